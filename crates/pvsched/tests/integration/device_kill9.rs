//! The device process may die: kill -9 of the device process during
//! `pvsched run --workload wakeup --device-mode sandboxed` leaves the VMM
//! running to the end of its duration. The run exits with code 8, its JSON
//! reports `device_lost` (pid, signal 9) and events counted after the loss;
//! with `--policy embedded` (root + BPF), every vCPU thread is back at its
//! baseline (SCHED_OTHER at the run's own nice: 0 unless the tests run
//! under `nice`) while the run is still going.

use crate::common;

use common::{LIMIT, children_with, vcpu_threads, wait_for};
use pvsched_abi::POLICY_NORMAL;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the embedded policy logs once it has unregistered the VM after the
/// device died (crates/pvsched-host/src/embedded.rs). Used only as a barrier:
/// before it the policy may still boost (the VMM has not yet noticed the
/// death); the test's assertions are on the threads' attributes.
const UNREGISTERED: &str = "VM unregistered, every vCPU thread back at its baseline";

/// Exit code of a run whose device process died (crates/pvsched/src/exit.rs).
const EXIT_DEVICE_LOST: i32 = 8;

/// The pvsched run child, killed if the test fails early.
struct Run(Option<Child>);

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z ") && !s.contains(") X "))
        .unwrap_or(false)
}

