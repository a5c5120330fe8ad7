//! The policy part of the `pvsched run` summary: per-vCPU boosts,
//! throttles, IPI pairs, slot hits, directed-yield slot, and per-VM
//! decisions, drops and decision→applied latency, from the agent's
//! [`VmStats`].

use pvsched_agent::VmStats;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::io::Write;

/// `+1`-encoded vCPU index (0 = none) as an index.
fn plus_one(v: u32) -> Option<u32> {
    v.checked_sub(1)
}

/// One vCPU thread's policy numbers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VcpuSummary {
    /// vCPU index.
    pub index: usize,
    /// Its thread.
    pub tid: u32,
    /// Boosts the policy decided.
    pub boosts: u64,
    /// Boosts the applier put on the thread.
    pub boosts_applied: u64,
    /// Boosts ended by the caps (continuous limit or budget).
    pub throttles: u64,
    /// Time spent boosted, ms.
    pub boosted_ms: f64,
    /// IPIs sent.
    pub ipis: u64,
    /// vCPU index of the last IPI's receiver.
    pub last_ipi_target: Option<u32>,
    /// Decisions taken from the guest's slot.
    pub slot_hits: u64,
    /// vCPU index in the directed-yield slot.
    pub yield_slot: Option<u32>,
    /// `sched_setattr` failures.
    pub errors: u64,
}

/// One emulator thread's policy numbers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EmulatorSummary {
    /// Its thread.
    pub tid: u32,
    /// Boosts the policy decided.
    pub boosts: u64,
    /// Boosts the applier put on the thread.
    pub boosts_applied: u64,
    /// Boosts ended by the caps.
    pub throttles: u64,
    /// Time spent boosted, ms.
    pub boosted_ms: f64,
    /// `sched_setattr` failures.
    pub errors: u64,
}

/// The policy section (`"policy"` in `pvsched run --json`, and in each
/// measured run of `pvsched-bench`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicySummary {
    /// `embedded` or `daemon`.
    pub name: String,
    /// Decisions the BPF policy emitted.
    pub decisions: u64,
    /// Decisions lost (ring buffer full).
    pub dropped: u64,
    /// Thread states the reconciliation corrected.
    pub corrections: u64,
    /// Decision→applied samples.
    pub apply_samples: usize,
    /// Decision→applied median, µs.
    pub apply_p50_us: f64,
    /// Decision→applied 99th percentile, µs.
    pub apply_p99_us: f64,
    /// Per vCPU.
    pub per_vcpu: Vec<VcpuSummary>,
    /// Per emulator thread.
    pub emulators: Vec<EmulatorSummary>,
}

impl PolicySummary {
    /// The summary of policy `name`'s statistics `s`.
    pub fn new(name: &str, s: &VmStats) -> Self {
        let ms = |ns: u64| ns as f64 / 1e6;
        PolicySummary {
            name: name.to_owned(),
            decisions: s.decisions,
            dropped: s.dropped,
            corrections: s.corrections,
            apply_samples: s.apply_samples,
            apply_p50_us: s.apply_p50_ns as f64 / 1e3,
            apply_p99_us: s.apply_p99_ns as f64 / 1e3,
            per_vcpu: s
                .vcpus
                .iter()
                .enumerate()
                .map(|(i, v)| VcpuSummary {
                    index: i,
                    tid: v.tid,
                    boosts: v.counters.boosts,
                    boosts_applied: v.counters.boosts_applied,
                    throttles: v.counters.throttles,
                    boosted_ms: ms(v.counters.boosted_ns),
                    ipis: v.ipis,
                    last_ipi_target: plus_one(v.last_ipi_target),
                    slot_hits: v.slot_hits,
                    yield_slot: plus_one(v.yield_slot),
                    errors: v.counters.errors,
                })
                .collect(),
            emulators: s
                .emulators
                .iter()
                .map(|v| EmulatorSummary {
                    tid: v.tid,
                    boosts: v.counters.boosts,
                    boosts_applied: v.counters.boosts_applied,
                    throttles: v.counters.throttles,
                    boosted_ms: ms(v.counters.boosted_ns),
                    errors: v.counters.errors,
                })
                .collect(),
        }
    }

