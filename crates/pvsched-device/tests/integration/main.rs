//! The device model's integration tests (handshake, config space, slots,
//! invalid regions, property-tested register sequences), in one test binary:
//! every test binary links the whole crate graph, so one link instead of one
//! per file. Tests of different modules run side by side (`--test-threads`)
//! like tests of one module: each owns its processes, threads and temporary
//! files.

mod config_space;
mod handshake;
mod invalid_region;
mod proptest_sequences;
mod slots;
