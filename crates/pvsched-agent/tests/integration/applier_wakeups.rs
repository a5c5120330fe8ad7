//! What the agent's applier thread costs a host when there is nothing to
//! do: while no VM is registered it does not wake at all, with a VM whose
//! threads ask for nothing it wakes once per quiet tick, and once a thread
//! is boosted once per tick. Read back from the kernel's count of the
//! thread's voluntary context switches (each wait that blocks is one).

use crate::common::{self, FakeVcpu};
use pvsched_abi::{CS_HARDIRQ, POLICY_FIFO, SlotGuest};
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

/// At most how many ticks of `period` fit in `took`: a tick is due
/// `period` after the last one began (a loaded host makes fewer, never
/// more).
fn at_most(took: Duration, period: Duration) -> u64 {
    (took.as_nanos() / period.as_nanos()) as u64 + 1
}

#[test]
fn applier_sleeps_without_vms_and_wakes_once_per_tick() {
    let _cpus = common::cpu_bound();
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
    // 200 ms, no boost, so every wake-up of the applier is a tick's, and
    // with nothing boosted a quiet one.
    let vcpu = FakeVcpu::spawn(0, Duration::from_millis(200));
    let vm = common::device_vm(&agent, &[vcpu.tid], &[], Caps::default());
    std::thread::sleep(Duration::from_millis(100));
    let (quiet, took) = count(tid);
    let cfg = AgentConfig::default();
    let quiet_ticks = at_most(took, cfg.quiet_tick);
    println!(
        "applier wake-ups in {SPAN:?}: {idle} with no VM, {quiet} with one asking for nothing \
         ({took:?}, at most {quiet_ticks} quiet ticks of {:?})",
        cfg.quiet_tick
    );
    assert!(quiet >= 1, "the applier did not tick with a VM registered");
    // Ticking every `tick` with nothing to do woke it ten times as often.
    assert!(
        quiet <= quiet_ticks + 3,
        "the applier woke {quiet} times in {took:?} with nothing boosted: more than once per \
         quiet tick ({quiet_ticks} at most)"
    );
    drop(vm);
    drop(vcpu);

    // A vCPU that stays on its CPU in a hard-irq section: boosted (no
    // boost length or budget cap), so every tick is due on time: the
    // applier wakes at the short period again.
    let vcpu = FakeVcpu::spawn_busy(0);
    let vm = common::device_vm(&agent, &[vcpu.tid], &[], common::cs_boost_caps());
    vm.region().unwrap().write_guest(
        1,
        0,
        &SlotGuest {
            kern_cs: CS_HARDIRQ,
            ..Default::default()
        },
    );
    common::wait_for("RT boost", Duration::from_secs(10), || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    let (busy, took) = count(tid);
    let ticks = at_most(took, cfg.tick);
    println!(
        "applier wake-ups in {took:?} with a boosted vCPU: {busy} (at most {ticks} ticks of {:?})",
        cfg.tick
    );
    // At its RT priority the applier's ticks are not delayed by load, so
    // with a thread boosted it wakes far more often than quiet ticks give.
    assert!(
        busy > quiet_ticks + 3,
        "the applier woke {busy} times in {took:?} with a vCPU boosted: no faster than quiet \
         ticks ({quiet_ticks})"
    );
    // Ending each wait before its tick as well made twice as many.
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
