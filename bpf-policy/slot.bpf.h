/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched BPF policy: reading the guest half and publishing the host half of
 * a vCPU's region slot, in both region modes. Every guest value is clamped;
 * a torn read (odd or changed seq) keeps the last valid request.
 */
#ifndef PVSCHED_SLOT_BPF_H
#define PVSCHED_SLOT_BPF_H

/* Pointer to slot `index` of device-region VM `vm_id`, or NULL. */
static __always_inline struct pvsched_slot *device_slot(__u32 vm_id, __u32 nr, __u32 index)
{
	__u32 key = vm_id, zero = 0;
	void *inner = bpf_map_lookup_elem(&regions, &key);
	__u8 *base;
	__u32 off;

	if (!inner)
		return NULL;
	base = bpf_map_lookup_elem(inner, &zero);
	if (!base || index >= nr || nr > PVS_MAX_VCPUS_PER_VM)
		return NULL;
	off = pvsched_slots_offset(nr) + PVSCHED_SLOT_SIZE * index;
	if (off > PVS_REGION_STRIDE - PVSCHED_SLOT_SIZE)
		return NULL;
	return (struct pvsched_slot *)(base + off);
}

/* Guest request before caps: best of critical section and running task. */
static __always_inline __u32 boost_rank(__u32 kind, __s32 prio)
{
	if (kind == PVSCHED_BOOST_RT)
		return 1000 + (__u32)prio;
	if (kind == PVSCHED_BOOST_NICE)
		return 100 + (__u32)(20 - prio);
	return 0;
}

/* Clamp a boost to the VM's caps; NONE if nothing is left of it. */
static __always_inline void caps_clamp(const struct pvs_caps *c, __u32 *kind, __s32 *prio)
{
	if (*kind == PVSCHED_BOOST_RT) {
		if (!c->allow_rt || c->max_rt_prio == 0) {
			*kind = PVSCHED_BOOST_NICE;
			*prio = c->nice_floor;
		} else {
			__s32 max = c->max_rt_prio > 99 ? 99 : (__s32)c->max_rt_prio;

			if (*prio > max)
				*prio = max;
			if (*prio < 1)
				*prio = 1;
		}
	}
	if (*kind == PVSCHED_BOOST_NICE) {
		if (*prio < c->nice_floor)
			*prio = c->nice_floor;
		if (*prio < PVSCHED_NICE_MIN)
			*prio = PVSCHED_NICE_MIN;
		if (*prio >= 0) {
			*kind = PVSCHED_BOOST_NONE;
			*prio = 0;
		}
	}
	if (*kind != PVSCHED_BOOST_RT && *kind != PVSCHED_BOOST_NICE) {
		*kind = PVSCHED_BOOST_NONE;
		*prio = 0;
	}
}

