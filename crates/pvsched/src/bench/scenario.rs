//! Scenarios S1–S3: which variants run (in the order they are interleaved
//! within a repetition), and how their runs become the bench JSON:
//! medians over repetitions, spread, ratios pvsched/vanilla and targets.

use super::BenchError;
use super::costs;
use super::plot::Series;
use super::runner::{self, Outcome, RunOpts, Variant};
use super::stats::{self, median, ratio, spread};
use super::worker::BenchWorkload;
use serde_json::{Map, Value, json};

/// S1–S3 (S4 is `bench/s4.py`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Wakeup latency, loaded host vs idle host.
    S1,
    /// IPI / spin round trips, vCPUs > pCPUs.
    S2,
    /// Costs.
    S3,
}

impl Scenario {
    /// `s1`, `s2`, `s3`.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::S1 => "s1",
            Scenario::S2 => "s2",
            Scenario::S3 => "s3",
        }
    }
}

fn v(
    name: &'static str,
    workload: BenchWorkload,
    vcpus: u32,
    policy: bool,
    no_yield: bool,
    hogs: usize,
) -> Variant {
    Variant {
        name,
        workload,
        vcpus,
        policy,
        no_yield,
        hogs,
    }
}

/// The variants of `s`, in run order within a repetition; `hogs` CPU hogs
/// load the host (as many as pCPUs by default).
pub fn variants(s: Scenario, hogs: usize) -> Vec<Variant> {
    use BenchWorkload::*;
    match s {
        Scenario::S1 => vec![
            v("vanilla", Wakeup, 2, false, false, hogs),
            v("pvsched", Wakeup, 2, true, false, hogs),
            v("idle_vanilla", Wakeup, 2, false, false, 0),
            v("idle_pvsched", Wakeup, 2, true, false, 0),
        ],
        Scenario::S2 => vec![
            v("vanilla", Ipi, 4, false, false, hogs),
            v("pvsched", Ipi, 4, true, false, hogs),
            v("no_yield", Ipi, 4, true, true, hogs),
            v("spin_vanilla", Spin, 4, false, false, hogs),
            v("spin_pvsched", Spin, 4, true, false, hogs),
            v("spin_no_yield", Spin, 4, true, true, hogs),
        ],
        Scenario::S3 => vec![
            v("wakeup", Wakeup, 2, true, false, hogs),
            v("ipi", Ipi, 4, true, false, hogs),
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
            let o = runner::run(&r.variant, opts)?;
            let l = &o.latency;
            eprintln!(
                "[{} rep {rep}/{reps}] {:<14} p50 {:>8} p99 {:>9} max {:>9} µs  ({} samples{})",
                scenario.name(),
                r.variant.name,
                fmt(l.p50_us),
                fmt(l.p99_us),
                fmt(l.max_us),
                l.samples,
                policy_brief(&o.json)
            );
            r.outcomes.push(o);
        }
    }
    Ok(all)
}

fn fmt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

fn policy_brief(j: &Value) -> String {
    let p = &j["policy"];
    if p.is_null() {
        return String::new();
    }
    let s = policy_summary(p);
    format!(
        ", boosts {}, throttles {}, apply p50 {} p99 {} µs",
        s["boosts"], s["throttles"], s["apply_p50_us"], s["apply_p99_us"]
    )
}

/// The per-run policy numbers: sums over vCPUs plus the VM's totals.
fn policy_summary(p: &Value) -> Value {
    if p.is_null() {
        return Value::Null;
    }
    let sum = |k: &str| -> u64 {
        p["per_vcpu"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v[k].as_u64()).sum())
            .unwrap_or(0)
    };
    json!({
        "decisions": p["decisions"],
        "dropped": p["dropped"],
        "boosts": sum("boosts"),
        "boosts_applied": sum("boosts_applied"),
        "throttles": sum("throttles"),
        "slot_hits": sum("slot_hits"),
        "ipis": sum("ipis"),
        "apply_samples": p["apply_samples"],
        "apply_p50_us": p["apply_p50_us"],
        "apply_p99_us": p["apply_p99_us"],
    })
}

