//! Scenarios S1–S3 and S5: which variants run (in the order they are
//! interleaved within a repetition), and how their runs become the bench
//! JSON: medians over repetitions, spread, ratios pvsched/vanilla and
//! targets.

use super::BenchError;
use super::costs;
use super::hogs::Load;
use super::plot::Series;
use super::report::{
    BpfReport, PolicyRun, ProgCost, Ratios, RunRow, Spread, Spreads, Target, VariantReport, value,
};
use super::runner::{self, Outcome, RunOpts, Variant};
use super::stats::{self, median, ratio};
use super::worker::{BenchWorkload, VariantPolicy};
use pvsched_agent::object::REEVAL_PROG;
use pvsched_host::summary::PolicySummary;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// S1–S3 and S5 (S4 is `bench/s4.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Wakeup latency, loaded host vs idle host.
    S1,
    /// IPI / spin round trips, vCPUs > pCPUs.
    S2,
    /// Costs.
    S3,
    /// A greedy guest (RT asked forever, every vCPU spinning) beside
    /// busy hogs: the caps' budget holds and the hogs keep their CPU.
    S5,
}

impl Scenario {
    /// `s1`, `s2`, `s3`, `s5`.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::S1 => "s1",
            Scenario::S2 => "s2",
            Scenario::S3 => "s3",
            Scenario::S5 => "s5",
        }
    }

    /// Hogs of the loaded variants when `--hogs` is not given, for
    /// `cpus` online CPUs: S1 two per CPU (so that vanilla's loaded tail
    /// shows the problem), the others one per CPU.
    pub fn default_hogs(self, cpus: usize) -> usize {
        match self {
            Scenario::S1 => 2 * cpus,
            _ => cpus,
        }
    }
}

fn v(
    name: &'static str,
    workload: BenchWorkload,
    vcpus: u32,
    policy: VariantPolicy,
    load: Load,
) -> Variant {
    Variant {
        name,
        workload,
        vcpus,
        policy,
        load,
        extra_vms: 0,
        prefilter_ms: 0,
    }
}

/// An S3 variant: `extra_vms` stand-in VMs beside the measured one, and a
/// prefilter window before it starts.
fn cost(
    name: &'static str,
    workload: BenchWorkload,
    vcpus: u32,
    extra_vms: u32,
    load: Load,
) -> Variant {
    Variant {
        extra_vms,
        prefilter_ms: S3_PREFILTER_MS,
        ..v(name, workload, vcpus, VariantPolicy::Default, load)
    }
}

/// S3's prefilter window per run: at ~20,000 host scheduler events a
/// second, enough runs for a stable mean.
const S3_PREFILTER_MS: u64 = 2000;

/// The variants of `s`, in run order within a repetition; `hogs` (CPU
/// hogs) load the host of every variant but S1's idle ones.
pub fn variants(s: Scenario, hogs: Load) -> Vec<Variant> {
    use BenchWorkload::*;
    use VariantPolicy::{Default as Pvsched, NoYield, None as Vanilla};
    match s {
        Scenario::S1 => vec![
            v("vanilla", Wakeup, 2, Vanilla, hogs),
            v("pvsched", Wakeup, 2, Pvsched, hogs),
            v("idle_vanilla", Wakeup, 2, Vanilla, Load::NONE),
            v("idle_pvsched", Wakeup, 2, Pvsched, Load::NONE),
        ],
        Scenario::S2 => vec![
            v("vanilla", Ipi, 4, Vanilla, hogs),
            v("pvsched", Ipi, 4, Pvsched, hogs),
            v("no_yield", Ipi, 4, NoYield, hogs),
            v("spin_vanilla", Spin, 4, Vanilla, hogs),
            v("spin_pvsched", Spin, 4, Pvsched, hogs),
            v("spin_no_yield", Spin, 4, NoYield, hogs),
        ],
        // The measured VM alone, then beside 15 and 63 stand-in VMs
        // (1, 16 and 64 registered VMs; 64 is the agent's limit).
        Scenario::S3 => vec![
            cost("wakeup", Wakeup, 2, 0, hogs),
            cost("ipi", Ipi, 4, 0, hogs),
            cost("ipi_16vms", Ipi, 4, 15, hogs),
            cost("ipi_64vms", Ipi, 4, 63, hogs),
        ],
        Scenario::S5 => vec![
            v("vanilla", Greedy, 2, Vanilla, hogs),
            v("pvsched", Greedy, 2, Pvsched, hogs),
        ],
    }
}

/// Every run of one variant, in repetition order.
pub struct Runs {
    /// The variant.
    pub variant: Variant,
    /// One per repetition.
    pub outcomes: Vec<Outcome>,
}

/// Runs `reps` repetitions of `variants`, interleaved (A, B, C, A, B, C...).
pub fn execute(
    scenario: Scenario,
    variants: Vec<Variant>,
    reps: u32,
    opts: &RunOpts,
) -> Result<Vec<Runs>, BenchError> {
    let mut all: Vec<Runs> = variants
        .into_iter()
        .map(|variant| Runs {
            variant,
            outcomes: Vec::new(),
        })
        .collect();
    for rep in 1..=reps {
        for r in &mut all {
            let tag = format!("{}-rep{rep}-{}", scenario.name(), r.variant.name);
            let o = runner::run(&r.variant, opts, &tag)?;
            let l = &o.latency;
            eprintln!(
                "[{} rep {rep}/{reps}] {:<14} p50 {:>8} p99 {:>9} max {:>9} µs  ({} samples{}{})",
                scenario.name(),
                r.variant.name,
                fmt(l.p50_us),
                fmt(l.p99_us),
                fmt(l.max_us),
                l.samples,
                hog_brief(&o),
                policy_brief(&o)
            );
            if let Some(t) = &o.trace {
                eprintln!(
                    "[{} rep {rep}/{reps}] {:<14} {}",
                    scenario.name(),
                    r.variant.name,
                    t.brief()
                );
            }
            r.outcomes.push(o);
        }
    }
    Ok(all)
}

