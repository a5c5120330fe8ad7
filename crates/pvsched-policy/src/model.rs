//! The policy state machine, the same step for step as `bpf-policy/`
//! (`policy.bpf.h`, `slot.bpf.h`, `budget.bpf.h`, `ipi.bpf.h`): unsigned
//! arithmetic wraps where the C wraps, and the order of operations is the
//! same, so a trace gives the same decisions through both.
//!
//! Per event for a vCPU: charge the boosted on-CPU time since its last
//! event (only a boosted vCPU on a CPU pays), update its run state, refresh
//! its guest request, update its directed-yield slot, re-evaluate its boost
//! (throttling it, and its waiting group with it, when a limit is reached),
//! then re-evaluate the yield targets it released or now waits on.

use crate::caps::{Caps, KickPairs, WaitOn};
use crate::event::*;
use crate::intf::PvsVcpu;
use pvsched_abi::{
    BOOST_NICE, BOOST_NONE, BOOST_RT, CS_ALL, NICE_MIN, POLICY_BATCH, POLICY_DEADLINE, POLICY_FIFO,
    POLICY_NORMAL, POLICY_RR, TASK_F_IDLE, TASK_F_KTHREAD, WAIT_ANY, WAIT_NONE,
};

/// Model of one VM: caps, vCPUs, the guest halves of the slots, APIC IDs.
#[derive(Clone, Debug)]
pub struct VmModel {
    /// vm_id used in gids.
    pub vm_id: u32,
    /// Caps.
    pub caps: Caps,
    /// vCPUs by slot index, then the emulator threads (index `nr_vcpus..`).
    pub vcpus: Vec<PvsVcpu>,
    /// Number of vCPUs (slots); the rest of `vcpus` are emulator threads.
    pub nr_vcpus: u32,
    /// Some vCPU is latency-sensitive until this time (`pvs_vm.ls_until`).
    pub ls_until: u64,
    /// Start of the VM's budget window (`pvs_vm.window_start`).
    pub window_start: u64,
    /// Boosted on-CPU ns of all its threads in this window
    /// (`pvs_vm.budget_used`).
    pub budget_used: u64,
    /// Guest halves by slot index.
    pub slots: Vec<GuestFields>,
    /// APIC ID of each slot.
    pub apic_ids: Vec<u32>,
    /// Features the driver negotiated, as the region header says
    /// (`driver_features` in maps.bpf.h; 0 = unknown).
    pub driver_features: u64,
}

/// Orders boosts: any RT above any nice, higher RT priority and lower nice
/// above the rest, NONE lowest (`boost_rank` in slot.bpf.h).
pub fn boost_rank(kind: u32, prio: i32) -> u32 {
    if kind == BOOST_RT {
        return 1000u32.wrapping_add(prio as u32);
    }
    if kind == BOOST_NICE {
        return 100u32.wrapping_add(20i32.wrapping_sub(prio) as u32);
    }
    0
}

/// Clamps a boost to the caps (`caps_clamp` in slot.bpf.h).
pub fn caps_clamp(c: &Caps, kind: &mut u32, prio: &mut i32) {
    if *kind == BOOST_RT {
        if !c.allow_rt || c.max_rt_prio == 0 {
            *kind = BOOST_NICE;
            *prio = c.nice_floor;
        } else {
            let max = if c.max_rt_prio > 99 {
                99
            } else {
                c.max_rt_prio as i32
            };
            if *prio > max {
                *prio = max;
            }
            if *prio < 1 {
                *prio = 1;
            }
        }
    }
    if *kind == BOOST_NICE {
        if *prio < c.nice_floor {
            *prio = c.nice_floor;
        }
        if *prio < NICE_MIN {
            *prio = NICE_MIN;
        }
        if *prio >= 0 {
            *kind = BOOST_NONE;
            *prio = 0;
        }
    }
    if *kind != BOOST_RT && *kind != BOOST_NICE {
        *kind = BOOST_NONE;
        *prio = 0;
    }
}

/// The next boost below a clamped `kind`/`prio` within the caps (`step_below`
/// in budget.bpf.h): RT p → RT p−1, RT 1 → the nice floor, nice n → n+1,
/// down to NONE.
pub fn step_below(c: &Caps, kind: &mut u32, prio: &mut i32) {
    if *kind == BOOST_RT {
        if *prio > 1 {
            *prio -= 1;
        } else {
            *kind = BOOST_NICE;
            *prio = c.nice_floor;
        }
    } else if *kind == BOOST_NICE {
        *prio = prio.wrapping_add(1);
    }
    caps_clamp(c, kind, prio);
}

/// The caps' boost `kind`/`prio` for a role (halt, yield), clamped.
/// Whether a budget window that started at `start` is over at `now`
/// (`window_over` in budget.bpf.h): signed, so an event whose clock read
/// is older than a window just started sees that window as current.
fn window_over(now: u64, start: u64, window: u64) -> bool {
    now.wrapping_sub(start) as i64 >= window as i64
}

fn clamped(c: &Caps, kind: u32, prio: i32) -> (u32, i32) {
    let (mut k, mut p) = (kind, prio);
    caps_clamp(c, &mut k, &mut p);
    (k, p)
}

impl VmModel {
    /// A VM (vm_id 0) with one vCPU per thread id.
    pub fn new(caps: Caps, tids: &[u32], apic_ids: &[u32]) -> VmModel {
        VmModel::with_emulators(caps, tids, apic_ids, &[])
    }

    /// A VM (vm_id 0) with one vCPU per thread id in `tids` and the
    /// emulator threads `emulator_tids` after them: they have no slot and
    /// hold the halt boost while any vCPU is latency-sensitive.
    pub fn with_emulators(
        caps: Caps,
        tids: &[u32],
        apic_ids: &[u32],
        emulator_tids: &[u32],
    ) -> VmModel {
        let vcpus = tids
            .iter()
            .chain(emulator_tids)
            .enumerate()
            .map(|(i, &tid)| PvsVcpu {
                tid,
                index: i as u32,
                ..Default::default()
            })
            .collect();
        VmModel {
            vm_id: 0,
            caps,
            vcpus,
            nr_vcpus: tids.len() as u32,
            ls_until: 0,
            window_start: 0,
            budget_used: 0,
            slots: vec![GuestFields::default(); tids.len()],
            apic_ids: apic_ids.to_vec(),
            driver_features: 0,
        }
    }

    fn nr(&self) -> u32 {
        self.nr_vcpus
    }

    fn gid(&self, index: u32) -> u32 {
        crate::event::gid(self.vm_id, index)
    }

