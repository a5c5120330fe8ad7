//! Library half of the `pvsched` command line: the pieces the binary and
//! its integration tests share.
//!
//! * [`embedded`]: `--policy embedded`, the BPF policy agent in-process,
//!   wired to the reference VMM (BAR2 backing, slot addresses, KICK).
//! * [`launch`]: starting the reference VMM's VM with that policy wired to
//!   it (`pvsched run` and `pvsched-bench run`).
//! * [`summary`]: the policy part of the `pvsched run` summary.
//! * [`hogs`]: counted CPU hogs, the host load of `pvsched run --compare`
//!   and of the benchmarks.

pub mod embedded;
pub mod hogs;
pub mod launch;
pub mod summary;
