/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: re-evaluation entry, run with BPF_PROG_TEST_RUN and
 * never attached. args: [0] event, [1] gid, [2] now (ns), [3] a, [4] b.
 * In production the agent's timer runs PVS_EV_TICK through it for every
 * registered vCPU (throttle ends, windows, latency holds of vCPUs that
 * produce no scheduler events) and the device's KICK doorbell runs it for
 * the vCPU whose guest changed its slot. The differential test drives the
 * same entry with synthetic events of every kind.
 */

SEC("raw_tp")
int pvs_reeval(void *ctx)
{
	/* Plain u64 array: bpf_raw_tracepoint_args is a flexible array that
	 * CO-RE access strings cannot index. */
	__u64 *args = ctx;
	__u32 gid = (__u32)args[1], vm_id = gid >> PVS_GID_SHIFT;
	__u32 index = gid & ((1U << PVS_GID_SHIFT) - 1);
	struct pvs_vcpu *v = vcpu_by_index(vm_id, index);
	struct pvs_vm *vm = bpf_map_lookup_elem(&vms, &vm_id);

	/* Every element of the array exists: only a thread of an active VM
	 * (registered, as the VM is activated after its threads) is one. */
	if (!v || !vm || !vm->active || index >= vm->nr_vcpus + vm->nr_emulators ||
	    v->vm_id != vm_id || v->index != index)
		return 1;
	handle_event(v, (__u32)args[0], args[3], args[4], args[2], 0);
	return 0;
}
