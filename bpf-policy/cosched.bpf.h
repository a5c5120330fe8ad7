/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: a co-scheduled phase, and a boost that serves
 * throughput, yield to the host's sleepers.
 *
 * A phase holds its VM's vCPU threads at SCHED_FIFO 1, so an ordinary host
 * thread woken on a CPU a phased vCPU holds would wait for the phase's end.
 * These programs only record. Per CPU (`cpus`): which registered thread
 * runs there, and which host threads were woken there and have not run
 * yet (the waiters). The sched_wakeup program, for a host thread placed
 * on a CPU whose phased vCPU runs, marks that vCPU YIELDED (once per phase,
 * compare-and-swap) and wakes the agent with a PVS_R_HOST_WAKE record. A
 * host thread woken before the phase (behind a CPU-bound thread, as an
 * ordinary wake-up often waits a time slice) is as urgent: the same record
 * goes out when a phased vCPU takes a CPU where a waiter is (sched_switch),
 * or when its phase starts while it runs there (the agent's
 * PVS_EV_PHASE_ON re-evaluation). The agent moves the vCPU out of its
 * phase (the waiters then run) and back in at the PVS_R_HOST_DONE record
 * the sched_switch program sends when a host thread leaves that CPU and no
 * waiter is left there, or at the phase's end. A CPU-bound host thread is
 * never woken (it is preempted and keeps its place on the run queue), so
 * it keeps its share of the period as before; only a sleeper's wake-up
 * cuts a phase.
 *
 * A vCPU's RT boost gives way the same way, at the same two points (a
 * host thread woken where the boosted vCPU runs, a boosted vCPU taking a
 * CPU where one waits), unless it serves the guest's latency: the boost
 * ends (PVS_R_HOST_YIELD), no throughput boost comes back for
 * PVS_HOST_HOLD_NS, and the vCPU joins the CPU's yields: the agent keeps
 * it at nice 19 until PVS_R_HOST_DONE, as it does a phased one.
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

/* Whether `tid`, woken at `at`, still counts as waiting at `now`. */
static __always_inline bool fresh(__u32 tid, __u64 at, __u64 now)
{
	return tid && now >= at && now - at <= PVS_WAIT_FRESH_NS;
}

/* Whether a host thread woken on CPU entry `c` still waits there. The
 * words are read without a lock (wake-ups onto a CPU run on any CPU): a
 * race costs at most one late or one needless yield. */
static __always_inline bool any_waiter(struct pvs_cpu *c, __u64 now)
{
	for (int i = 0; i < PVS_CPU_WAITERS; i++)
		if (fresh(READ_ONCE(c->wait_tid[i]), READ_ONCE(c->wait_at[i]), now))
			return true;
	return false;
}

/* Host thread `tid` was woken onto CPU entry `c` at `now`: its own slot if
 * it has one, else a free or stale one, else the one woken first. */
static __always_inline void add_waiter(struct pvs_cpu *c, __u32 tid, __u64 now)
{
	__u64 first = ~0ULL;
	int pick = 0;

	for (int i = 0; i < PVS_CPU_WAITERS; i++) {
		__u32 t = READ_ONCE(c->wait_tid[i]);
		__u64 at = READ_ONCE(c->wait_at[i]);

		if (t == tid) {
			pick = i;
			break;
		}
		if (!fresh(t, at, now))
			at = 0;
		if (at < first) {
			first = at;
			pick = i;
		}
	}
	WRITE_ONCE(c->wait_at[pick], now);
	WRITE_ONCE(c->wait_tid[pick], tid);
}

/* `next_tid` takes the CPU of entry `c`: it waits no more; none waits on a
 * CPU that goes idle (next_tid 0). */
static __always_inline void waiter_ran(struct pvs_cpu *c, __u32 next_tid)
{
	for (int i = 0; i < PVS_CPU_WAITERS; i++) {
		__u32 t = READ_ONCE(c->wait_tid[i]);

		if (t && (t == next_tid || !next_tid))
			WRITE_ONCE(c->wait_tid[i], 0);
	}
}

/* Whether `v`, one of a CPU's yields outside any co-scheduling phase (its
 * boost gave way: boost_gives_way), is still unboosted: the agent keeps it
 * below the host's threads until they ran. (Its boost_reason does not
 * say: a re-evaluation that finds the boost held rewrites it.) */
static __always_inline bool gave_way(const struct pvs_vcpu *v)
{
	return READ_ONCE(v->phase) == PVS_PHASE_FREE && READ_ONCE(v->boost) == PVSCHED_BOOST_NONE;
}

