//! The applier: turns a decision into thread attributes within the VM's
//! caps, starting from the thread's baseline (captured before its first
//! boost) and restoring exactly that baseline on unboost or throttle.

use crate::guardian::Guardian;
use crate::ident::ThreadIdent;
use crate::sched::{self, SchedAttr};
use pvsched_abi::{
    BOOST_NICE, BOOST_NONE, BOOST_RT, POLICY_DEADLINE, POLICY_FIFO, POLICY_IDLE, POLICY_NORMAL,
    POLICY_RR,
};
use pvsched_policy::Caps;
use std::sync::Arc;

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
    /// The boost (`kind`, `prio`) the thread carries now, as last decided
    /// and applied; compared with the policy's state by [`Self::reconcile`].
    pub decided: (u32, i32),
    /// Times reconciliation found the thread out of step with the policy
    /// (a lost decision record, a failed syscall, an outside change) and
    /// corrected it.
    pub corrections: u64,
    /// The guardian's ledger entry of this thread, if guarded.
    guard: Option<Guard>,
    /// The thread exited or exec'd (the policy saw `sched_process_exit` or
    /// `sched_process_exec`, or its identity check failed): its TID is
    /// never passed to sched_setattr again, even if a new thread gets it.
    pub exited: bool,
    /// Checked before every system call on the TID (see [`crate::ident`]);
    /// None only for threads made by [`ThreadState::new`] in unit tests.
    ident: Option<Arc<ThreadIdent>>,
}