    /// Runs one event at time `now`; returns the decisions it emitted.
    /// Events naming a vCPU that does not exist do nothing.
    pub fn step(&mut self, now: u64, ev: Event) -> Vec<Decision> {
        let mut out = Vec::new();
        if let Event::GuestWrite { vcpu, guest } = ev {
            if let Some(s) = self.slots.get_mut(vcpu as usize) {
                *s = guest;
            }
            return out;
        }
        let Some((code, vcpu, a, b)) = ev.encode() else {
            return out;
        };
        if vcpu as usize >= self.vcpus.len() {
            return out;
        }
        let i = vcpu as usize;
        // Charge the time up to now in the state the vCPU was in.
        self.charge(i, now);
        {
            let v = &mut self.vcpus[i];
            match code {
                EV_SWITCH_OUT if a != 0 => v.state = ST_PREEMPTED,
                EV_SWITCH_OUT => {
                    v.state = ST_HALTED;
                    v.cont_ns = 0;
                }
                EV_VCPU_WAKEUP => {
                    v.state = ST_RUNNING;
                    v.cont_ns = 0;
                }
                // An IPI or a kick runs in the vCPU's own thread: it is on
                // a CPU even if its switch in was never recorded.
                EV_SWITCH_IN | EV_USER_EXIT | EV_IPI | EV_KICK => v.state = ST_RUNNING,
                EV_WAKEUP => {
                    v.state = ST_WOKEN;
                    if v.sync_since != 0 && now > v.sync_since {
                        v.sync_wait_ns += now - v.sync_since;
                    }
                    v.sync_since = 0;
                }
                _ => {}
            }
        }
        // A halt while a sibling is preempted: what co-scheduling serves.
        if code == EV_SWITCH_OUT && a == 0 && vcpu < self.nr_vcpus && self.first_preempted(i) != 0 {
            self.vcpus[i].sync_halts += 1;
            self.vcpus[i].sync_since = now;
        }
        // Only a vCPU sends IPIs (an emulator thread never runs KVM_RUN).
        if code == EV_IPI && vcpu < self.nr_vcpus {
            self.ipi_record(i, a as u32, b as u32, now);
        }
        if code == EV_KICK && vcpu < self.nr_vcpus {
            self.kick_record(i, a as u32, now);
        }
        self.refresh_request(i, now);
        let (old_t, new_t) = self.yield_update(i, now);
        if old_t != new_t {
            self.yield_mark(old_t, vcpu, false, now, code, &mut out);
            self.yield_mark(new_t, vcpu, true, now, code, &mut out);
        }
        self.apply_boost(i, now, code, old_t != new_t, &mut out);
        out
    }

    /// Charges the boosted on-CPU time since the last charge to the thread
    /// and its VM (`charge` in budget.bpf.h): only a boosted vCPU that is
    /// on a CPU pays.
    fn charge(&mut self, i: usize, now: u64) {
        let v = &mut self.vcpus[i];
        if now > v.acct_ns {
            if v.boost != BOOST_NONE && v.state == ST_RUNNING {
                let d = now - v.acct_ns;
                v.budget_used = v.budget_used.wrapping_add(d);
                v.cont_ns = v.cont_ns.wrapping_add(d);
                v.boosted_ns = v.boosted_ns.wrapping_add(d);
                self.budget_used = self.budget_used.wrapping_add(d);
            }
            v.acct_ns = now;
        }
    }

    /// Starts the VM's next budget window once the current one is over,
    /// then says whether its boosted on-CPU time in it has reached
    /// `vm_budget_us` (`vm_spent` in budget.bpf.h).
    fn vm_spent(&mut self, now: u64) -> bool {
        let window = Caps::ns(self.caps.window_us);
        if window != 0 && window_over(now, self.window_start, window) {
            self.window_start = now;
            self.budget_used = 0;
        }
        self.budget_used >= self.caps.vm_budget_ns()
    }

    fn ipi_record(&mut self, i: usize, dest_id: u32, icr_low: u32, now: u64) {
        if (icr_low >> 18) & 3 != 0 || (icr_low >> 8) & 7 != 0 || icr_low & (1 << 11) != 0 {
            return;
        }
        // The BPF map keeps the last registration of a duplicate APIC ID.
        let Some(idx) = self.apic_ids.iter().rposition(|&a| a == dest_id) else {
            return;
        };
        let idx = idx as u32;
        if idx == self.vcpus[i].index || idx >= MAX_VCPUS_PER_VM {
            return;
        }
        self.pair_confirm(i, idx, now);
    }

    /// vCPU `i`'s pair with slot `idx` is confirmed now (`pair_confirm` in
    /// ipi.bpf.h).
    fn pair_confirm(&mut self, i: usize, idx: u32, now: u64) {
        let v = &mut self.vcpus[i];
        v.last_ipi_target = idx + 1;
        v.last_ipi_ns = now;
        v.ipis += 1;
    }

    /// Whether kicks pair at all (`kick_pairs_vm` in maps.bpf.h): always,
    /// or (auto) for a guest that negotiated a region but not `F_WAIT_ON`.
    fn kick_pairs_on(&self) -> bool {
        let f = self.driver_features & 0xffff_ffff;
        match self.caps.kick_pairs {
            KickPairs::On => true,
            KickPairs::Off => false,
            KickPairs::Auto => {
                f & (pvsched_abi::F_DEVICE_REGION | pvsched_abi::F_GUEST_REGION) != 0
                    && f & pvsched_abi::F_WAIT_ON == 0
            }
        }
    }

    /// vCPU `i`'s thread woke vCPU `target`'s (`kick_record` in ipi.bpf.h).
    fn kick_record(&mut self, i: usize, target: u32, now: u64) {
        let nr = self.nr();
        if target == self.vcpus[i].index
            || target >= nr
            || target >= MAX_VCPUS_PER_VM
            // Auto: only a boosted sender's kick counts.
            || (self.caps.kick_pairs == KickPairs::Auto && self.vcpus[i].boost == BOOST_NONE)
            || !self.kick_pairs_on()
            || self.vcpus[target as usize].guest_idle == 0
        {
            return;
        }
        let win = Caps::ns(self.caps.ipi_window_us);
        let v = &mut self.vcpus[i];
        // The second kick of the same vCPU within the window confirms.
        if v.last_kick_target != target + 1 || now.wrapping_sub(v.last_kick_ns) > win {
            v.last_kick_target = target + 1;
            v.last_kick_ns = now;
            return;
        }
        v.last_kick_ns = now;
        self.pair_confirm(i, target, now);
    }

    fn refresh_request(&mut self, i: usize, now: u64) {
        // An emulator thread has no slot.
        let Some(&g) = self.slots.get(i) else {
            return;
        };
        let c = &self.caps;
        let nr = self.nr_vcpus;
        let v = &mut self.vcpus[i];
        let (mut kind, mut prio, mut reason) = (BOOST_NONE, 0i32, R_NONE);
        let (mut tkind, mut tprio, mut treason) = (BOOST_NONE, 0i32, R_NONE);
        // cs_rt_prio 0: critical sections ask for nothing.
        if g.kern_cs & CS_ALL != 0 && c.cs_rt_prio != 0 {
            kind = BOOST_RT;
            prio = if c.cs_rt_prio > 99 {
                99
            } else {
                c.cs_rt_prio as i32
            };
            reason = R_CS;
        }
        if g.policy == POLICY_FIFO || g.policy == POLICY_RR {
            tkind = BOOST_RT;
            tprio = if g.rt_prio > 99 {
                99
            } else if g.rt_prio < 1 {
                1
            } else {
                g.rt_prio as i32
            };
            treason = R_RT_TASK;
        } else if g.policy == POLICY_DEADLINE {
            tkind = BOOST_RT;
            tprio = 99;
            treason = R_RT_TASK;
        } else if (g.policy == POLICY_NORMAL || g.policy == POLICY_BATCH) && g.nice < 0 {
            tkind = BOOST_NICE;
            tprio = if g.nice < NICE_MIN { NICE_MIN } else { g.nice };
            treason = R_NICE_TASK;
        }
        if boost_rank(tkind, tprio) > boost_rank(kind, prio) {
            kind = tkind;
            prio = tprio;
            reason = treason;
        }
        caps_clamp(c, &mut kind, &mut prio);
        if kind == BOOST_NONE {
            reason = R_NONE;
        }
        v.req_kind = kind;
        v.req_prio = prio;
        v.req_reason = reason;
        // Only the guest's own RT task makes the vCPU latency-sensitive,
        // whichever reason won; not a kernel thread's, not a critical
        // section (slot.bpf.h says why).
        if treason == R_RT_TASK && g.flags & TASK_F_KTHREAD == 0 && kind != BOOST_NONE {
            v.ls_until = now.wrapping_add(Caps::ns(c.halt_hold_us));
            v.ls_prio = if kind == BOOST_RT { prio } else { 0 };
            if self.ls_until < v.ls_until {
                self.ls_until = v.ls_until;
            }
        }
        // WAIT_ANY (a lock spinner) is kept as it is: yield_update resolves
        // it to a vCPU each time the slot is read.
        let mut wait_on = g.wait_on;
        if wait_on == WAIT_ANY {
            if !c.lock_wait || nr < 2 {
                wait_on = WAIT_NONE;
            }
        } else if c.wait_on == WaitOn::Off || wait_on > nr || wait_on == v.index + 1 {
            wait_on = WAIT_NONE;
        }
        v.wait_on = wait_on;
        v.guest_idle = u32::from(g.flags & TASK_F_IDLE != 0);
    }

