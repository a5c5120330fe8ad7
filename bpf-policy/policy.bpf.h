/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: one event for one registered thread (a vCPU, or an
 * emulator thread: scheduler events only, no slot), from any program
 * (real tracepoint or the re-evaluation entry). Order: charge the boosted
 * on-CPU time since the last event, state transition, request refresh,
 * directed-yield slot, the yield targets it released or now waits on, its
 * own boost, host half.
 */
#ifndef PVSCHED_POLICY_BPF_H
#define PVSCHED_POLICY_BPF_H

static __always_inline void handle_event(struct pvs_vcpu *v, __u32 event, __u64 a, __u64 b,
					 __u64 now, __u32 cur_tid)
{
	__u32 vm_id = v->vm_id, old_t = 0, new_t = 0;
	struct pvsched_slot *slot;
	struct pvs_vm *vm;
	struct pvs_stats *s;

	vm = bpf_map_lookup_elem(&vms, &vm_id);
	if (!vm || !vm->active)
		return;
	/* One lookup of the region (an inner map: a helper call, not inlined)
	 * for both the read of the guest half and the publish. */
	slot = vcpu_slot(v, vm);
	s = stats_get();
	if (s && event < PVS_EV_MAX)
		s->events[event]++;
	/* Charge the time up to now in the state the vCPU was in. */
	charge(v, vm, now);
	switch (event) {
	case PVS_EV_SWITCH_OUT:
		if (a) {
			v->state = PVS_ST_PREEMPTED;
		} else {
			v->state = PVS_ST_HALTED; /* blocked: a continuous run ends */
			v->cont_ns = 0;
			/* It has nothing to run while a sibling has: a guest
			 * whose vCPUs wait for each other does this often, a
			 * batch guest (every vCPU busy) almost never. */
			if (v->index < vm->nr_vcpus && first_preempted(v, vm)) {
				v->sync_halts++;
				v->sync_since = now;
			}
		}
		break;
	case PVS_EV_VCPU_WAKEUP: /* a halt ended (also a polled one) */
		v->state = PVS_ST_RUNNING;
		v->cont_ns = 0;
		break;
	case PVS_EV_SWITCH_IN:
	case PVS_EV_USER_EXIT:
		v->state = PVS_ST_RUNNING;
		break;
	case PVS_EV_WAKEUP:
		v->state = PVS_ST_WOKEN;
		if (v->sync_since && now > v->sync_since)
			v->sync_wait_ns += now - v->sync_since;
		v->sync_since = 0;
		break;
	/* An IPI or a kick runs in the vCPU's own thread: it is on a CPU
	 * whatever the last switch said. Some hosts never record a switch out
	 * of an idle task, so a vCPU woken onto an idle CPU would otherwise
	 * stay "woken" (reported preempted, its boosted time uncharged) until
	 * it next switched out. */
	case PVS_EV_IPI: /* only a vCPU sends IPIs (an emulator thread never runs KVM_RUN) */
		v->state = PVS_ST_RUNNING;
		if (v->index < vm->nr_vcpus)
			ipi_record(v, (__u32)a, (__u32)b, now);
		break;
	case PVS_EV_KICK: /* a vCPU woke a sibling; the waker is never an emulator thread */
		v->state = PVS_ST_RUNNING;
		if (v->index < vm->nr_vcpus)
			kick_record(v, vm, (__u32)a, now);
		break;
	default:
		break;
	}
	refresh_request(v, vm, slot, cur_tid, now);
	yield_update(v, vm, now, &old_t, &new_t);
	if (old_t != new_t) {
		yield_mark(vm, vm_id, old_t, v->index, 0, now, event);
		yield_mark(vm, vm_id, new_t, v->index, 1, now, event);
	}
	apply_boost(v, vm, now, event, old_t != new_t);
	pvs_publish(v, slot);
}

/* The registered thread (vCPU or emulator thread) with id `tid`, or NULL;
 * most host threads are turned away by the prefilter's count, and a
 * registered thread alone in its prefilter element is found there. The
 * element is only a hint (the agent rewrites it while events run): its key
 * is taken only if the thread there says it is `tid`, else `tids` decides.
 * A tid that is 0 in its `vcpus` element exited: a new thread that gets the
 * same TID is never that vCPU. */
static __always_inline struct pvs_vcpu *vcpu_by_tid(__u32 tid)
{
	__u32 key = tid & (PVS_TID_HINTS - 1);
	struct pvs_tid_hint *h = bpf_map_lookup_elem(&tid_hint, &key);
	struct pvs_vcpu *v;
	__u32 *gid;

	if (!h || !READ_ONCE(h->count))
		return NULL;
	if (READ_ONCE(h->tid) == tid) {
		key = READ_ONCE(h->key);
		v = bpf_map_lookup_elem(&vcpus, &key);
		if (v && READ_ONCE(v->tid) == tid)
			return v;
	}
	gid = bpf_map_lookup_elem(&tids, &tid);
	if (!gid)
		return NULL;
	v = vcpu_by_gid(*gid);
	if (!v || READ_ONCE(v->tid) != tid)
		return NULL;
	return v;
}

static __always_inline __u32 current_tid(void)
{
	return (__u32)bpf_get_current_pid_tgid();
}

#endif
