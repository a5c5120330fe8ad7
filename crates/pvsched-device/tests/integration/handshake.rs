//! Handshake in both region modes up to DRIVER_OK, checked byte by byte in
//! memory, plus features/version refusals and reset behaviour.

use pvsched_abi as abi;
use pvsched_device::testing::{
    RecordingSink, device_handshake, driver_ok, guest_handshake, map_bar2, negotiate, reg_read,
    reg_write,
};
use pvsched_device::{
    BarIndex, DeviceConfig, GuestSlotState, PciDevice, PvschedDevice, RegionMode, SlotError,
};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap, MmapRegion, VolatileMemory};

const NR: u32 = 3;
const GPA: u64 = 0x10_0000;

fn device(nr: u32) -> (PvschedDevice, Arc<RecordingSink>) {
    let sink = Arc::new(RecordingSink::default());
    let mut cfg = DeviceConfig::new(nr);
    cfg.apic_ids = (0..nr).map(|i| 0x10 + 2 * i).collect();
    let dev = PvschedDevice::new(cfg, sink.clone()).unwrap();
    assert_eq!(sink.vcpus.load(Ordering::SeqCst), nr);
    (dev, sink)
}

fn ram() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1_0000), (GuestAddress(GPA), 0x1_0000)])
        .unwrap()
}

fn le32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

/// Check header and APIC table bytes of a freshly attached region whose
/// driver negotiated `features` (testing::*_handshake).
fn check_layout(bytes: &[u8], generation: u32, features: u64) {
    assert_eq!(&bytes[0..4], b"PVSR");
    assert_eq!(le32(bytes, 0), abi::REGION_MAGIC);
    assert_eq!(le32(bytes, 4), abi::ABI_VERSION);
    assert_eq!(le32(bytes, 8), NR);
    assert_eq!(le32(bytes, 12), abi::SLOT_SIZE);
    assert_eq!(le32(bytes, 16), abi::HEADER_SIZE);
    assert_eq!(le32(bytes, 20), abi::APIC_TABLE_OFFSET);
    assert_eq!(le32(bytes, 24), abi::slots_offset(NR));
    assert_eq!(le32(bytes, 28), generation);
    assert_eq!(le32(bytes, 32), 0, "host_flags from NullSink-like sink");
    // What the driver negotiated, for the host policy (1.3).
    assert_eq!(le32(bytes, 36), features as u32, "driver_features_lo");
    assert_eq!(
        le32(bytes, 40),
        (features >> 32) as u32,
        "driver_features_hi"
    );
    // The ABI the driver said it speaks, for operators (1.6): the
    // handshakes write this build's DRIVER_VERSION.
    assert_eq!(le32(bytes, 44), abi::ABI_VERSION, "driver_version");
    assert!(
        bytes[48..64].iter().all(|&b| b == 0),
        "reserved header words zero"
    );
    for i in 0..NR as usize {
        assert_eq!(
            le32(bytes, 64 + 4 * i),
            0x10 + 2 * i as u32,
            "apic id of slot {i}"
        );
    }
    for i in 0..NR {
        let host = abi::slot_offset(NR, i) as usize + 64;
        assert!(
            bytes[host..host + 64].iter().all(|&b| b == 0),
            "host half {i} zeroed"
        );
    }
}

