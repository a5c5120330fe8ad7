//! The policy state machine, the same step for step as `bpf-policy/`
//! (`policy.bpf.h`, `slot.bpf.h`, `budget.bpf.h`, `ipi.bpf.h`): unsigned
//! arithmetic wraps where the C wraps, and the order of operations is the
//! same, so a trace gives the same decisions through both.

use crate::caps::Caps;
use crate::event::*;
use pvsched_abi::{
    BOOST_NICE, BOOST_NONE, BOOST_RT, CS_ALL, NICE_MIN, POLICY_BATCH, POLICY_DEADLINE, POLICY_FIFO,
    POLICY_NORMAL, POLICY_RR, WAIT_NONE,
};

/// Model of one vCPU (`struct pvs_vcpu`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VcpuModel {
    /// Thread id.
    pub tid: u32,
    /// Slot index.
    pub index: u32,
    /// `ST_*`.
    pub state: u32,
    /// Capped guest request: kind.
    pub req_kind: u32,
    /// Capped guest request: priority.
    pub req_prio: i32,
    /// Capped guest request: reason.
    pub req_reason: u32,
    /// Valid wait_on.
    pub wait_on: u32,
    /// Applied boost.
    pub boost: u32,
    /// Its priority.
    pub boost_prio: i32,
    /// Its reason.
    pub boost_reason: u32,
    /// 1 while throttled.
    pub throttled: u32,
    /// Start of the current boost.
    pub boost_start: u64,
    /// Boost time before this is accounted in `budget_used`.
    pub acct_start: u64,
    /// Budget window start.
    pub window_start: u64,
    /// Boosted ns in this window.
    pub budget_used: u64,
    /// No boost before this.
    pub throttled_until: u64,
    /// Last unicast IPI receiver + 1.
    pub last_ipi_target: u32,
    /// Directed-yield slot (+1).
    pub yield_slot: u32,
    /// Time of the last IPI.
    pub last_ipi_ns: u64,
    /// Target boosted on our behalf (+1).
    pub yield_boosting: u32,
    /// Senders waiting on us.
    pub yield_mask: u64,
    /// Boosts started.
    pub boosts: u64,
    /// Throttles.
    pub throttles: u64,
    /// Total boosted ns.
    pub boosted_ns: u64,
    /// IPIs recorded.
    pub ipis: u64,
    /// Times this vCPU's slot target was boosted.
    pub slot_hits: u64,
}

/// Model of one VM: caps, vCPUs, the guest halves of the slots, APIC IDs.
#[derive(Clone, Debug)]
pub struct VmModel {
    /// vm_id used in gids.
    pub vm_id: u32,
    /// Caps.
    pub caps: Caps,
    /// vCPUs by slot index.
    pub vcpus: Vec<VcpuModel>,
    /// Guest halves by slot index.
    pub slots: Vec<GuestFields>,
    /// APIC ID of each slot.
    pub apic_ids: Vec<u32>,
}

