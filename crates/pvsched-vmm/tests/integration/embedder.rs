//! Real KVM: the seams other components use. The BAR2 backing comes from
//! the embedder (as the agent's mmapable BPF array map will), the device
//! reports to the embedder's policy sink, and the guest's slot writes show
//! up in the embedder's own mapping with no copy.

use crate::common;

use pvsched_abi as abi;
use pvsched_device::{PolicySink, PvschedDevice, RegionInfo, RegionMode};
use pvsched_vmm::{Run, RunConfig, Workload, memory};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Recorder {
    attached: Mutex<Vec<(RegionMode, u32, u64)>>,
}

impl PolicySink for Recorder {
    fn region_attached(&self, r: &RegionInfo) {
        self.attached
            .lock()
            .unwrap()
            .push((r.mode, r.nr_vcpus, r.guest_addr));
    }
}

#[test]
fn embedder_backing_and_sink_see_the_guest() {
    if !common::kvm_available() {
        return;
    }
    let backing = memory::memfd_region(c"test-bar2", PvschedDevice::region_bar_size(2)).unwrap();
    let sink = Arc::new(Recorder::default());
    let mut vm = common::config(2, Workload::Idle);
    vm.device_region = Some(backing.clone());
    vm.policy_sink = Some(sink.clone());
    let run = Run::start(&RunConfig::new(vm, Duration::from_secs(1))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !run.progress().ready {
        assert!(Instant::now() < deadline, "guest never became ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    let bar2 = run.vm().bar2_memslot().expect("BAR2 mapped");
    assert_eq!(
        sink.attached.lock().unwrap().as_slice(),
        &[(RegionMode::Device, 2, bar2)]
    );
    // Read the guest half of slot 1 straight from the embedder's mapping.
    let slots = abi::slots_offset(2) as usize;
    let at = |off: usize| -> u32 {
        assert!(off + 4 <= backing.size());
        // SAFETY: in bounds of the live mapping (checked above); u32 reads
        // of shared memory are fine for any bit pattern.
        unsafe { std::ptr::read_volatile(backing.as_ptr().add(off) as *const u32) }
    };
    assert_eq!(at(0), abi::REGION_MAGIC);
    let slot1 = slots + abi::SLOT_SIZE as usize;
    assert_eq!(at(slot1), 2 * 17, "seq after 16 + 1 updates");
    assert_eq!(at(slot1 + 8), abi::POLICY_NORMAL, "policy after the burst");
    assert_eq!(at(slot1 + 16), 0, "rt_prio after the burst");
    let tids = run.vm().vcpu_tids();
    assert_eq!(tids.len(), 2);
    assert!(tids.iter().all(|t| *t > 0));
    assert_eq!(run.vm().apic_ids(), &[0, 1]);
    let r = run.finish();
    assert!(r.clean_shutdown);
}