#[test]
fn guest_region_handshake_reaches_driver_ok() {
    let (mut dev, sink) = device(NR);
    let mem = ram();
    // Dirty the host halves first: attach must zero them.
    mem.write_slice(&[0xff; 4096], GuestAddress(GPA)).unwrap();
    dev.set_guest_memory(mem.clone());
    assert_eq!(reg_read(&mut dev, abi::REG_MAGIC), abi::MAGIC);
    assert_eq!(reg_read(&mut dev, abi::REG_NR_VCPUS), NR);
    assert_eq!(reg_read(&mut dev, abi::REG_REGION_SIZE), 4096);
    let st = guest_handshake(&mut dev, GPA, 4096);
    assert_eq!(st, 0xf, "ACK|DRIVER|FEATURES_OK|DRIVER_OK");
    assert_eq!(dev.error(), abi::ERR_NONE);
    assert_eq!(reg_read(&mut dev, abi::REG_GENERATION), 1);

    let mut bytes = vec![0u8; 4096];
    mem.read_slice(&mut bytes, GuestAddress(GPA)).unwrap();
    check_layout(
        &bytes,
        1,
        abi::F_GUEST_REGION | abi::F_WAIT_ON | abi::F_KICK,
    );

    let view = dev.region_view().unwrap();
    assert_eq!(view.info().mode, RegionMode::Guest);
    assert_eq!(view.info().guest_addr, GPA);
    assert_eq!(view.info().generation, 1);
    assert_eq!(sink.attaches.load(Ordering::SeqCst), 1);
    assert_eq!(sink.last.lock().unwrap().as_ref(), Some(view.info()));
    assert_eq!(view.apic_id(2), Some(0x14));

    // Guest writes slot 1 with the seq protocol through raw guest memory.
    let slot1 = GPA + u64::from(abi::slot_offset(NR, 1));
    let g = abi::SlotGuest {
        seq: 2,
        kern_cs: abi::CS_HARDIRQ,
        policy: abi::POLICY_FIFO,
        nice: 0,
        rt_prio: 42,
        wait_on: 3,
        updates: 7,
        ..Default::default()
    };
    mem.write_obj(1u32, GuestAddress(slot1)).unwrap();
    mem.write_obj(g, GuestAddress(slot1)).unwrap();
    let s = view.read_guest_slot(1).unwrap();
    assert_eq!(
        s,
        GuestSlotState {
            seq: 2,
            kern_cs: abi::CS_HARDIRQ,
            policy: abi::POLICY_FIFO,
            nice: 0,
            rt_prio: 42,
            wait_on: Some(2),
            lock_wait: false,
            task_flags: 0,
            updates: 7,
            wakes: 0,
            waits: 0,
            clamped: false
        }
    );

    // Host half written by the device is visible in guest memory.
    let h = abi::SlotHost {
        vcpu_state: abi::VCPU_PREEMPTED,
        boost: abi::BOOST_RT,
        boost_prio: 10,
        boosts: 5,
        ..Default::default()
    };
    view.write_host_slot(1, &h).unwrap();
    view.write_host_slot(1, &h).unwrap();
    let back: abi::SlotHost = mem.read_obj(GuestAddress(slot1 + 64)).unwrap();
    assert_eq!(back, abi::SlotHost { seq: 4, ..h });
    assert_eq!(view.read_host_slot(1).unwrap(), back);

    // Kick reaches the sink only for valid slots.
    reg_write(&mut dev, abi::REG_KICK, 2);
    reg_write(&mut dev, abi::REG_KICK, NR);
    assert_eq!(sink.kicks.load(Ordering::SeqCst), 1);

    // Reset: the view stops working, the sink is told.
    reg_write(&mut dev, abi::REG_STATUS, 0);
    assert_eq!(dev.status(), 0);
    assert!(dev.region_view().is_none());
    assert_eq!(view.read_guest_slot(1), Err(SlotError::Detached));
    assert_eq!(view.write_host_slot(1, &h), Err(SlotError::Detached));
    assert_eq!(sink.detaches.load(Ordering::SeqCst), 1);
    reg_write(&mut dev, abi::REG_KICK, 0);
    assert_eq!(sink.kicks.load(Ordering::SeqCst), 1, "no kick after reset");
    // GENERATION survives reset and increments on the next attach.
    assert_eq!(guest_handshake(&mut dev, GPA, 4096), 0xf);
    assert_eq!(dev.generation(), 2);
}

