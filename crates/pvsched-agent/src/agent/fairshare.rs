//! `cosched_us = "auto"`: the co-scheduled phase that gives a VM its fair
//! share of the host, measured.
//!
//! Without co-scheduling, the host's scheduler shares an overcommitted
//! host among the threads that want to run, each as much as the others
//! unless it wants less: a max-min ("water-filling") split of the CPUs.
//! What every thread on the host wanted is measured, not sampled: the
//! time it ran and the time it waited on a run queue in a window
//! (`/proc/<pid>/task/<tid>/schedstat`; a host without `CONFIG_SCHEDSTATS`
//! has no `/proc/schedstat` to give the sums at once); a light thread
//! wants only what it ran ([`Demands`]). The level `L` at which
//! `Σ min(wanted_i, L)` fills the host's CPUs is what a thread that wants
//! more gets; the VM is owed `Σ min(wanted_v, L)` over its vCPU threads.
//! Its co-scheduled phase holds `min(vCPUs, CPUs)` CPUs, so the phase is
//! the owed CPUs over that, of the period. What the VM gets outside its
//! phase (nice 19 still runs now and then) and what it leaves unused inside
//! it are corrected by an integral term on the VM's measured CPU against
//! what it is owed.
//!
//! The reads run on their own thread at nice 10, within a CPU-time
//! budget per window, never on the applier ([`super::scan`]): their size
//! is the host's number of threads, which any local user decides. A
//! window whose read ran out of budget leaves every share as it was
//! ([`AutoPhase::incomplete`]).
//!
//! The sums are the same with and without the VM's phases: they change
//! who waits, not which threads want to run. (A first version sampled
//! `/proc/loadavg`'s running count at the agent's ticks and saw about 10 %
//! more runnable threads than there were: the agent wakes with the timers
//! of other threads. A second one split the host by the mean
//! run / (run + wait) of all threads, which the many threads that want
//! little and get all of it pull down: the VMs got 5–20 % less than
//! without co-scheduling.)

use pvsched_util::thread_cpu_ns;
use std::fs;

/// How long a measuring window lasts: long enough for thousands of the
/// host scheduler's slices, short enough to follow a load that changes.
pub const WINDOW_NS: u64 = 1_000_000_000;

/// The least the host's threads must want, in CPUs per CPU, before a VM is
/// co-scheduled: below it nobody waits long for a CPU, every vCPU runs
/// when it wants, and a phase would only move CPU around.
pub const OVERCOMMIT: f64 = 1.1;

/// How far the integral correction may move a phase, of the period.
const MAX_CORRECTION: f64 = 0.25;

/// How far above the operator's limit a VM's share may be, of the period,
/// and still be co-scheduled (at the limit) rather than left to the host.
const OVER_LIMIT_SLACK: f64 = 0.05;

/// A phase below this share of the period is not worth its switches.
const MIN_PHASE: f64 = 0.02;

/// (run, wait) ns from the text of a `/proc/<tid>/schedstat`.
pub fn parse_thread(text: &str) -> Option<(u64, u64)> {
    let mut f = text.split_whitespace().map(|x| x.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

/// A thread's (tid, run + wait ns, run ns), as [`all_threads`] reads it.
pub type ThreadFigures = (u32, u64, u64);

/// Threads read between two looks at the budget and at whether to go on.
const CHECK_EVERY: usize = 32;

/// One read of every thread on the host.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    /// (tid, run + wait ns, run ns), sorted by tid.
    pub threads: Vec<ThreadFigures>,
    /// Every thread was read: false when the CPU-time budget ran out
    /// first, and the figures are of part of the host only.
    pub complete: bool,
}

/// Every thread on the host now, read from `/proc`, within
/// `cpu_budget_ns` of the calling thread's CPU time: once the read has
/// cost that much, it stops and says so ([`Reading::complete`]). Threads
/// that exit while it reads are left out; a kernel without
/// `CONFIG_SCHED_INFO` has no schedstat files, so the list is empty and
/// "auto" never co-schedules. None as soon as `go_on` says false (looked
/// at every few threads): the caller no longer wants the figures.
pub fn all_threads(cpu_budget_ns: u64, mut go_on: impl FnMut() -> bool) -> Option<Reading> {
    let mut out = Vec::new();
    let start = thread_cpu_ns();
    let Ok(procs) = fs::read_dir("/proc") else {
        return Some(Reading {
            threads: out,
            complete: false,
        });
    };
    let mut read: usize = 0;
    // Looked at every CHECK_EVERY threads and at every process.
    let mut within = |read: usize| -> Option<bool> {
        if !go_on() {
            return None;
        }
        Some(
            !read.is_multiple_of(CHECK_EVERY)
                || thread_cpu_ns().saturating_sub(start) < cpu_budget_ns,
        )
    };
    let mut complete = true;
    'procs: for p in procs.flatten() {
        if !within(0)? {
            complete = false;
            break;
        }
        let name = p.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            read += 1;
            if !within(read)? {
                complete = false;
                break 'procs;
            }
            let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let path = format!("/proc/{pid}/task/{tid}/schedstat");
            if let Some((run, wait)) = fs::read_to_string(path).ok().and_then(|s| parse_thread(&s))
            {
                out.push((tid, run.saturating_add(wait), run));
            }
        }
    }
    out.sort_unstable_by_key(|t| t.0);
    Some(Reading {
        threads: out,
        complete,
    })
}

