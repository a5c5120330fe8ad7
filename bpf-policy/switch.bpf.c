/* SPDX-License-Identifier: GPL-2.0 */
/* pvsched BPF policy: scheduler events (sched_switch, sched_wakeup). */

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

SEC("tp_btf/sched_wakeup")
int BPF_PROG(pvs_sched_wakeup, struct task_struct *p)
{
	struct pvs_vcpu *v = vcpu_by_tid((__u32)p->pid);

	if (v)
		handle_event(v, PVS_EV_WAKEUP, 0, 0, bpf_ktime_get_ns(), current_tid());
	return 0;
}
