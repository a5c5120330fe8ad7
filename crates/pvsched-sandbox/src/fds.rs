//! File descriptors: close everything the device does not need, and list a
//! process's open fds (for tests and diagnostics).
//!
//! Closing uses `close_range(2)` (Linux 5.9) over the gaps between kept fds;
//! on `ENOSYS` it falls back to listing `/proc/self/fd`.

use std::fs;
use std::io;
use std::os::fd::RawFd;

use crate::error::{Error, Result};

/// How fds were closed, for the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseMethod {
    /// `close_range(2)` over the gaps.
    CloseRange,
    /// Listing `/proc/self/fd` and closing one by one.
    ProcSelfFd,
}

/// The fds in `keep` plus 0/1/2, sorted and deduplicated.
pub(crate) fn kept_set(keep: &[RawFd]) -> Vec<RawFd> {
    let mut v: Vec<RawFd> = keep.iter().copied().filter(|fd| *fd >= 0).collect();
    v.extend([0, 1, 2]);
    v.sort_unstable();
    v.dedup();
    v
}

/// Points fd 0 at `/dev/null` (the device never reads stdin; a terminal
/// there would be needless attack surface).
pub(crate) fn null_stdin() -> Result<()> {
    let null = fs::OpenOptions::new()
        .read(true)
        .open("/dev/null")
        .map_err(Error::Stdin)?;
    use std::os::fd::AsRawFd;
    // SAFETY: dup2 onto fd 0 with a valid open fd; fd 0 is owned by no Rust
    // object in this process, replacing it cannot invalidate an OwnedFd.
    let rc = unsafe { libc::dup2(null.as_raw_fd(), 0) };
    if rc < 0 {
        return Err(Error::Stdin(io::Error::last_os_error()));
    }
    Ok(())
}

/// Closes every fd not in `keep` (0/1/2 are always kept).
///
/// Fails if a kept fd is not open (a configuration error worth catching
/// before the sandbox makes it undebuggable).
pub(crate) fn close_other_fds(keep: &[RawFd]) -> Result<CloseMethod> {
    let kept = kept_set(keep);
    for &fd in &kept {
        // SAFETY: F_GETFD only queries the flags of `fd`; no memory is passed.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(Error::KeptFdNotOpen(fd));
        }
    }
    match close_with_close_range(&kept) {
        Ok(()) => Ok(CloseMethod::CloseRange),
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            close_with_proc(&kept)?;
            Ok(CloseMethod::ProcSelfFd)
        }
        Err(e) => Err(Error::CloseFds(e)),
    }
}

fn close_range(first: u32, last: u32) -> io::Result<()> {
    // SAFETY: close_range takes three integers and touches no user memory.
    // Closing fds owned by Rust objects is the point of the sandbox; the
    // caller documents that such objects must not be used afterwards.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn close_with_close_range(kept: &[RawFd]) -> io::Result<()> {
    // `kept` is sorted and holds at least 0, 1, 2.
    let mut next: u32 = 0;
    for &fd in kept {
        let fd = fd as u32;
        if fd > next {
            close_range(next, fd - 1)?;
        }
        next = fd.saturating_add(1);
    }
    close_range(next, u32::MAX)
}

fn close_with_proc(kept: &[RawFd]) -> Result<()> {
    // Collect first: the directory's own fd shows up in the listing.
    let fds = open_fds_of("/proc/self/fd")?;
    for fd in fds {
        if kept.binary_search(&fd).is_err() {
            // SAFETY: closing an fd number; errors (EBADF for the already
            // closed directory fd) are ignored.
            unsafe { libc::close(fd) };
        }
    }
    Ok(())
}

fn open_fds_of(dir: &str) -> Result<Vec<RawFd>> {
    let proc_err = |source| Error::Proc {
        path: dir.to_string(),
        source,
    };
    let mut fds: Vec<RawFd> = fs::read_dir(dir)
        .map_err(proc_err)?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .collect();
    fds.sort_unstable();
    Ok(fds)
}

/// The open fds of process `pid`, sorted, read from `/proc/<pid>/fd`.
///
/// For `pid` = own pid the list includes the fd used to read the directory.
pub fn open_fds(pid: u32) -> Result<Vec<RawFd>> {
    open_fds_of(&format!("/proc/{pid}/fd"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_set_adds_stdio_sorts_and_dedups() {
        assert_eq!(kept_set(&[9, 4, 4, 1, -3]), vec![0, 1, 2, 4, 9]);
    }

    #[test]
    fn open_fds_of_self_contains_stdio() {
        let fds = open_fds(std::process::id()).expect("list own fds");
        assert!(fds.contains(&0) && fds.contains(&1) && fds.contains(&2));
    }
}
