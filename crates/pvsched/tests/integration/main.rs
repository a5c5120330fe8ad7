//! The `pvsched` CLI's integration tests (except `device_shutdown`, which
//! counts this process's threads and children and so has a binary of its
//! own), in one test binary: every test binary links the whole crate graph,
//! so one link instead of one per file. Tests of different modules run side
//! by side (`--test-threads`) like tests of one module: each owns its
//! processes, threads and temporary files.

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod daemon_cli;
mod device_kill9;
mod device_modes;
mod policy;
mod snapshot;