/* Derive the capped request from guest fields; store it in v. */
static __always_inline void set_request(struct pvs_vcpu *v, struct pvs_vm *vm, __u64 now,
					__u32 kern_cs, __u32 policy, __s32 nice,
					__u32 rt_prio, __u32 wait_on, __u32 flags)
{
	__u32 kind = PVSCHED_BOOST_NONE, reason = PVS_R_NONE;
	__s32 prio = 0;
	__u32 tkind = PVSCHED_BOOST_NONE, treason = PVS_R_NONE;
	__s32 tprio = 0;

	/* cs_rt_prio 0: critical sections ask for nothing. */
	if ((kern_cs & PVSCHED_CS_ALL) && vm->caps.cs_rt_prio) {
		kind = PVSCHED_BOOST_RT;
		prio = vm->caps.cs_rt_prio > 99 ? 99 : (__s32)vm->caps.cs_rt_prio;
		reason = PVS_R_CS;
	}
	if (policy == PVSCHED_POLICY_FIFO || policy == PVSCHED_POLICY_RR) {
		tkind = PVSCHED_BOOST_RT;
		tprio = rt_prio > 99 ? 99 : (rt_prio < 1 ? 1 : (__s32)rt_prio);
		treason = PVS_R_RT_TASK;
	} else if (policy == PVSCHED_POLICY_DEADLINE) {
		tkind = PVSCHED_BOOST_RT;
		tprio = 99;
		treason = PVS_R_RT_TASK;
	} else if ((policy == PVSCHED_POLICY_NORMAL || policy == PVSCHED_POLICY_BATCH) && nice < 0) {
		tkind = PVSCHED_BOOST_NICE;
		tprio = nice < PVSCHED_NICE_MIN ? PVSCHED_NICE_MIN : nice;
		treason = PVS_R_NICE_TASK;
	}
	if (boost_rank(tkind, tprio) > boost_rank(kind, prio)) {
		kind = tkind;
		prio = tprio;
		reason = treason;
	}
	caps_clamp(&vm->caps, &kind, &prio);
	if (kind == PVSCHED_BOOST_NONE)
		reason = PVS_R_NONE;
	v->req_kind = kind;
	v->req_prio = prio;
	v->req_reason = reason;
	/* The guest's own RT task makes the vCPU latency-sensitive, whether or
	 * not a critical section at the same priority is the reason of the
	 * boost. A kernel thread's RT does not (every guest runs the stopper
	 * at FIFO 99 for the soft-lockup watchdog every few seconds), nor does
	 * a critical section alone (every guest takes timer interrupts and
	 * softirqs): a batch guest would hold the halt boost, and spend its
	 * budget at FIFO, for ever. Those boosts last while the slot shows
	 * them. */
	if (treason == PVS_R_RT_TASK && !(flags & PVSCHED_TASK_F_KTHREAD) &&
	    kind != PVSCHED_BOOST_NONE) {
		v->ls_until = now + vm->caps.halt_hold_ns;
		/* The halt boost holds this priority until ls_until: one
		 * priority across the vCPU's halts, not a flip (and a
		 * sched_setattr) at every halt and every wake-up. */
		v->ls_prio = kind == PVSCHED_BOOST_RT ? prio : 0;
		/* The VM's emulator threads follow its latest latency-sensitive
		 * vCPU (a lost race between two CPUs only shortens a hold that
		 * the next request renews). */
		if (vm->ls_until < v->ls_until)
			vm->ls_until = v->ls_until;
	}
	/* WAIT_ANY (a lock spinner; F_LOCK_WAIT) is kept as it is: yield_update()
	 * resolves it to a vCPU each time the slot is read. */
	if (wait_on == PVSCHED_WAIT_ANY) {
		if (!vm->lock_wait_enabled || vm->nr_vcpus < 2)
			wait_on = PVSCHED_WAIT_NONE;
	} else if (!vm->wait_on_enabled || READ_ONCE(v->wait_on_off) || wait_on > vm->nr_vcpus ||
		   wait_on == v->index + 1) {
		wait_on = PVSCHED_WAIT_NONE;
	}
	v->wait_on = wait_on;
	v->guest_idle = !!(flags & PVSCHED_TASK_F_IDLE);
}

/* v's slot in a device-region VM, else NULL. */
static __always_inline struct pvsched_slot *vcpu_slot(const struct pvs_vcpu *v,
						      const struct pvs_vm *vm)
{
	if (vm->mode != PVS_MODE_DEVICE)
		return NULL;
	return device_slot(v->vm_id, vm->nr_vcpus, v->index);
}

/* Refresh v's request from its slot if this context can read it; `s` is
 * vcpu_slot(v, vm), looked up once per event by the caller. */
static __always_inline void refresh_request(struct pvs_vcpu *v, struct pvs_vm *vm,
					    struct pvsched_slot *s, __u32 cur_tid, __u64 now)
{
	struct pvsched_slot_guest g;
	__u32 seq2;

