//! Library half of the `pvsched` command line: the pieces the binary and
//! its integration tests share.
//!
//! * [`embedded`]: `--policy embedded`, the BPF policy agent in-process,
//!   wired to the reference VMM (BAR2 backing, slot addresses, KICK).
//! * [`summary`]: the policy part of the `pvsched run` summary.

pub mod embedded;
pub mod summary;