#[test]
fn device_region_handshake_reaches_driver_ok() {
    let (mut dev, sink) = device(NR);
    let size = PvschedDevice::region_bar_size(NR) as usize;
    let backing = Arc::new(MmapRegion::new(size).unwrap());
    backing
        .get_slice(0, size)
        .unwrap()
        .write_slice(&vec![0xffu8; size], 0)
        .unwrap();
    dev.set_device_region(backing.clone()).unwrap();
    assert_eq!(device_handshake(&mut dev, 0xc000_0000), 0xf);
    let mut bytes = vec![0u8; size];
    backing
        .get_slice(0, size)
        .unwrap()
        .read_slice(&mut bytes, 0)
        .unwrap();
    check_layout(
        &bytes,
        1,
        abi::F_DEVICE_REGION | abi::F_WAIT_ON | abi::F_KICK,
    );
    let view = dev.region_view().unwrap();
    assert_eq!(view.info().mode, RegionMode::Device);
    assert_eq!(view.info().guest_addr, 0xc000_0000);
    assert_eq!(view.info().host_addr, backing.as_ptr() as usize);
    assert_eq!(sink.balance.load(Ordering::SeqCst), 1);

    // Guest writes its half through BAR2 MMIO (a transport that cannot map BAR2).
    let slot0 = u64::from(abi::slot_offset(NR, 0));
    let g = abi::SlotGuest {
        policy: abi::POLICY_NORMAL,
        nice: -5,
        wait_on: 1,
        updates: 1,
        ..Default::default()
    };
    dev.write_bar(BarIndex(2), slot0, &1u32.to_le_bytes());
    let gb = vm_memory::ByteValued::as_slice(&g);
    for (i, chunk) in gb.chunks(4).enumerate().skip(1) {
        dev.write_bar(BarIndex(2), slot0 + 4 * i as u64, chunk);
    }
    dev.write_bar(BarIndex(2), slot0, &2u32.to_le_bytes());
    let s = view.read_guest_slot(0).unwrap();
    assert_eq!((s.seq, s.nice, s.wait_on, s.updates), (2, -5, Some(0), 1));

    // Host half visible in the backing and through BAR2 reads.
    view.write_host_slot(
        0,
        &abi::SlotHost {
            throttled: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let mut b = [0u8; 4];
    dev.read_bar(BarIndex(2), slot0 + 64 + 16, &mut b);
    assert_eq!(u32::from_le_bytes(b), 1);
    let mut b8 = [0u8; 8];
    dev.read_bar(BarIndex(2), 0, &mut b8);
    assert_eq!(&b8[..4], b"PVSR");
    // Out of bounds BAR2 access reads 0.
    dev.read_bar(BarIndex(2), size as u64 - 2, &mut b);
    assert_eq!(b, [0; 4]);
    dev.read_bar(BarIndex(2), u64::MAX, &mut b);
    assert_eq!(b, [0; 4]);

    // Moving BAR2 while attached is reported but keeps the region attached.
    let r = dev.write_config_register(6, 0, &0xd000_0000u32.to_le_bytes());
    assert_eq!(r.bar_changes.len(), 1);
    assert!(view.is_attached());

    // Replacing the backing while attached forces a reset.
    dev.set_device_region(Arc::new(MmapRegion::new(size).unwrap()))
        .unwrap();
    assert_eq!(
        dev.status() & abi::STATUS_DEVICE_NEEDS_RESET,
        abi::STATUS_DEVICE_NEEDS_RESET
    );
    assert_eq!(dev.status() & abi::STATUS_DRIVER_OK, 0);
    assert_eq!(dev.error(), abi::ERR_DEVICE_FAILED);
    assert!(!view.is_attached());
    reg_write(&mut dev, abi::REG_STATUS, 0);
    assert_eq!(device_handshake(&mut dev, 0xc000_0000), 0xf);
}

#[test]
fn device_region_needs_decoded_bar_and_backing() {
    let (mut dev, _) = device(NR);
    negotiate(&mut dev, abi::F_DEVICE_REGION);
    driver_ok(&mut dev);
    assert_eq!(dev.status(), 0xb | abi::STATUS_FAILED);
    assert_eq!(dev.error(), abi::ERR_REGION_UNMAPPED);
    reg_write(&mut dev, abi::REG_STATUS, 0);
    map_bar2(&mut dev, 0xc000_0000);
    negotiate(&mut dev, abi::F_DEVICE_REGION);
    driver_ok(&mut dev);
    assert_eq!(dev.error(), abi::ERR_REGION_UNAVAILABLE);
    assert_eq!(dev.status() & abi::STATUS_FAILED, abi::STATUS_FAILED);
    reg_write(&mut dev, abi::REG_STATUS, 0);
    let size = PvschedDevice::region_bar_size(NR) as usize;
    assert!(
        dev.set_device_region(Arc::new(MmapRegion::new(size * 2).unwrap()))
            .is_err()
    );
    dev.set_device_region(Arc::new(MmapRegion::new(size).unwrap()))
        .unwrap();
    assert_eq!(device_handshake(&mut dev, 0xc000_0000), 0xf);
}

#[test]
fn feature_refusals() {
    let (mut dev, _) = device(NR);
    dev.set_guest_memory(ram());
    // A feature the device does not offer.
    negotiate(&mut dev, abi::F_GUEST_REGION | 1 << 63);
    assert_eq!(dev.status(), 0x3, "FEATURES_OK not set");
    assert_eq!(dev.error(), abi::ERR_FEATURES_UNSUPPORTED);
    // Both region modes.
    reg_write(&mut dev, abi::REG_STATUS, 0);
    negotiate(&mut dev, abi::F_GUEST_REGION | abi::F_DEVICE_REGION);
    assert_eq!(dev.status(), 0x3);
    assert_eq!(dev.error(), abi::ERR_NO_REGION_MODE);
    // Neither.
    reg_write(&mut dev, abi::REG_STATUS, 0);
    negotiate(&mut dev, abi::F_KICK);
    assert_eq!(dev.error(), abi::ERR_NO_REGION_MODE);
    // DRIVER_OK without FEATURES_OK is out of order.
    driver_ok(&mut dev);
    assert_eq!(dev.status(), 0x3 | abi::STATUS_FAILED);
    assert_eq!(dev.error(), abi::ERR_BAD_SEQUENCE);
    // Usable after reset.
    reg_write(&mut dev, abi::REG_STATUS, 0);
    assert_eq!(dev.error(), abi::ERR_NONE);
    assert_eq!(guest_handshake(&mut dev, GPA, 4096), 0xf);
    // Feature writes after FEATURES_OK are refused.
    reg_write(
        &mut dev,
        abi::REG_DRV_FEATURES_LO,
        abi::F_DEVICE_REGION as u32,
    );
    assert_eq!(dev.error(), abi::ERR_BAD_SEQUENCE);
    assert_eq!(
        reg_read(&mut dev, abi::REG_DRV_FEATURES_LO),
        (abi::F_GUEST_REGION | abi::F_WAIT_ON | abi::F_KICK) as u32
    );
    assert_eq!(dev.status(), 0xf, "still live");
}

#[test]
fn version_mismatch() {
    let (mut dev, sink) = device(NR);
    dev.set_guest_memory(ram());
    negotiate(&mut dev, abi::F_GUEST_REGION);
    reg_write(&mut dev, abi::REG_DRIVER_VERSION, 2 << 16);
    reg_write(&mut dev, abi::REG_SHM_GPA_LO, GPA as u32);
    reg_write(&mut dev, abi::REG_SHM_SIZE, 4096);
    driver_ok(&mut dev);
    assert_eq!(dev.status(), 0xb | abi::STATUS_FAILED);
    assert_eq!(dev.error(), abi::ERR_VERSION_MISMATCH);
    assert_eq!(sink.attaches.load(Ordering::SeqCst), 0);
    // A newer minor is fine.
    reg_write(&mut dev, abi::REG_STATUS, 0);
    negotiate(&mut dev, abi::F_GUEST_REGION);
    reg_write(&mut dev, abi::REG_DRIVER_VERSION, abi::ABI_MAJOR << 16 | 7);
    reg_write(&mut dev, abi::REG_SHM_GPA_LO, GPA as u32);
    reg_write(&mut dev, abi::REG_SHM_SIZE, 4096);
    driver_ok(&mut dev);
    assert_eq!(dev.status(), 0xf);
}

#[test]
fn status_sequence_rules() {
    let (mut dev, _) = device(NR);
    reg_write(&mut dev, abi::REG_STATUS, abi::STATUS_DRIVER);
    assert_eq!(dev.status(), abi::STATUS_FAILED);
    assert_eq!(dev.error(), abi::ERR_BAD_SEQUENCE);
    reg_write(&mut dev, abi::REG_STATUS, 0);
    reg_write(&mut dev, abi::REG_STATUS, 0x3);
    reg_write(&mut dev, abi::REG_STATUS, 0x1); // clearing: ignored
    assert_eq!(dev.status(), 0x3);
    reg_write(
        &mut dev,
        abi::REG_STATUS,
        0x3 | abi::STATUS_DEVICE_NEEDS_RESET,
    );
    assert_eq!(dev.status(), 0x3 | abi::STATUS_FAILED);
    reg_write(&mut dev, abi::REG_STATUS, 0);
    dev.set_needs_reset();
    assert_eq!(dev.status(), abi::STATUS_DEVICE_NEEDS_RESET);
    assert_eq!(dev.error(), abi::ERR_DEVICE_FAILED);
    reg_write(&mut dev, abi::REG_STATUS, 0x1);
    assert_eq!(
        dev.status(),
        abi::STATUS_DEVICE_NEEDS_RESET,
        "ignored until reset"
    );
    reg_write(&mut dev, abi::REG_STATUS, 0);
    assert_eq!((dev.status(), dev.error()), (0, 0));
}

#[test]
fn register_access_rules() {
    let (mut dev, _) = device(NR);
    let bar0 = BarIndex(0);
    let mut b8 = [0u8; 8];
    dev.read_bar(bar0, u64::from(abi::REG_DEV_FEATURES_LO), &mut b8);
    assert_eq!(u64::from_le_bytes(b8), abi::F_ALL);
    dev.write_bar(
        bar0,
        u64::from(abi::REG_SHM_GPA_LO),
        &0x1234_5678_9abc_d000u64.to_le_bytes(),
    );
    dev.read_bar(bar0, u64::from(abi::REG_SHM_GPA_LO), &mut b8);
    assert_eq!(u64::from_le_bytes(b8), 0x1234_5678_9abc_d000);
    assert_eq!(reg_read(&mut dev, abi::REG_SHM_GPA_HI), 0x1234_5678);
    // 8-byte access not on a pair, unaligned, short, or past the end reads 0.
    dev.read_bar(bar0, u64::from(abi::REG_MAGIC), &mut b8);
    assert_eq!(b8, [0; 8]);
    for (off, len) in [
        (1u64, 4usize),
        (0, 2),
        (0, 1),
        (u64::from(abi::REG_END), 4),
        (0xffc, 4),
        (u64::MAX, 4),
        (0, 3),
    ] {
        let mut d = vec![0xaa; len];
        dev.read_bar(bar0, off, &mut d);
        assert!(d.iter().all(|&b| b == 0), "offset {off:#x} len {len}");
    }
    // Bad writes are ignored.
    dev.write_bar(bar0, u64::from(abi::REG_STATUS) + 1, &[1, 0, 0, 0]);
    dev.write_bar(bar0, u64::from(abi::REG_STATUS), &[1, 0]);
    dev.write_bar(BarIndex(1), 0, &[1, 0, 0, 0]);
    dev.write_bar(BarIndex(200), 0, &[1, 0, 0, 0]);
    assert_eq!(dev.status(), 0);
    // Read-only registers ignore writes.
    reg_write(&mut dev, abi::REG_MAGIC, 0);
    reg_write(&mut dev, abi::REG_NR_VCPUS, 99);
    assert_eq!(reg_read(&mut dev, abi::REG_MAGIC), abi::MAGIC);
    assert_eq!(reg_read(&mut dev, abi::REG_NR_VCPUS), NR);
    assert_eq!(reg_read(&mut dev, abi::REG_VERSION), abi::ABI_VERSION);
    assert_eq!(reg_read(&mut dev, abi::REG_SLOT_SIZE), abi::SLOT_SIZE);
}

#[test]
fn snapshot_restore_round_trip() {
    let (mut dev, sink) = device(NR);
    let mem = ram();
    dev.set_guest_memory(mem.clone());
    guest_handshake(&mut dev, GPA, 4096);
    let json = serde_json::to_string(&dev.snapshot()).unwrap();

    let (mut dev2, sink2) = device(NR);
    dev2.set_guest_memory(mem.clone());
    dev2.restore(serde_json::from_str(&json).unwrap()).unwrap();
    assert_eq!(dev2.status(), 0xf);
    assert_eq!(dev2.generation(), 1, "restore does not re-attach as new");
    assert_eq!(sink2.balance.load(Ordering::SeqCst), 1);
    let v = dev2.region_view().unwrap();
    assert_eq!(v.read_header().generation, 1);
    assert_eq!(dev2.snapshot(), dev.snapshot());
    let _ = sink;

    // Restoring where the region is no longer RAM leaves the device needing reset.
    let (mut dev3, sink3) = device(NR);
    dev3.set_guest_memory(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1_0000)]).unwrap());
    assert!(dev3.restore(serde_json::from_str(&json).unwrap()).is_err());
    assert_eq!(
        dev3.status() & abi::STATUS_DEVICE_NEEDS_RESET,
        abi::STATUS_DEVICE_NEEDS_RESET
    );
    assert_eq!(dev3.status() & abi::STATUS_DRIVER_OK, 0);
    assert_eq!(sink3.balance.load(Ordering::SeqCst), 0);

    // A snapshot of another configuration is refused.
    let (mut dev4, _) = device(NR + 1);
    assert!(dev4.restore(serde_json::from_str(&json).unwrap()).is_err());
}

