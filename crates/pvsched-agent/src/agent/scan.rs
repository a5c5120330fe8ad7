//! The host-thread scan of `cosched_us = "auto"`, on its own thread.
//!
//! "auto" needs what every thread on the host ran and waited in each
//! measuring window ([`fairshare`]): one read of
//! `/proc/<pid>/task/<tid>/schedstat` per thread, and any local user
//! decides how many threads there are (a VMM that created 20 000 made
//! the read take 200 ms of every second). Done by the applier at
//! SCHED_FIFO 99, that read held every decision of every VM (throttles
//! included) and every host thread below FIFO 99 for its length. So it
//! runs here, on the "pvsched-scan" thread at SCHED_OTHER nice
//! [`SCAN_NICE`] (never RT: a thread that cannot lower itself does not
//! scan), which also turns the two reads into the window's figures. The
//! applier takes them from a slot it only `try_lock`s: it never waits for
//! the scan and never reads a host thread's figures itself.
//!
//! Bounded: a read stops after [`SCAN_CPU_BUDGET_NS`] of the scan
//! thread's CPU time; a window with such a read at either end is
//! incomplete, and every "auto" VM keeps the share it had, never raised
//! ([`fairshare::AutoPhase::incomplete`]). The thread parks while no VM
//! is "auto" (woken when one is) and between two reads; it ends with the
//! agent, which joins it.

use super::fairshare::{self, Reading};
use crate::sched::{self, SchedAttr};
use pvsched_util::mono_ns;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

/// The scan thread's nice: below the host's ordinary threads, so that a
/// busy host gives its own work the CPU first; the figures of a read that
/// takes longer are as good (each thread is read about as far into both
/// reads of a window).
pub const SCAN_NICE: i32 = 10;

/// The most CPU time one read of the host's threads may take, ns: 10 %
/// of one CPU per one-second window, at nice [`SCAN_NICE`]. At about 9 µs
/// a thread that is some 11 000 threads; a host with more gets
/// incomplete windows, in which no "auto" share grows.
pub const SCAN_CPU_BUDGET_NS: u64 = 100_000_000;

/// One measuring window of the host's threads, as the applier uses it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostWindow {
    /// Each host thread read at both ends: (tid, ran, runnable CPUs),
    /// sorted by tid ([`fairshare::host_threads`]).
    pub threads: Vec<(u32, f64, f64)>,
    /// The least a thread must run to count as heavy, CPUs
    /// ([`fairshare::Demands`]).
    pub heavy_ran: f64,
    /// What a thread that wants more gets, CPUs ([`fairshare::fair_level`]).
    pub level: f64,
    /// What all the host's threads wanted, CPUs.
    pub host_demand: f64,
    /// Both reads were whole: false when either ran out of its budget,
    /// and the figures are of part of the host only.
    pub complete: bool,
}

impl HostWindow {
    /// The window between two reads `dt_ns` apart on `cpus` CPUs.
    pub fn new(before: &Reading, after: &Reading, dt_ns: u64, cpus: f64) -> HostWindow {
        let threads = fairshare::host_threads(&before.threads, &after.threads, dt_ns);
        let demands = fairshare::Demands::new(&threads, cpus);
        let (level, host_demand) = fairshare::fair_level(&demands.demands, cpus);
        HostWindow {
            threads,
            heavy_ran: demands.heavy_ran,
            level,
            host_demand,
            complete: before.complete && after.complete,
        }
    }
}

/// What the scan thread and the applier share.
#[derive(Default)]
struct Shared {
    /// The agent is stopping.
    stop: AtomicBool,
    /// Some VM is "auto": the scan reads.
    wanted: AtomicBool,
    /// The last window, until the applier takes it.
    latest: Mutex<Option<HostWindow>>,
    /// The scan thread's TID, 0 until it runs.
    tid: AtomicU32,
}

/// The scan thread; dropping it stops and joins it.
pub struct Scanner {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// The applier's side of the scan: never blocks.
#[derive(Clone)]
pub struct ScanHandle {
    shared: Arc<Shared>,
    thread: Thread,
}

impl Scanner {
    /// Starts the scan thread (parked until [`ScanHandle::want`]) for a
    /// host of `cpus` CPUs, each read within `cpu_budget_ns`.
    pub fn spawn(cpus: f64, cpu_budget_ns: u64) -> io::Result<(Scanner, ScanHandle)> {
        let shared = Arc::new(Shared::default());
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pvsched-scan".into())
            .spawn(move || scan_loop(&s2, cpus, cpu_budget_ns))?;
        let handle = ScanHandle {
            shared: shared.clone(),
            thread: thread.thread().clone(),
        };
        Ok((
            Scanner {
                shared,
                thread: Some(thread),
            },
            handle,
        ))
    }

    /// The scan thread's TID, 0 until it runs (or if it ended because it
    /// could not leave an RT policy).
    pub fn tid(&self) -> u32 {
        self.shared.tid.load(Ordering::Relaxed)
    }
}

impl Drop for Scanner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl ScanHandle {
    /// Whether some VM is "auto": the scan reads only then (a switch on
    /// wakes it; off, the window it may have left is dropped). An atomic
    /// store and at most a wake-up: the applier calls it every tick.
    pub fn want(&self, on: bool) {
        let was = self.shared.wanted.swap(on, Ordering::SeqCst);
        if on && !was {
            self.thread.unpark();
        }
        if !on {
            drop(self.take());
        }
    }

