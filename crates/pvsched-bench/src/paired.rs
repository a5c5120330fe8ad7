//! Paired comparison of two variants over repetitions (index =
//! repetition): per-pair ratios, their median and range, an exact
//! two-sided sign-flip test on the log ratios, and a verdict against a
//! threshold that says "unresolved" when the repetitions cannot tell.
//!
//! A stand-in with the lead's signatures until main carries the real
//! module (merge takes main's).

use serde::{Deserialize, Serialize};

/// The paired comparison of one figure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Paired {
    /// Pairs with both figures.
    pub n: usize,
    /// Repetitions where either figure is missing.
    pub failed: usize,
    /// Median of the per-pair test/base ratios.
    pub ratio: Option<f64>,
    /// Smallest per-pair ratio.
    pub min: Option<f64>,
    /// Largest per-pair ratio.
    pub max: Option<f64>,
    /// Exact two-sided sign-flip test on the log ratios.
    pub p: Option<f64>,
    /// 95 % interval of the ratio.
    pub ci95: Option<(f64, f64)>,
    /// Smallest relative difference the cell can detect.
    pub resolution: Option<f64>,
}

/// A figure against its threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The threshold is met, and the repetitions show it.
    Met,
    /// The threshold is missed, and the repetitions show it.
    NotMet,
    /// The repetitions cannot tell.
    Unresolved,
}

/// Significance level of the verdicts.
const ALPHA: f64 = 0.05;

/// Compares `test` with `base`, repetition by repetition.
pub fn paired(base: &[Option<f64>], test: &[Option<f64>]) -> Paired {
    let reps = base.len().max(test.len());
    let mut ratios: Vec<f64> = (0..reps)
        .filter_map(|i| {
            let b = base.get(i).copied().flatten()?;
            let t = test.get(i).copied().flatten()?;
            (b > 0.0 && t > 0.0).then_some(t / b)
        })
        .collect();
    let n = ratios.len();
    ratios.sort_by(f64::total_cmp);
    let median = match n {
        0 => None,
        _ if n % 2 == 1 => Some(ratios[n / 2]),
        _ => Some((ratios[n / 2 - 1] + ratios[n / 2]) / 2.0),
    };
    let logs: Vec<f64> = ratios.iter().map(|r| r.ln()).collect();
    Paired {
        n,
        failed: reps - n,
        ratio: median,
        min: ratios.first().copied(),
        max: ratios.last().copied(),
        p: sign_flip_p(&logs),
        ci95: None,
        resolution: None,
    }
}

/// The exact two-sided p of the sign-flip test of `x` (mean zero under
/// the null): the share of the 2^n sign assignments whose |sum| is at
/// least the observed one. None without samples or past 20 of them.
fn sign_flip_p(x: &[f64]) -> Option<f64> {
    if x.is_empty() || x.len() > 20 {
        return None;
    }
    let observed = x.iter().sum::<f64>().abs();
    let total = 1u32 << x.len();
    let hits = (0..total)
        .filter(|mask| {
            let s: f64 = x
                .iter()
                .enumerate()
                .map(|(i, v)| if mask & (1 << i) != 0 { -v } else { *v })
                .sum();
            s.abs() >= observed - 1e-12
        })
        .count();
    Some(hits as f64 / f64::from(total))
}

impl Paired {
    /// Whether the ratio is at least `t`.
    pub fn at_least(&self, t: f64) -> Verdict {
        self.verdict(|r| r >= t)
    }

    /// Whether the ratio is at most `t`.
    pub fn at_most(&self, t: f64) -> Verdict {
        self.verdict(|r| r <= t)
    }

    fn verdict(&self, ok: impl Fn(f64) -> bool) -> Verdict {
        match (self.ratio, self.p) {
            (Some(r), Some(p)) if p <= ALPHA => {
                if ok(r) {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                }
            }
            _ => Verdict::Unresolved,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_by_repetition_and_counts_the_missing() {
        let p = paired(
            &[Some(1.0), Some(2.0), None, Some(4.0)],
            &[Some(2.0), Some(4.0), Some(1.0), Some(8.0)],
        );
        assert_eq!((p.n, p.failed), (3, 1));
        assert_eq!(p.ratio, Some(2.0));
        // Three positive log ratios: only all-plus and all-minus reach it.
        assert_eq!(p.p, Some(0.25));
        assert_eq!(p.at_least(1.0), Verdict::Unresolved);
    }
}
