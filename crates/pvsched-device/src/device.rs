//! [`PvschedDevice`]: configuration space, register file and region tied
//! together behind the [`PciDevice`] trait.
//!
//! BAR0 is the register file (see [`crate::registers`] for the handshake);
//! BAR2, present only when `F_DEVICE_REGION` is offered, is the device
//! region. Accesses to BAR2 through [`PciDevice::read_bar`] /
//! [`PciDevice::write_bar`] (for transports that cannot map it) go to the
//! backing memory, bounds-checked, whatever the handshake state; without
//! backing they read 0. Accesses to other BARs read 0 and are ignored.
//!
//! Memory changes: [`PvschedDevice::set_guest_memory`] re-resolves an
//! attached guest region (if the host address changed, old views are revoked
//! and the policy sees `region_detached` then `region_attached` with the same
//! generation); if the region no longer lies in RAM the device goes
//! DEVICE_NEEDS_RESET. Replacing the device-region backing while a device
//! region is attached also sets DEVICE_NEEDS_RESET. Moving BAR2 or clearing
//! COMMAND.MEMORY while attached does not detach: the backing memory is
//! unchanged and the transport acts on the reported [`BarChange`]s.

use crate::config_space::{ConfigSpace, PciIds};
use crate::log_limit::{LogLimiter, warn_limited};
use crate::pci::{BarIndex, BarInfo, ConfigWriteResult, PciDevice};
use crate::region::{self, Mapping, RegionInfo, RegionMode, RegionView};
use crate::registers::{self, Effect, Registers};
use crate::sink::PolicySink;
use crate::snapshot::{DeviceSnapshot, SNAPSHOT_FORMAT};
use pvsched_abi as abi;
use std::sync::Arc;
use vm_memory::{GuestMemoryMmap, MmapRegion};

/// Errors from building, configuring or restoring a [`PvschedDevice`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `apic_ids` does not have one entry per vCPU.
    #[error(
        "apic_ids has {got} entries but nr_vcpus is {expected}; give one APIC ID per vCPU slot"
    )]
    ApicIdsLen {
        /// nr_vcpus.
        expected: u32,
        /// apic_ids.len().
        got: usize,
    },
    /// The device-region backing has the wrong size or alignment.
    #[error(
        "device region backing is {got:#x} bytes at a host address not 64-byte aligned or of the wrong size; it must be exactly region_bar_size = {expected:#x} bytes"
    )]
    DeviceRegionSize {
        /// region_bar_size(nr_vcpus).
        expected: u64,
        /// Size supplied.
        got: u64,
    },
    /// The device does not offer F_DEVICE_REGION, so it has no BAR2.
    #[error(
        "device region backing given but F_DEVICE_REGION is not offered; add it to DeviceConfig::features"
    )]
    DeviceRegionNotOffered,
    /// Offered features contain bits ABI v1 does not define, or no region mode.
    #[error(
        "offered features {0:#x} must be a subset of F_ALL and include F_DEVICE_REGION or F_GUEST_REGION"
    )]
    Features(u64),
    /// nr_vcpus is 0 or above MAX_VCPUS.
    #[error("nr_vcpus {0} is out of range; use 1..={max}", max = abi::MAX_VCPUS)]
    NrVcpus(u32),
    /// The attached region could not be re-validated at restore.
    #[error(
        "restored device had a region attached that is no longer valid (ERROR code {0}); the device is DEVICE_NEEDS_RESET and the guest must reset it"
    )]
    RestoreRegion(u32),
    /// The snapshot belongs to a differently configured device.
    #[error(
        "snapshot does not match this device ({0}); create the device with the snapshot's configuration"
    )]
    SnapshotMismatch(&'static str),
}

/// Static configuration of a device.
///
/// ```
/// use pvsched_device::DeviceConfig;
/// let cfg = DeviceConfig::new(4);
/// assert_eq!(cfg.apic_ids, vec![0, 1, 2, 3]);
/// assert_eq!(cfg.features, pvsched_abi::F_ALL);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Number of vCPU slots, `1..=MAX_VCPUS`.
    pub nr_vcpus: u32,
    /// Slot `i` → APIC ID; `len == nr_vcpus`.
    pub apic_ids: Vec<u32>,
    /// PCI identity.
    pub ids: PciIds,
    /// Offered features; `F_DEVICE_REGION` makes BAR2 exist.
    pub features: u64,
}

