//! Small helpers written once for the whole workspace.
//!
//! - [`lock`], [`read`], [`write`]: take a lock even if a thread panicked
//!   while holding it. pvsched's shared state stays consistent across a
//!   panic (every update is a plain store), and the paths that take these
//!   locks are the ones that must still run then: restoring boosted
//!   threads, reporting statistics, shutting down.
//! - [`percentile`]: the nearest-rank percentile every report uses.
//! - [`pidfd_open`]: a pidfd, to watch a process without pid reuse races;
//! - [`mono_ns`]: CLOCK_MONOTONIC, the clock of BPF's `bpf_ktime_get_ns`
//!   and of a tracefs trace with `trace_clock` mono;
//! - [`exit`]: the exit-code table every pvsched binary shares;
//! - [`logging`]: the one logging setup of every pvsched program;
//! - [`pi::PiMutex`]: a mutex whose waiters lend their priority to its
//!   holder, for state a SCHED_FIFO thread shares with ordinary ones.

pub mod exit;
#[cfg(feature = "logging")]
pub mod logging;
pub mod pi;

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `m`, ignoring poisoning (see the crate docs).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Read-locks `l`, ignoring poisoning.
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Write-locks `l`, ignoring poisoning.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// CLOCK_MONOTONIC now, ns (the clock of `Instant`, BPF's
/// `bpf_ktime_get_ns` and a tracefs trace with `trace_clock` mono).
pub fn mono_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CPU time the calling thread has used, ns.
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// `clock_gettime(clock)`, ns; only for clocks every Linux has.
fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to the valid pointer we
    // pass; the callers name CLOCK_MONOTONIC or CLOCK_THREAD_CPUTIME_ID,
    // which always exist.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// The CPU time (user + system) a CPU-time clock has counted so far, ns:
/// a process's ([`process_cpu_clock`]: all its threads, the exited ones
/// too) or a thread's ([`thread_cpu_clock`]). `None` once that process or
/// thread is gone.
pub fn cpu_clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the valid timespec we pass; an invalid
    // or stale clock id is an error return, not undefined behaviour.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(
        (ts.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec as u64),
    )
}

/// Process `pid`'s CPU-time clock (any process this one may signal).
pub fn process_cpu_clock(pid: u32) -> Option<libc::clockid_t> {
    let mut clock: libc::clockid_t = 0;
    let pid = libc::pid_t::try_from(pid).ok()?;
    // SAFETY: clock_getcpuclockid writes the clockid_t we pass; no other
    // memory is touched.
    (unsafe { libc::clock_getcpuclockid(pid, &mut clock) } == 0).then_some(clock)
}

/// Thread `t`'s CPU-time clock (a thread of this process).
pub fn thread_cpu_clock(t: libc::pthread_t) -> Option<libc::clockid_t> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: pthread_getcpuclockid writes the clockid_t we pass; the
    // caller's `t` is a thread it holds a join handle to, so still valid.
    (unsafe { libc::pthread_getcpuclockid(t, &mut clock) } == 0).then_some(clock)
}

/// Nearest-rank percentile `p` (0..=100) of `sorted` (ascending); `None` if
/// empty.
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    // The epsilon keeps e.g. 0.999 × 1000 (= 999.000…1 in floating
    // point) at rank 999.
    let rank = ((p / 100.0) * sorted.len() as f64 - 1e-9).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Opens a pidfd for `pid` (`pidfd_open(2)`, Linux 5.3+).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    pidfd_open_flags(pid, 0)
}

/// `PIDFD_THREAD` (Linux 6.9+): the pidfd names one thread, not a process.
pub const PIDFD_THREAD: u32 = libc::O_EXCL as u32;

/// Opens a pidfd for thread `tid` (`PIDFD_THREAD`, Linux 6.9+; `EINVAL` on
/// older kernels for any thread but a process's leader). It polls readable
/// once that thread is gone, whether it exited or its TID was freed by an
/// `execve` of another thread, so it names the thread and never a later
/// thread that is given the same number.
pub fn pidfd_open_thread(tid: u32) -> io::Result<OwnedFd> {
    pidfd_open_flags(tid, PIDFD_THREAD)
}

fn pidfd_open_flags(pid: u32, flags: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A connected pair of `AF_UNIX` `SOCK_SEQPACKET` sockets, both ends
/// close-on-exec: one message per send, so a reader's bounded read never
/// splits one (the device process's event channel to its VMM).
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two fds into the array on success.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created by the kernel; nothing else owns
    // them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Receives one message from `fd` without blocking (EINTR retried):
/// `None` if none is waiting, else the message's full length, which is
/// larger than `buf` for a message that did not fit (`MSG_TRUNC`: its
/// tail is dropped, so a reader can refuse it). A closed peer reads as
/// `Some(0)`.
pub fn recv_ready(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: recv writes at most `buf.len()` bytes into `buf`, which
        // stays borrowed for the call, on an fd the borrow keeps open.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT | libc::MSG_TRUNC,
            )
        };
        if let Ok(n) = usize::try_from(n) {
            return Ok(Some(n));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::WouldBlock => return Ok(None),
            io::ErrorKind::Interrupted => continue,
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&v, 50.0), Some(500));
        assert_eq!(percentile(&v, 99.0), Some(990));
        assert_eq!(percentile(&v, 99.9), Some(999));
        assert_eq!(percentile(&v, 100.0), Some(1000));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn cpu_clocks_count_a_spinning_thread_and_its_process() {
        use std::os::unix::thread::JoinHandleExt;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        let thread = thread_cpu_clock(t.as_pthread_t()).unwrap();
        let process = process_cpu_clock(std::process::id()).unwrap();
        let (t0, p0) = (
            cpu_clock_ns(thread).unwrap(),
            cpu_clock_ns(process).unwrap(),
        );
        // Spin until the thread itself has had 20 ms of CPU: what the
        // clock counts is caused here, whatever else the machine runs.
        while cpu_clock_ns(thread).unwrap() - t0 < 20_000_000 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        t.join().unwrap();
        // The process's clock includes the exited thread's time.
        assert!(cpu_clock_ns(process).unwrap() - p0 >= 20_000_000);
        assert_eq!(process_cpu_clock(u32::MAX), None);
    }

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 1);
    }

    #[test]
    fn pidfd_of_self_and_of_nothing() {
        assert!(pidfd_open(std::process::id()).is_ok());
        assert!(pidfd_open(u32::MAX).is_err());
    }
}