	if (vm->mode == PVS_MODE_DEVICE) {
		if (!s)
			return;
		g.seq = READ_ONCE(s->guest.seq);
		barrier();
		g.kern_cs = READ_ONCE(s->guest.kern_cs);
		g.policy = READ_ONCE(s->guest.policy);
		g.nice = READ_ONCE(s->guest.nice);
		g.rt_prio = READ_ONCE(s->guest.rt_prio);
		g.wait_on = READ_ONCE(s->guest.wait_on);
		g.flags = READ_ONCE(s->guest.flags);
		barrier();
		seq2 = READ_ONCE(s->guest.seq);
	} else if (vm->mode == PVS_MODE_GUEST) {
		/* Only in the vCPU thread's own context is the VMM's mm current. */
		if (cur_tid != v->tid || !v->slot_addr)
			return;
		if (bpf_probe_read_user(&g, sizeof(g), (const void *)v->slot_addr)) {
			STAT_INC(read_errors);
			return;
		}
		seq2 = g.seq;
	} else {
		return;
	}
	if ((g.seq & 1) || g.seq != seq2) {
		STAT_INC(torn_reads);
		return;
	}
	set_request(v, vm, now, g.kern_cs, g.policy, g.nice, g.rt_prio, g.wait_on, g.flags);
}

/* Publish v's host-visible state into the host half of its device slot `s`
 * (NULL: no region to publish into). A global function, so the verifier
 * checks it once rather than at every inlined call site (its claim loop
 * would multiply the states of each). */
__noinline int pvs_publish(const struct pvs_vcpu *v, struct pvsched_slot *s)
{
	__u32 st, seq = 1;
	int i;

	if (!v || !s)
		return 0;
	st = v->state == PVS_ST_WOKEN ? PVSCHED_VCPU_PREEMPTED : v->state;
	/* Most events change nothing the guest reads (a userspace exit of a
	 * running vCPU, an unboosted vCPU's wake-up after its switch-in): the
	 * half is left as it is, with no locked instruction and no store to
	 * the line the guest reads. (Only this guest can make the half look
	 * current when it is not, and only to itself.) */
	seq = READ_ONCE(s->host.seq);
	if (!(seq & 1) && READ_ONCE(s->host.vcpu_state) == st &&
	    READ_ONCE(s->host.boost) == v->boost &&
	    READ_ONCE(s->host.boost_prio) == v->boost_prio &&
	    READ_ONCE(s->host.throttled) == v->throttled &&
	    READ_ONCE(s->host.yield_target) == v->yield_slot &&
	    READ_ONCE(s->host.boosts) == v->boosts &&
	    READ_ONCE(s->host.throttles) == v->throttles &&
	    READ_ONCE(s->host.boosted_ns) == v->boosted_ns)
		return 1;
	/* Two CPUs may publish one vCPU at once (two of its events), and two
	 * plain increments can interleave into an odd seq that no reader ever
	 * gets past. So a writer claims the half by moving seq from even to
	 * odd with a compare-and-swap, waiting briefly while another holds it
	 * (a BPF program runs to completion). If it never gets it, the other
	 * writer's copy stands until v's next publish. */
	for (i = 0; i < 64; i++) {
		seq = READ_ONCE(s->host.seq);
		if (!(seq & 1) && __sync_val_compare_and_swap(&s->host.seq, seq, seq + 1) == seq)
			break;
		seq = 1;
	}
	if (seq & 1) {
		STAT_INC(publish_busy);
		return 0;
	}
	WRITE_ONCE(s->host.vcpu_state, st);
	WRITE_ONCE(s->host.boost, v->boost);
	WRITE_ONCE(s->host.boost_prio, v->boost_prio);
	WRITE_ONCE(s->host.throttled, v->throttled);
	WRITE_ONCE(s->host.yield_target, v->yield_slot);
	WRITE_ONCE(s->host.boosts, v->boosts);
	WRITE_ONCE(s->host.throttles, v->throttles);
	WRITE_ONCE(s->host.boosted_ns, v->boosted_ns);
	barrier();
	WRITE_ONCE(s->host.seq, seq + 2);
	return 1;
}

/* Publish a vCPU other than the event's own (its slot is looked up here). */
static __always_inline void publish(const struct pvs_vcpu *v, const struct pvs_vm *vm)
{
	pvs_publish(v, vcpu_slot(v, vm));
}

#endif
