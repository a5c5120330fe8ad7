//! The host side a VMM links to use pvsched: what `pvsched run` and
//! `pvsched-bench` share, so that what the bench measures is what the CLI
//! does.
//!
//! * [`host`]: the one policy host: the BPF policy agent in the caller's
//!   own process, or pvschedd, behind one `register`.
//! * [`embedded`]: that host wired to the reference VMM (the device's sink,
//!   BAR2's backing, the slots' addresses).
//! * [`launch`]: starting the reference VMM's VM with the policy wired to
//!   it.
//! * [`hogs`]: counted CPU hogs, the host load of `pvsched run --compare`
//!   and of the benchmarks.
//! * [`summary`]: the policy part of a run's summary (per-vCPU boosts,
//!   throttles, decision latency).
//!
//! pvschedd itself does not link this crate: it is the other side of
//! [`host::PolicyHost::daemon`].

pub mod embedded;
pub mod hogs;
pub mod host;
pub mod launch;
pub mod summary;
