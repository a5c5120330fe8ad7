//! Test support shared by the unit tests, the property test
//! (`tests/integration/proptest_sequences.rs`), the fuzz target (`fuzz/`) and other
//! crates' tests: driver-side handshake helpers, and an operation language
//! ([`Op`], decoded from bytes) with a [`Harness`] that applies operations to
//! a device and checks its invariants after each one.
//!
//! Not part of the stable API.

use crate::RegionInfo;
use crate::config_space::COMMAND_MEMORY;
use crate::device::{DeviceConfig, PvschedDevice};
use crate::pci::{BarIndex, PciDevice};
use crate::region::{RegionMode, RegionView, SlotError};
use crate::sink::PolicySink;
use pvsched_abi as abi;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    MmapRegion, VolatileMemory,
};

/// Write a 32-bit register in BAR0.
pub fn reg_write(dev: &mut PvschedDevice, offset: u32, value: u32) {
    dev.write_bar(
        BarIndex(abi::REG_BAR),
        u64::from(offset),
        &value.to_le_bytes(),
    );
}

/// Read a 32-bit register in BAR0.
pub fn reg_read(dev: &mut PvschedDevice, offset: u32) -> u32 {
    let mut b = [0u8; 4];
    dev.read_bar(BarIndex(abi::REG_BAR), u64::from(offset), &mut b);
    u32::from_le_bytes(b)
}

/// Write a whole configuration dword.
pub fn cfg_write(dev: &mut PvschedDevice, reg_idx: usize, value: u32) -> crate::ConfigWriteResult {
    dev.write_config_register(reg_idx, 0, &value.to_le_bytes())
}

