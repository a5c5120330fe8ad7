//! Fault injection for the guest driver's negative tests: a wrapper that
//! makes a correct device misbehave in one chosen way.
//!
//! - [`Fault::WrongMagic`]: BAR0 MAGIC reads a wrong value.
//! - [`Fault::WrongVersion`]: BAR0 VERSION reads major `ABI_MAJOR + 1`.
//! - [`Fault::RefuseRegion`]: the guest region's GPA is moved far outside
//!   RAM on its way in (SHM_GPA_HI write), so the real device model refuses
//!   DRIVER_OK with `ERR_REGION_OUTSIDE_RAM`.
//! - [`Fault::HostileHeader`]: the device accepts DRIVER_OK and then
//!   overwrites the region header it just wrote, differently at each
//!   DRIVER_OK (see [`HostileHeader`]); from the fifth on the header is
//!   valid while the driver validates it and is rewritten with garbage
//!   right after (at the driver's GENERATION read).
//!
//! And one test-only trigger ([`TestTrigger`]), not a guest-visible fault:
//! [`TestTrigger::OpenOnReset`] makes the device try to `open()` a file when
//! it handles a device reset (mpqemu DEVICE_RESET, vfio-user
//! VFIO_USER_DEVICE_RESET), so a test can watch a sandboxed device die of
//! SIGSYS; [`TestTrigger::PanicOnReset`] makes it panic there, to test how
//! a panic inside the sandbox ends.

use crate::backend::TransportDevice;
use pvsched_abi as abi;
use pvsched_device::{BarIndex, BarInfo, ConfigWriteResult, PciDevice, RegionView};
use vm_memory::{ByteValued, GuestMemoryMmap};

/// Which misbehaviour to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer a wrong MAGIC.
    WrongMagic,
    /// Answer a wrong major VERSION.
    WrongVersion,
    /// Refuse the guest region at DRIVER_OK.
    RefuseRegion,
    /// Corrupt the region header after DRIVER_OK ([`HostileHeader`]).
    HostileHeader,
}

/// What [`Fault::HostileHeader`] does at the Nth DRIVER_OK (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostileHeader {
    /// 1st: `slots_offset` points past the end of the region.
    SlotsOutside,
    /// 2nd: the APIC table names slot 0's APIC ID again in slot 1.
    ApicDuplicate,
    /// 3rd: slot 0's APIC ID is [`HOSTILE_APIC_ID`] (≥ 32768, no x86
    /// Linux CPU has it).
    ApicOutOfRange,
    /// 4th: `nr_vcpus` is one more than the NR_VCPUS register.
    NrVcpusMismatch,
    /// 5th and later: valid at validation, then every header field and
    /// the APIC table are overwritten with garbage ([`Self::garbage`]).
    RewriteAfter,
}

impl HostileHeader {
    /// The corruption of the `n`th DRIVER_OK (1-based).
    pub fn nth(n: u32) -> Self {
        match n {
            0 | 1 => Self::SlotsOutside,
            2 => Self::ApicDuplicate,
            3 => Self::ApicOutOfRange,
            4 => Self::NrVcpusMismatch,
            _ => Self::RewriteAfter,
        }
    }

    /// The header written by [`Self::RewriteAfter`]: every size and offset
    /// as large as a u32 goes.
    pub fn garbage() -> abi::RegionHeader {
        abi::RegionHeader {
            magic: 0,
            version: u32::MAX,
            nr_vcpus: u32::MAX,
            slot_size: u32::MAX,
            header_size: u32::MAX,
            apic_table_offset: u32::MAX - 3,
            slots_offset: u32::MAX - 63,
            generation: u32::MAX,
            host_flags: u32::MAX,
            driver_features_lo: u32::MAX,
            driver_features_hi: u32::MAX,
            driver_version: u32::MAX,
            reserved: [u32::MAX; 4],
        }
    }
}

/// APIC ID written by [`HostileHeader::ApicOutOfRange`].
pub const HOSTILE_APIC_ID: u32 = 0x8000;

