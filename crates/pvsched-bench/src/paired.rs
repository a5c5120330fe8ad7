//! Paired comparisons of two variants over repetitions, and the verdicts a
//! target may draw from them.
//!
//! A benchmark's variants run in the same repetition back to back, so the
//! machine's drift between repetitions (the hypervisor under this host, the
//! page cache, a neighbour) moves both of a repetition's figures together.
//! Comparing each repetition's pair and then summarising the pair ratios
//! cancels that drift; comparing two medians does not. Every figure here is
//! computed at full precision: rounding is for display only, so a 0.0503
//! never passes a "≤ 0.05" target.
//!
//! * [`Paired::p`]: an exact two-sided sign-flip (permutation) test of the
//!   mean log ratio: under "no difference" each pair's sign is a coin toss.
//!   The smallest p `n` pairs can give is `2 / 2^n` (0.25 for 3, 0.0625
//!   for 5, 0.0078 for 8).
//! * [`Paired::ci95`]: the ratio's 95 % interval, `exp(mean ± t·sd/√n)` of
//!   the log ratios (Student's t with n − 1 degrees of freedom).
//! * [`Paired::resolution`]: the interval's half-width as a fraction: the
//!   smallest difference the cell could tell from chance. A "no loss"
//!   claim is only as good as this number.

use serde::{Deserialize, Serialize};

/// The sign-flip test enumerates all `2^n` sign patterns up to this many
/// pairs (65 536 sums); above it only the first pairs' signs are flipped,
/// an approximation. The benchmarks run a dozen repetitions at most, where
/// the test is exact.
const EXACT_PAIRS: usize = 16;

/// One figure of a test variant against a base variant over repetitions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// Repetitions in which both variants gave the figure.
    pub n: usize,
    /// Repetitions in which either variant gave none (a failed or missing
    /// run): counted, never silently left out.
    pub failed: usize,
    /// Median of the per-repetition ratios test / base.
    pub ratio: Option<f64>,
    /// Smallest per-repetition ratio.
    pub min: Option<f64>,
    /// Largest per-repetition ratio.
    pub max: Option<f64>,
    /// Exact two-sided sign-flip p of the log ratios (`None` below 2 pairs).
    pub p: Option<f64>,
    /// 95 % interval of the ratio (`None` below 2 pairs).
    pub ci95: Option<(f64, f64)>,
    /// Half-width of [`Self::ci95`] as a fraction of the ratio: the smallest
    /// relative difference these repetitions could detect.
    pub resolution: Option<f64>,
}

/// What a target may say of a [`Paired`] figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The whole 95 % interval is on the target's side.
    Met,
    /// The whole 95 % interval is on the wrong side.
    NotMet,
    /// The interval straddles the target (or there are too few pairs):
    /// these repetitions cannot tell.
    Unresolved,
}

impl Verdict {
    /// The word a table shows.
    pub fn word(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::NotMet => "not met",
            Verdict::Unresolved => "unresolved",
        }
    }
}

/// Pairs `base[i]` with `test[i]` (index = repetition) and summarises the
/// ratios `test / base`. A pair counts only when both figures are present,
/// finite and positive (a ratio of a zero is no ratio); any other
/// repetition counts as failed.
pub fn paired(base: &[Option<f64>], test: &[Option<f64>]) -> Paired {
    let reps = base.len().max(test.len());
    let mut ratios = Vec::with_capacity(reps);
    for i in 0..reps {
        let b = base.get(i).copied().flatten();
        let t = test.get(i).copied().flatten();
        if let (Some(b), Some(t)) = (b, t)
            && b.is_finite()
            && t.is_finite()
            && b > 0.0
            && t > 0.0
        {
            ratios.push(t / b);
        }
    }
    let n = ratios.len();
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let logs: Vec<f64> = ratios.iter().map(|r| r.ln()).collect();
    let (p, ci95, resolution) = match interval(&logs) {
        Some((lo, hi)) => {
            let centre = mean(&logs).exp();
            let half = (hi.exp() - lo.exp()) / 2.0;
            (
                Some(sign_flip_p(&logs)),
                Some((lo.exp(), hi.exp())),
                Some(half / centre),
            )
        }
        None => (None, None, None),
    };
    Paired {
        n,
        failed: reps - n,
        ratio: median_sorted(&sorted),
        min: sorted.first().copied(),
        max: sorted.last().copied(),
        p,
        ci95,
        resolution,
    }
}

impl Paired {
    /// The resolution as a table shows it: `±3 %`, `±0.4 %` below one
    /// per cent (a "±0 %" would claim more than the pairs show), `-`
    /// without one.
    pub fn resolution_text(&self) -> String {
        match self.resolution {
            Some(r) if r < 0.01 => format!("±{:.1} %", r * 100.0),
            Some(r) => format!("±{:.0} %", r * 100.0),
            None => "-".into(),
        }
    }

