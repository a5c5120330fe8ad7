/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: choosing a vCPU's boost (guest request, the halt boost
 * of a latency-sensitive vCPU, the directed-yield boost), charging what the
 * host pays (boosted time on a CPU, never wall-clock time), enforcing the
 * continuous limit, throttle time and budgets per window (each thread's and
 * the whole VM's), throttling a
 * waiting pair as one unit, and emitting a decision record whenever a
 * vCPU's applied boost changes. crates/pvsched-policy/src/model.rs is the
 * same in Rust, step for step.
 */
#ifndef PVSCHED_BUDGET_BPF_H
#define PVSCHED_BUDGET_BPF_H

/* A record of thread v's boost as it is now, for `reason` (emit(), and the
 * co-scheduling records, which change no boost). */
static __always_inline void emit_reason(const struct pvs_vcpu *v, __u32 event, __u32 reason,
					__u64 now, __u64 flags)
{
	struct pvs_decision *d;
	struct pvs_stats *s = stats_get();

	d = bpf_ringbuf_reserve(&decisions, sizeof(*d), 0);
	if (!d) {
		if (s)
			s->dropped++;
		return;
	}
	d->ts = now;
	d->tid = v->tid;
	d->gid = gid_of(v->vm_id, v->index);
	d->kind = v->boost;
	d->prio = v->boost_prio;
	d->reason = reason;
	d->event = event;
	d->throttled_until = v->throttled_until;
	d->waits_on = v->yield_boosting;
	d->pad0 = 0;
	/* The kernel wakes the agent for a record without flags only if the
	 * agent has read every record before it: behind a trace-only record
	 * still unread (BPF_RB_NO_WAKEUP), one the agent must act on now (a
	 * boost change, a host thread waiting for a phased vCPU's CPU) waited
	 * for the agent's next tick. Forced then; not always, which would cost
	 * a wake-up per record while the agent is already reading. */
	if (!flags &&
	    bpf_ringbuf_query(&decisions, BPF_RB_AVAIL_DATA) > sizeof(*d) + BPF_RINGBUF_HDR_SZ)
		flags = BPF_RB_FORCE_WAKEUP;
	bpf_ringbuf_submit(d, flags);
	if (s)
		s->decisions++;
}

/* Send v's current boost, throttle and waiting target as a record. `flags`
 * is 0 when the boost changed (the agent must apply it now) or
 * BPF_RB_NO_WAKEUP for a trace-only record the agent reads at its next
 * wake-up. */
static __always_inline void emit(const struct pvs_vcpu *v, __u32 event, __u64 now, __u64 flags)
{
	emit_reason(v, event, v->boost_reason, now, flags);
}

/* Charge the boosted on-CPU time since the last charge, to the thread and to
 * its VM: only a boosted vCPU that is on a CPU (RUNNING) costs the host
 * anything. The VM's sum is added atomically (its threads run on several
 * CPUs at once), whether or not it has a VM budget: one branch less for
 * the verifier, which walks this code in every program. */
static __always_inline void charge(struct pvs_vcpu *v, struct pvs_vm *vm, __u64 now)
{
	__u64 d;

	if (now <= v->acct_ns)
		return;
	if (v->boost != PVSCHED_BOOST_NONE && v->state == PVS_ST_RUNNING) {
		d = now - v->acct_ns;
		v->budget_used += d;
		v->cont_ns += d;
		v->boosted_ns += d;
		__sync_fetch_and_add(&vm->budget_used, d);
	}
	v->acct_ns = now;
}

/* Whether a budget window that started at `start` is over at `now`. The
 * difference is signed: a program whose `now` is older than a window
 * another CPU just started (its clock read came first) sees that window
 * as current, never as over; unsigned, the difference wrapped and started
 * the window again, giving the VM a second budget in it. */
static __always_inline int window_over(__u64 now, __u64 start, __u64 window)
{
	return (__s64)(now - start) >= (__s64)window;
}

/* Start the VM's next budget window if the current one is over, then say
 * whether the VM's boosted on-CPU time in it has reached its budget
 * (vm_budget_ns is U64_MAX for "no VM budget"). Only the CPU whose
 * compare-and-swap moves window_start clears the sum; a charge another CPU
 * adds between the two is lost to the new window (a few µs at most, in the
 * VM's favour). */
static __always_inline int vm_spent(struct pvs_vm *vm, __u64 now)
{
	__u64 ws, window;

	window = vm->caps.window_ns;
	ws = READ_ONCE(vm->window_start);
	if (window && window_over(now, ws, window) &&
	    __sync_val_compare_and_swap(&vm->window_start, ws, now) == ws)
		WRITE_ONCE(vm->budget_used, 0);
	return READ_ONCE(vm->budget_used) >= vm->caps.vm_budget_ns;
}

/* The next boost below a clamped kind/prio: RT p -> RT p-1, RT 1 -> the
 * nice floor, nice n -> n+1, down to NONE. */
static __always_inline void step_below(const struct pvs_caps *c, __u32 *kind, __s32 *prio)
{
	if (*kind == PVSCHED_BOOST_RT) {
		if (*prio > 1) {
			*prio -= 1;
		} else {
			*kind = PVSCHED_BOOST_NICE;
			*prio = c->nice_floor;
		}
	} else if (*kind == PVSCHED_BOOST_NICE) {
		*prio += 1;
	}
	caps_clamp(c, kind, prio);
}

/* v lends nothing any more (it was throttled): clear its bit in its target's
 * mask. The target is throttled with it, so it needs no re-evaluation. */
static __always_inline void end_lend(struct pvs_vcpu *v)
{
	__u32 t = v->yield_boosting;
	struct pvs_vcpu *tv;

	v->yield_boosting = 0;
	if (!t || v->index >= 64)
		return;
	tv = vcpu_by_index(v->vm_id, t - 1);
	if (tv)
		tv->yield_mask &= ~(1ULL << v->index);
}

/* Throttle the target of a throttled sender until at least `until`. */
static __always_inline void force_throttle(struct pvs_vcpu *v, struct pvs_vm *vm, __u64 until,
					   __u32 event, __u64 now)
{
	int extended = v->throttled_until < until, unboosted = 0;

	charge(v, vm, now);
	if (extended)
		v->throttled_until = until;
	v->throttled = 1;
	v->cont_ns = 0;
	/* v may be re-evaluated on another CPU right now: see apply_boost(). */
	full_fence(v->fence);
	if (v->boost != PVSCHED_BOOST_NONE) {
		v->throttles++;
		v->boost = PVSCHED_BOOST_NONE;
		v->boost_prio = 0;
		v->boost_reason = PVS_R_THROTTLED;
		STAT_INC(throttles);
		unboosted = 1;
	}
	end_lend(v);
	if (unboosted)
		emit(v, event, now, 0);
	else if (extended)
		emit(v, event, now, BPF_RB_NO_WAKEUP);
	publish(v, vm);
}

struct unit_ctx {
	__u64 mask;  /* senders to unboost */
	__u64 now;
	__u32 vm_id;
	__u32 skip;  /* the throttled vCPU itself */
	__u32 event;
	__u32 pad;
};

/* bpf_loop callback: drop the boost of sender `s` if it is in the mask (its
 * target was just throttled; it gets no boost until the target may run). */
static long unboost_sender_cb(__u32 s, void *data)
{
	struct unit_ctx *u = data;
	struct pvs_vcpu *v;
	struct pvs_vm *vm;
	__u32 vm_id;
	__u64 ts;

	if (s >= 64)
		return 1;
	if (s == u->skip || !(u->mask & (1ULL << s)))
		return 0;
	v = vcpu_by_index(u->vm_id, s);
	vm_id = u->vm_id;
	vm = bpf_map_lookup_elem(&vms, &vm_id);
	if (!v || !vm)
		return 0;
	charge(v, vm, u->now);
	if (v->boost == PVSCHED_BOOST_NONE)
		return 0;
	v->boost = PVSCHED_BOOST_NONE;
	v->boost_prio = 0;
	v->boost_reason = PVS_R_THROTTLED;
	/* The sender may have been boosted on another CPU by a program that
	 * started after this one (its charge moved acct_ns past u->now): stamp
	 * the unboost no earlier than that boost, so the trace keeps them in
	 * the order they happened. */
	ts = READ_ONCE(v->acct_ns);
	emit(v, u->event, ts > u->now ? ts : u->now, 0);
	publish(v, vm);
	return 0;
}

/* A waiting pair is throttled as one unit: the target v waits on is
 * throttled with it, and every sender waiting on either loses its boost at
 * once. Then v lends nothing. */
static __always_inline void unit_throttle(struct pvs_vcpu *v, struct pvs_vm *vm, __u64 until,
					  __u32 event, __u64 now)
{
	__u32 by = v->yield_boosting, nr = vm->nr_vcpus;
	struct unit_ctx u = {
		.now = now,
		.vm_id = v->vm_id,
		.skip = v->index,
		.event = event,
	};
	struct pvs_vcpu *g;

	if (by && by <= nr) {
		g = vcpu_by_index(v->vm_id, by - 1);
		if (g) {
			force_throttle(g, vm, until, event, now);
			u.mask = g->yield_mask;
		}
	}
	u.mask |= v->yield_mask;
	/* Pairs with the re-check in apply_boost(): a sender boosted on
	 * another CPU at this moment either sees the throttle there or is
	 * seen boosted here. */
	full_fence(v->fence);
	if (u.mask)
		bpf_loop(nr > 64 ? 64 : nr, unboost_sender_cb, &u, 0);
	end_lend(v);
}

/* End v's running boost as throttled until `until`, for `reason`. */
static __always_inline void throttle(struct pvs_vcpu *v, struct pvs_vm *vm, __u64 until,
				     __u32 reason, __u32 event, __u64 now)
{
	v->throttled_until = until;
	v->throttled = 1;
	v->throttles++;
	v->cont_ns = 0;
	v->boost = PVSCHED_BOOST_NONE;
	v->boost_prio = 0;
	v->boost_reason = reason;
	STAT_INC(throttles);
	unit_throttle(v, vm, until, event, now);
	emit(v, event, now, 0);
}

/* Whether a boost for `reason` serves the guest's latency (a latency-
 * sensitive vCPU's halt boost, an RT task's request), not throughput: it
 * does not give way to a woken host thread (host_hold_until). */
static __always_inline bool latency_boost(__u32 reason)
{
	return reason == PVS_R_HALT || reason == PVS_R_RT_TASK;
}

/* Whether a candidate boost (`kind`, for `reason`) must wait for the end
 * of v's hold for host threads (boost_gives_way()): an RT boost that
 * serves throughput. */
static __always_inline bool held_for_host(const struct pvs_vcpu *v, __u32 kind, __u32 reason,
					  __u64 now)
{
	return kind == PVSCHED_BOOST_RT && !latency_boost(reason) &&
	       now < READ_ONCE(v->host_hold_until);
}

/* Re-evaluate v's boost at time `now` and emit a decision if it changes
 * (or a trace record if `waits_changed`: v's waiting target changed while
 * it stays boosted). A global function, so the verifier checks it once, on
 * its own, rather than in each of the three places every event program
 * inlined it, where its branches multiplied every caller's states: the
 * re-evaluation program went from 772 000 instructions checked (of the
 * verifier's 1 000 000) to 34 000, and loading the policy from 3.4 s to
 * 0.2 s. Returns 0. */
__noinline int apply_boost(struct pvs_vcpu *v, struct pvs_vm *vm, __u64 now, __u32 event,
			   int waits_changed)
{
	const struct pvs_caps *c;
	__u32 kind = PVSCHED_BOOST_NONE, reason = PVS_R_NONE, why = 0;
	__s32 prio = 0;
	__u64 until = 0;
	struct pvs_vcpu *t = NULL;
	__u32 hk, yk, old_kind;
	__s32 hp, yp, old_prio;
	int spent;

	if (!v || !vm)
		return 0;
	c = &vm->caps;
	charge(v, vm, now);
	/* Budget window roll-over, the thread's and the VM's. */
	if (c->window_ns && window_over(now, v->window_start, c->window_ns)) {
		v->window_start = now;
		v->budget_used = 0;
	}
	spent = vm_spent(vm, now);
	/* Throttle a boost that ran too long on a CPU or used up a budget. */
	if (v->boost != PVSCHED_BOOST_NONE) {
		if (c->max_boost_ns && v->cont_ns >= c->max_boost_ns) {
			why = PVS_R_MAX_BOOST;
			until = now + c->throttle_ns;
		} else if (c->budget_ns && v->budget_used >= c->budget_ns) {
			why = PVS_R_BUDGET;
			until = v->window_start + c->window_ns;
		} else if (spent) {
			why = PVS_R_VM_BUDGET;
			until = READ_ONCE(vm->window_start) + c->window_ns;
		}
		if (why) {
			/* At least throttle_ns, also at a window's very end. */
			if (until < now + c->throttle_ns)
				until = now + c->throttle_ns;
			throttle(v, vm, until, why, event, now);
			return 0;
		}
	}
	/* Throttled, or the VM spent its budget: no thread of it gets a new
	 * boost until its next window (the boosted ones are throttled as they
	 * are re-evaluated, above). */
	if (now < v->throttled_until || spent)
		return 0;
	v->throttled = 0;

	/* What the vCPU should have now. */
	if (v->state != PVS_ST_HALTED && !held_for_host(v, v->req_kind, v->req_reason, now)) {
		kind = v->req_kind;
		prio = v->req_prio;
		reason = v->req_reason;
	}
	/* An emulator thread holds the halt boost while any vCPU of its VM is
	 * latency-sensitive (its timers and I/O wake those vCPUs). */
	if (c->halt_always || now < v->ls_until ||
	    (v->index >= vm->nr_vcpus && now < vm->ls_until)) {
		hk = c->halt_kind;
		hp = c->halt_prio;
		/* A latency-sensitive vCPU holds its RT request's priority
		 * (slot.bpf.h), if that is higher. */
		if (hk == PVSCHED_BOOST_RT && now < v->ls_until && v->ls_prio > hp)
			hp = v->ls_prio;
		caps_clamp(c, &hk, &hp);
		if (boost_rank(hk, hp) > boost_rank(kind, prio)) {
			kind = hk;
			prio = hp;
			reason = PVS_R_HALT;
		}
	}
	yk = c->yield_kind;
	yp = c->yield_prio;
	caps_clamp(c, &yk, &yp);
	if (v->yield_mask && boost_rank(yk, yp) > boost_rank(kind, prio) &&
	    !held_for_host(v, yk, PVS_R_YIELD, now)) {
		kind = yk;
		prio = yp;
		reason = PVS_R_YIELD;
	}
	/* A sender that says it spins on its target (wait_on) stays one step
	 * below the boost its target gets; any sender has none while its
	 * target is throttled. */
	if (v->yield_boosting) {
		if (v->wait_on && yk != PVSCHED_BOOST_NONE &&
		    boost_rank(kind, prio) >= boost_rank(yk, yp)) {
			step_below(c, &yk, &yp);
			kind = yk;
			prio = yp;
		}
		t = vcpu_by_index(v->vm_id, v->yield_boosting - 1);
	}
	old_kind = v->boost;
	old_prio = v->boost_prio;
	WRITE_ONCE(v->boost, kind);
	WRITE_ONCE(v->boost_prio, prio);
	/* Another CPU may be throttling v (a sender waiting on v ran out) or
	 * v's target, or holding v for a woken host thread, right now (a
	 * sender whose target is held gets no throughput boost either). The
	 * boost is stored first, then a fence, then both throttles and the
	 * hold are read again; that CPU stores the throttle or the hold,
	 * fences, then reads (and drops) the boost (force_throttle(),
	 * unit_throttle(), boost_gives_way()). So either that CPU sees this
	 * boost or this one sees that throttle. The boost is never stored
	 * again after the fence (that could undo the other CPU's unboost). */
	if (kind != PVSCHED_BOOST_NONE) {
		full_fence(v->fence);
		if (now < READ_ONCE(v->throttled_until) ||
		    (t && now < READ_ONCE(t->throttled_until)) ||
		    held_for_host(v, kind, reason, now) ||
		    (t && held_for_host(t, kind, reason, now))) {
			kind = PVSCHED_BOOST_NONE;
			prio = 0;
			WRITE_ONCE(v->boost, kind);
			WRITE_ONCE(v->boost_prio, prio);
		}
	}
	if (kind == PVSCHED_BOOST_NONE)
		reason = PVS_R_NONE;
	v->boost_reason = reason;
	if (kind == old_kind && prio == old_prio) {
		if (waits_changed && kind != PVSCHED_BOOST_NONE)
			emit(v, event, now, BPF_RB_NO_WAKEUP);
		return 0;
	}
	if (kind == PVSCHED_BOOST_NONE) {
		STAT_INC(unboosts);
	} else if (old_kind == PVSCHED_BOOST_NONE) {
		v->boosts++;
		STAT_INC(boosts);
	}
	emit(v, event, now, 0);
	return 0;
}

#endif
