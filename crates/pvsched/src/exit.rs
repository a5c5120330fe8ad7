//! Process exit codes: the workspace's one table (`pvsched_util::exit`).

pub use pvsched_util::exit::{Exit, help};