    /// Sum of `f` over the vCPUs.
    pub fn vcpu_sum(&self, f: impl Fn(&VcpuSummary) -> u64) -> u64 {
        self.per_vcpu.iter().map(f).fold(0, u64::saturating_add)
    }
}

/// The policy section as JSON (`"policy"` in `pvsched run --json`).
pub fn to_json(name: &str, s: &VmStats) -> Value {
    serde_json::to_value(PolicySummary::new(name, s)).unwrap_or(Value::Null)
}

fn opt(v: Option<u32>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

/// The policy section as a table.
pub fn print_table(out: &mut impl Write, name: &str, s: &VmStats) -> std::io::Result<()> {
    writeln!(out, "\npolicy {name}:")?;
    writeln!(
        out,
        "{:>4} {:>8} {:>7} {:>7} {:>9} {:>11} {:>6} {:>8} {:>9} {:>6}",
        "vCPU",
        "TID",
        "boosts",
        "applied",
        "throttles",
        "boosted ms",
        "IPIs",
        "IPI to",
        "slot hits",
        "yield"
    )?;
    for (i, v) in s.vcpus.iter().enumerate() {
        writeln!(
            out,
            "{:>4} {:>8} {:>7} {:>7} {:>9} {:>11.1} {:>6} {:>8} {:>9} {:>6}",
            i,
            v.tid,
            v.counters.boosts,
            v.counters.boosts_applied,
            v.counters.throttles,
            v.counters.boosted_ns as f64 / 1e6,
            v.ipis,
            opt(plus_one(v.last_ipi_target)),
            v.slot_hits,
            opt(plus_one(v.yield_slot)),
        )?;
    }
    for (j, v) in s.emulators.iter().enumerate() {
        writeln!(
            out,
            "{:>4} {:>8} {:>7} {:>7} {:>9} {:>11.1}",
            format!("emu{j}"),
            v.tid,
            v.counters.boosts,
            v.counters.boosts_applied,
            v.counters.throttles,
            v.counters.boosted_ns as f64 / 1e6,
        )?;
    }
    writeln!(
        out,
        "decisions {} (dropped {}, corrected by reconciliation {}), decision→applied p50 {:.1} µs p99 {:.1} µs over {} samples",
        s.decisions,
        s.dropped,
        s.corrections,
        s.apply_p50_ns as f64 / 1e3,
        s.apply_p99_ns as f64 / 1e3,
        s.apply_samples
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_agent::agent::ThreadStats;

    fn stats() -> VmStats {
        VmStats {
            vcpus: vec![
                ThreadStats {
                    tid: 7,
                    counters: pvsched_agent::agent::ThreadCounters {
                        boosts: 3,
                        ..Default::default()
                    },
                    last_ipi_target: 2,
                    yield_slot: 2,
                    ipis: 5,
                    ..Default::default()
                },
                ThreadStats::default(),
            ],
            emulators: vec![],
            decisions: 9,
            dropped: 1,
            corrections: 1,
            apply_samples: 4,
            apply_p50_ns: 12_000,
            apply_p99_ns: 40_500,
            tick_gap_max_ns: 5_000_000,
            cosched_now_us: 0,
            cosched_sync_rate: None,
            apply_hist: Default::default(),
        }
    }

    #[test]
    fn json_decodes_plus_one_indices() {
        let j = to_json("embedded", &stats());
        assert_eq!(j["per_vcpu"][0]["last_ipi_target"], 1);
        assert_eq!(j["per_vcpu"][0]["yield_slot"], 1);
        assert!(j["per_vcpu"][1]["yield_slot"].is_null());
        assert_eq!(j["apply_p99_us"], 40.5);
        assert_eq!(j["dropped"], 1);
    }

    #[test]
    fn table_has_a_row_per_vcpu() {
        let mut out = Vec::new();
        print_table(&mut out, "embedded", &stats()).unwrap();
        let t = String::from_utf8(out).unwrap();
        assert!(t.contains("dropped 1"));
        assert!(t.contains("p99 40.5 µs"));
        assert_eq!(
            t.lines()
                .filter(|l| l.trim_start().starts_with("0 "))
                .count(),
            1
        );
    }
}
