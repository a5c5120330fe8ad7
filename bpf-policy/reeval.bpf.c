/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: synthetic-event entry, run with BPF_PROG_TEST_RUN and
 * never attached. args: [0] event, [1] gid, [2] now (ns), [3] a, [4] b.
 * Used by the differential test (same traces through the Rust model) and by
 * the agent's timer (PVS_EV_TICK: throttling and window expiry for vCPUs
 * that produce no scheduler events).
 */

SEC("raw_tp")
int pvs_test_event(void *ctx)
{
	/* Plain u64 array: bpf_raw_tracepoint_args is a flexible array that
	 * CO-RE access strings cannot index. */
	__u64 *args = ctx;
	__u32 gid = (__u32)args[1];
	struct pvs_vcpu *v = bpf_map_lookup_elem(&vcpus, &gid);

	if (!v)
		return 1;
	handle_event(v, (__u32)args[0], args[3], args[4], args[2], 0);
	return 0;
}
