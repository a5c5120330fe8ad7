/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * pvsched BPF policy <-> userspace interface: the one C definition of the
 * records the BPF program and the agent exchange (per-VM configuration,
 * per-vCPU state, decision records, statistics, synthetic test events).
 * crates/pvsched-policy/src/intf.rs (and event.rs's Decision) mirrors it
 * and crates/pvsched-policy/tests/intf_layout.rs compares every size and
 * offset with this file compiled by the C compiler.
 *
 * Include after the ABI header (pvsched_abi.h) which provides __u32 etc.
 */
#ifndef PVSCHED_BPF_INTF_H
#define PVSCHED_BPF_INTF_H

/* Limits. A VM's region is one 16 KiB map (element vm_id of `regions`). */
#define PVS_MAX_VMS 64
#define PVS_MAX_VCPUS_PER_VM 64
/* Non-vCPU threads of a VM (QEMU's main loop, I/O threads) per VM. */
#define PVS_MAX_EMULATORS 4
#define PVS_REGION_STRIDE 16384
/* Threads (vCPUs, then emulator threads) of one VM in the `vcpus` array. */
#define PVS_THREADS_PER_VM (PVS_MAX_VCPUS_PER_VM + PVS_MAX_EMULATORS)
#define PVS_MAX_TIDS (PVS_MAX_VMS * PVS_THREADS_PER_VM)
/* gid = vm_id << PVS_GID_SHIFT | index: vCPU slot index 0..nr_vcpus-1, then
 * the VM's emulator threads at nr_vcpus..nr_vcpus+nr_emulators-1. */
#define PVS_GID_SHIFT 10
/* The re-evaluation entry's gid for "every thread of every active VM". */
#define PVS_GID_ALL 0xffffffffU
/* The re-evaluation entry's `now` for "the policy's own clock when it runs"
 * (bpf_ktime_get_ns()): a time the caller read before the system call can
 * be older than a window another CPU has just started. */
#define PVS_NOW_CLOCK 0
/* Entries of the `tid_hint` prefilter (a power of two). */
#define PVS_TID_HINTS 4096

/* Region modes (pvs_vm.mode). */
#define PVS_MODE_NONE 0	  /* no region: only halt/yield boosts */
#define PVS_MODE_DEVICE 1 /* region = the map at element vm_id of `regions` */
#define PVS_MODE_GUEST 2  /* region slots at pvs_vcpu.slot_addr (VMM address) */

/* pvs_caps.kick_pairs. */
#define PVS_KICK_OFF 0
#define PVS_KICK_ON 1
#define PVS_KICK_AUTO 2 /* a guest without F_WAIT_ON, from a boosted sender */

/* Internal vCPU run states (pvs_vcpu.state). */
#define PVS_ST_UNKNOWN 0
#define PVS_ST_RUNNING 1
#define PVS_ST_PREEMPTED 2
#define PVS_ST_HALTED 3
#define PVS_ST_WOKEN 4 /* woken from a halt, not yet on a CPU */

/* Event kinds (pvs_decision.event, pvs_reeval args[0]). */
#define PVS_EV_SWITCH_OUT 1 /* a = 1 if preempted (still runnable), 0 if it blocked */
#define PVS_EV_SWITCH_IN 2
#define PVS_EV_WAKEUP 3
#define PVS_EV_VCPU_WAKEUP 4
#define PVS_EV_IPI 5	    /* a = dest_id, b = icr_low */
#define PVS_EV_USER_EXIT 6  /* a = exit reason */
#define PVS_EV_TICK 7	    /* agent timer or device KICK: re-evaluate */
#define PVS_EV_EXIT 8	    /* the registered thread exits (sched_process_exit) */
#define PVS_EV_KICK 9	    /* this vCPU's thread woke sibling vCPU a (slot index) */
#define PVS_EV_PHASE_ON 10  /* reeval only: VM gid>>PVS_GID_SHIFT entered its phase, a = CPUs */
#define PVS_EV_MAX 11

/* Decision reasons. */
#define PVS_R_NONE 0	   /* the guest no longer asks */
#define PVS_R_CS 1	   /* kernel critical section (kern_cs) */
#define PVS_R_RT_TASK 2	   /* guest runs an RT task */
#define PVS_R_NICE_TASK 3  /* guest runs a high-priority (negative nice) task */
#define PVS_R_HALT 4	   /* latency-sensitive vCPU: its waking interrupt must preempt batch work */
#define PVS_R_YIELD 5	   /* target of a waiting sender's directed-yield slot */
#define PVS_R_MAX_BOOST 6  /* throttled: continuous boost exceeded max_boost_ns */
#define PVS_R_BUDGET 7	   /* throttled: budget of the window used up */
#define PVS_R_THROTTLED 8  /* its waiting pair was throttled (unit throttle) */
#define PVS_R_EXITED 9	   /* the thread exited: its TID is forgotten, nothing to restore */
#define PVS_R_VM_BUDGET 10 /* throttled: the VM's budget of the window used up (vm_budget_ns) */
/* Co-scheduling records (the thread's boost is unchanged): */
#define PVS_R_HOST_WAKE 11 /* a host thread waits for the CPU this phased vCPU holds: leave it */
#define PVS_R_HOST_DONE 12 /* no woken host thread waits there any more: the phase again */
/* A host thread woken on the CPU this vCPU holds with an RT boost that
 * serves throughput (a critical section, a directed yield, a waiting
 * sender's): the boost ends, and no such boost comes back for
 * PVS_HOST_HOLD_NS (pvs_vcpu.host_hold_until; latency boosts still do). */
#define PVS_R_HOST_YIELD 13

/* pvs_vcpu.phase: the agent writes FREE, ON and OFF as it moves the thread
 * between its VM's co-scheduled phases; the policy changes ON to YIELDED
 * (once, compare-and-swap) when a host thread wakes on the CPU the thread
 * holds, or was woken there and still waits when the thread takes the CPU
 * or enters its phase on it, and the agent then moves it out of the phase
 * until a host thread leaves that CPU with no woken one still waiting there
 * (PVS_R_HOST_DONE) or the phase ends. */
#define PVS_PHASE_FREE 0
#define PVS_PHASE_ON 1
#define PVS_PHASE_OFF 2
#define PVS_PHASE_YIELDED 3
/* The SCHED_FIFO priority of a co-scheduled phase (the lowest): a host
 * thread whose kernel priority (task_struct.prio) is at or below this one's
 * cannot preempt a phase and is what a phase yields to. */
#define PVS_COSCHED_RT_PRIO 1
/* CPUs the `cpus` array covers; a host thread woken on a CPU above them is
 * not seen (it waits for the phase's end, as without the array). */
#define PVS_MAX_CPUS 1024
/* A host thread woken onto a CPU longer ago than this and not run there
 * since is taken to have moved to another CPU (a wake-up's record on the
 * CPU it left is not cleared): a vCPU entering its phase there does not
 * leave it for that thread. Two of the host's time slices (EEVDF's base
 * slice is 0.75 ms times 1 + log2 of the CPUs, at most 3 ms at 8 CPUs and
 * more) is as long as a woken thread waits behind a CPU-bound one. */
#define PVS_WAIT_FRESH_NS 6000000ULL
/* How long a vCPU whose throughput boost ended for a woken host thread
 * (PVS_R_HOST_YIELD) gets no new boost. The vCPU is then an ordinary
 * thread beside the woken one, and the host's scheduler may run it first
 * for up to two of its time slices (EEVDF places a thread back in the fair
 * class with the lag it left with): a hold shorter than that let the vCPU
 * take its boost back while the woken thread still waited (1 ms: one wake-up
 * in ten waited ~50 ms, until the kernel's fair server ran it). As
 * PVS_WAIT_FRESH_NS, and short against the boosts it cuts (max_boost_us,
 * 20 ms by default). */
#define PVS_HOST_HOLD_NS 6000000ULL
/* Woken host threads a CPU's record holds at once; a fifth replaces the
 * one woken first (which then waits for the phase's end, as without the
 * record). */
#define PVS_CPU_WAITERS 4
/* vCPUs a CPU's record holds as out of their phase for its waiters; a
 * fifth puts the one in the first entry back in its phase. */
#define PVS_CPU_YIELDS 4

/* Per-VM configuration: admin caps and policy knobs. */
struct pvs_caps {
	__u32 allow_rt;	     /* 0: RT requests become nice boosts at nice_floor */
	__u32 max_rt_prio;   /* highest SCHED_FIFO priority granted (1..99) */
	__s32 nice_floor;    /* lowest nice granted (-20..19) */
	__u32 cs_rt_prio;    /* RT priority for a kernel critical section */
	__u32 halt_kind;     /* PVSCHED_BOOST_* held by a latency-sensitive vCPU */
	__s32 halt_prio;     /* its RT priority or nice */
	__u32 yield_kind;    /* PVSCHED_BOOST_* for a directed-yield target */
	__s32 yield_prio;    /* its RT priority or nice */
	__u64 max_boost_ns;  /* longest boosted on-CPU run without a halt; 0 = unlimited */
	__u64 throttle_ns;   /* no boost for this long after max_boost_ns */
	__u64 budget_ns;     /* boosted on-CPU time per window; 0 = unlimited */
	__u64 window_ns;     /* budget window */
	__u64 ipi_window_ns; /* how long an IPI pair stays confirmed */
	__u64 halt_hold_ns;  /* latency-sensitive this long after the guest last asked */
	__u32 halt_always;   /* every vCPU is latency-sensitive */
	__u32 kick_pairs;    /* PVS_KICK_*: when a sibling vCPU's wakeup confirms a pair */
	__u64 vm_budget_ns;  /* boosted on-CPU time of all the VM's threads per window; U64_MAX = unlimited */
};

/* Per-VM record (`vms` array, key = vm_id). */
struct pvs_vm {
	__u32 active;
	__u32 nr_vcpus;
	__u32 mode; /* PVS_MODE_* */
	__u32 wait_on_enabled; /* honour slot.wait_on (PVSCHED_F_WAIT_ON) */
	struct pvs_caps caps;
	__u32 nr_emulators; /* emulator threads after the vCPUs */
	__u32 lock_wait_enabled; /* honour wait_on = PVSCHED_WAIT_ANY (F_LOCK_WAIT) */
	__u64 ls_until;	    /* some vCPU is latency-sensitive until (BPF-owned) */
	/* The VM's budget window (BPF-owned; a caps update keeps it). */
	__u64 window_start;
	__u64 budget_used;  /* boosted on-CPU ns of all its threads in this window */
};

/* Per-thread state (`vcpus` array, key = vm_id * PVS_THREADS_PER_VM + index). */
struct pvs_vcpu {
	__u32 tid;
	__u32 vm_id;
	__u32 index;
	__u32 state;	    /* PVS_ST_* */
	__u64 slot_addr;    /* PVS_MODE_GUEST: VMM address of the slot */
	/* last valid guest request, after caps */
	__u32 req_kind;
	__s32 req_prio;
	__u32 req_reason;
	__u32 wait_on;	    /* last valid guest wait_on */
	/* applied boost */
	__u32 boost;	    /* PVSCHED_BOOST_* */
	__s32 boost_prio;
	__u32 boost_reason;
	__u32 throttled;    /* 1 while throttled */
	__u64 acct_ns;      /* boosted on-CPU time is charged up to this time */
	__u64 cont_ns;      /* boosted on-CPU ns since the vCPU last blocked or halted */
	__u64 window_start;
	__u64 budget_used;  /* boosted on-CPU ns in this window */
	__u64 throttled_until;
	__u64 ls_until;     /* latency-sensitive (holds the halt boost) until */
	/* IPI-aware directed yield */
	__u32 last_ipi_target; /* slot index + 1, or 0 */
	__u32 yield_slot;      /* slot index + 1, or 0 */
	__u64 last_ipi_ns;
	__u32 yield_boosting;  /* target boosted on our behalf (we wait on it), + 1 */
	__u32 fence;	       /* word of full_fence()'s no-op compare-and-swap */
	__u64 yield_mask;      /* senders waiting on us (bit = sender index) */
	/* counters */
	__u64 boosts;
	__u64 throttles;
	__u64 boosted_ns;      /* boosted on-CPU ns */
	__u64 ipis;
	__u64 slot_hits;
	__u32 guest_idle;      /* the guest ran its idle task at the last slot read */
	__u32 last_kick_target; /* slot index + 1 of the vCPU this one last kicked, or 0 */
	__u64 last_kick_ns;
	__s32 ls_prio;	       /* RT priority of the request that set ls_until (0: not RT) */
	__u32 phase;	       /* PVS_PHASE_* (agent-written; ON -> YIELDED by the policy) */
	/* How much its vCPUs wait for each other (what co-scheduling serves):
	 * halts of this vCPU while a sibling vCPU was preempted, and wake-ups
	 * of its thread by a sibling vCPU's thread (an IPI to a halted vCPU),
	 * and how long those halts lasted: from the halt to the wake-up. */
	__u64 sync_halts;
	__u64 sib_wakes;
	__u64 sync_wait_ns;
	__u64 sync_since;   /* when the current such halt began, 0 = none */
	/* No throughput RT boost before this time: a host thread was woken
	 * where the vCPU ran (boost_gives_way). Not throttled_until, which
	 * would hold the latency boosts too. */
	__u64 host_hold_until;
	/* Agent-written: the guest's wait_on is not honoured for this vCPU
	 * (its VM's `wait_on` is "auto" and it has more vCPUs than the CPUs
	 * their threads may run on, where the yield takes a working
	 * sibling's CPU). */
	__u32 wait_on_off;
	__u32 pad1;
};

/* Per-CPU record (`cpus` array, key = CPU number), written by the scheduler
 * programs running on that CPU and read by a wakeup on any CPU. */
struct pvs_cpu {
	__u32 run_key;	 /* `vcpus` key + 1 of the registered thread on the CPU, 0 = none */
	/* `vcpus` keys + 1 of the threads out of their phase for this CPU's
	 * waiters (0 = free): several, since a vCPU out of its phase is an
	 * ordinary thread the kernel may move away, and a sibling that then
	 * takes the CPU while the waiters still wait leaves its phase too. */
	__u32 yield_keys[PVS_CPU_YIELDS];
	/* Host threads woken onto the CPU that have not run there since
	 * (0 = free), and when each was woken (bpf_ktime_get_ns). */
	__u32 wait_tid[PVS_CPU_WAITERS];
	__u32 pad0;
	__u64 wait_at[PVS_CPU_WAITERS];
};

/* Decision record (`decisions` ring buffer): sent when a thread's boost
 * changes, and, without waking the agent, when a throttle is extended or a
 * boosted vCPU starts or stops waiting on a target, so the record stream is
 * a complete trace of boosts, throttles and waiting pairs. */
struct pvs_decision {
	__u64 ts;     /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) */
	__u32 tid;
	__u32 gid;
	__u32 kind;   /* PVSCHED_BOOST_* to apply now (NONE = restore baseline) */
	__s32 prio;   /* RT priority or nice */
	__u32 reason; /* PVS_R_* */
	__u32 event;  /* PVS_EV_* that caused it */
	__u64 throttled_until; /* no boost before this time */
	__u32 waits_on;	       /* slot + 1 of the target it waits on (boosted on its behalf), 0 = none */
	__u32 pad0;
};