/// Negotiate `features` up to FEATURES_OK, as a driver does.
pub fn negotiate(dev: &mut PvschedDevice, features: u64) {
    reg_write(dev, abi::REG_STATUS, abi::STATUS_ACKNOWLEDGE);
    reg_write(
        dev,
        abi::REG_STATUS,
        abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER,
    );
    reg_write(dev, abi::REG_DRV_FEATURES_LO, features as u32);
    reg_write(dev, abi::REG_DRV_FEATURES_HI, (features >> 32) as u32);
    let s = reg_read(dev, abi::REG_STATUS);
    reg_write(dev, abi::REG_STATUS, s | abi::STATUS_FEATURES_OK);
    reg_write(dev, abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
}

/// Set DRIVER_OK on top of the current STATUS.
pub fn driver_ok(dev: &mut PvschedDevice) {
    let s = reg_read(dev, abi::REG_STATUS);
    reg_write(dev, abi::REG_STATUS, s | abi::STATUS_DRIVER_OK);
}

/// Full guest-region handshake with the region at `gpa` of `size` bytes.
/// Returns STATUS.
pub fn guest_handshake(dev: &mut PvschedDevice, gpa: u64, size: u32) -> u32 {
    negotiate(dev, abi::F_GUEST_REGION | abi::F_WAIT_ON | abi::F_KICK);
    reg_write(dev, abi::REG_SHM_GPA_LO, gpa as u32);
    reg_write(dev, abi::REG_SHM_GPA_HI, (gpa >> 32) as u32);
    reg_write(dev, abi::REG_SHM_SIZE, size);
    driver_ok(dev);
    dev.status()
}

/// Program BAR2 at `bar2` and enable memory decoding, as firmware does.
pub fn map_bar2(dev: &mut PvschedDevice, bar2: u32) {
    cfg_write(dev, 4 + usize::from(abi::REGION_BAR), bar2);
    cfg_write(dev, 4, 0xfebf_0000);
    let cmd = dev.read_config_register(1) as u16;
    dev.write_config_register(1, 0, &(cmd | COMMAND_MEMORY).to_le_bytes());
}

/// Map BAR2 at `bar2`, then a full device-region handshake. Returns STATUS.
pub fn device_handshake(dev: &mut PvschedDevice, bar2: u32) -> u32 {
    map_bar2(dev, bar2);
    negotiate(dev, abi::F_DEVICE_REGION | abi::F_WAIT_ON | abi::F_KICK);
    driver_ok(dev);
    dev.status()
}

/// A sink that records what it was told.
#[derive(Debug, Default)]
pub struct RecordingSink {
    /// Attaches minus detaches.
    pub balance: AtomicI64,
    /// Attaches seen.
    pub attaches: AtomicU64,
    /// Detaches seen.
    pub detaches: AtomicU64,
    /// Kicks seen.
    pub kicks: AtomicU64,
    /// Largest kicked slot + 1 (0 if none).
    pub max_kick: AtomicU32,
    /// vCPU count reported.
    pub vcpus: AtomicU32,
    /// Last attached region.
    pub last: std::sync::Mutex<Option<RegionInfo>>,
}

impl PolicySink for RecordingSink {
    fn region_attached(&self, region: &RegionInfo) {
        self.balance.fetch_add(1, Ordering::SeqCst);
        self.attaches.fetch_add(1, Ordering::SeqCst);
        *pvsched_util::lock(&self.last) = Some(region.clone());
    }
    fn region_detached(&self) {
        self.balance.fetch_sub(1, Ordering::SeqCst);
        self.detaches.fetch_add(1, Ordering::SeqCst);
    }
    fn kick(&self, slot: u32) {
        self.kicks.fetch_add(1, Ordering::SeqCst);
        self.max_kick.fetch_max(slot + 1, Ordering::SeqCst);
    }
    fn vcpu_count(&self, n: u32) {
        self.vcpus.store(n, Ordering::SeqCst);
    }
}

/// One step of a random device session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Configuration write of `len` bytes (any value, may be invalid) at `offset` in dword `reg`.
    ConfigWrite {
        /// Dword index (may be out of range).
        reg: u8,
        /// Byte offset (may be invalid).
        offset: u8,
        /// Length (may be invalid).
        len: u8,
        /// Value (low `len` bytes used).
        value: u32,
    },
    /// Configuration read.
    ConfigRead {
        /// Dword index (may be out of range).
        reg: u8,
    },
    /// BAR write with any bar, offset, length and value.
    BarWrite {
        /// BAR index (may be invalid).
        bar: u8,
        /// Offset.
        offset: u16,
        /// Length (0..=9).
        len: u8,
        /// Value.
        value: u64,
    },
    /// BAR read with any bar, offset and length.
    BarRead {
        /// BAR index (may be invalid).
        bar: u8,
        /// Offset.
        offset: u16,
        /// Length (0..=9).
        len: u8,
    },
    /// Aligned 32-bit write to a defined register (biased towards the handshake).
    RegWrite {
        /// Index into the register table.
        reg: u8,
        /// Value (or, for STATUS, a choice of plausible values).
        value: u32,
    },
    /// Program SHM_GPA/SHM_SIZE from small tables of good and bad values.
    SetShm {
        /// GPA choice.
        gpa: u8,
        /// Size choice.
        size: u8,
    },
    /// A complete handshake in one mode.
    Handshake {
        /// Device region mode if true.
        device_mode: bool,
    },
    /// Program BAR2 and enable memory decoding.
    MapBar2,
    /// Write bytes into guest RAM or the BAR2 backing.
    Scribble {
        /// 0: guest RAM, 1: BAR2 backing, 2: inside the attached region.
        target: u8,
        /// Offset (reduced modulo the target size).
        offset: u32,
        /// Bytes to write.
        bytes: [u8; 8],
    },
    /// STATUS = 0.
    Reset,
    /// The embedder marks the back end gone.
    SetNeedsReset,
    /// Replace guest memory with layout `n % 3`.
    SwapMemory(u8),
    /// Keep a clone of the current view (if any) for later checks.
    TakeView,
    /// Read every slot (and one past the end) and write host halves.
    AccessSlots,
    /// Snapshot, then restore into the same device.
    SnapshotRestore,
}

/// Reads fields from fuzz/proptest bytes; exhausted input reads zeros.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }
}

