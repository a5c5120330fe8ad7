//! Real KVM: the ipi, spin, wakeup, hostile and greedy workloads.

use crate::common;

use pvsched_abi as abi;
use pvsched_device::RegionMode;
use pvsched_vmm::vm::PVSCHED_DEVICE;
use pvsched_vmm::{Run, RunConfig, VcpuEnd, Workload};
use std::time::{Duration, Instant};

#[test]
fn ipi_workload_delivers_every_ipi_it_sent() {
    if !common::kvm_available() {
        return;
    }
    let r = common::run(common::config(2, Workload::Ipi), 1.0);
    assert!(r.driver_ok());
    assert!(r.clean_shutdown);
    let (a, b) = (&r.per_vcpu[0], &r.per_vcpu[1]);
    assert!(a.ipi_sent > 0, "no IPI sent");
    assert_eq!(b.ipi_received, a.ipi_sent, "every ping arrived: {r:#?}");
    // Each completed round trip is one pong back at vCPU 0.
    assert!(a.events == a.ipi_sent || a.events + 1 == a.ipi_sent);
    assert_eq!(a.fault, None);
    assert_eq!(b.fault, None);
}

#[test]
fn ipi_workload_with_an_odd_vcpu_out() {
    if !common::kvm_available() {
        return;
    }
    let r = common::run(common::config(3, Workload::Ipi), 0.5);
    assert!(r.clean_shutdown);
    assert_eq!(
        r.per_vcpu[1].ipi_received, r.per_vcpu[0].ipi_sent,
        "{:#?}",
        r.per_vcpu
    );
    assert_eq!(r.per_vcpu[2].events, 0, "vCPU 2 has no partner");
}

