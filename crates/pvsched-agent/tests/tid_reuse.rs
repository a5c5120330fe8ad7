//! A registered thread exits and the kernel gives its TID to a new thread
//! (forced by writing `/proc/sys/kernel/ns_last_pid`): the new thread is
//! never boosted, though the slot of the vCPU that had the TID keeps
//! asking for RT 99. Real BPF (`sched_process_exit`), real threads, read
//! back with sched_getattr.

mod common;

use common::{FakeVcpu, need_bpf, wait_for};
use pvsched_abi::{POLICY_FIFO, POLICY_NORMAL, SlotGuest};
use pvsched_agent::{Agent, AgentConfig};
use pvsched_policy::{BoostKind, Caps};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(10);

/// Starts a FakeVcpu whose TID is `tid`: sets ns_last_pid to tid - 1 just
/// before each try (another process may take the number first).
fn vcpu_with_tid(tid: u32) -> Option<FakeVcpu> {
    for _ in 0..200 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (tid - 1).to_string()).ok()?;
        let v = FakeVcpu::spawn(0, Duration::from_millis(1));
        if v.tid == tid {
            return Some(v);
        }
    }
    None
}

#[test]
fn a_reused_tid_is_never_boosted() {
    if !need_bpf("a_reused_tid_is_never_boosted") {
        return;
    }
    // CONFIG_CHECKPOINT_RESTORE is in every distribution kernel.
    if std::fs::metadata("/proc/sys/kernel/ns_last_pid").is_err()
        && !pvsched_testkit::skip_or_fail(
            "a_reused_tid_is_never_boosted",
            "/proc/sys/kernel/ns_last_pid missing",
        )
    {
        return;
    }
    let agent = Agent::load(AgentConfig {
        handle_signals: false,
        ..AgentConfig::default()
    })
    .expect("agent loads");
    let caps = Caps {
        halt_boost: BoostKind::None,
        yield_boost: BoostKind::None,
        max_boost_us: 0,
        budget_us: 0,
        ..Caps::default()
    };
    let old = FakeVcpu::spawn(0, Duration::from_millis(1));
    let tid = old.tid;
    let vm = common::one_vcpu_vm(&agent, tid, caps);
    let region = vm.region().unwrap();
    let rt99 = SlotGuest {
        policy: POLICY_FIFO,
        rt_prio: 99,
        ..Default::default()
    };
    region.write_guest(1, 0, &rt99);
    wait_for("the registered thread boosted", LIMIT, || {
        Some(old.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    // The thread exits while boosted; its slot still asks for RT 99.
    drop(old);
    let new = vcpu_with_tid(tid).expect("a new thread with the old TID (ns_last_pid)");
    assert_eq!(new.tid, tid);
    let t0 = Instant::now();
    let mut samples = 0;
    while t0.elapsed() < Duration::from_millis(500) {
        region.write_guest(1, 0, &rt99);
        let a = new.attr();
        assert_eq!(
            (a.policy, a.priority, a.nice),
            (POLICY_NORMAL, 0, 0),
            "the new thread with the reused TID {tid} was touched"
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = vm.stats();
    println!(
        "TID {tid} reused by a new thread: never boosted over {samples} samples in 500 ms \
         (decisions {}, applied boosts {})",
        st.decisions, st.vcpus[0].boosts_applied
    );
    drop(vm);
    assert_eq!(new.attr().policy, POLICY_NORMAL);
}
