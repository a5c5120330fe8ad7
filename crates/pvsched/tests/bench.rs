//! `pvsched bench` end to end (issue 7 "Must show"): `pvsched bench s1
//! --quick --json -` boots the reference VMM on real KVM with and without
//! the embedded BPF policy, beside CPU hogs and on an idle host, exits 0
//! and prints one JSON object with the documented shape. Asserts on the
//! shape and on values being present, never on how fast anything was
//! (benchmarks measure, tests don't time).
//!
//! Needs root, /dev/kvm and BPF; without them it prints `SKIP` (or fails
//! under `PVSCHED_REQUIRE_REAL=1`). The exit-code test needs nothing.

mod common;

use serde_json::Value;
use std::process::Command;

/// Whether root, /dev/kvm and BPF are there; SKIP or fail if not.
fn need_real(test: &str) -> bool {
    common::kvm_root_bpf(test)
}

fn pvsched() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pvsched"))
}

fn is_num(v: &Value) -> bool {
    v.as_f64().is_some()
}

#[test]
fn s1_quick_prints_the_bench_json() {
    if !need_real("s1_quick_prints_the_bench_json") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("pvsched-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("s1.png");
    let out = pvsched()
        .args(["bench", "s1", "--quick", "--json", "-", "--plot"])
        .arg(&png)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
    let j: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object: {e}\n{stderr}"));
    assert_eq!(j["scenario"], "s1");
    assert_eq!(j["quick"], true);
    assert_eq!(j["reps"], 1);
    assert!(j["machine"]["cpus"].as_u64().unwrap() >= 1);
    assert!(j["machine"]["kernel"].is_string());
    for v in ["vanilla", "pvsched", "idle_vanilla", "idle_pvsched"] {
        for k in ["p50_us", "p99_us", "max_us"] {
            assert!(is_num(&j[v][k]), "{v}.{k}: {}", j[v]);
        }
        assert_eq!(j[v]["p99_us_reps"].as_array().unwrap().len(), 1, "{v}");
        assert!(j[v]["samples"].as_u64().unwrap() > 0, "{v} has samples");
    }
    assert_eq!(j["vanilla"]["policy"], "none");
    assert_eq!(j["pvsched"]["policy"], "embedded");
    // The policy really ran in the pvsched variant: it made decisions.
    assert!(
        j["pvsched"]["runs"][0]["policy"]["decisions"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert!(j["vanilla"]["runs"][0]["policy"].is_null());
    for k in ["ratio_p50", "ratio_p99", "ratio_max"] {
        assert!(is_num(&j[k]), "{k}");
    }
    let targets = j["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 3);
    for t in targets {
        assert!(t["name"].is_string() && t["goal"].is_string());
        assert!(t["met"].is_boolean());
        assert!(is_num(&t["value"]));
    }
    let png = std::fs::read(&png).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_that_cannot_run_exits_9() {
    let out = pvsched()
        .args([
            "bench",
            "s4",
            "--quick",
            "--repo",
            "/nonexistent-pvsched-repo",
            "--device-bin",
            "/bin/true",
            "--agent-bin",
            "/bin/true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(9));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bench/s4.py not found"), "{stderr}");
}

/// A stand-in bench/s4.py: echoes its arguments in the JSON and writes
/// one histogram per variant to --samples, as the real one does.
const FAKE_S4: &str = r#"
import json, sys
a = sys.argv[1:]
samples = a[a.index("--samples") + 1]
runs = [{"variant": v, "load": "loaded", "interval_us": 500, "rep": 1,
         "guest": {"hist": [[10, 90], [k, 10]], "cycles": 100, "overflow": 0},
         "host": {"hist": [[5, 100]], "cycles": 100, "overflow": 0}}
        for v, k in (("vanilla", 900), ("pvsched", 300))]
json.dump({"unit": "us", "runs": runs}, open(samples, "w"))
print(json.dumps({"scenario": "s4", "quick": "--quick" in a, "reps": 1, "argv": a,
                  "vanilla": {"p50_us": 10, "p99_us": 900, "max_us": 900},
                  "pvsched": {"p50_us": 10, "p99_us": 300, "max_us": 300},
                  "ratio_p50": 1.0, "ratio_p99": 0.333, "ratio_max": 0.333, "targets": []}))
"#;

#[test]
fn s4_runs_the_script_and_relays_its_json() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("SKIP: s4_runs_the_script_and_relays_its_json: no python3");
        return;
    }
    let repo = std::env::temp_dir().join(format!("pvsched-bench-s4-test-{}", std::process::id()));
    std::fs::create_dir_all(repo.join("bench")).unwrap();
    std::fs::write(repo.join("bench/s4.py"), FAKE_S4).unwrap();
    let png = repo.join("s4.png");
    let out = pvsched()
        .args(["bench", "s4", "--quick", "--reps", "2", "--json", "-"])
        .args(["--device-bin", "/bin/true", "--agent-bin", "/bin/false"])
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
    assert_eq!(j["quick"], true);
    assert_eq!(j["ratio_p99"], 0.333);
    assert!(j["machine"]["cpus"].as_u64().is_some());
    let argv: Vec<&str> = j["argv"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    for pair in [
        ["--device-bin", "/bin/true"],
        ["--agent-bin", "/bin/false"],
        ["--reps", "2"],
        ["--json", "-"],
    ] {
        assert!(argv.windows(2).any(|w| w == pair), "{pair:?} in {argv:?}");
    }
    assert!(argv.contains(&"--quick"));
    assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");
    std::fs::remove_dir_all(&repo).unwrap();
}

#[test]
fn bench_help_lists_the_scenarios() {
    let out = pvsched().args(["bench", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for s in [
        "s1", "s2", "s3", "s4", "--quick", "--reps", "--json", "--plot",
    ] {
        assert!(help.contains(s), "{s} in\n{help}");
    }
    assert!(help.contains("9  pvsched bench"));
}
