//! `pvsched-agent-attach` as a process: refuses a thread of another
//! process, boosts a thread of the `--pid` process from its slot (read in
//! that thread's context), restores it and writes its statistics on
//! SIGTERM, and stops by itself when the `--pid` process exits.

use crate::common;

use common::{FakeVcpu, need_bpf, wait_for};
use pvsched_abi::{POLICY_FIFO, SlotGuest};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_pvsched-agent-attach");
const LIMIT: Duration = Duration::from_secs(10);

fn spawn(args: &[String]) -> Child {
    let mut child = Command::new(BIN)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pvsched-agent-attach");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("agent did not start: {seen}");
        }
        seen.push_str(&line);
        if line.contains("pvsched-agent-attach: ready") {
            break;
        }
    }
    // Keep draining its stderr so it never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    child
}

fn wait_exit(child: &mut Child) -> i32 {
    let st = wait_for("agent exit", LIMIT, || child.try_wait().unwrap());
    st.code().expect("agent killed by a signal")
}

fn stats(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn attach_refuses_a_thread_of_another_process() {
    let out = Command::new(BIN)
        .args(["--pid", &std::process::id().to_string()])
        .args(["--tids", "1", "--apic-ids", "0", "--slot-addrs", "0x1000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a thread of process"), "{err}");
}

#[test]
fn attach_rejects_mismatched_lists() {
    let me = std::process::id().to_string();
    let out = Command::new(BIN)
        .args(["--pid", &me, "--tids", &me, "--apic-ids", "0,1"])
        .args(["--slot-addrs", "0x1000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn attach_boosts_from_the_slot_and_restores_on_sigterm() {
    if !need_bpf("attach_boosts_from_the_slot_and_restores_on_sigterm") {
        return;
    }
    let vcpu = FakeVcpu::spawn(2, Duration::from_micros(300));
    let baseline = vcpu.attr();
    // The guest's slot says: a FIFO 5 task runs on this vCPU.
    let slot = Box::new(std::sync::Mutex::new(pvsched_abi::Slot::default()));
    let addr = {
        let mut s = slot.lock().unwrap();
        s.guest.policy = POLICY_FIFO;
        s.guest.rt_prio = 5;
        &s.guest as *const SlotGuest as u64
    };
    let dir = std::env::temp_dir().join(format!("pvsched-attach-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let caps = dir.join("caps.toml");
    std::fs::write(
        &caps,
        "allow_rt = true\nmax_rt_prio = 10\nhalt_boost = \"none\"\n",
    )
    .unwrap();
    let out = dir.join("stats.json");
    let mut agent = spawn(&[
        "--pid".into(),
        std::process::id().to_string(),
        "--tids".into(),
        vcpu.tid.to_string(),
        "--apic-ids".into(),
        "0".into(),
        "--slot-addrs".into(),
        format!("{addr:#x}"),
        "--caps".into(),
        caps.display().to_string(),
        "--stats-json".into(),
        out.display().to_string(),
    ]);
    let boosted = wait_for("FIFO 5 boost", LIMIT, || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    // (sched_getattr reports no nice for an RT thread; the restore below
    // shows the nice was kept.)
    assert_eq!(boosted.priority, 5);
    // SAFETY: kill sends SIGTERM to the agent child we spawned.
    assert_eq!(unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(wait_exit(&mut agent), 0);
    assert_eq!(vcpu.attr(), baseline);
    let s = stats(&out);
    assert_eq!(s["stopped_by"], "signal");
    assert!(s["vcpus"][0]["boosts_applied"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["vcpus"][0]["tid"], vcpu.tid);
    drop(slot);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn attach_stops_when_the_vmm_exits() {
    if !need_bpf("attach_stops_when_the_vmm_exits") {
        return;
    }
    let mut vmm = Command::new("sleep").arg("60").spawn().unwrap();
    let out = std::env::temp_dir().join(format!("pvsched-attach-exit-{}.json", vmm.id()));
    let mut agent = spawn(&[
        "--pid".into(),
        vmm.id().to_string(),
        "--tids".into(),
        vmm.id().to_string(),
        "--apic-ids".into(),
        "0".into(),
        "--slot-addrs".into(),
        "0x1000".into(),
        "--stats-json".into(),
        out.display().to_string(),
    ]);
    vmm.kill().unwrap();
    assert_eq!(wait_exit(&mut agent), 0);
    vmm.wait().unwrap();
    assert_eq!(stats(&out)["stopped_by"], "vmm-exit");
    let _ = std::fs::remove_file(&out);
}
