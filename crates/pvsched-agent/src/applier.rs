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
use pvsched_policy::{Caps, CoschedUs};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
                slice_ns: 0,
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
                slice_ns: base.slice_ns,
            }
        }
        _ => *base,
    }
}

/// Where a vCPU thread is in its VM's co-scheduling period (caps
/// `cosched_us`, `cosched_period_us`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// The VM does not co-schedule (or the thread is an emulator thread).
    #[default]
    Free,
    /// The VM's vCPUs run together: SCHED_FIFO [`COSCHED_RT_PRIO`].
    On,
    /// The rest of the period: nice [`COSCHED_OFF_NICE`].
    Off,
    /// In the phase's time but out of the phase, as [`Phase::Off`], for a
    /// host thread woken on the CPU it held, until that thread leaves the
    /// CPU or the phase ends.
    Yielded,
}

/// The longest a thread whose boost gave way to a woken host thread stays
/// below the host's threads without the policy's word that they ran (a
/// record lost to a full ring): twice the policy's hold on its throughput
/// boosts, so that a boost back after the hold ends it first.
pub const GAVE_WAY_MAX_NS: u64 = 2 * pvsched_policy::event::HOST_HOLD_NS;

/// The RT priority of a co-scheduled phase: the lowest, so every boost the
/// policy decides (halt, yield) still outranks it.
pub const COSCHED_RT_PRIO: i32 = pvsched_policy::event::COSCHED_RT_PRIO as i32;

/// The nice value of a vCPU thread outside its VM's co-scheduled phase.
/// Nice 19 rather than SCHED_IDLE: on this host's EEVDF threads moved
/// between SCHED_FIFO and SCHED_IDLE every few ms got 0.69 of the CPU time
/// where their phases meant 0.40, at nice 19 0.41
/// (docs/bench/NOTES.md, "Why nice 19 off the phase").
pub const COSCHED_OFF_NICE: i32 = 19;

/// The fair-class slice of a vCPU thread outside its phase (nice
/// [`COSCHED_OFF_NICE`]: the rest of the period, a yield, a boost that
/// gave way), ns, unless [`set_off_phase_slice`] says otherwise: longer
/// than the kernel's default (0.7 ms times 1 + log2 of the CPUs, up to 8),
/// so that an ordinary host thread's wake-up preempts such a vCPU at once
/// (EEVDF lets a waking task with a shorter slice preempt; with equal
/// slices the running one keeps the CPU for its slice, and on a host
/// without high-resolution ticks until the next tick). The share is the
/// nice value's either way. On a kernel without custom slices (before
/// 6.12) nothing is set.
pub const OFF_PHASE_SLICE_NS: u64 = 4_000_000;

static OFF_PHASE_SLICE: AtomicU64 = AtomicU64::new(OFF_PHASE_SLICE_NS);

/// Sets the slice of a vCPU thread outside its phase, ns (0: the kernel's
/// default; the kernel bounds a custom slice to 0.1..=100 ms). For every
/// thread the applier moves from now on; a host daemon calls it once from
/// its configuration.
pub fn set_off_phase_slice(ns: u64) {
    OFF_PHASE_SLICE.store(ns, Ordering::Relaxed);
}

/// The slice [`effective`] gives a thread outside its phase: 0 where the
/// kernel has no custom slices, and where the one set is the default
/// (which [`sched::get`] reads back as 0).
fn off_phase_slice() -> u64 {
    let default = sched::default_slice_ns();
    match OFF_PHASE_SLICE.load(Ordering::Relaxed) {
        s if default == 0 || s == default => 0,
        s => s,
    }
}

/// How much CPU the scheduler gives `a` before other work: RT priority
/// above any nice value, a lower nice above a higher one.
fn rank(a: &SchedAttr) -> i64 {
    match a.policy {
        POLICY_DEADLINE => 1_000_000,
        POLICY_FIFO | POLICY_RR => 1000 + i64::from(a.priority),
        POLICY_IDLE => -100,
        _ => -i64::from(a.nice),
    }
}

