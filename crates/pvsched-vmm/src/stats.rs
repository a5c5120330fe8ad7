//! Latency summaries (nearest-rank percentiles) of nanosecond samples.

use serde::Serialize;

/// p50/p99/max of a set of samples, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub samples: usize,
    /// Median, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile, µs.
    pub p99_us: Option<f64>,
    /// Maximum, µs.
    pub max_us: Option<f64>,
}

/// Nearest-rank percentile, shared by `pvsched run`'s summary, `pvsched
/// bench` and the agent's statistics.
pub use pvsched_util::percentile;

fn us(ns: Option<u64>) -> Option<f64> {
    ns.map(|n| (n as f64 / 1000.0 * 10.0).round() / 10.0)
}

/// Summarise nanosecond samples.
pub fn summarize(samples: &[u64]) -> Summary {
    let mut v = samples.to_vec();
    v.sort_unstable();
    Summary {
        samples: v.len(),
        p50_us: us(percentile(&v, 50.0)),
        p99_us: us(percentile(&v, 99.0)),
        max_us: us(v.last().copied()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let s: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        let r = summarize(&s);
        assert_eq!(r.samples, 100);
        assert_eq!(r.p50_us, Some(50.0));
        assert_eq!(r.p99_us, Some(99.0));
        assert_eq!(r.max_us, Some(100.0));
        assert_eq!(summarize(&[]).p50_us, None);
        assert_eq!(summarize(&[1500]).p99_us, Some(1.5));
    }
}
