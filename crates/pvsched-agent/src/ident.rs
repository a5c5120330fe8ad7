//! Which thread a registered TID names. A TID is only a number: when its
//! thread exits, or when it calls `execve` from a thread other than the
//! leader (the kernel then frees its TID with no `sched_process_exit`), the
//! number may be given to any new thread of any process. The applier
//! therefore checks, before every `sched_setattr`, that the TID still names
//! the thread that was registered, and forgets it for good when it does not.
//!
//! The check holds a thread pidfd (`PIDFD_THREAD`, Linux 6.9+), which names
//! the thread itself and polls readable once it is gone; a `poll` with no
//! timeout asks. On older kernels it compares the thread's start time
//! (field 22 of `/proc/TID/stat`, clock ticks since boot) with the one read
//! at registration, which a new thread shares only if it got the same TID
//! within the same tick.
//!
//! What remains: a thread that goes away between the check and the
//! `sched_setattr` right after it, and whose TID is given to a new thread
//! in that instant (a TID is reused only after the kernel has handed out
//! every other free one, or when root sets `ns_last_pid`).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum IdentError {
    /// The thread is gone already (or never existed).
    #[error("thread {tid} does not exist")]
    Gone {
        /// The thread id.
        tid: u32,
    },
    /// The thread is not a thread of the process that registers it.
    #[error("thread {tid} is not a thread of process {pid}")]
    NotOwned {
        /// The thread id.
        tid: u32,
        /// The process it was claimed for.
        pid: u32,
    },
}

/// How a registered thread is recognised.
#[derive(Debug)]
enum Kind {
    /// A thread pidfd (Linux 6.9+).
    Pidfd(OwnedFd),
    /// The thread's start time (older kernels).
    StartTime(u64),
}

/// The identity of one registered thread: [`ThreadIdent::is_alive`] says
/// whether its TID still names it.
#[derive(Debug)]
pub struct ThreadIdent {
    tid: u32,
    kind: Kind,
    /// The owner process and a pidfd on it, if one was named.
    owner: Option<(u32, OwnedFd)>,
}

impl ThreadIdent {
    /// Takes hold of thread `tid` now; if `owner` is given, the thread must
    /// be one of that process's threads, checked after the hold is taken
    /// (so the thread held is the thread checked: a TID names one live
    /// thread at a time, and the held one is still alive after the check).
    pub fn open(tid: u32, owner: Option<u32>) -> Result<ThreadIdent, IdentError> {
        let kind = match pvsched_util::pidfd_open_thread(tid) {
            Ok(fd) => Kind::Pidfd(fd),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                return Err(IdentError::Gone { tid });
            }
            // EINVAL: a kernel without PIDFD_THREAD.
            Err(_) => {
                Kind::StartTime(crate::guardian::start_time(tid).ok_or(IdentError::Gone { tid })?)
            }
        };
        let owner = match owner {
            Some(pid) => {
                let fd =
                    pvsched_util::pidfd_open(pid).map_err(|_| IdentError::NotOwned { tid, pid })?;
                if !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
                    return Err(IdentError::NotOwned { tid, pid });
                }
                Some((pid, fd))
            }
            None => None,
        };
        let ident = ThreadIdent { tid, kind, owner };
        if !ident.is_alive() {
            return Err(IdentError::Gone { tid });
        }
        Ok(ident)
    }

    /// The thread id.
    pub fn tid(&self) -> u32 {
        self.tid
    }

    /// True while the TID still names the registered thread.
    pub fn is_alive(&self) -> bool {
        match &self.kind {
            Kind::Pidfd(fd) => !polls_readable(fd),
            Kind::StartTime(t) => crate::guardian::start_time(self.tid) == Some(*t),
        }
    }

    /// Where the registered thread went if it called `execve` (it is then
    /// its process's leader, TID = the owner's pid): the owner's pid while
    /// the owner process is still alive, else None.
    pub fn exec_successor(&self) -> Option<u32> {
        let (pid, fd) = self.owner.as_ref()?;
        (*pid != self.tid && !polls_readable(fd)).then_some(*pid)
    }
}

/// True if a pidfd polls readable: its thread or process is gone.
fn polls_readable(fd: &OwnedFd) -> bool {
    loop {
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on an fd we own, no timeout.
        match unsafe { libc::poll(&mut p, 1, 0) } {
            0 => return false,
            r if r > 0 => return true,
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            // Cannot tell (ENOMEM): never act on a thread we are
            // not sure of.
            _ => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_thread_is_alive_until_it_exits() {
        let (tx, rx) = mpsc::channel();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(crate::sched::gettid()).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        let ident = ThreadIdent::open(tid, Some(std::process::id())).unwrap();
        assert!(ident.is_alive());
        stop_tx.send(()).unwrap();
        t.join().unwrap();
        // join() returns once the kernel cleared the thread's TID word,
        // which it does in do_exit() before the thread is reaped: give the
        // exit a moment to complete (bounded) rather than race it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ident.is_alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(!ident.is_alive(), "thread {tid} exited");
        assert!(matches!(
            ThreadIdent::open(tid, None),
            Err(IdentError::Gone { .. })
        ));
    }

    #[test]
    fn another_process_s_thread_is_refused() {
        // PID 1's main thread is not one of this process's threads.
        assert!(matches!(
            ThreadIdent::open(1, Some(std::process::id())),
            Err(IdentError::NotOwned { tid: 1, .. })
        ));
    }
}
