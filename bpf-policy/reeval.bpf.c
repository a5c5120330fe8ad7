/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: re-evaluation entry, run with BPF_PROG_TEST_RUN and
 * never attached. args: [0] event, [1] gid, [2] now (ns; PVS_NOW_CLOCK for
 * the policy's own clock), [3] a, [4] b.
 * In production the agent's timer runs PVS_EV_TICK through it for every
 * registered thread (gid PVS_GID_ALL, a = how many VM ids from 0 to scan:
 * throttle ends, windows, latency holds of vCPUs that produce no scheduler
 * events) and the device's KICK doorbell runs it for the vCPU whose guest
 * changed its slot, and the agent runs PVS_EV_PHASE_ON for a VM whose
 * co-scheduled phase it has just started. The differential test drives the
 * same entry with synthetic events of every kind.
 */

struct tick_ctx {
	__u64 now;
	__u32 count; /* threads re-evaluated */
	__u32 pad;
};

/* Thread `index` of VM `vm_id` if it is registered, else NULL. Every
 * element of the array exists: only a thread of an active VM (activated
 * after its threads) is one. */
static __always_inline struct pvs_vcpu *registered(__u32 vm_id, __u32 index)
{
	struct pvs_vm *vm = bpf_map_lookup_elem(&vms, &vm_id);
	struct pvs_vcpu *v;

	if (!vm || !vm->active || index >= vm->nr_vcpus + vm->nr_emulators)
		return NULL;
	v = vcpu_by_index(vm_id, index);
	if (!v || v->vm_id != vm_id || v->index != index)
		return NULL;
	return v;
}

/* bpf_loop callback: element k of `vcpus` has a tick if it is a registered
 * thread. */
static long tick_cb(__u32 k, void *data)
{
	struct pvs_vcpu *v = registered(k / PVS_THREADS_PER_VM, k % PVS_THREADS_PER_VM);
	struct tick_ctx *t = data;

	if (!v)
		return 0;
	handle_event(v, PVS_EV_TICK, 0, 0, t->now, 0);
	t->count++;
	return 0;
}

SEC("raw_tp")
int pvs_reeval(void *ctx)
{
	/* Plain u64 array: bpf_raw_tracepoint_args is a flexible array that
	 * CO-RE access strings cannot index. */
	__u64 *args = ctx;
	__u32 gid = (__u32)args[1];
	__u64 now = args[2] == PVS_NOW_CLOCK ? bpf_ktime_get_ns() : args[2];
	struct pvs_vcpu *v;

	/* The agent's timer: a tick for every thread of every active VM in
	 * one run (one system call per tick, not one per thread); returns
	 * how many. */
	if (gid == PVS_GID_ALL) {
		struct tick_ctx t = { .now = now };
		__u64 vms_to_scan = args[3] < PVS_MAX_VMS ? args[3] : PVS_MAX_VMS;

		bpf_loop(vms_to_scan * PVS_THREADS_PER_VM, tick_cb, &t, 0);
		return t.count;
	}
	/* The agent put VM gid >> PVS_GID_SHIFT's vCPUs in their phase: a =
	 * the host's CPUs; returns how many vCPUs left it for a host thread
	 * already waiting on their CPU. */
	if ((__u32)args[0] == PVS_EV_PHASE_ON)
		return phase_on(gid >> PVS_GID_SHIFT, args[3]);
	v = registered(gid >> PVS_GID_SHIFT, gid & ((1U << PVS_GID_SHIFT) - 1));
	if (!v)
		return 1;
	handle_event(v, (__u32)args[0], args[3], args[4], now, 0);
	return 0;
}