fn fmt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

fn hog_brief(o: &Outcome) -> String {
    match o.hog.per_s() {
        Some(r) => format!(", hogs {:.3e} it/s", r),
        None => String::new(),
    }
}

fn policy_brief(o: &Outcome) -> String {
    let Some(r) = policy_run(o.report.policy.as_ref()) else {
        return String::new();
    };
    format!(
        ", boosts {}, throttles {}, boosted {:.2} s, apply p50 {} p99 {} µs",
        r.boosts, r.throttles, r.boosted_s, r.apply_p50_us, r.apply_p99_us
    )
}

/// The per-run policy numbers: sums over vCPUs plus the VM's totals.
fn policy_run(p: Option<&PolicySummary>) -> Option<PolicyRun> {
    let p = p?;
    Some(PolicyRun {
        decisions: p.decisions,
        dropped: p.dropped,
        boosts: p.vcpu_sum(|v| v.boosts),
        boosts_applied: p.vcpu_sum(|v| v.boosts_applied),
        throttles: p.vcpu_sum(|v| v.throttles),
        slot_hits: p.vcpu_sum(|v| v.slot_hits),
        ipis: p.vcpu_sum(|v| v.ipis),
        apply_samples: p.apply_samples,
        apply_p50_us: p.apply_p50_us,
        apply_p99_us: p.apply_p99_us,
        boosted_s: (p.per_vcpu.iter().map(|v| v.boosted_ms).sum::<f64>()
            + p.emulators.iter().map(|e| e.boosted_ms).sum::<f64>())
            / 1e3,
    })
}

/// One variant over every repetition: medians, spread, per-rep arrays.
pub fn variant_report(r: &Runs) -> VariantReport {
    let o = &r.outcomes;
    let col = |f: fn(&stats::Latency) -> Option<f64>| -> Vec<Option<f64>> {
        o.iter().map(|x| f(&x.latency)).collect()
    };
    let p50 = col(|l| l.p50_us);
    let p90 = col(|l| l.p90_us);
    let p99 = col(|l| l.p99_us);
    let p999 = col(|l| l.p999_us);
    let max = col(|l| l.max_us);
    let hog_it: Vec<Option<f64>> = o
        .iter()
        .map(|x| x.hog.iterations().map(|n| n as f64))
        .collect();
    let hog_rate: Vec<Option<f64>> = o.iter().map(|x| x.hog.per_s()).collect();
    let vm_cpu: Vec<Option<f64>> = o.iter().map(|x| x.hog.vm_cpu_s()).collect();
    let hog_cpu: Vec<Option<f64>> = o.iter().map(|x| x.hog.hog_cpu_s()).collect();
    let per_cpu: Vec<Option<f64>> = o
        .iter()
        .zip(&vm_cpu)
        .map(|(x, c)| {
            c.filter(|&c| c > 0.0)
                .map(|c| (x.report.events as f64 / c).round())
        })
        .collect();
    let runs = o
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let l = &x.latency;
            RunRow {
                rep: i + 1,
                p50_us: l.p50_us,
                p90_us: l.p90_us,
                p99_us: l.p99_us,
                p999_us: l.p999_us,
                max_us: l.max_us,
                samples: l.samples,
                events: x.report.events,
                lost_wakeups: x.report.lost_wakeups,
                stalls: x.report.stalls,
                stalls_injector: x.report.stalls_injector,
                inject_max_us: x.report.inject_max_us,
                start_ms: x.report.start_ms,
                loadavg_1m_before: x.loadavg_1m_before,
                hog_iterations: x.hog.iterations(),
                hog_window_s: x.hog.window_s(),
                hog_iterations_per_s: x.hog.per_s(),
                vm_cpu_s: vm_cpu[i],
                hog_cpu_s: hog_cpu[i],
                events_per_vm_cpu_s: per_cpu[i],
                policy: policy_run(x.report.policy.as_ref()),
                trace: x.trace.clone(),
            }
        })
        .collect();
    let v = &r.variant;
    VariantReport {
        workload: v.workload.name(),
        vcpus: v.vcpus,
        hogs: v.load.threads(),
        load: v.load.report(),
        policy: v.policy_name(),
        caps: v.caps_name(),
        p50_us: median(&p50),
        p90_us: median(&p90),
        p99_us: median(&p99),
        p999_us: median(&p999),
        max_us: median(&max),
        spread: Spreads {
            p50_us: Spread::of(&p50),
            p99_us: Spread::of(&p99),
            max_us: Spread::of(&max),
        },
        p50_us_reps: p50,
        p99_us_reps: p99,
        max_us_reps: max,
        samples: o.iter().map(|x| x.latency.samples).sum(),
        hog_iterations: median(&hog_it),
        hog_iterations_per_s: median(&hog_rate),
        hog_iterations_reps: hog_it,
        vm_cpu_s: median(&vm_cpu),
        hog_cpu_s: median(&hog_cpu),
        events_per_vm_cpu_s: median(&per_cpu),
        events_per_vm_cpu_s_reps: per_cpu,
        runs,
        apply_p50_us_reps: None,
        apply_p99_us_reps: None,
        decisions_reps: None,
        bpf: None,
    }
}

/// Every variant's report, by name.
type Reports = BTreeMap<&'static str, VariantReport>;

fn reports(runs: &[Runs]) -> Reports {
    runs.iter()
        .map(|r| (r.variant.name, variant_report(r)))
        .collect()
}

/// `a` over `b`, by variant name.
fn ratios(v: &Reports, a: &str, b: &str) -> Ratios {
    Ratios::of(v.get(a), v.get(b))
}