/// One variant's object: medians over repetitions, spread, per-rep arrays.
pub fn variant_json(r: &Runs) -> Value {
    let o = &r.outcomes;
    let col = |f: fn(&stats::Latency) -> Option<f64>| -> Vec<Option<f64>> {
        o.iter().map(|x| f(&x.latency)).collect()
    };
    let p50 = col(|l| l.p50_us);
    let p90 = col(|l| l.p90_us);
    let p99 = col(|l| l.p99_us);
    let p999 = col(|l| l.p999_us);
    let max = col(|l| l.max_us);
    let sp = |v: &[Option<f64>]| spread(v).map(|(lo, hi)| json!({ "min": lo, "max": hi }));
    let runs: Vec<Value> = o
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let l = &x.latency;
            json!({
                "rep": i + 1,
                "p50_us": l.p50_us, "p90_us": l.p90_us, "p99_us": l.p99_us,
                "p999_us": l.p999_us, "max_us": l.max_us, "samples": l.samples,
                "events": x.json["events"], "lost_wakeups": x.json["lost_wakeups"],
                "start_ms": x.json["start_ms"],
                "loadavg_1m_before": x.json["loadavg_1m_before"],
                "policy": policy_summary(&x.json["policy"]),
            })
        })
        .collect();
    let v = &r.variant;
    json!({
        "workload": format!("{:?}", v.workload).to_lowercase(),
        "vcpus": v.vcpus,
        "hogs": v.hogs,
        "policy": v.policy_name(),
        "caps": v.caps_name(),
        "p50_us": median(&p50),
        "p90_us": median(&p90),
        "p99_us": median(&p99),
        "p999_us": median(&p999),
        "max_us": median(&max),
        "p50_us_reps": p50,
        "p99_us_reps": p99,
        "max_us_reps": max,
        "spread": { "p50_us": sp(&p50), "p99_us": sp(&p99), "max_us": sp(&max) },
        "samples": o.iter().map(|x| x.latency.samples).sum::<usize>(),
        "runs": runs,
    })
}

/// `{ratio_p50, ratio_p99, ratio_max}` of `a` over `b`.
pub fn ratios(a: &Value, b: &Value) -> Value {
    let r = |k: &str| ratio(a[k].as_f64(), b[k].as_f64());
    json!({ "ratio_p50": r("p50_us"), "ratio_p99": r("p99_us"), "ratio_max": r("max_us") })
}

/// A target: `value <= limit`.
pub fn target(name: &str, goal: &str, value: Option<f64>, limit: f64) -> Value {
    json!({
        "name": name,
        "goal": goal,
        "limit": limit,
        "value": value,
        "met": value.is_some_and(|v| v <= limit),
    })
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
            for r in runs {
                out.insert(r.variant.name.into(), variant_json(r));
            }
            let r = ratios(&out["pvsched"], &out["vanilla"]);
            for k in ["ratio_p50", "ratio_p99", "ratio_max"] {
                out.insert(k.into(), r[k].clone());
            }
            let mut more = Map::new();
            let mut targets = Vec::new();
            if s == Scenario::S1 {
                more.insert(
                    "idle".into(),
                    ratios(&out["idle_pvsched"], &out["idle_vanilla"]),
                );
                let loaded_vs_idle = ratio(
                    out["pvsched"]["p99_us"].as_f64(),
                    out["idle_vanilla"]["p99_us"].as_f64(),
                );
                more.insert(
                    "vanilla_loaded_vs_idle".into(),
                    ratios(&out["vanilla"], &out["idle_vanilla"]),
                );
                more.insert(
                    "pvsched_loaded_vs_idle".into(),
                    ratios(&out["pvsched"], &out["idle_vanilla"]),
                );
                targets.push(target(
                    "p99_ratio",
                    "loaded host: pvsched p99 <= 0.2x vanilla p99",
                    r["ratio_p99"].as_f64(),
                    0.2,
                ));
                targets.push(target(
                    "max_ratio",
                    "loaded host: pvsched max <= 0.2x vanilla max",
                    r["ratio_max"].as_f64(),
                    0.2,
                ));
                targets.push(target(
                    "loaded_vs_idle_p99",
                    "pvsched p99 on the loaded host <= 1.5x the idle host's p99 (vanilla, idle)",
                    loaded_vs_idle,
                    1.5,
                ));
            } else {
                more.insert("no_yield".into(), ratios(&out["no_yield"], &out["vanilla"]));
                let spin = ratios(&out["spin_pvsched"], &out["spin_vanilla"]);
                more.insert("spin".into(), spin.clone());
                more.insert(
                    "spin_no_yield".into(),
                    ratios(&out["spin_no_yield"], &out["spin_vanilla"]),
                );
                targets.push(target(
                    "ipi_p99_ratio",
                    "ipi round trip: pvsched p99 <= 0.5x vanilla p99",
                    r["ratio_p99"].as_f64(),
                    0.5,
                ));
                targets.push(target(
                    "spin_p99_ratio",
                    "spin (wait_on) round trip: pvsched p99 <= 0.5x vanilla p99",
                    spin["ratio_p99"].as_f64(),
                    0.5,
                ));
            }
            out.insert("ratios".into(), Value::Object(more));
            out.insert("targets".into(), Value::Array(targets));
        }
        Scenario::S3 => s3(runs, guest_hook, &mut out)?,
    }
    Ok(out)
}

