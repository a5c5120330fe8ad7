//! The sandbox's error type: one variant per step of [`crate::enter`], each
//! saying what failed and what the embedder can do about it.

use std::io;

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong while entering the sandbox or reading process state.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Dropping capabilities failed.
    #[error(
        "dropping capabilities ({what}) failed: {source}; the process keeps privileges, do not start serving"
    )]
    Capabilities {
        /// Which set or call failed.
        what: &'static str,
        /// Underlying OS error.
        #[source]
        source: io::Error,
    },
    /// Closing inherited fds failed.
    #[error("closing inherited file descriptors failed: {0}; check that /proc is mounted")]
    CloseFds(#[source] io::Error),
    /// A kept fd is not open in this process.
    #[error("keep_fds lists fd {0} but it is not open; pass only fds the device really holds")]
    KeptFdNotOpen(i32),
    /// Setting `PR_SET_NO_NEW_PRIVS` failed.
    #[error(
        "prctl(PR_SET_NO_NEW_PRIVS) failed: {0}; the kernel is too old (< 3.5) for the sandbox"
    )]
    NoNewPrivs(#[source] io::Error),
    /// Reading `/proc/<pid>/...` failed.
    #[error("reading {path} failed: {source}; is the process still alive and /proc mounted?")]
    Proc {
        /// The file or directory read.
        path: String,
        /// Underlying OS error.
        #[source]
        source: io::Error,
    },
    /// A `/proc/<pid>/status` field is missing or malformed.
    #[error("/proc status field {0} is missing or malformed; unsupported kernel")]
    ProcField(&'static str),
    /// Setting a resource limit failed.
    #[error(
        "setrlimit({resource}) failed: {source}; lower the requested limit or run with CAP_SYS_RESOURCE"
    )]
    Rlimit {
        /// The resource name, e.g. `RLIMIT_NOFILE`.
        resource: &'static str,
        /// Underlying OS error.
        #[source]
        source: io::Error,
    },
    /// Compiling the seccomp profile failed (a bad JSON file is a build bug).
    #[error(
        "compiling seccomp profile {profile} failed: {source}; fix crates/pvsched-sandbox/seccomp/device-common.json or device-additions.json"
    )]
    SeccompCompile {
        /// Profile name.
        profile: String,
        /// seccompiler's error.
        #[source]
        source: seccompiler::Error,
    },
    /// The profile's JSON could not be extended with a runtime rule.
    #[error(
        "extending seccomp profile {profile} with a runtime rule failed: {source}; fix crates/pvsched-sandbox/seccomp/device-common.json or device-additions.json"
    )]
    SeccompJson {
        /// Profile name.
        profile: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// The compiled profile lacks the filter named after the profile.
    #[error(
        "seccomp profile {0} has no filter named {0}; the JSON's top-level key must equal the profile name"
    )]
    SeccompMissingFilter(String),
    /// Installing the seccomp filter failed.
    #[error(
        "installing seccomp filter {profile} failed: {source}; the kernel needs CONFIG_SECCOMP_FILTER"
    )]
    SeccompInstall {
        /// Profile name.
        profile: String,
        /// seccompiler's error.
        #[source]
        source: seccompiler::Error,
    },
    /// The current architecture has no seccompiler support.
    #[error("seccomp is not supported on architecture {0}; only x86_64, aarch64 and riscv64 are")]
    SeccompArch(&'static str),
    /// Redirecting stdin to `/dev/null` failed.
    #[error("redirecting stdin to /dev/null failed: {0}; check that /dev/null exists")]
    Stdin(#[source] io::Error),
}
