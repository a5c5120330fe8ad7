//! CPU hogs for loaded-host runs: threads of the bench process at
//! SCHED_OTHER, nice 0, started by the bench and always stopped (dropping
//! [`Hogs`] stops and joins them; they die with the process in any case).
//!
//! Kinds ([`LoadKind`]): `busy` hogs never sleep; `sleepy` hogs run for a
//! random 0.5–5 ms, then sleep a random 0.1–1 ms, so they keep waking up
//! and competing for wakeup preemption with the vCPU threads; `mixed` is
//! both. Every hog counts the iterations of its loop — one iteration is a
//! fixed unit of integer work ([`UNIT_STEPS`] xorshift64 steps) — so a run
//! can report how much CPU work the hogs got done beside the VM.
//!
//! Used by `pvsched run --compare` (its built-in host load) and by
//! `pvsched-bench` (the loaded variants of S1–S5).

use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use std::os::unix::thread::JoinHandleExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// xorshift64 steps per counted hog iteration (a fixed unit of work).
pub const UNIT_STEPS: u32 = 1024;

/// What kind of hogs load the host (`pvsched-bench --load`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LoadKind {
    /// Busy loops that never sleep.
    #[default]
    Busy,
    /// Run a random 0.5–5 ms, sleep a random 0.1–1 ms, again and again.
    Sleepy,
    /// `--hogs` busy hogs plus `--hogs` sleepy hogs.
    Mixed,
}

impl LoadKind {
    /// `busy`, `sleepy`, `mixed`.
    pub fn name(self) -> &'static str {
        match self {
            LoadKind::Busy => "busy",
            LoadKind::Sleepy => "sleepy",
            LoadKind::Mixed => "mixed",
        }
    }
}

/// The load beside one run: `n` hogs of `kind` (`mixed`: `n` of each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// Kind.
    pub kind: LoadKind,
    /// `--hogs`: hogs of the kind (of each kind for `mixed`).
    pub n: usize,
}

impl Load {
    /// No hogs (idle-host variants).
    pub const NONE: Load = Load {
        kind: LoadKind::Busy,
        n: 0,
    };

    /// Busy hogs.
    pub fn busy_threads(self) -> usize {
        match self.kind {
            LoadKind::Busy | LoadKind::Mixed => self.n,
            LoadKind::Sleepy => 0,
        }
    }

    /// Sleepy hogs.
    pub fn sleepy_threads(self) -> usize {
        match self.kind {
            LoadKind::Sleepy | LoadKind::Mixed => self.n,
            LoadKind::Busy => 0,
        }
    }

    /// All hog threads.
    pub fn threads(self) -> usize {
        self.busy_threads() + self.sleepy_threads()
    }

    /// `{kind, busy, sleepy}` for the JSON (`kind` is `none` without hogs).
    pub fn report(self) -> LoadReport {
        LoadReport {
            kind: if self.threads() == 0 {
                "none"
            } else {
                self.kind.name()
            }
            .to_owned(),
            busy: self.busy_threads(),
            sleepy: self.sleepy_threads(),
        }
    }
}

/// The host load of a run, for the JSON (and read back from it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// `busy`, `sleepy`, `mixed`, or `none` without hogs.
    pub kind: String,
    /// Busy hog threads.
    pub busy: usize,
    /// Sleepy hog threads.
    pub sleepy: usize,
}

/// One hog's iteration counter, on its own cache line.
#[repr(align(64))]
#[derive(Default)]
struct Counter(AtomicU64);

/// The hogs' iteration counters and CPU-time clocks, readable while they
/// run.
#[derive(Clone, Default)]
pub struct HogCounter {
    counters: Arc<Vec<Counter>>,
    clocks: Arc<Vec<libc::clockid_t>>,
}

impl HogCounter {
    /// Iterations of every hog so far.
    pub fn total(&self) -> u64 {
        self.counters
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .fold(0, u64::saturating_add)
    }

    /// CPU time every hog has had so far, ns; `None` without hogs, or once
    /// they stopped.
    pub fn cpu_ns(&self) -> Option<u64> {
        if self.clocks.is_empty() {
            return None;
        }
        self.clocks
            .iter()
            .map(|&c| pvsched_util::cpu_clock_ns(c))
            .sum()
    }
}

/// Running hog threads.
pub struct Hogs {
    stop: Arc<AtomicBool>,
    counter: HogCounter,
    threads: Vec<JoinHandle<()>>,
}

/// SCHED_OTHER at nice 0 for the calling thread, whatever the bench was
/// started with (e.g. under `nice`): the hogs must compete fairly with the
/// vCPU threads, which the worker also puts at nice 0.
pub fn normal_nice0() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(0, ...) on the calling thread with a valid
    // sched_param; it reads `param` only during the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) } != 0 {
        log::warn!("bench: SCHED_OTHER: {}", std::io::Error::last_os_error());
    }
    // SAFETY: plain syscall, no pointers.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on our own thread id; no pointers.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 0) } != 0 {
        log::warn!("bench: nice 0: {}", std::io::Error::last_os_error());
    }
}