impl DeviceConfig {
    /// `nr_vcpus` slots with APIC IDs `0..nr_vcpus`, default IDs, all features.
    pub fn new(nr_vcpus: u32) -> Self {
        Self {
            nr_vcpus,
            apic_ids: (0..nr_vcpus.min(abi::MAX_VCPUS)).collect(),
            ids: PciIds::default(),
            features: abi::F_ALL,
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if self.nr_vcpus == 0 || self.nr_vcpus > abi::MAX_VCPUS {
            return Err(Error::NrVcpus(self.nr_vcpus));
        }
        if self.apic_ids.len() != self.nr_vcpus as usize {
            return Err(Error::ApicIdsLen {
                expected: self.nr_vcpus,
                got: self.apic_ids.len(),
            });
        }
        if self.features & !abi::F_ALL != 0
            || self.features & (abi::F_DEVICE_REGION | abi::F_GUEST_REGION) == 0
        {
            return Err(Error::Features(self.features));
        }
        Ok(())
    }
}

/// The pvsched PCI device.
///
/// ```
/// use pvsched_abi as abi;
/// use pvsched_device::testing::device_handshake;
/// use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
/// use std::sync::Arc;
/// use vm_memory::MmapRegion;
///
/// let mut dev = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).unwrap();
/// let size = PvschedDevice::region_bar_size(2) as usize;
/// dev.set_device_region(Arc::new(MmapRegion::new(size).unwrap())).unwrap();
/// device_handshake(&mut dev, 0xc000_0000);
/// assert_eq!(dev.status(), 0xf);
/// assert_eq!(dev.region_view().unwrap().read_header().nr_vcpus, 2);
/// ```
pub struct PvschedDevice {
    cfg: DeviceConfig,
    sink: Arc<dyn PolicySink>,
    config: ConfigSpace,
    regs: Registers,
    mem: Option<GuestMemoryMmap>,
    backing: Option<Arc<MmapRegion>>,
    view: Option<RegionView>,
    apic_ids: Arc<[u32]>,
    bad_access: LogLimiter,
}

impl std::fmt::Debug for PvschedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PvschedDevice")
            .field("cfg", &self.cfg)
            .field("regs", self.regs.state())
            .field("config", self.config.state())
            .field("view", &self.view.as_ref().map(|v| v.info()))
            .finish_non_exhaustive()
    }
}

impl PvschedDevice {
    /// A device in reset state. Tells `sink` the vCPU count.
    pub fn new(cfg: DeviceConfig, sink: Arc<dyn PolicySink>) -> Result<Self, Error> {
        cfg.validate()?;
        let bar2 =
            (cfg.features & abi::F_DEVICE_REGION != 0).then(|| Self::region_bar_size(cfg.nr_vcpus));
        let config = ConfigSpace::new(cfg.ids, bar2);
        let regs = Registers::new(cfg.features, cfg.nr_vcpus);
        let apic_ids: Arc<[u32]> = cfg.apic_ids.clone().into();
        sink.vcpu_count(cfg.nr_vcpus);
        Ok(Self {
            cfg,
            sink,
            config,
            regs,
            mem: None,
            backing: None,
            view: None,
            apic_ids,
            bad_access: LogLimiter::new(),
        })
    }

