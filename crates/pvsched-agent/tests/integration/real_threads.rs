//! The agent on real tracepoints with real threads standing in for vCPU
//! threads (no KVM needed): a registered thread whose slot in the mmapped
//! region map says HARDIRQ or an RT task is boosted when it is switched out
//! or woken, capped by the VM's caps, throttled after the max boost, and
//! restored exactly to its baseline (non-default nice) read back with
//! sched_getattr.

use crate::common;

use common::{FakeVcpu, agent, need_bpf, wait_for};
use pvsched_abi::seq::SharedWords;
use pvsched_abi::{CS_HARDIRQ, F_DEVICE_REGION, F_KICK, POLICY_FIFO, POLICY_NORMAL, SlotGuest};
use pvsched_agent::{Agent, RegionSpec, VmSpec, sched};
use pvsched_policy::event::{EV_KICK, EV_WAKEUP};
use pvsched_policy::{BoostKind, Caps, KickPairs, WaitOn};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(10);

fn caps() -> Caps {
    common::cs_boost_caps()
}

#[test]
fn hardirq_boosts_and_clearing_restores_exact_baseline() {
    if !need_bpf("hardirq_boosts_and_clearing_restores_exact_baseline") {
        return;
    }
    let agent = agent();
    let vcpu = FakeVcpu::spawn(3, Duration::from_micros(300));
    let baseline = vcpu.attr();
    assert_eq!((baseline.policy, baseline.nice), (POLICY_NORMAL, 3));
    let vm = common::one_vcpu_vm(&agent, vcpu.tid, caps());
    let region = vm.region().unwrap();
    region.write_guest(
        1,
        0,
        &SlotGuest {
            kern_cs: CS_HARDIRQ,
            ..Default::default()
        },
    );
    let boosted = wait_for("RT boost", LIMIT, || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    assert_eq!(boosted.priority, 2, "critical sections get cs_rt_prio");
    // The host half counts the boosts (its `boost` field follows the
    // thread, which is unboosted each time it blocks: halt_boost is none).
    let host = region.read_host(1, 0).unwrap();
    assert!(host.boosts >= 1);
    region.write_guest(1, 0, &SlotGuest::default());
    // Exactly the baseline, waited for: a boost that gave way to a host
    // thread woken on the vCPU's CPU passes through nice 19 (with the
    // longer slice) until that thread has run.
    wait_for("the exact baseline back", LIMIT, || {
        Some(vcpu.attr()).filter(|a| *a == baseline)
    });
    let st = vm.stats();
    println!(
        "apply latency: p50 {} ns p99 {} ns over {} samples; decisions {}",
        st.apply_p50_ns, st.apply_p99_ns, st.apply_samples, st.decisions
    );
    assert!(st.vcpus[0].counters.boosts >= 1 && st.vcpus[0].counters.boosts_applied >= 1);
}

#[test]
fn guest_rt_prio_99_is_capped_and_drop_restores() {
    if !need_bpf("guest_rt_prio_99_is_capped_and_drop_restores") {
        return;
    }
    let agent = agent();
    let vcpu = FakeVcpu::spawn(1, Duration::from_micros(300));
    let baseline = vcpu.attr();
    let vm = common::one_vcpu_vm(&agent, vcpu.tid, caps());
    vm.region().unwrap().write_guest(
        1,
        0,
        &SlotGuest {
            policy: POLICY_FIFO,
            rt_prio: 99,
            ..Default::default()
        },
    );
    let boosted = wait_for("RT boost", LIMIT, || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    assert_eq!(boosted.priority, 7, "capped to max_rt_prio");
    // Unregistering while boosted restores the baseline.
    drop(vm);
    assert_eq!(vcpu.attr(), baseline);
}

#[test]
fn asking_forever_and_spinning_is_throttled_and_reported() {
    let _cpus = common::cpu_bound();
    if !need_bpf("asking_forever_and_spinning_is_throttled_and_reported") {
        return;
    }
    let agent = agent();
    // Never blocks: its boosted time on a CPU reaches the continuous limit.
    let vcpu = FakeVcpu::spawn_busy(2);
    let baseline = vcpu.attr();
    let c = Caps {
        max_boost_us: 20_000,
        halt_boost: BoostKind::Rt,
        halt_prio: 2,
        throttle_us: 300_000,
        ..caps()
    };
    let vm = common::one_vcpu_vm(&agent, vcpu.tid, c);
    let region = vm.region().unwrap();
    region.write_guest(
        1,
        0,
        &SlotGuest {
            kern_cs: CS_HARDIRQ,
            ..Default::default()
        },
    );
    wait_for("RT boost", LIMIT, || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    wait_for("throttle", LIMIT, || {
        Some(vm.stats()).filter(|s| s.vcpus[0].counters.throttles >= 1)
    });
    // Throttled while the guest still asks: back at baseline, reported in
    // the stats and in the host half of the slot.
    let st = wait_for("throttled at baseline", LIMIT, || {
        let s = vm.stats();
        (s.vcpus[0].throttled == 1 && vcpu.attr() == baseline).then_some(s)
    });
    println!("throttle test stats: {:?}", st.vcpus[0]);
    assert!(st.vcpus[0].counters.throttles >= 1);
    assert_eq!(region.read_host(1, 0).unwrap().throttled, 1);
}

#[test]
fn unregistered_threads_are_never_touched() {
    if !need_bpf("unregistered_threads_are_never_touched") {
        return;
    }
    let agent = agent();
    let vcpu = FakeVcpu::spawn(4, Duration::from_micros(300));
    let other = FakeVcpu::spawn(5, Duration::from_micros(300));
    let before = other.attr();
    let vm = common::one_vcpu_vm(&agent, vcpu.tid, caps());
    vm.region().unwrap().write_guest(
        1,
        0,
        &SlotGuest {
            kern_cs: CS_HARDIRQ,
            ..Default::default()
        },
    );
    wait_for("RT boost", LIMIT, || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    assert_eq!(other.attr(), before);
    // Registering the same thread twice is refused.
    let again = agent.register_vm(VmSpec {
        owner: None,
        emulator_tids: vec![],
        vcpu_tids: vec![vcpu.tid],
        apic_ids: vec![0],
        caps: caps(),
        region: RegionSpec::None,
    });
    assert!(again.is_err());
}

#[test]
fn register_vm_rejects_bad_specs() {
    if !need_bpf("register_vm_rejects_bad_specs") {
        return;
    }
    let agent = agent();
    let tid = pvsched_agent::sched::gettid();
    let bad = [
        VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: vec![],
            apic_ids: vec![],
            caps: caps(),
            region: RegionSpec::None,
        },
        VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: vec![tid],
            apic_ids: vec![],
            caps: caps(),
            region: RegionSpec::None,
        },
        VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: vec![tid],
            apic_ids: vec![0],
            caps: caps(),
            region: RegionSpec::GuestAddrs(vec![]),
        },
        VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: vec![u32::MAX - 1],
            apic_ids: vec![0],
            caps: caps(),
            region: RegionSpec::None,
        },
        VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: vec![tid],
            apic_ids: vec![0],
            caps: Caps {
                max_rt_prio: 100,
                ..caps()
            },
            region: RegionSpec::None,
        },
    ];
    for spec in bad {
        assert!(
            agent.register_vm(spec.clone()).is_err(),
            "{spec:?} accepted"
        );
    }
}