#[test]
fn snapshot_restore_device_mode() {
    let (mut dev, _) = device(NR);
    let size = PvschedDevice::region_bar_size(NR) as usize;
    let backing = Arc::new(MmapRegion::new(size).unwrap());
    dev.set_device_region(backing.clone()).unwrap();
    assert_eq!(device_handshake(&mut dev, 0xc000_0000), 0xf);
    // The guest disables decoding (e.g. while sizing BARs) before the snapshot.
    dev.write_config_register(1, 0, &[0]);
    let snap = dev.snapshot();
    let (mut dev2, sink2) = device(NR);
    dev2.set_device_region(backing.clone()).unwrap();
    dev2.restore(snap.clone()).unwrap();
    assert_eq!(dev2.status(), 0xf);
    assert_eq!(sink2.balance.load(Ordering::SeqCst), 1);
    let v = dev2.region_view().unwrap();
    assert_eq!(v.info().mode, RegionMode::Device);
    assert_eq!(v.info().guest_addr, 0xc000_0000);
    assert_eq!(dev2.read_config_register(6), 0xc000_0008);
    // Without backing the restore fails and the device needs a reset.
    let (mut dev3, _) = device(NR);
    assert!(matches!(
        dev3.restore(snap),
        Err(pvsched_device::Error::RestoreRegion(
            abi::ERR_REGION_UNAVAILABLE
        ))
    ));
    assert_eq!(
        dev3.status() & abi::STATUS_DEVICE_NEEDS_RESET,
        abi::STATUS_DEVICE_NEEDS_RESET
    );
    reg_write(&mut dev3, abi::REG_STATUS, 0);
    assert_eq!(dev3.status(), 0);
}

