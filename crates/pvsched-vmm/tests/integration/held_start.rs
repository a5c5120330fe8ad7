//! Real KVM: the held start an embedded host policy uses. The vCPU threads
//! exist (TIDs known) before the guest runs, the embedder replaces BAR2's
//! backing then (as `pvsched run --policy embedded` does with the agent's
//! BPF map, which it can only get once the TIDs are registered), and the
//! guest's handshake and slot writes land in the replacement.

use crate::common;

use pvsched_abi as abi;
use pvsched_device::PvschedDevice;
use pvsched_vmm::{Run, RunConfig, Vm, Workload, memory};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn device_region_replaced_while_held_is_what_the_guest_uses() {
    if !common::kvm_available() {
        return;
    }
    let mut vm = Vm::new(common::config(2, Workload::Idle)).unwrap();
    vm.start_held().unwrap();
    let tids = vm.vcpu_tids();
    assert_eq!(tids.len(), 2);
    assert!(
        tids.iter().all(|&t| t > 0),
        "TIDs known before the guest runs"
    );
    let mine = memory::memfd_region(c"held-bar2", PvschedDevice::region_bar_size(2)).unwrap();
    vm.set_device_region(mine.clone()).unwrap();
    vm.release();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !vm.monitor().all_ready() {
        assert!(Instant::now() < deadline, "guest never got ready");
        std::thread::sleep(Duration::from_millis(1));
    }
    let view = vm.region_view().expect("DRIVER_OK");
    assert_eq!(view.info().host_addr, mine.as_ptr() as usize);
    assert!(Arc::ptr_eq(&vm.bar2_backing().unwrap(), &mine));
    // The guest's slot burst was written into our mapping, through the memslot.
    let off = abi::slot_offset(2, 0) as usize;
    // SAFETY: `off` + 64 is inside `mine` (region_bar_size(2) >= region_size(2)),
    // which is alive; a volatile read of guest-written shared memory.
    let seq = unsafe { std::ptr::read_volatile(mine.as_ptr().add(off).cast::<u32>()) };
    assert!(seq >= 2 && seq % 2 == 0, "slot 0 seq {seq}");
    // Once the guest runs the backing can no longer be swapped.
    let other = memory::memfd_region(c"late-bar2", PvschedDevice::region_bar_size(2)).unwrap();
    assert!(vm.set_device_region(other).is_err());
    assert!(vm.shutdown().clean());
}

#[test]
fn start_with_error_stops_the_held_vcpus() {
    if !common::kvm_available() {
        return;
    }
    let cfg = RunConfig::new(common::config(2, Workload::Idle), Duration::from_secs(1));
    let r = Run::start_with(&cfg, |vm| {
        assert_eq!(vm.vcpu_tids().len(), 2);
        Err(pvsched_vmm::Error::Config("attach refused".into()))
    });
    assert!(matches!(r, Err(pvsched_vmm::Error::Config(_))));
}
