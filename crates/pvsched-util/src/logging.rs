//! The one logging setup of every pvsched program: `tracing-subscriber`'s
//! formatter on stderr, filtered by `RUST_LOG` (its `EnvFilter` syntax,
//! e.g. `RUST_LOG=debug` or `RUST_LOG=pvsched_agent=trace`), which also
//! takes the records of the crates that log through the `log` facade (the
//! device, the agent, the VMM). A line reads
//!
//! ```text
//! 2026-12-03T16:49:40.640186Z  INFO registered vm=web1 vm_id=0 pid=24798
//! ```
//!
//! (UTC; journald adds its own time, so the daemon's lines keep it for
//! plain files). Interactive tools leave the time out.

use tracing_subscriber::EnvFilter;

/// Whether lines carry the time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// Daemons and long-running processes (pvschedd, the device).
    Time,
    /// Commands a person runs and reads at once (`pvsched run`, the bench).
    NoTime,
}

/// Installs the logger: `RUST_LOG` if set (and valid), else `default`
/// (`"info"`, `"warn"`, ...). Does nothing if a logger is installed
/// already, so a command that runs another's `main` may call it again.
pub fn init(default: &str, clock: Clock) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // try_init: an error only says a logger is there already.
    let _ = match clock {
        Clock::Time => fmt.try_init(),
        Clock::NoTime => fmt.without_time().try_init(),
    };
}
