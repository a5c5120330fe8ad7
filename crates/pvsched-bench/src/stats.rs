//! Numbers for `pvsched-bench`: nearest-rank percentiles of raw samples,
//! medians and spread over repetitions, and CDF points for plots. Nothing
//! here rounds: a figure a target compares keeps full precision, and only
//! the rendered tables round (`report`'s `markdown`).

/// Nearest-rank percentile, the rule of `pvsched run`'s summary.
pub use pvsched_vmm::stats::percentile;

/// Nanoseconds as microseconds.
pub fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// Latency summary of one run, µs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Latency {
    /// Number of samples.
    pub samples: usize,
    /// Median.
    pub p50_us: Option<f64>,
    /// 90th percentile.
    pub p90_us: Option<f64>,
    /// 99th percentile.
    pub p99_us: Option<f64>,
    /// 99.9th percentile.
    pub p999_us: Option<f64>,
    /// Maximum.
    pub max_us: Option<f64>,
}

/// Summarise nanosecond samples (sorts them in place).
pub fn latency(samples: &mut [u64]) -> Latency {
    samples.sort_unstable();
    let p = |q| percentile(samples, q).map(us);
    Latency {
        samples: samples.len(),
        p50_us: p(50.0),
        p90_us: p(90.0),
        p99_us: p(99.0),
        p999_us: p(99.9),
        max_us: samples.last().copied().map(us),
    }
}

/// Median of the values present (the mean of the middle two for an even
/// count); `None` if there are none.
pub fn median(values: &[Option<f64>]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().flatten().copied().collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let m = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(m)
}

/// (min, max) of the values present.
pub fn spread(values: &[Option<f64>]) -> Option<(f64, f64)> {
    let mut it = values.iter().flatten().copied();
    let first = it.next()?;
    Some(it.fold((first, first), |(lo, hi), x| (lo.min(x), hi.max(x))))
}

/// `a / b`; `None` if either is missing or `b` is not positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Empirical CDF of sorted nanosecond samples as at most `max_points`
/// (µs, fraction ≤) points: every distinct value for small sets, else
/// quantiles spaced evenly in log(1 − F) so the tail (p99, p99.9, max)
/// keeps its detail.
pub fn cdf(sorted: &[u64], max_points: usize) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 || max_points < 2 {
        return Vec::new();
    }
    let point = |i: usize| (sorted[i] as f64 / 1000.0, (i + 1) as f64 / n as f64);
    if n <= max_points {
        return (0..n).map(point).collect();
    }
    // Ranks r_k with 1 - r_k/n spread in log scale from 1 down to 1/n.
    let mut idx: Vec<usize> = (0..max_points)
        .map(|k| {
            let t = k as f64 / (max_points - 1) as f64;
            let tail = (n as f64).powf(-t); // 1 .. 1/n
            (((1.0 - tail) * n as f64).round() as usize).min(n - 1)
        })
        .collect();
    idx.push(n - 1);
    idx.dedup();
    idx.into_iter().map(point).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_medians_ratios() {
        let mut s: Vec<u64> = (1..=1000).rev().map(|i| i * 1000).collect();
        let l = latency(&mut s);
        assert_eq!(l.samples, 1000);
        assert_eq!(l.p50_us, Some(500.0));
        assert_eq!(l.p99_us, Some(990.0));
        assert_eq!(l.p999_us, Some(999.0));
        assert_eq!(l.max_us, Some(1000.0));
        assert_eq!(latency(&mut []).p50_us, None);
        assert_eq!(median(&[Some(3.0), None, Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median(&[Some(1.0), Some(2.0)]), Some(1.5));
        assert_eq!(median(&[None]), None);
        assert_eq!(spread(&[Some(3.0), Some(1.0), None]), Some((1.0, 3.0)));
        assert_eq!(ratio(Some(1.0), Some(4.0)), Some(0.25));
        // Full precision: no rounding before a comparison.
        assert_eq!(ratio(Some(503.0), Some(10_000.0)), Some(0.0503));
        assert_eq!(latency(&mut [1234]).p50_us, Some(1.234));
        assert_eq!(median(&[Some(1.0), Some(1.005)]), Some(1.0025));
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }

    #[test]
    fn cdf_is_monotonic_and_ends_at_the_max() {
        let s: Vec<u64> = (1..=100_000).collect();
        let c = cdf(&s, 200);
        assert!(c.len() <= 201);
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(c.last(), Some(&(100.0, 1.0)));
        assert_eq!(cdf(&[5000, 7000], 200), vec![(5.0, 0.5), (7.0, 1.0)]);
        assert!(cdf(&[], 200).is_empty());
    }
}