    /// The ratio should be at least `target` (a throughput kept or gained).
    pub fn at_least(&self, target: f64) -> Verdict {
        match self.ci95 {
            Some((lo, _)) if lo >= target => Verdict::Met,
            Some((_, hi)) if hi < target => Verdict::NotMet,
            _ => Verdict::Unresolved,
        }
    }

    /// The ratio should be at most `target` (a latency cut).
    pub fn at_most(&self, target: f64) -> Verdict {
        match self.ci95 {
            Some((_, hi)) if hi <= target => Verdict::Met,
            Some((lo, _)) if lo > target => Verdict::NotMet,
            _ => Verdict::Unresolved,
        }
    }
}

/// Median of sorted values (the mean of the middle two for an even count).
pub fn median_sorted(v: &[f64]) -> Option<f64> {
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// The 95 % interval of the mean of `x` (Student's t), `None` below two
/// values.
fn interval(x: &[f64]) -> Option<(f64, f64)> {
    let n = x.len();
    if n < 2 {
        return None;
    }
    let m = mean(x);
    let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1) as f64;
    let half = t975(n - 1) * (var / n as f64).sqrt();
    Some((m - half, m + half))
}

/// Two-sided 97.5 % quantile of Student's t with `df` degrees of freedom.
fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        31..=60 => 2.000,
        61..=120 => 1.980,
        _ => 1.960,
    }
}

/// Exact two-sided sign-flip p of the sum of `x`: the share of the `2^n`
/// sign patterns whose absolute sum is at least the observed one.
fn sign_flip_p(x: &[f64]) -> f64 {
    let n = x.len().min(EXACT_PAIRS);
    let observed = x.iter().sum::<f64>().abs();
    // Ties within rounding count as "at least as extreme", so a pattern
    // equal to the observed one is never lost to floating-point noise.
    let tol = 1e-12 * x.iter().map(|v| v.abs()).sum::<f64>().max(1.0);
    let patterns: u32 = 1 << n;
    let mut extreme = 0u32;
    for mask in 0..patterns {
        let s: f64 = x
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i < n && mask & (1 << i) != 0 {
                    -v
                } else {
                    *v
                }
            })
            .sum();
        if s.abs() + tol >= observed {
            extreme += 1;
        }
    }
    f64::from(extreme) / f64::from(patterns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_repetitions_are_a_ratio_of_one_with_no_difference() {
        let p = paired(&[Some(10.0); 5], &[Some(10.0); 5]);
        assert_eq!((p.n, p.failed, p.ratio), (5, 0, Some(1.0)));
        assert_eq!(p.p, Some(1.0));
        assert_eq!(p.at_least(0.95), Verdict::Met);
        assert_eq!(p.at_least(1.05), Verdict::NotMet);
    }

    #[test]
    fn the_smallest_p_is_two_over_two_to_the_n() {
        let base = [Some(1.0); 5];
        let test = [Some(2.0), Some(2.1), Some(1.9), Some(2.2), Some(2.0)];
        let p = paired(&base, &test);
        assert_eq!(p.p, Some(2.0 / 32.0));
        assert_eq!(p.ratio, Some(2.0));
        assert_eq!((p.min, p.max), (Some(1.9), Some(2.2)));
    }

    #[test]
    fn a_missing_or_zero_figure_is_a_failed_repetition_not_a_pair() {
        let base = [Some(1.0), None, Some(1.0), Some(0.0)];
        let test = [Some(1.5), Some(1.0), None, Some(1.0), Some(1.0)];
        let p = paired(&base, &test);
        assert_eq!((p.n, p.failed), (1, 4));
        assert_eq!(p.ci95, None);
        assert_eq!(p.at_least(1.0), Verdict::Unresolved);
    }

    #[test]
    fn a_ratio_just_over_the_target_is_not_met_by_rounding() {
        // An S1 tail ratio of 0.0503 once passed "≤ 0.05" because medians
        // were rounded first.
        let base = [Some(1000.0); 6];
        let test = [
            Some(50.3),
            Some(50.2),
            Some(50.4),
            Some(50.3),
            Some(50.35),
            Some(50.25),
        ];
        let p = paired(&base, &test);
        assert!(p.ratio.unwrap() > 0.05);
        assert_eq!(p.at_most(0.05), Verdict::NotMet);
    }

    #[test]
    fn a_wide_spread_cannot_resolve_a_small_difference() {
        let base = [Some(1.0); 4];
        let test = [Some(0.8), Some(1.3), Some(0.9), Some(1.25)];
        let p = paired(&base, &test);
        assert!(p.resolution.unwrap() > 0.2, "{p:?}");
        assert_eq!(p.at_least(0.95), Verdict::Unresolved);
    }
}
