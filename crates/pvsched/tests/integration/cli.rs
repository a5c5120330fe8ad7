//! The `pvsched` binary end to end (real KVM for `run`).

use std::process::Command;

fn pvsched() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pvsched"))
}

fn kvm_available(test: &str) -> bool {
    match pvsched_vmm::open_kvm() {
        Ok(_) => true,
        Err(e) => pvsched_testkit::skip_or_fail(test, &format!("KVM is unusable: {e}")),
    }
}

#[test]
fn run_wakeup_json() {
    if !kvm_available("run_wakeup_json") {
        return;
    }
    let out = pvsched()
        .args([
            "run",
            "--vcpus",
            "2",
            "--workload",
            "wakeup",
            "--duration",
            "3s",
            "--policy",
            "none",
            "--json",
        ])
        .output()
        .expect("spawn pvsched");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["vcpus"], 2);
    assert_eq!(v["workload"], "wakeup");
    assert_eq!(v["region"], "device");
    assert_eq!(v["handshake"], "DRIVER_OK");
    assert!(v["events"].as_u64().unwrap() > 0);
    for key in ["p50_us", "p99_us", "max_us"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}");
    }
    let per = v["per_vcpu"].as_array().unwrap();
    assert_eq!(per.len(), 2);
    for (i, p) in per.iter().enumerate() {
        assert_eq!(p["index"], i);
        assert!(p["tid"].as_i64().unwrap() > 0);
        assert!(p["events"].as_u64().unwrap() > 0);
        assert_eq!(p["burst_mmio_exits"], 0);
        // Every injection was timed to the end of its ioctl, and a stall
        // is the injector's at most as often as it is a stall.
        assert!(p["inject_max_us"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["stalls_injector"].as_u64().unwrap() <= p["stalls"].as_u64().unwrap());
    }
    // Live progress: one line per second on stderr.
    assert!(stderr.contains("[   1s] events"), "{stderr}");
}

#[test]
fn run_guest_region_table() {
    if !kvm_available("run_guest_region_table") {
        return;
    }
    let out = pvsched()
        .args([
            "run",
            "--workload",
            "ipi",
            "--region",
            "guest",
            "--duration",
            "1s",
            "--policy",
            "none",
        ])
        .output()
        .expect("spawn pvsched");
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("handshake DRIVER_OK"), "{stdout}");
    assert!(stdout.contains("p99 µs"), "{stdout}");
}

#[test]
fn bad_arguments_exit_2_and_help_documents_exit_codes() {
    let out = pvsched().args(["run", "--vcpus", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = pvsched()
        .args(["run", "--duration", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = pvsched()
        .args(["run", "--policy", "magic"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = pvsched()
        .args(["run", "--compare", "--policy", "none"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--compare without a policy");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--compare"));
    let help = pvsched().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("Exit codes:"));
    assert!(help.contains("/dev/kvm"));
}
