//! pvschedd's command line, in the library so that `pvsched man` can
//! render its manual page from the same definitions the daemon parses.

use crate::config::DEFAULT_CONFIG;
use clap::Parser;
use pvsched_util::exit::Exit;
use std::path::PathBuf;

/// The codes of the workspace's table (`pvsched_util::exit`) pvschedd
/// returns: 0 after SIGINT/SIGTERM with every VM unregistered.
pub const EXIT_CODES: [Exit; 5] = [
    Exit::Ok,
    Exit::Failure,
    Exit::Usage,
    Exit::PolicyLoad,
    Exit::PolicyFile,
];

/// pvschedd: loads the pvsched BPF policy once and serves VMMs on a UNIX
/// socket.
#[derive(Parser)]
#[command(
    name = "pvschedd",
    version,
    about = "The pvsched host daemon: loads the BPF policy once and serves every VMM on a UNIX socket",
    after_help = pvsched_util::exit::help(&EXIT_CODES))]
pub struct Args {
    /// Configuration file.
    #[arg(long, default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
    /// Socket path (overrides `socket` in the file).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Metrics `host:port` (overrides `metrics_listen`; "" turns it off).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Socket group (overrides `socket_group`; "" = root only).
    #[arg(long)]
    pub socket_group: Option<String>,
    /// Check the configuration and exit: the file, every VM file of
    /// `vm_dir` and every flavor file of `--flavor-dir`, against `[max]`.
    #[arg(long)]
    pub check: bool,
    /// With --check: once the check passed, send SIGHUP to the pvschedd
    /// of this pid so that it reads the configuration again (the unit's
    /// ExecReload, `systemctl reload pvschedd`, which then fails with the
    /// check's message instead of leaving the old configuration silently).
    #[arg(long, value_name = "PID", requires = "check")]
    pub reload: Option<u32>,
    /// The flavor caps files `pvsched qemu-attach` sends for Nova
    /// domains, checked by `--check` and at every reload (SIGHUP).
    #[arg(long, value_name = "DIR", default_value = "/etc/pvsched/flavors")]
    pub flavor_dir: PathBuf,
    /// Put back every thread the ledger in the runtime directory still
    /// lists as boosted, then exit (after a stop, however pvschedd and its
    /// guardian ended: the unit's ExecStopPost). Waits for a guardian
    /// still restoring; fails if a running pvschedd holds the ledger.
    #[arg(long, conflicts_with = "check")]
    pub restore: bool,
}