/// A thread runnable for at least this share of a window may want a
/// whole CPU (see [`Demands`]).
pub const HEAVY: f64 = 0.5;

/// What the host's threads wanted in a window.
///
/// A thread that was runnable for at least [`HEAVY`] of it and ran at
/// least half of what an equal split among such threads gives wants what
/// it was runnable for; any other thread wants what it ran. A light thread
/// (a VMM's main loop woken by timers) gets what it wants once it waits
/// its turn: its waits are latency, and a VM's co-scheduled phases make
/// them longer without it wanting more CPU (counted as demand, they made
/// the split, and the phases, swing from one window to the next).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Demands {
    /// Each thread's demand, CPUs.
    pub demands: Vec<f64>,
    /// The least a thread must run, CPUs, to count as heavy.
    pub heavy_ran: f64,
}

impl Demands {
    /// From each thread's (tid, ran, runnable CPUs) in the window
    /// ([`host_threads`]), on `cpus`.
    pub fn new(threads: &[(u32, f64, f64)], cpus: f64) -> Demands {
        let candidates = threads.iter().filter(|t| t.2 >= HEAVY).count().max(1);
        let heavy_ran = 0.5 * (cpus / candidates as f64).min(1.0);
        let demands = threads
            .iter()
            .map(|&(_, ran, runnable)| demand(ran, runnable, heavy_ran))
            .filter(|d| *d > 0.0)
            .collect();
        Demands { demands, heavy_ran }
    }
}

/// A thread's demand, CPUs: what it was runnable for if it is heavy (see
/// [`Demands`]), else what it ran; at most one CPU.
pub fn demand(ran: f64, runnable: f64, heavy_ran: f64) -> f64 {
    if is_heavy(ran, runnable, heavy_ran) {
        runnable.min(1.0)
    } else {
        ran.min(1.0)
    }
}

/// Whether a thread that ran `ran` and was runnable for `runnable` CPUs is
/// heavy (see [`Demands`]).
pub fn is_heavy(ran: f64, runnable: f64, heavy_ran: f64) -> bool {
    runnable >= HEAVY && ran >= heavy_ran
}

/// Each host thread present at both reads: (tid, what it ran, what it was
/// runnable for) between them, CPUs over `dt_ns`. Both lists, and the
/// result, sorted by tid.
pub fn host_threads(
    before: &[(u32, u64, u64)],
    after: &[(u32, u64, u64)],
    dt_ns: u64,
) -> Vec<(u32, f64, f64)> {
    let dt = dt_ns.max(1) as f64;
    after
        .iter()
        .filter_map(|(tid, w1, r1)| {
            let i = before.binary_search_by_key(tid, |t| t.0).ok()?;
            let (_, w0, r0) = before[i];
            let ran = r1.saturating_sub(r0) as f64 / dt;
            let runnable = w1.saturating_sub(w0) as f64 / dt;
            Some((*tid, ran, runnable.max(ran)))
        })
        .collect()
}

