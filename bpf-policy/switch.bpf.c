/* SPDX-License-Identifier: GPL-2.0 */
/* pvsched BPF policy: scheduler events (sched_switch, sched_wakeup,
 * sched_process_exit). */

SEC("tp_btf/sched_switch")
int BPF_PROG(pvs_sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next,
	     unsigned int prev_state)
{
	__u64 now = bpf_ktime_get_ns();
	struct pvs_vcpu *v;

	v = vcpu_by_tid((__u32)prev->pid);
	if (v)
		/* Still runnable (TASK_RUNNING) = preempted; else it blocked. */
		handle_event(v, PVS_EV_SWITCH_OUT, preempt || prev_state == 0, 0, now,
			     current_tid());
	v = vcpu_by_tid((__u32)next->pid);
	if (v)
		handle_event(v, PVS_EV_SWITCH_IN, 0, 0, now, current_tid());
	return 0;
}

/*
 * A registered thread exits. The tracepoint fires in do_exit() before the
 * kernel frees the TID, so the vCPU forgets it here, before any new thread
 * can be given the same TID: from now on no event of that TID reaches the
 * policy (vcpu_by_tid checks v->tid) and no record names it. The agent
 * learns it from the PVS_R_EXITED record (and, level-triggered, from
 * v->tid == 0 at reconciliation) and never calls sched_setattr on the TID
 * again.
 */
SEC("tp_btf/sched_process_exit")
int BPF_PROG(pvs_sched_process_exit, struct task_struct *p)
{
	__u32 tid = (__u32)p->pid;
	struct pvs_vcpu *v = vcpu_by_tid(tid);

	if (!v)
		return 0;
	v->boost = PVSCHED_BOOST_NONE;
	v->boost_prio = 0;
	v->boost_reason = PVS_R_EXITED;
	emit(v, PVS_EV_EXIT, bpf_ktime_get_ns(), 0);
	WRITE_ONCE(v->tid, 0);
	return 0;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(pvs_sched_wakeup, struct task_struct *p)
{
	struct pvs_vcpu *v = vcpu_by_tid((__u32)p->pid);

	if (v)
		handle_event(v, PVS_EV_WAKEUP, 0, 0, bpf_ktime_get_ns(), current_tid());
	return 0;
}
