//! Real KVM: `pvsched run --snapshot-to DIR` saves the whole VM, and
//! `pvsched run --restore DIR`, another process, runs the same guest on
//! from where it was: no boot, no new handshake, its workload and its
//! slot updates carrying on from the counts the snapshot holds.

use crate::common;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn pvsched(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pvsched"))
        .args(args)
        .output()
        .expect("spawn pvsched")
}

/// A directory of its own under the temporary directory, empty.
fn scratch(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pvsched-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The run's JSON report; fails the test on a non-zero exit.
fn report(out: &Output) -> serde_json::Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// Each vCPU's completed slot updates, as the host read its slot.
fn slot_updates(v: &serde_json::Value) -> Vec<u64> {
    v["per_vcpu"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["guest_slot"]["updates"].as_u64().expect("a slot reading"))
        .collect()
}

/// Each vCPU's completed slot updates as the snapshot in `dir` holds them
/// (its BAR2 bytes). Not the snapshot run's report: a vCPU stopped in the
/// middle of a slot update leaves its seq odd, and the report then has no
/// consistent reading of that slot; the count itself is whole.
fn saved_updates(dir: &Path, vcpus: u32) -> Vec<u64> {
    let region = std::fs::read(dir.join("region.bin")).expect("region.bin");
    let field = std::mem::offset_of!(pvsched_abi::Slot, guest.updates);
    (0..vcpus)
        .map(|i| {
            let at = pvsched_abi::slot_offset(vcpus, i) as usize + field;
            u64::from_le_bytes(region[at..at + 8].try_into().unwrap())
        })
        .collect()
}

/// `pvsched run --restore dir` with `extra`, for 2 s, as JSON.
fn restore(dir: &Path, extra: &[&str]) -> Output {
    let d = dir.to_str().unwrap();
    let mut args = vec![
        "run",
        "--restore",
        d,
        "--duration",
        "2s",
        "--device-mode",
        "in-process",
        "--json",
    ];
    args.extend_from_slice(extra);
    pvsched(&args)
}

#[test]
fn a_snapshot_runs_on_in_a_new_process() {
    let test = "a_snapshot_runs_on_in_a_new_process";
    if !common::kvm(test) {
        return;
    }
    let dir = scratch(test);
    let d = dir.to_str().unwrap();
    // `spin`: every vCPU sets wait_on in its slot and spins on its
    // partner's IPI, so its slot's update count grows all the time.
    let before = report(&pvsched(&[
        "run",
        "--vcpus",
        "2",
        "--workload",
        "spin",
        "--duration",
        "2s",
        "--device-mode",
        "in-process",
        "--policy",
        "none",
        "--snapshot-to",
        d,
        "--json",
    ]));
    assert_eq!(before["handshake"], "DRIVER_OK");
    assert!(before["events"].as_u64().unwrap() > 0, "{before}");
    for f in ["vm.json", "ram.bin", "region.bin"] {
        assert!(dir.join(f).is_file(), "{f} written");
    }
    let saved = saved_updates(&dir, 2);
    // vCPU 0 spun all the while: many updates beyond its start-up burst.
    assert!(saved[0] > 1000, "{saved:?}");

    let after = report(&restore(&dir, &["--policy", "none"]));
    assert_eq!(after["workload"], "spin", "the snapshot's workload");
    assert_eq!(after["vcpus"], 2);
    // The handshake is the snapshot's: the restored device is at
    // DRIVER_OK without the guest asking again.
    assert_eq!(after["handshake"], "DRIVER_OK");
    assert_ne!(
        after["device_status"].as_u64().unwrap() & 0x4,
        0,
        "DRIVER_OK"
    );
    assert_eq!(after["clean_shutdown"], true, "{after}");
    assert!(
        after["events"].as_u64().unwrap() > 0,
        "the guest works on: {after}"
    );
    // vCPU 0 is the spinning one (vCPU 1 answers its IPIs and keeps the
    // slot of its start-up burst).
    let now = slot_updates(&after);
    assert!(
        now[0] > saved[0],
        "vCPU 0's slot updates carry on from the snapshot's {}, not from 0: {}",
        saved[0],
        now[0]
    );
    assert_eq!(now[1], saved[1], "vCPU 1's slot as it was");
    for p in after["per_vcpu"].as_array().unwrap() {
        assert!(p["fault"].is_null(), "no vCPU faulted: {p}");
    }

    // With the embedded policy (root and BPF), the restored vCPU threads
    // are registered and BAR2 is the policy's map, holding the snapshot's
    // slots.
    if common::kvm_root_bpf(test) {
        let after = report(&restore(&dir, &["--policy", "embedded"]));
        assert_eq!(after["handshake"], "DRIVER_OK");
        assert!(after["events"].as_u64().unwrap() > 0, "{after}");
        let again = slot_updates(&after);
        assert!(
            again[0] > saved[0] && again[1] == saved[1],
            "slot updates in the policy's map carry on: {saved:?} -> {again:?}"
        );
        assert_eq!(after["policy"]["name"], "embedded", "{after}");
        // The policy read the restored slots: vCPU 0's wait_on named
        // vCPU 1 as the one to yield to.
        assert_eq!(after["policy"]["per_vcpu"][0]["yield_slot"], 1, "{after}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn snapshot_flags_say_what_is_wrong() {
    let dir = scratch("snapshot_flags_say_what_is_wrong");
    let d = dir.to_str().unwrap();
    // The sandboxed device (the default) cannot be snapshotted: a usage
    // error before any VM starts.
    let out = pvsched(&["run", "--snapshot-to", d, "--policy", "none"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--device-mode in-process"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The snapshot gives the vCPUs and the workload.
    let out = pvsched(&["run", "--restore", d, "--vcpus", "4"]);
    assert_eq!(out.status.code(), Some(2));
    // No snapshot there: exit 1, naming the file.
    let out = restore(&dir, &["--policy", "none"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vm.json"), "{err}");
    assert!(!dir.exists(), "nothing created by a failed restore");
}