/// Test-only triggers inside the device process (sandbox tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestTrigger {
    /// On device reset, call [`pvsched_sandbox::attempt_forbidden_open`]:
    /// a sandboxed device dies with SIGSYS; an unsandboxed one logs an
    /// error and carries on with the reset.
    OpenOnReset,
    /// On device reset, panic: the vfio-user server contains it and the
    /// process exits 1 (inside the sandbox even with `RUST_BACKTRACE=1`,
    /// whose default hook would open the executable and die of SIGSYS).
    PanicOnReset,
}

/// MAGIC value answered under [`Fault::WrongMagic`].
pub const WRONG_MAGIC: u32 = 0xdead_beef;
/// SHM_GPA_HI written under [`Fault::RefuseRegion`] (GPA ≥ 16 TiB).
pub const REFUSED_GPA_HI: u32 = 0x1000;

/// A device with an optional injected fault.
pub struct FaultyDevice<D> {
    inner: D,
    fault: Option<Fault>,
    trigger: Option<TestTrigger>,
    /// DRIVER_OKs accepted so far ([`Fault::HostileHeader`]).
    driver_oks: u32,
    /// Rewrite the header with garbage at the next GENERATION read.
    rewrite_armed: bool,
}

impl<D> FaultyDevice<D> {
    /// Wrap `inner`; `None` injects nothing.
    pub fn new(inner: D, fault: Option<Fault>) -> Self {
        FaultyDevice {
            inner,
            fault,
            trigger: None,
            driver_oks: 0,
            rewrite_armed: false,
        }
    }

    /// Arm a test-only trigger (`None`: none).
    pub fn with_test_trigger(mut self, trigger: Option<TestTrigger>) -> Self {
        self.trigger = trigger;
        self
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }
}

fn is_reg(bar: BarIndex, offset: u64, reg: u32) -> bool {
    bar == BarIndex(abi::REG_BAR) && offset == u64::from(reg)
}

/// Write `bytes` at byte `offset` of the region a 32-bit word at a time (as
/// the device writes its header); false if any word was out of bounds or
/// the region detached.
fn write_words(view: &RegionView, offset: u64, bytes: &[u8]) -> bool {
    bytes
        .chunks(4)
        .enumerate()
        .all(|(i, w)| view.write_bytes(offset + 4 * i as u64, w))
}

impl<D: TransportDevice> FaultyDevice<D> {
    /// After an accepted DRIVER_OK: corrupt the header the device just
    /// wrote ([`HostileHeader`]).
    fn corrupt_header(&mut self) {
        use std::mem::offset_of;
        self.driver_oks += 1;
        let Some(view) = self.inner.region_view() else {
            return;
        };
        let info = view.info().clone();
        let apic = u64::from(abi::APIC_TABLE_OFFSET);
        let what = HostileHeader::nth(self.driver_oks);
        let ok = match what {
            HostileHeader::SlotsOutside => {
                let past = u32::try_from(info.size).unwrap_or(u32::MAX);
                write_words(
                    &view,
                    offset_of!(abi::RegionHeader, slots_offset) as u64,
                    &past.to_le_bytes(),
                )
            }
            HostileHeader::ApicDuplicate => {
                let first = view.apic_id(0).unwrap_or(0);
                write_words(&view, apic + 4, &first.to_le_bytes())
            }
            HostileHeader::ApicOutOfRange => {
                write_words(&view, apic, &HOSTILE_APIC_ID.to_le_bytes())
            }
            HostileHeader::NrVcpusMismatch => write_words(
                &view,
                offset_of!(abi::RegionHeader, nr_vcpus) as u64,
                &info.nr_vcpus.saturating_add(1).to_le_bytes(),
            ),
            HostileHeader::RewriteAfter => {
                self.rewrite_armed = true;
                true
            }
        };
        log::warn!(
            "fault hostile-header: DRIVER_OK #{}: {what:?}",
            self.driver_oks
        );
        if !ok {
            log::error!("fault hostile-header: could not write {what:?} into the region");
        }
    }

    /// [`HostileHeader::RewriteAfter`]: garbage over the whole header and
    /// APIC table, after the driver validated them.
    fn rewrite_header(&mut self) {
        self.rewrite_armed = false;
        let Some(view) = self.inner.region_view() else {
            return;
        };
        let table = vec![0xff; 4 * view.info().nr_vcpus as usize];
        let ok = write_words(&view, 0, HostileHeader::garbage().as_slice())
            && write_words(&view, u64::from(abi::APIC_TABLE_OFFSET), &table);
        log::warn!(
            "fault hostile-header: header and APIC table overwritten after validation (ok: {ok})"
        );
    }
}