/// The reports and the pvsched/vanilla ratios into `out`.
fn put_variants(out: &mut Map<String, Value>, v: &Reports) -> Ratios {
    for (name, r) in v {
        out.insert((*name).into(), value(r));
    }
    let r = ratios(v, "pvsched", "vanilla");
    if let Value::Object(m) = value(&r) {
        out.extend(m);
    }
    r
}

/// Vanilla's loaded p99 over its idle p99 at or above which S1's load
/// shows the problem pvsched is for.
pub const LOAD_SHOWS_PROBLEM: f64 = 5.0;

/// `a`'s hog work over `b`'s: medians of iterations per second of
/// measured time (the same `--duration` in both, so the ratio of totals).
fn hog_ratio(v: &Reports, a: &str, b: &str) -> Option<f64> {
    let rate = |n: &str| v.get(n).and_then(|r| r.hog_iterations_per_s);
    ratio(rate(a), rate(b))
}

/// The largest, over repetitions, of `a`'s max over the same repetition's
/// `b` max: a repetition that misses is not averaged away. `None` if any
/// repetition lacks either.
fn worst_rep_ratio(v: &Reports, a: &str, b: &str) -> Option<f64> {
    let (a, b) = (v.get(a)?, v.get(b)?);
    if a.max_us_reps.is_empty() || a.max_us_reps.len() != b.max_us_reps.len() {
        return None;
    }
    a.max_us_reps
        .iter()
        .zip(&b.max_us_reps)
        .map(|(&x, &y)| ratio(x, y))
        .try_fold(f64::NEG_INFINITY, |m, r| Some(m.max(r?)))
}

/// The scenario's JSON fields (everything but the common header).
pub fn assemble(
    s: Scenario,
    runs: &[Runs],
    guest_hook: Option<&Value>,
) -> Result<Map<String, Value>, BenchError> {
    let mut out = Map::new();
    match s {
        Scenario::S1 | Scenario::S2 => {
            let v = reports(runs);
            let r = put_variants(&mut out, &v);
            let mut more: BTreeMap<&str, Ratios> = BTreeMap::new();
            let targets = if s == Scenario::S1 {
                more.insert("idle", ratios(&v, "idle_pvsched", "idle_vanilla"));
                let p99 = |n: &str| v.get(n).and_then(|x| x.p99_us);
                let loaded_vs_idle = ratio(p99("pvsched"), p99("idle_vanilla"));
                let vanilla_vs_idle = ratios(&v, "vanilla", "idle_vanilla");
                let shows = vanilla_vs_idle.ratio_p99;
                more.insert("vanilla_loaded_vs_idle", vanilla_vs_idle);
                more.insert(
                    "pvsched_loaded_vs_idle",
                    ratios(&v, "pvsched", "idle_vanilla"),
                );
                // Whether the load showed the problem at all: without it
                // the latency targets say little.
                out.insert("vanilla_loaded_vs_idle_p99".into(), json!(shows));
                out.insert(
                    "load_shows_problem".into(),
                    json!(shows.is_some_and(|x| x >= LOAD_SHOWS_PROBLEM)),
                );
                vec![
                    Target::at_most(
                        "s1_p99_vs_idle",
                        "loaded host: pvsched p99 <= 1.0x the idle host's p99 (idle_vanilla)",
                        loaded_vs_idle,
                        1.0,
                    ),
                    Target::at_most(
                        "s1_p99_ratio",
                        "loaded host: pvsched p99 <= 0.05x vanilla p99",
                        r.ratio_p99,
                        0.05,
                    ),
                    Target::at_most(
                        "s1_max_ratio",
                        "loaded host: pvsched max <= 0.1x vanilla max (medians over repetitions)",
                        r.ratio_max,
                        0.1,
                    ),
                    Target::at_most(
                        "s1_max_every_rep",
                        "loaded host: pvsched max <= 0.2x the same repetition's vanilla max, in every repetition (the worst)",
                        worst_rep_ratio(&v, "pvsched", "vanilla"),
                        0.2,
                    ),
                    Target::at_least(
                        "s1_host_cost",
                        "pvsched hog iterations >= 0.95x vanilla (same run, per second of measured time)",
                        hog_ratio(&v, "pvsched", "vanilla"),
                        0.95,
                    ),
                ]
            } else {
                more.insert("no_yield", ratios(&v, "no_yield", "vanilla"));
                let spin = ratios(&v, "spin_pvsched", "spin_vanilla");
                more.insert("spin", spin);
                more.insert("spin_no_yield", ratios(&v, "spin_no_yield", "spin_vanilla"));
                vec![
                    Target::at_most(
                        "ipi_p99_ratio",
                        "ipi round trip: pvsched p99 <= 0.2x vanilla p99",
                        r.ratio_p99,
                        0.2,
                    ),
                    Target::at_most(
                        "spin_p99_ratio",
                        "spin (wait_on) round trip: pvsched p99 <= 0.3x vanilla p99",
                        spin.ratio_p99,
                        0.3,
                    ),
                    Target::at_most(
                        "ipi_max_ratio",
                        "ipi round trip: pvsched max <= 1.0x the same repetition's vanilla max, in every repetition (the worst)",
                        worst_rep_ratio(&v, "pvsched", "vanilla"),
                        1.0,
                    ),
                    Target::at_most(
                        "spin_max_ratio",
                        "spin (wait_on) round trip: pvsched max <= 1.0x the same repetition's vanilla max, in every repetition (the worst)",
                        worst_rep_ratio(&v, "spin_pvsched", "spin_vanilla"),
                        1.0,
                    ),
                    Target::at_least(
                        "ipi_host_cost",
                        "ipi: pvsched hog iterations >= 0.8x vanilla (same run, per second of measured time)",
                        hog_ratio(&v, "pvsched", "vanilla"),
                        0.8,
                    ),
                ]
            };
            out.insert("ratios".into(), value(&more));
            out.insert("targets".into(), value(&targets));
        }
        Scenario::S3 => s3(runs, guest_hook, &mut out)?,
        Scenario::S5 => s5(runs, &mut out),
    }
    Ok(out)
}