/// Decode a sequence of at most `max_ops` operations from `data`.
///
/// ```
/// use pvsched_device::testing::{decode_ops, Op};
/// assert_eq!(decode_ops(&[10], 64), vec![Op::Reset]);
/// ```
pub fn decode_ops(data: &[u8], max_ops: usize) -> Vec<Op> {
    let mut c = Cursor(data);
    let mut ops = Vec::new();
    while !c.0.is_empty() && ops.len() < max_ops {
        let op = match c.u8() % 16 {
            0 => Op::ConfigWrite {
                reg: c.u8() % 72,
                offset: c.u8() % 6,
                len: c.u8() % 6,
                value: c.u32(),
            },
            1 => Op::ConfigRead { reg: c.u8() % 72 },
            2 => Op::BarWrite {
                bar: c.u8() % 8,
                offset: c.u16(),
                len: c.u8() % 10,
                value: c.u64(),
            },
            3 => Op::BarRead {
                bar: c.u8() % 8,
                offset: c.u16(),
                len: c.u8() % 10,
            },
            4 | 5 => Op::RegWrite {
                reg: c.u8(),
                value: c.u32(),
            },
            6 => Op::SetShm {
                gpa: c.u8(),
                size: c.u8(),
            },
            7 => Op::Handshake {
                device_mode: c.u8() & 1 == 1,
            },
            8 => Op::MapBar2,
            9 => Op::Scribble {
                target: c.u8() % 3,
                offset: c.u32(),
                bytes: c.u64().to_le_bytes(),
            },
            10 => Op::Reset,
            11 => Op::SetNeedsReset,
            12 => Op::SwapMemory(c.u8()),
            13 => Op::TakeView,
            14 => Op::AccessSlots,
            _ => Op::SnapshotRestore,
        };
        ops.push(op);
    }
    ops
}

/// Registers [`Op::RegWrite`] picks from.
const REGS: [u32; 12] = [
    abi::REG_STATUS,
    abi::REG_STATUS,
    abi::REG_STATUS,
    abi::REG_DRV_FEATURES_LO,
    abi::REG_DRV_FEATURES_HI,
    abi::REG_SHM_GPA_LO,
    abi::REG_SHM_GPA_HI,
    abi::REG_SHM_SIZE,
    abi::REG_KICK,
    abi::REG_DRIVER_VERSION,
    abi::REG_MAGIC,
    abi::REG_GENERATION,
];

/// STATUS values [`Op::RegWrite`] picks from (low byte of the value).
const STATUS_VALUES: [u32; 10] = [0, 0x1, 0x3, 0xb, 0xf, 0x80, 0x40, 0x10, 0x5, 0xff];

/// Guest RAM layouts [`Op::SwapMemory`] picks from.
const LAYOUTS: [&[(u64, usize)]; 3] = [
    &[(0, 0x1_0000), (0x10_0000, 0x1_0000)],
    &[(0, 0x1_0000)],
    &[(0x10_0000, 0x1_0000), (0x20_0000, 0x4000)],
];

/// A device plus the memory and sink it runs with, for sequence testing.
pub struct Harness {
    /// The device under test.
    pub dev: PvschedDevice,
    /// What the device told the policy.
    pub sink: Arc<RecordingSink>,
    /// Current guest RAM.
    pub mem: GuestMemoryMmap,
    /// BAR2 backing.
    pub backing: Arc<MmapRegion>,
    /// Views kept by [`Op::TakeView`], with the sink's attach count at the time.
    views: Vec<(RegionView, u64)>,
}

fn layout(n: u8) -> GuestMemoryMmap {
    let ranges: Vec<(GuestAddress, usize)> = LAYOUTS[usize::from(n) % LAYOUTS.len()]
        .iter()
        .map(|&(a, s)| (GuestAddress(a), s))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges)
        .unwrap_or_else(|e| panic!("cannot map test guest RAM: {e}"))
}

impl Harness {
    /// A device with `nr_vcpus` slots, all features, RAM layout 0 and BAR2 backing.
    pub fn new(nr_vcpus: u32) -> Self {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = PvschedDevice::new(DeviceConfig::new(nr_vcpus), sink.clone())
            .unwrap_or_else(|e| panic!("cannot create device: {e}"));
        let mem = layout(0);
        dev.set_guest_memory(mem.clone());
        let size = PvschedDevice::region_bar_size(nr_vcpus) as usize;
        let backing = Arc::new(
            MmapRegion::new(size).unwrap_or_else(|e| panic!("cannot map BAR2 backing: {e}")),
        );
        dev.set_device_region(backing.clone())
            .unwrap_or_else(|e| panic!("cannot set BAR2 backing: {e}"));
        Self {
            dev,
            sink,
            mem,
            backing,
            views: Vec::new(),
        }
    }

    fn nr(&self) -> u32 {
        self.dev.config().nr_vcpus
    }

