//! `pvsched-bench host-costs`: what the operations pvschedd's applier is
//! made of cost in CPU time on this host, so its own CPU in S6 can be read
//! against what the host charges for them.
//!
//! The applier sleeps in `epoll_wait`, is woken by the policy's record,
//! calls `sched_setattr` on a vCPU thread (which preempts or lets run
//! whatever is on that thread's CPU) and sleeps again: one wake-up, one
//! change and one sleep per record. On a host that is itself a VM, a
//! wake-up that crosses CPUs, a timer and a change that preempts another
//! CPU's thread each cost exits to the hypervisor, charged to the thread
//! that caused them. Each figure is the CPU time (`CLOCK_THREAD_CPUTIME_ID`)
//! of the measured thread per operation, median and range over rounds:
//!
//! * `wake_same_cpu_us`: a `SCHED_FIFO` thread blocked in `epoll_wait` on an
//!   eventfd, woken by a thread on its own CPU (it preempts the waker),
//!   until it blocks again;
//! * `wake_same_cpu_timer_us`: the same with a 1 ms timeout on the wait,
//!   as the applier's wait has while a tick is due soon (a timer armed and
//!   cancelled each time);
//! * `wake_other_cpu_us`: the same, woken from the other CPU while a
//!   `SCHED_OTHER` thread spins on its own;
//! * `timer_sleep_us`: a thread's 50 µs `nanosleep` on an otherwise idle
//!   CPU;
//! * `setattr_preempting_us`: the caller's cost of one `sched_setattr` that
//!   moves a thread spinning on the other CPU between `SCHED_FIFO` 1 and
//!   `SCHED_OTHER` nice 19 while a second spinner competes there, so each
//!   call changes which of the two runs;
//! * `setattr_queued_us`: the same change made from the thread's own CPU
//!   by a `SCHED_FIFO` caller that preempted it (it waits on the run queue,
//!   nothing else to preempt).
//!
//! Needs root (`SCHED_FIFO`) and two online CPUs (0 and 1).

