//! Entering the process sandbox ([`pvsched_sandbox`]) in the device
//! process: which fds each transport keeps, which seccomp profile it
//! installs, and the one log line that says what happened (once seccomp is
//! on, the process can no longer inspect itself).
//!
//! Where each transport enters (after setup, before the first guest data):
//! - mpqemu: the socket is inherited, so right before serving;
//! - vfio-user: once the client's connection is pending on the listener and
//!   the socket path is unlinked, before the `vfio_user` crate accepts it
//!   (`accept4` stays allowed on the listener fd only).
//!
//! See `docs/sandbox.md` for the operator's view.

use pvsched_sandbox::{SandboxConfig, SandboxReport, SeccompProfile};
use std::os::fd::RawFd;
use thiserror::Error;

/// Largest dump file the sandboxed process may write (`RLIMIT_FSIZE` when
/// `--dump-slots` is on); a dump of `MAX_VCPUS` slots is far below it.
pub const DUMP_FSIZE_LIMIT: u64 = 64 << 20;

/// Entering the sandbox failed: the device must not serve.
#[derive(Debug, Error)]
#[error(
    "entering the device sandbox failed: {0}; refusing to serve unsandboxed (pass --no-sandbox only to debug)"
)]
pub struct SandboxError(#[source] pub pvsched_sandbox::Error);

/// What to keep and install.
#[derive(Debug, Clone)]
pub struct DeviceSandbox {
    /// Fds to keep besides 0/1/2.
    pub keep_fds: Vec<RawFd>,
    /// Allowlist.
    pub profile: SeccompProfile,
    /// Listener on which `accept4` stays allowed (vfio-user).
    pub accept_fd: Option<RawFd>,
    /// `RLIMIT_NOFILE` room above the highest kept fd, for fds created or
    /// received later (connection, guest RAM, eventfds).
    pub nofile_margin: u64,
    /// Whether a dump file is written (raises `RLIMIT_FSIZE` from 0 to
    /// [`DUMP_FSIZE_LIMIT`]).
    pub writes_dump: bool,
}

impl DeviceSandbox {
    /// Enter the sandbox and log the report.
    ///
    /// Also replaces the panic hook with one that prints the message
    /// without a backtrace: symbolising a backtrace (`RUST_BACKTRACE=1`)
    /// opens the executable, which the sandbox forbids, and would turn a
    /// contained panic (hostile vfio-user input) into a SIGSYS.
    pub fn enter(&self) -> Result<SandboxReport, SandboxError> {
        std::panic::set_hook(Box::new(|info| {
            log::error!("panic (no backtrace inside the sandbox): {info}");
        }));
        let mut cfg = SandboxConfig::new(self.keep_fds.clone(), self.profile.clone());
        cfg.accept_fd = self.accept_fd;
        cfg.rlimits.nofile_margin = self.nofile_margin;
        if self.writes_dump {
            cfg.rlimits.fsize = Some(DUMP_FSIZE_LIMIT);
        }
        let t = std::time::Instant::now();
        let report = pvsched_sandbox::enter(&cfg).map_err(SandboxError)?;
        log::info!(
            "sandbox: entered in {} us (profile {}, isolation {:?}, fds kept {:?}, RLIMIT_NOFILE {})",
            t.elapsed().as_micros(),
            report.seccomp_profile,
            report.isolation,
            report.kept_fds,
            report.nofile_limit
        );
        Ok(report)
    }
}
