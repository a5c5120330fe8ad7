//! `pvsched run --compare`: the same VM and workload twice on a host
//! loaded with busy threads, first without the host policy, then with it,
//! and one side-by-side summary — what pvsched does for the guest's
//! latency and what it costs the host's other work, in one command.
//!
//! One repetition each, without first: a demonstration, not a benchmark
//! (`pvsched-bench s1` repeats and interleaves; docs/benchmarks.md).

use crate::exit::Exit;
use crate::run::{self, HogWork, Measured, RunArgs, RunError};
use pvsched_host::summary::PolicySummary;
use pvsched_vmm::{RunReport, Workload};
use serde::Serialize;
use std::io::Write;

/// One side of the comparison, for the table and the JSON.
#[derive(Debug, Serialize)]
struct Side {
    #[serde(flatten)]
    report: RunReport,
    hogs: Option<HogWork>,
    /// The VM's CPU time over the workload's time, s (the process's less
    /// the hogs'; a sandboxed device's own process is not in it).
    vm_cpu_s: Option<f64>,
    policy: Option<PolicySummary>,
}

impl Side {
    fn new(m: Measured, name: &str) -> Side {
        Side {
            policy: m.stats.as_ref().map(|s| PolicySummary::new(name, s)),
            report: m.report,
            hogs: m.hogs,
            vm_cpu_s: m.vm_cpu_s,
        }
    }

    /// Latency samples per second of the VM's CPU time: the work done for
    /// the host CPU it took.
    fn samples_per_cpu_s(&self) -> Option<f64> {
        self.vm_cpu_s
            .filter(|&c| c > 0.0)
            .map(|c| self.report.samples as f64 / c)
    }
}