    /// Size of BAR2 for `nr_vcpus` slots: `region_size(nr_vcpus)` rounded up
    /// to a power of two (at least 4096). `nr_vcpus` is clamped to
    /// `1..=MAX_VCPUS`.
    ///
    /// ```
    /// use pvsched_device::PvschedDevice;
    /// assert_eq!(PvschedDevice::region_bar_size(1), 4096);
    /// assert_eq!(PvschedDevice::region_bar_size(64), 16384); // 12288 rounded up
    /// ```
    pub fn region_bar_size(nr_vcpus: u32) -> u64 {
        let n = nr_vcpus.clamp(1, abi::MAX_VCPUS);
        u64::from(abi::region_size(n))
            .next_power_of_two()
            .max(u64::from(abi::PAGE_SIZE))
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &DeviceConfig {
        &self.cfg
    }

    /// Guest RAM, for guest-region validation and access. May be replaced
    /// at any time (QEMU SYNC_SYSMEM): an attached guest region is
    /// re-resolved, or the device goes DEVICE_NEEDS_RESET if it no longer
    /// lies in RAM.
    pub fn set_guest_memory(&mut self, mem: GuestMemoryMmap) {
        self.mem = Some(mem);
        let Some(view) = &self.view else { return };
        if view.info().mode != RegionMode::Guest {
            return;
        }
        let s = self.regs.state();
        match region::resolve_guest_region(
            self.mem.as_ref(),
            s.shm_gpa,
            u64::from(s.shm_size),
            self.cfg.nr_vcpus,
        ) {
            Ok(mapping) if mapping.host_addr() == view.info().host_addr => {
                view.replace_mapping(mapping);
            }
            Ok(mapping) => {
                let info = RegionInfo {
                    host_addr: mapping.host_addr(),
                    ..view.info().clone()
                };
                self.detach();
                self.publish(info, mapping);
            }
            Err(code) => {
                log::warn!(
                    "pvsched: guest region no longer valid after memory change (ERROR {code}); device needs reset"
                );
                self.set_needs_reset();
            }
        }
    }

    /// Device-region backing (BAR2). Its size must equal
    /// [`region_bar_size`](Self::region_bar_size). Replacing the backing
    /// while a device region is attached sets DEVICE_NEEDS_RESET.
    pub fn set_device_region(&mut self, region: Arc<MmapRegion>) -> Result<(), Error> {
        if self.cfg.features & abi::F_DEVICE_REGION == 0 {
            return Err(Error::DeviceRegionNotOffered);
        }
        let expected = Self::region_bar_size(self.cfg.nr_vcpus);
        let got = region.size() as u64;
        if got != expected || !(region.as_ptr() as usize).is_multiple_of(64) {
            return Err(Error::DeviceRegionSize { expected, got });
        }
        if self
            .view
            .as_ref()
            .is_some_and(|v| v.info().mode == RegionMode::Device)
        {
            self.set_needs_reset();
        }
        self.backing = Some(region);
        Ok(())
    }

    /// STATUS register.
    pub fn status(&self) -> u32 {
        self.regs.status()
    }

    /// ERROR register.
    pub fn error(&self) -> u32 {
        self.regs.error()
    }

    /// GENERATION register.
    pub fn generation(&self) -> u32 {
        self.regs.state().generation
    }

    /// A handle onto the attached region, if any.
    pub fn region_view(&self) -> Option<RegionView> {
        self.view.clone()
    }

    /// Mark the device broken (back end gone): STATUS gains
    /// DEVICE_NEEDS_RESET (and loses DRIVER_OK), ERROR = DEVICE_FAILED, the
    /// region is detached. A reset (STATUS = 0) clears it.
    pub fn set_needs_reset(&mut self) {
        self.regs.needs_reset();
        self.detach();
    }

    /// The device state as serde data.
    pub fn snapshot(&self) -> DeviceSnapshot {
        DeviceSnapshot {
            format: SNAPSHOT_FORMAT,
            nr_vcpus: self.cfg.nr_vcpus,
            features: self.cfg.features,
            ids: self.cfg.ids,
            apic_ids: self.cfg.apic_ids.clone(),
            config: self.config.state().clone(),
            registers: self.regs.state().clone(),
        }
    }

    /// Restore state taken by [`snapshot`](Self::snapshot) from a device
    /// with the same configuration. If the snapshot has DRIVER_OK, the
    /// region is re-validated against the current memory (without
    /// rewriting the header) and re-attached; if that fails the device is
    /// left DEVICE_NEEDS_RESET and [`Error::RestoreRegion`] is returned.
    pub fn restore(&mut self, s: DeviceSnapshot) -> Result<(), Error> {
        if s.format != SNAPSHOT_FORMAT {
            return Err(Error::SnapshotMismatch("snapshot format"));
        }
        if s.nr_vcpus != self.cfg.nr_vcpus {
            return Err(Error::SnapshotMismatch("nr_vcpus"));
        }
        if s.features != self.cfg.features {
            return Err(Error::SnapshotMismatch("offered features"));
        }
        if s.ids != self.cfg.ids {
            return Err(Error::SnapshotMismatch("PCI IDs"));
        }
        if s.apic_ids != self.cfg.apic_ids {
            return Err(Error::SnapshotMismatch("APIC IDs"));
        }
        self.detach();
        self.config.set_state(s.config);
        self.regs.set_state(s.registers);
        if self.regs.status() & abi::STATUS_DRIVER_OK == 0 {
            return Ok(());
        }
        match self.resolve(false) {
            Ok((mapping, info)) => {
                self.publish(info, mapping);
                Ok(())
            }
            Err(code) => {
                self.set_needs_reset();
                Err(Error::RestoreRegion(code))
            }
        }
    }

    /// Resolve the negotiated region; the `ERR_*` code on refusal.
    /// `require_decoded`: a device region needs BAR2 decoded (at DRIVER_OK;
    /// not at restore, since an attached device region stays attached while
    /// the guest toggles decoding).
    fn resolve(&self, require_decoded: bool) -> Result<(Mapping, RegionInfo), u32> {
        let nr = self.cfg.nr_vcpus;
        let s = self.regs.state();
        let (mapping, guest_addr, size) = match self.regs.region_mode() {
            Some(RegionMode::Guest) => {
                let size = u64::from(s.shm_size);
                let m = region::resolve_guest_region(self.mem.as_ref(), s.shm_gpa, size, nr)?;
                (m, s.shm_gpa, size)
            }
            Some(RegionMode::Device) => {
                let bar2 = BarIndex(abi::REGION_BAR);
                let addr = match self.config.bar_address(bar2) {
                    Some(a) => a,
                    None if !require_decoded => self.config.bar_programmed(bar2),
                    None => return Err(abi::ERR_REGION_UNMAPPED),
                };
                let m = region::resolve_device_region(self.backing.clone())?;
                let size = m.len() as u64;
                (m, addr, size)
            }
            None => return Err(abi::ERR_NO_REGION_MODE),
        };
        let info = RegionInfo {
            mode: self.regs.region_mode().unwrap_or(RegionMode::Guest),
            generation: s.generation,
            nr_vcpus: nr,
            size,
            guest_addr,
            host_addr: mapping.host_addr(),
        };
        Ok((mapping, info))
    }

    /// DRIVER_OK: resolve, initialise and publish the region.
    fn attach(&mut self) {
        match self.resolve(true) {
            Ok((mapping, mut info)) => {
                let generation = self.regs.state().generation.wrapping_add(1);
                let header = region::header(
                    self.cfg.nr_vcpus,
                    generation,
                    self.sink.host_flags(),
                    self.regs.state().drv_features,
                    self.regs.state().driver_version,
                );
                mapping.initialize(&header, &self.apic_ids);
                self.regs.attached(generation);
                info.generation = generation;
                self.publish(info, mapping);
            }
            Err(code) => {
                log::info!("pvsched: DRIVER_OK refused with ERROR {code}");
                self.regs.fail(code);
            }
        }
    }

    fn publish(&mut self, info: RegionInfo, mapping: Mapping) {
        let view = RegionView::new(info.clone(), mapping, self.apic_ids.clone());
        self.view = Some(view);
        self.sink.region_attached(&info);
    }

    /// Stop touching the region and tell the policy, if attached.
    fn detach(&mut self) {
        if let Some(view) = self.view.take() {
            view.revoke();
            self.sink.region_detached();
        }
    }

    fn apply(&mut self, effect: Effect) {
        match effect {
            Effect::None => {}
            Effect::Reset | Effect::Detach => self.detach(),
            Effect::Attach => self.attach(),
            Effect::Kick(slot) => self.sink.kick(slot),
        }
    }

    /// The backing of BAR2 as a bounds-checked window.
    fn bar2(&self) -> Option<Mapping> {
        let b = self.backing.clone()?;
        let size = b.size();
        Mapping::new(b, 0, size)
    }
}

impl PciDevice for PvschedDevice {
    fn debug_label(&self) -> String {
        "pvsched".to_string()
    }

