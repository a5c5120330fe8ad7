//! Which `"auto"` VMs co-scheduling serves: those whose guests hand work
//! across their vCPUs or wait for each other, as their drivers count it
//! (ABI 1.5, `F_SYNC_COUNTS`).
//!
//! A phase only helps a guest whose vCPUs need each other at the same time:
//! a task woken on another vCPU, a synchronous cross-CPU call, a lock held
//! by a preempted vCPU. A batch guest, each task keeping to its vCPU, does
//! as much work per CPU-second without one, and a phase would still make
//! every host thread that wakes on its CPUs wait. The host cannot tell the
//! two apart by itself: measured on a TCG host, the vCPU threads of a batch
//! guest also halt beside preempted siblings and wake each other (QEMU's
//! own lock), about as often as those of a synchronising guest
//! (docs/bench/s6-gate-signals.json). The guest can: its driver counts the
//! wake-ups of tasks that last ran on another CPU and the waits it reports
//! in `wait_on`.
//!
//! The counts are the guest's word: a guest that inflates them gets phases,
//! and a phase is never more than its fair share of the host
//! ([`super::fairshare`]), so it gains no CPU by lying, only the shape of
//! its share.

use pvsched_abi::seq::{SharedWords, slot_in};
use std::sync::atomic::Ordering;

/// A VM co-schedules from a window in which its score reaches this, per
/// vCPU and second. Measured with 2-vCPU 7.3 guests beside host hogs, per
/// vCPU and second: the batch controls score 0-1 while they run
/// (docs/bench/s6-gate-windows.json, every window of 16 runs), the TLB
/// stressor and dbench 20-30 while co-scheduled (more without), hackbench
/// over 150 (docs/bench/s6-gate.json).
pub const ON_PER_VCPU_S: f64 = 16.0;
/// Windows in a row at or above [`ON_PER_VCPU_S`] that start its phases: a
/// batch guest's kernel hands work across CPUs in bursts as programs start
/// and end, a synchronising one all the time. On the S6 guests a batch
/// program's start scored 15-38 for one or two seconds and its end (the
/// results collected) 15-64 for one (s6-gate-windows.json): one program
/// ending and the next starting can make three windows in a row, and
/// while this was 3 a batch guest got phases in one of four repetitions
/// (docs/bench/s6-waiters.json).
pub const ON_WINDOWS: u32 = 5;
/// ...and stops after [`QUIET_WINDOWS`] windows in a row below this.
pub const OFF_PER_VCPU_S: f64 = 12.0;
/// Windows in a row below [`OFF_PER_VCPU_S`] that end its phases: a phase
/// shortens the waits it serves, so the score drops while it runs.
pub const QUIET_WINDOWS: u32 = 3;
/// A wait (a vCPU spinning until another answers) weighs this many
/// wake-ups: a batch guest makes a wait a second or less per vCPU, a
/// synchronising one several, while its kernel wakes its own threads
/// across CPUs a few times a second either way.
pub const WAIT_WEIGHT: u64 = 8;
/// The shortest window a rate is taken over, ns.
pub const WINDOW_NS: u64 = 1_000_000_000;

/// What the guest of a device-region VM with `vcpus` vCPUs has counted so
/// far, summed over its slots: (wakes, waits). None when its driver did
/// not negotiate `F_SYNC_COUNTS` (or wrote no header). The counters are
/// read as they are, not through the seq protocol: each is one store of
/// its own, and a vCPU preempted in the middle of a slot update (seq odd)
/// would otherwise hide them for as long as it waits for a CPU.
pub fn guest_counts<W: SharedWords + ?Sized>(w: &W, vcpus: u32) -> Option<(u64, u64)> {
    if w.load(0, Ordering::Acquire) != pvsched_abi::REGION_MAGIC {
        return None;
    }
    let lo = w.load(
        std::mem::offset_of!(pvsched_abi::RegionHeader, driver_features_lo),
        Ordering::Acquire,
    );
    if u64::from(lo) & pvsched_abi::F_SYNC_COUNTS == 0 {
        return None;
    }
    let (mut wakes, mut waits) = (0u64, 0u64);
    for i in 0..vcpus {
        // A slot outside the region (a region smaller than its vCPU
        // count asks) counts nothing.
        let Some(slot) = slot_in(w, vcpus, i) else {
            continue;
        };
        let at = |field: usize| load_u64(w, slot + field);
        wakes = wakes.saturating_add(at(std::mem::offset_of!(pvsched_abi::SlotGuest, wakes)));
        waits = waits.saturating_add(at(std::mem::offset_of!(pvsched_abi::SlotGuest, waits)));
    }
    Some((wakes, waits))
}