/// The caps' budget and window of a pvsched run (the caps the worker ran
/// with), µs.
fn budget_window(o: &Outcome) -> (Option<u64>, Option<u64>) {
    let c = o.report.caps.as_ref();
    (c.map(|c| c.budget_us), c.map(|c| c.window_us))
}

/// One pvsched run of S5: per vCPU boosted time per budget window against
/// the budget, and the worst vCPU's share of the budget.
fn greedy_run(o: &Outcome) -> Value {
    let (budget, window) = budget_window(o);
    let budget = budget.filter(|&b| b > 0);
    let window = window.filter(|&w| w > 0);
    let policy_s = o.report.policy_s.filter(|&s| s > 0.0);
    let windows = match (policy_s, window) {
        (Some(s), Some(w)) => Some(s / (w as f64 / 1e6)),
        _ => None,
    };
    let per_vcpu: Vec<Value> = o
        .report
        .boosted_ns
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, &b)| {
            let ns = Some(b);
            let per_window_us = match (ns, windows) {
                (Some(ns), Some(w)) => Some(stats::round2(ns as f64 / 1e3 / w)),
                _ => None,
            };
            let of_budget = match (per_window_us, budget) {
                (Some(u), Some(b)) => Some((u / b as f64 * 1000.0).round() / 1000.0),
                _ => None,
            };
            let pv = o.report.policy.as_ref().and_then(|p| p.per_vcpu.get(i));
            json!({
                "index": i,
                "boosted_ns": ns,
                "boosts": pv.map(|v| v.boosts),
                "throttles": pv.map(|v| v.throttles),
                "boosted_us_per_window": per_window_us,
                "of_budget": of_budget,
            })
        })
        .collect();
    let worst = per_vcpu
        .iter()
        .filter_map(|v| v["of_budget"].as_f64())
        .reduce(f64::max);
    json!({
        "policy_s": policy_s,
        "windows": windows.map(stats::round2),
        "per_vcpu": per_vcpu,
        "worst_of_budget": worst,
    })
}

/// S5: a greedy guest beside busy hogs. Latency fields are null (the
/// guest spins; nothing is timed); what counts is the policy's boosted
/// time per budget window and the hogs' work against vanilla's.
fn s5(runs: &[Runs], out: &mut Map<String, Value>) {
    let v = reports(runs);
    put_variants(out, &v);
    let pv: Vec<&Outcome> = runs
        .iter()
        .filter(|r| r.variant.policy.enabled())
        .flat_map(|r| r.outcomes.iter())
        .collect();
    let (budget_us, window_us) = pv.first().map_or((None, None), |o| budget_window(o));
    let share = match (budget_us, window_us) {
        (Some(b), Some(w)) if b > 0 && w > 0 => Some((b as f64 / w as f64).min(1.0)),
        _ => None,
    };
    let reps: Vec<Value> = pv.iter().map(|o| greedy_run(o)).collect();
    // The budget must hold in every run: the worst repetition counts.
    let worst = reps
        .iter()
        .filter_map(|r| r["worst_of_budget"].as_f64())
        .reduce(f64::max);
    let hog = hog_ratio(&v, "pvsched", "vanilla");
    let hog_limit = share.map(|s| stats::round2(1.0 - s - 0.05));
    out.insert(
        "greedy".into(),
        json!({
            "budget_us": budget_us,
            "window_us": window_us,
            "budget_share": share,
            "reps": reps,
            "worst_of_budget": worst,
            "hog_ratio": hog,
            "what": "pvsched runs: per vCPU boosted_ns (agent ThreadStats) over the time the VM was registered (policy_s, boot + workload), per budget window (window_us), against the caps' budget_us; hog_ratio = hog iterations per second, pvsched / vanilla",
        }),
    );
    let targets = [
        Target::at_most(
            "s5_greedy_budget",
            "greedy guest: boosted on-CPU time per vCPU <= budget per window + 5% (max over vCPUs and reps of boosted_ns / windows / budget_us)",
            worst.filter(|_| share.is_some()),
            1.05,
        ),
        Target::at_least(
            "s5_hog_share",
            "hog keeps >= (1 - budget_us/window_us - 0.05) of its CPU: hog iterations pvsched / vanilla",
            hog.filter(|_| share.is_some()),
            hog_limit.unwrap_or(1.0),
        ),
    ];
    out.insert("targets".into(), value(&targets));
}

/// S5's bars: each vCPU's boosted ms per window (worst repetition) and
/// the budget in ms, or `None` without a budget.
pub fn s5_bars(j: &Value) -> (Vec<(String, f64)>, Option<f64>) {
    let mut worst: Vec<f64> = Vec::new();
    for rep in j["greedy"]["reps"].as_array().into_iter().flatten() {
        for (i, v) in rep["per_vcpu"].as_array().into_iter().flatten().enumerate() {
            let x = v["boosted_us_per_window"].as_f64().unwrap_or(0.0) / 1e3;
            match worst.get_mut(i) {
                Some(w) => *w = w.max(x),
                None => worst.push(x),
            }
        }
    }
    let bars = worst
        .into_iter()
        .enumerate()
        .map(|(i, x)| (format!("VCPU {i}"), stats::round2(x)))
        .collect();
    let budget = j["greedy"]["budget_us"]
        .as_f64()
        .filter(|b| *b > 0.0)
        .map(|b| b / 1e3);
    (bars, budget)
}