    /// The vCPU lock spinner `i` (`wait_on` = `WAIT_ANY`) lends its yield
    /// boost to (`lock_target` in ipi.bpf.h): its current slot while that
    /// vCPU runs or is preempted, else the first preempted vCPU after it in
    /// slot order, else none.
    fn lock_target(&self, i: usize) -> u32 {
        let nr = self.nr();
        let s = &self.vcpus[i];
        let cur = s.yield_slot;
        if cur != 0 && cur <= nr && cur != s.index + 1 {
            let st = self.vcpus[(cur - 1) as usize].state;
            if st == ST_RUNNING || st == ST_PREEMPTED {
                return cur;
            }
        }
        self.first_preempted(i)
    }

    /// The first preempted vCPU after `i` in slot order (slot index + 1),
    /// or 0 (`first_preempted` in ipi.bpf.h).
    fn first_preempted(&self, i: usize) -> u32 {
        let nr = self.nr();
        let s = &self.vcpus[i];
        if !(2..=MAX_VCPUS_PER_VM).contains(&nr) || s.index >= nr {
            return 0;
        }
        (1..nr)
            .map(|k| (s.index + k) % nr)
            .find(|&j| self.vcpus[j as usize].state == ST_PREEMPTED)
            .map_or(0, |j| j + 1)
    }

    fn yield_update(&mut self, i: usize, now: u64) -> (u32, u32) {
        let win = Caps::ns(self.caps.ipi_window_us);
        let slot = match self.vcpus[i].wait_on {
            WAIT_ANY => self.lock_target(i),
            WAIT_NONE => {
                let v = &self.vcpus[i];
                if v.last_ipi_target != 0 && now.wrapping_sub(v.last_ipi_ns) <= win {
                    v.last_ipi_target
                } else {
                    0
                }
            }
            w => w,
        };
        let v = &mut self.vcpus[i];
        v.yield_slot = slot;
        // The slot's target is lent the yield boost for as long as the slot
        // holds (the guest's wait_on, or a pair confirmed within the IPI
        // window), not only while the sender waits: the boost is in place
        // before the next IPI and a round trip makes no decision. A
        // throttled sender lends nothing.
        let target = if now >= v.throttled_until { slot } else { 0 };
        if target == v.yield_boosting {
            return (0, 0);
        }
        let old = v.yield_boosting;
        v.yield_boosting = target;
        if target != 0 {
            v.slot_hits += 1;
        }
        (old, target)
    }

    fn yield_mark(
        &mut self,
        target1: u32,
        sender: u32,
        set: bool,
        now: u64,
        event: u32,
        out: &mut Vec<Decision>,
    ) {
        if target1 == 0 || sender >= 64 || target1 > self.nr() {
            return;
        }
        let t = (target1 - 1) as usize;
        if set {
            self.vcpus[t].yield_mask |= 1u64 << sender;
        } else {
            self.vcpus[t].yield_mask &= !(1u64 << sender);
        }
        self.apply_boost(t, now, event, false, out);
    }

    /// Records vCPU `i`'s boost, throttle and waiting target (`emit` in
    /// budget.bpf.h; the BPF wake-up flag is not modelled).
    fn emit(&self, i: usize, event: u32, now: u64, out: &mut Vec<Decision>) {
        let v = &self.vcpus[i];
        out.push(Decision {
            ts: now,
            tid: v.tid,
            gid: self.gid(v.index),
            kind: v.boost,
            prio: v.boost_prio,
            reason: v.boost_reason,
            event,
            throttled_until: v.throttled_until,
            waits_on: v.yield_boosting,
            pad0: 0,
        });
    }

    /// Re-evaluates vCPU `i`'s boost (`apply_boost` in budget.bpf.h);
    /// `waits_changed`: its waiting target just changed, which is recorded
    /// even when its boost does not change.
    fn apply_boost(
        &mut self,
        i: usize,
        now: u64,
        event: u32,
        waits_changed: bool,
        out: &mut Vec<Decision>,
    ) {
        self.charge(i, now);
        let c = self.caps.clone();
        let (max_boost, throttle, budget, window) = (
            Caps::ns(c.max_boost_us),
            Caps::ns(c.throttle_us),
            Caps::ns(c.budget_us),
            Caps::ns(c.window_us),
        );
        let v = &mut self.vcpus[i];
        if window != 0 && window_over(now, v.window_start, window) {
            v.window_start = now;
            v.budget_used = 0;
        }
        let spent = self.vm_spent(now);
        let v = &self.vcpus[i];
        if v.boost != BOOST_NONE {
            if max_boost != 0 && v.cont_ns >= max_boost {
                let until = now.wrapping_add(throttle);
                self.throttle(i, until, R_MAX_BOOST, event, now, out);
                return;
            }
            let limit = if budget != 0 && v.budget_used >= budget {
                Some((R_BUDGET, v.window_start))
            } else if spent {
                Some((R_VM_BUDGET, self.window_start))
            } else {
                None
            };
            if let Some((why, start)) = limit {
                let mut until = start.wrapping_add(window);
                if until < now.wrapping_add(throttle) {
                    until = now.wrapping_add(throttle);
                }
                self.throttle(i, until, why, event, now, out);
                return;
            }
        }
        // The VM spent its budget: no thread gets a new boost until its
        // next window.
        if now < v.throttled_until || spent {
            return;
        }
        let v = &mut self.vcpus[i];
        v.throttled = 0;
        let (mut kind, mut prio, mut reason) = (BOOST_NONE, 0i32, R_NONE);
        if v.state != ST_HALTED {
            kind = v.req_kind;
            prio = v.req_prio;
            reason = v.req_reason;
        }
        let emulator = v.index >= self.nr_vcpus;
        if c.halt_always || now < v.ls_until || (emulator && now < self.ls_until) {
            let held =
                c.halt_boost.abi() == BOOST_RT && now < v.ls_until && v.ls_prio > c.halt_prio;
            let hp = if held { v.ls_prio } else { c.halt_prio };
            let (hk, hp) = clamped(&c, c.halt_boost.abi(), hp);
            if boost_rank(hk, hp) > boost_rank(kind, prio) {
                kind = hk;
                prio = hp;
                reason = R_HALT;
            }
        }
        let (yk, yp) = clamped(&c, c.yield_boost.abi(), c.yield_prio);
        if v.yield_mask != 0 && boost_rank(yk, yp) > boost_rank(kind, prio) {
            kind = yk;
            prio = yp;
            reason = R_YIELD;
        }
        // A sender that says it spins on its target (wait_on) stays one
        // step below the boost its target gets; any sender has none while
        // its target is throttled.
        if v.yield_boosting != 0
            && v.wait_on != 0
            && yk != BOOST_NONE
            && boost_rank(kind, prio) >= boost_rank(yk, yp)
        {
            let (mut sk, mut sp) = (yk, yp);
            step_below(&c, &mut sk, &mut sp);
            kind = sk;
            prio = sp;
        }
        let t = v.yield_boosting as usize;
        if t != 0 && t <= self.vcpus.len() && now < self.vcpus[t - 1].throttled_until {
            kind = BOOST_NONE;
            prio = 0;
        }
        if kind == BOOST_NONE {
            reason = R_NONE;
        }
        let v = &mut self.vcpus[i];
        if kind == v.boost && prio == v.boost_prio {
            v.boost_reason = reason;
            if waits_changed && kind != BOOST_NONE {
                self.emit(i, event, now, out);
            }
            return;
        }
        if kind != BOOST_NONE && v.boost == BOOST_NONE {
            v.boosts += 1;
        }
        v.boost = kind;
        v.boost_prio = prio;
        v.boost_reason = reason;
        self.emit(i, event, now, out);
    }