/// S3: costs. `vanilla` is all zeros (no BPF, no applier: nothing to
/// pay); `pvsched` p50/p99 is the decision→applied latency.
fn s3(
    runs: &[Runs],
    guest_hook: Option<&Value>,
    out: &mut Map<String, Value>,
) -> Result<(), BenchError> {
    let mut apply50 = Vec::new();
    let mut apply99 = Vec::new();
    let mut by_workload = Map::new();
    let mut totals: Vec<(String, u64, u64)> = Vec::new();
    for r in runs {
        let mut progs: Vec<(String, u64, u64)> = Vec::new();
        let (mut a50, mut a99, mut dec) = (Vec::new(), Vec::new(), Vec::new());
        for o in &r.outcomes {
            let p = &o.json["policy"];
            a50.push(p["apply_p50_us"].as_f64());
            a99.push(p["apply_p99_us"].as_f64());
            dec.push(p["decisions"].clone());
            for s in o.json["prog_stats"].as_array().into_iter().flatten() {
                let name = s["name"].as_str().unwrap_or("?").to_owned();
                let (c, ns) = (
                    s["run_cnt"].as_u64().unwrap_or(0),
                    s["run_time_ns"].as_u64().unwrap_or(0),
                );
                for list in [&mut progs, &mut totals] {
                    match list.iter_mut().find(|x| x.0 == name) {
                        Some(x) => {
                            x.1 = x.1.saturating_add(c);
                            x.2 = x.2.saturating_add(ns);
                        }
                        None => list.push((name.clone(), c, ns)),
                    }
                }
            }
        }
        apply50.extend(a50.iter().copied());
        apply99.extend(a99.iter().copied());
        let mut w = variant_json(r);
        if let Some(o) = w.as_object_mut() {
            o.insert("apply_p50_us_reps".into(), json!(a50));
            o.insert("apply_p99_us_reps".into(), json!(a99));
            o.insert("decisions_reps".into(), json!(dec));
            o.insert("bpf".into(), progs_json(&progs));
        }
        by_workload.insert(r.variant.name.into(), w);
    }
    let bpf = progs_json(&totals);
    let worst = bpf["worst_ns_per_event"].as_f64();
    let hs = costs::device_handshake_ns(1000).map_err(BenchError::Costs)?;
    let mut hs = hs;
    let hsl = stats::latency(&mut hs);
    let starts: Vec<Option<f64>> = runs
        .iter()
        .flat_map(|r| r.outcomes.iter().map(|o| o.json["start_ms"].as_f64()))
        .collect();
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
                "p50_us": spread(&apply50).map(|(a, b)| json!({"min": a, "max": b})),
                "p99_us": spread(&apply99).map(|(a, b)| json!({"min": a, "max": b})),
            },
            "what": "decision -> applied latency (agent stats: BPF decision timestamp to sched_setattr done), all S3 runs; the agent keeps no max",
        }),
    );
    for k in ["ratio_p50", "ratio_p99", "ratio_max"] {
        out.insert(k.into(), Value::Null);
    }
    out.insert("bpf".into(), bpf);
    out.insert("workloads".into(), Value::Object(by_workload));
    out.insert(
        "handshake".into(),
        json!({
            "device_in_process_us": { "p50": hsl.p50_us, "p99": hsl.p99_us, "max": hsl.max_us, "iterations": hsl.samples },
            "device_in_process_what": "host CPU time of a full device-region handshake (BAR2 programming, features, DRIVER_OK) against an in-process PvschedDevice, no guest",
            "vm_start_ms": median(&starts),
            "vm_start_ms_reps": starts,
            "vm_start_what": "VM build + guest boot + PCI scan + handshake + slot burst until every vCPU is in its loop (test guest under KVM's instruction emulator here)",
        }),
    );
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
    let a50 = out["pvsched"]["p50_us"].as_f64();
    let a99 = out["pvsched"]["p99_us"].as_f64();
    out.insert(
        "targets".into(),
        json!([
            target(
                "bpf_ns_per_event",
                "BPF run time per event <= 300 ns (worst program, run_time_ns / run_cnt)",
                worst,
                300.0
            ),
            target("apply_p50", "decision -> applied p50 <= 20 us", a50, 20.0),
            target("apply_p99", "decision -> applied p99 <= 100 us", a99, 100.0),
        ]),
    );
    Ok(())
}