    /// Apply one operation. Panics only if an invariant breaks.
    pub fn apply(&mut self, op: &Op) {
        let nr = self.nr();
        match *op {
            Op::ConfigWrite {
                reg,
                offset,
                len,
                value,
            } => {
                let bytes = value.to_le_bytes();
                let len = usize::from(len).min(4);
                self.dev
                    .write_config_register(usize::from(reg), u64::from(offset), &bytes[..len]);
            }
            Op::ConfigRead { reg } => {
                let v = self.dev.read_config_register(usize::from(reg));
                if reg >= 64 {
                    assert_eq!(v, 0xffff_ffff, "config dword {reg} out of range");
                }
            }
            Op::BarWrite {
                bar,
                offset,
                len,
                value,
            } => {
                let bytes = value.to_le_bytes();
                let mut data = bytes.to_vec();
                data.resize(usize::from(len), 0xa5);
                self.dev.write_bar(BarIndex(bar), u64::from(offset), &data);
            }
            Op::BarRead { bar, offset, len } => {
                let mut data = vec![0xeeu8; usize::from(len)];
                self.dev
                    .read_bar(BarIndex(bar), u64::from(offset), &mut data);
                if bar != abi::REG_BAR && bar != abi::REGION_BAR {
                    assert!(data.iter().all(|&b| b == 0), "absent BAR{bar} must read 0");
                }
            }
            Op::RegWrite { reg, value } => {
                let off = REGS[usize::from(reg) % REGS.len()];
                let value = match off {
                    abi::REG_STATUS => STATUS_VALUES[(value as usize) % STATUS_VALUES.len()],
                    abi::REG_DRV_FEATURES_LO => [
                        abi::F_GUEST_REGION as u32,
                        abi::F_DEVICE_REGION as u32,
                        abi::F_ALL as u32,
                        value,
                    ][(value as usize) % 4],
                    abi::REG_DRIVER_VERSION if value & 1 == 0 => abi::ABI_VERSION,
                    abi::REG_KICK => value % (nr + 2),
                    _ => value,
                };
                reg_write(&mut self.dev, off, value);
            }
            Op::SetShm { gpa, size } => {
                let gpas = [
                    0x1000u64, 0x8000, 0x10_0000, 0xf000, 0x1001, !0xfffu64, 0x20_0000, 0x5_0000,
                ];
                let rs = abi::region_size(nr);
                let sizes = [rs, rs, 0, 0x1000, 0x2000, rs + 1, 0x1_0000, !0xfffu32];
                let g = gpas[usize::from(gpa) % gpas.len()];
                reg_write(&mut self.dev, abi::REG_SHM_GPA_LO, g as u32);
                reg_write(&mut self.dev, abi::REG_SHM_GPA_HI, (g >> 32) as u32);
                reg_write(
                    &mut self.dev,
                    abi::REG_SHM_SIZE,
                    sizes[usize::from(size) % sizes.len()],
                );
            }
            Op::Handshake { device_mode } => {
                if device_mode {
                    device_handshake(&mut self.dev, 0xc000_0000);
                } else {
                    guest_handshake(&mut self.dev, 0x10_0000, abi::region_size(nr));
                }
            }
            Op::MapBar2 => map_bar2(&mut self.dev, 0xc000_0000),
            Op::Scribble {
                target,
                offset,
                bytes,
            } => match target {
                0 => {
                    let span: u64 = 0x21_0000;
                    let _ = self
                        .mem
                        .write_slice(&bytes, GuestAddress(u64::from(offset) % span));
                }
                1 => {
                    let off = offset as usize % self.backing.size();
                    let n = bytes.len().min(self.backing.size() - off);
                    if let Ok(s) = self.backing.get_slice(off, n) {
                        s.copy_from(&bytes[..n]);
                    }
                }
                _ => {
                    if let Some(v) = self.dev.region_view() {
                        let len = u64::from(abi::region_size(nr));
                        let _ = v.write_bytes((u64::from(offset) % len) & !7, &bytes);
                    }
                }
            },
            Op::Reset => {
                reg_write(&mut self.dev, abi::REG_STATUS, 0);
                assert_eq!(self.dev.status(), 0);
                assert_eq!(self.dev.error(), abi::ERR_NONE);
                for (v, _) in self.views.drain(..) {
                    assert!(!v.is_attached(), "view alive after reset");
                    assert_eq!(v.read_guest_slot(0), Err(SlotError::Detached));
                    assert_eq!(
                        v.write_host_slot(0, &abi::SlotHost::default()),
                        Err(SlotError::Detached)
                    );
                    assert_eq!(v.read_header(), abi::RegionHeader::default());
                }
            }
            Op::SetNeedsReset => {
                self.dev.set_needs_reset();
                assert_ne!(self.dev.status() & abi::STATUS_DEVICE_NEEDS_RESET, 0);
                assert_eq!(self.dev.error(), abi::ERR_DEVICE_FAILED);
            }
            Op::SwapMemory(n) => {
                self.mem = layout(n);
                self.dev.set_guest_memory(self.mem.clone());
            }
            Op::TakeView => {
                if let Some(v) = self.dev.region_view()
                    && self.views.len() < 8
                {
                    self.views
                        .push((v, self.sink.attaches.load(Ordering::SeqCst)));
                }
            }
            Op::AccessSlots => {
                if let Some(v) = self.dev.region_view() {
                    for i in 0..=nr {
                        match v.read_guest_slot(i) {
                            Ok(s) => {
                                assert!(i < nr);
                                assert!((abi::NICE_MIN..=abi::NICE_MAX).contains(&s.nice));
                                assert!(s.rt_prio <= abi::RT_PRIO_MAX);
                                assert!(s.wait_on.is_none_or(|w| w < nr));
                                assert_eq!(s.kern_cs & !abi::CS_ALL, 0);
                                assert_eq!(s.seq & 1, 0);
                            }
                            Err(SlotError::OutOfRange { .. }) => assert_eq!(i, nr),
                            Err(SlotError::Busy { .. }) => {}
                            Err(SlotError::Detached) => panic!("current view detached"),
                        }
                        let host = abi::SlotHost {
                            boosts: u64::from(i),
                            ..Default::default()
                        };
                        assert_eq!(v.write_host_slot(i, &host).is_ok(), i < nr);
                    }
                    assert!(v.apic_id(nr).is_none());
                }
            }
            Op::SnapshotRestore => {
                let snap = self.dev.snapshot();
                let was_ok = snap.registers.status & abi::STATUS_DRIVER_OK != 0;
                let r = self.dev.restore(snap.clone());
                if was_ok {
                    assert!(r.is_ok(), "restore of a valid attached state failed: {r:?}");
                }
                assert_eq!(self.dev.snapshot(), snap, "restore must round-trip");
            }
        }
        self.check();
    }