#[test]
fn guest_region_mode_reads_the_slot_in_the_vcpu_threads_context() {
    if !need_bpf("guest_region_mode_reads_the_slot_in_the_vcpu_threads_context") {
        return;
    }
    let agent = agent();
    let vcpu = FakeVcpu::spawn(3, Duration::from_micros(300));
    let baseline = vcpu.attr();
    // The "guest RAM" slot lives in this process (the VMM's address space).
    let slot = Box::new(std::sync::Mutex::new(pvsched_abi::Slot::default()));
    let addr = {
        let mut s = slot.lock().unwrap();
        s.guest.kern_cs = CS_HARDIRQ;
        &s.guest as *const SlotGuest as u64
    };
    let vm = agent
        .register_vm(VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: vec![vcpu.tid],
            apic_ids: vec![0],
            caps: caps(),
            region: RegionSpec::GuestAddrs(vec![addr]),
        })
        .unwrap();
    assert!(vm.region().is_none());
    let boosted = wait_for("RT boost", LIMIT, || {
        Some(vcpu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    assert_eq!(boosted.priority, 2);
    slot.lock().unwrap().guest.kern_cs = 0;
    // As above: through nice 19 if the boost gave way to a host thread.
    wait_for("the exact baseline back", LIMIT, || {
        Some(vcpu.attr()).filter(|a| *a == baseline)
    });
    drop(vm);
}

#[test]
fn wait_on_hint_boosts_the_directed_yield_target() {
    if !need_bpf("wait_on_hint_boosts_the_directed_yield_target") {
        return;
    }
    let agent = agent();
    let sender = FakeVcpu::spawn(0, Duration::from_micros(300));
    let target = FakeVcpu::spawn(2, Duration::from_micros(300));
    let baseline = target.attr();
    let c = Caps {
        yield_boost: BoostKind::Nice,
        yield_prio: -8,
        ..caps()
    };
    let vm = common::device_vm(&agent, &[sender.tid, target.tid], &[], c);
    let region = vm.region().unwrap();
    // vCPU 0 waits on vCPU 1 (slot index + 1 = 2).
    region.write_guest(
        2,
        0,
        &SlotGuest {
            wait_on: 2,
            ..Default::default()
        },
    );
    let a = wait_for("yield boost", LIMIT, || {
        Some(target.attr()).filter(|a| a.nice == -8)
    });
    assert_eq!(a.policy, POLICY_NORMAL);
    let st = wait_for("slot visible", LIMIT, || {
        Some(vm.stats()).filter(|s| s.vcpus[0].yield_slot == 2)
    });
    assert!(st.vcpus[0].slot_hits >= 1);
    assert_eq!(region.read_host(2, 0).unwrap().yield_target, 2);
    region.write_guest(2, 0, &SlotGuest::default());
    let back = wait_for("restore", LIMIT, || {
        Some(target.attr()).filter(|a| *a == baseline)
    });
    assert_eq!(back, baseline);
}

/// `wait_on = "auto"` (the default) lends no yield on a VM with more vCPUs
/// than the CPUs its vCPU threads may run on, where the boosted target
/// would take a CPU that a sibling doing the guest's work holds. Two vCPU
/// threads pinned to one CPU: the agent marks their records, and the
/// guest's wait_on, read in the same slot write as a critical section that
/// boosts the sender, boosts no target; let them run on two CPUs and the
/// agent clears the mark (its affinity read is once a second), and the
/// same wait_on boosts the target.
#[test]
fn wait_on_auto_lends_no_yield_on_a_vm_wider_than_its_cpus() {
    if !need_bpf("wait_on_auto_lends_no_yield_on_a_vm_wider_than_its_cpus") {
        return;
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2
        && !pvsched_testkit::skip_or_fail(
            "wait_on_auto_lends_no_yield_on_a_vm_wider_than_its_cpus",
            "needs 2 CPUs: on one, every 2-vCPU VM is wider than the host",
        )
    {
        return;
    }
    let agent = agent();
    let sender = FakeVcpu::spawn(0, Duration::from_micros(300));
    let target = FakeVcpu::spawn(2, Duration::from_micros(300));
    for t in [sender.tid, target.tid] {
        common::pin(t, 0);
    }
    let baseline = target.attr();
    let c = Caps {
        yield_boost: BoostKind::Nice,
        yield_prio: -8,
        ..caps()
    };
    assert_eq!(c.wait_on, WaitOn::Auto, "the default");
    let vm = common::device_vm(&agent, &[sender.tid, target.tid], &[], c);
    let region = vm.region().unwrap();
    wait_for("the agent's mark on the wide VM", LIMIT, || {
        Some(()).filter(|_| vm.stats().vcpus.iter().all(|v| v.wait_on_off))
    });
    // vCPU 0 in a critical section, waiting on vCPU 1 (slot index + 1).
    region.write_guest(
        2,
        0,
        &SlotGuest {
            kern_cs: CS_HARDIRQ,
            wait_on: 2,
            ..Default::default()
        },
    );
    wait_for("the sender's critical-section boost", LIMIT, || {
        Some(sender.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    let st = vm.stats();
    assert_eq!(
        (st.vcpus[0].yield_slot, target.attr()),
        (0, baseline),
        "no yield slot and no boost for the target on a wide VM"
    );
    for t in [sender.tid, target.tid] {
        common::pin_to(t, &[0, 1]);
    }
    let a = wait_for("the yield boost once the VM fits", LIMIT, || {
        Some(target.attr()).filter(|a| a.nice == -8)
    });
    assert_eq!(a.policy, POLICY_NORMAL);
    assert!(vm.stats().vcpus.iter().all(|v| !v.wait_on_off));
    region.write_guest(2, 0, &SlotGuest::default());
    wait_for("restore", LIMIT, || {
        Some(target.attr()).filter(|a| *a == baseline)
    });
}

/// An emulator thread (QEMU's main loop) holds the VM's
/// halt boost while a vCPU is latency-sensitive, gets nothing once the hold
/// has lapsed, and is restored to its exact baseline on unregistration.
#[test]
fn emulator_thread_follows_the_latency_sensitive_vcpu() {
    if !need_bpf("emulator_thread_follows_the_latency_sensitive_vcpu") {
        return;
    }
    let agent = agent();
    let vcpu = FakeVcpu::spawn(0, Duration::from_micros(300));
    let emu = FakeVcpu::spawn(4, Duration::from_micros(500));
    let baseline = emu.attr();
    let c = Caps {
        halt_boost: BoostKind::Rt,
        halt_prio: 1,
        halt_hold_us: 200_000,
        ..caps()
    };
    let vm = common::device_vm(&agent, &[vcpu.tid], &[emu.tid], c);
    // Nobody asks yet: the emulator thread stays at its baseline.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(emu.attr(), baseline, "no boost before a vCPU asks");
    let region = vm.region().unwrap();
    region.write_guest(
        1,
        0,
        &SlotGuest {
            policy: POLICY_FIFO,
            rt_prio: 5,
            ..Default::default()
        },
    );
    let a = wait_for("emulator halt boost", LIMIT, || {
        Some(emu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    assert_eq!(
        a.priority, 1,
        "the emulator thread gets the halt boost only"
    );
    let st = vm.stats();
    assert_eq!(st.emulators.len(), 1);
    assert_eq!(st.emulators[0].tid, emu.tid);
    assert!(st.emulators[0].counters.boosts >= 1 && st.emulators[0].counters.boosts_applied >= 1);
    // The guest stops asking: after the 200 ms hold the boost is gone.
    region.write_guest(1, 0, &SlotGuest::default());
    let back = wait_for("hold lapses", LIMIT, || {
        Some(emu.attr()).filter(|a| *a == baseline)
    });
    assert_eq!(back, baseline);
    // Asked again, then unregistered while boosted: exact baseline back.
    region.write_guest(
        1,
        0,
        &SlotGuest {
            policy: POLICY_FIFO,
            rt_prio: 5,
            ..Default::default()
        },
    );
    wait_for("boosted again", LIMIT, || {
        Some(emu.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    drop(vm);
    assert_eq!(emu.attr(), baseline, "unregistration restores it");
}

#[test]
fn bad_emulator_lists_are_refused() {
    if !need_bpf("bad_emulator_lists_are_refused") {
        return;
    }
    let agent = agent();
    let vcpu = FakeVcpu::spawn(0, Duration::from_micros(300));
    let spec = |emulator_tids: Vec<u32>| VmSpec {
        owner: None,
        vcpu_tids: vec![vcpu.tid],
        emulator_tids,
        apic_ids: vec![0],
        caps: caps(),
        region: RegionSpec::None,
    };
    for (bad, why) in [
        (vec![vcpu.tid], "listed twice"),
        (vec![vcpu.tid + 1_000_000], "does not exist"),
        (vec![vcpu.tid; 5], "at most 4"),
    ] {
        let e = agent.register_vm(spec(bad)).err().expect("refused");
        assert!(e.to_string().contains(why), "{e}");
    }
}

/// A thread that wakes its partner every `period` (a vCPU kicking a
/// sibling): the partner blocks on a channel the waker sends on, so each
/// wake-up runs in the waker's context, as a vCPU's IPI to a halted
/// sibling does under KVM.
struct KickingPair {
    waker: u32,
    woken: u32,
    stop: Arc<AtomicBool>,
    joins: Vec<std::thread::JoinHandle<()>>,
}

impl KickingPair {
    fn spawn(period: Duration) -> KickingPair {
        let stop = Arc::new(AtomicBool::new(false));
        let (kick, kicked) = std::sync::mpsc::channel::<bool>();
        let (woken_tx, woken_rx) = std::sync::mpsc::channel();
        let (waker_tx, waker_rx) = std::sync::mpsc::channel();
        let woken = std::thread::spawn(move || {
            woken_tx.send(sched::gettid()).unwrap();
            while let Ok(true) = kicked.recv() {}
        });
        let s2 = stop.clone();
        let waker = std::thread::spawn(move || {
            waker_tx.send(sched::gettid()).unwrap();
            while !s2.load(Ordering::Relaxed) {
                std::thread::sleep(period);
                let _ = kick.send(true);
            }
            let _ = kick.send(false);
        });
        KickingPair {
            waker: waker_rx.recv().unwrap(),
            woken: woken_rx.recv().unwrap(),
            stop,
            joins: vec![waker, woken],
        }
    }
}

impl Drop for KickingPair {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for j in self.joins.drain(..) {
            let _ = j.join();
        }
    }
}

/// With `kick_pairs = "auto"` and a guest whose driver did not negotiate
/// `F_WAIT_ON`, a vCPU thread waking a sibling costs the policy a KICK event
/// only while the waker is boosted: a batch guest's vCPUs wake each other
/// all the time and pay for no event of the waker's; with `"on"` every such
/// wake-up is one.
#[test]
fn auto_kick_pairs_run_the_wakers_event_only_while_it_is_boosted() {
    if !need_bpf("auto_kick_pairs_run_the_wakers_event_only_while_it_is_boosted") {
        return;
    }
    let kicks = |agent: &Agent| agent.bpf_stats().unwrap().events[EV_KICK as usize];
    let wakeups = |agent: &Agent| agent.bpf_stats().unwrap().events[EV_WAKEUP as usize];
    for mode in [KickPairs::Auto, KickPairs::On] {
        let agent = agent();
        let pair = KickingPair::spawn(Duration::from_millis(1));
        let c = Caps {
            kick_pairs: mode,
            ..caps()
        };
        let vm = common::device_vm(&agent, &[pair.waker, pair.woken], &[], c);
        let region = vm.region().unwrap();
        // What the device writes at DRIVER_OK for a Linux < 6.3 guest.
        region.words().store(
            std::mem::offset_of!(pvsched_abi::RegionHeader, driver_features_lo),
            (F_DEVICE_REGION | F_KICK) as u32,
            Ordering::Release,
        );
        // However slow the host: counted over 50 of the pair's wake-ups
        // at least, not over a fixed time.
        let (k0, w0) = (kicks(&agent), wakeups(&agent));
        let w1 = wait_for("50 wake-ups of the pair", LIMIT, || {
            Some(wakeups(&agent)).filter(|&w| w - w0 >= 50)
        });
        let k1 = kicks(&agent);
        println!(
            "{mode:?}, waker unboosted: {} wake-ups, {} kick events",
            w1 - w0,
            k1 - k0
        );
        match mode {
            KickPairs::Auto => assert_eq!(k1, k0, "an unboosted waker's kicks are skipped"),
            _ => {
                wait_for("50 kick events with \"on\"", LIMIT, || {
                    Some(kicks(&agent)).filter(|&k| k - k0 >= 50)
                });
            }
        }
        if mode != KickPairs::Auto {
            continue;
        }
        // The waker's guest runs an RT task: it is boosted, and its kicks
        // are events again (kick_record() may pair them).
        region.write_guest(
            2,
            0,
            &SlotGuest {
                policy: POLICY_FIFO,
                rt_prio: 1,
                ..Default::default()
            },
        );
        wait_for("the waker boosted", LIMIT, || {
            Some(sched::get(pair.waker).unwrap()).filter(|a| a.policy == POLICY_FIFO)
        });
        let k2 = kicks(&agent);
        let k3 = wait_for("50 kick events of the boosted waker", LIMIT, || {
            Some(kicks(&agent)).filter(|&k| k - k2 >= 50)
        });
        println!("{mode:?}, waker boosted: {} kick events", k3 - k2);
    }
}