fn boost_rank(kind: u32, prio: i32) -> u32 {
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

impl VmModel {
    /// A VM (vm_id 0) with one vCPU per thread id.
    pub fn new(caps: Caps, tids: &[u32], apic_ids: &[u32]) -> VmModel {
        let vcpus = tids
            .iter()
            .enumerate()
            .map(|(i, &tid)| VcpuModel {
                tid,
                index: i as u32,
                ..Default::default()
            })
            .collect();
        VmModel {
            vm_id: 0,
            caps,
            vcpus,
            slots: vec![GuestFields::default(); tids.len()],
            apic_ids: apic_ids.to_vec(),
        }
    }

    fn nr(&self) -> u32 {
        self.vcpus.len() as u32
    }

    fn gid(&self, index: u32) -> u32 {
        (self.vm_id << GID_SHIFT) | index
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
        if vcpu >= self.nr() {
            return out;
        }
        let i = vcpu as usize;
        {
            let v = &mut self.vcpus[i];
            match code {
                EV_SWITCH_OUT => v.state = if a != 0 { ST_PREEMPTED } else { ST_HALTED },
                EV_SWITCH_IN | EV_VCPU_WAKEUP | EV_USER_EXIT => v.state = ST_RUNNING,
                EV_WAKEUP => v.state = ST_WOKEN,
                _ => {}
            }
        }
        if code == EV_IPI {
            self.ipi_record(i, a as u32, b as u32, now);
        }
        self.refresh_request(i);
        let (old_t, new_t) = self.yield_update(i, now);
        self.apply_boost(i, now, code, &mut out);
        if old_t != new_t {
            self.yield_mark(old_t, vcpu, false, now, code, &mut out);
            self.yield_mark(new_t, vcpu, true, now, code, &mut out);
        }
        out
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
        let v = &mut self.vcpus[i];
        if idx == v.index || idx >= MAX_VCPUS_PER_VM {
            return;
        }
        v.last_ipi_target = idx + 1;
        v.last_ipi_ns = now;
        v.ipis += 1;
    }

    fn refresh_request(&mut self, i: usize) {
        let g = self.slots[i];
        let c = &self.caps;
        let nr = self.vcpus.len() as u32;
        let v = &mut self.vcpus[i];
        let (mut kind, mut prio, mut reason) = (BOOST_NONE, 0i32, R_NONE);
        let (mut tkind, mut tprio, mut treason) = (BOOST_NONE, 0i32, R_NONE);
        if g.kern_cs & CS_ALL != 0 {
            kind = BOOST_RT;
            prio = if c.cs_rt_prio > 99 {
                99
            } else {
                c.cs_rt_prio as i32
            };
            if prio < 1 {
                prio = 1;
            }
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
        let mut wait_on = g.wait_on;
        if !c.wait_on || wait_on > nr || wait_on == v.index + 1 {
            wait_on = WAIT_NONE;
        }
        v.wait_on = wait_on;
    }

    fn yield_update(&mut self, i: usize, now: u64) -> (u32, u32) {
        let win = Caps::ns(self.caps.ipi_window_us);
        let v = &mut self.vcpus[i];
        let mut slot = 0;
        if v.wait_on != 0 {
            slot = v.wait_on;
        } else if v.last_ipi_target != 0 && now.wrapping_sub(v.last_ipi_ns) <= win {
            slot = v.last_ipi_target;
        }
        v.yield_slot = slot;
        let waits = v.state == ST_HALTED
            || v.state == ST_PREEMPTED
            || v.state == ST_WOKEN
            || v.wait_on != 0;
        let target = if waits { slot } else { 0 };
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
        self.apply_boost(t, now, event, out);
    }

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
        });
    }

    fn apply_boost(&mut self, i: usize, now: u64, event: u32, out: &mut Vec<Decision>) {
        let c = self.caps.clone();
        let (max_boost, throttle, budget, window) = (
            Caps::ns(c.max_boost_us),
            Caps::ns(c.throttle_us),
            Caps::ns(c.budget_us),
            Caps::ns(c.window_us),
        );
        let v = &mut self.vcpus[i];
        if window != 0 && now.wrapping_sub(v.window_start) >= window {
            v.window_start = now;
            v.budget_used = 0;
            if v.boost != BOOST_NONE {
                v.acct_start = now;
            }
        }
        if v.boost != BOOST_NONE {
            let run = now.wrapping_sub(v.boost_start);
            let used = v.budget_used.wrapping_add(now.wrapping_sub(v.acct_start));
            let why = if max_boost != 0 && run >= max_boost {
                v.throttled_until = now.wrapping_add(throttle);
                Some(R_MAX_BOOST)
            } else if budget != 0 && used >= budget {
                v.throttled_until = v.window_start.wrapping_add(window);
                if v.throttled_until < now.wrapping_add(throttle) {
                    v.throttled_until = now.wrapping_add(throttle);
                }
                Some(R_BUDGET)
            } else {
                None
            };
            if let Some(reason) = why {
                v.throttled = 1;
                v.throttles += 1;
                boost_end(v, now);
                v.boost = BOOST_NONE;
                v.boost_prio = 0;
                v.boost_reason = reason;
                self.emit(i, event, now, out);
                return;
            }
        }
        if now < v.throttled_until {
            return;
        }
        v.throttled = 0;
        let (mut kind, mut prio, mut reason) = (BOOST_NONE, 0i32, R_NONE);
        if v.state != ST_HALTED {
            kind = v.req_kind;
            prio = v.req_prio;
            reason = v.req_reason;
        }
        if v.state == ST_HALTED || v.state == ST_WOKEN {
            let (mut hk, mut hp) = (c.halt_boost.abi(), c.halt_prio);
            caps_clamp(&c, &mut hk, &mut hp);
            if boost_rank(hk, hp) > boost_rank(kind, prio) {
                kind = hk;
                prio = hp;
                reason = R_HALT;
            }
        }
        if v.yield_mask != 0 {
            let (mut yk, mut yp) = (c.yield_boost.abi(), c.yield_prio);
            caps_clamp(&c, &mut yk, &mut yp);
            if boost_rank(yk, yp) > boost_rank(kind, prio) {
                kind = yk;
                prio = yp;
                reason = R_YIELD;
            }
        }
        if kind == v.boost && prio == v.boost_prio {
            return;
        }
        if kind == BOOST_NONE {
            boost_end(v, now);
        } else if v.boost == BOOST_NONE {
            v.boost_start = now;
            v.acct_start = now;
            v.boosts += 1;
        }
        v.boost = kind;
        v.boost_prio = prio;
        v.boost_reason = reason;
        self.emit(i, event, now, out);
    }
}

