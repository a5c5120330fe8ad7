/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: a co-scheduled phase yields to the host's sleepers.
 *
 * A phase holds its VM's vCPU threads at SCHED_FIFO 1, so an ordinary host
 * thread woken on a CPU a phased vCPU holds would wait for the phase's end.
 * These programs only record: the sched_switch program notes which
 * registered thread runs on each CPU (`cpus`) and which host thread woken
 * there has not run yet; the sched_wakeup program, for a host thread placed
 * on a CPU whose phased vCPU runs, marks that vCPU YIELDED (once per phase,
 * compare-and-swap) and wakes the agent with a PVS_R_HOST_WAKE record. A
 * host thread woken before the phase (behind a CPU-bound thread, as an
 * ordinary wake-up often waits a time slice) is as urgent: the same record
 * goes out when a phased vCPU takes a CPU where such a thread waits
 * (sched_switch), or when its phase starts while it runs there (the
 * agent's PVS_EV_PHASE_ON re-evaluation). The agent moves the vCPU out of
 * its phase (the host thread then runs) and back in at the PVS_R_HOST_DONE
 * record the sched_switch program sends when that host thread leaves the
 * CPU, or at the phase's end. A CPU-bound host thread is never woken (it
 * is preempted and keeps its place on the run queue), so it keeps its
 * share of the period as before; only a sleeper's wake-up cuts a phase.
 */
#ifndef PVSCHED_COSCHED_BPF_H
#define PVSCHED_COSCHED_BPF_H

/* Kernel priority (task_struct.prio) of SCHED_FIFO priority r: 99 - r. A
 * woken thread at or below the phase's priority waits for it. */
#define PVS_PHASE_KPRIO (99 - PVS_COSCHED_RT_PRIO)

/* task_struct.cpu of kernels that had it outside thread_info. */
struct task_struct___cpu {
	unsigned int cpu;
} __attribute__((preserve_access_index));

/* The CPU whose run queue `p` is on (task_cpu()). */
static __always_inline __u32 task_cpu_of(struct task_struct *p)
{
	if (bpf_core_field_exists(p->thread_info.cpu))
		return BPF_CORE_READ(p, thread_info.cpu);
	return BPF_CORE_READ((struct task_struct___cpu *)p, cpu);
}

/* This CPU's entry of `cpus`. */
static __always_inline struct pvs_cpu *this_cpu_entry(void)
{
	__u32 cpu = bpf_get_smp_processor_id();

	return bpf_map_lookup_elem(&cpus, &cpu);
}

/*
 * On CPU entry `c`, `prev_tid` leaves the CPU: when it is the host thread a
 * phased vCPU left the CPU for, the agent is told to put that vCPU back in
 * its phase.
 */
static __always_inline void host_thread_left(struct pvs_cpu *c, __u32 prev_tid)
{
	struct pvs_vcpu *y;
	__u32 key;

	if (!prev_tid || READ_ONCE(c->yield_tid) != prev_tid)
		return;
	key = READ_ONCE(c->yield_key);
	WRITE_ONCE(c->yield_tid, 0);
	if (!key)
		return;
	key -= 1;
	y = bpf_map_lookup_elem(&vcpus, &key);
	if (y && READ_ONCE(y->phase) == PVS_PHASE_YIELDED)
		emit_reason(y, PVS_EV_SWITCH_OUT, PVS_R_HOST_DONE, bpf_ktime_get_ns(), 0);
}

/* On CPU entry `c`, `next_tid` takes the CPU: a host thread woken there
 * waits no more once it runs, and none waits on a CPU that goes idle. */
static __always_inline void waiter_ran(struct pvs_cpu *c, __u32 next_tid)
{
	__u32 w = READ_ONCE(c->wait_tid);

	if (w && (w == next_tid || !next_tid))
		WRITE_ONCE(c->wait_tid, 0);
}

/* A switch between two host threads: only the end of a yield can be due
 * (the CPU's running thread is already none). */
static __always_inline void cpu_switch_host(__u32 prev_tid, __u32 next_tid)
{
	struct pvs_cpu *c = this_cpu_entry();

	if (!c)
		return;
	waiter_ran(c, next_tid);
	host_thread_left(c, prev_tid);
}

/*
 * The vCPU `v` (`vcpus` key `key`), in its phase, is the running thread of
 * CPU entry `c`: it leaves the phase for host thread `tid` (the first host
 * thread of the phase to want the CPU sends the record; a later one while
 * the vCPU is out only becomes the host thread whose leaving ends the
 * yield).
 */