/// Where a thread's boosts are recorded for the guardian.
#[derive(Clone)]
struct Guard {
    guardian: Arc<Guardian>,
    slot: usize,
    start_time: u64,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Guard(slot {}, start {})", self.slot, self.start_time)
    }
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
            decided: (BOOST_NONE, 0),
            corrections: 0,
            guard: None,
            exited: false,
            ident: None,
        }
    }

    /// True while this state holds its TID: not gone, as far as the last
    /// check or record says, and still named by its identity now.
    pub fn is_registered(&mut self) -> bool {
        self.still_there()
    }

    /// This state acts on `tid` only while `ident` says the TID still names
    /// the registered thread.
    pub fn with_ident(mut self, ident: ThreadIdent) -> Self {
        self.ident = Some(Arc::new(ident));
        self
    }

    /// False (and the thread forgotten) once the TID no longer names the
    /// registered thread: called right before each system call on it.
    fn still_there(&mut self) -> bool {
        if self.exited {
            return false;
        }
        if self.ident.as_ref().is_some_and(|i| !i.is_alive()) {
            log::info!(
                "pvsched applier: registered thread {} is gone (exited or exec'd); \
                 its TID is never touched again",
                self.tid
            );
            self.forget();
            return false;
        }
        true
    }

    /// The registered thread is gone from its TID: it exited, or it called
    /// `execve` from a thread other than its process's leader, in which
    /// case it lives on as that leader (TID = the owner's pid), running
    /// another program with our boost still set. That is put back to the
    /// baseline if the leader carries exactly the boost applied here (so a
    /// leader the VMM set itself is left alone); the owner's pidfd is
    /// checked first, so only the owner's own leader is ever touched. Then
    /// the TID is forgotten.
    pub fn forget(&mut self) {
        if let (Some(applied), Some(base), Some(ident)) =
            (self.applied, self.baseline, self.ident.as_ref())
            && let Some(leader) = ident.exec_successor()
            && sched::get(leader).is_ok_and(|cur| applied.is_set_in(&cur))
        {
            match sched::set(leader, &base) {
                Ok(()) => log::info!(
                    "pvsched applier: thread {} exec'd as {leader}: baseline restored",
                    self.tid
                ),
                Err(e) => log::warn!("pvsched applier: restoring an exec'd thread: {e}"),
            }
        }
        self.exit();
    }

    /// The thread exited: forget it (nothing to restore; its TID may
    /// belong to another thread from now on).
    pub fn exit(&mut self) {
        self.exited = true;
        self.applied = None;
        self.decided = (BOOST_NONE, 0);
        self.disarm();
    }

    /// A thread whose boosts the guardian restores if the agent process
    /// dies: ledger entry `slot`; the thread's start time is read now so a
    /// reused TID is never touched. Unguarded (logged) if the thread is
    /// already gone.
    pub fn guarded(tid: u32, vm_id: u32, index: u32, guardian: Arc<Guardian>, slot: usize) -> Self {
        let mut t = ThreadState::new(tid, vm_id, index);
        match crate::guardian::start_time(tid) {
            Some(start_time) => {
                t.guard = Some(Guard {
                    guardian,
                    slot,
                    start_time,
                });
                t.take_over_ledger_entry();
            }
            None => log::warn!("pvsched applier: thread {tid} has no start time; not guarded"),
        }
        t
    }

    /// If the ledger says this thread is boosted already (an earlier
    /// registration or agent could not restore it), its baseline is the
    /// ledger's, never its current attributes: the entry moves to this
    /// thread's slot (armed throughout) and the thread is restored now.
    fn take_over_ledger_entry(&mut self) {
        let Some(g) = &self.guard else {
            return;
        };
        let ledger = g.guardian.ledger();
        let Some((old, base)) = ledger.armed_baseline(self.tid, g.start_time) else {
            return;
        };
        ledger.arm(g.slot, self.tid, g.start_time, &base);
        if old != g.slot {
            ledger.disarm_thread(old, self.tid, g.start_time);
        }
        log::warn!(
            "pvsched applier: thread {} is still boosted by an earlier registration; \
             restoring its recorded baseline {base:?}",
            self.tid
        );
        self.baseline = Some(base);
        self.applied = sched::get(self.tid).ok().or(Some(base));
        self.restore();
    }

    /// Level-triggered check: brings the thread to the policy's current
    /// boost (`kind`, `prio`) if a decision was lost or not applied, and back
    /// to what was applied if its attributes were changed behind our back
    /// while boosted. Returns true if it corrected something.
    pub fn reconcile(&mut self, kind: u32, prio: i32, caps: &Caps) -> bool {
        if self.exited {
            return false;
        }
        let want = if kind == BOOST_NONE {
            (BOOST_NONE, 0)
        } else {
            (kind, prio)
        };
        if want != self.decided {
            self.apply(want.0, want.1, pvsched_policy::event::R_NONE, caps);
            if self.decided == want {
                self.corrections += 1;
                return true;
            }
            return false;
        }
        let Some(applied) = self.applied else {
            return false;
        };
        if !self.still_there() {
            return false;
        }
        match sched::get(self.tid) {
            Ok(cur) if applied.is_set_in(&cur) => false,
            Ok(_) => match sched::set(self.tid, &applied) {
                Ok(()) => {
                    self.corrections += 1;
                    true
                }
                Err(e) => {
                    log::warn!("pvsched applier: reconcile: {e}");
                    self.errors += 1;
                    false
                }
            },
            Err(e) => {
                log::debug!("pvsched applier: reconcile: {e}");
                false
            }
        }
    }

    /// The thread has its baseline: the guardian has nothing to restore.
    fn disarm(&self) {
        if let Some(g) = &self.guard {
            g.guardian.ledger().disarm(g.slot);
        }
    }

    /// Applies a decision; returns true if a syscall changed the thread.
    pub fn apply(&mut self, kind: u32, prio: i32, reason: u32, caps: &Caps) -> bool {
        if self.exited {
            return false;
        }
        if pvsched_policy::event::R_LIMITS.contains(&reason) {
            self.throttles += 1;
        }
        if kind == BOOST_NONE {
            let changed = self.restore();
            if self.applied.is_none() {
                self.decided = (BOOST_NONE, 0);
            }
            return changed;
        }
        if self.baseline.is_none() && !self.still_there() {
            return false;
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
            self.decided = (kind, prio);
            return false;
        }
        if !self.still_there() {
            return false;
        }
        // Write-ahead: the guardian knows the baseline before the boost.
        if target != base
            && let Some(g) = &self.guard
        {
            g.guardian
                .ledger()
                .arm(g.slot, self.tid, g.start_time, &base);
        }
        match sched::set(self.tid, &target) {
            Ok(()) => {
                self.decided = (kind, prio);
                self.applied = if target == base { None } else { Some(target) };
                if self.applied.is_some() {
                    self.boosts_applied += 1;
                } else {
                    self.disarm();
                }
                true
            }
            Err(sched::SchedError::Set { source, .. })
                if source.raw_os_error() == Some(libc::ESRCH) =>
            {
                // The thread exited (its VM is being torn down): nothing
                // to boost, and nothing armed to restore.
                log::debug!("pvsched applier: thread {} is gone", self.tid);
                self.disarm();
                false
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
        if self.exited {
            return false;
        }
        let (Some(base), Some(_)) = (self.baseline, self.applied) else {
            return false;
        };
        if !self.still_there() {
            return false;
        }
        match sched::set(self.tid, &base) {
            Ok(()) => {
                self.disarm();
                self.applied = None;
                self.decided = (BOOST_NONE, 0);
                // Re-captured before the next boost (the VMM may change it).
                self.baseline = None;
                true
            }
            // The thread has exited (its VMM shut down first): nothing is
            // left to restore.
            Err(sched::SchedError::Set { source, .. })
                if source.raw_os_error() == Some(libc::ESRCH) =>
            {
                log::debug!(
                    "pvsched applier: thread {} is gone; nothing to restore",
                    self.tid
                );
                self.disarm();
                self.applied = None;
                self.decided = (BOOST_NONE, 0);
                self.baseline = None;
                false
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
        assert_eq!((t.policy, t.priority, t.flags), (POLICY_FIFO, 4, 1));
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
