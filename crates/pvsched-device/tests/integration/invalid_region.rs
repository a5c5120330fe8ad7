//! Every invalid guest region ends in FAILED with its own ERROR code, and
//! the device is usable again after a reset (a full handshake succeeds).

use pvsched_abi as abi;
use pvsched_device::testing::{RecordingSink, driver_ok, guest_handshake, negotiate, reg_write};
use pvsched_device::{DeviceConfig, PvschedDevice};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use vm_memory::{GuestAddress, GuestMemoryMmap};

const NR: u32 = 40; // region_size(40) = 8192
const RAM_LO: (u64, usize) = (0, 0x1_0000);
const RAM_HI: (u64, usize) = (0x10_0000, 0x1_0000);

fn setup(with_memory: bool) -> (PvschedDevice, Arc<RecordingSink>) {
    let sink = Arc::new(RecordingSink::default());
    let mut dev = PvschedDevice::new(DeviceConfig::new(NR), sink.clone()).unwrap();
    if with_memory {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(RAM_LO.0), RAM_LO.1),
            (GuestAddress(RAM_HI.0), RAM_HI.1),
        ])
        .unwrap();
        dev.set_guest_memory(mem);
    }
    (dev, sink)
}

/// Handshake with `gpa`/`size`, expect FAILED with `code`, then reset and
/// check a valid handshake works.
fn refused(dev: &mut PvschedDevice, sink: &RecordingSink, gpa: u64, size: u32, code: u32) {
    negotiate(dev, abi::F_GUEST_REGION);
    reg_write(dev, abi::REG_SHM_GPA_LO, gpa as u32);
    reg_write(dev, abi::REG_SHM_GPA_HI, (gpa >> 32) as u32);
    reg_write(dev, abi::REG_SHM_SIZE, size);
    driver_ok(dev);
    assert_eq!(
        dev.status(),
        0xb | abi::STATUS_FAILED,
        "gpa {gpa:#x} size {size:#x}"
    );
    assert_eq!(dev.error(), code, "gpa {gpa:#x} size {size:#x}");
    assert!(dev.region_view().is_none());
    assert_eq!(sink.balance.load(Ordering::SeqCst), 0);
    // Further status writes are ignored until reset.
    reg_write(dev, abi::REG_STATUS, 0xf);
    assert_eq!(dev.status() & abi::STATUS_DRIVER_OK, 0);
    reg_write(dev, abi::REG_STATUS, 0);
    assert_eq!((dev.status(), dev.error()), (0, abi::ERR_NONE));
    assert_eq!(
        guest_handshake(dev, RAM_HI.0, 0x2000),
        0xf,
        "usable after reset"
    );
    assert!(dev.region_view().is_some());
    reg_write(dev, abi::REG_STATUS, 0);
}

#[test]
fn zero_size() {
    let (mut d, s) = setup(true);
    refused(&mut d, &s, RAM_HI.0, 0, abi::ERR_REGION_ZERO_SIZE);
}

#[test]
fn unaligned() {
    let (mut d, s) = setup(true);
    refused(
        &mut d,
        &s,
        RAM_HI.0 + 0x800,
        0x2000,
        abi::ERR_REGION_UNALIGNED,
    );
    refused(&mut d, &s, RAM_HI.0, 0x2001, abi::ERR_REGION_UNALIGNED);
}

#[test]
fn wrapping() {
    let (mut d, s) = setup(true);
    refused(&mut d, &s, !0xfffu64, 0x2000, abi::ERR_REGION_WRAPS);
    // Ending exactly at 2^64 also wraps.
    refused(&mut d, &s, !0x1fffu64, 0x2000, abi::ERR_REGION_WRAPS);
}

#[test]
fn outside_ram() {
    let (mut d, s) = setup(true);
    // In a hole.
    refused(&mut d, &s, 0x8_0000, 0x2000, abi::ERR_REGION_OUTSIDE_RAM);
    // Straddling the end of a RAM range.
    refused(
        &mut d,
        &s,
        RAM_LO.1 as u64 - 0x1000,
        0x2000,
        abi::ERR_REGION_OUTSIDE_RAM,
    );
    // Far above RAM.
    refused(&mut d, &s, 0xfee0_0000, 0x2000, abi::ERR_REGION_OUTSIDE_RAM);
    // No memory at all.
    let (mut d2, s2) = setup(false);
    negotiate(&mut d2, abi::F_GUEST_REGION);
    reg_write(&mut d2, abi::REG_SHM_SIZE, 0x2000);
    driver_ok(&mut d2);
    assert_eq!(d2.error(), abi::ERR_REGION_OUTSIDE_RAM);
    let _ = s2;
}

#[test]
fn too_small() {
    let (mut d, s) = setup(true);
    assert_eq!(abi::region_size(NR), 0x2000);
    refused(&mut d, &s, RAM_HI.0, 0x1000, abi::ERR_REGION_TOO_SMALL);
}

#[test]
fn changed_after_driver_ok() {
    for reg in [abi::REG_SHM_GPA_LO, abi::REG_SHM_GPA_HI, abi::REG_SHM_SIZE] {
        let (mut d, s) = setup(true);
        assert_eq!(guest_handshake(&mut d, RAM_HI.0, 0x2000), 0xf);
        let view = d.region_view().unwrap();
        reg_write(&mut d, reg, 0x3000);
        assert_eq!(d.status(), 0xb | abi::STATUS_FAILED);
        assert_eq!(d.error(), abi::ERR_REGION_CHANGED);
        assert!(!view.is_attached(), "region detached");
        assert!(d.region_view().is_none());
        assert_eq!(s.detaches.load(Ordering::SeqCst), 1);
        assert_eq!(s.balance.load(Ordering::SeqCst), 0);
        reg_write(&mut d, abi::REG_STATUS, 0);
        assert_eq!(
            guest_handshake(&mut d, RAM_HI.0, 0x2000),
            0xf,
            "usable after reset"
        );
        assert_eq!(d.generation(), 2);
    }
}

#[test]
fn straddling_two_adjacent_ram_ranges() {
    // Two RAM ranges back to back are still two ranges (two host mappings):
    // a region across the boundary is refused.
    let sink = Arc::new(RecordingSink::default());
    let mut dev = PvschedDevice::new(DeviceConfig::new(NR), sink.clone()).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 0x1_0000),
        (GuestAddress(0x1_0000), 0x1_0000),
        (GuestAddress(RAM_HI.0), RAM_HI.1),
    ])
    .unwrap();
    dev.set_guest_memory(mem);
    refused(&mut dev, &sink, 0xf000, 0x2000, abi::ERR_REGION_OUTSIDE_RAM);
    assert_eq!(guest_handshake(&mut dev, 0x1_0000, 0x2000), 0xf);
}
