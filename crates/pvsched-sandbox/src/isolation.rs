//! Isolation from the host's filesystem, network and IPC: new namespaces
//! where the host allows, else a Landlock ruleset that allows no path.
//!
//! As root (`CAP_SYS_ADMIN`) the process unshares mount, network and IPC
//! namespaces directly. Unprivileged, it first unshares a user namespace
//! (which grants the capabilities for the rest inside it). If neither works
//! (e.g. user namespaces disabled by sysctl), it falls back to Landlock with
//! every filesystem access handled and no rule, i.e. no path can be opened.
//! `unshare(CLONE_NEWUSER)` needs a single-threaded process: call
//! [`crate::enter`] before starting threads.

use std::io;

use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetStatus};

/// Which isolation was applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// New mount, network and IPC namespaces; `user` says whether a user
    /// namespace was created first (unprivileged path).
    Namespaces {
        /// A new user namespace was created first.
        user: bool,
    },
    /// Landlock with no allowed path; `fully_enforced` is false if the
    /// kernel supports only part of the requested access rights.
    Landlock {
        /// All requested access rights are enforced.
        fully_enforced: bool,
        /// Why namespaces were not used (empty if not requested).
        namespace_error: String,
    },
    /// Neither was possible; seccomp alone blocks file access.
    None {
        /// Why namespaces failed (empty if not requested).
        namespace_error: String,
        /// Why Landlock failed or is unsupported.
        landlock_error: String,
    },
}

fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare takes an integer flag set and touches no user memory.
    if unsafe { libc::unshare(flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn try_namespaces() -> Result<Isolation, String> {
    let rest = libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC;
    match unshare(rest) {
        Ok(()) => return Ok(Isolation::Namespaces { user: false }),
        Err(e) if e.raw_os_error() != Some(libc::EPERM) => {
            return Err(format!("unshare(NEWNS|NEWNET|NEWIPC): {e}"));
        }
        Err(_) => {}
    }
    unshare(libc::CLONE_NEWUSER | rest)
        .map_err(|e| format!("unshare(NEWUSER|NEWNS|NEWNET|NEWIPC): {e}"))?;
    Ok(Isolation::Namespaces { user: true })
}

fn try_landlock() -> Result<bool, String> {
    let abi = ABI::V5;
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.create())
        .and_then(|r| r.restrict_self())
        .map_err(|e| e.to_string())?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(true),
        RulesetStatus::PartiallyEnforced => Ok(false),
        RulesetStatus::NotEnforced => Err("the kernel does not support Landlock".into()),
    }
}

/// Applies isolation: namespaces if `namespaces`, else (or on failure)
/// Landlock. Never fails: the outcome is reported, seccomp still applies.
pub(crate) fn isolate(namespaces: bool) -> Isolation {
    let namespace_error = if namespaces {
        match try_namespaces() {
            Ok(iso) => return iso,
            Err(e) => {
                log::warn!("sandbox: namespaces unavailable ({e}); falling back to Landlock");
                e
            }
        }
    } else {
        String::new()
    };
    match try_landlock() {
        Ok(fully_enforced) => Isolation::Landlock {
            fully_enforced,
            namespace_error,
        },
        Err(landlock_error) => {
            log::warn!(
                "sandbox: Landlock unavailable ({landlock_error}); relying on seccomp alone"
            );
            Isolation::None {
                namespace_error,
                landlock_error,
            }
        }
    }
}