    /// Ends vCPU `i`'s boost as throttled until `until`, then throttles the
    /// rest of its waiting group (`throttle` in budget.bpf.h).
    fn throttle(
        &mut self,
        i: usize,
        until: u64,
        reason: u32,
        event: u32,
        now: u64,
        out: &mut Vec<Decision>,
    ) {
        let v = &mut self.vcpus[i];
        v.throttled_until = until;
        v.throttled = 1;
        v.throttles += 1;
        v.cont_ns = 0;
        v.boost = BOOST_NONE;
        v.boost_prio = 0;
        v.boost_reason = reason;
        self.unit_throttle(i, until, event, now, out);
        self.emit(i, event, now, out);
    }

    /// A throttled vCPU lends nothing: clear its bit in its target's mask
    /// (`end_lend` in ipi.bpf.h). The target is throttled with it.
    fn end_lend(&mut self, j: usize) {
        let t = self.vcpus[j].yield_boosting as usize;
        self.vcpus[j].yield_boosting = 0;
        if t != 0 && t <= self.vcpus.len() && j < 64 {
            self.vcpus[t - 1].yield_mask &= !(1u64 << j);
        }
    }

    /// A waiting pair is throttled as one unit (`unit_throttle` in
    /// budget.bpf.h): the target `i` waits on is throttled with it, and every
    /// sender waiting on either loses its boost at once (it gets none while
    /// its target is throttled). Then `i` lends nothing.
    fn unit_throttle(
        &mut self,
        i: usize,
        until: u64,
        event: u32,
        now: u64,
        out: &mut Vec<Decision>,
    ) {
        let nr = self.nr();
        let by = self.vcpus[i].yield_boosting;
        let mut mask = 0;
        if by != 0 && by <= nr {
            let g = (by - 1) as usize;
            self.force_throttle(g, until, event, now, out);
            mask = self.vcpus[g].yield_mask;
        }
        mask |= self.vcpus[i].yield_mask;
        for s in 0..nr.min(64) as usize {
            if s != i && mask & (1u64 << s) != 0 {
                self.unboost_sender(s, event, now, out);
            }
        }
        self.end_lend(i);
    }

    /// Throttles the target of a throttled sender (`force_throttle` in
    /// budget.bpf.h).
    fn force_throttle(
        &mut self,
        j: usize,
        until: u64,
        event: u32,
        now: u64,
        out: &mut Vec<Decision>,
    ) {
        let extended = self.vcpus[j].throttled_until < until;
        self.charge(j, now);
        let v = &mut self.vcpus[j];
        if extended {
            v.throttled_until = until;
        }
        v.throttled = 1;
        v.cont_ns = 0;
        let unboosted = v.boost != BOOST_NONE;
        if unboosted {
            v.throttles += 1;
            v.boost = BOOST_NONE;
            v.boost_prio = 0;
            v.boost_reason = R_THROTTLED;
        }
        self.end_lend(j);
        // An extended throttle is recorded too (trace-only record).
        if unboosted || extended {
            self.emit(j, event, now, out);
        }
    }

