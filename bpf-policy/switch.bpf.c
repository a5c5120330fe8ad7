/* SPDX-License-Identifier: GPL-2.0 */
/* pvsched BPF policy: scheduler events (sched_switch, sched_wakeup,
 * sched_process_exit, sched_process_exec). */

SEC("tp_btf/sched_switch")
int BPF_PROG(pvs_sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	/* The tracepoint runs in __schedule() before the switch: current is
	 * prev, so its pid is the current tid with no helper call. */
	__u32 cur = (__u32)prev->pid;
	struct pvs_vcpu *out = vcpu_by_tid(cur), *in = vcpu_by_tid((__u32)next->pid);
	__u64 now;

	/* Most switches on a host are of other threads: no clock read. */
	if (!out && !in) {
		cpu_switch_host((__u32)next->pid);
		return 0;
	}
	count_full(PVS_PROG_SWITCH);
	now = bpf_ktime_get_ns();
	cpu_switch(out, (__u32)next->pid, in, now);
	if (out)
		/* Still runnable (TASK_RUNNING) = preempted; else it blocked. */
		handle_event(out, PVS_EV_SWITCH_OUT, preempt || prev_state == 0, 0, now, cur);
	if (in)
		handle_event(in, PVS_EV_SWITCH_IN, 0, 0, now, cur);
	return 0;
}

/*
 * The registered thread `v` is gone: forget it before any new thread can be
 * given its TID. From now on no event of that TID reaches the policy
 * (vcpu_by_tid checks v->tid) and no record names it. The agent learns it
 * from the PVS_R_EXITED record (and, level-triggered, from v->tid == 0 at
 * reconciliation) and never calls sched_setattr on the TID again.
 */
static __always_inline void forget_thread(struct pvs_vcpu *v)
{
	v->boost = PVSCHED_BOOST_NONE;
	v->boost_prio = 0;
	v->boost_reason = PVS_R_EXITED;
	emit(v, PVS_EV_EXIT, bpf_ktime_get_ns(), 0);
	WRITE_ONCE(v->tid, 0);
}

/* A registered thread exits: the tracepoint fires in do_exit() before the
 * kernel frees the TID. */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(pvs_sched_process_exit, struct task_struct *p)
{
	struct pvs_vcpu *v = vcpu_by_tid((__u32)p->pid);

	if (v)
		forget_thread(v);
	return 0;
}

/*
 * A thread other than the leader calls execve: the kernel kills the other
 * threads (each passes sched_process_exit), hands the exec'ing thread the
 * process's pid and frees its old TID with no sched_process_exit of its
 * own. That TID is old_pid here; a registered thread that exec'd is a new
 * program and no longer the vCPU it was, so it is forgotten too (the agent
 * puts the exec'd thread, now its process's leader, back to its baseline).
 */
SEC("tp_btf/sched_process_exec")
int BPF_PROG(pvs_sched_process_exec, struct task_struct *p, pid_t old_pid,
	     struct linux_binprm *bprm)
{
	struct pvs_vcpu *v;

	/* A leader that exec's keeps its TID: it stays registered until its
	 * VM is unregistered, which restores it. */
	if ((__u32)old_pid == (__u32)p->pid)
		return 0;
	v = vcpu_by_tid((__u32)old_pid);
	if (v)
		forget_thread(v);
	return 0;
}

/*
 * A host thread is woken: it may cut a co-scheduled phase short on its CPU
 * (host_wakeup). A vCPU thread is woken: when the waker is a sibling vCPU's
 * thread, that vCPU kicked it (under QEMU TCG an IPI is exactly that): the
 * waker's event goes first, so the woken vCPU's own event already sees the
 * loan.
 */
SEC("tp_btf/sched_wakeup")
int BPF_PROG(pvs_sched_wakeup, struct task_struct *p)
{
	struct pvs_vcpu *v = vcpu_by_tid((__u32)p->pid), *s = NULL;
	__u32 cur = current_tid();
	struct pvs_vm *vm;
	__u64 now;

	if (!v) {
		host_wakeup(p);
		return 0;
	}
	count_full(PVS_PROG_WAKEUP);
	now = bpf_ktime_get_ns();
	if (cur != (__u32)p->pid)
		s = vcpu_by_tid(cur);
	/* Counted for every VM (co-scheduling reads it): emulator threads
	 * (slots from nr_vcpus on) wake vCPUs for I/O, not for each other. */
	if (s && s->vm_id == v->vm_id) {
		__u32 vm_id = v->vm_id;

		vm = bpf_map_lookup_elem(&vms, &vm_id);
		if (vm && s->index < vm->nr_vcpus && v->index < vm->nr_vcpus)
			v->sib_wakes++;
	}
	/* Only a VM that pairs kicks pays for the waker's event (under KVM
	 * every IPI to a halted vCPU is such a wake-up; under TCG every hand-
	 * over between sibling vCPU threads). */
	if (s && (vm = kick_vm(v->vm_id))) {
		if (s->vm_id == v->vm_id && kick_sender_counts(s, vm))
			handle_event(s, PVS_EV_KICK, v->index, 0, now, cur);
	}
	handle_event(v, PVS_EV_WAKEUP, 0, 0, now, cur);
	return 0;
}