/// One counted iteration: [`UNIT_STEPS`] dependent xorshift64 steps.
#[inline(never)]
fn unit(mut x: u64) -> u64 {
    for _ in 0..UNIT_STEPS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    std::hint::black_box(x)
}

/// A small xorshift64 generator for the sleepy hogs' random phases.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// Uniform-ish in `lo..=hi` (µs).
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        lo + x % (hi - lo + 1)
    }
}

/// Busy hog: units until stopped.
fn busy(stop: &AtomicBool, count: &AtomicU64) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while !stop.load(Ordering::Relaxed) {
        x = unit(x);
        count.fetch_add(1, Ordering::Relaxed);
    }
}

/// Sleepy hog: units for 0.5–5 ms (wall clock), then sleep 0.1–1 ms.
fn sleepy(stop: &AtomicBool, count: &AtomicU64, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut x = seed | 1;
    while !stop.load(Ordering::Relaxed) {
        let run = Duration::from_micros(rng.between(500, 5000));
        let t0 = Instant::now();
        while t0.elapsed() < run && !stop.load(Ordering::Relaxed) {
            x = unit(x);
            count.fetch_add(1, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_micros(rng.between(100, 1000)));
    }
}

impl Hogs {
    /// Starts the hogs of `load` (none for `n` = 0).
    pub fn start(load: Load) -> std::io::Result<Hogs> {
        let stop = Arc::new(AtomicBool::new(false));
        let n = load.threads();
        let counter = HogCounter {
            counters: Arc::new((0..n).map(|_| Counter::default()).collect()),
            clocks: Arc::default(),
        };
        let mut hogs = Hogs {
            stop: stop.clone(),
            counter: counter.clone(),
            threads: Vec::new(),
        };
        let seed0 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        for i in 0..n {
            let stop = stop.clone();
            let counter = counter.clone();
            let is_busy = i < load.busy_threads();
            let seed = seed0 ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let t = std::thread::Builder::new()
                .name(format!(
                    "bench-hog {} {i}",
                    if is_busy { "busy" } else { "sleepy" }
                ))
                .spawn(move || {
                    normal_nice0();
                    let count = &counter.counters[i].0;
                    if is_busy {
                        busy(&stop, count);
                    } else {
                        sleepy(&stop, count, seed);
                    }
                })?;
            hogs.threads.push(t);
        }
        // Every hog has a clock, or none is counted (a partial sum would
        // look like less work).
        let clocks: Option<Vec<_>> = hogs
            .threads
            .iter()
            .map(|t| pvsched_util::thread_cpu_clock(t.as_pthread_t()))
            .collect();
        hogs.counter.clocks = Arc::new(clocks.unwrap_or_default());
        Ok(hogs)
    }

    /// Their iteration counters (a handle that stays valid after a stop).
    pub fn counter(&self) -> HogCounter {
        self.counter.clone()
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(kind: LoadKind, n: usize) -> Load {
        Load { kind, n }
    }

    #[test]
    fn load_kinds_count_threads() {
        assert_eq!(load(LoadKind::Busy, 3).threads(), 3);
        assert_eq!(load(LoadKind::Sleepy, 3).sleepy_threads(), 3);
        assert_eq!(load(LoadKind::Sleepy, 3).busy_threads(), 0);
        assert_eq!(load(LoadKind::Mixed, 2).threads(), 4);
        assert_eq!(Load::NONE.threads(), 0);
        assert_eq!(Load::NONE.report().kind, "none");
        assert_eq!(
            serde_json::to_value(load(LoadKind::Mixed, 1).report()).unwrap(),
            serde_json::json!({"kind": "mixed", "busy": 1, "sleepy": 1})
        );
        for k in [LoadKind::Busy, LoadKind::Sleepy, LoadKind::Mixed] {
            assert_eq!(LoadKind::from_str(k.name(), false), Ok(k));
        }
        assert!(LoadKind::from_str("lazy", false).is_err());
    }

    #[test]
    fn rng_stays_in_range() {
        let mut r = Rng::new(42);
        for _ in 0..10_000 {
            let x = r.between(100, 1000);
            assert!((100..=1000).contains(&x));
        }
    }

    /// Starts and stops every kind; the counters only ever grow (no
    /// assertion on how much work got done: tests don't time).
    #[test]
    fn hogs_start_count_and_stop() {
        for kind in [LoadKind::Busy, LoadKind::Sleepy, LoadKind::Mixed] {
            let h = Hogs::start(load(kind, 1)).unwrap();
            assert_eq!(h.threads.len(), load(kind, 1).threads());
            let c = h.counter();
            let a = c.total();
            drop(h);
            let b = c.total();
            assert!(b >= a);
            assert_eq!(c.total(), b, "stopped hogs count no more");
        }
        let none = Hogs::start(Load::NONE).unwrap();
        assert!(none.threads.is_empty());
        assert_eq!(none.counter().total(), 0);
    }
}