    fn read_config_register(&self, reg_idx: usize) -> u32 {
        self.config.read(reg_idx)
    }

    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteResult {
        ConfigWriteResult {
            bar_changes: self.config.write(reg_idx, offset, data),
        }
    }

    fn bars(&self) -> Vec<BarInfo> {
        self.config.bars()
    }

    /// BAR0: registers (bad accesses read 0). BAR2: backing memory
    /// (out of bounds or no backing reads 0). Other BARs read 0.
    fn read_bar(&mut self, bar: BarIndex, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let len = data.len();
        match bar.0 {
            abi::REG_BAR => {
                if !self.regs.read_bar(offset, data) {
                    warn_limited!(
                        self.bad_access,
                        "pvsched: bad BAR0 read at {offset:#x} len {len}; reads 0"
                    );
                }
            }
            abi::REGION_BAR
                if self.config.bar_size(bar).is_some() && matches!(len, 1 | 2 | 4 | 8) =>
            {
                if !self.bar2().is_some_and(|m| m.read_bytes(offset, data)) {
                    data.fill(0);
                    warn_limited!(
                        self.bad_access,
                        "pvsched: BAR2 read at {offset:#x} len {len} outside backing; reads 0"
                    );
                }
            }
            _ => warn_limited!(
                self.bad_access,
                "pvsched: read of {bar} at {offset:#x} len {len}; reads 0"
            ),
        }
    }