impl<D: TransportDevice> PciDevice for FaultyDevice<D> {
    fn debug_label(&self) -> String {
        match self.fault {
            Some(f) => format!("{} (fault {f:?})", self.inner.debug_label()),
            None => self.inner.debug_label(),
        }
    }

    fn read_config_register(&self, reg_idx: usize) -> u32 {
        self.inner.read_config_register(reg_idx)
    }

    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteResult {
        self.inner.write_config_register(reg_idx, offset, data)
    }

    fn bars(&self) -> Vec<BarInfo> {
        self.inner.bars()
    }

    fn read_bar(&mut self, bar: BarIndex, offset: u64, data: &mut [u8]) {
        if self.rewrite_armed && is_reg(bar, offset, abi::REG_GENERATION) {
            self.rewrite_header();
        }
        self.inner.read_bar(bar, offset, data);
        let replace = match self.fault {
            Some(Fault::WrongMagic) if is_reg(bar, offset, abi::REG_MAGIC) => Some(WRONG_MAGIC),
            Some(Fault::WrongVersion) if is_reg(bar, offset, abi::REG_VERSION) => {
                Some(((abi::ABI_MAJOR + 1) << 16) | abi::ABI_MINOR)
            }
            _ => None,
        };
        if let Some(v) = replace {
            let b = v.to_le_bytes();
            let n = data.len().min(4);
            data[..n].copy_from_slice(&b[..n]);
        }
    }

    fn write_bar(&mut self, bar: BarIndex, offset: u64, data: &[u8]) {
        if self.fault == Some(Fault::RefuseRegion)
            && is_reg(bar, offset, abi::REG_SHM_GPA_HI)
            && data.len() == 4
        {
            self.inner
                .write_bar(bar, offset, &REFUSED_GPA_HI.to_le_bytes());
            return;
        }
        self.inner.write_bar(bar, offset, data);
        if self.fault == Some(Fault::HostileHeader)
            && is_reg(bar, offset, abi::REG_STATUS)
            && data.len() == 4
            && u32::from_le_bytes([data[0], data[1], data[2], data[3]]) & abi::STATUS_DRIVER_OK != 0
            && self.inner.status() & abi::STATUS_DRIVER_OK != 0
            && self.inner.region_view().is_some()
        {
            self.corrupt_header();
        }
    }

    fn keep_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.inner.keep_fds()
    }

    fn on_sandboxed(&mut self) {
        self.inner.on_sandboxed();
    }
}

impl<D: TransportDevice> TransportDevice for FaultyDevice<D> {
    fn set_guest_memory(&mut self, mem: GuestMemoryMmap) {
        self.inner.set_guest_memory(mem);
    }

    fn reset(&mut self) {
        if self.trigger == Some(TestTrigger::OpenOnReset) {
            log::warn!("test trigger open-on-reset: opening a file (a sandboxed device dies here)");
            let opened = pvsched_sandbox::attempt_forbidden_open();
            log::error!(
                "test trigger open-on-reset: open() returned (opened: {opened}); this device is NOT sandboxed"
            );
        }
        if self.trigger == Some(TestTrigger::PanicOnReset) {
            panic!("test trigger panic-on-reset");
        }
        self.inner.reset();
    }

    fn status(&self) -> u32 {
        self.inner.status()
    }

    fn error(&self) -> u32 {
        self.inner.error()
    }

    fn generation(&self) -> u32 {
        self.inner.generation()
    }

    fn region_view(&self) -> Option<RegionView> {
        self.inner.region_view()
    }

    fn registers(&self) -> pvsched_device::registers::RegisterState {
        self.inner.registers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
    use std::sync::Arc;

    fn read(d: &mut impl PciDevice, reg: u32) -> u32 {
        let mut b = [0u8; 4];
        d.read_bar(BarIndex(0), u64::from(reg), &mut b);
        u32::from_le_bytes(b)
    }

    fn dev(f: Option<Fault>) -> FaultyDevice<PvschedDevice> {
        let d = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).expect("device");
        FaultyDevice::new(d, f)
    }

