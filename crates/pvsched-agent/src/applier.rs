//! The applier: turns a decision into thread attributes within the VM's
//! caps, starting from the thread's baseline (captured before its first
//! boost) and restoring exactly that baseline on unboost or throttle.

use crate::sched::{self, SchedAttr};
use pvsched_abi::{
    BOOST_NICE, BOOST_NONE, BOOST_RT, POLICY_DEADLINE, POLICY_FIFO, POLICY_IDLE, POLICY_NORMAL,
    POLICY_RR,
};
use pvsched_policy::Caps;

/// What `kind`/`prio` means for a thread whose baseline is `base`, within
/// `caps`: the attributes to set. Never lowers a thread below its baseline
/// (an RT baseline stays when a nice boost is asked, and so on).
pub fn plan(base: &SchedAttr, kind: u32, prio: i32, caps: &Caps) -> SchedAttr {
    let rt_base = base.policy == POLICY_FIFO || base.policy == POLICY_RR;
    let mut kind = kind;
    let mut prio = prio;
    if kind == BOOST_RT && (!caps.allow_rt || caps.max_rt_prio == 0) {
        kind = BOOST_NICE;
        prio = caps.nice_floor;
    }
    match kind {
        BOOST_RT => {
            let p = prio.clamp(1, caps.max_rt_prio.min(99) as i32) as u32;
            if base.policy == POLICY_DEADLINE || (rt_base && base.priority >= p) {
                return *base;
            }
            SchedAttr {
                policy: POLICY_FIFO,
                priority: p,
                nice: base.nice,
                flags: base.flags,
            }
        }
        BOOST_NICE => {
            let n = prio.max(caps.nice_floor).max(pvsched_abi::NICE_MIN);
            if rt_base || base.policy == POLICY_DEADLINE || n >= base.nice {
                return *base;
            }
            SchedAttr {
                policy: if base.policy == POLICY_IDLE {
                    POLICY_NORMAL
                } else {
                    base.policy
                },
                priority: 0,
                nice: n,
                flags: base.flags,
            }
        }
        _ => *base,
    }
}

/// One registered vCPU thread as the applier sees it.
#[derive(Clone, Debug)]
pub struct ThreadState {
    /// Thread id.
    pub tid: u32,
    /// VM.
    pub vm_id: u32,
    /// Slot index.
    pub index: u32,
    /// Attributes before the first boost.
    pub baseline: Option<SchedAttr>,
    /// Attributes we set last (None = untouched / restored).
    pub applied: Option<SchedAttr>,
    /// sched_setattr boosts applied.
    pub boosts_applied: u64,
    /// Throttle decisions applied.
    pub throttles: u64,
    /// Failed syscalls.
    pub errors: u64,
}

impl ThreadState {
    /// A thread not touched yet.
    pub fn new(tid: u32, vm_id: u32, index: u32) -> Self {
        ThreadState {
            tid,
            vm_id,
            index,
            baseline: None,
            applied: None,
            boosts_applied: 0,
            throttles: 0,
            errors: 0,
        }
    }

    /// Applies a decision; returns true if a syscall changed the thread.
    pub fn apply(&mut self, kind: u32, prio: i32, reason: u32, caps: &Caps) -> bool {
        if reason == pvsched_policy::event::R_MAX_BOOST || reason == pvsched_policy::event::R_BUDGET
        {
            self.throttles += 1;
        }
        if kind == BOOST_NONE {
            return self.restore();
        }
        let base = match self.baseline {
            Some(b) => b,
            None => match sched::get(self.tid) {
                Ok(b) => {
                    self.baseline = Some(b);
                    b
                }
                Err(e) => {
                    log::warn!("pvsched applier: {e}");
                    self.errors += 1;
                    return false;
                }
            },
        };
        let target = plan(&base, kind, prio, caps);
        let current = self.applied.unwrap_or(base);
        if target == current {
            return false;
        }
        match sched::set(self.tid, &target) {
            Ok(()) => {
                self.applied = if target == base { None } else { Some(target) };
                if self.applied.is_some() {
                    self.boosts_applied += 1;
                }
                true
            }
            Err(e) => {
                log::warn!("pvsched applier: {e}");
                self.errors += 1;
                false
            }
        }
    }

    /// Puts the thread back to its baseline if we changed it.
    pub fn restore(&mut self) -> bool {
        let (Some(base), Some(_)) = (self.baseline, self.applied) else {
            return false;
        };
        match sched::set(self.tid, &base) {
            Ok(()) => {
                self.applied = None;
                // Re-captured before the next boost (the VMM may change it).
                self.baseline = None;
                true
            }
            Err(e) => {
                log::error!("pvsched applier: restoring baseline: {e}");
                self.errors += 1;
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normal(nice: i32) -> SchedAttr {
        SchedAttr {
            policy: POLICY_NORMAL,
            priority: 0,
            nice,
            flags: 0,
        }
    }

    #[test]
    fn rt_is_capped_and_keeps_flags() {
        let c = Caps::default();
        let b = SchedAttr {
            flags: 1,
            ..normal(5)
        };
        let t = plan(&b, BOOST_RT, 99, &c);
        assert_eq!((t.policy, t.priority, t.flags), (POLICY_FIFO, 10, 1));
    }

    #[test]
    fn never_below_baseline() {
        let c = Caps::default();
        let rt = SchedAttr {
            policy: POLICY_FIFO,
            priority: 50,
            nice: 0,
            flags: 0,
        };
        assert_eq!(plan(&rt, BOOST_RT, 5, &c), rt);
        assert_eq!(plan(&rt, BOOST_NICE, -10, &c), rt);
        assert_eq!(plan(&normal(-15), BOOST_NICE, -5, &c), normal(-15));
        assert_eq!(plan(&normal(3), BOOST_NICE, -19, &c).nice, -10);
    }

    #[test]
    fn rt_disallowed_is_nice_floor() {
        let c = Caps {
            allow_rt: false,
            ..Caps::default()
        };
        assert_eq!(plan(&normal(0), BOOST_RT, 50, &c), normal(-10));
    }
}