static __always_inline void leave_phase_for(struct pvs_cpu *c, struct pvs_vcpu *v, __u32 key,
					    __u32 tid)
{
	__u32 phase = READ_ONCE(v->phase);

	if (phase == PVS_PHASE_YIELDED) {
		if (READ_ONCE(c->yield_key) == key + 1)
			WRITE_ONCE(c->yield_tid, tid);
		return;
	}
	if (phase != PVS_PHASE_ON ||
	    __sync_val_compare_and_swap(&v->phase, PVS_PHASE_ON, PVS_PHASE_YIELDED) != PVS_PHASE_ON)
		return;
	WRITE_ONCE(c->yield_key, key + 1);
	WRITE_ONCE(c->yield_tid, tid);
	STAT_INC(phase_yields);
	emit_reason(v, PVS_EV_WAKEUP, PVS_R_HOST_WAKE, bpf_ktime_get_ns(), 0);
}

/* The vCPU `v` (key `key`) runs on CPU entry `c` in its phase: if a host
 * thread woken there has waited since (and not too long ago to still be
 * queued there), the vCPU leaves its phase for it. The two words are read
 * without a lock: a wake-up racing with this read costs at most one late
 * or one needless yield. */
static __always_inline int yield_to_waiter(struct pvs_cpu *c, struct pvs_vcpu *v, __u32 key,
					   __u64 now)
{
	__u32 tid = READ_ONCE(c->wait_tid);
	__u64 at = READ_ONCE(c->wait_at);

	if (!tid || tid == READ_ONCE(v->tid) || READ_ONCE(v->phase) != PVS_PHASE_ON ||
	    now < at || now - at > PVS_WAIT_FRESH_NS)
		return 0;
	leave_phase_for(c, v, key, tid);
	return 1;
}

/* A switch from or to a registered thread: `in` (NULL for a host thread)
 * is the CPU's running thread from now on. */
static __always_inline void cpu_switch(__u32 prev_tid, __u32 next_tid, struct pvs_vcpu *in,
				       __u64 now)
{
	struct pvs_cpu *c = this_cpu_entry();
	__u32 key;

	if (!c)
		return;
	key = in ? vcpu_key(in->vm_id, in->index) : 0;
	WRITE_ONCE(c->run_key, in ? key + 1 : 0);
	waiter_ran(c, next_tid);
	host_thread_left(c, prev_tid);
	if (in)
		yield_to_waiter(c, in, key, now);
}

/*
 * Host thread `p` (not a registered one) was woken onto a run queue: it
 * waits there until it runs. If the CPU's running thread is a vCPU in its
 * co-scheduled phase, that vCPU leaves the phase for it.
 */
static __always_inline void host_wakeup(struct task_struct *p)
{
	__u32 cpu, key, tid = (__u32)p->pid;
	struct pvs_cpu *c;
	struct pvs_vcpu *v;

	/* An RT thread above the phase preempts it anyway. */
	if (p->prio < PVS_PHASE_KPRIO)
		return;
	cpu = task_cpu_of(p);
	c = bpf_map_lookup_elem(&cpus, &cpu);
	if (!c)
		return;
	WRITE_ONCE(c->wait_at, bpf_ktime_get_ns());
	WRITE_ONCE(c->wait_tid, tid);
	key = READ_ONCE(c->run_key);
	if (!key)
		return;
	key -= 1;
	v = bpf_map_lookup_elem(&vcpus, &key);
	if (!v || !READ_ONCE(v->tid))
		return;
	leave_phase_for(c, v, key, tid);
}

struct phase_on_ctx {
	__u64 now;
	__u32 vm_id;
	__u32 yields;
};

/* bpf_loop callback: CPU `cpu`, if a vCPU of the VM runs there. */
static long phase_on_cb(__u32 cpu, void *data)
{
	struct phase_on_ctx *x = data;
	struct pvs_cpu *c = bpf_map_lookup_elem(&cpus, &cpu);
	struct pvs_vcpu *v;
	__u32 key;

	if (!c)
		return 1;
	key = READ_ONCE(c->run_key);
	if (!key)
		return 0;
	key -= 1;
	v = bpf_map_lookup_elem(&vcpus, &key);
	if (v && v->vm_id == x->vm_id)
		x->yields += yield_to_waiter(c, v, key, x->now);
	return 0;
}

/* VM `vm_id` has just entered its phase (the agent's re-evaluation, after
 * the system calls that put its vCPUs at FIFO): a vCPU that was already
 * running on a CPU took no switch, so a host thread woken there before is
 * checked here. Returns how many vCPUs left the phase. */
static __always_inline __u32 phase_on(__u32 vm_id, __u64 cpus_to_scan)
{
	struct phase_on_ctx x = { .now = bpf_ktime_get_ns(), .vm_id = vm_id };

	bpf_loop(cpus_to_scan < PVS_MAX_CPUS ? cpus_to_scan : PVS_MAX_CPUS, phase_on_cb, &x, 0);
	return x.yields;
}

#endif