    /// Check the device invariants.
    pub fn check(&self) {
        let st = self.dev.status();
        let err = self.dev.error();
        assert!(err <= abi::ERR_MAX, "ERROR {err} out of range");
        assert!(
            st & abi::STATUS_DRIVER_OK == 0 || st & abi::STATUS_FAILED == 0,
            "DRIVER_OK and FAILED together: {st:#x}"
        );
        let view = self.dev.region_view();
        assert_eq!(
            st & abi::STATUS_DRIVER_OK != 0,
            view.is_some(),
            "DRIVER_OK iff a region is attached (status {st:#x})"
        );
        let balance = self.sink.balance.load(Ordering::SeqCst);
        assert_eq!(
            balance,
            i64::from(view.is_some()),
            "sink attach/detach balance"
        );
        assert!(self.sink.max_kick.load(Ordering::SeqCst) <= self.nr());
        if let Some(v) = &view {
            assert!(v.is_attached());
            let info = v.info();
            match info.mode {
                RegionMode::Guest => {
                    let r = self
                        .mem
                        .find_region(GuestAddress(info.guest_addr))
                        .expect("attached guest region not in RAM");
                    let end = info.guest_addr + info.size - 1;
                    assert!(end <= r.last_addr().raw_value(), "guest region leaves RAM");
                    assert!(info.size >= u64::from(abi::region_size(info.nr_vcpus)));
                    let host = r
                        .get_host_address(
                            r.to_region_addr(GuestAddress(info.guest_addr))
                                .expect("in region"),
                        )
                        .expect("host address");
                    assert_eq!(host as usize, info.host_addr, "view maps stale memory");
                }
                RegionMode::Device => {
                    assert_eq!(info.host_addr, self.backing.as_ptr() as usize);
                }
            }
        }
        // Every attach revokes earlier views; with nothing attached, no view works.
        let attaches = self.sink.attaches.load(Ordering::SeqCst);
        for (v, seen) in &self.views {
            if view.is_none() || attaches > *seen {
                assert!(!v.is_attached(), "stale view still attached");
                assert_eq!(v.read_guest_slot(0), Err(SlotError::Detached));
                assert!(!v.write_bytes(0, &[0]), "stale view wrote memory");
            }
        }
    }
}