    /// The window the scan finished since the last call, if any. Never
    /// waits: while the scan thread holds the slot (to put a window in),
    /// nothing, and the window is taken at the next call.
    pub fn take(&self) -> Option<HostWindow> {
        self.shared.latest.try_lock().ok()?.take()
    }
}

/// Puts the calling thread at SCHED_OTHER nice [`SCAN_NICE`] (lowering
/// needs no privilege) and says whether it is at a non-RT policy now.
fn lower_self() -> bool {
    let me = sched::gettid();
    let attr = SchedAttr {
        policy: pvsched_abi::POLICY_NORMAL,
        priority: 0,
        nice: SCAN_NICE,
        flags: 0,
        slice_ns: 0,
    };
    if let Err(e) = sched::set(me, &attr) {
        log::warn!("pvsched scan: cannot set SCHED_OTHER nice {SCAN_NICE}: {e}");
    }
    sched::get(me).is_ok_and(|a| {
        matches!(
            a.policy,
            pvsched_abi::POLICY_NORMAL | pvsched_abi::POLICY_BATCH | pvsched_abi::POLICY_IDLE
        )
    })
}

fn scan_loop(shared: &Shared, cpus: f64, cpu_budget_ns: u64) {
    shared.tid.store(sched::gettid(), Ordering::Relaxed);
    if !lower_self() {
        log::error!(
            "pvsched scan: this thread stays at an RT policy; it does not read the host's \
             threads, and no cosched_us = \"auto\" VM is co-scheduled"
        );
        return;
    }
    let stop = || shared.stop.load(Ordering::SeqCst);
    let wanted = || shared.wanted.load(Ordering::SeqCst);
    // The last read and when it started.
    let mut last: Option<(u64, Reading)> = None;
    let mut next_ns = 0u64;
    let mut was_complete = true;
    while !stop() {
        if !wanted() {
            last = None;
            std::thread::park();
            continue;
        }
        let now = mono_ns();
        if now < next_ns {
            std::thread::park_timeout(Duration::from_nanos(next_ns - now));
            continue;
        }
        let Some(reading) = fairshare::all_threads(cpu_budget_ns, || wanted() && !stop()) else {
            continue;
        };
        next_ns = now.saturating_add(fairshare::WINDOW_NS);
        if reading.complete != was_complete {
            was_complete = reading.complete;
            if was_complete {
                log::info!("pvsched scan: the host's threads are read whole again");
            } else {
                log::warn!(
                    "pvsched scan: reading the host's threads took more than its budget \
                     ({} ms of CPU) after {} threads: \"auto\" co-scheduling keeps every \
                     VM's share as it was until a read is whole",
                    cpu_budget_ns / 1_000_000,
                    reading.threads.len()
                );
            }
        }
        let window = last.take().map(|(start, before)| {
            HostWindow::new(&before, &reading, now.saturating_sub(start), cpus)
        });
        last = Some((now, reading));
        let Some(window) = window else {
            continue;
        };
        // Put in the slot only while still wanted; what it held before
        // (never taken) is freed outside the lock.
        let old = {
            let mut slot = shared.latest.lock().unwrap_or_else(|e| e.into_inner());
            if wanted() { slot.replace(window) } else { None }
        };
        drop(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(threads: &[(u32, u64, u64)], complete: bool) -> Reading {
        Reading {
            threads: threads.to_vec(),
            complete,
        }
    }

    #[test]
    fn a_window_is_incomplete_if_either_read_was() {
        let a = reading(&[(1, 0, 0), (2, 0, 0)], true);
        let b = reading(&[(1, 1_000, 500), (2, 1_000, 1_000)], true);
        let w = HostWindow::new(&a, &b, 1_000, 1.0);
        assert!(w.complete);
        assert_eq!(w.threads, vec![(1, 0.5, 1.0), (2, 1.0, 1.0)]);
        assert!((w.host_demand - 2.0).abs() < 1e-9, "{w:?}");
        assert!((w.level - 0.5).abs() < 1e-9, "{w:?}");
        assert!(!HostWindow::new(&reading(&[], false), &b, 1_000, 1.0).complete);
        assert!(!HostWindow::new(&a, &reading(&[], false), 1_000, 1.0).complete);
    }

    /// The scan thread runs at a non-RT policy, reads only while wanted,
    /// and the applier's side gets its window without waiting.
    #[test]
    fn the_scan_reads_while_wanted_and_hands_over_without_waiting() {
        let (scanner, handle) = Scanner::spawn(1.0, SCAN_CPU_BUDGET_NS).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while scanner.tid() == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let attr = sched::get(scanner.tid()).unwrap();
        assert_eq!(
            (attr.policy, attr.nice),
            (pvsched_abi::POLICY_NORMAL, SCAN_NICE)
        );
        // Not wanted: no window, however long.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(handle.take(), None);
        handle.want(true);
        // Two reads a window apart.
        let w = loop {
            if let Some(w) = handle.take() {
                break w;
            }
            assert!(std::time::Instant::now() < deadline, "no window");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(w.complete);
        let me = sched::gettid();
        assert!(
            w.threads.iter().any(|t| t.0 == me),
            "{} threads",
            w.threads.len()
        );
        handle.want(false);
        drop(scanner);
    }
}
