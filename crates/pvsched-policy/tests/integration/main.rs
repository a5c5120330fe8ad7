//! The BPF policy's integration tests (the C header against its Rust mirror,
//! the policy's invariants), in one test binary: every test binary links the
//! whole crate graph, so one link instead of one per file. Tests of different
//! modules run side by side (`--test-threads`) like tests of one module: each
//! owns its processes, threads and temporary files.

mod intf_layout;
mod invariants;