/* Element tid & (PVS_TID_HINTS - 1) of the `tid_hint` prefilter: how many
 * registered threads have a tid there and, while that is exactly one, which
 * (its `vcpus` key), so the common event needs no hash lookup. The agent
 * writes it with plain copies: the policy takes `key` only after the element
 * it names says it is thread `tid`, and falls back to `tids` otherwise. */
struct pvs_tid_hint {
	__u32 count;
	__u32 tid; /* the one registered thread here, 0 while count != 1 */
	__u32 key; /* its `vcpus` key: vm_id * PVS_THREADS_PER_VM + index */
	__u32 pad0;
};

/* Tracepoint programs that take a prefilter, for pvs_stats.full_runs. */
#define PVS_PROG_SWITCH 0
#define PVS_PROG_WAKEUP 1
#define PVS_PROG_VCPU_WAKEUP 2
#define PVS_PROG_USER_EXIT 3
#define PVS_PROG_IPI 4
#define PVS_PROG_MAX 5

/* APIC IDs below this are looked up in the `apic_fast` array, the others in
 * the `apics` hash. */
#define PVS_APIC_FAST 256

/* Per-CPU statistics (`stats` per-CPU array, key 0). */
struct pvs_stats {
	__u64 events[PVS_EV_MAX];
	__u64 decisions;
	__u64 dropped;	     /* ring buffer full */
	__u64 boosts;
	__u64 unboosts;
	__u64 throttles;
	__u64 ipi_pairs;
	__u64 slot_hits;
	__u64 torn_reads;    /* guest half read while the guest wrote it */
	__u64 read_errors;   /* guest-region reads that failed */
	__u64 publish_busy;  /* host half left to a publish running on another CPU */
	/* Runs of each PVS_PROG_* program past its prefilter (a registered
	 * thread's event): the others returned after the prefilter. */
	__u64 full_runs[PVS_PROG_MAX];
	__u64 phase_yields;  /* phased vCPUs moved out of their phase for a host thread */
};

#endif /* PVSCHED_BPF_INTF_H */
