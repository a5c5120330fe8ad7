//! The policy part of the `pvsched run` summary: per-vCPU boosts,
//! throttles, IPI pairs, slot hits, directed-yield slot, and per-VM
//! decisions, drops and decision→applied latency, from the agent's
//! [`VmStats`].

use pvsched_agent::VmStats;
use serde_json::{Value, json};
use std::io::Write;

/// `+1`-encoded vCPU index (0 = none) as an index.
fn plus_one(v: u32) -> Option<u32> {
    v.checked_sub(1)
}

/// The policy section as JSON (`"policy"` in `pvsched run --json`).
pub fn to_json(name: &str, s: &VmStats) -> Value {
    let vcpus: Vec<Value> = s
        .vcpus
        .iter()
        .enumerate()
        .map(|(i, v)| {
            json!({
                "index": i,
                "tid": v.tid,
                "boosts": v.boosts,
                "boosts_applied": v.boosts_applied,
                "throttles": v.throttles,
                "boosted_ms": v.boosted_ns as f64 / 1e6,
                "ipis": v.ipis,
                "last_ipi_target": plus_one(v.last_ipi_target),
                "slot_hits": v.slot_hits,
                "yield_slot": plus_one(v.yield_slot),
                "errors": v.errors,
            })
        })
        .collect();
    let emulators: Vec<Value> = s
        .emulators
        .iter()
        .map(|v| {
            json!({
                "tid": v.tid,
                "boosts": v.boosts,
                "boosts_applied": v.boosts_applied,
                "throttles": v.throttles,
                "boosted_ms": v.boosted_ns as f64 / 1e6,
                "errors": v.errors,
            })
        })
        .collect();
    json!({
        "name": name,
        "decisions": s.decisions,
        "dropped": s.dropped,
        "corrections": s.corrections,
        "apply_samples": s.apply_samples,
        "apply_p50_us": s.apply_p50_ns as f64 / 1e3,
        "apply_p99_us": s.apply_p99_ns as f64 / 1e3,
        "per_vcpu": vcpus,
        "emulators": emulators,
    })
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
            v.boosts,
            v.boosts_applied,
            v.throttles,
            v.boosted_ns as f64 / 1e6,
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
            v.boosts,
            v.boosts_applied,
            v.throttles,
            v.boosted_ns as f64 / 1e6,
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
                    boosts: 3,
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
