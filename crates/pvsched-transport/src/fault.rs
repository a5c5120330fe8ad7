//! Fault injection for the guest driver's negative tests: a wrapper that
//! makes a correct device misbehave in one chosen way.
//!
//! - [`Fault::WrongMagic`]: BAR0 MAGIC reads a wrong value.
//! - [`Fault::WrongVersion`]: BAR0 VERSION reads major `ABI_MAJOR + 1`.
//! - [`Fault::RefuseRegion`]: the guest region's GPA is moved far outside
//!   RAM on its way in (SHM_GPA_HI write), so the real device model refuses
//!   DRIVER_OK with `ERR_REGION_OUTSIDE_RAM`.
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
use vm_memory::GuestMemoryMmap;

/// Which misbehaviour to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer a wrong MAGIC.
    WrongMagic,
    /// Answer a wrong major VERSION.
    WrongVersion,
    /// Refuse the guest region at DRIVER_OK.
    RefuseRegion,
}

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
}

impl<D> FaultyDevice<D> {
    /// Wrap `inner`; `None` injects nothing.
    pub fn new(inner: D, fault: Option<Fault>) -> Self {
        FaultyDevice {
            inner,
            fault,
            trigger: None,
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

impl<D: PciDevice> PciDevice for FaultyDevice<D> {
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
}
