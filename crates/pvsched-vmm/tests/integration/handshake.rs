//! Real KVM: the test guest negotiates the region in both modes, writes
//! its slot, and (device-region mode) does so without a single MMIO exit.

use crate::common;

use pvsched_abi as abi;
use pvsched_device::RegionMode;
use pvsched_vmm::guest::layout::GUEST_REGION_GPA;
use pvsched_vmm::vm::PVSCHED_DEVICE;
use pvsched_vmm::{Run, RunConfig, Vm, Workload};
use std::time::{Duration, Instant};

const BURST: u32 = 200;

/// Start `cfg`, wait until every vCPU is in its workload loop, check the
/// region from the host side while the VM runs, then finish.
fn handshake(region: RegionMode, bar2_move: Option<u32>) {
    if !common::kvm_available() {
        return;
    }
    let mut vm = common::config(2, Workload::Idle);
    vm.region = region;
    vm.slot_burst = BURST;
    vm.bar2_move = bar2_move;
    let run = Run::start(&RunConfig::new(vm, Duration::from_secs(1))).expect("start");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !run.progress().ready {
        assert!(Instant::now() < deadline, "guest never became ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    let view = run.vm().region_view().expect("region attached");
    let info = view.info().clone();
    match region {
        RegionMode::Guest => {
            assert_eq!(info.guest_addr, GUEST_REGION_GPA);
            assert!(run.vm().bar2_memslot().is_some(), "BAR2 stays mapped");
        }
        RegionMode::Device => {
            // The region is BAR2, and BAR2 is a memslot at its address.
            assert_eq!(run.vm().bar2_memslot(), Some(info.guest_addr));
            if let Some(moved) = bar2_move {
                assert_eq!(info.guest_addr, u64::from(moved));
            }
        }
    }
    let header = view.read_header();
    assert_eq!(header.magic, abi::REGION_MAGIC);
    assert_eq!(header.nr_vcpus, 2);
    for slot in 0..2 {
        assert_eq!(view.apic_id(slot), Some(slot));
        let g = view.read_guest_slot(slot).expect("slot readable");
        assert_eq!(g.seq % 2, 0);
        // The burst, then one final update: nothing special (NORMAL, rt_prio 0).
        assert_eq!(g.updates, u64::from(BURST) + 1);
        assert_eq!(g.seq, 2 * (BURST + 1));
        assert_eq!(g.rt_prio, 0);
        assert_eq!(g.policy, abi::POLICY_NORMAL);
        assert_eq!(g.kern_cs, 0);
        assert_eq!(g.wait_on, None);
    }
    let report = run.finish();
    assert!(report.driver_ok(), "handshake: {}", report.handshake);
    assert_eq!(report.handshake, "DRIVER_OK");
    assert_eq!(report.console, pvsched_vmm::guest::program::BANNER);
    assert!(report.clean_shutdown);
    for (i, v) in report.per_vcpu.iter().enumerate() {
        assert_eq!(v.slot, Some(i as u32));
        assert_eq!(v.apic_id, Some(i as u32));
        assert_eq!(v.burst_updates, Some(BURST));
        assert_eq!(v.fault, None);
        // Slot writes are plain memory writes in both modes: RAM in guest
        // mode, a memslot in device mode. Not one MMIO exit.
        assert_eq!(v.burst_mmio_exits, Some(0), "vCPU {i}");
    }
    // vCPU 1 never touches the registers: no MMIO exit at all.
    assert_eq!(report.per_vcpu[1].mmio_exits, 0);
    assert!(
        report.per_vcpu[0].mmio_exits > 0,
        "vCPU 0 did the handshake"
    );
}

#[test]
fn device_region_handshake_and_zero_exit_slot_updates() {
    handshake(RegionMode::Device, None);
}

#[test]
fn guest_region_handshake() {
    handshake(RegionMode::Guest, None);
}

#[test]
fn guest_moves_bar2_and_the_memslot_follows() {
    handshake(RegionMode::Device, Some(0xd000_0000));
}

#[test]
fn host_config_writes_move_and_disable_the_bar2_memslot() {
    if !common::kvm_available() {
        return;
    }
    let vm = Vm::new(common::config(1, Workload::Idle)).expect("vm");
    let pci = vm.pci();
    let bar2 = pci.config_read(PVSCHED_DEVICE, 6) & !0xf;
    assert!(bar2 >= 0xc000_0000, "firmware placed BAR2 in the MMIO hole");
    assert_eq!(vm.bar2_memslot(), Some(u64::from(bar2)));
    // Move it.
    pci.config_write(PVSCHED_DEVICE, 6, 0, &0xe000_0000u32.to_le_bytes());
    assert_eq!(vm.bar2_memslot(), Some(0xe000_0000));
    // Disable memory decoding: the slot goes away.
    let cmd = pci.config_read(PVSCHED_DEVICE, 1) as u16;
    pci.config_write(PVSCHED_DEVICE, 1, 0, &(cmd & !0x2).to_le_bytes());
    assert_eq!(vm.bar2_memslot(), None);
    // Re-enable: back at the programmed address.
    pci.config_write(PVSCHED_DEVICE, 1, 0, &(cmd | 0x2).to_le_bytes());
    assert_eq!(vm.bar2_memslot(), Some(0xe000_0000));
    // A BAR over guest RAM: KVM refuses the overlapping slot, the VMM logs
    // and carries on with the BAR unmapped.
    pci.config_write(PVSCHED_DEVICE, 6, 0, &0x0001_0000u32.to_le_bytes());
    assert_eq!(vm.bar2_memslot(), None);
    let report = vm.shutdown();
    assert!(report.vcpu_ends.is_empty(), "never started");
}