/* The vCPU of `vcpus` key `key` + 1 was out of its phase, or below the
 * host's threads after its boost gave way, for a CPU's waiters, and that
 * is over: the agent puts it back in its phase, or at its baseline. */
static __always_inline void end_yield(__u32 key, __u64 now)
{
	struct pvs_vcpu *y;

	if (!key)
		return;
	key -= 1;
	y = bpf_map_lookup_elem(&vcpus, &key);
	if (y && (READ_ONCE(y->phase) == PVS_PHASE_YIELDED || gave_way(y)))
		emit_reason(y, PVS_EV_SWITCH_OUT, PVS_R_HOST_DONE, now, 0);
}

/*
 * A host thread left the CPU of entry `c`: if vCPUs are out of their phase
 * for this CPU's waiters and none is left, the agent is told to put them
 * back.
 */
static __always_inline void host_thread_left(struct pvs_cpu *c)
{
	bool any = false;
	__u64 now;

	for (int i = 0; i < PVS_CPU_YIELDS; i++)
		any |= READ_ONCE(c->yield_keys[i]) != 0;
	if (!any)
		return;
	now = bpf_ktime_get_ns();
	if (any_waiter(c, now))
		return;
	/* Exchanged, so a vCPU is put back once even if host threads leave
	 * this CPU's record on two CPUs at once. */
	for (int i = 0; i < PVS_CPU_YIELDS; i++)
		end_yield(__sync_lock_test_and_set(&c->yield_keys[i], 0), now);
}

/* The vCPU of `vcpus` key `key` leaves its phase for CPU entry `c`'s
 * waiters: it is added to the entry's yields (its own, else a free one,
 * else the first, whose vCPU is then put back in its phase). */
static __always_inline void add_yield(struct pvs_cpu *c, __u32 key, __u64 now)
{
	for (int i = 0; i < PVS_CPU_YIELDS; i++)
		if (READ_ONCE(c->yield_keys[i]) == key + 1)
			return;
	for (int i = 0; i < PVS_CPU_YIELDS; i++)
		if (__sync_val_compare_and_swap(&c->yield_keys[i], 0, key + 1) == 0)
			return;
	end_yield(__sync_lock_test_and_set(&c->yield_keys[0], key + 1), now);
}

/* A switch between two host threads: a waiter may have got the CPU, and
 * a yield may be over (the CPU's running thread is already none). */
static __always_inline void cpu_switch_host(__u32 next_tid)
{
	struct pvs_cpu *c = this_cpu_entry();

	if (!c)
		return;
	/* First: a waiter that takes the CPU now keeps the yield until it
	 * leaves the CPU itself. */
	host_thread_left(c);
	waiter_ran(c, next_tid);
}

/*
 * The vCPU `v` (`vcpus` key `key`), in its phase, is the running thread of
 * CPU entry `c` and a host thread waits there: the vCPU leaves the phase
 * (once; while it is out, later waiters only keep it out). Returns 1 if
 * this call moved it out.
 */
static __always_inline int leave_phase(struct pvs_cpu *c, struct pvs_vcpu *v, __u32 key, __u64 now)
{
	if (READ_ONCE(v->phase) != PVS_PHASE_ON ||
	    __sync_val_compare_and_swap(&v->phase, PVS_PHASE_ON, PVS_PHASE_YIELDED) != PVS_PHASE_ON)
		return 0;
	add_yield(c, key, now);
	STAT_INC(phase_yields);
	emit_reason(v, PVS_EV_WAKEUP, PVS_R_HOST_WAKE, now, 0);
	return 1;
}

/* The vCPU `v` (key `key`) runs on CPU entry `c`: in its phase, with a
 * waiter there, it leaves the phase. Returns 1 if it did. (The phase is
 * read first: most switches are of vCPUs outside a phase, and they skip
 * the scan of the waiters.) */
static __always_inline int yield_to_waiter(struct pvs_cpu *c, struct pvs_vcpu *v, __u32 key,
					   __u64 now)
{
	if (READ_ONCE(v->phase) != PVS_PHASE_ON || !any_waiter(c, now))
		return 0;
	return leave_phase(c, v, key, now);
}

