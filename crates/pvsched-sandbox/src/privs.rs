//! Privileges: `PR_SET_NO_NEW_PRIVS` and dropping every capability
//! (bounding, ambient, inheritable, permitted, effective).

use std::fs;
use std::io;

use caps::CapSet;

use crate::error::{Error, Result};

/// Sets `PR_SET_NO_NEW_PRIVS`: no later `execve` can gain privileges, and
/// unprivileged seccomp filters become installable.
pub(crate) fn set_no_new_privs() -> Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc < 0 {
        return Err(Error::NoNewPrivs(io::Error::last_os_error()));
    }
    Ok(())
}

/// Highest capability number the running kernel knows, from
/// `/proc/sys/kernel/cap_last_cap` (falls back to 63 so none is missed).
fn cap_last_cap() -> u32 {
    fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
}

fn caps_err(what: &'static str) -> impl Fn(caps::errors::CapsError) -> Error {
    move |e| Error::Capabilities {
        what,
        source: io::Error::other(e.to_string()),
    }
}

/// Drops all capabilities. The bounding set goes first because dropping
/// from it needs `CAP_SETPCAP` in the effective set.
pub(crate) fn drop_all_capabilities() -> Result<()> {
    for cap in 0..=cap_last_cap() {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            // EINVAL: the kernel does not know this cap (cap_last_cap raced
            // or unreadable); nothing to drop.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(Error::Capabilities {
                    what: "PR_CAPBSET_DROP",
                    source: e,
                });
            }
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(caps_err("ambient set"))?;
    caps::clear(None, CapSet::Inheritable).map_err(caps_err("inheritable set"))?;
    caps::clear(None, CapSet::Effective).map_err(caps_err("effective set"))?;
    caps::clear(None, CapSet::Permitted).map_err(caps_err("permitted set"))?;
    Ok(())
}