/// The little-endian u64 at byte offset `off`, which its writer stores at
/// once: its high word again until it reads the same on both sides of the
/// low one, so that a carry between the two loads is never read torn.
fn load_u64<W: SharedWords + ?Sized>(w: &W, off: usize) -> u64 {
    let mut hi = w.load(off + 4, Ordering::Acquire);
    for _ in 0..4 {
        let lo = w.load(off, Ordering::Acquire);
        let again = w.load(off + 4, Ordering::Acquire);
        if again == hi {
            return u64::from(hi) << 32 | u64::from(lo);
        }
        hi = again;
    }
    u64::from(hi) << 32
}

/// One VM's gate: whether its phases run, from its guest's counts.
#[derive(Clone, Debug, Default)]
pub struct SyncGate {
    /// The score and time (ns) the current window started at.
    start: Option<(u64, u64)>,
    /// Co-scheduling now.
    on: bool,
    /// Windows in a row below [`OFF_PER_VCPU_S`].
    quiet: u32,
    /// Windows in a row at or above [`ON_PER_VCPU_S`].
    busy: u32,
    /// The last window's score per vCPU and second.
    rate: f64,
    /// The guest reported counts at the last update.
    reported: bool,
    /// Windows ended so far (a new rate each).
    windows: u64,
}

impl SyncGate {
    /// Whether the VM co-schedules.
    pub fn on(&self) -> bool {
        self.on
    }

    /// The last window's score per vCPU and second (wakes plus
    /// [`WAIT_WEIGHT`] × waits).
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Windows ended so far: a caller that saw a different number before
    /// an update has a new [`SyncGate::rate`].
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// The last window's score, None while the guest reports no counts.
    pub fn reported_rate(&self) -> Option<f64> {
        self.reported.then_some(self.rate)
    }