/// The max-min split of `cpus` CPUs among threads that want `demands`
/// CPUs: the level every thread that wants more than it gets, and their
/// total demand. With less demand than CPUs, every thread gets what it
/// wants (the level is 1).
pub fn fair_level(demands: &[f64], cpus: f64) -> (f64, f64) {
    let total: f64 = demands.iter().sum();
    if total <= cpus {
        return (1.0, total);
    }
    let mut d: Vec<f64> = demands.to_vec();
    d.sort_unstable_by(f64::total_cmp);
    let mut left = cpus;
    for (i, x) in d.iter().enumerate() {
        let n = (d.len() - i) as f64;
        if x * n >= left {
            return (left / n, total);
        }
        left -= x;
    }
    (1.0, total)
}

/// One window of a VM's measurement.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    /// What the host's threads wanted in it, CPUs ([`fair_level`]).
    pub host_demand: f64,
    /// The host's CPUs.
    pub host_cpus: u32,
    /// What the VM's vCPUs are owed of it, CPUs: `Σ min(wanted, level)`.
    pub owed: f64,
    /// What they got, CPUs.
    pub got: f64,
    /// The VM's vCPUs.
    pub vcpus: u32,
    /// Some vCPU of the VM is latency-sensitive (a phase's off part would
    /// hold its RT task's wake-ups behind the host's work).
    pub latency_sensitive: bool,
    /// Some vCPU of the VM is heavy ([`Demands`]: runnable for at least
    /// half of the window). A VM whose vCPUs are all light (a lightly used
    /// VM, an interactive one) waits little and gains nothing from a
    /// phase, whose off part would hold its wake-ups behind the host's
    /// work.
    pub contended: bool,
}

/// At most this many windows a VM must spend without a latency-sensitive
/// vCPU before it is co-scheduled. A guest that has run an RT task for a
/// while is an RT guest between two RT jobs: a phase begun while its RT
/// task sleeps would hold the task's first wake-ups in the off part (S4's
/// guest, busy writing one cyclictest's results before the next
/// cyclictest, was co-scheduled between the two and the next one's first
/// cycles waited up to 14 ms). The cool-down is as many windows as the VM
/// was latency-sensitive in a row, between 1 and this: one RT moment (the
/// reference VMM's test guest as it boots) costs a window, not ten, of a
/// ten-second run.
pub const LS_COOLDOWN_WINDOWS: u32 = 10;

/// The auto phase of one VM: its last share and integral correction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AutoPhase {
    /// Share of the period the VM's phase holds (0: not co-scheduled).
    pub share: f64,
    /// Integral correction, of the period.
    correction: f64,
    /// Windows ended since a vCPU of the VM was last latency-sensitive
    /// (saturating; `u32::MAX`: never seen so).
    since_ls: u32,
    /// Windows of the last run of latency-sensitive ones (the cool-down).
    ls_windows: u32,
    /// A vCPU was latency-sensitive in the window now open.
    ls_seen: bool,
}

impl Default for AutoPhase {
    fn default() -> Self {
        AutoPhase {
            share: 0.0,
            correction: 0.0,
            since_ls: u32::MAX,
            ls_windows: 0,
            ls_seen: false,
        }
    }
}

impl AutoPhase {
    /// A vCPU of the VM is latency-sensitive now: no phase, and none until
    /// the cool-down ([`LS_COOLDOWN_WINDOWS`]) has passed without.
    pub fn latency_sensitive(&mut self) {
        // A cool-down that has passed ends the run; one still going goes on.
        let ls_windows = if self.since_ls > self.cooldown() {
            0
        } else {
            self.ls_windows
        };
        *self = AutoPhase {
            since_ls: 0,
            ls_windows,
            ls_seen: true,
            ..AutoPhase::default()
        };
    }

    /// Windows without a latency-sensitive vCPU before a phase.
    fn cooldown(&self) -> u32 {
        self.ls_windows.clamp(1, LS_COOLDOWN_WINDOWS)
    }

    /// No phase (the correction starts again), remembering when the VM was
    /// last latency-sensitive.
    fn off(&mut self) -> f64 {
        *self = AutoPhase {
            since_ls: self.since_ls,
            ls_windows: self.ls_windows,
            ..AutoPhase::default()
        };
        0.0
    }