/// What a thread whose baseline is `base` gets for the policy's boost
/// (`kind`, `prio`) in co-scheduling `phase`: the higher of the boost and
/// the phase's FIFO in the co-scheduled phase; outside it, the boost if
/// there is one, else the baseline lowered to nice [`COSCHED_OFF_NICE`]
/// with the slice [`OFF_PHASE_SLICE_NS`] (an RT, deadline or idle
/// baseline, or one already at 19, is kept).
///
/// A VM co-scheduled at its measured fair share (`cosched_us = "auto"`)
/// gets no boost outside its phase: the phase is its whole share, and a
/// boost in the rest of the period would be host CPU on top of it (S2's
/// confirmed IPI pairs, kept boosted through their off parts, left the
/// hogs half their vanilla work). Such a VM has no latency-sensitive vCPU
/// (one leaves the phase within a tick), so what it gives up is the boosts
/// of its batch work.
pub fn effective(base: &SchedAttr, kind: u32, prio: i32, phase: Phase, caps: &Caps) -> SchedAttr {
    let out = matches!(phase, Phase::Off | Phase::Yielded);
    let kind = if out && caps.cosched_us == CoschedUs::Auto {
        BOOST_NONE
    } else {
        kind
    };
    let boost = if kind == BOOST_NONE {
        *base
    } else {
        plan(base, kind, prio, caps)
    };
    match phase {
        Phase::Free => boost,
        Phase::On => {
            let gang = plan(base, BOOST_RT, COSCHED_RT_PRIO, caps);
            if rank(&gang) > rank(&boost) {
                gang
            } else {
                boost
            }
        }
        Phase::Off | Phase::Yielded => {
            let fair = base.policy == POLICY_NORMAL || base.policy == pvsched_abi::POLICY_BATCH;
            if boost != *base || !fair || base.nice >= COSCHED_OFF_NICE {
                boost
            } else {
                SchedAttr {
                    nice: COSCHED_OFF_NICE,
                    slice_ns: off_phase_slice(),
                    ..*base
                }
            }
        }
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
    /// Where the thread is in its VM's co-scheduling period.
    pub phase: Phase,
    /// Co-scheduling phase changes applied.
    pub phase_changes: u64,
    /// Times the thread left its phase for a host thread's wake-up.
    pub phase_yields: u64,
    /// Times its boost ended for a host thread's wake-up
    /// ([`R_HOST_YIELD`](pvsched_policy::event::R_HOST_YIELD)).
    pub boost_yields: u64,
    /// When (monotonic ns) its boost last gave way to a woken host thread,
    /// while it stays below the host's threads for it (see
    /// [`ThreadState::host_threads_ran`]); None otherwise, and always
    /// outside [`Phase::Free`] (every phase change clears it).
    gave_way_at: Option<u64>,
    /// Where the policy learns the thread's phase (None in unit tests).
    word: Option<PhaseWord>,
}

/// A thread's `phase` word in the policy's mapped `vcpus` array.
#[derive(Clone)]
pub struct PhaseWord {
    map: Arc<pvsched_abi::seq::SharedRegion>,
    off: usize,
}

impl PhaseWord {
    /// The word at byte offset `off` of `map` (4-byte aligned; a store
    /// outside the mapping does nothing).
    pub fn new(map: Arc<pvsched_abi::seq::SharedRegion>, off: usize) -> Self {
        PhaseWord { map, off }
    }

    fn set(&self, phase: u32) {
        use pvsched_abi::seq::SharedWords;
        self.map
            .words()
            .store(self.off, phase, std::sync::atomic::Ordering::Release);
    }
}

impl std::fmt::Debug for PhaseWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PhaseWord(+{})", self.off)
    }
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
            phase: Phase::Free,
            phase_changes: 0,
            phase_yields: 0,
            boost_yields: 0,
            gave_way_at: None,
            word: None,
        }
    }

    /// The policy learns this thread's phase from `word`.
    pub fn with_phase_word(mut self, word: PhaseWord) -> Self {
        self.word = Some(word);
        self
    }

    /// Tells the policy the thread's phase: before the system call that
    /// moves the thread, so a host thread woken right after it is seen.
    /// [`Phase::Yielded`] is the policy's own change.
    fn publish_phase(&self) {
        use pvsched_policy::event::{PHASE_FREE, PHASE_OFF, PHASE_ON};
        let Some(w) = &self.word else {
            return;
        };
        match self.phase {
            Phase::Free => w.set(PHASE_FREE),
            Phase::On => w.set(PHASE_ON),
            Phase::Off => w.set(PHASE_OFF),
            Phase::Yielded => {}
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
        self.gave_way_at = None;
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
        if reason == pvsched_policy::event::R_HOST_YIELD {
            self.boost_yields += 1;
        }
        // A boost that ended for a woken host thread leaves the thread at
        // nice 19 rather than its baseline until the host threads waiting
        // for its CPU ran: moved from SCHED_FIFO straight back to its
        // nice-0 baseline, the kernel (EEVDF, protecting the slice of the
        // task it just moved back to the fair class) often ran the vCPU
        // again first, and the woken thread waited until the next tick. A
        // phase's yield does the same (Phase::Yielded).
        self.gave_way_at = (kind == BOOST_NONE
            && reason == pvsched_policy::event::R_HOST_YIELD
            && self.phase == Phase::Free)
            .then(pvsched_util::mono_ns);
        if kind == BOOST_NONE && self.phase == Phase::Free && self.gave_way_at.is_none() {
            let changed = self.restore();
            if self.applied.is_none() {
                self.decided = (BOOST_NONE, 0);
            }
            return changed;
        }
        let prio = if kind == BOOST_NONE { 0 } else { prio };
        self.set_target(kind, prio, caps)
    }

    /// Moves the thread to co-scheduling `phase` (its decided boost kept);
    /// returns true if a syscall changed the thread. `Phase::Free` puts it
    /// back where the policy alone has it: its baseline unless boosted.
    pub fn set_phase(&mut self, phase: Phase, caps: &Caps) -> bool {
        if self.exited || phase == self.phase {
            return false;
        }
        if phase == Phase::Yielded {
            self.phase_yields += 1;
        }
        self.phase = phase;
        self.gave_way_at = None;
        self.publish_phase();
        let (kind, prio) = self.decided;
        let changed = if phase == Phase::Free && kind == BOOST_NONE {
            self.restore()
        } else {
            self.set_target(kind, prio, caps)
        };
        if changed {
            self.phase_changes += 1;
        }
        changed
    }

    /// Sets the attributes of the policy's boost (`kind`, `prio`) in the
    /// thread's phase, capturing its baseline first if it has none.
    fn set_target(&mut self, kind: u32, prio: i32, caps: &Caps) -> bool {
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
        // Below the host's threads after a boost gave way: as a phase's
        // yield.
        let phase = if self.gave_way_at.is_some() {
            Phase::Yielded
        } else {
            self.phase
        };
        let target = effective(&base, kind, prio, phase, caps);
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

    /// The host threads its boost gave way to ran (the policy's
    /// `R_HOST_DONE` record): back to its baseline unless something else
    /// was decided for it since. Returns true if a syscall changed the
    /// thread.
    pub fn host_threads_ran(&mut self) -> bool {
        if self.gave_way_at.take().is_none() || self.decided.0 != BOOST_NONE {
            return false;
        }
        self.restore()
    }

    /// As [`Self::host_threads_ran`] once [`GAVE_WAY_MAX_NS`] passed since
    /// its boost gave way (at `now`), in case that record was lost.
    pub fn gave_way_expired(&mut self, now: u64) -> bool {
        match self.gave_way_at {
            Some(at) if now.saturating_sub(at) >= GAVE_WAY_MAX_NS => self.host_threads_ran(),
            _ => false,
        }
    }

    /// Puts the thread back to its baseline if we changed it, out of any
    /// co-scheduling phase (the next phase change moves it again).
    pub fn restore(&mut self) -> bool {
        if self.exited {
            return false;
        }
        self.phase = Phase::Free;
        self.gave_way_at = None;
        self.publish_phase();
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

    fn fifo(priority: u32) -> SchedAttr {
        SchedAttr {
            policy: POLICY_FIFO,
            priority,
            nice: 0,
            flags: 0,
            slice_ns: 0,
        }
    }

    fn normal(nice: i32) -> SchedAttr {
        SchedAttr {
            policy: POLICY_NORMAL,
            priority: 0,
            nice,
            flags: 0,
            slice_ns: 0,
        }
    }

    /// A thread outside its phase: `nice` with the longer slice.
    fn off(nice: i32) -> SchedAttr {
        SchedAttr {
            slice_ns: off_phase_slice(),
            ..normal(nice)
        }
    }

    #[test]
    fn outside_the_phase_the_slice_is_longer_and_a_boost_keeps_the_threads_own() {
        let c = Caps {
            cosched_us: CoschedUs::Us(10_000),
            ..Caps::default()
        };
        let own = SchedAttr {
            slice_ns: 3_000_000,
            ..normal(0)
        };
        let expect = if sched::default_slice_ns() == 0 {
            0 // no custom slices on this kernel: none is set
        } else {
            OFF_PHASE_SLICE_NS
        };
        for phase in [Phase::Off, Phase::Yielded] {
            let a = effective(&own, BOOST_NONE, 0, phase, &c);
            assert_eq!((a.nice, a.slice_ns), (COSCHED_OFF_NICE, expect));
        }
        // A nice boost and the phase's own states leave the slice as it was.
        let n = effective(&own, BOOST_NICE, -5, Phase::Off, &c);
        assert_eq!((n.nice, n.slice_ns), (-5, 3_000_000));
        assert_eq!(effective(&own, BOOST_NONE, 0, Phase::Free, &c), own);
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
        let rt = fifo(50);
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

    #[test]
    fn a_cosched_phase_runs_at_fifo_1_and_the_rest_at_nice_19() {
        let c = Caps::default();
        let on = effective(&normal(0), BOOST_NONE, 0, Phase::On, &c);
        assert_eq!((on.policy, on.priority), (POLICY_FIFO, 1));
        assert_eq!(
            effective(&normal(0), BOOST_NONE, 0, Phase::Off, &c),
            off(19)
        );
        assert_eq!(
            effective(&normal(0), BOOST_NONE, 0, Phase::Free, &c),
            normal(0)
        );
    }

    #[test]
    fn a_boost_outranks_the_cosched_phase_either_way() {
        // A phase set as a number ("auto" has its own rule, below).
        let c = Caps {
            cosched_us: CoschedUs::Us(10_000),
            ..Caps::default()
        };
        // The policy's halt boost (FIFO 1) and yield boost (FIFO 2) hold in
        // the phase outside the co-scheduled one, and FIFO 2 beats it.
        let halt = effective(&normal(0), BOOST_RT, 1, Phase::Off, &c);
        assert_eq!((halt.policy, halt.priority), (POLICY_FIFO, 1));
        let y = effective(&normal(0), BOOST_RT, 2, Phase::On, &c);
        assert_eq!((y.policy, y.priority), (POLICY_FIFO, 2));
        // A nice boost is below the co-scheduled phase's FIFO.
        let n = effective(&normal(0), BOOST_NICE, -5, Phase::On, &c);
        assert_eq!((n.policy, n.priority), (POLICY_FIFO, 1));
        assert_eq!(
            effective(&normal(0), BOOST_NICE, -5, Phase::Off, &c),
            normal(-5)
        );
    }

    #[test]
    fn an_auto_vm_gets_no_boost_outside_its_phase() {
        let c = Caps {
            cosched_us: CoschedUs::Auto,
            ..Caps::default()
        };
        for (kind, prio) in [(BOOST_RT, 1), (BOOST_RT, 2), (BOOST_NICE, -5)] {
            assert_eq!(effective(&normal(0), kind, prio, Phase::Off, &c), off(19));
        }
        // In its phase a yield boost still outranks the phase's FIFO.
        let y = effective(&normal(0), BOOST_RT, 2, Phase::On, &c);
        assert_eq!((y.policy, y.priority), (POLICY_FIFO, 2));
        // A VM out of co-scheduling (Free) is boosted as any other.
        let f = effective(&normal(0), BOOST_RT, 1, Phase::Free, &c);
        assert_eq!((f.policy, f.priority), (POLICY_FIFO, 1));
    }

    #[test]
    fn the_cosched_phases_never_touch_an_rt_or_idle_baseline_wrongly() {
        let c = Caps::default();
        let rt = fifo(50);
        for phase in [Phase::On, Phase::Off] {
            assert_eq!(effective(&rt, BOOST_NONE, 0, phase, &c), rt);
        }
        let idle = SchedAttr {
            policy: POLICY_IDLE,
            ..normal(0)
        };
        assert_eq!(effective(&idle, BOOST_NONE, 0, Phase::Off, &c), idle);
        // Without RT the co-scheduled phase is the nice floor.
        let no_rt = Caps {
            allow_rt: false,
            ..Caps::default()
        };
        assert_eq!(
            effective(&normal(0), BOOST_NONE, 0, Phase::On, &no_rt),
            normal(-10)
        );
    }
}