#[test]
fn guest_memory_swap() {
    let (mut dev, sink) = device(NR);
    dev.set_guest_memory(ram());
    guest_handshake(&mut dev, GPA, 4096);
    let old = dev.region_view().unwrap();
    // Same layout, new mapping: re-resolved, old view revoked, sink told.
    let mem2 = ram();
    dev.set_guest_memory(mem2.clone());
    assert_eq!(dev.status(), 0xf);
    assert!(!old.is_attached());
    let new = dev.region_view().unwrap();
    assert_eq!(new.info().generation, old.info().generation);
    assert_ne!(new.info().host_addr, old.info().host_addr);
    assert_eq!(sink.attaches.load(Ordering::SeqCst), 2);
    assert_eq!(sink.balance.load(Ordering::SeqCst), 1);
    new.write_host_slot(
        0,
        &abi::SlotHost {
            boosts: 9,
            ..Default::default()
        },
    )
    .unwrap();
    let h: abi::SlotHost = mem2
        .read_obj(GuestAddress(GPA + u64::from(abi::slot_offset(NR, 0)) + 64))
        .unwrap();
    assert_eq!(h.boosts, 9);
    // RAM removed under the region: device needs reset.
    dev.set_guest_memory(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x1_0000)]).unwrap());
    assert_eq!(
        dev.status() & abi::STATUS_DEVICE_NEEDS_RESET,
        abi::STATUS_DEVICE_NEEDS_RESET
    );
    assert!(!new.is_attached());
    assert_eq!(sink.balance.load(Ordering::SeqCst), 0);
}

/// Regression: an undefined or device-owned STATUS bit written while the
/// region is attached fails the device *and* lets the region go (the device
/// must not keep touching guest memory once DRIVER_OK is gone).
#[test]
fn bad_status_bits_while_attached_detach_the_region() {
    for bad in [0x10u32, 0x20, abi::STATUS_DEVICE_NEEDS_RESET] {
        let (mut dev, sink) = device(NR);
        dev.set_guest_memory(ram());
        assert_eq!(guest_handshake(&mut dev, GPA, 4096), 0xf);
        let view = dev.region_view().unwrap();
        reg_write(&mut dev, abi::REG_STATUS, 0xf | bad);
        assert_eq!(dev.status() & abi::STATUS_DRIVER_OK, 0, "bit {bad:#x}");
        assert_ne!(dev.status() & abi::STATUS_FAILED, 0, "bit {bad:#x}");
        assert_eq!(dev.error(), abi::ERR_BAD_SEQUENCE);
        assert!(dev.region_view().is_none(), "bit {bad:#x}: region kept");
        assert!(
            view.read_guest_slot(0).is_err(),
            "bit {bad:#x}: old view still works"
        );
        assert_eq!(sink.balance.load(Ordering::SeqCst), 0);
    }
}