    /// BAR0: registers (bad accesses ignored). BAR2: backing memory
    /// (out of bounds or no backing ignored). Other BARs: ignored.
    fn write_bar(&mut self, bar: BarIndex, offset: u64, data: &[u8]) {
        let len = data.len();
        match bar.0 {
            abi::REG_BAR => match registers::access_ok(offset, len) {
                Some(off) => {
                    let mut bytes = [0u8; 8];
                    bytes[..len].copy_from_slice(data);
                    let v = u64::from_le_bytes(bytes);
                    let effect = self.regs.write(off, v as u32);
                    self.apply(effect);
                    if len == 8 {
                        let effect = self.regs.write(off + 4, (v >> 32) as u32);
                        self.apply(effect);
                    }
                }
                None => warn_limited!(
                    self.bad_access,
                    "pvsched: bad BAR0 write at {offset:#x} len {len}; ignored"
                ),
            },
            abi::REGION_BAR
                if self.config.bar_size(bar).is_some() && matches!(len, 1 | 2 | 4 | 8) =>
            {
                if !self.bar2().is_some_and(|m| m.write_bytes(offset, data)) {
                    warn_limited!(
                        self.bad_access,
                        "pvsched: BAR2 write at {offset:#x} len {len} outside backing; ignored"
                    );
                }
            }
            _ => warn_limited!(
                self.bad_access,
                "pvsched: write to {bar} at {offset:#x} len {len}; ignored"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::NullSink;

    #[test]
    fn config_validation() {
        let sink: Arc<dyn PolicySink> = Arc::new(NullSink);
        assert!(matches!(
            PvschedDevice::new(DeviceConfig::new(0), sink.clone()),
            Err(Error::NrVcpus(0))
        ));
        assert!(PvschedDevice::new(DeviceConfig::new(abi::MAX_VCPUS + 1), sink.clone()).is_err());
        let mut c = DeviceConfig::new(2);
        c.apic_ids.pop();
        assert!(matches!(
            PvschedDevice::new(c, sink.clone()),
            Err(Error::ApicIdsLen { .. })
        ));
        let mut c = DeviceConfig::new(2);
        c.features = abi::F_KICK;
        assert!(matches!(
            PvschedDevice::new(c, sink.clone()),
            Err(Error::Features(_))
        ));
        let mut c = DeviceConfig::new(2);
        c.features = abi::F_GUEST_REGION;
        let mut d = PvschedDevice::new(c, sink).unwrap();
        assert_eq!(d.bars().len(), 1);
        let r = Arc::new(MmapRegion::new(4096).unwrap());
        assert!(matches!(
            d.set_device_region(r),
            Err(Error::DeviceRegionNotOffered)
        ));
    }

    #[test]
    fn bar_size_formula() {
        for n in [1, 2, 31, 32, 100, abi::MAX_VCPUS] {
            let s = PvschedDevice::region_bar_size(n);
            assert!(s.is_power_of_two());
            assert!(s >= u64::from(abi::region_size(n)));
        }
        assert_eq!(PvschedDevice::region_bar_size(0), 4096);
        assert_eq!(
            PvschedDevice::region_bar_size(u32::MAX),
            PvschedDevice::region_bar_size(abi::MAX_VCPUS)
        );
    }
}
