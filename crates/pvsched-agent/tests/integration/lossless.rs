//! Lossless application on real BPF: with a one-page decision ring and the
//! applier starved by two SCHED_FIFO threads, the ring overflows and a
//! decision record is lost; the agent's reconciliation still brings the
//! thread to exactly what the policy decided (read back with
//! `sched_getattr`), and counts the drop and the correction.

use crate::common;

use common::{FakeVcpu, need_bpf, wait_for};
use pvsched_abi::{BOOST_NONE, CS_HARDIRQ, POLICY_FIFO, SlotGuest};
use pvsched_agent::sched::{self, SchedAttr};
use pvsched_agent::{Agent, AgentConfig};
use pvsched_policy::{BoostKind, Caps};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn fifo(prio: u32) -> SchedAttr {
    SchedAttr {
        policy: POLICY_FIFO,
        priority: prio,
        nice: 0,
        flags: 0,
        slice_ns: 0,
    }
}

#[test]
fn a_lost_decision_is_corrected_by_reconciliation() {
    let _cpus = common::cpu_bound();
    if !need_bpf("a_lost_decision_is_corrected_by_reconciliation") {
        return;
    }
    let agent = Agent::load(AgentConfig {
        handle_signals: false,
        consumer_rt_prio: 0, // SCHED_OTHER: the FIFO threads below starve it
        ring_bytes: 4096,    // ~100 records
        ..AgentConfig::default()
    })
    .expect("agent loads");
    // Blocked throughout: the policy keeps no cs boost for a vCPU it saw
    // halt, so a wake-up of this thread during a slow burst would change
    // the state the test expects.
    let vcpu = FakeVcpu::spawn_blocked(3);
    let baseline = vcpu.attr();
    let caps = Caps {
        halt_boost: BoostKind::None,
        yield_boost: BoostKind::None,
        cs_rt_prio: 2,
        max_boost_us: 0,
        budget_us: 0,
        ..Caps::default()
    };
    let vm = common::one_vcpu_vm(&agent, vcpu.tid, caps);
    let region = vm.region().unwrap();
    let slot = |cs: u32| {
        region.write_guest(
            1,
            0,
            &SlotGuest {
                kern_cs: cs,
                ..Default::default()
            },
        );
    };
    let dropped = || agent.bpf_stats().unwrap().dropped;

    // Starve the applier: this thread and a spinner at SCHED_FIFO 90 on the
    // two CPUs, while this thread toggles the guest's critical section and
    // kicks, one decision record per kick, until the ring drops one.
    let me = sched::gettid();
    let mine = sched::get(me).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let spinner = std::thread::spawn(move || {
        let _ = sched::set(sched::gettid(), &fifo(90));
        let t0 = Instant::now();
        while !stop2.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(3) {
            std::hint::spin_loop();
        }
    });
    sched::set(me, &fifo(90)).unwrap();
    let before = dropped();
    let t0 = Instant::now();
    let mut cs = 0;
    let mut kicks = 0u64;
    while dropped() == before && t0.elapsed() < Duration::from_secs(2) {
        cs ^= CS_HARDIRQ;
        slot(cs);
        vm.kick(0);
        kicks += 1;
    }
    sched::set(me, &mine).unwrap();
    stop.store(true, Ordering::Relaxed);
    spinner.join().unwrap();
    let lost = dropped() - before;
    assert!(lost > 0, "the ring never overflowed in {kicks} kicks");

    // The last record (cs = the final value) was dropped; the one before it
    // survived. Reconciliation must end at the policy's final state.
    let want_boosted = cs != 0;
    let st = wait_for(
        "thread matches the policy's state",
        Duration::from_secs(5),
        || {
            // Only once the applier has handled every record that
            // survived (mid-drain the thread passes through the final
            // state too), so the drain's end is read before the thread:
            // read the other way round, a thread seen at the final state
            // mid-drain and a drain that ended just after would pass
            // before reconciliation ran.
            if vm.stats().decisions < kicks - lost {
                return None;
            }
            let a = vcpu.attr();
            let ok = if want_boosted {
                a.policy == POLICY_FIFO && a.priority == 2
            } else {
                a == baseline
            };
            // Read after the thread: a correction seen there is counted.
            let s = vm.stats();
            (ok && (s.vcpus[0].boost != BOOST_NONE) == want_boosted).then_some(s)
        },
    );
    println!(
        "lossless: {kicks} kicks, {lost} records dropped, final cs {cs:#x}, corrections {}, stats {:?}",
        st.corrections, st.vcpus[0]
    );
    assert!(st.dropped >= lost);
    assert!(
        st.corrections >= 1,
        "the lost record had to be corrected by reconciliation"
    );
    // And it stays there: the next ticks change nothing.
    std::thread::sleep(Duration::from_millis(50));
    let a = vcpu.attr();
    if want_boosted {
        assert_eq!((a.policy, a.priority), (POLICY_FIFO, 2));
    } else {
        assert_eq!(a, baseline);
    }
    drop(vm);
    assert_eq!(vcpu.attr(), baseline, "unregistering restores the baseline");
}
