//! pvschedd's integration tests (the real daemon, real BPF, real threads;
//! under systemd in a container), in one test binary: every test binary links
//! the whole crate graph, so one link instead of one per file. Tests of
//! different modules run side by side (`--test-threads`) like tests of one
//! module: each owns its processes, threads and temporary files.

#[path = "../../../pvsched-agent/tests/integration/common/mod.rs"]
mod common;
mod support;

mod daemon;
mod hostile;
mod hostile_metrics;
mod reload;
mod restart;
mod systemd;
mod systemd_unit;
