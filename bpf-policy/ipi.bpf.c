/* SPDX-License-Identifier: GPL-2.0 */
/* pvsched BPF policy: kvm_apic_ipi, in the sending vCPU thread's context. */

SEC("tp_btf/kvm_apic_ipi")
int BPF_PROG(pvs_kvm_apic_ipi, __u32 icr_low, __u32 dest_id)
{
	__u32 tid = current_tid();
	struct pvs_vcpu *v = vcpu_by_tid(tid);

	if (!v)
		return 0;
	count_full(PVS_PROG_IPI);
	handle_event(v, PVS_EV_IPI, dest_id, icr_low, bpf_ktime_get_ns(), tid);
	return 0;
}
