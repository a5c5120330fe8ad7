//! Process sandbox for the pvsched device process.
//!
//! The device process (`pvsched device`, and the reference VMM's device
//! child) calls [`enter`] once, after setup (connection accepted, event loop
//! fds made) and before the first guest access. [`enter`] applies, in order:
//!
//! 0. **Compile the seccomp profile** (allocates; done first so a bad profile
//!    fails before anything irreversible happens).
//! 1. **Close every fd not in [`SandboxConfig::keep_fds`]** (fds 1 and 2 are
//!    kept as the log channel; fd 0 is pointed at `/dev/null`). Uses
//!    `close_range(2)` over the gaps, `/proc/self/fd` if the kernel lacks it.
//!    Done first so nothing inherited survives into the later steps.
//! 2. **`PR_SET_NO_NEW_PRIVS`**: no later exec can gain privileges, and it is
//!    required for installing seccomp without `CAP_SYS_ADMIN`.
//! 3. **Isolation**: unshare mount, network and IPC namespaces (root), or a
//!    user namespace first (unprivileged); if the host refuses, Landlock
//!    with no allowed path. Needs privileges, so it comes before dropping
//!    them. Which one happened is in [`SandboxReport::isolation`].
//! 4. **rlimits**: `RLIMIT_NOFILE` just above the kept fds plus a margin for
//!    fds received later, `RLIMIT_NPROC` 0, `RLIMIT_CORE` 0 (no guest memory
//!    in core files), `RLIMIT_FSIZE` 0 (skipped while stdout/stderr is a
//!    regular log file, which it would break), `RLIMIT_DATA` 256 MiB (heap
//!    and private mappings; shared guest RAM does not count). Lowering needs no privilege, but it
//!    comes before the capability drop so `CAP_SYS_RESOURCE` cannot undo it.
//! 5. **Drop all capabilities**: bounding set (needs `CAP_SETPCAP`, so first),
//!    ambient, inheritable, effective, permitted.
//! 6. **Install the seccomp allowlist** (default action: kill the process,
//!    so a forbidden syscall is observable as SIGSYS). Last, because the
//!    earlier steps use syscalls the allowlist forbids.
//!
//! The allowlists are reviewed data: `seccomp/device-common.json` plus each
//! transport's rules in `seccomp/device-additions.json`, with a reason
//! beside every syscall. They assume a **single-threaded** device: `clone`
//! is not allowed, so no thread may be started after [`enter`].
//!
//! ```no_run
//! use pvsched_sandbox::{enter, SandboxConfig, SeccompProfile};
//! # let conn_fd = 3;
//! let cfg = SandboxConfig::new(vec![conn_fd], SeccompProfile::DeviceVfioUser);
//! let report = enter(&cfg).expect("sandbox");
//! eprintln!("sandboxed: {report:?}");
//! ```

mod error;
mod fds;
mod isolation;
mod privs;
mod proc_status;
mod rlimits;
mod seccomp;

use std::os::fd::RawFd;

pub use error::{Error, Result};
pub use fds::{CloseMethod, open_fds};
pub use isolation::Isolation;
pub use proc_status::{ProcStatus, parse_proc_status, read_proc_status};
pub use rlimits::{DEFAULT_DATA_LIMIT, Rlimits};
pub use seccomp::{SeccompProfile, attempt_forbidden_open, fd_fs_type, fd_seals, fd_size};

/// What [`enter`] should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxConfig {
    /// Fds to keep open besides 0/1/2 (connection socket, region fds,
    /// eventfds, epoll fd). Every other fd is closed: Rust objects owning a
    /// closed fd must not be used or dropped afterwards (`mem::forget` them
    /// or list them here).
    pub keep_fds: Vec<RawFd>,
    /// The seccomp allowlist to install last.
    pub seccomp: SeccompProfile,
    /// Try new namespaces first (`true`); `false` goes straight to Landlock.
    pub namespaces: bool,
    /// Resource limits.
    pub rlimits: Rlimits,
    /// A listening socket on which `accept4` stays allowed after the
    /// sandbox (only on this fd: the rule matches argument 0). For a
    /// vfio-user server that must let its library accept the one client
    /// whose connection is already pending; unlink the socket's path before
    /// [`enter`] so no other client can reach it. `None`: no `accept*`.
    pub accept_fd: Option<RawFd>,
}

impl SandboxConfig {
    /// A config with namespaces on and default rlimits.
    pub fn new(keep_fds: Vec<RawFd>, seccomp: SeccompProfile) -> Self {
        SandboxConfig {
            keep_fds,
            seccomp,
            namespaces: true,
            rlimits: Rlimits::default(),
            accept_fd: None,
        }
    }
}

/// What [`enter`] did. Log it: once seccomp is on, the process can no
/// longer inspect itself through `/proc`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxReport {
    /// The fds left open (0/1/2 plus `keep_fds`), sorted.
    pub kept_fds: Vec<RawFd>,
    /// How the others were closed.
    pub close_method: CloseMethod,
    /// Namespaces, Landlock, or neither.
    pub isolation: Isolation,
    /// The `RLIMIT_NOFILE` value set.
    pub nofile_limit: u64,
    /// The `RLIMIT_FSIZE` value set; `None` if not applied (configured off,
    /// or stdout/stderr is a regular file).
    pub fsize_limit: Option<u64>,
    /// The `RLIMIT_DATA` value set; `None` if configured off.
    pub data_limit: Option<u64>,
    /// The seccomp profile installed.
    pub seccomp_profile: String,
}

/// Enters the sandbox; see the crate docs for the steps and their order.
///
/// Call from a single-threaded process. On error the process is partly
/// sandboxed and should exit rather than serve.
pub fn enter(cfg: &SandboxConfig) -> Result<SandboxReport> {
    let prog = cfg.seccomp.compile_with_accept(cfg.accept_fd)?;
    let kept_fds = fds::kept_set(&cfg.keep_fds);
    let close_method = fds::close_other_fds(&cfg.keep_fds)?;
    fds::null_stdin()?;
    privs::set_no_new_privs()?;
    let isolation = isolation::isolate(cfg.namespaces);
    let limits = rlimits::apply(&cfg.rlimits, &kept_fds)?;
    privs::drop_all_capabilities()?;
    seccomp::install(&cfg.seccomp, &prog)?;
    Ok(SandboxReport {
        kept_fds,
        close_method,
        isolation,
        nofile_limit: limits.nofile,
        fsize_limit: limits.fsize,
        data_limit: limits.data,
        seccomp_profile: cfg.seccomp.name().to_string(),
    })
}
