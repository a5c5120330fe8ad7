//! Watching a process with a pidfd: [`PidfdWatcher`] runs a closure when the
//! watched process exits (`pidfd_open` + `poll`, blocking, no spinning). A
//! VMM uses it on the agent's pid to restore its own vCPU threads with
//! [`crate::sched::restore_baselines`] if the agent dies.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::thread::JoinHandle;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// pidfd_open failed.
    #[error("pidfd_open({pid}) failed: {source} (process gone, or kernel < 5.3)")]
    Open {
        /// Pid.
        pid: u32,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// The watcher thread could not start.
    #[error("spawning the pidfd watcher thread failed: {0}")]
    Spawn(#[source] io::Error),
}

/// Opens a pidfd for `pid`.
pub fn pidfd_open(pid: u32) -> Result<OwnedFd, WatchError> {
    pvsched_util::pidfd_open(pid).map_err(|source| WatchError::Open { pid, source })
}

/// Blocks until the process behind `pidfd` exits.
pub fn wait_exit(pidfd: &OwnedFd) -> io::Result<()> {
    loop {
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, infinite timeout.
        let r = unsafe { libc::poll(&mut p, 1, -1) };
        if r > 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Runs a closure once the watched process exits.
pub struct PidfdWatcher {
    thread: Option<JoinHandle<()>>,
}

impl PidfdWatcher {
    /// Opens a pidfd on `pid` now (so a later pid reuse cannot fool it) and
    /// calls `on_exit` from a watcher thread when that process exits.
    pub fn spawn<F: FnOnce() + Send + 'static>(pid: u32, on_exit: F) -> Result<Self, WatchError> {
        let fd = pidfd_open(pid)?;
        let thread = std::thread::Builder::new()
            .name("pvsched-pidfd".into())
            .spawn(move || {
                if let Err(e) = wait_exit(&fd) {
                    log::error!("pidfd watcher: poll failed: {e}; restoring anyway");
                }
                on_exit();
            })
            .map_err(WatchError::Spawn)?;
        Ok(PidfdWatcher {
            thread: Some(thread),
        })
    }

    /// Waits for the closure to have run.
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn fires_when_child_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.05")
            .spawn()
            .unwrap();
        let (tx, rx) = mpsc::channel();
        let w = PidfdWatcher::spawn(child.id(), move || tx.send(()).unwrap()).unwrap();
        child.wait().unwrap();
        rx.recv().unwrap();
        w.join();
    }
}
