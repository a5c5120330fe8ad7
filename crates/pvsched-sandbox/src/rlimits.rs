//! Resource limits for the sandboxed process.

use std::io;
use std::os::fd::RawFd;

use crate::error::{Error, Result};

/// Resource limits applied by [`crate::enter`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rlimits {
    /// `RLIMIT_NOFILE` = highest kept fd + 1 + this margin. The margin must
    /// cover fds received later over the socket (guest RAM regions arrive as
    /// fds with SYNC_SYSMEM / DMA_MAP, up to 8 per message).
    pub nofile_margin: u64,
    /// `RLIMIT_NPROC` (0: no fork; threads are also forbidden by seccomp).
    pub nproc: u64,
    /// `RLIMIT_CORE` (0: no core dump with guest memory in it).
    pub core: u64,
    /// `RLIMIT_FSIZE` (0: no file growth). Not applied while stdout or
    /// stderr is a regular file (a log file), since every log write would
    /// then raise SIGXFSZ; [`crate::SandboxReport::fsize_limit`] says
    /// whether it was applied. `None` never applies it.
    pub fsize: Option<u64>,
    /// `RLIMIT_DATA`: the heap and every private writable mapping (thread
    /// stacks, allocator arenas). Shared mappings of received fds (guest
    /// RAM, the BAR2 memfd) do not count, so this caps what a client can
    /// make the process allocate without limiting guest RAM size (which
    /// `RLIMIT_AS` would). `None` leaves it unchanged.
    pub data: Option<u64>,
}

/// Default [`Rlimits::data`]: 256 MiB. The device process needs a few MiB
/// (one message of a few KiB plus its own state); the cap turns a leak
/// or an unbounded allocation into a failed allocation far below the host's
/// memory.
pub const DEFAULT_DATA_LIMIT: u64 = 256 << 20;

impl Default for Rlimits {
    fn default() -> Self {
        Rlimits {
            nofile_margin: 64,
            nproc: 0,
            core: 0,
            fsize: Some(0),
            data: Some(DEFAULT_DATA_LIMIT),
        }
    }
}

fn set(resource: libc::__rlimit_resource_t, name: &'static str, value: u64) -> Result<()> {
    let lim = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: `lim` is a valid rlimit that outlives the call.
    if unsafe { libc::setrlimit(resource, &lim) } < 0 {
        return Err(Error::Rlimit {
            resource: name,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Whether `fd` is a regular file (e.g. stderr redirected to a log file).
fn is_regular_file(fd: RawFd) -> bool {
    // SAFETY: all-zero bytes are a valid `stat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable stat buffer for the call.
    let rc = unsafe { libc::fstat(fd, &mut st) };
    rc == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFREG
}

/// The limits actually set.
pub(crate) struct Applied {
    pub nofile: u64,
    pub fsize: Option<u64>,
    pub data: Option<u64>,
}

/// Applies `lim`.
pub(crate) fn apply(lim: &Rlimits, kept: &[RawFd]) -> Result<Applied> {
    let highest = kept.iter().copied().max().unwrap_or(2).max(2) as u64;
    let nofile = highest.saturating_add(1).saturating_add(lim.nofile_margin);
    set(libc::RLIMIT_NOFILE, "RLIMIT_NOFILE", nofile)?;
    set(libc::RLIMIT_NPROC, "RLIMIT_NPROC", lim.nproc)?;
    set(libc::RLIMIT_CORE, "RLIMIT_CORE", lim.core)?;
    let fsize = match lim.fsize {
        Some(_) if is_regular_file(1) || is_regular_file(2) => {
            log::warn!("sandbox: stdout/stderr is a regular file; RLIMIT_FSIZE left unchanged");
            None
        }
        Some(fsize) => {
            set(libc::RLIMIT_FSIZE, "RLIMIT_FSIZE", fsize)?;
            Some(fsize)
        }
        None => None,
    };
    if let Some(data) = lim.data {
        set(libc::RLIMIT_DATA, "RLIMIT_DATA", data)?;
    }
    Ok(Applied {
        nofile,
        fsize,
        data: lim.data,
    })
}