/// `with / without`, when both are known and the denominator is not zero.
fn ratio(with: Option<f64>, without: Option<f64>) -> Option<f64> {
    match (with, without) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// The ratios the summary's last column shows (`with / without`).
#[derive(Debug, PartialEq, Serialize)]
struct Ratios {
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
    hogs_work: Option<f64>,
    vm_cpu: Option<f64>,
    samples_per_vm_cpu_s: Option<f64>,
}

fn ratios(without: &Side, with: &Side) -> Ratios {
    let hogs = |s: &Side| s.hogs.map(|h| h.units_per_s);
    Ratios {
        p50: ratio(with.report.p50_us, without.report.p50_us),
        p99: ratio(with.report.p99_us, without.report.p99_us),
        max: ratio(with.report.max_us, without.report.max_us),
        hogs_work: ratio(hogs(with), hogs(without)),
        vm_cpu: ratio(with.vm_cpu_s, without.vm_cpu_s),
        samples_per_vm_cpu_s: ratio(with.samples_per_cpu_s(), without.samples_per_cpu_s()),
    }
}

/// Runs the comparison; returns the worse of the two runs' verdicts.
pub fn main(args: &RunArgs) -> Result<Exit, RunError> {
    let hogs = args.hogs.unwrap_or_else(|| {
        2 * std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    // Loaded once up front so that a policy that cannot load stops the
    // command before the first run, not after it; dropped again so that
    // the run without pvsched has no BPF program attached at all.
    let probe = run::load_policy_as(args, true)?;
    let name = probe.name;
    drop(probe);
    eprintln!(
        "pvsched run --compare: {} vCPUs, workload {}, {} region, {} device, {} per run, \
         host loaded with {hogs} busy threads (SCHED_OTHER, nice 0); policy {name}",
        args.vcpus,
        Workload::from(args.workload),
        run::region_name(args.region),
        run::device_mode_name(args.device_mode),
        humantime::format_duration(args.duration),
    );
    eprintln!("run 1 of 2: without pvsched");
    let without = run::measure(args, None, hogs)?;
    let v1 = run::verdict(&without.report);
    eprintln!("run 2 of 2: with pvsched (policy {name})");
    let mut policy = run::load_policy_as(args, true)?;
    let mut with = run::measure(args, policy.policy.as_mut(), hogs)?;
    with.stats = policy
        .policy
        .as_ref()
        .and_then(pvsched_host::embedded::Embedded::stats);
    // Unregister (every vCPU thread back at its baseline) before printing.
    drop(policy);
    let v2 = run::verdict(&with.report);
    let (without, with) = (Side::new(without, name), Side::new(with, name));
    let r = ratios(&without, &with);
    if args.json {
        let v = serde_json::json!({
            "compare": { "hogs": hogs, "policy": name, "without": without, "with": with, "ratios": r }
        });
        println!("{v}");
    } else {
        let mut out = std::io::stdout().lock();
        print_table(&mut out, hogs, &without, &with, &r).map_err(RunError::Write)?;
    }
    Ok(if v1 == Exit::Ok { v2 } else { v1 })
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.digits$}"))
}

/// Per-VM policy totals: (boosts applied, throttles, boosted ms).
fn policy_totals(p: &PolicySummary) -> (u64, u64, f64) {
    (
        p.vcpu_sum(|v| v.boosts_applied),
        p.vcpu_sum(|v| v.throttles),
        p.per_vcpu.iter().map(|v| v.boosted_ms).sum(),
    )
}

/// The side-by-side summary.
fn print_table(
    out: &mut impl Write,
    hogs: usize,
    without: &Side,
    with: &Side,
    r: &Ratios,
) -> std::io::Result<()> {
    let w = &with.report;
    writeln!(
        out,
        "\npvsched run --compare: {} vCPUs, {} workload, {:.1} s per run, host loaded with {hogs} busy threads",
        w.vcpus, w.workload, w.duration_s
    )?;
    writeln!(
        out,
        "{:<28} {:>16} {:>16} {:>8}",
        "", "without pvsched", "with pvsched", "ratio"
    )?;
    let row = |out: &mut dyn Write, label: &str, a: String, b: String, q: Option<f64>| {
        writeln!(out, "{label:<28} {a:>16} {b:>16} {:>8}", num(q, 3))
    };
    let (a, b) = (&without.report, &with.report);
    row(
        out,
        "latency p50, µs",
        run::us(a.p50_us),
        run::us(b.p50_us),
        r.p50,
    )?;
    row(
        out,
        "latency p99, µs",
        run::us(a.p99_us),
        run::us(b.p99_us),
        r.p99,
    )?;
    row(
        out,
        "latency max, µs",
        run::us(a.max_us),
        run::us(b.max_us),
        r.max,
    )?;
    row(
        out,
        "samples",
        a.samples.to_string(),
        b.samples.to_string(),
        None,
    )?;
    let t = with.policy.as_ref().map(policy_totals);
    let dash = || "-".to_owned();
    for (label, v) in [
        ("boosts applied", t.map(|t| t.0.to_string())),
        ("throttles (caps)", t.map(|t| t.1.to_string())),
        ("vCPU time boosted, ms", t.map(|t| format!("{:.1}", t.2))),
    ] {
        row(out, label, dash(), v.unwrap_or_else(dash), None)?;
    }
    let work = |s: &Side| num(s.hogs.map(|h| h.units_per_s / 1e6), 3);
    row(
        out,
        "host threads' work, M/s",
        work(without),
        work(with),
        r.hogs_work,
    )?;
    row(
        out,
        "VM CPU time, s",
        num(without.vm_cpu_s, 2),
        num(with.vm_cpu_s, 2),
        r.vm_cpu,
    )?;
    row(
        out,
        "samples per VM CPU-second",
        num(without.samples_per_cpu_s(), 0),
        num(with.samples_per_cpu_s(), 0),
        r.samples_per_vm_cpu_s,
    )?;
    writeln!(
        out,
        "{}; host monotonic clock on both ends",
        run::what_is_measured(w.workload)
    )?;
    writeln!(
        out,
        "host threads' work: units of integer work per second of the {hogs} busy threads \
         beside the VM (ratio: the share of it they kept); VM CPU time: this process's less \
         the busy threads' (the VMM and the embedded policy; a sandboxed device's own process \
         is not in it); samples per VM CPU-second: the work done for the CPU it took"
    )?;
    writeln!(
        out,
        "one run each, without first; repeated and interleaved measurements: pvsched-bench s1 (docs/benchmarks.md)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(p99: f64, work: f64, policy: Option<PolicySummary>) -> Side {
        let mut report = crate::run::tests::report(0xf);
        report.vcpus = 2;
        report.duration_s = 10.0;
        report.p50_us = Some(40.0);
        report.p99_us = Some(p99);
        report.max_us = Some(2.0 * p99);
        Side {
            report,
            hogs: Some(HogWork {
                threads: 4,
                units_per_s: work,
            }),
            vm_cpu_s: Some(if policy.is_some() { 0.6 } else { 0.5 }),
            policy,
        }
    }

    #[test]
    fn ratios_are_with_over_without_and_absent_without_a_denominator() {
        let a = side(1000.0, 2e6, None);
        let b = side(20.0, 1.9e6, None);
        let r = ratios(&a, &b);
        assert_eq!(r.p50, Some(1.0));
        assert_eq!(r.p99, Some(0.02));
        assert_eq!(r.max, Some(0.02));
        assert!((r.hogs_work.unwrap() - 0.95).abs() < 1e-12);
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(None, Some(1.0)), None);
    }

    #[test]
    fn table_shows_both_sides_the_policy_and_the_hogs() {
        let mut p = PolicySummary {
            name: "embedded".into(),
            ..Default::default()
        };
        p.per_vcpu = vec![
            crate::compare::tests::vcpu(3, 1, 12.5),
            crate::compare::tests::vcpu(2, 0, 7.5),
        ];
        let (a, b) = (side(1000.0, 2e6, None), side(20.0, 1.9e6, Some(p)));
        let r = ratios(&a, &b);
        let mut out = Vec::new();
        print_table(&mut out, 4, &a, &b, &r).unwrap();
        let t = String::from_utf8(out).unwrap();
        let line = |label: &str| {
            t.lines()
                .find(|l| l.starts_with(label))
                .unwrap_or_else(|| panic!("no {label} row in\n{t}"))
                .split_whitespace()
                .rev()
                .take(3)
                .collect::<Vec<_>>()
        };
        assert_eq!(line("latency p99"), ["0.020", "20.0", "1000.0"]);
        assert_eq!(line("boosts applied"), ["-", "5", "-"]);
        assert_eq!(line("throttles"), ["-", "1", "-"]);
        assert_eq!(line("vCPU time boosted"), ["-", "20.0", "-"]);
        assert_eq!(line("host threads' work"), ["0.950", "1.900", "2.000"]);
        assert_eq!(line("VM CPU time"), ["1.200", "0.60", "0.50"]);
        // The same samples (report(0xf)) for 1.2x the CPU.
        assert_eq!(line("samples per VM CPU-second")[0], "0.833");
        assert!(t.contains("4 busy threads"), "{t}");
    }

    fn vcpu(applied: u64, throttles: u64, ms: f64) -> pvsched_host::summary::VcpuSummary {
        pvsched_host::summary::VcpuSummary {
            boosts_applied: applied,
            throttles,
            boosted_ms: ms,
            ..Default::default()
        }
    }
}
