//! The agent's integration tests, one module per concern, in one test
//! binary: every test binary links the agent with aya and libbpf's
//! loader, so one link instead of eight. Tests of different modules run
//! side by side (`--test-threads`), like tests of one module: each test
//! owns its threads, agents and temporary files.

mod common;

mod applier_wakeups;
mod attach_cli;
mod cosched;
mod differential;
mod kill9;
mod lossless;
mod no_privilege;
mod real_threads;
mod restorers;
mod tid_hint;
mod tid_reuse;