    /// Drops the boost of a sender whose target was just throttled
    /// (`unboost_sender_cb` in budget.bpf.h).
    fn unboost_sender(&mut self, j: usize, event: u32, now: u64, out: &mut Vec<Decision>) {
        self.charge(j, now);
        let v = &mut self.vcpus[j];
        if v.boost != BOOST_NONE {
            v.boost = BOOST_NONE;
            v.boost_prio = 0;
            v.boost_reason = R_THROTTLED;
            // Stamped no earlier than the sender's last charge, so a
            // trace keeps a boost from another CPU before this unboost.
            let ts = v.acct_ns.max(now);
            self.emit(j, event, ts, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caps::BoostKind;
    use pvsched_abi::{
        CS_HARDIRQ, CS_PREEMPT_OFF, CS_SOFTIRQ, F_DEVICE_REGION, F_KICK, F_LOCK_WAIT, F_TASK_FLAGS,
        F_WAIT_ON, POLICY_FIFO, TASK_F_RT_SLEEPER,
    };

    const MS: u64 = 1_000_000;

    fn vm2() -> VmModel {
        VmModel::new(Caps::default(), &[10, 11], &[0, 1])
    }

    /// Default caps with lock waits honoured (off by default).
    fn lock_wait_on() -> Caps {
        Caps {
            lock_wait: true,
            ..Caps::default()
        }
    }

    /// vm2 with critical sections asking for FIFO 1 (off by default).
    fn vm2_cs() -> VmModel {
        let caps = Caps {
            cs_rt_prio: 1,
            ..Caps::default()
        };
        VmModel::new(caps, &[10, 11], &[0, 1])
    }

    fn write(vm: &mut VmModel, vcpu: u32, guest: GuestFields) {
        vm.step(0, Event::GuestWrite { vcpu, guest });
    }

    fn rt(prio: u32) -> GuestFields {
        GuestFields {
            policy: POLICY_FIFO,
            rt_prio: prio,
            ..Default::default()
        }
    }

    /// The guest is in the kernel critical sections `bits`.
    fn cs(bits: u32) -> GuestFields {
        GuestFields {
            kern_cs: bits,
            ..Default::default()
        }
    }

    /// The guest waits on slot `on - 1` (`wait_on` is slot + 1).
    fn waits(on: u32) -> GuestFields {
        GuestFields {
            wait_on: on,
            ..Default::default()
        }
    }

    fn out(vcpu: u32, preempted: bool) -> Event {
        Event::SwitchOut { vcpu, preempted }
    }

    #[test]
    fn cs_boost_lasts_while_the_slot_shows_it_and_holds_nothing() {
        let mut vm = vm2_cs();
        write(&mut vm, 0, cs(CS_HARDIRQ));
        let d = vm.step(10, out(0, true));
        assert_eq!(d.len(), 1);
        assert_eq!(
            (d[0].kind, d[0].prio, d[0].reason, d[0].tid),
            (BOOST_RT, 1, R_CS, 10)
        );
        // Still in the section when it runs again: the boost stays.
        assert!(vm.step(20, Event::SwitchIn { vcpu: 0 }).is_empty());
        // The section ended: the next event drops the boost. A critical
        // section does not make the vCPU latency-sensitive (every guest
        // takes interrupts), so no halt boost follows.
        write(&mut vm, 0, GuestFields::default());
        let d = vm.step(30, Event::Tick { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_NONE));
        // 20..30 on a CPU, boosted: charged.
        assert_eq!(vm.vcpus[0].boosted_ns, 10);
        assert!(vm.step(40, out(0, false)).is_empty());
        assert_eq!(vm.vcpus[0].boost, BOOST_NONE);
        assert!(vm.step(50, Event::VcpuWakeup { vcpu: 0 }).is_empty());
        assert_eq!(vm.vcpus[0].boost, BOOST_NONE);
        assert_eq!(vm.ls_until, 0);
    }

    #[test]
    fn an_ipi_or_a_kick_says_the_vcpu_runs_without_its_switch_in() {
        // Some hosts never record a switch out of an idle task: a boosted
        // vCPU woken onto an idle CPU gets no SwitchIn. Its own IPI or
        // kick shows it on a CPU, and its boosted time is charged from
        // there.
        let mut vm = vm2_cs();
        write(&mut vm, 0, cs(CS_HARDIRQ));
        vm.step(10, out(0, true));
        assert_eq!(vm.vcpus[0].boost, BOOST_RT);
        vm.step(20, Event::Wakeup { vcpu: 0 });
        assert_eq!(vm.vcpus[0].state, ST_WOKEN);
        vm.step(
            30,
            Event::Ipi {
                vcpu: 0,
                dest_id: 1,
                icr_low: 0xfd,
            },
        );
        assert_eq!(vm.vcpus[0].state, ST_RUNNING);
        vm.step(40, Event::Tick { vcpu: 0 });
        assert_eq!(vm.vcpus[0].boosted_ns, 10);
        vm.step(50, out(0, true));
        vm.step(60, Event::Wakeup { vcpu: 0 });
        vm.step(70, Event::Kick { vcpu: 0, target: 1 });
        assert_eq!(vm.vcpus[0].state, ST_RUNNING);
    }

    #[test]
    fn cs_rt_prio_0_turns_critical_sections_off() {
        let caps = Caps {
            cs_rt_prio: 0,
            ..Caps::default()
        };
        let mut vm = VmModel::new(caps, &[1], &[0]);
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_HARDIRQ | CS_SOFTIRQ,
                ..Default::default()
            },
        );
        assert!(vm.step(5, out(0, true)).is_empty());
        assert_eq!(vm.vcpus[0].req_kind, BOOST_NONE);
        // An RT task still asks.
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_HARDIRQ,
                ..rt(2)
            },
        );
        let d = vm.step(6, Event::SwitchIn { vcpu: 0 });
        assert_eq!(
            (d[0].kind, d[0].prio, d[0].reason),
            (BOOST_RT, 2, R_RT_TASK)
        );
    }

    #[test]
    fn rt_prio_is_capped() {
        let mut vm = vm2();
        write(&mut vm, 1, rt(99));
        let d = vm.step(5, Event::Wakeup { vcpu: 1 });
        assert_eq!((d[0].kind, d[0].prio), (BOOST_RT, 4));
    }

    #[test]
    fn rt_not_allowed_becomes_nice_floor() {
        let caps = Caps {
            allow_rt: false,
            cs_rt_prio: 1,
            ..Caps::default()
        };
        let mut vm = VmModel::new(caps, &[1], &[0]);
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_PREEMPT_OFF,
                ..Default::default()
            },
        );
        let d = vm.step(5, out(0, true));
        assert_eq!((d[0].kind, d[0].prio), (BOOST_NICE, -10));
    }

    #[test]
    fn a_plain_vm_gets_no_halt_boost() {
        let mut vm = vm2();
        assert!(vm.step(5, out(0, false)).is_empty());
        assert!(vm.step(6, Event::Wakeup { vcpu: 0 }).is_empty());
        let caps = Caps {
            halt_always: true,
            ..Caps::default()
        };
        let mut vm = VmModel::new(caps, &[1], &[0]);
        let d = vm.step(5, out(0, false));
        assert_eq!((d[0].kind, d[0].prio, d[0].reason), (BOOST_RT, 1, R_HALT));
    }

    #[test]
    fn an_rt_task_in_a_critical_section_is_latency_sensitive() {
        // FIFO 1 inside a hard IRQ: the section's reason wins at the same
        // priority, and the RT task still makes the vCPU latency-sensitive.
        let mut vm = vm2_cs();
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_HARDIRQ,
                ..rt(1)
            },
        );
        let d = vm.step(MS, Event::SwitchIn { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].prio, d[0].reason), (BOOST_RT, 1, R_CS));
        write(&mut vm, 0, GuestFields::default());
        assert!(vm.step(2 * MS, out(0, false)).is_empty());
        assert_eq!(vm.vcpus[0].boost_reason, R_HALT);
        assert_eq!(
            vm.vcpus[0].ls_until,
            MS + Caps::ns(Caps::default().halt_hold_us)
        );
    }

    #[test]
    fn a_latency_sensitive_vcpu_holds_its_rt_priority_across_halts() {
        // The guest's RT task at FIFO 3: the halt boost holds 3, not
        // halt_prio 1, so halting and waking again decide nothing.
        let mut vm = vm2();
        write(&mut vm, 0, rt(3));
        let d = vm.step(MS, Event::SwitchIn { vcpu: 0 });
        assert_eq!(
            (d[0].kind, d[0].prio, d[0].reason),
            (BOOST_RT, 3, R_RT_TASK)
        );
        write(&mut vm, 0, GuestFields::default());
        assert!(vm.step(2 * MS, out(0, false)).is_empty());
        assert_eq!(
            (vm.vcpus[0].boost_prio, vm.vcpus[0].boost_reason),
            (3, R_HALT)
        );
        assert!(vm.step(3 * MS, Event::Wakeup { vcpu: 0 }).is_empty());
        write(&mut vm, 0, rt(3));
        assert!(vm.step(4 * MS, Event::SwitchIn { vcpu: 0 }).is_empty());
        // A lower RT request lowers what is held (capped at max_rt_prio 4
        // above, halt_prio 1 below).
        write(&mut vm, 0, rt(2));
        vm.step(5 * MS, Event::Tick { vcpu: 0 });
        write(&mut vm, 0, GuestFields::default());
        vm.step(6 * MS, out(0, false));
        assert_eq!((vm.vcpus[0].boost_prio, vm.vcpus[0].ls_prio), (2, 2));
        // The hold ends with ls_until.
        let end = 5 * MS + Caps::ns(Caps::default().halt_hold_us);
        let d = vm.step(end, Event::Tick { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_NONE));
        // A NICE halt boost is not raised to an RT priority.
        let caps = Caps {
            halt_boost: BoostKind::Nice,
            halt_prio: -5,
            ..Caps::default()
        };
        let mut vm = VmModel::new(caps, &[10], &[0]);
        write(&mut vm, 0, rt(3));
        vm.step(MS, Event::SwitchIn { vcpu: 0 });
        write(&mut vm, 0, GuestFields::default());
        vm.step(2 * MS, out(0, false));
        assert_eq!(
            (vm.vcpus[0].boost, vm.vcpus[0].boost_prio),
            (BOOST_NICE, -5)
        );
    }

    #[test]
    fn an_idle_cpu_reporting_its_rt_sleeper_renews_the_hold() {
        // A periodic RT task at FIFO 3 ran once; the host then reads the
        // slot only when the guest is idle again. With TASK_F_RT_SLEEPER
        // (ABI 1.4) the idle slot carries the sleeping task: each such
        // read renews the hold at its priority, as a sighting of the task
        // would.
        let mut vm = vm2();
        write(&mut vm, 0, rt(3));
        vm.step(MS, Event::SwitchIn { vcpu: 0 });
        let sleeper = GuestFields {
            flags: TASK_F_IDLE | TASK_F_RT_SLEEPER,
            ..rt(3)
        };
        write(&mut vm, 0, sleeper);
        vm.step(2 * MS, out(0, false));
        let hold = Caps::ns(Caps::default().halt_hold_us);
        // Each wake-up and halt of the vCPU, 900 ms apart, shows only the
        // idle guest with its sleeper.
        for k in 1..5u64 {
            let t = k * 900 * MS;
            vm.step(t, Event::Wakeup { vcpu: 0 });
            vm.step(t + MS, out(0, false));
            assert_eq!(vm.vcpus[0].ls_until, t + MS + hold);
            assert_eq!(
                (vm.vcpus[0].boost, vm.vcpus[0].boost_prio),
                (BOOST_RT, 3),
                "held across halts, {k}"
            );
        }
        // The plain idle task (the sleeper gone) renews nothing: the hold
        // ends with ls_until.
        write(
            &mut vm,
            0,
            GuestFields {
                flags: TASK_F_IDLE,
                ..Default::default()
            },
        );
        vm.step(5 * 900 * MS, Event::Wakeup { vcpu: 0 });
        vm.step(5 * 900 * MS + MS, out(0, false));
        let d = vm.step(4 * 900 * MS + MS + hold, Event::Tick { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_NONE));
    }

    #[test]
    fn a_kernel_threads_rt_is_boosted_but_holds_nothing() {
        // The stopper (FIFO 99, a kernel thread) runs on every guest CPU
        // every few seconds: boosted while it runs, no halt hold after.
        let mut vm = vm2();
        write(
            &mut vm,
            0,
            GuestFields {
                flags: pvsched_abi::TASK_F_KTHREAD,
                ..rt(99)
            },
        );
        let d = vm.step(MS, Event::SwitchIn { vcpu: 0 });
        assert_eq!(
            (d[0].kind, d[0].prio, d[0].reason),
            (BOOST_RT, 4, R_RT_TASK)
        );
        write(&mut vm, 0, GuestFields::default());
        let d = vm.step(2 * MS, out(0, false));
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_NONE));
        assert_eq!((vm.vcpus[0].ls_until, vm.ls_until), (0, 0));
    }

    #[test]
    fn a_halted_boost_costs_nothing() {
        let mut vm = vm2();
        write(&mut vm, 0, rt(1));
        let d = vm.step(MS, Event::SwitchIn { vcpu: 0 });
        assert_eq!(d[0].kind, BOOST_RT);
        write(&mut vm, 0, GuestFields::default());
        vm.step(2 * MS, out(0, false));
        // Halted for 900 ms of ticks: boost held, budget and limit untouched.
        for t in (5..900).step_by(5) {
            assert!(vm.step(t * MS, Event::Tick { vcpu: 0 }).is_empty());
        }
        let v = &vm.vcpus[0];
        assert_eq!(
            (v.boost, v.boost_reason, v.throttled),
            (BOOST_RT, R_HALT, 0)
        );
        assert_eq!((v.budget_used, v.cont_ns, v.boosted_ns), (MS, 0, MS));
    }

    #[test]
    fn continuous_limit_counts_on_cpu_time_and_resets_on_halt() {
        let mut vm = vm2();
        write(&mut vm, 0, rt(1));
        vm.step(0, Event::SwitchIn { vcpu: 0 });
        // 15 ms on a CPU, then preempted 100 ms: not a halt, the run continues.
        vm.step(15 * MS, out(0, true));
        assert!(vm.step(115 * MS, Event::SwitchIn { vcpu: 0 }).is_empty());
        let d = vm.step(120 * MS, Event::Tick { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_MAX_BOOST));
        assert_eq!(vm.vcpus[0].throttled, 1);
        assert!(vm.step(150 * MS, Event::Tick { vcpu: 0 }).is_empty());
        let d = vm.step(170 * MS, Event::Tick { vcpu: 0 });
        assert_eq!(d[0].kind, BOOST_RT);
        assert_eq!(vm.vcpus[0].throttled, 0);
        // A halt resets the continuous run.
        vm.step(185 * MS, out(0, false));
        vm.step(186 * MS, Event::SwitchIn { vcpu: 0 });
        assert!(vm.step(200 * MS, Event::Tick { vcpu: 0 }).is_empty());
        assert_eq!(vm.vcpus[0].cont_ns, 14 * MS);
    }

    #[test]
    fn a_late_event_does_not_start_a_second_vm_window() {
        let caps = Caps {
            vm_budget_us: 10_000,
            window_us: 100_000,
            ..Caps::default()
        };
        let mut vm = VmModel::new(caps, &[10, 11], &[0, 1]);
        write(&mut vm, 0, rt(1));
        write(&mut vm, 1, rt(1));
        let d = vm.step(200 * MS, Event::SwitchIn { vcpu: 0 });
        assert_eq!((d[0].kind, vm.window_start), (BOOST_RT, 200 * MS));
        let d = vm.step(215 * MS, Event::Tick { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_VM_BUDGET));
        // vCPU 1's event read its clock just before that window began (on
        // another CPU, or a caller's read before its system call): the
        // window is still the current one, and its budget is spent.
        let d = vm.step(199 * MS, Event::SwitchIn { vcpu: 1 });
        assert!(d.iter().all(|d| d.kind == BOOST_NONE), "{d:?}");
        assert_eq!((vm.window_start, vm.budget_used), (200 * MS, 15 * MS));
    }

    #[test]
    fn budget_counts_on_cpu_time_per_window() {
        let mut vm = vm2();
        write(&mut vm, 0, rt(1));
        let mut t = MS;
        let mut throttled_at = None;
        // 10 ms runs, each followed by a 10 ms halt: 50 % on a CPU.
        while t < 990 * MS {
            let mut d = vm.step(t, Event::SwitchIn { vcpu: 0 });
            d.extend(vm.step(t + 10 * MS, out(0, false)));
            if d.iter().any(|d| d.reason == R_BUDGET) {
                throttled_at = Some(t + 10 * MS);
                break;
            }
            t += 20 * MS;
        }
        // Budget 200 ms of on-CPU time: reached at the end of the 20th run.
        assert_eq!(throttled_at, Some(391 * MS));
        assert_eq!(vm.vcpus[0].throttled_until, 1_000 * MS);
    }

    #[test]
    fn ipi_receiver_outranks_its_waiting_sender() {
        let mut vm = vm2();
        write(&mut vm, 0, rt(3));
        vm.step(50, Event::SwitchIn { vcpu: 0 });
        // Fixed, physical, no shorthand IPI to APIC 1: the pair is
        // confirmed, the receiver gets the yield boost at once.
        let d = vm.step(
            100,
            Event::Ipi {
                vcpu: 0,
                dest_id: 1,
                icr_low: 0xfd,
            },
        );
        assert_eq!(vm.vcpus[0].yield_slot, 2);
        assert!(
            d.iter()
                .any(|d| d.tid == 11 && (d.kind, d.prio, d.reason) == (BOOST_RT, 2, R_YIELD))
        );
        assert_eq!((vm.vcpus[0].boost, vm.vcpus[0].boost_prio), (BOOST_RT, 3));
        // Sender halted, then running again: neither side changes (no
        // decision per round trip); the receiver keeps its boost for the
        // IPI window.
        let mut d = vm.step(200, out(0, false));
        d.extend(vm.step(300, Event::SwitchIn { vcpu: 0 }));
        assert!(d.iter().all(|d| d.tid != 11));
        assert_eq!((vm.vcpus[0].boost, vm.vcpus[0].boost_prio), (BOOST_RT, 3));
        assert_eq!(vm.vcpus[1].boost, BOOST_RT);
        // The sender says it spins on the receiver (wait_on): one step
        // below the receiver's boost.
        write(
            &mut vm,
            0,
            GuestFields {
                wait_on: 2,
                ..rt(3)
            },
        );
        vm.step(350, Event::Tick { vcpu: 0 });
        assert_eq!((vm.vcpus[0].boost, vm.vcpus[0].boost_prio), (BOOST_RT, 1));
        write(&mut vm, 0, rt(3));
        vm.step(360, Event::Tick { vcpu: 0 });
        // The window passes with no further IPI: the receiver's boost ends.
        let win = Caps::ns(Caps::default().ipi_window_us);
        let d = vm.step(100 + win + 1, Event::Tick { vcpu: 0 });
        assert!(d.iter().any(|d| d.tid == 11 && d.kind == BOOST_NONE));
        // Broadcast shorthand is not a pair.
        vm.step(
            400,
            Event::Ipi {
                vcpu: 1,
                dest_id: 0,
                icr_low: 3 << 18,
            },
        );
        assert_eq!(vm.vcpus[1].last_ipi_target, 0);
    }

    #[test]
    fn a_waiting_pair_is_throttled_as_one_unit() {
        let mut vm = vm2_cs();
        // vCPU 0 spins in a critical section waiting on vCPU 1.
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_PREEMPT_OFF,
                wait_on: 2,
                ..Default::default()
            },
        );
        vm.step(0, Event::SwitchIn { vcpu: 0 });
        vm.step(0, Event::SwitchIn { vcpu: 1 });
        assert_eq!((vm.vcpus[0].boost, vm.vcpus[0].boost_prio), (BOOST_RT, 1));
        assert_eq!(
            (
                vm.vcpus[1].boost,
                vm.vcpus[1].boost_prio,
                vm.vcpus[1].boost_reason
            ),
            (BOOST_RT, 2, R_YIELD)
        );
        // The spinner reaches max_boost: both are throttled, until the same time.
        let d = vm.step(20 * MS, Event::Tick { vcpu: 0 });
        let got: Vec<_> = d
            .iter()
            .map(|d| (d.tid, d.kind, d.reason, d.throttled_until, d.waits_on))
            .collect();
        let until = 20 * MS + Caps::ns(Caps::default().throttle_us);
        assert_eq!(
            got,
            vec![
                (11, BOOST_NONE, R_THROTTLED, until, 0),
                (10, BOOST_NONE, R_MAX_BOOST, until, 0)
            ]
        );
        assert_eq!(vm.vcpus[1].throttled_until, vm.vcpus[0].throttled_until);
        assert_eq!(
            vm.vcpus[0].yield_boosting, 0,
            "a throttled sender lends nothing"
        );
        // Throttled the receiver first: the waiting sender goes with it.
        let mut vm = vm2_cs();
        write(&mut vm, 0, waits(2));
        write(&mut vm, 1, rt(1));
        vm.step(0, Event::SwitchIn { vcpu: 1 });
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_PREEMPT_OFF,
                wait_on: 2,
                ..Default::default()
            },
        );
        vm.step(0, Event::SwitchIn { vcpu: 0 });
        let d = vm.step(20 * MS, Event::Tick { vcpu: 1 });
        let got: Vec<_> = d.iter().map(|d| (d.tid, d.kind, d.reason)).collect();
        assert_eq!(
            got,
            vec![(10, BOOST_NONE, R_THROTTLED), (11, BOOST_NONE, R_MAX_BOOST)]
        );
    }

    #[test]
    fn wait_on_hint_and_window_expiry() {
        let mut vm = vm2();
        write(&mut vm, 0, waits(2));
        let d = vm.step(1, Event::SwitchIn { vcpu: 0 });
        assert!(d.iter().any(|d| d.tid == 11 && d.reason == R_YIELD));
        // wait_on of itself or out of range is ignored.
        write(&mut vm, 1, waits(2));
        vm.step(2, Event::SwitchIn { vcpu: 1 });
        assert_eq!(vm.vcpus[1].wait_on, 0);
        write(&mut vm, 1, waits(9));
        vm.step(3, Event::SwitchIn { vcpu: 1 });
        assert_eq!(vm.vcpus[1].wait_on, 0);
    }

    #[test]
    fn a_lock_spinner_lends_to_a_preempted_vcpu_and_keeps_it_while_it_runs() {
        let mut vm = VmModel::new(lock_wait_on(), &[10, 11, 12], &[0, 1, 2]);
        // vCPU 1 halts, vCPU 2 is preempted: vCPU 0 spins on a lock.
        vm.step(1, out(1, false));
        vm.step(2, out(2, true));
        write(&mut vm, 0, waits(WAIT_ANY));
        let d = vm.step(3, Event::SwitchIn { vcpu: 0 });
        assert_eq!(
            vm.vcpus[0].yield_slot, 3,
            "the preempted vCPU, not the halted one"
        );
        assert!(
            d.iter()
                .any(|d| d.tid == 12 && d.kind == BOOST_RT && d.reason == R_YIELD)
        );
        // The spinner itself gets nothing: burning a CPU is no reason.
        assert_eq!(vm.vcpus[0].boost, BOOST_NONE);
        // The boosted vCPU runs: the spinner keeps lending to it, even
        // though vCPU 1 is now preempted too.
        vm.step(4, Event::SwitchIn { vcpu: 2 });
        vm.step(5, Event::Wakeup { vcpu: 1 });
        vm.step(6, out(1, true));
        vm.step(7, Event::Tick { vcpu: 0 });
        assert_eq!(vm.vcpus[0].yield_slot, 3);
        // It halts (the lock was passed on): the next preempted vCPU.
        vm.step(8, out(2, false));
        vm.step(9, Event::Tick { vcpu: 0 });
        assert_eq!(vm.vcpus[0].yield_slot, 2);
        assert_eq!(vm.vcpus[1].boost, BOOST_RT);
        // The lock is taken: the loan ends.
        write(&mut vm, 0, waits(WAIT_NONE));
        vm.step(10, Event::Tick { vcpu: 0 });
        assert_eq!((vm.vcpus[0].yield_slot, vm.vcpus[1].boost), (0, BOOST_NONE));
    }

    #[test]
    fn a_lock_spinner_with_nobody_preempted_or_lock_wait_off_lends_nothing() {
        let mut vm = VmModel::new(lock_wait_on(), &[10, 11], &[0, 1]);
        write(&mut vm, 0, waits(WAIT_ANY));
        vm.step(1, Event::SwitchIn { vcpu: 0 });
        vm.step(2, out(1, false));
        vm.step(3, Event::Tick { vcpu: 0 });
        assert_eq!(vm.vcpus[0].yield_slot, 0, "vCPU 1 is halted");
        // Off, the default.
        assert!(!Caps::default().lock_wait);
        let mut vm = VmModel::new(Caps::default(), &[10, 11], &[0, 1]);
        vm.step(1, out(1, true));
        write(&mut vm, 0, waits(WAIT_ANY));
        vm.step(2, Event::SwitchIn { vcpu: 0 });
        assert_eq!((vm.vcpus[0].wait_on, vm.vcpus[0].yield_slot), (0, 0));
    }

    #[test]
    fn a_kick_confirms_a_pair_like_an_ipi() {
        let caps = Caps {
            kick_pairs: KickPairs::On,
            ..Caps::default()
        };
        let mut vm = VmModel::new(caps, &[10, 11], &[0, 1]);
        // vCPU 1 halts in a busy guest (it waits for QEMU's lock): a wake-up
        // by vCPU 0 then is no IPI.
        vm.step(1, out(1, false));
        vm.step(1, Event::Kick { vcpu: 0, target: 1 });
        assert_eq!(vm.vcpus[0].yield_slot, 0);
        // Its guest goes idle, and it halts.
        write(
            &mut vm,
            1,
            GuestFields {
                flags: TASK_F_IDLE,
                ..Default::default()
            },
        );
        vm.step(1, out(1, false));
        // vCPU 0's thread wakes vCPU 1's (the sender's event first, as the
        // BPF program runs them), twice within the window: vCPU 1 is lent
        // the yield boost.
        vm.step(1, Event::Kick { vcpu: 0, target: 1 });
        assert_eq!(vm.vcpus[0].yield_slot, 0, "one kick confirms nothing");
        let d = vm.step(2, Event::Kick { vcpu: 0, target: 1 });
        assert_eq!(vm.vcpus[0].yield_slot, 2);
        assert!(
            d.iter()
                .any(|d| d.tid == 11 && d.kind == BOOST_RT && d.reason == R_YIELD)
        );
        vm.step(2, Event::Wakeup { vcpu: 1 });
        assert_eq!(vm.vcpus[1].boost, BOOST_RT);
        // The pair lapses after ipi_window_us like an IPI's.
        vm.step(2 + 51 * MS, Event::Tick { vcpu: 0 });
        assert_eq!((vm.vcpus[0].yield_slot, vm.vcpus[1].boost), (0, BOOST_NONE));
        // A kick of itself or out of range, or with kick_pairs off, is none.
        vm.step(200 * MS, Event::Kick { vcpu: 0, target: 0 });
        vm.step(200 * MS, Event::Kick { vcpu: 0, target: 5 });
        assert_eq!(vm.vcpus[0].yield_slot, 0);
        // Auto with features unknown (a 1.2 device): none, whatever the
        // guest does.
        let mut vm = vm_auto();
        let idle = GuestFields {
            flags: TASK_F_IDLE,
            ..Default::default()
        };
        write(&mut vm, 1, idle);
        vm.step(1, out(1, false));
        vm.step(1, Event::Kick { vcpu: 0, target: 1 });
        vm.step(2, Event::Kick { vcpu: 0, target: 1 });
        assert_eq!(vm.vcpus[0].yield_slot, 0);
    }

    /// Two kicks of halted, idle vCPU 1 by vCPU 0; vCPU 0's confirmed pair.
    fn two_kicks(vm: &mut VmModel, at: u64) -> u32 {
        let idle = GuestFields {
            flags: TASK_F_IDLE,
            ..Default::default()
        };
        write(vm, 1, idle);
        vm.step(at, out(1, false));
        vm.step(at, Event::Kick { vcpu: 0, target: 1 });
        vm.step(at + 1, Event::Kick { vcpu: 0, target: 1 });
        vm.vcpus[0].yield_slot
    }

    fn vm_auto() -> VmModel {
        let caps = Caps {
            kick_pairs: KickPairs::Auto,
            ..Caps::default()
        };
        VmModel::new(caps, &[10, 11], &[0, 1])
    }

    #[test]
    fn auto_kick_pairs_only_a_guest_without_wait_on_from_a_boosted_sender() {
        let no_wait_on = F_DEVICE_REGION | F_KICK | F_TASK_FLAGS | F_LOCK_WAIT;
        // A 6.1 guest (no F_WAIT_ON) whose sender runs batch work: nothing.
        let mut vm = vm_auto();
        vm.driver_features = no_wait_on;
        vm.step(1, Event::SwitchIn { vcpu: 0 });
        assert_eq!(vm.vcpus[0].boost, BOOST_NONE);
        assert_eq!(two_kicks(&mut vm, 2), 0, "an unboosted sender");
        // Its RT task boosts the sender: now its kicks pair.
        write(&mut vm, 0, rt(5));
        vm.step(10, Event::Tick { vcpu: 0 });
        assert_eq!(vm.vcpus[0].boost, BOOST_RT);
        assert_eq!(two_kicks(&mut vm, 11), 2, "a boosted sender, no wait_on");
        // A guest that reports wait_on (7.3): never, boosted or not.
        let mut vm = vm_auto();
        vm.driver_features = no_wait_on | F_WAIT_ON;
        write(&mut vm, 0, rt(5));
        vm.step(1, Event::SwitchIn { vcpu: 0 });
        assert_eq!(vm.vcpus[0].boost, BOOST_RT);
        assert_eq!(two_kicks(&mut vm, 2), 0, "the guest says whom it waits on");
        // On: an unboosted sender's kicks pair too.
        let mut vm = VmModel::new(
            Caps {
                kick_pairs: KickPairs::On,
                ..Caps::default()
            },
            &[10, 11],
            &[0, 1],
        );
        vm.driver_features = no_wait_on | F_WAIT_ON;
        vm.step(1, Event::SwitchIn { vcpu: 0 });
        assert_eq!(two_kicks(&mut vm, 2), 2);
    }

    #[test]
    fn out_of_range_vcpu_is_ignored() {
        let mut vm = vm2();
        assert!(vm.step(1, Event::Tick { vcpu: 7 }).is_empty());
        assert!(
            vm.step(
                1,
                Event::GuestWrite {
                    vcpu: 7,
                    guest: GuestFields::default()
                }
            )
            .is_empty()
        );
    }
}