/// S3: costs. `vanilla` is all zeros (no BPF, no applier: nothing to
/// pay); `pvsched` p50/p99 is the decision→applied latency.
fn s3(
    runs: &[Runs],
    guest_hook: Option<&Value>,
    out: &mut Map<String, Value>,
) -> Result<(), BenchError> {
    let S3Runs {
        apply50,
        apply99,
        by_workload,
        totals,
    } = s3_runs(runs);
    let bpf = bpf_report(&totals);
    let worst = bpf.worst_ns_per_event;
    // The worst full path of any workload (pooling them would hide one).
    let worst_full = by_workload
        .values()
        .filter_map(|w| w.bpf.as_ref()?.worst_full_ns_per_event)
        .reduce(f64::max);
    out.insert("scaling".into(), s3_scaling(runs, &by_workload));
    out.insert(
        "vanilla".into(),
        json!({
            "p50_us": 0.0, "p99_us": 0.0, "max_us": 0.0,
            "p50_us_reps": [], "p99_us_reps": [], "max_us_reps": [],
            "what": "no policy: no BPF programs, no applier, no maps; every cost is 0",
        }),
    );
    out.insert(
        "pvsched".into(),
        json!({
            "p50_us": median(&apply50),
            "p99_us": median(&apply99),
            "max_us": null,
            "p50_us_reps": apply50,
            "p99_us_reps": apply99,
            "max_us_reps": [],
            "spread": {
                "p50_us": Spread::of(&apply50),
                "p99_us": Spread::of(&apply99),
            },
            "what": "decision -> applied latency (agent stats: BPF decision timestamp to sched_setattr done), all S3 runs; the agent keeps no max",
        }),
    );
    for k in ["ratio_p50", "ratio_p99", "ratio_max"] {
        out.insert(k.into(), Value::Null);
    }
    out.insert("bpf".into(), value(&bpf));
    out.insert("workloads".into(), value(&by_workload));
    out.insert("handshake".into(), s3_handshake(runs)?);
    out.insert("bytes_per_vcpu".into(), costs::bytes_per_vcpu());
    let hook = guest_hook
        .and_then(|j| j.get("guest_hook_ns"))
        .filter(|v| !v.is_null());
    out.insert("guest_hook_ns".into(), hook.cloned().unwrap_or(Value::Null));
    out.insert(
        "guest_hook_source".into(),
        json!(match hook {
            Some(_) => "bench/s4.py output (--s4-json)",
            None => "not measured in this scenario: the guest hook runs in the Linux guest driver (S4, bench/s4.py under QEMU TCG); pass --s4-json FILE with an S4 result that has guest_hook_ns",
        }),
    );
    let targets = [
        Target::at_most(
            "bpf_ns_per_event",
            "BPF run time per event <= 300 ns (worst program, run_time_ns / run_cnt)",
            worst,
            300.0,
        ),
        Target::at_most(
            "bpf_full_ns_per_event",
            "BPF run time per event of a registered thread <= 300 ns (worst program of any workload, prefilter included)",
            worst_full,
            300.0,
        ),
        Target::at_most(
            "apply_p50",
            "decision -> applied p50 <= 20 us",
            median(&apply50),
            20.0,
        ),
        Target::at_most(
            "apply_p99",
            "decision -> applied p99 <= 100 us",
            median(&apply99),
            100.0,
        ),
    ];
    out.insert("targets".into(), value(&targets));
    Ok(())
}

/// S3's scaling table: per workload, how many VMs were registered, the
/// BPF costs (sched_switch's prefilter and full path, the worst full
/// path) and decision→applied, medians over its runs.
fn s3_scaling(runs: &[Runs], by_workload: &Reports) -> Value {
    let rows: Vec<Value> = runs
        .iter()
        .filter_map(|r| {
            let w = by_workload.get(r.variant.name)?;
            let bpf = w.bpf.as_ref()?;
            let switch = bpf.programs.iter().find(|p| p.name == "pvs_sched_switch");
            let timer = bpf.programs.iter().find(|p| p.name == REEVAL_PROG);
            let med = |x: &Option<Vec<Option<f64>>>| x.as_deref().and_then(median);
            Some(json!({
                "workload": r.variant.name,
                "registered_vms": 1 + r.variant.extra_vms,
                "switch_prefilter_ns": switch.and_then(|p| p.prefilter_ns_per_event),
                "switch_full_ns": switch.and_then(|p| p.full_ns_per_event),
                "worst_full_ns": bpf.worst_full_ns_per_event,
                "timer_ns_per_thread": timer.and_then(|p| p.full_ns_per_event),
                "worst_ns": bpf.worst_ns_per_event,
                "apply_p50_us": med(&w.apply_p50_us_reps),
                "apply_p99_us": med(&w.apply_p99_us_reps),
                "agent_cpu": median(&r.outcomes.iter().map(|o| o.report.agent_cpu).collect::<Vec<_>>()),
            }))
        })
        .collect();
    Value::Array(rows)
}

/// What S3 gathers from its runs.
struct S3Runs {
    /// Decision→applied p50 of every rep of every workload, µs.
    apply50: Vec<Option<f64>>,
    /// ... and p99.
    apply99: Vec<Option<f64>>,
    /// Per workload: its reps and its BPF programs' costs.
    by_workload: Reports,
    /// BPF runs per program over all runs.
    totals: ProgTotals,
}

/// Per program: its runs in the measured windows and in the prefilter
/// windows, summed over runs.
#[derive(Default)]
struct ProgTotals(Vec<ProgAcc>);

#[derive(Default)]
struct ProgAcc {
    name: String,
    run: (u64, u64),
    full: Option<u64>,
    prefilter: (u64, u64),
}

