/* SPDX-License-Identifier: GPL-2.0 */
/* pvsched BPF policy: KVM events, all in the vCPU thread's own context. */

SEC("tp_btf/kvm_vcpu_wakeup")
int BPF_PROG(pvs_kvm_vcpu_wakeup, __u64 ns, bool waited, bool valid)
{
	__u32 tid = current_tid();
	struct pvs_vcpu *v = vcpu_by_tid(tid);

	if (!v)
		return 0;
	count_full(PVS_PROG_VCPU_WAKEUP);
	handle_event(v, PVS_EV_VCPU_WAKEUP, waited, 0, bpf_ktime_get_ns(), tid);
	return 0;
}

SEC("tp_btf/kvm_userspace_exit")
int BPF_PROG(pvs_kvm_userspace_exit, __u32 reason, int err)
{
	__u32 tid = current_tid();
	struct pvs_vcpu *v = vcpu_by_tid(tid);

	if (!v)
		return 0;
	count_full(PVS_PROG_USER_EXIT);
	handle_event(v, PVS_EV_USER_EXIT, reason, 0, bpf_ktime_get_ns(), tid);
	return 0;
}
