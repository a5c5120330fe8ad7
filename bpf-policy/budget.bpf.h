/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: choosing a vCPU's boost (guest request, halt boost,
 * directed-yield boost), enforcing max continuous boost, throttle time and
 * the budget per window, and emitting the decision record when the applied
 * boost changes. crates/pvsched-policy/src/model.rs is the same in Rust.
 */
#ifndef PVSCHED_BUDGET_BPF_H
#define PVSCHED_BUDGET_BPF_H

static __always_inline void emit(const struct pvs_vcpu *v, __u32 event, __u64 now)
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
	d->reason = v->boost_reason;
	d->event = event;
	bpf_ringbuf_submit(d, 0);
	if (s)
		s->decisions++;
}

/* Close the accounting of a running boost. */
static __always_inline void boost_end(struct pvs_vcpu *v, __u64 now)
{
	if (now > v->acct_start)
		v->budget_used += now - v->acct_start;
	if (now > v->boost_start)
		v->boosted_ns += now - v->boost_start;
}

/* End v's running boost as throttled until `until`, for `reason`. */
static __always_inline void throttle(struct pvs_vcpu *v, __u64 until, __u32 reason,
				     __u32 event, __u64 now)
{
	v->throttled_until = until;
	v->throttled = 1;
	v->throttles++;
	boost_end(v, now);
	v->boost = PVSCHED_BOOST_NONE;
	v->boost_prio = 0;
	v->boost_reason = reason;
	STAT_INC(throttles);
	emit(v, event, now);
}

/* Re-evaluate v's boost at time `now` and emit a decision if it changes. */
static __always_inline void apply_boost(struct pvs_vcpu *v, const struct pvs_vm *vm,
					__u64 now, __u32 event)
{
	const struct pvs_caps *c = &vm->caps;
	__u32 kind = PVSCHED_BOOST_NONE, reason = PVS_R_NONE;
	__s32 prio = 0;
	__u32 hk, yk;
	__s32 hp, yp;

	/* Budget window roll-over. */
	if (c->window_ns && now - v->window_start >= c->window_ns) {
		v->window_start = now;
		v->budget_used = 0;
		if (v->boost != PVSCHED_BOOST_NONE)
			v->acct_start = now;
	}
	/* Throttle a boost that ran too long or used up the budget. */
	if (v->boost != PVSCHED_BOOST_NONE) {
		__u64 run = now - v->boost_start;
		__u64 used = v->budget_used + (now - v->acct_start);

		if (c->max_boost_ns && run >= c->max_boost_ns) {
			throttle(v, now + c->throttle_ns, PVS_R_MAX_BOOST, event, now);
			return;
		}
		if (c->budget_ns && used >= c->budget_ns) {
			__u64 until = v->window_start + c->window_ns;

			if (until < now + c->throttle_ns)
				until = now + c->throttle_ns;
			throttle(v, until, PVS_R_BUDGET, event, now);
			return;
		}
	}
	if (now < v->throttled_until)
		return; /* stays unboosted, throttled */
	v->throttled = 0;

	/* What the vCPU should have now. */
	if (v->state != PVS_ST_HALTED) {
		kind = v->req_kind;
		prio = v->req_prio;
		reason = v->req_reason;
	}
	if (v->state == PVS_ST_HALTED || v->state == PVS_ST_WOKEN) {
		hk = c->halt_kind;
		hp = c->halt_prio;
		caps_clamp(c, &hk, &hp);
		if (boost_rank(hk, hp) > boost_rank(kind, prio)) {
			kind = hk;
			prio = hp;
			reason = PVS_R_HALT;
		}
	}
	if (v->yield_mask) {
		yk = c->yield_kind;
		yp = c->yield_prio;
		caps_clamp(c, &yk, &yp);
		if (boost_rank(yk, yp) > boost_rank(kind, prio)) {
			kind = yk;
			prio = yp;
			reason = PVS_R_YIELD;
		}
	}
	if (kind == v->boost && prio == v->boost_prio)
		return;
	if (kind == PVSCHED_BOOST_NONE) {
		boost_end(v, now);
		STAT_INC(unboosts);
	} else if (v->boost == PVSCHED_BOOST_NONE) {
		v->boost_start = now;
		v->acct_start = now;
		v->boosts++;
		STAT_INC(boosts);
	}
	v->boost = kind;
	v->boost_prio = prio;
	v->boost_reason = reason;
	emit(v, event, now);
}

#endif
