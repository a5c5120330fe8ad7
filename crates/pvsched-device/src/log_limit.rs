//! Rate limiting for logs triggered by guest input.
//!
//! A hostile or buggy guest can issue millions of bad accesses per second;
//! logging each one would turn the log into a denial-of-service vector. A
//! [`LogLimiter`] lets the first [`LogLimiter::BURST`] events through, then
//! one in every [`LogLimiter::EVERY`].

use std::sync::atomic::{AtomicU64, Ordering};

/// Counts events and decides which of them get logged.
#[derive(Debug, Default)]
pub struct LogLimiter {
    count: AtomicU64,
}

impl LogLimiter {
    /// Events always logged before limiting starts.
    pub const BURST: u64 = 16;
    /// After the burst, one event in this many is logged.
    pub const EVERY: u64 = 4096;

    /// A limiter that has seen no events.
    pub const fn new() -> Self {
        Self {
            count: AtomicU64::new(0),
        }
    }

    /// Record one event; returns the number of events so far (1-based) if
    /// this one should be logged.
    pub fn hit(&self) -> Option<u64> {
        let n = self.count.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        (n <= Self::BURST || n.is_multiple_of(Self::EVERY)).then_some(n)
    }
}

/// Log a warning through `limiter` (a `&LogLimiter`) if it lets this event through.
macro_rules! warn_limited {
    ($limiter:expr, $($arg:tt)+) => {
        if let Some(n) = $limiter.hit() {
            log::warn!("{} (event #{n})", format_args!($($arg)+));
        }
    };
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_sparse() {
        let l = LogLimiter::new();
        let logged = (0..2 * LogLimiter::EVERY)
            .filter(|_| l.hit().is_some())
            .count();
        assert_eq!(logged as u64, LogLimiter::BURST + 2);
    }
}