    /// Ends a window whose figures are incomplete (the host-thread read
    /// ran out of its budget, [`all_threads`]): the share stays what it
    /// was, never raised, and the correction is not moved (what the VM is
    /// owed is not known); a window with a latency-sensitive vCPU still
    /// counts as one and leaves no phase.
    pub fn incomplete(&mut self) -> f64 {
        if std::mem::take(&mut self.ls_seen) {
            self.ls_windows = self.ls_windows.saturating_add(1);
            return 0.0;
        }
        self.since_ls = self.since_ls.saturating_add(1);
        self.share
    }

    /// Ends a window, measured as `w`, and gives the share of the next
    /// one, at most `max_share` (the operator's `max_cosched_pct` / 100,
    /// or less: the phase bound over the period).
    pub fn update(&mut self, w: &Window, max_share: f64) -> f64 {
        let cpus = f64::from(w.host_cpus.max(1));
        // A NaN demand (no window) is no overcommit either.
        let overcommitted = w
            .host_demand
            .partial_cmp(&(OVERCOMMIT * cpus))
            .is_some_and(|o| o != std::cmp::Ordering::Less);
        if w.latency_sensitive {
            self.latency_sensitive();
        }
        // A window with a latency-sensitive vCPU, at its end or at any tick
        // in it, is one more of the run; the cool-down starts after it.
        if std::mem::take(&mut self.ls_seen) {
            self.ls_windows = self.ls_windows.saturating_add(1);
            return 0.0;
        }
        self.since_ls = self.since_ls.saturating_add(1);
        if self.since_ls <= self.cooldown() || !w.contended || !overcommitted {
            return self.off();
        }
        let held = f64::from(w.vcpus.min(w.host_cpus).max(1));
        let max_share = max_share.clamp(0.0, 1.0);
        // A phase cut to the operator's limit would give the VM less than
        // the host's scheduler does without one: leave it to the host.
        // The slack keeps a VM owed about the limit from flapping.
        if w.owed / held > max_share + OVER_LIMIT_SLACK {
            return self.off();
        }
        if self.share > 0.0 {
            // Only a window the VM spent co-scheduled says how far its
            // phase misses its share (one without is the host's own
            // sharing, which the feed-forward term already follows).
            self.correction = (self.correction + 0.5 * (w.owed - w.got) / held)
                .clamp(-MAX_CORRECTION, MAX_CORRECTION);
        }
        let share = (w.owed / held + self.correction).clamp(0.0, max_share);
        self.share = if share.is_finite() && share >= MIN_PHASE {
            share
        } else {
            0.0
        };
        self.share
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_figures_parse() {
        assert_eq!(parse_thread("123 456 7\n"), Some((123, 456)));
        assert_eq!(parse_thread("123\n"), None);
        assert_eq!(parse_thread("x 1 2\n"), None);
        assert_eq!(parse_thread(""), None);
        // This host's own files.
        let t = std::time::Instant::now();
        let cpu = thread_cpu_ns();
        let all = all_threads(u64::MAX, || true).unwrap();
        // What one window's read of every thread costs here (printed, not
        // asserted: docs/operating.md quotes it).
        println!(
            "all_threads: {} threads in {:?}, {} µs of CPU",
            all.threads.len(),
            t.elapsed(),
            thread_cpu_ns().saturating_sub(cpu) / 1000
        );
        assert!(all.complete);
        let all = all.threads;
        assert!(
            all.iter().any(|t| t.0 == std::process::id()),
            "{} threads",
            all.len()
        );
        assert!(all.windows(2).all(|w| w[0].0 < w[1].0), "sorted by tid");
    }

    /// A read stops once it has cost its budget, saying it is incomplete,
    /// and at once when its caller no longer wants it.
    #[test]
    fn a_read_keeps_to_its_budget_and_stops_when_told() {
        let none = all_threads(0, || true).unwrap();
        assert!(!none.complete, "a budget of 0 ends the read at once");
        assert!(none.threads.len() < CHECK_EVERY, "{}", none.threads.len());
        assert_eq!(all_threads(u64::MAX, || false), None);
        let mut looks = 0;
        assert_eq!(
            all_threads(u64::MAX, || {
                looks += 1;
                looks < 3
            }),
            None
        );
    }

    #[test]
    fn the_host_threads_present_at_both_reads_count() {
        let before = [(1, 100, 60), (2, 50, 50), (5, 10, 0), (8, 0, 0)];
        // Thread 2 exited, 7 is new, 5 ran backwards (a reused tid).
        let after = [(1, 300, 160), (5, 5, 0), (7, 1_000, 1_000), (8, 600, 100)];
        assert_eq!(
            host_threads(&before, &after, 1_000),
            vec![(1, 0.1, 0.2), (5, 0.0, 0.0), (8, 0.1, 0.6)]
        );
    }

    #[test]
    fn light_threads_want_what_they_ran_however_long_they_waited() {
        // Four CPU-bound threads on 2 CPUs, and a main loop that ran 0.05
        // but waited behind a phase for most of the window.
        let d = Demands::new(
            &[
                (1, 0.5, 1.0),
                (2, 0.5, 1.0),
                (3, 0.45, 1.0),
                (4, 0.5, 1.0),
                (5, 0.05, 0.7),
            ],
            2.0,
        );
        assert!((d.heavy_ran - 0.2).abs() < 1e-9, "{d:?}");
        assert_eq!(d.demands, vec![1.0, 1.0, 1.0, 1.0, 0.05]);
        assert_eq!(demand(0.1, 0.3, 0.2), 0.1);
        assert_eq!(demand(0.3, 0.4, 0.2), 0.3);
        assert_eq!(demand(0.3, 0.6, 0.2), 0.6);
        assert_eq!(
            Demands::new(&[(1, 0.0, 0.0)], 2.0).demands,
            Vec::<f64>::new()
        );
    }

    #[test]
    fn the_level_fills_the_cpus_max_min() {
        // Four threads that want a whole CPU on 2 CPUs: half each.
        assert_eq!(fair_level(&[1.0; 4], 2.0), (0.5, 4.0));
        // Light threads get what they want, the rest split what is left.
        let (l, t) = fair_level(&[0.1, 0.1, 1.0, 1.0, 1.0, 1.0], 2.0);
        assert!((l - 0.45).abs() < 1e-9 && (t - 4.2).abs() < 1e-9, "{l} {t}");
        // Room for everyone.
        assert_eq!(fair_level(&[0.5, 0.5], 2.0), (1.0, 1.0));
        assert_eq!(fair_level(&[], 2.0), (1.0, 0.0));
    }

    /// A window on 2 CPUs whose threads wanted `demand` CPUs; the VM's 2
    /// vCPUs are owed `owed` and got `got`.
    fn window(demand: f64, owed: f64, got: f64) -> Window {
        Window {
            host_demand: demand,
            host_cpus: 2,
            owed,
            got,
            vcpus: 2,
            latency_sensitive: false,
            contended: true,
        }
    }

    #[test]
    fn the_share_is_what_the_vm_is_owed_over_the_cpus_it_holds() {
        // A 2-vCPU VM owed 1 CPU of 2: half of the period.
        let mut a = AutoPhase::default();
        let s = a.update(&window(4.0, 1.0, 1.0), 0.5);
        assert!((s - 0.5).abs() < 1e-9, "{s}");
        let mut a = AutoPhase::default();
        let s = a.update(&window(6.0, 2.0 / 3.0, 2.0 / 3.0), 1.0);
        assert!((s - 1.0 / 3.0).abs() < 1e-9, "{s}");
        // The operator's limit holds, a little above it...
        let mut a = AutoPhase::default();
        assert!((a.update(&window(3.0, 1.08, 1.08), 0.5) - 0.5).abs() < 1e-9);
        // ...and a VM owed more than its limit allows is left to the host
        // (a 4-vCPU VM owed 4/3 of 2 CPUs: 2/3 of the period).
        assert_eq!(a.update(&window(3.0, 4.0 / 3.0, 4.0 / 3.0), 0.5), 0.0);
        assert_eq!(a, AutoPhase::default());
    }

    #[test]
    fn no_phase_without_overcommit_or_with_a_latency_sensitive_vcpu() {
        let mut a = AutoPhase::default();
        assert_eq!(a.update(&window(2.0, 2.0, 2.0), 0.5), 0.0);
        assert_eq!(a.update(&window(2.1, 1.9, 1.9), 0.5), 0.0);
        assert_eq!(a.update(&window(f64::NAN, 1.0, 1.0), 0.5), 0.0);
        assert!(a.update(&window(4.0, 1.0, 1.0), 0.5) > 0.0);
        let mut w = window(4.0, 1.0, 1.0);
        w.latency_sensitive = true;
        // A long run of latency-sensitive windows (an RT guest)...
        for _ in 0..2 * LS_COOLDOWN_WINDOWS {
            assert_eq!(a.update(&w, 0.5), 0.0);
        }
        // ...is followed by LS_COOLDOWN_WINDOWS windows without a phase.
        for n in 0..LS_COOLDOWN_WINDOWS {
            assert_eq!(a.update(&window(4.0, 1.0, 1.0), 0.5), 0.0, "window {n}");
        }
        assert!(a.update(&window(4.0, 1.0, 1.0), 0.5) > 0.0);
        // One tick that sees an RT task ends the phase and starts a new
        // run: one window, and a cool-down of one.
        a.latency_sensitive();
        assert_eq!(a.share, 0.0);
        assert_eq!(a.update(&window(4.0, 1.0, 1.0), 0.5), 0.0);
        assert_eq!(a.update(&window(4.0, 1.0, 1.0), 0.5), 0.0);
        assert!(a.update(&window(4.0, 1.0, 1.0), 0.5) > 0.0);
        // Three windows in a row: three without.
        for _ in 0..3 {
            assert_eq!(a.update(&w, 0.5), 0.0);
        }
        for n in 0..3 {
            assert_eq!(a.update(&window(4.0, 1.0, 1.0), 0.5), 0.0, "window {n}");
        }
        assert!(a.update(&window(4.0, 1.0, 1.0), 0.5) > 0.0);
        let mut a = AutoPhase::default();
        // An idle VM on a busy host.
        assert_eq!(a.update(&window(4.0, 0.01, 0.01), 0.5), 0.0);
        // A VM whose vCPUs get all they want, however much that is.
        assert!(a.update(&window(4.0, 0.6, 0.6), 0.5) > 0.0);
        let mut w = window(4.0, 0.6, 0.6);
        w.contended = false;
        assert_eq!(a.update(&w, 0.5), 0.0);
        assert_eq!(a, AutoPhase::default());
    }

    #[test]
    fn the_correction_takes_back_what_the_vm_gets_beyond_its_share() {
        // Owed 1 CPU of 2, and the phase of a half gives it 1.1 (nice 19
        // outside it still runs): the share shrinks until it gets 1.
        let mut a = AutoPhase::default();
        let mut share = a.update(&window(4.0, 1.0, 1.0), 1.0);
        for _ in 0..20 {
            share = a.update(&window(4.0, 1.0, 2.0 * share + 0.1), 1.0);
        }
        assert!((2.0 * share + 0.1 - 1.0).abs() < 0.01, "{share}");
        // Bounded, whatever the VM's figures say.
        for _ in 0..100 {
            a.update(&window(4.0, 1.0, 2.0), 1.0);
        }
        assert!(a.share >= 0.5 - MAX_CORRECTION - 1e-9, "{a:?}");
    }

    #[test]
    fn an_incomplete_window_keeps_the_share_and_never_raises_it() {
        let mut a = AutoPhase::default();
        // No phase yet: an incomplete window gives none.
        assert_eq!(a.incomplete(), 0.0);
        let share = a.update(&window(4.0, 1.0, 1.0), 1.0);
        assert!(share > 0.0);
        let before = a;
        for _ in 0..3 {
            assert_eq!(a.incomplete(), share);
        }
        assert_eq!((a.share, a.correction), (before.share, before.correction));
        // A latency-sensitive vCPU still ends the phase at once, and the
        // window counts in its run.
        a.latency_sensitive();
        assert_eq!(a.incomplete(), 0.0);
        assert_eq!(a.share, 0.0);
    }
}
