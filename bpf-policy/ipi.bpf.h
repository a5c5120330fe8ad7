/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: IPI-aware directed yield. kvm_apic_ipi gives unicast
 * sender -> receiver pairs (APIC ID -> slot through the `apics` map); a
 * vCPU's directed-yield slot holds the guest's wait_on hint (for a lock
 * spinner, WAIT_ANY, one of the VM's preempted vCPUs), else its receiver
 * confirmed within ipi_window_ns; while the slot holds and the
 * sender is not throttled, the slot's target carries a bit for it in
 * yield_mask, which gives it the VM's yield boost (a sender that says it
 * spins on it, wait_on, is kept one step below it: budget.bpf.h).
 */
#ifndef PVSCHED_IPI_BPF_H
#define PVSCHED_IPI_BPF_H

/* s's pair with slot `idx` is confirmed now (an IPI or a second kick). */
static __always_inline void pair_confirm(struct pvs_vcpu *s, __u32 idx, __u64 now)
{
	s->last_ipi_target = idx + 1;
	s->last_ipi_ns = now;
	s->ipis++;
	STAT_INC(ipi_pairs);
}

/* Record a unicast fixed physical IPI from s. */
static __always_inline void ipi_record(struct pvs_vcpu *s, __u32 dest_id, __u32 icr_low, __u64 now)
{
	__u32 *idx, index;
	__u64 key;

	if ((icr_low >> 18) & 3)	 /* shorthand: self / all / all-but-self */
		return;
	if ((icr_low >> 8) & 7)		 /* only fixed delivery */
		return;
	if (icr_low & (1 << 11))	 /* logical destination: not one receiver */
		return;
	if (dest_id < PVS_APIC_FAST) {
		__u32 k = s->vm_id * PVS_APIC_FAST + dest_id;

		if (s->vm_id >= PVS_MAX_VMS)
			return;
		idx = bpf_map_lookup_elem(&apic_fast, &k);
		if (!idx || !*idx)
			return;
		index = *idx - 1;
	} else {
		key = ((__u64)s->vm_id << 32) | dest_id;
		idx = bpf_map_lookup_elem(&apics, &key);
		if (!idx)
			return;
		index = *idx;
	}
	if (index == s->index || index >= PVS_MAX_VCPUS_PER_VM)
		return;
	pair_confirm(s, index, now);
}

/*
 * s's thread woke vCPU `target`'s thread (caps.kick_pairs): the pair is
 * confirmed as by an IPI. Under QEMU TCG this is the IPI itself (the sender
 * kicks the halted receiver's thread); under KVM it doubles the
 * kvm_apic_ipi record of a kick, or is a paravirtual unhalt. Only when the
 * target's guest was idle at its last slot read (it halted): a TCG vCPU
 * thread also wakes a sibling that waited for QEMU's global lock, which is
 * no IPI and would lend a busy vCPU the boost. And only the second kick of
 * the same vCPU within ipi_window_ns confirms the pair: a guest that
 * communicates kicks its siblings again and again, a batch guest's odd
 * IPI (a timer, a load balance) lends nothing. With kick_pairs "auto"
 * only a boosted sender's kick counts: its FIFO run is what keeps the
 * sibling it woke off the CPU (the woken thread often waits on the
 * sender's CPU), while an unboosted sender competes with it as equals.
 */
static __always_inline void kick_record(struct pvs_vcpu *s, const struct pvs_vm *vm,
					__u32 target, __u64 now)
{
	struct pvs_vcpu *t;

	if (target == s->index || target >= vm->nr_vcpus || target >= PVS_MAX_VCPUS_PER_VM)
		return;
	if (vm->caps.kick_pairs == PVS_KICK_AUTO && s->boost == PVSCHED_BOOST_NONE)
		return;
	if (!kick_pairs_vm(s->vm_id, vm))
		return;
	t = vcpu_by_index(s->vm_id, target);
	if (!t || !READ_ONCE(t->guest_idle))
		return;
	if (s->last_kick_target != target + 1 || now - s->last_kick_ns > vm->caps.ipi_window_ns) {
		s->last_kick_target = target + 1;
		s->last_kick_ns = now;
		return;
	}
	s->last_kick_ns = now;
	pair_confirm(s, target, now);
}

struct pick_ctx {
	__u32 vm_id;
	__u32 self;
	__u32 nr;
	__u32 found; /* slot index + 1, 0 = none */
};