    #[test]
    fn wrong_magic_and_version() {
        assert_eq!(read(&mut dev(None), abi::REG_MAGIC), abi::MAGIC);
        assert_eq!(
            read(&mut dev(Some(Fault::WrongMagic)), abi::REG_MAGIC),
            WRONG_MAGIC
        );
        let v = read(&mut dev(Some(Fault::WrongVersion)), abi::REG_VERSION);
        assert_eq!(abi::version_major(v), abi::ABI_MAJOR + 1);
    }

    #[test]
    fn refuse_region_rewrites_gpa_hi() {
        let mut d = dev(Some(Fault::RefuseRegion));
        d.write_bar(
            BarIndex(0),
            u64::from(abi::REG_SHM_GPA_HI),
            &0u32.to_le_bytes(),
        );
        assert_eq!(read(&mut d, abi::REG_SHM_GPA_HI), REFUSED_GPA_HI);
    }

    fn write(d: &mut impl PciDevice, reg: u32, v: u32) {
        d.write_bar(BarIndex(0), u64::from(reg), &v.to_le_bytes());
    }

    fn word(view: &RegionView, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        assert!(view.read_bytes(offset, &mut b), "read at {offset}");
        u32::from_le_bytes(b)
    }

    /// Device-region handshake through the wrapper, as the guest driver
    /// does it; returns STATUS.
    fn handshake(d: &mut FaultyDevice<PvschedDevice>) -> u32 {
        write(d, abi::REG_STATUS, 0);
        for bit in [
            abi::STATUS_ACKNOWLEDGE,
            abi::STATUS_DRIVER,
            abi::STATUS_FEATURES_OK,
            abi::STATUS_DRIVER_OK,
        ] {
            if bit == abi::STATUS_FEATURES_OK {
                write(d, abi::REG_DRV_FEATURES_LO, abi::F_DEVICE_REGION as u32);
                write(d, abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
            }
            let s = read(d, abi::REG_STATUS);
            write(d, abi::REG_STATUS, s | bit);
        }
        read(d, abi::REG_STATUS)
    }

    #[test]
    fn hostile_header_corrupts_each_driver_ok_then_rewrites_after_validation() {
        let mut inner =
            PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).expect("device");
        let size = PvschedDevice::region_bar_size(2) as usize;
        let backing = vm_memory::MmapRegion::new(size).expect("region memory");
        inner
            .set_device_region(Arc::new(backing))
            .expect("device region");
        let mut d = FaultyDevice::new(inner, Some(Fault::HostileHeader));
        d.write_config_register(
            4 + usize::from(abi::REGION_BAR),
            0,
            &0xc000_0000u32.to_le_bytes(),
        );
        d.write_config_register(4, 0, &0xfebf_0000u32.to_le_bytes());
        let cmd = d.read_config_register(1) as u16;
        d.write_config_register(1, 0, &(cmd | 0x2).to_le_bytes());
        let apic = u64::from(abi::APIC_TABLE_OFFSET);
        for n in 1..=6 {
            let status = handshake(&mut d);
            let err = read(&mut d, abi::REG_ERROR);
            assert_ne!(
                status & abi::STATUS_DRIVER_OK,
                0,
                "DRIVER_OK #{n}: {status:#x}, error {err}"
            );
            let view = d.inner().region_view().expect("attached");
            let h = view.read_header();
            match HostileHeader::nth(n) {
                HostileHeader::SlotsOutside => {
                    assert!(u64::from(h.slots_offset) >= view.info().size)
                }
                HostileHeader::ApicDuplicate => {
                    assert_eq!(word(&view, apic + 4), word(&view, apic))
                }
                HostileHeader::ApicOutOfRange => assert_eq!(word(&view, apic), HOSTILE_APIC_ID),
                HostileHeader::NrVcpusMismatch => assert_eq!(h.nr_vcpus, 3),
                HostileHeader::RewriteAfter => {
                    assert_eq!(
                        (h.magic, h.nr_vcpus),
                        (abi::REGION_MAGIC, 2),
                        "valid until read"
                    );
                    assert_eq!((word(&view, apic), word(&view, apic + 4)), (0, 1));
                    read(&mut d, abi::REG_GENERATION);
                    assert_eq!(view.read_header(), HostileHeader::garbage());
                    assert_eq!(word(&view, apic + 4), u32::MAX);
                }
            }
        }
    }
}