fn boost_end(v: &mut VcpuModel, now: u64) {
    if now > v.acct_start {
        v.budget_used = v.budget_used.wrapping_add(now - v.acct_start);
    }
    if now > v.boost_start {
        v.boosted_ns = v.boosted_ns.wrapping_add(now - v.boost_start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_abi::{CS_HARDIRQ, CS_PREEMPT_OFF, POLICY_FIFO};

    fn vm2() -> VmModel {
        VmModel::new(Caps::default(), &[10, 11], &[0, 1])
    }

    fn write(vm: &mut VmModel, vcpu: u32, guest: GuestFields) {
        vm.step(0, Event::GuestWrite { vcpu, guest });
    }

    #[test]
    fn cs_boost_then_unboost() {
        let mut vm = vm2();
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_HARDIRQ,
                ..Default::default()
            },
        );
        let d = vm.step(
            10,
            Event::SwitchOut {
                vcpu: 0,
                preempted: true,
            },
        );
        assert_eq!(d.len(), 1);
        assert_eq!(
            (d[0].kind, d[0].prio, d[0].reason, d[0].tid),
            (BOOST_RT, 1, R_CS, 10)
        );
        write(&mut vm, 0, GuestFields::default());
        let d = vm.step(20, Event::SwitchIn { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_NONE));
        assert_eq!(vm.vcpus[0].boosted_ns, 10);
    }

    #[test]
    fn rt_prio_is_capped() {
        let mut vm = vm2();
        write(
            &mut vm,
            1,
            GuestFields {
                policy: POLICY_FIFO,
                rt_prio: 99,
                ..Default::default()
            },
        );
        let d = vm.step(5, Event::Wakeup { vcpu: 1 });
        assert_eq!((d[0].kind, d[0].prio), (BOOST_RT, 10));
    }

    #[test]
    fn rt_not_allowed_becomes_nice_floor() {
        let caps = Caps {
            allow_rt: false,
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
        let d = vm.step(
            5,
            Event::SwitchOut {
                vcpu: 0,
                preempted: true,
            },
        );
        assert_eq!((d[0].kind, d[0].prio), (BOOST_NICE, -10));
    }

    #[test]
    fn throttle_after_max_boost_then_reboost_after_throttle() {
        let mut vm = vm2();
        write(
            &mut vm,
            0,
            GuestFields {
                kern_cs: CS_HARDIRQ,
                ..Default::default()
            },
        );
        vm.step(
            1,
            Event::SwitchOut {
                vcpu: 0,
                preempted: true,
            },
        );
        let d = vm.step(1 + 20_000_000, Event::Tick { vcpu: 0 });
        assert_eq!((d[0].kind, d[0].reason), (BOOST_NONE, R_MAX_BOOST));
        assert_eq!(vm.vcpus[0].throttled, 1);
        assert!(vm.step(30_000_000, Event::Tick { vcpu: 0 }).is_empty());
        let d = vm.step(1 + 70_000_000, Event::Tick { vcpu: 0 });
        assert_eq!(d[0].kind, BOOST_RT);
        assert_eq!(vm.vcpus[0].throttled, 0);
    }

    #[test]
    fn ipi_pair_boosts_receiver_while_sender_waits() {
        let mut vm = vm2();
        // Fixed, physical, no shorthand IPI to APIC 1.
        vm.step(
            100,
            Event::Ipi {
                vcpu: 0,
                dest_id: 1,
                icr_low: 0xfd,
            },
        );
        assert_eq!(vm.vcpus[0].yield_slot, 2);
        let d = vm.step(
            200,
            Event::SwitchOut {
                vcpu: 0,
                preempted: false,
            },
        );
        // Sender halted: its own halt boost, and the receiver's yield boost.
        assert!(
            d.iter()
                .any(|d| d.tid == 11 && d.reason == R_YIELD && d.prio == -10)
        );
        let d = vm.step(300, Event::SwitchIn { vcpu: 0 });
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
    fn wait_on_hint_and_window_expiry() {
        let mut vm = vm2();
        write(
            &mut vm,
            0,
            GuestFields {
                wait_on: 2,
                ..Default::default()
            },
        );
        let d = vm.step(1, Event::SwitchIn { vcpu: 0 });
        assert!(d.iter().any(|d| d.tid == 11 && d.reason == R_YIELD));
        // wait_on of itself or out of range is ignored.
        write(
            &mut vm,
            1,
            GuestFields {
                wait_on: 2,
                ..Default::default()
            },
        );
        vm.step(2, Event::SwitchIn { vcpu: 1 });
        assert_eq!(vm.vcpus[1].wait_on, 0);
        write(
            &mut vm,
            1,
            GuestFields {
                wait_on: 9,
                ..Default::default()
            },
        );
        vm.step(3, Event::SwitchIn { vcpu: 1 });
        assert_eq!(vm.vcpus[1].wait_on, 0);
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