/*
 * The vCPU `v` (`vcpus` key `key`) runs on CPU entry `c` where a host
 * thread waits (woken there now, or before `v` took the CPU: an RT thread
 * preempted on another CPU is pushed to one that runs an ordinary thread),
 * and holds an RT boost: unless the boost serves the guest's latency
 * (latency_boost()), it ends, and the vCPU gets no throughput RT boost for
 * PVS_HOST_HOLD_NS (host_hold_until), so the woken thread runs now rather
 * than after the boost (up to max_boost_us). The vCPU is added to the
 * CPU's yields, as a phase's is: the agent keeps it below the host's
 * threads (nice 19) until none waits there (PVS_R_HOST_DONE), because at
 * its baseline the kernel would often run it first, for up to a tick, as
 * the task it just moved back to the fair class.
 * A critical section's, a directed yield's or a waiting sender's boost
 * raises throughput, which a host sleeper's wake-up must not pay for; a
 * CPU-bound host thread is never woken and so never ends one. The hold is
 * renewed at every such wake-up while it lasts, or the boost would come
 * back at the vCPU's next event and preempt the next woken thread.
 */
static __always_inline void boost_gives_way(struct pvs_cpu *c, struct pvs_vcpu *v, __u32 key,
					    __u64 now)
{
	__u32 vm_id = READ_ONCE(v->vm_id), kind = READ_ONCE(v->boost);
	__u64 until = now + PVS_HOST_HOLD_NS, held = READ_ONCE(v->host_hold_until);
	struct pvs_vm *vm;

	if (held > now && held < until)
		WRITE_ONCE(v->host_hold_until, until);
	if (kind != PVSCHED_BOOST_RT || latency_boost(READ_ONCE(v->boost_reason)))
		return;
	vm = bpf_map_lookup_elem(&vms, &vm_id);
	if (!vm)
		return;
	charge(v, vm, now);
	if (held < until)
		WRITE_ONCE(v->host_hold_until, until);
	/* v may be re-evaluated on another CPU right now: the hold is stored,
	 * then a fence, then the boost is read; apply_boost() stores the
	 * boost, fences, then reads the hold. So either that CPU sees the
	 * hold or this one sees its boost. */
	full_fence(v->fence);
	if (READ_ONCE(v->boost) == PVSCHED_BOOST_NONE)
		return;
	WRITE_ONCE(v->boost, PVSCHED_BOOST_NONE);
	WRITE_ONCE(v->boost_prio, 0);
	v->boost_reason = PVS_R_HOST_YIELD;
	STAT_INC(unboosts);
	emit(v, PVS_EV_WAKEUP, now, 0);
	publish(v, vm);
	add_yield(c, key, now);
}

/* A switch from or to a registered thread (`out` and `in`, NULL for a
 * host thread): `in` is the CPU's running thread from now on. */
static __always_inline void cpu_switch(const struct pvs_vcpu *out, __u32 next_tid,
				       struct pvs_vcpu *in, __u64 now)
{
	struct pvs_cpu *c = this_cpu_entry();
	__u32 key;

	if (!c)
		return;
	key = in ? vcpu_key(in->vm_id, in->index) : 0;
	WRITE_ONCE(c->run_key, in ? key + 1 : 0);
	if (!out)
		host_thread_left(c);
	waiter_ran(c, next_tid);
	if (!in)
		return;
	yield_to_waiter(c, in, key, now);
	/* The boost is read first: most switches are of unboosted vCPUs. */
	if (READ_ONCE(in->boost) == PVSCHED_BOOST_RT && any_waiter(c, now))
		boost_gives_way(c, in, key, now);
}

/*
 * Host thread `p` (not a registered one) was woken onto a run queue: it
 * waits there until it runs. If the CPU's running thread is a vCPU in its
 * co-scheduled phase, that vCPU leaves the phase for it; if it holds a
 * throughput boost, the boost ends (boost_gives_way).
 */
static __always_inline void host_wakeup(struct task_struct *p)
{
	__u32 cpu, key;
	struct pvs_cpu *c;
	struct pvs_vcpu *v;
	__u64 now;

	/* An RT thread above the phase preempts it anyway. */
	if (p->prio < PVS_PHASE_KPRIO)
		return;
	cpu = task_cpu_of(p);
	c = bpf_map_lookup_elem(&cpus, &cpu);
	if (!c)
		return;
	now = bpf_ktime_get_ns();
	add_waiter(c, (__u32)p->pid, now);
	key = READ_ONCE(c->run_key);
	if (!key)
		return;
	key -= 1;
	v = bpf_map_lookup_elem(&vcpus, &key);
	if (!v || !READ_ONCE(v->tid))
		return;
	leave_phase(c, v, key, now);
	boost_gives_way(c, v, key, now);
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