use crate::s4::Spread;
use clap::Args;
use pvsched_abi::{POLICY_FIFO, POLICY_NORMAL};
use pvsched_agent::sched::{self, SchedAttr};
use pvsched_util::thread_cpu_ns;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Errors of `pvsched-bench host-costs`.
#[derive(Debug, thiserror::Error)]
pub enum HostCostsError {
    /// Fewer than two CPUs: nothing crosses CPUs.
    #[error("host-costs: needs CPUs 0 and 1 online, this host has {0} CPU(s)")]
    Cpus(usize),
    /// A system call the measurement needs failed.
    #[error("host-costs: {what}: {source} (run as root: SCHED_FIFO needs CAP_SYS_NICE)")]
    Sys {
        /// Which call.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The report could not be written.
    #[error("host-costs: writing {path}: {source}")]
    Write {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, HostCostsError>;

/// Arguments of `pvsched-bench host-costs`.
#[derive(Args, Debug)]
pub struct HostCostsArgs {
    /// Operations per round.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(100..))]
    pub ops: u32,
    /// Rounds; each figure is the median and range over them.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// Also write the report as JSON to this file ("-": standard output).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The report.
#[derive(Debug, Serialize)]
pub struct HostCosts {
    /// The command that made it.
    pub command: String,
    /// What it ran on.
    pub machine: serde_json::Value,
    /// Operations per round.
    pub ops: u32,
    /// Rounds.
    pub rounds: u32,
    /// A FIFO thread's wake-up by a thread on its own CPU and its sleep
    /// again, µs of its CPU.
    pub wake_same_cpu_us: Spread,
    /// The same with a 1 ms timeout on its wait, µs of its CPU.
    pub wake_same_cpu_timer_us: Spread,
    /// The same, woken from the other CPU while an ordinary thread spins on
    /// its own, µs of its CPU.
    pub wake_other_cpu_us: Spread,
    /// A 50 µs `nanosleep`, µs of the sleeper's CPU.
    pub timer_sleep_us: Spread,
    /// One `sched_setattr` that preempts the other CPU's running thread, µs
    /// of the caller's CPU.
    pub setattr_preempting_us: Spread,
    /// The same change of a thread queued on the caller's own CPU, µs of the
    /// caller's CPU.
    pub setattr_queued_us: Spread,
}

fn sys(what: &'static str) -> HostCostsError {
    HostCostsError::Sys {
        what,
        source: std::io::Error::last_os_error(),
    }
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) -> Result<()> {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (0 or 1 here).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size given.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(sys("sched_setaffinity"));
    }
    Ok(())
}

/// Sets `tid`'s policy (0: the calling thread) with the agent's own
/// `sched_setattr`, the call the applier makes.
fn setattr(tid: u32, policy: u32, nice: i32, priority: u32) -> Result<()> {
    let attr = SchedAttr {
        policy,
        priority,
        nice,
        flags: 0,
        slice_ns: 0,
    };
    sched::set(tid, &attr).map_err(|e| HostCostsError::Sys {
        what: "sched_setattr",
        source: std::io::Error::other(e),
    })
}

/// A thread spinning on `cpu` until `stop`; its TID once it runs.
fn spinner(cpu: usize, stop: Arc<AtomicBool>) -> (std::thread::JoinHandle<()>, u32) {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = pin(cpu);
        let _ = tx.send(sched::gettid());
        while !stop.load(Ordering::Relaxed) {
            std::hint::spin_loop();
        }
    });
    (h, rx.recv().unwrap_or(0))
}

/// An eventfd and an epoll set that waits on it, closed on drop.
struct Waitable {
    efd: std::os::fd::OwnedFd,
    ep: std::os::fd::OwnedFd,
}

impl Waitable {
    fn new() -> Result<Waitable> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: eventfd takes no pointer; it returns a new fd or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(sys("eventfd"));
        }
        // SAFETY: `efd` is a new fd this process owns from here on.
        let efd = unsafe { std::os::fd::OwnedFd::from_raw_fd(efd) };
        // SAFETY: epoll_create1 takes no pointer; it returns a new fd or -1.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(sys("epoll_create1"));
        }
        // SAFETY: `ep` is a new fd this process owns from here on.
        let ep = unsafe { std::os::fd::OwnedFd::from_raw_fd(ep) };
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 0,
        };
        // SAFETY: valid epoll fd, valid target fd, valid event struct.
        if unsafe {
            libc::epoll_ctl(
                ep.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                efd.as_raw_fd(),
                &mut ev,
            )
        } != 0
        {
            return Err(sys("epoll_ctl"));
        }
        Ok(Waitable { efd, ep })
    }

    fn signal(&self) {
        use std::os::fd::AsRawFd;
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a valid buffer to an eventfd.
        unsafe { libc::write(self.efd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Blocks until signalled (or `timeout_ms`), then consumes the signal.
    fn wait(&self, timeout_ms: i32) {
        use std::os::fd::AsRawFd;
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }];
        // SAFETY: `ev` is a valid buffer of one event.
        unsafe { libc::epoll_wait(self.ep.as_raw_fd(), ev.as_mut_ptr(), 1, timeout_ms) };
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a valid buffer; non-blocking.
        unsafe { libc::read(self.efd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

/// µs of a SCHED_FIFO waiter's CPU per wake-up and sleep, the waiter on
/// CPU `waiter_cpu` and the waker on CPU 0; with `busy`, an ordinary thread
/// spins on the waiter's CPU meanwhile. The waiter's `epoll_wait` has a
/// timeout of `timeout_ms`: one short enough to be the CPU's next timer
/// is armed and cancelled at every wait.
fn wake_cost(ops: u32, waiter_cpu: usize, busy: bool, timeout_ms: i32) -> Result<f64> {
    let w = Arc::new(Waitable::new()?);
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let spin = busy.then(|| spinner(waiter_cpu, stop.clone()));
    pin(0)?;
    let waiter = {
        let (w, done, stop) = (w.clone(), done.clone(), stop.clone());
        std::thread::spawn(move || -> Result<u64> {
            pin(waiter_cpu)?;
            setattr(0, POLICY_FIFO, 0, 10)?;
            let t0 = thread_cpu_ns();
            while !stop.load(Ordering::Relaxed) {
                w.wait(timeout_ms);
                done.fetch_add(1, Ordering::Release);
            }
            Ok(thread_cpu_ns() - t0)
        })
    };
    // The waiter is in its first wait once it counted nothing yet and had
    // a moment to start; a signal sent before that is consumed by its
    // first wait, one operation more, not less.
    std::thread::sleep(std::time::Duration::from_millis(50));
    let start = done.load(Ordering::Acquire);
    for i in 0..u64::from(ops) {
        w.signal();
        while done.load(Ordering::Acquire) < start + i + 1 {
            std::hint::spin_loop();
        }
    }
    stop.store(true, Ordering::Relaxed);
    w.signal();
    let cpu = waiter.join().map_err(|_| HostCostsError::Sys {
        what: "waiter thread",
        source: std::io::Error::other("panicked"),
    })??;
    if let Some((h, _)) = spin {
        let _ = h.join();
    }
    // The waiter's count includes the wake-ups before `start` and the last
    // one; its CPU time covers them all.
    let n = done.load(Ordering::Acquire).max(1);
    Ok(cpu as f64 / n as f64 / 1e3)
}

/// µs of the sleeper's CPU per 50 µs nanosleep, on CPU 0.
fn sleep_cost(ops: u32) -> Result<f64> {
    pin(0)?;
    let t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 50_000,
    };
    let t0 = thread_cpu_ns();
    for _ in 0..ops {
        // SAFETY: `t` is a valid timespec; no remainder is asked for.
        unsafe { libc::nanosleep(&t, std::ptr::null_mut()) };
    }
    Ok((thread_cpu_ns() - t0) as f64 / f64::from(ops) / 1e3)
}

/// µs of the caller's CPU per sched_setattr that moves a thread spinning on
/// CPU 1 between SCHED_FIFO 1 and SCHED_OTHER nice 19 while a second
/// spinner competes there; the caller on CPU 0, or with `queued` on CPU 1
/// at SCHED_FIFO 10 (the spinners wait while it runs).
fn setattr_cost(ops: u32, queued: bool) -> Result<f64> {
    let stop = Arc::new(AtomicBool::new(false));
    let (a, tid) = spinner(1, stop.clone());
    let (b, _) = spinner(1, stop.clone());
    if tid == 0 {
        stop.store(true, Ordering::Relaxed);
        let _ = (a.join(), b.join());
        return Err(HostCostsError::Sys {
            what: "spinner thread",
            source: std::io::Error::other("did not start"),
        });
    }
    let mut res = if queued {
        pin(1).and_then(|()| setattr(0, POLICY_FIFO, 0, 10))
    } else {
        pin(0)
    };
    let t0 = thread_cpu_ns();
    for i in 0..ops {
        if res.is_err() {
            break;
        }
        res = if i % 2 == 0 {
            setattr(tid, POLICY_FIFO, 0, 1)
        } else {
            setattr(tid, POLICY_NORMAL, 19, 0)
        };
    }
    let cpu = thread_cpu_ns() - t0;
    if queued {
        // Let the spinners run again before stopping them.
        let _ = setattr(0, POLICY_NORMAL, 0, 0);
    }
    // Back to an ordinary thread before stopping it (it may be at FIFO).
    let _ = setattr(tid, POLICY_NORMAL, 0, 0);
    stop.store(true, Ordering::Relaxed);
    let _ = (a.join(), b.join());
    res?;
    Ok(cpu as f64 / f64::from(ops) / 1e3)
}

/// Runs every measurement `rounds` times, interleaved.
pub fn measure(a: &HostCostsArgs, command: String) -> Result<HostCosts> {
    let cpus = crate::machine::cpus();
    if cpus < 2 {
        return Err(HostCostsError::Cpus(cpus));
    }
    let machine = crate::machine::describe();
    let mut figs: [Vec<f64>; 6] = Default::default();
    // Each round in its own thread, so the pinning does not outlive it.
    for _ in 0..a.rounds {
        let ops = a.ops;
        let round = std::thread::spawn(move || -> Result<[f64; 6]> {
            Ok([
                wake_cost(ops, 0, false, 100)?,
                wake_cost(ops, 0, false, 1)?,
                wake_cost(ops, 1, true, 100)?,
                sleep_cost(ops)?,
                setattr_cost(ops, false)?,
                setattr_cost(ops, true)?,
            ])
        })
        .join()
        .map_err(|_| HostCostsError::Sys {
            what: "measuring thread",
            source: std::io::Error::other("panicked"),
        })??;
        for (v, x) in figs.iter_mut().zip(round) {
            v.push(x);
        }
    }
    let [wake_same, wake_timer, wake_other, sleep, set, set_queued] = figs;
    Ok(HostCosts {
        command,
        machine,
        ops: a.ops,
        rounds: a.rounds,
        wake_same_cpu_us: Spread::of(wake_same),
        wake_same_cpu_timer_us: Spread::of(wake_timer),
        wake_other_cpu_us: Spread::of(wake_other),
        timer_sleep_us: Spread::of(sleep),
        setattr_preempting_us: Spread::of(set),
        setattr_queued_us: Spread::of(set_queued),
    })
}

/// `pvsched-bench host-costs`: prints the figures, writes the JSON.
pub fn main(a: &HostCostsArgs, command: String) -> u8 {
    use pvsched_util::exit::Exit;
    let r = match measure(a, command) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pvsched-bench: {e}");
            return Exit::Bench as u8;
        }
    };
    // With the JSON on standard output, the table goes to standard error.
    let to_stdout = a.json.as_ref().is_none_or(|p| p.as_os_str() != "-");
    let mut table = format!(
        "host costs, µs of CPU per operation, median [min-max] of {} rounds of {}:\n",
        r.rounds, r.ops
    );
    for (name, s) in [
        ("wake-up on its own CPU", &r.wake_same_cpu_us),
        ("the same, a 1 ms timer armed", &r.wake_same_cpu_timer_us),
        ("wake-up from the other CPU", &r.wake_other_cpu_us),
        ("50 µs nanosleep", &r.timer_sleep_us),
        ("sched_setattr preempting", &r.setattr_preempting_us),
        ("sched_setattr of a queued one", &r.setattr_queued_us),
    ] {
        table += &format!("  {name:30} {}\n", s.cell(2));
    }
    if to_stdout {
        print!("{table}");
    } else {
        eprint!("{table}");
    }
    let Some(path) = &a.json else {
        return Exit::Ok as u8;
    };
    let j = match serde_json::to_string_pretty(&r) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("pvsched-bench: host-costs: {e}");
            return Exit::Bench as u8;
        }
    };
    if path.as_os_str() == "-" {
        println!("{j}");
    } else if let Err(source) = std::fs::write(path, j + "\n") {
        eprintln!(
            "pvsched-bench: {}",
            HostCostsError::Write {
                path: path.clone(),
                source
            }
        );
        return Exit::Bench as u8;
    }
    Exit::Ok as u8
}
