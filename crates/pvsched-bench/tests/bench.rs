//! `pvsched-bench` end to end: `pvsched-bench s1
//! --quick --json -` boots the reference VMM on real KVM with and without
//! the embedded BPF policy, beside CPU hogs and on an idle host, measures
//! the idle host's floor with cyclictest, exits 0 and prints one JSON
//! report with the documented shape. Asserts on the shape, on every
//! repetition being counted and on verdicts being computed, never on how
//! fast anything was or which verdict came out (benchmarks measure, tests
//! don't time).
//!
//! Needs root, /dev/kvm and BPF; without them it prints `SKIP` (or fails
//! under `PVSCHED_REQUIRE_REAL=1`). The exit-code test needs nothing.

use pvsched_testkit::skip_or_fail;
use serde_json::Value;
use std::process::Command;

fn pvsched() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pvsched-bench"))
}

/// Runs `pvsched-bench` with `cmd` (which prints the JSON on stdout) as
/// root and returns the one JSON object it printed; `None` (SKIP, or a
/// failure under `PVSCHED_REQUIRE_REAL=1`) when the bench says KVM or BPF
/// is missing (its exit codes 3, 4 and 6, passed through from the run).
fn bench_json(test: &str, cmd: &mut Command) -> Option<Value> {
    if !pvsched_testkit::root(test, "the BPF policy") {
        return None;
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if matches!(out.status.code(), Some(3 | 4 | 6)) {
        skip_or_fail(test, &format!("KVM or BPF is unusable: {stderr}"));
        return None;
    }
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
    Some(
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON object: {e}\n{stderr}")),
    )
}

/// The sum of a `{name: count}` object's counts.
fn total(counts: &Value) -> u64 {
    counts
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum()
}

fn is_num(v: &Value) -> bool {
    v.as_f64().is_some()
}

/// Every verdict is one of the three words.
fn is_verdict(v: &Value) -> bool {
    matches!(v.as_str(), Some("met" | "not_met" | "unresolved"))
}

/// Each target names itself, says what it asks and carries a verdict
/// computed from n judged repetitions; returns their names.
fn targets(j: &Value) -> Vec<&str> {
    let t = j["targets"].as_array().unwrap();
    for t in t {
        assert!(t["name"].is_string() && t["goal"].is_string(), "{t}");
        assert!(is_verdict(&t["verdict"]), "{t}");
        assert!(
            t["n"].as_u64().is_some() && t["failed"].as_u64().is_some(),
            "{t}"
        );
    }
    t.iter().map(|t| t["name"].as_str().unwrap()).collect()
}

/// The run order of every step of repetition `rep` (0-based) of `j`:
/// each step once, 0..k.
fn orders(j: &Value, rep: usize) -> Vec<u64> {
    let mut o: Vec<u64> = j["variants"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v["runs"][rep]["order"].as_u64().unwrap())
        .chain(j["floor"]["runs"][rep]["order"].as_u64())
        .collect();
    o.sort_unstable();
    o
}

#[test]
fn s1_quick_prints_the_bench_json() {
    let dir = std::env::temp_dir().join(format!("pvsched-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("s1.png");
    let Some(j) = bench_json(
        "s1_quick_prints_the_bench_json",
        pvsched()
            .args(["s1", "--quick", "--json", "-", "--plot"])
            .arg(&png),
    ) else {
        return;
    };
    assert_eq!(j["scenario"], "s1");
    assert_eq!(j["options"]["quick"], true);
    assert_eq!(j["options"]["reps"], 1);
    assert_eq!(j["options"]["floor"], true);
    assert!(j["machine"]["cpus"].as_u64().unwrap() >= 1);
    assert!(j["machine"]["kernel"].is_string());
    let v = &j["variants"];
    for name in ["vanilla", "pvsched", "idle_vanilla", "idle_pvsched"] {
        let v = &v[name];
        assert_eq!(
            (v["n"].as_u64(), v["failed"].as_u64()),
            (Some(1), Some(0)),
            "{name}"
        );
        for k in ["p50_us", "p99_us", "max_us"] {
            assert!(is_num(&v[k]), "{name}.{k}: {v}");
        }
        assert_eq!(v["runs"].as_array().unwrap().len(), 1, "{name}");
        assert!(v["runs"][0]["error"].is_null(), "{name}");
        assert!(v["samples"].as_u64().unwrap() > 0, "{name} has samples");
    }
    // The four variants and the floor each ran once in the repetition.
    assert_eq!(orders(&j, 0), [0, 1, 2, 3, 4]);
    assert_eq!(v["vanilla"]["policy"], "none");
    assert_eq!(v["pvsched"]["policy"], "embedded");
    // The policy really ran in the pvsched variant: it made decisions.
    assert!(
        v["pvsched"]["runs"][0]["policy"]["decisions"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(v["vanilla"]["runs"][0]["policy"].is_null());
    // The idle host's floor, measured in the repetition.
    let floor = &j["floor"];
    assert_eq!(
        (floor["n"].as_u64(), floor["failed"].as_u64()),
        (Some(1), Some(0))
    );
    assert!(is_num(&floor["runs"][0]["max_us"]), "{floor}");
    assert!(floor["runs"][0]["samples"].as_u64().unwrap() > 0, "{floor}");
    // Ratios are paired per repetition: one pair each.
    for (name, k) in [
        ("pvsched", "p50_us"),
        ("pvsched", "p99_us"),
        ("pvsched", "max_us"),
        ("idle", "p99_us"),
        ("vanilla_loaded_vs_idle", "p99_us"),
    ] {
        let p = &j["ratios"][name][k];
        assert_eq!(
            (p["n"].as_u64(), p["failed"].as_u64()),
            (Some(1), Some(0)),
            "{name}.{k}: {p}"
        );
        assert!(is_num(&p["ratio"]), "{name}.{k}: {p}");
    }
    // The load: busy hogs by default, two per online CPU, each run with
    // the hogs' work counted (present, not how much).
    let cpus = j["machine"]["cpus"].as_u64().unwrap();
    assert_eq!(j["options"]["load"], "busy");
    assert_eq!(j["options"]["hogs"].as_u64().unwrap(), 2 * cpus);
    for name in ["vanilla", "pvsched"] {
        let v = &v[name];
        assert_eq!(v["load"]["busy"].as_u64().unwrap(), 2 * cpus, "{name}");
        assert!(
            v["runs"][0]["hog_iterations"].as_u64().unwrap() > 0,
            "{name}"
        );
        assert!(is_num(&v["runs"][0]["hog_iterations_per_s"]), "{name}");
        assert!(is_num(&v["hog_iterations_per_s"]), "{name}");
        // The busy hogs ran the whole measured time: CPU time counted.
        assert!(v["runs"][0]["hog_cpu_s"].as_f64().unwrap() > 0.0, "{name}");
    }
    for name in ["vanilla", "pvsched", "idle_vanilla", "idle_pvsched"] {
        // The VM's vCPUs ran the workload: its CPU time, and the events
        // per CPU-second, are there.
        let run = &v[name]["runs"][0];
        assert!(run["vm_cpu_s"].as_f64().unwrap() > 0.0, "{name}");
        assert!(run["events_per_vm_cpu_s"].as_f64().unwrap() > 0.0, "{name}");
    }
    for name in ["idle_vanilla", "idle_pvsched"] {
        assert_eq!(v[name]["load"]["kind"], "none", "{name}");
        assert!(v[name]["runs"][0]["hog_iterations"].is_null(), "{name}");
        assert!(v[name]["runs"][0]["hog_cpu_s"].is_null(), "{name}");
    }
    // Whether the load showed the problem is judged, whatever it was.
    assert!(is_verdict(&j["load_shows_problem"]));
    assert_eq!(
        targets(&j),
        [
            "s1_p99_vs_idle",
            "s1_p99_ratio",
            "s1_max_ratio",
            "s1_max_every_rep",
            "s1_max_vs_floor",
            "s1_max_vs_loaded_floor",
            "s1_host_cost"
        ]
    );
    // One repetition: a paired interval needs two, so a paired target is
    // unresolved; the every-repetition targets are judged.
    let t = j["targets"].as_array().unwrap();
    assert_eq!(t[1]["verdict"], "unresolved", "{}", t[1]);
    assert_ne!(t[4]["verdict"], "unresolved", "{}", t[4]);
    assert!(is_num(&t[4]["value"]), "{}", t[4]);
    let png = std::fs::read(&png).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// S2: the IPI and spin variants with and without the yield boost, and
/// the idle host's floor, each once in the repetition.
#[test]
fn s2_quick_pairs_every_variant_and_measures_the_floor() {
    let Some(j) = bench_json(
        "s2_quick_pairs_every_variant_and_measures_the_floor",
        pvsched().args(["s2", "--quick", "--json", "-"]),
    ) else {
        return;
    };
    assert_eq!(j["scenario"], "s2");
    for name in [
        "vanilla",
        "pvsched",
        "no_yield",
        "spin_vanilla",
        "spin_pvsched",
        "spin_no_yield",
    ] {
        let v = &j["variants"][name];
        assert_eq!(
            (v["n"].as_u64(), v["failed"].as_u64()),
            (Some(1), Some(0)),
            "{name}"
        );
        assert!(is_num(&v["p99_us"]), "{name}: {v}");
    }
    assert_eq!(orders(&j, 0), [0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(j["floor"]["n"], 1);
    assert!(is_num(&j["floor"]["runs"][0]["max_us"]));
    for name in ["pvsched", "no_yield", "spin", "spin_no_yield"] {
        assert_eq!(j["ratios"][name]["p99_us"]["n"], 1, "{name}");
    }
    assert_eq!(
        targets(&j),
        [
            "ipi_p99_ratio",
            "spin_p99_ratio",
            "ipi_max_ratio",
            "spin_max_ratio",
            "ipi_host_cost"
        ]
    );
}

/// Without cyclictest the floor cannot be measured: the bench cannot run
/// (exit 9, like any program it needs), said before any run.
#[test]
fn a_missing_cyclictest_stops_the_bench_before_any_run() {
    let empty = std::env::temp_dir().join(format!("pvsched-bench-nopath-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = pvsched()
        .env("PATH", &empty)
        .args(["s1", "--quick", "--json", "-"])
        .output()
        .unwrap();
    std::fs::remove_dir_all(&empty).unwrap();
    assert_eq!(out.status.code(), Some(9));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cyclictest") && stderr.contains("--no-floor"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}

/// `--trace`: the chosen variants' runs are recorded on the real tracefs
/// and each run's JSON names its vCPU threads' waits over 1 ms by cause.
/// The loaded vanilla run's vCPU threads compete with eight busy hogs at
/// SCHED_OTHER (four per CPU of a 2-CPU host: with S1's default two per
/// CPU a 2 s run once had no wait over 1 ms, when the scheduler let each
/// wake-up preempt), so it has such waits, unboosted (the test's own load
/// causes them); the idle variants, not chosen, are not traced; no
/// tracefs instance is left behind, nor one a killed bench left.
#[test]
fn s1_quick_trace_names_the_stalls_of_each_run() {
    let test = "s1_quick_trace_names_the_stalls_of_each_run";
    if Command::new("python3").arg("--version").output().is_err() {
        skip_or_fail(test, "no python3 for pvsched_bench stall-trace");
        return;
    }
    let dir = std::env::temp_dir().join(format!("pvsched-bench-trace-{}", std::process::id()));
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // An instance left by a bench that was killed (no such PID): removed.
    // (Creating it needs root; without root the bench skips anyway.)
    let _ = std::fs::create_dir("/sys/kernel/tracing/instances/pvsched-bench-999999999-0");
    let Some(j) = bench_json(
        test,
        pvsched()
            .args(["s1", "--quick", "--json", "-", "--trace-buffer-mb", "64"])
            .args(["--hogs", "8"])
            .arg("--no-floor")
            .args(["--trace-variants", "vanilla,pvsched", "--trace"])
            .arg(&dir)
            .arg("--repo")
            .arg(&repo),
    ) else {
        return;
    };
    // --no-floor: no floor, and the floor target cannot tell.
    assert!(j["floor"].is_null());
    assert_eq!(j["options"]["floor"], false);
    let vs_floor = &j["targets"][4];
    assert_eq!(vs_floor["name"], "s1_max_vs_floor");
    assert_eq!(vs_floor["verdict"], "unresolved");
    let j = &j["variants"];
    for v in ["vanilla", "pvsched"] {
        let t = &j[v]["runs"][0]["trace"];
        assert_eq!(t["over_us"], 1000, "{v}: {t}");
        assert!(t["overrun"].as_u64().is_some(), "{v}: {t}");
        let waits = t["waits"].as_u64().unwrap();
        let by_cause = total(&t["causes"]);
        assert_eq!(waits, by_cause, "{v}: {t}");
        let file = std::path::PathBuf::from(t["file"].as_str().unwrap());
        assert_eq!(file, dir.join(format!("s1-rep1-{v}.trace")));
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("sched_switch:"), "{v}");
        assert!(file.with_extension("stalls.json").is_file(), "{v}");
    }
    let vanilla = &j["vanilla"]["runs"][0]["trace"];
    assert!(
        vanilla["causes"]["unboosted"].as_u64().unwrap_or(0) > 0,
        "the loaded vanilla vCPUs waited behind the hogs: {vanilla}"
    );
    // Every stalled sample of each traced run is named, one cause each.
    for v in ["vanilla", "pvsched"] {
        let run = &j[v]["runs"][0];
        let s = &run["trace"]["samples"];
        let stalls = run["stalls"].as_u64().unwrap();
        if stalls == 0 {
            assert!(s.is_null(), "{v}: {s}");
            continue;
        }
        assert_eq!(s["stalls"].as_u64().unwrap(), stalls, "{v}: {s}");
        let named = total(&s["causes"]);
        assert_eq!(named, stalls, "{v}: {s}");
    }
    assert!(
        j["vanilla"]["runs"][0]["stalls"].as_u64().unwrap() > 0,
        "the hogs delay vanilla's wake-ups past 1 ms"
    );
    for v in ["idle_vanilla", "idle_pvsched"] {
        assert!(j[v]["runs"][0].get("trace").is_none(), "{v} not chosen");
    }
    let left: Vec<String> = std::fs::read_dir("/sys/kernel/tracing/instances")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("pvsched-bench-"))
        .collect();
    assert!(left.is_empty(), "instances left: {left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// S5: the greedy guest beside busy hogs, vanilla and pvsched; the JSON
/// carries what its two targets need. Skips if this build's test guest
/// has no `greedy` workload.
#[test]
fn s5_quick_reports_budget_and_hog_share() {
    let Some(j) = bench_json(
        "s5_quick_reports_budget_and_hog_share",
        pvsched().args(["s5", "--quick", "--json", "-"]),
    ) else {
        return;
    };
    assert_eq!(j["scenario"], "s5");
    assert_eq!(j["options"]["load"], "busy");
    assert_eq!(j["options"]["hogs"], j["machine"]["cpus"]);
    // No latency tail to judge: no floor.
    assert!(j["floor"].is_null());
    let v = &j["variants"];
    assert_eq!(v["vanilla"]["workload"], "greedy");
    assert_eq!(v["vanilla"]["policy"], "none");
    assert_eq!(v["pvsched"]["policy"], "embedded");
    for name in ["vanilla", "pvsched"] {
        assert!(
            v[name]["runs"][0]["hog_iterations"].as_u64().unwrap() > 0,
            "{name}"
        );
    }
    assert_eq!(j["ratios"]["pvsched"]["hog_iterations_per_s"]["n"], 1);
    let g = &j["greedy"];
    assert_eq!(g["budget_us"], pvsched_policy::Caps::default().budget_us);
    assert_eq!(g["window_us"], pvsched_policy::Caps::default().window_us);
    assert!(is_num(&g["budget_share"]));
    let rep = &g["reps"][0];
    assert!(is_num(&rep["policy_s"]) && is_num(&rep["windows"]));
    let vcpus = rep["per_vcpu"].as_array().unwrap();
    assert_eq!(vcpus.len(), 2);
    for v in vcpus {
        assert!(v["boosted_ns"].as_u64().is_some(), "{v}");
        assert!(is_num(&v["boosted_us_per_window"]) && is_num(&v["of_budget"]));
        assert!(v["boosts"].as_u64().is_some() && v["throttles"].as_u64().is_some());
    }
    assert_eq!(targets(&j), ["s5_greedy_budget", "s5_hog_share"]);
    // Judged in the one repetition: the budget's worst vCPU.
    assert!(is_num(&j["targets"][0]["value"]));
    assert_ne!(j["targets"][0]["verdict"], "unresolved");
}

#[test]
fn load_kinds_parse() {
    // A valid --load gets past the command line (`--help` after it then
    // exits 0); an unknown one is refused before (2: bad command line).
    for kind in ["busy", "sleepy", "mixed"] {
        let out = pvsched()
            .args(["s1", "--load", kind, "--hogs", "1", "--help"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "--load {kind}");
    }
    let out = pvsched().args(["s1", "--load", "lazy"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for kind in ["busy", "sleepy", "mixed"] {
        assert!(stderr.contains(kind), "{kind} in\n{stderr}");
    }
}

#[test]
fn bench_that_cannot_run_exits_9() {
    let out = pvsched()
        .args([
            "s4",
            "--quick",
            "--repo",
            "/nonexistent-pvsched-repo",
            "--device-bin",
            "/bin/true",
            "--pvsched-bin",
            "/bin/true",
            "--pvschedd-bin",
            "/bin/true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(9));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("python/pvsched_bench/__main__.py not found"),
        "{stderr}"
    );
}

/// A stand-in `python3 -m pvsched_bench`: for `s4`, writes raw rows to
/// --json as the real one does, its arguments in `command`.
const FAKE_PACKAGE: &str = r#"
import json, sys
a = sys.argv[1:]
assert a[0] == "s4", a
cyc = lambda mx: {"avg_us": 10, "p50_us": 9, "p99_us": mx, "max_us": mx, "cycles": 100}
runs = [{"kernel": "7.3-cloud", "variant": v, "rep": r, "order": 0, "load": "loaded",
         "interval_us": 500, "guest": cyc(k * (r + 1)), "host": cyc(50)}
        for r in range(2) for v, k in (("vanilla", 900), ("pvsched", 300))]
json.dump({"scenario": "s4", "reps": 2, "duration_s": 3, "variants": ["vanilla", "pvsched"],
           "kernels": ["7.3-cloud"], "command": " ".join(a), "runs": runs, "failed": [],
           "floors": [{"kernel": "7.3-cloud", "rep": 0, "p99_us": 5, "max_us": 9}]},
          open(a[a.index("--json") + 1], "w"))
"#;

#[test]
fn s4_runs_the_package_and_reports_from_its_rows() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("SKIP: s4_runs_the_package_and_reports_from_its_rows: no python3");
        return;
    }
    let repo = std::env::temp_dir().join(format!("pvsched-bench-s4-test-{}", std::process::id()));
    std::fs::create_dir_all(repo.join("python/pvsched_bench")).unwrap();
    std::fs::write(repo.join("python/pvsched_bench/__init__.py"), "").unwrap();
    std::fs::write(repo.join("python/pvsched_bench/__main__.py"), FAKE_PACKAGE).unwrap();
    let png = repo.join("s4.png");
    let out = pvsched()
        .args(["s4", "--quick", "--reps", "2", "--json", "-"])
        .args(["--device-bin", "/bin/true", "--pvsched-bin", "/bin/false"])
        .args(["--pvschedd-bin", "/bin/sh"])
        .arg("--repo")
        .arg(&repo)
        .arg("--plot")
        .arg(&png)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["scenario"], "s4");
    let pv = &j["cells"][0]["variants"][1];
    assert_eq!(pv["variant"], "pvsched");
    assert_eq!(pv["n"], 2);
    let vs = &pv["vs_vanilla"]["guest_max"];
    assert_eq!(vs["n"], 2);
    assert!(
        (vs["ratio"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-9,
        "{vs}"
    );
    let argv: Vec<&str> = j["raw"]["command"].as_str().unwrap().split(' ').collect();
    for pair in [
        ["--device-bin", "/bin/true"],
        ["--pvsched-bin", "/bin/false"],
        ["--pvschedd-bin", "/bin/sh"],
        ["--reps", "2"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    assert!(argv.contains(&"--quick"));
    // The table goes to stderr when the JSON takes stdout.
    assert!(stderr.contains("| pvsched | 2 (0) |"), "{stderr}");
    assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");
    std::fs::remove_dir_all(&repo).unwrap();
}

/// `host-costs --json -` measures every figure on this host (real threads,
/// real `sched_setattr`) and prints one JSON object with the table on
/// standard error; each figure is a positive CPU time, never judged.
#[test]
fn host_costs_measures_each_figure_and_prints_one_json() {
    let test = "host_costs_measures_each_figure_and_prints_one_json";
    if !pvsched_testkit::root(test, "SCHED_FIFO threads") {
        return;
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        skip_or_fail(test, "needs two CPUs");
        return;
    }
    let out = pvsched()
        .args(["host-costs", "--ops", "200", "--rounds", "2", "--json", "-"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
    assert!(stderr.contains("wake-up from the other CPU"), "{stderr}");
    let j: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object: {e}\n{stderr}"));
    assert_eq!(
        (j["ops"].as_u64(), j["rounds"].as_u64()),
        (Some(200), Some(2))
    );
    for k in [
        "wake_same_cpu_us",
        "wake_same_cpu_timer_us",
        "wake_other_cpu_us",
        "timer_sleep_us",
        "setattr_preempting_us",
        "setattr_queued_us",
    ] {
        assert_eq!(j[k]["n"].as_u64(), Some(2), "{k}: {}", j[k]);
        let (lo, hi) = (j[k]["min"].as_f64().unwrap(), j[k]["max"].as_f64().unwrap());
        assert!(lo > 0.0 && lo <= hi, "{k}: {}", j[k]);
    }
}