impl ProgTotals {
    fn entry(&mut self, name: &str) -> &mut ProgAcc {
        let i = match self.0.iter().position(|p| p.name == name) {
            Some(i) => i,
            None => {
                self.0.push(ProgAcc {
                    name: name.to_owned(),
                    ..ProgAcc::default()
                });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    /// Adds one run's statistics.
    fn add(&mut self, report: &crate::worker::WorkerReport) {
        for s in &report.prog_stats {
            let e = self.entry(&s.name);
            e.run.0 = e.run.0.saturating_add(s.run_cnt);
            e.run.1 = e.run.1.saturating_add(s.run_time_ns);
            if let Some(f) = s.full_runs {
                e.full = Some(e.full.unwrap_or(0).saturating_add(f));
            }
        }
        for s in &report.prefilter_stats {
            let e = self.entry(&s.name);
            e.prefilter.0 = e.prefilter.0.saturating_add(s.run_cnt);
            e.prefilter.1 = e.prefilter.1.saturating_add(s.run_time_ns);
        }
    }
}

fn s3_runs(runs: &[Runs]) -> S3Runs {
    let mut all = S3Runs {
        apply50: Vec::new(),
        apply99: Vec::new(),
        by_workload: Reports::new(),
        totals: ProgTotals::default(),
    };
    for r in runs {
        let mut progs = ProgTotals::default();
        let (mut a50, mut a99, mut dec) = (Vec::new(), Vec::new(), Vec::new());
        for o in &r.outcomes {
            let p = o.report.policy.as_ref();
            a50.push(p.map(|p| p.apply_p50_us));
            a99.push(p.map(|p| p.apply_p99_us));
            dec.push(p.map(|p| p.decisions));
            progs.add(&o.report);
            all.totals.add(&o.report);
        }
        all.apply50.extend(a50.iter().copied());
        all.apply99.extend(a99.iter().copied());
        let w = VariantReport {
            apply_p50_us_reps: Some(a50),
            apply_p99_us_reps: Some(a99),
            decisions_reps: Some(dec),
            bpf: Some(bpf_report(&progs)),
            ..variant_report(r)
        };
        all.by_workload.insert(r.variant.name, w);
    }
    all
}

/// S3's handshake section: an in-process device handshake's host CPU time,
/// and the VM start times of the runs.
fn s3_handshake(runs: &[Runs]) -> Result<Value, BenchError> {
    let mut hs = costs::device_handshake_ns(1000).map_err(BenchError::Costs)?;
    let hsl = stats::latency(&mut hs);
    let starts: Vec<Option<f64>> = runs
        .iter()
        .flat_map(|r| r.outcomes.iter().map(|o| Some(o.report.start_ms)))
        .collect();
    Ok(json!({
        "device_in_process_us": { "p50": hsl.p50_us, "p99": hsl.p99_us, "max": hsl.max_us, "iterations": hsl.samples },
        "device_in_process_what": "host CPU time of a full device-region handshake (BAR2 programming, features, DRIVER_OK) against an in-process PvschedDevice, no guest",
        "vm_start_ms": median(&starts),
        "vm_start_ms_reps": starts,
        "vm_start_what": "VM build + guest boot + PCI scan + handshake + slot burst until every vCPU is in its loop (test guest under KVM's instruction emulator here)",
    }))
}

/// Per-program BPF costs (all runs, prefiltered runs, full runs) plus the
/// worst of each and the overall mean.
fn bpf_report(progs: &ProgTotals) -> BpfReport {
    let per = |c: u64, ns: f64| {
        if c == 0 {
            None
        } else {
            Some(stats::round2(ns / c as f64))
        }
    };
    let programs: Vec<ProgCost> = progs
        .0
        .iter()
        .map(|p| {
            let (n, t) = p.run;
            let pre = per(p.prefilter.0, p.prefilter.1 as f64);
            // The runs that returned at the prefilter cost what they cost
            // in the prefilter window; the rest of the time is the full
            // runs'.
            let full_ns = match (p.full, pre) {
                // Every run was a full one (the KVM tracepoints fire only
                // while a VM runs: no prefilter window for them).
                (Some(f), _) if f > 0 && f >= n => per(f, t as f64),
                (Some(f), Some(c)) if f > 0 => {
                    per(f, (t as f64 - n.saturating_sub(f) as f64 * c).max(0.0))
                }
                _ => None,
            };
            ProgCost {
                name: p.name.clone(),
                run_cnt: n,
                run_time_ns: t,
                // A run that handles several threads' events (the agent's
                // timer) is counted per thread.
                ns_per_event: per(n.max(p.full.unwrap_or(0)), t as f64),
                prefilter_ns_per_event: pre,
                full_runs: p.full,
                full_ns_per_event: full_ns,
            }
        })
        .collect();
    let worst = |f: fn(&ProgCost) -> Option<f64>| programs.iter().filter_map(f).reduce(f64::max);
    let (c, ns) = progs.0.iter().fold((0u64, 0u64), |(a, b), p| {
        (a.saturating_add(p.run.0), b.saturating_add(p.run.1))
    });
    BpfReport {
        worst_ns_per_event: worst(|p| p.ns_per_event),
        // Events on the tracepoints: the agent's timer is reported apart.
        worst_full_ns_per_event: worst(|p| p.full_ns_per_event.filter(|_| p.name != REEVAL_PROG)),
        worst_prefilter_ns_per_event: worst(|p| {
            p.prefilter_ns_per_event.filter(|_| p.name != REEVAL_PROG)
        }),
        mean_ns_per_event: per(c, ns as f64),
        programs,
    }
}

/// CDF series of the variants (all repetitions merged).
pub fn series(runs: &[Runs]) -> Vec<Series> {
    runs.iter()
        .map(|r| {
            let mut all: Vec<u64> = r
                .outcomes
                .iter()
                .flat_map(|o| o.samples.iter().copied())
                .collect();
            all.sort_unstable();
            Series {
                name: r.variant.name.to_owned(),
                points: stats::cdf(&all, 400),
                n: all.len() as f64,
            }
        })
        .collect()
}

/// S3's bars: ns/event per program over all runs.
pub fn s3_bars(j: &Value) -> Vec<(String, f64)> {
    j["bpf"]["programs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["name"].as_str()?.to_owned(), p["ns_per_event"].as_f64()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::hogs::LoadKind;

    use crate::runner::HogWork;
    use crate::worker::{ProgStat, WorkerReport};
    use pvsched_host::summary::VcpuSummary;
    use pvsched_policy::Caps;

    /// An outcome of `report` with the hogs at `hog_per_s` over 2 s.
    fn with_hogs(report: WorkerReport, hog_per_s: f64) -> Outcome {
        Outcome {
            hog: HogWork::measured((hog_per_s * 2.0) as u64, 2.0),
            ..Outcome::new(report)
        }
    }

    fn policy(vcpus: &[(u64, u64)]) -> PolicySummary {
        PolicySummary {
            decisions: 4,
            apply_samples: 2,
            apply_p50_us: 10.0,
            apply_p99_us: 50.0,
            per_vcpu: vcpus
                .iter()
                .map(|&(boosts, throttles)| VcpuSummary {
                    boosts,
                    throttles,
                    ..VcpuSummary::default()
                })
                .collect(),
            ..PolicySummary::default()
        }
    }

    fn outcome(p50: u64, p99: u64, hog_per_s: f64) -> Outcome {
        let mut samples_ns = vec![p50; 98];
        samples_ns.extend([p99, p99]);
        let report = WorkerReport {
            ok: true,
            events: 3,
            policy: Some(policy(&[(2, 1)])),
            prog_stats: vec![ProgStat {
                name: "switch".into(),
                run_cnt: 10,
                run_time_ns: 9000,
                full_runs: Some(4),
            }],
            prefilter_stats: vec![ProgStat {
                name: "switch".into(),
                run_cnt: 10,
                run_time_ns: 1000,
                full_runs: Some(0),
            }],
            start_ms: 40.0,
            samples_ns,
            ..WorkerReport::default()
        };
        with_hogs(report, hog_per_s)
    }

    const LOAD: Load = Load {
        kind: LoadKind::Busy,
        n: 2,
    };

    fn runs(s: Scenario, scale: &[(&str, u64)]) -> Vec<Runs> {
        variants(s, LOAD)
            .into_iter()
            .map(|variant| {
                let k = scale
                    .iter()
                    .find(|x| x.0 == variant.name)
                    .map_or(1, |x| x.1);
                // pvsched's hogs get 96 % of vanilla's work.
                let hog = if variant.policy.enabled() {
                    960.0
                } else {
                    1000.0
                };
                Runs {
                    variant,
                    outcomes: vec![
                        outcome(1000 * k, 100_000 * k, hog),
                        outcome(2000 * k, 90_000 * k, hog),
                    ],
                }
            })
            .collect()
    }

    #[test]
    fn s1_shape_ratios_and_targets() {
        let r = runs(Scenario::S1, &[("vanilla", 10)]);
        let j = assemble(Scenario::S1, &r, None).unwrap();
        assert_eq!(j["vanilla"]["p99_us"], 950.0);
        assert_eq!(j["pvsched"]["p99_us"], 95.0);
        assert_eq!(j["ratio_p99"], 0.1);
        assert_eq!(j["pvsched"]["p99_us_reps"], json!([100.0, 90.0]));
        assert_eq!(
            j["pvsched"]["spread"]["p50_us"],
            json!({"min": 1.0, "max": 2.0})
        );
        assert_eq!(j["pvsched"]["runs"][0]["policy"]["boosts"], 2);
        assert_eq!(j["vanilla"]["load"]["busy"], 2);
        assert_eq!(j["vanilla"]["hogs"], 2);
        assert_eq!(j["idle_vanilla"]["load"]["kind"], "none");
        assert_eq!(j["vanilla"]["hog_iterations"], 2000.0);
        assert_eq!(j["pvsched"]["runs"][1]["hog_iterations_per_s"], 960.0);
        let t = j["targets"].as_array().unwrap();
        let names: Vec<&str> = t.iter().map(|x| x["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "s1_p99_vs_idle",
                "s1_p99_ratio",
                "s1_max_ratio",
                "s1_max_every_rep",
                "s1_host_cost"
            ]
        );
        assert_eq!(t[0]["value"], 1.0);
        assert_eq!(t[0]["met"], true);
        // p99 0.1x: not the 0.05x asked.
        assert_eq!(
            (t[1]["value"].clone(), t[1]["met"].clone()),
            (json!(0.1), json!(false))
        );
        // Each repetition's max is 0.1x its vanilla's.
        assert_eq!(
            (t[3]["value"].clone(), t[3]["met"].clone()),
            (json!(0.1), json!(true))
        );
        assert_eq!(t[4]["value"], 0.96);
        assert_eq!(t[4]["limit"], 0.95);
        assert_eq!(t[4]["met"], true);
        // vanilla loaded p99 950 µs vs idle 95 µs: the load shows it.
        assert_eq!(j["vanilla_loaded_vs_idle_p99"], 10.0);
        assert_eq!(j["load_shows_problem"], true);
        assert_eq!(j["ratios"]["vanilla_loaded_vs_idle"]["ratio_p99"], 10.0);
        assert!(j["idle_vanilla"].is_object() && j["ratios"]["idle"].is_object());
        assert_eq!(series(&r).len(), 4);
        let weak = assemble(Scenario::S1, &runs(Scenario::S1, &[]), None).unwrap();
        assert_eq!(weak["load_shows_problem"], false);
    }

    /// A greedy pvsched run: 10.5 s registered, window 1 s, budget 0.2 s.
    fn greedy(boosted_ns: [u64; 2], hog_per_s: f64) -> Outcome {
        let report = WorkerReport {
            ok: true,
            policy: Some(policy(&[(3, 9), (4, 8)])),
            policy_s: Some(10.5),
            boosted_ns: Some(boosted_ns.into()),
            caps: Some(Caps {
                budget_us: 200_000,
                window_us: 1_000_000,
                ..Caps::default()
            }),
            ..WorkerReport::default()
        };
        with_hogs(report, hog_per_s)
    }

    fn s5_runs(pv: [Outcome; 2]) -> Vec<Runs> {
        let mut v = variants(Scenario::S5, LOAD).into_iter();
        let van = v.next().unwrap();
        let pvs = v.next().unwrap();
        assert!(!van.policy.enabled() && pvs.policy.enabled());
        assert_eq!(van.workload, BenchWorkload::Greedy);
        vec![
            Runs {
                variant: van,
                outcomes: vec![with_hogs(
                    WorkerReport {
                        ok: true,
                        ..WorkerReport::default()
                    },
                    1000.0,
                )],
            },
            Runs {
                variant: pvs,
                outcomes: pv.into(),
            },
        ]
    }

    #[test]
    fn s5_budget_and_hog_share() {
        // 2.1 s boosted over 10.5 windows = 200 ms per window = the budget.
        let j = assemble(
            Scenario::S5,
            &s5_runs([
                greedy([2_100_000_000, 1_050_000_000], 790.0),
                greedy([1_000_000_000, 2_205_000_000], 810.0),
            ]),
            None,
        )
        .unwrap();
        let g = &j["greedy"];
        assert_eq!(g["budget_us"], 200_000);
        assert_eq!(g["budget_share"], 0.2);
        assert_eq!(g["reps"][0]["windows"], 10.5);
        assert_eq!(
            g["reps"][0]["per_vcpu"][0]["boosted_us_per_window"],
            200_000.0
        );
        assert_eq!(g["reps"][0]["per_vcpu"][0]["of_budget"], 1.0);
        assert_eq!(g["reps"][0]["per_vcpu"][1]["of_budget"], 0.5);
        assert_eq!(g["reps"][0]["per_vcpu"][1]["throttles"], 8);
        assert_eq!(g["reps"][1]["worst_of_budget"], 1.05);
        assert_eq!(g["worst_of_budget"], 1.05);
        assert_eq!(g["hog_ratio"], 0.8);
        let t = j["targets"].as_array().unwrap();
        assert_eq!(t[0]["name"], "s5_greedy_budget");
        assert_eq!(t[0]["value"], 1.05);
        assert_eq!(t[0]["met"], true);
        assert_eq!(t[1]["name"], "s5_hog_share");
        assert_eq!(t[1]["limit"], 0.75);
        assert_eq!(t[1]["met"], true);
        assert!(j["ratio_p99"].is_null() && j["vanilla"]["p99_us"].is_null());
        let (bars, budget) = s5_bars(&Value::Object(j));
        assert_eq!(
            bars,
            vec![("VCPU 0".to_owned(), 200.0), ("VCPU 1".to_owned(), 210.0)]
        );
        assert_eq!(budget, Some(200.0));
        // Over budget, hogs starved.
        let bad = assemble(
            Scenario::S5,
            &s5_runs([greedy([4_200_000_000, 0], 500.0), greedy([0, 0], 500.0)]),
            None,
        )
        .unwrap();
        assert_eq!(bad["targets"][0]["value"], 2.0);
        assert_eq!(bad["targets"][0]["met"], false);
        assert_eq!(bad["targets"][1]["met"], false);
    }

    #[test]
    fn s2_has_no_yield_and_spin() {
        let j = assemble(
            Scenario::S2,
            &runs(Scenario::S2, &[("spin_vanilla", 4)]),
            None,
        )
        .unwrap();
        assert!(j["no_yield"]["p99_us"].is_number());
        assert_eq!(j["ratios"]["spin"]["ratio_p50"], 0.25);
        let t = &j["targets"];
        assert_eq!(
            (t[1]["name"].clone(), t[1]["met"].clone()),
            (json!("spin_p99_ratio"), json!(true))
        );
        // Every repetition's spin max is 0.25x its vanilla's.
        assert_eq!(t[3]["value"], 0.25);
        // The ipi hogs keep 0.96 of vanilla's work.
        assert_eq!(
            (t[4]["name"].clone(), t[4]["value"].clone()),
            (json!("ipi_host_cost"), json!(0.96))
        );
        assert_eq!(t[4]["met"], true);
    }

    #[test]
    fn s3_costs() {
        let hook = json!({"guest_hook_ns": 420});
        let j = assemble(Scenario::S3, &runs(Scenario::S3, &[]), Some(&hook)).unwrap();
        assert_eq!(j["vanilla"]["p99_us"], 0.0);
        assert_eq!(j["pvsched"]["p50_us"], 10.0);
        assert!(j["ratio_p99"].is_null());
        assert_eq!(j["bpf"]["worst_ns_per_event"], 900.0);
        assert_eq!(j["bpf"]["programs"][0]["run_cnt"], 80);
        // 100 ns per prefiltered run; the 6 others of each 10 leave
        // 9000 - 600 ns to the 4 full runs.
        let w = &j["workloads"]["ipi_64vms"]["bpf"];
        assert_eq!(w["programs"][0]["prefilter_ns_per_event"], 100.0);
        assert_eq!(w["programs"][0]["full_ns_per_event"], 2100.0);
        assert_eq!(w["worst_full_ns_per_event"], 2100.0);
        let scaling: Vec<u64> = j["scaling"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["registered_vms"].as_u64().unwrap())
            .collect();
        assert_eq!(scaling, [1, 1, 16, 64]);
        assert_eq!(j["scaling"][3]["switch_full_ns"], Value::Null);
        assert_eq!(j["targets"][0]["met"], false);
        assert_eq!(j["targets"][1]["met"], false);
        assert_eq!(j["targets"][2]["met"], true);
        assert_eq!(j["guest_hook_ns"], 420);
        assert!(j["handshake"]["device_in_process_us"]["p50"].is_number());
        assert_eq!(
            s3_bars(&Value::Object(j)),
            vec![("switch".to_owned(), 900.0)]
        );
        let none = assemble(Scenario::S3, &runs(Scenario::S3, &[]), None).unwrap();
        assert!(none["guest_hook_ns"].is_null());
    }
}
