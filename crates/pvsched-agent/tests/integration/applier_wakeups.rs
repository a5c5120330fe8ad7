//! What the agent's applier thread costs a host when there is nothing to
//! do: while no VM is registered it does not wake at all, and with a VM
//! whose threads ask for nothing it wakes once per tick. Read back from
//! the kernel's count of the thread's voluntary context switches (each
//! wait that blocks is one).

use crate::common::{self, FakeVcpu};
use pvsched_agent::AgentConfig;
use pvsched_policy::Caps;
use std::time::{Duration, Instant};

/// How long each count runs.
const SPAN: Duration = Duration::from_millis(500);

/// The thread's voluntary context switches so far.
fn waits(tid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status"))
        .expect("the applier thread's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("voluntary_ctxt_switches in the status")
}

/// The applier's waits during SPAN, and how long that took.
fn count(tid: u32) -> (u64, Duration) {
    let (w0, t0) = (waits(tid), Instant::now());
    std::thread::sleep(SPAN);
    (waits(tid) - w0, t0.elapsed())
}

#[test]
fn applier_sleeps_without_vms_and_wakes_once_per_tick() {
    if !common::need_bpf("applier_sleeps_without_vms_and_wakes_once_per_tick") {
        return;
    }
    let agent = common::agent();
    let deadline = Instant::now() + Duration::from_secs(5);
    while agent.applier_tid() == 0 {
        assert!(
            Instant::now() < deadline,
            "the applier thread never started"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let tid = agent.applier_tid();
    // Its first tick (which finds no VM) is long over after this.
    std::thread::sleep(Duration::from_millis(200));
    let (idle, _) = count(tid);
    assert!(
        idle <= 2,
        "the applier woke {idle} times in {SPAN:?} with no VM registered"
    );

    // A VM whose vCPU asks for nothing: a switch and a wake-up every
    // 200 ms, no boost, so every wake-up of the applier is a tick's.
    let vcpu = FakeVcpu::spawn(0, Duration::from_millis(200));
    let vm = common::device_vm(&agent, &[vcpu.tid], &[], Caps::default());
    let (busy, took) = count(tid);
    let tick = AgentConfig::default().tick;
    // A tick is due `tick` after the last one began, so there are at most
    // this many (a loaded host makes fewer, never more); ending each wait
    // before its tick as well made twice as many wake-ups.
    let ticks = (took.as_nanos() / tick.as_nanos()) as u64 + 1;
    println!(
        "applier wake-ups in {SPAN:?}: {idle} with no VM, {busy} with one ({took:?}, at most \
         {ticks} ticks of {tick:?})"
    );
    assert!(busy >= 1, "the applier did not tick with a VM registered");
    assert!(
        busy <= ticks + 10,
        "the applier woke {busy} times in {took:?}: more than once per tick ({ticks} at most)"
    );

    // The last VM gone, the applier sleeps again after one more tick.
    drop(vm);
    std::thread::sleep(Duration::from_millis(100));
    let (after, _) = count(tid);
    assert!(
        after <= 2,
        "the applier woke {after} times in {SPAN:?} after the last VM left"
    );
    drop(vcpu);
}