/// One run with the device killed; returns the time from the kill to every
/// vCPU thread back at its baseline (with a policy).
fn kill9(extra: &[&str], duration: &str) -> Duration {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pvsched"))
        .args([
            "run",
            "--workload",
            "wakeup",
            "--duration",
            duration,
            "--json",
            "--device-mode",
            "sandboxed",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pvsched run");
    let pid = child.id();
    // The run's stderr, read as it comes (kept whole for failure messages).
    let stderr = Arc::new(Mutex::new(String::new()));
    let mut pipe = child.stderr.take().expect("stderr piped");
    let reader = {
        let stderr = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(&mut pipe).lines() {
                let Ok(line) = line else { break };
                let mut s = stderr.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
            let mut rest = String::new();
            let _ = pipe.read_to_string(&mut rest);
        })
    };
    let mut run = Run(Some(child));
    let device = wait_for("the device process", LIMIT, || {
        children_with(pid, "device").first().copied()
    });
    let policy = !matches!(extra, ["--policy", "none"]);
    let vcpus = wait_for("two vCPU threads", LIMIT, || {
        let v = vcpu_threads(pid);
        (v.len() == 2).then_some(v)
    });
    // The vCPU threads' baseline is what they inherited from the run's main
    // thread: SCHED_OTHER, at the nice the test runs at (0, or e.g. 10
    // under `nice cargo test`).
    let baseline = pvsched_agent::sched::get(pid).expect("sched_getattr of the run");
    assert_eq!((baseline.policy, baseline.priority), (POLICY_NORMAL, 0));
    let t0 = Instant::now();
    if policy {
        // The embedded policy boosts (halt boost, nice -5) while the device
        // lives: the drop below is observable.
        wait_for("a boosted vCPU thread", LIMIT, || {
            vcpus.iter().find_map(|&(_, tid)| {
                pvsched_agent::sched::get(tid)
                    .ok()
                    .filter(|a| *a != baseline)
            })
        });
    }
    let full: Duration = humantime::parse_duration(duration).unwrap();
    std::thread::sleep((full / 3).saturating_sub(t0.elapsed()));
    let killed = Instant::now();
    // SAFETY: kill(2) of the device process found above (a child of the
    // run, alive: it is only reaped by the run once it ends).
    assert_eq!(unsafe { libc::kill(device as i32, libc::SIGKILL) }, 0);
    let mut restored = Duration::ZERO;
    if policy {
        // Until the VMM notices the death, the policy still serves the VM
        // (its slots are in the VMM's own mapping): wait for the end of the
        // registration, then every vCPU thread is back at its baseline and
        // stays there while the run goes on.
        let t = Instant::now();
        while !stderr.lock().unwrap().contains(UNREGISTERED) {
            assert!(
                t.elapsed() < LIMIT,
                "the policy did not unregister the VM within {LIMIT:?} of the device's death \
                 (run still going: {}); the run said:\n{}",
                running(pid),
                stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        wait_for("vCPU threads at baseline", LIMIT, || {
            vcpus
                .iter()
                .all(|&(_, tid)| pvsched_agent::sched::get(tid).is_ok_and(|a| a == baseline))
                .then_some(())
        });
        restored = killed.elapsed();
        for _ in 0..50 {
            assert!(running(pid), "the run ended early");
            for &(i, tid) in &vcpus {
                let a = pvsched_agent::sched::get(tid).expect("sched_getattr");
                assert_eq!(
                    a,
                    baseline,
                    "vCPU {i} (TID {tid}) after the device died; the run said:\n{}",
                    stderr.lock().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert!(running(pid), "the run is still going after the kill");
    let out = run
        .0
        .take()
        .expect("child")
        .wait_with_output()
        .expect("pvsched run ends");
    reader.join().expect("stderr reader");
    let stderr = stderr.lock().unwrap().clone();
    assert_eq!(out.status.code(), Some(EXIT_DEVICE_LOST), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let lost = &v["device_lost"];
    assert_eq!(lost["pid"], device, "{v}");
    assert_eq!(lost["signal"], 9);
    let at = lost["at_s"].as_f64().expect("at_s");
    assert!(at > 0.0 && at < v["duration_s"].as_f64().unwrap(), "{lost}");
    let before = lost["events_at_loss"].as_u64().unwrap();
    let total = v["events"].as_u64().unwrap();
    assert!(
        total > before,
        "events kept being counted: {before} -> {total}"
    );
    assert!(
        v["duration_s"].as_f64().unwrap() >= full.as_secs_f64(),
        "ran to the end"
    );
    assert_eq!(v["device_mode"], "sandboxed");
    assert_eq!(v["clean_shutdown"], true);
    assert_ne!(
        v["device_status"].as_u64().unwrap() & 0x40,
        0,
        "DEVICE_NEEDS_RESET"
    );
    assert_eq!(v["device_error"], 13);
    if policy {
        assert_eq!(v["policy"]["name"], extra[1]);
    }
    println!(
        "killed device {device} at {at} s; events {before} at the loss, {total} at the end; \
         every vCPU thread at its baseline {restored:?} after the kill"
    );
    restored
}

#[test]
fn kill9_of_the_device_process_leaves_the_run_going() {
    if !common::kvm("kill9_of_the_device_process_leaves_the_run_going") {
        return;
    }
    kill9(&["--policy", "none"], "6s");
}

#[test]
fn kill9_with_the_embedded_policy_drops_every_boost() {
    if !common::kvm_root_bpf("kill9_with_the_embedded_policy_drops_every_boost") {
        return;
    }
    kill9(&["--policy", "embedded"], "6s");
}

/// The same with the policy in pvschedd (`pvsched run --policy daemon`):
/// the VMM unregisters its VM when the device dies and the daemon restores
/// every vCPU thread. Repeated `PVSCHED_KILL_REPS` times (default 3; the
/// figure in docs/operating.md is from 20), the worst case printed.
#[test]
fn kill9_with_pvschedd_drops_every_boost() {
    if !common::kvm_root_bpf("kill9_with_pvschedd_drops_every_boost") {
        return;
    }
    let daemon = common::Pvschedd::start("devkill");
    let socket = daemon.socket.to_str().unwrap().to_string();
    let reps: u32 = std::env::var("PVSCHED_KILL_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let worst = (0..reps)
        .map(|_| kill9(&["--policy", "daemon", "--daemon-socket", &socket], "3s"))
        .max()
        .unwrap_or_default();
    println!("device SIGKILL x{reps} with pvschedd: worst restore {worst:?} after the kill");
}