#[test]
fn spin_workload_publishes_wait_on() {
    if !common::kvm_available() {
        return;
    }
    let run = Run::start(&RunConfig::new(
        common::config(2, Workload::Spin),
        Duration::from_secs(1),
    ))
    .expect("start");
    // While vCPU 0 spins its slot says whom it waits for: slot 1.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = false;
    while !seen && Instant::now() < deadline {
        if let Some(view) = run.vm().region_view()
            && let Ok(g) = view.read_guest_slot(0)
        {
            seen = g.wait_on == Some(1) && g.kern_cs == abi::CS_PREEMPT_OFF;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let r = run.finish();
    assert!(seen, "never saw wait_on = slot 1 in vCPU 0's slot");
    assert!(r.clean_shutdown);
    assert!(r.per_vcpu[0].spins > 0);
    assert!(r.per_vcpu[0].pause_iterations >= r.per_vcpu[0].spins);
    assert!(r.per_vcpu[1].events >= r.per_vcpu[0].spins);
}

#[test]
fn wakeup_workload_times_injected_interrupts() {
    if !common::kvm_available() {
        return;
    }
    let r = common::run(common::config(2, Workload::Wakeup), 1.0);
    assert!(r.driver_ok());
    assert!(r.clean_shutdown);
    for v in &r.per_vcpu {
        assert!(v.events > 0, "vCPU {} was never woken", v.index);
        assert!(v.samples > 0);
        // The handler asks for RT (FIFO 1, HARDIRQ) and clears its slot
        // again before it halts: after the run the slot asks for nothing.
        let g = v.guest_slot.as_ref().expect("slot read back");
        assert_eq!(g.kern_cs, 0);
        assert_eq!(g.policy, abi::POLICY_NORMAL, "vCPU {}: {g:?}", v.index);
        assert_eq!(g.rt_prio, 0, "vCPU {}: {g:?}", v.index);
        assert_eq!(g.wait_on, None);
        // The burst (16) and its final write, then two writes per wakeup.
        assert!(g.updates > 16 + 1);
        assert_eq!((g.updates - 17) % 2, 0, "every wakeup cleared its slot");
        assert_eq!(g.seq % 2, 0);
    }
    assert!(r.p50_us.is_some() && r.p99_us.is_some() && r.max_us.is_some());
}

#[test]
fn hostile_guest_is_refused_and_the_vmm_keeps_running() {
    hostile(RegionMode::Device);
}

#[test]
fn hostile_guest_in_guest_region_mode() {
    hostile(RegionMode::Guest);
}

fn hostile(region: RegionMode) {
    if !common::kvm_available() {
        return;
    }
    let mut vm = common::config(2, Workload::Hostile);
    vm.region = region;
    let run = Run::start(&RunConfig::new(vm, Duration::from_secs(1))).expect("start");
    let deadline = Instant::now() + Duration::from_secs(20);
    while run.vm().monitor().stats(0).hostile.len() < 7 {
        assert!(Instant::now() < deadline, "hostile guest did not finish");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The VMM still serves configuration space and the device still answers.
    let id = run.vm().pci().config_read(PVSCHED_DEVICE, 0);
    assert_eq!(
        id,
        u32::from(abi::PCI_DEVICE_ID) << 16 | u32::from(abi::PCI_VENDOR_ID)
    );
    let r = run.finish();
    assert!(r.clean_shutdown, "{:?}", r.per_vcpu);
    assert_eq!(r.per_vcpu[0].fault, None);
    let steps = &r.per_vcpu[0].hostile;
    let expected = [
        (1, abi::ERR_BAD_SEQUENCE),
        (2, abi::ERR_FEATURES_UNSUPPORTED),
        (3, abi::ERR_REGION_UNALIGNED),
        (4, abi::ERR_REGION_OUTSIDE_RAM),
        (5, abi::ERR_VERSION_MISMATCH),
    ];
    assert_eq!(&steps[..5], &expected);
    assert_eq!(steps[5].0, 6);
    assert_eq!(steps[6].0, 7);
    // The first handshake (before the garbage) had succeeded.
    assert!(r.driver_ok());
}

#[test]
fn greedy_workload_asks_for_rt_spins_and_stops() {
    if !common::kvm_available() {
        return;
    }
    let run = Run::start(&RunConfig::new(
        common::config(2, Workload::Greedy),
        Duration::from_millis(500),
    ))
    .expect("start");
    let monitor = run.vm().monitor().clone();
    for v in 0..2 {
        assert!(monitor.stats(v).ready, "vCPU {v} never reported READY");
    }
    // While they spin every slot asks for RT: FIFO 1, no critical section
    // (written just after READY, so give the guest a moment).
    let view = run.vm().region_view().expect("region attached");
    let deadline = Instant::now() + Duration::from_secs(1);
    for slot in 0..2 {
        let g = loop {
            let g = view.read_guest_slot(slot).expect("slot readable");
            if g.policy == abi::POLICY_FIFO || Instant::now() > deadline {
                break g;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!((g.policy, g.rt_prio), (abi::POLICY_FIFO, 1), "{g:?}");
        assert_eq!(g.kern_cs, 0);
        assert_eq!(g.wait_on, None);
    }
    std::thread::sleep(Duration::from_millis(100));
    let spinning = run.vm().greedy_loops(0);
    assert!(spinning > 0, "vCPU 0 is not spinning");
    let r = run.finish();
    assert!(r.driver_ok(), "{}", r.handshake);
    assert!(r.clean_shutdown, "{:?}", r.per_vcpu);
    for v in &r.per_vcpu {
        let s = monitor.stats(v.index);
        assert!(s.done, "vCPU {} did not see the stop flag", v.index);
        assert_eq!(v.fault, None);
        assert_eq!(v.end, Some(VcpuEnd::Stopped));
        assert!(v.greedy_loops > 0, "vCPU {} never looped", v.index);
        // Asking forever: the slot still says FIFO 1 after the run.
        let g = v.guest_slot.as_ref().expect("slot read back");
        assert_eq!((g.policy, g.rt_prio), (abi::POLICY_FIFO, 1));
    }
    assert!(r.per_vcpu[0].greedy_loops >= spinning);
    assert_eq!(r.samples, 0, "greedy takes no latency samples");
}