    /// Feeds the VM's counts so far (None: none reported) at `now_ns`;
    /// a window ends once [`WINDOW_NS`] have passed since it started.
    /// Returns whether the VM co-schedules.
    pub fn update(&mut self, counts: Option<(u64, u64)>, now_ns: u64, vcpus: u32) -> bool {
        let Some((wakes, waits)) = counts else {
            // No counts, no phase: nothing says the guest would gain.
            *self = SyncGate::default();
            return false;
        };
        self.reported = true;
        let score = wakes.saturating_add(waits.saturating_mul(WAIT_WEIGHT));
        let Some((first, at)) = self.start else {
            self.start = Some((score, now_ns));
            return self.on;
        };
        if score < first || now_ns < at {
            // The counters started again (the driver was reloaded, the
            // device reset): a new window from here.
            self.start = Some((score, now_ns));
            return self.on;
        }
        let ns = now_ns - at;
        if ns < WINDOW_NS {
            return self.on;
        }
        self.start = Some((score, now_ns));
        let rate = (score - first) as f64 * 1e9 / ns as f64 / f64::from(vcpus.max(1));
        self.rate = rate;
        self.windows = self.windows.wrapping_add(1);
        if rate >= ON_PER_VCPU_S {
            self.busy = self.busy.saturating_add(1);
            self.quiet = 0;
            if self.busy >= ON_WINDOWS {
                self.on = true;
            }
        } else if rate < OFF_PER_VCPU_S {
            self.busy = 0;
            self.quiet = self.quiet.saturating_add(1);
            if self.quiet >= QUIET_WINDOWS {
                self.on = false;
            }
        } else {
            self.busy = 0;
            self.quiet = 0;
        }
        self.on
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    /// Feeds one window per second with `per_s` score per second for a
    /// 2-vCPU VM; returns the gate's state after each.
    fn run(g: &mut SyncGate, t0: u64, total0: u64, per_s: &[u64]) -> Vec<bool> {
        let (mut t, mut total) = (t0, total0);
        per_s
            .iter()
            .map(|&n| {
                t += S;
                total += n;
                g.update(Some((total, 0)), t, 2)
            })
            .collect()
    }

    #[test]
    fn a_batch_guest_never_gets_a_phase() {
        let mut g = SyncGate::default();
        g.update(Some((0, 0)), 0, 2);
        // 10 per vCPU and second: a batch guest's own wake-ups.
        assert!(run(&mut g, 0, 0, &[20; 30]).iter().all(|on| !on));
        assert!((g.rate() - 10.0).abs() < 1e-9);
    }

    /// The gate's state after each of `per_s` windows from a new gate
    /// (2 vCPUs, wake-ups only).
    fn fresh(per_s: &[u64]) -> Vec<bool> {
        let mut g = SyncGate::default();
        g.update(Some((0, 0)), 0, 2);
        run(&mut g, 0, 0, per_s)
    }

    /// Windows in a row at the threshold and what follows them.
    fn busy_then(n: u32, per_s: u64, then: &[u64]) -> Vec<u64> {
        let mut v = vec![per_s; n as usize];
        v.extend_from_slice(then);
        v
    }

    #[test]
    fn a_synchronising_guest_gets_one_from_its_nth_window_and_keeps_it() {
        // 20 per vCPU and second, then 13 (its phases shorten the waits).
        let on = fresh(&busy_then(ON_WINDOWS, 40, &[26, 26, 26]));
        let first = on.iter().position(|&on| on);
        assert_eq!(first, Some(ON_WINDOWS as usize - 1), "{on:?}");
        assert!(on[ON_WINDOWS as usize - 1..].iter().all(|&on| on), "{on:?}");
    }

    #[test]
    fn program_starts_and_ends_open_nothing() {
        // Shapes measured on the S6 batch guests (per vCPU and second,
        // doubled for the 2 vCPUs here; s6-gate-windows.json): a program's
        // start, one or two windows at 15-38; its end, one at up to 64;
        // and an end right before the next program's start.
        let on = fresh(&[
            0, 50, 34, 0, 0, 0, 128, 0, 0, 104, 76, 40, 0, 0, 96, 72, 0, 1,
        ]);
        assert!(on.iter().all(|on| !on), "{on:?}");
        let on = fresh(&busy_then(ON_WINDOWS - 1, 100, &[0, 0]));
        assert!(on.iter().all(|on| !on), "{on:?}");
    }

    #[test]
    fn it_stops_after_quiet_windows_in_a_row() {
        let on = fresh(&busy_then(ON_WINDOWS, 40, &[2, 2, 40, 2, 2, 2, 2]));
        let n = ON_WINDOWS as usize;
        // On from the nth busy window; two quiet ones and a busy one keep
        // it; QUIET_WINDOWS quiet ones in a row end it.
        assert!(on[..n - 1].iter().all(|on| !on), "{on:?}");
        assert!(on[n - 1..n + 5].iter().all(|&on| on), "{on:?}");
        assert_eq!(on[n + 5..], [false, false], "{on:?}");
        assert_eq!(QUIET_WINDOWS, 3);
    }

    #[test]
    fn waits_weigh_more_than_wakes() {
        // 4 waits a second over 2 vCPUs: 16 per vCPU and second.
        let mut g = SyncGate::default();
        g.update(Some((0, 0)), 0, 2);
        let mut on = false;
        for i in 1..=u64::from(ON_WINDOWS) {
            on = g.update(Some((0, 4 * i)), i * S, 2);
        }
        assert!(on);
        // As many wake-ups: 2.
        let mut g = SyncGate::default();
        g.update(Some((0, 0)), 0, 2);
        for i in 1..=u64::from(ON_WINDOWS) {
            on = g.update(Some((4 * i, 0)), i * S, 2);
        }
        assert!(!on);
    }

    #[test]
    fn no_counts_no_phase_and_a_restart_is_a_new_window() {
        let n = u64::from(ON_WINDOWS);
        let mut g = SyncGate::default();
        g.update(Some((0, 0)), 0, 2);
        for i in 1..n {
            assert!(!g.update(Some((100 * i, 0)), i * S, 2));
        }
        assert!(g.update(Some((100 * n, 0)), n * S, 2));
        assert!(!g.update(None, (n + 1) * S, 2));
        assert_eq!(g.reported_rate(), None);
        let mut g = SyncGate::default();
        g.update(Some((1000, 0)), 0, 2);
        // The counters restart below where the window began: no rate.
        assert!(!g.update(Some((10, 0)), S, 2));
        for i in 1..n {
            assert!(!g.update(Some((10 + 100 * i, 0)), (i + 1) * S, 2));
        }
        assert!(g.update(Some((10 + 100 * n, 0)), (n + 1) * S, 2));
    }

    #[test]
    fn a_window_shorter_than_a_second_decides_nothing() {
        let mut g = SyncGate::default();
        g.update(Some((0, 0)), 0, 2);
        g.update(Some((1000, 0)), S / 2, 2);
        assert_eq!(g.rate(), 0.0);
        g.update(Some((1000, 0)), S, 2);
        assert_eq!(g.rate(), 500.0);
    }

    /// The counters are read without the seq protocol, from the slots the
    /// region holds: a slot mid-update (seq odd) still counts, and a
    /// region without the feature in its header counts nothing.
    #[test]
    fn counts_are_read_from_the_slots_whatever_their_seq() {
        use pvsched_abi::seq::SharedRegion;
        let path = std::env::temp_dir().join(format!("pvsched-gate-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f.set_len(pvsched_abi::region_size(2) as u64).unwrap();
        let r = SharedRegion::map(f, pvsched_abi::region_size(2) as usize).unwrap();
        let w = r.words();
        assert_eq!(guest_counts(&w, 2), None, "no header");
        w.store(0, pvsched_abi::REGION_MAGIC, Ordering::Release);
        let feat = std::mem::offset_of!(pvsched_abi::RegionHeader, driver_features_lo);
        w.store(feat, pvsched_abi::F_DEVICE_REGION as u32, Ordering::Release);
        assert_eq!(guest_counts(&w, 2), None, "not negotiated");
        w.store(
            feat,
            (pvsched_abi::F_DEVICE_REGION | pvsched_abi::F_SYNC_COUNTS) as u32,
            Ordering::Release,
        );
        for (i, (wakes, waits)) in [(5u64 << 32 | 7, 3u64), (11, 1)].into_iter().enumerate() {
            let s = pvsched_abi::slot_offset(2, i as u32) as usize;
            w.store(s, 1, Ordering::Release); // seq odd: mid-update
            let put = |off: usize, v: u64| {
                w.store(s + off, v as u32, Ordering::Release);
                w.store(s + off + 4, (v >> 32) as u32, Ordering::Release);
            };
            put(std::mem::offset_of!(pvsched_abi::SlotGuest, wakes), wakes);
            put(std::mem::offset_of!(pvsched_abi::SlotGuest, waits), waits);
        }
        assert_eq!(guest_counts(&w, 2), Some(((5u64 << 32) + 18, 4)));
    }

    proptest! {
        /// Whatever the guest writes, the gate never panics and its rate
        /// is finite and not negative.
        #[test]
        fn any_counts(steps in proptest::collection::vec(
            (proptest::option::of((any::<u64>(), any::<u64>())), 0u64..5 * S, 0u32..70), 1..40)) {
            let mut g = SyncGate::default();
            let mut t = 0u64;
            for (c, dt, v) in steps {
                t = t.saturating_add(dt);
                g.update(c, t, v);
                prop_assert!(g.rate().is_finite() && g.rate() >= 0.0);
            }
        }
    }
}