/* bpf_loop callback: the k-th vCPU after ctx->self (in slot order, wrapping)
 * is the pick if it is preempted. */
static long pick_preempted_cb(__u32 k, void *data)
{
	struct pick_ctx *p = data;
	__u32 j = p->self + 1 + k;
	struct pvs_vcpu *t;

	if (p->nr == 0 || k >= p->nr)
		return 1;
	if (j >= p->nr)
		j -= p->nr;
	t = vcpu_by_index(p->vm_id, j);
	if (t && READ_ONCE(t->state) == PVS_ST_PREEMPTED) {
		p->found = j + 1;
		return 1;
	}
	return 0;
}

/* The first preempted vCPU after `s` in slot order (slot index + 1), or 0
 * when every other vCPU runs, halts or was woken. */
static __always_inline __u32 first_preempted(const struct pvs_vcpu *s, const struct pvs_vm *vm)
{
	struct pick_ctx p = { .vm_id = s->vm_id, .self = s->index, .nr = vm->nr_vcpus };

	if (p.nr < 2 || p.nr > PVS_MAX_VCPUS_PER_VM || s->index >= p.nr)
		return 0;
	bpf_loop(p.nr - 1, pick_preempted_cb, &p, 0);
	return p.found;
}

/*
 * The vCPU a lock spinner (wait_on = WAIT_ANY) lends its yield boost to: the
 * lock's holder is not known, but it is another vCPU of the VM that is on a
 * CPU or was preempted (a halted vCPU holds no spinlock). The current slot
 * stays while its vCPU is one of those, so a boosted holder that starts
 * running keeps its boost; otherwise the first preempted vCPU after the
 * spinner, in slot order. 0 when every other vCPU runs or halts: there is
 * nobody to give the time to.
 */
static __always_inline __u32 lock_target(const struct pvs_vcpu *s, const struct pvs_vm *vm)
{
	__u32 cur = s->yield_slot, st, nr = vm->nr_vcpus;
	struct pvs_vcpu *t;

	if (cur && cur <= nr && cur != s->index + 1) {
		t = vcpu_by_index(s->vm_id, cur - 1);
		if (t) {
			st = READ_ONCE(t->state);
			if (st == PVS_ST_RUNNING || st == PVS_ST_PREEMPTED)
				return cur;
		}
	}
	return first_preempted(s, vm);
}

/* Recompute s's directed-yield slot; returns the target to re-evaluate
 * through *old_t / *new_t (slot index + 1, 0 = none). */
static __always_inline void yield_update(struct pvs_vcpu *s, const struct pvs_vm *vm, __u64 now,
					 __u32 *old_t, __u32 *new_t)
{
	__u32 slot = 0, target;

	*old_t = 0;
	*new_t = 0;
	if (s->wait_on == PVSCHED_WAIT_ANY)
		slot = lock_target(s, vm);
	else if (s->wait_on)
		slot = s->wait_on;
	else if (s->last_ipi_target && now - s->last_ipi_ns <= vm->caps.ipi_window_ns)
		slot = s->last_ipi_target;
	s->yield_slot = slot;
	/* The target is lent the yield boost for as long as the slot holds
	 * (wait_on, or a pair confirmed within the IPI window), not only while
	 * the sender waits: the boost is in place before the next IPI and a
	 * round trip makes no decision. A throttled sender lends nothing. */
	target = now >= s->throttled_until ? slot : 0;
	if (target == s->yield_boosting)
		return;
	*old_t = s->yield_boosting;
	*new_t = target;
	s->yield_boosting = target;
	if (target)
		s->slot_hits++;
}

/* Set or clear sender bit `sender` in the target's mask and re-evaluate it. */
static __always_inline void yield_mark(struct pvs_vm *vm, __u32 vm_id, __u32 target1,
				       __u32 sender, int set, __u64 now, __u32 event)
{
	struct pvs_vcpu *t;

	if (!target1 || sender >= 64)
		return;
	t = vcpu_by_index(vm_id, target1 - 1);
	if (!t)
		return;
	if (set) {
		t->yield_mask |= 1ULL << sender;
		STAT_INC(slot_hits);
	} else {
		t->yield_mask &= ~(1ULL << sender);
	}
	apply_boost(t, vm, now, event, 0);
	publish(t, vm);
}

#endif