/// Per-program BPF costs plus the worst and the overall mean.
fn progs_json(progs: &[(String, u64, u64)]) -> Value {
    let per = |c: u64, ns: u64| {
        if c == 0 {
            None
        } else {
            Some(stats::round2(ns as f64 / c as f64))
        }
    };
    let list: Vec<Value> = progs
        .iter()
        .map(|(n, c, ns)| json!({ "name": n, "run_cnt": c, "run_time_ns": ns, "ns_per_event": per(*c, *ns) }))
        .collect();
    let worst = progs
        .iter()
        .filter_map(|(_, c, ns)| per(*c, *ns))
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    let (c, ns) = progs.iter().fold((0u64, 0u64), |(a, b), (_, c, ns)| {
        (a.saturating_add(*c), b.saturating_add(*ns))
    });
    json!({ "programs": list, "worst_ns_per_event": worst, "mean_ns_per_event": per(c, ns) })
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

    fn outcome(p50: u64, p99: u64) -> Outcome {
        let text = format!(
            r#"{{"ok":true,"events":3,"policy":{{"decisions":4,"dropped":0,"apply_samples":2,"apply_p50_us":10.0,"apply_p99_us":50.0,"per_vcpu":[{{"boosts":2,"throttles":1}}]}},"prog_stats":[{{"name":"switch","run_cnt":10,"run_time_ns":9000}}],"start_ms":40.0,"samples_ns":[{}]}}"#,
            std::iter::repeat_n(p50.to_string(), 98)
                .chain([p99.to_string(), p99.to_string()])
                .collect::<Vec<_>>()
                .join(",")
        );
        runner::parse(&text).unwrap()
    }

    fn runs(s: Scenario, scale: &[(&str, u64)]) -> Vec<Runs> {
        variants(s, 2)
            .into_iter()
            .map(|variant| {
                let k = scale
                    .iter()
                    .find(|x| x.0 == variant.name)
                    .map_or(1, |x| x.1);
                Runs {
                    variant,
                    outcomes: vec![
                        outcome(1000 * k, 100_000 * k),
                        outcome(2000 * k, 90_000 * k),
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
        let t = j["targets"].as_array().unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t[0]["met"], true);
        assert_eq!(t[2]["value"], 1.0);
        assert!(j["idle_vanilla"].is_object() && j["ratios"]["idle"].is_object());
        assert_eq!(series(&r).len(), 4);
    }

    #[test]
    fn s2_has_no_yield_and_spin() {
        let j = assemble(
            Scenario::S2,
            &runs(Scenario::S2, &[("spin_vanilla", 3)]),
            None,
        )
        .unwrap();
        assert!(j["no_yield"]["p99_us"].is_number());
        assert_eq!(j["ratios"]["spin"]["ratio_p50"], 0.333);
        assert_eq!(j["targets"][1]["met"], true);
    }

    #[test]
    fn s3_costs() {
        let hook = json!({"guest_hook_ns": 420});
        let j = assemble(Scenario::S3, &runs(Scenario::S3, &[]), Some(&hook)).unwrap();
        assert_eq!(j["vanilla"]["p99_us"], 0.0);
        assert_eq!(j["pvsched"]["p50_us"], 10.0);
        assert!(j["ratio_p99"].is_null());
        assert_eq!(j["bpf"]["worst_ns_per_event"], 900.0);
        assert_eq!(j["bpf"]["programs"][0]["run_cnt"], 40);
        assert_eq!(j["targets"][0]["met"], false);
        assert_eq!(j["targets"][1]["met"], true);
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
