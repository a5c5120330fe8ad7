//! The pvsched device in its own (sandboxed) process, behind the same
//! [`PciDevice`] interface as the in-process device: the VMM is a
//! vfio-user client (`vfio_user` 0.1.7).
//!
//! The device process is the only owner of the device's state. This side
//! keeps what a VMM keeps for any passthrough device, and nothing of the
//! device's logic:
//!
//! * Configuration space (region 7) and BAR0 (region 0) accesses are socket
//!   round trips ([`Link::messages`] counts them). A copy of configuration
//!   space (`pvsched_device::config_space::ConfigSpace`, following every
//!   write) decodes the BARs for the BAR2 memslot and answers after a loss.
//! * BAR2 (region 2) is mapped from the memfd the device sent with the
//!   region info; that mapping is BAR2's KVM memslot, so the guest's slot
//!   updates never cross the socket.
//! * Guest RAM (a memfd) is handed over once with DMA_MAP.
//! * **Events.** The VMM gives the device process one end of a
//!   `SOCK_SEQPACKET` socketpair at spawn (`--event-fd`). The device sends
//!   a typed [`DeviceEvent`] for each thing its policy sink would hear
//!   (region attached / detached, kick), each **before** its reply to the
//!   access that caused it (`pvsched_transport::events`). So once this side
//!   has a reply, every event that access caused is in its socket buffer:
//!   it drains the socket without blocking, with no further round trip (a
//!   STATUS write costs exactly its one message). [`HostView`] turns the
//!   events into sink calls and a [`RegionView`] of this process's own
//!   memory, after checking the reported region against guest RAM or the
//!   BAR2 mapping with the device crate's own validation
//!   ([`view_of_reported_region`]). Every byte from the device process is
//!   untrusted: a message that is oversized, malformed, out of range or
//!   part of a flood makes the device lost (killed), never a panic.
//!
//! Fault isolation: when the device process dies (socket error on an
//! access, or the watcher reaping it) or hangs (an access times out after
//! [`crate::device_process::REPLY_TIMEOUT`]; the VMM then kills it), or
//! sends a bad event, the remote is marked lost and the region detached
//! (the sink hears `region_detached`). From then on this side answers the
//! guest: BAR0 reads are a fixed DEVICE_NEEDS_RESET answer built from the
//! registers the device last reported (STATUS loses DRIVER_OK and gains
//! 0x40, ERROR = `ERR_DEVICE_FAILED`; MAGIC, VERSION, NR_VCPUS and the
//! offered features are the device's identity, checked at connect), BAR0
//! writes are dropped (so the device stays DEVICE_NEEDS_RESET, even across
//! a reset), configuration space is served from the copy (last values the
//! device had, and it keeps following writes so BAR sizing and memslot
//! moves still work). No new device process is attached.

use crate::device_process::{DeviceProcess, ExitInfo};
use pvsched_abi as abi;
use pvsched_device::config_space::ConfigSpace;
use pvsched_device::event::{
    DeviceEvent, MAX_EVENTS_PER_DRAIN, read_ready, view_of_reported_region,
};
use pvsched_device::registers::{RegisterState, Registers};
use pvsched_device::{
    BarIndex, BarInfo, ConfigWriteResult, DeviceConfig, PciDevice, PolicySink, PvschedDevice,
    RegionMode, RegionView,
};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vm_memory::{
    FileOffset, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MmapRegion, VolatileMemory,
};

/// VFIO PCI region index of configuration space (`VFIO_PCI_CONFIG_REGION_INDEX`).
const CONFIG_REGION: u32 = 7;

/// How long the device gets to exit after the VMM closes its socket.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Errors connecting the remote device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A socket access failed during setup.
    #[error("vfio-user {what} failed: {source}")]
    Access {
        /// What was being done.
        what: &'static str,
        /// The crate's error.
        #[source]
        source: vfio_user::Error,
    },
    /// The device does not offer what the VMM configured.
    #[error(
        "the device process serves {what} {got:#x} but the VMM configured {want:#x}; pass matching --vcpus/--features or update the device program"
    )]
    Mismatch {
        /// Which property.
        what: &'static str,
        /// Device's value.
        got: u64,
        /// VMM's value.
        want: u64,
    },
    /// BAR2 was not offered as a mappable region with an fd.
    #[error(
        "the device process offers no mappable BAR2 (region 2 without an fd or of size {0:#x}); it cannot serve device-region mode to this VMM"
    )]
    NoBar2(u64),
    /// Mapping BAR2 failed.
    #[error("mapping the device's BAR2 fd failed: {0}")]
    MapBar2(#[source] vm_memory::mmap::MmapRegionError),
    /// Guest RAM is not fd-backed.
    #[error("guest RAM region at {0:#x} has no fd; a sandboxed device needs memfd-backed RAM")]
    RamNotShared(u64),
    /// The device configuration is invalid.
    #[error("device model: {0}")]
    Device(#[from] pvsched_device::Error),
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, Error>;

/// How the device process was lost.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceLoss {
    /// How the process ended (PID, signal or exit code, when).
    pub exit: ExitInfo,
    /// What the VMM noticed first: `"socket"` (an access failed or the
    /// device sent a bad event) or `"process"` (the watcher reaped it).
    pub noticed_by: &'static str,
    /// Workload events the VMM had counted when it was lost.
    pub events_at_loss: u64,
}

/// State shared by the remote device, the watcher and the VM.
pub struct Link {
    pid: u32,
    lost: AtomicBool,
    socket_failed: AtomicBool,
    stopping: AtomicBool,
    messages: Arc<AtomicU64>,
    loss: Mutex<Option<DeviceLoss>>,
}

impl Link {
    /// The device process's PID.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the device process is gone (or its socket broke).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Requests sent on the vfio-user socket since connecting (DMA map,
    /// configuration and BAR0 accesses; region-info queries at connect not
    /// counted). Events the device sends on its own socket are not
    /// requests and are not counted.
    pub fn messages(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }

    /// The counter behind [`Link::messages`].
    pub fn message_counter(&self) -> Arc<AtomicU64> {
        self.messages.clone()
    }

    /// How the device process was lost, if it was (not a VMM-initiated stop).
    pub fn loss(&self) -> Option<DeviceLoss> {
        lock(&self.loss).clone()
    }
}

use pvsched_util::lock;

/// Called (from the watcher thread) once the device process is lost.
pub type OnLoss = Arc<dyn Fn(&DeviceLoss) + Send + Sync>;

/// What the watcher does when the child ends: unless the VMM stopped it,
/// mark the link lost, detach the region (the sink hears
/// `region_detached`), record and log the loss, tell the embedder.
pub(crate) fn on_exit(
    link: &Arc<Link>,
    host: &Arc<Mutex<HostView>>,
    events: &(dyn Fn() -> u64 + Send + Sync),
    on_loss: Option<&OnLoss>,
    exit: ExitInfo,
) {
    if link.stopping.load(Ordering::Acquire) {
        log::debug!(
            "device process {} {exit} after the VMM stopped it",
            exit.pid
        );
        return;
    }
    link.lost.store(true, Ordering::Release);
    lock(host).lose();
    let loss = DeviceLoss {
        exit,
        noticed_by: if link.socket_failed.load(Ordering::Acquire) {
            "socket"
        } else {
            "process"
        },
        events_at_loss: events(),
    };
    log::error!(
        "pvsched: device process {} {exit}; the VM keeps running without it: the guest reads DEVICE_NEEDS_RESET (ERROR {}), host policy boosts for this VM are dropped",
        exit.pid,
        abi::ERR_DEVICE_FAILED
    );
    *lock(&link.loss) = Some(loss.clone());
    if let Some(f) = on_loss {
        f(&loss);
    }
}

/// What the VMM knows of the device from its events: the region view in
/// this process, the policy sink it drives, and the registers the device
/// last reported (for the answer after a loss).
pub struct HostView {
    sink: Arc<dyn PolicySink>,
    view: Option<RegionView>,
    registers: RegisterState,
    ram: GuestMemoryMmap,
    bar2: Option<Arc<MmapRegion>>,
    apic_ids: Arc<[u32]>,
    nr_vcpus: u32,
    features: u64,
    lost: bool,
}

impl std::fmt::Debug for HostView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostView")
            .field("view", &self.view.as_ref().map(RegionView::info))
            .field("registers", &self.registers)
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

impl HostView {
    /// Nothing attached yet, for a device configured as `cfg` whose guest
    /// RAM is `ram`. Tells `sink` the vCPU count, as a device does when it
    /// is created.
    pub fn new(cfg: &DeviceConfig, sink: Arc<dyn PolicySink>, ram: GuestMemoryMmap) -> Self {
        sink.vcpu_count(cfg.nr_vcpus);
        Self {
            sink,
            view: None,
            registers: RegisterState::default(),
            ram,
            bar2: None,
            apic_ids: cfg.apic_ids.clone().into(),
            nr_vcpus: cfg.nr_vcpus,
            features: cfg.features,
            lost: false,
        }
    }

    /// The attached region, with host addresses in this process (guest
    /// RAM or the BAR2 mapping).
    pub fn region_view(&self) -> Option<RegionView> {
        self.view.clone()
    }

    /// Act on one event from the device. `bar2_at` is where this process
    /// has BAR2 programmed. An `Err` says why the event cannot come from a
    /// device following the protocol: the caller treats the device as lost.
    pub fn apply(
        &mut self,
        ev: DeviceEvent,
        bar2_at: Option<u64>,
    ) -> std::result::Result<(), String> {
        if self.lost {
            return Ok(());
        }
        match ev {
            DeviceEvent::RegionAttached { region, registers } => {
                if region.nr_vcpus != self.nr_vcpus {
                    return Err(format!(
                        "attach of a region of {} slots, the device has {}",
                        region.nr_vcpus, self.nr_vcpus
                    ));
                }
                let offered = match region.mode {
                    RegionMode::Device => abi::F_DEVICE_REGION,
                    RegionMode::Guest => abi::F_GUEST_REGION,
                };
                if self.features & offered == 0 {
                    return Err(format!("attach of a {:?} region, not offered", region.mode));
                }
                self.registers = registers;
                self.detach();
                match view_of_reported_region(
                    &region,
                    Some(&self.ram),
                    self.bar2.as_ref(),
                    bar2_at,
                    self.apic_ids.clone(),
                ) {
                    Ok(view) => {
                        let info = view.info().clone();
                        self.view = Some(view);
                        self.sink.region_attached(&info);
                    }
                    Err(code) => log::warn!(
                        "pvsched: the device attached a region the VMM cannot map ({region:?}, ERROR {code}); the host policy sees no region"
                    ),
                }
            }
            DeviceEvent::RegionDetached { why, registers } => {
                log::debug!("pvsched: device detached its region ({why:?})");
                self.registers = registers;
                self.detach();
            }
            DeviceEvent::Kick { slot } => {
                if slot >= self.nr_vcpus {
                    return Err(format!("kick of slot {slot} of {}", self.nr_vcpus));
                }
                // Only while attached, as the device itself kicks only at
                // DRIVER_OK (a region this side could not map: no policy).
                if self.view.is_some() {
                    self.sink.kick(slot);
                }
            }
        }
        Ok(())
    }

    /// Revoke the view and tell the sink, if attached.
    fn detach(&mut self) {
        if let Some(view) = self.view.take() {
            view.revoke();
            self.sink.region_detached();
        }
    }

    /// The device is gone: detach (once), and answer for it from now on.
    pub fn lose(&mut self) {
        self.detach();
        self.lost = true;
    }

    /// The register file the guest reads once the device is lost: the
    /// last reported registers, DEVICE_NEEDS_RESET, ERROR = DEVICE_FAILED.
    fn lost_registers(&self) -> Registers {
        let mut r = Registers::new(self.features, self.nr_vcpus);
        r.set_state(self.registers.clone());
        r.needs_reset();
        r
    }
}

/// Read and apply every event waiting on `fd` without blocking (at most
/// [`MAX_EVENTS_PER_DRAIN`]). An `Err` says why the stream cannot come from
/// a device following the protocol (closed, oversized, malformed, out of
/// range, a flood); the caller treats the device as lost.
fn drain_events(
    fd: &OwnedFd,
    host: &Mutex<HostView>,
    bar2_at: Option<u64>,
) -> std::result::Result<(), String> {
    for ev in read_ready(fd.as_fd(), MAX_EVENTS_PER_DRAIN).map_err(|e| e.to_string())? {
        lock(host).apply(ev, bar2_at)?;
    }
    Ok(())
}

/// The device behind a vfio-user socket.
pub struct RemoteDevice {
    client: Mutex<Option<vfio_user::Client>>,
    config: ConfigSpace,
    host: Arc<Mutex<HostView>>,
    events: Option<OwnedFd>,
    link: Arc<Link>,
    process: Arc<DeviceProcess>,
    bar2: Option<Arc<MmapRegion>>,
    identity: (u32, u64, u32),
    dropped_writes: u64,
}

impl RemoteDevice {
    /// A link for the device process `pid`, shared with the watcher's exit
    /// callback and the VM.
    pub fn link(pid: u32) -> Arc<Link> {
        Arc::new(Link {
            pid,
            lost: AtomicBool::new(false),
            socket_failed: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            messages: Arc::new(AtomicU64::new(0)),
            loss: Mutex::new(None),
        })
    }

    /// Wrap a connected `client` of a device configured as `cfg`: check
    /// that the device is that one, map BAR2, DMA-map `ram`. `events` is
    /// this side's end of the event socket the device process was given;
    /// `host` (shared with the watcher) gets the BAR2 mapping.
    pub fn new(
        client: vfio_user::Client,
        cfg: &DeviceConfig,
        events: Option<OwnedFd>,
        process: Arc<DeviceProcess>,
        link: Arc<Link>,
        host: Arc<Mutex<HostView>>,
        ram: &GuestMemoryMmap,
    ) -> Result<Self> {
        let bar2_size = (cfg.features & abi::F_DEVICE_REGION != 0)
            .then(|| PvschedDevice::region_bar_size(cfg.nr_vcpus));
        let config = ConfigSpace::new(cfg.ids, bar2_size);
        let id = config.read(0);
        let mut me = Self {
            client: Mutex::new(Some(client)),
            config,
            host,
            events,
            link,
            process,
            bar2: None,
            identity: (cfg.nr_vcpus, cfg.features, id),
            dropped_writes: 0,
        };
        me.check_identity()?;
        if let Some(want) = bar2_size {
            let map = {
                let c = lock(&me.client);
                let region = c
                    .as_ref()
                    .and_then(|c| c.region(u32::from(abi::REGION_BAR)));
                let size = region.map_or(0, |r| r.size);
                let Some(fo) = region.and_then(|r| r.file_offset.as_ref()) else {
                    return Err(Error::NoBar2(size));
                };
                if size != want {
                    return Err(Error::NoBar2(size));
                }
                let file = fo
                    .file()
                    .try_clone()
                    .map_err(|e| Error::MapBar2(vm_memory::mmap::MmapRegionError::Mmap(e)))?;
                MmapRegion::from_file(FileOffset::new(file, fo.start()), want as usize)
                    .map_err(Error::MapBar2)?
            };
            let map = Arc::new(map);
            lock(&me.host).bar2 = Some(map.clone());
            me.bar2 = Some(map);
        }
        for region in ram.iter() {
            let base = region.start_addr().0;
            let fo = region.file_offset().ok_or(Error::RamNotShared(base))?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(fo.file());
            me.messages_inc();
            me.with_client("DMA_MAP of guest RAM", |c| {
                c.dma_map(fo.start(), base, region.len(), fd)
            })?;
        }
        Ok(me)
    }

    fn messages_inc(&self) {
        self.link.messages.fetch_add(1, Ordering::Relaxed);
    }

    fn with_client<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut vfio_user::Client) -> std::result::Result<T, vfio_user::Error>,
    ) -> Result<T> {
        let mut g = lock(&self.client);
        let Some(c) = g.as_mut() else {
            return Err(Error::Access {
                what,
                source: vfio_user::Error::StreamRead(std::io::ErrorKind::NotConnected.into()),
            });
        };
        f(c).map_err(|source| Error::Access { what, source })
    }

    fn check_identity(&self) -> Result<()> {
        let (want_nr, want_features, want_id) = self.identity;
        let mut b4 = [0u8; 4];
        let mut b8 = [0u8; 8];
        self.with_client("reading the device's identity", |c| {
            c.region_read(CONFIG_REGION, 0, &mut b4)
        })?;
        let id = u32::from_le_bytes(b4);
        self.with_client("reading NR_VCPUS", |c| {
            c.region_read(0, u64::from(abi::REG_NR_VCPUS), &mut b4)
        })?;
        let nr = u32::from_le_bytes(b4);
        self.with_client("reading DEV_FEATURES", |c| {
            c.region_read(0, u64::from(abi::REG_DEV_FEATURES_LO), &mut b8)
        })?;
        let features = u64::from_le_bytes(b8);
        self.link.messages.fetch_add(3, Ordering::Relaxed);
        for (what, got, want) in [
            ("PCI vendor/device ID", u64::from(id), u64::from(want_id)),
            ("NR_VCPUS", u64::from(nr), u64::from(want_nr)),
            ("DEV_FEATURES", features, want_features),
        ] {
            if got != want {
                return Err(Error::Mismatch { what, got, want });
            }
        }
        Ok(())
    }

    /// The shared link (loss state, message counter).
    pub fn shared_link(&self) -> &Arc<Link> {
        &self.link
    }

    /// The VMM's mapping of the device's BAR2 (device-region mode).
    pub fn bar2(&self) -> Option<Arc<MmapRegion>> {
        self.bar2.clone()
    }

    /// What the VMM knows from the device's events (region view, sink).
    pub fn host_view(&self) -> &Arc<Mutex<HostView>> {
        &self.host
    }

    /// The device process.
    pub fn process(&self) -> &Arc<DeviceProcess> {
        &self.process
    }

    /// One request on the socket, then the events it caused; on failure
    /// (of either) the device is lost (killed, region detached) and
    /// `false` is returned.
    fn access(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut vfio_user::Client) -> std::result::Result<(), vfio_user::Error>,
    ) -> bool {
        if self.link.is_lost() {
            return false;
        }
        self.messages_inc();
        if let Err(e) = self.with_client(what, f) {
            self.lose(&e.to_string());
            return false;
        }
        if let Err(why) = self.drain_events() {
            self.lose(&format!("bad event from the device: {why}"));
            return false;
        }
        true
    }

    /// Read every event waiting on the event socket, without blocking, and
    /// apply it. The device sends an access's events before its reply, so
    /// after a reply they are all here.
    fn drain_events(&self) -> std::result::Result<(), String> {
        let Some(fd) = &self.events else {
            return Ok(());
        };
        let bar2_at = self
            .bar2
            .is_some()
            .then(|| self.config.bar_programmed(BarIndex(abi::REGION_BAR)));
        drain_events(fd, &self.host, bar2_at)
    }

    fn lose(&self, why: &str) {
        if self.link.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        self.link.socket_failed.store(true, Ordering::Release);
        log::debug!(
            "device process {}: {why}; killing it, the watcher reports how it ended",
            self.link.pid
        );
        if let Some(c) = lock(&self.client).take() {
            let _ = c.shutdown();
        }
        lock(&self.host).lose();
        self.process.kill();
    }

    /// A BAR2 access through this process's mapping of it (the guest's
    /// go through the memslot and never get here): 1, 2, 4 or 8 bytes
    /// inside the BAR, else nothing (a read then reads 0).
    fn bar2_access(&self, offset: u64, len: usize) -> Option<vm_memory::VolatileSlice<'_>> {
        let map = self.bar2.as_ref()?;
        if !matches!(len, 1 | 2 | 4 | 8) {
            return None;
        }
        map.get_slice(usize::try_from(offset).ok()?, len).ok()
    }
}

impl PciDevice for RemoteDevice {
    fn debug_label(&self) -> String {
        format!("pvsched (device process {})", self.link.pid)
    }

    fn read_config_register(&self, reg_idx: usize) -> u32 {
        if reg_idx >= 64 {
            return u32::MAX;
        }
        let mut b = [0u8; 4];
        if self.access("config read", |c| {
            c.region_read(CONFIG_REGION, reg_idx as u64 * 4, &mut b)
        }) {
            return u32::from_le_bytes(b);
        }
        self.config.read(reg_idx)
    }

    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteResult {
        let in_range = reg_idx < 64
            && matches!(data.len(), 1 | 2 | 4)
            && offset
                .checked_add(data.len() as u64)
                .is_some_and(|end| end <= 4);
        if in_range {
            let at = reg_idx as u64 * 4 + offset;
            self.access("config write", |c| c.region_write(CONFIG_REGION, at, data));
        }
        ConfigWriteResult {
            bar_changes: self.config.write(reg_idx, offset, data),
        }
    }

    fn bars(&self) -> Vec<BarInfo> {
        self.config.bars()
    }

    fn read_bar(&mut self, bar: BarIndex, offset: u64, data: &mut [u8]) {
        match bar.0 {
            abi::REG_BAR => {
                if !self.access("BAR0 read", |c| {
                    c.region_read(u32::from(abi::REG_BAR), offset, data)
                }) {
                    // Lost: the fixed DEVICE_NEEDS_RESET answer.
                    lock(&self.host).lost_registers().read_bar(offset, data);
                }
            }
            abi::REGION_BAR => match self.bar2_access(offset, data.len()) {
                Some(s) => {
                    if s.copy_to(data) != data.len() {
                        data.fill(0);
                    }
                }
                None => data.fill(0),
            },
            _ => data.fill(0),
        }
    }

    fn write_bar(&mut self, bar: BarIndex, offset: u64, data: &[u8]) {
        if bar.0 == abi::REGION_BAR {
            if let Some(s) = self.bar2_access(offset, data.len()) {
                s.copy_from(data);
            }
            return;
        }
        if bar.0 != abi::REG_BAR {
            return;
        }
        // Events the write caused (attach, detach, kick) are applied in
        // `access`, before it returns.
        if !self.access("BAR0 write", |c| {
            c.region_write(u32::from(abi::REG_BAR), offset, data)
        }) {
            self.dropped_writes += 1;
            if self.dropped_writes == 1 {
                log::warn!(
                    "pvsched: device process {} is gone; guest BAR0 writes are dropped",
                    self.link.pid
                );
            }
        }
    }
}

impl RemoteDevice {
    /// Stop the device process: close the socket, give it 2 s
    /// to exit, kill it otherwise, reap it. Not a loss.
    pub fn shutdown(&self) -> Option<ExitInfo> {
        self.link.stopping.store(true, Ordering::Release);
        if let Some(c) = lock(&self.client).take() {
            let _ = c.shutdown();
        }
        self.process.stop(STOP_GRACE)
    }

    /// STATUS and ERROR: from the device while it lives, else the fixed
    /// DEVICE_NEEDS_RESET answer.
    pub fn status(&self) -> (u32, u32) {
        let mut s = [0u8; 4];
        let mut e = [0u8; 4];
        if self.access("BAR0 read", |c| {
            c.region_read(0, u64::from(abi::REG_STATUS), &mut s)
        }) && self.access("BAR0 read", |c| {
            c.region_read(0, u64::from(abi::REG_ERROR), &mut e)
        }) {
            return (u32::from_le_bytes(s), u32::from_le_bytes(e));
        }
        let r = lock(&self.host).lost_registers();
        (r.status(), r.error())
    }
}

impl Drop for RemoteDevice {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_device::event::{DetachReason, MAX_EVENT_SIZE, ReportedRegion};
    use pvsched_device::{PolicySink, RegionInfo};
    use std::os::fd::AsRawFd;
    use std::time::Instant;
    use vm_memory::GuestAddress;

    /// What the sink heard, in order.
    #[derive(Default)]
    struct Heard(Mutex<Vec<String>>);

    impl PolicySink for Heard {
        fn region_attached(&self, r: &RegionInfo) {
            lock(&self.0).push(format!(
                "attached {:?} {} {:#x}",
                r.mode, r.generation, r.guest_addr
            ));
        }
        fn region_detached(&self) {
            lock(&self.0).push("detached".into());
        }
        fn kick(&self, slot: u32) {
            lock(&self.0).push(format!("kick {slot}"));
        }
        fn vcpu_count(&self, n: u32) {
            lock(&self.0).push(format!("vcpus {n}"));
        }
    }

    impl Heard {
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *lock(&self.0))
        }
    }

    fn exit() -> ExitInfo {
        ExitInfo {
            pid: 42,
            signal: Some(libc::SIGKILL),
            exit_code: None,
            at: Instant::now(),
        }
    }

    fn host(sink: Arc<Heard>) -> Arc<Mutex<HostView>> {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        Arc::new(Mutex::new(HostView::new(&DeviceConfig::new(2), sink, mem)))
    }

    fn driver_ok() -> RegisterState {
        RegisterState {
            drv_features: abi::F_GUEST_REGION,
            status: 0xf,
            shm_gpa: 0x10000,
            shm_size: 4096,
            generation: 1,
            driver_version: abi::ABI_VERSION,
            ..RegisterState::default()
        }
    }

    fn attach() -> DeviceEvent {
        DeviceEvent::RegionAttached {
            region: ReportedRegion {
                mode: RegionMode::Guest,
                generation: 1,
                nr_vcpus: 2,
                size: 4096,
                guest_addr: 0x10000,
            },
            registers: driver_ok(),
        }
    }

    fn attached_host(sink: Arc<Heard>) -> Arc<Mutex<HostView>> {
        let h = host(sink.clone());
        lock(&h).apply(attach(), None).expect("valid attach");
        assert!(lock(&h).region_view().is_some());
        sink.take();
        h
    }

    #[test]
    fn events_become_the_sink_calls_and_a_view_of_this_process_memory() {
        let sink = Arc::new(Heard::default());
        let h = host(sink.clone());
        assert_eq!(
            sink.take(),
            ["vcpus 2"],
            "told at creation, as a device does"
        );
        let mut g = lock(&h);
        g.apply(DeviceEvent::Kick { slot: 1 }, None).unwrap();
        assert!(
            sink.take().is_empty(),
            "no kick before a region is attached"
        );
        g.apply(attach(), None).unwrap();
        let view = g.region_view().expect("attached");
        let host_addr = g.ram.get_host_address(GuestAddress(0x10000)).unwrap();
        assert_eq!(view.info().host_addr, host_addr as usize);
        g.apply(DeviceEvent::Kick { slot: 1 }, None).unwrap();
        g.apply(
            DeviceEvent::RegionDetached {
                why: DetachReason::Reset,
                registers: RegisterState::default(),
            },
            None,
        )
        .unwrap();
        assert!(!view.is_attached(), "revoked before the sink hears it");
        assert!(g.region_view().is_none());
        assert_eq!(
            sink.take(),
            ["attached Guest 1 0x10000", "kick 1", "detached"]
        );
    }

    #[test]
    fn a_region_outside_this_process_memory_gets_no_view() {
        let sink = Arc::new(Heard::default());
        let h = host(sink.clone());
        sink.take();
        let mut ev = attach();
        if let DeviceEvent::RegionAttached { region, .. } = &mut ev {
            region.guest_addr = 1 << 30;
        }
        lock(&h).apply(ev, None).expect("not a protocol violation");
        assert!(lock(&h).region_view().is_none());
        assert!(sink.take().is_empty());
    }

    #[test]
    fn impossible_events_are_refused() {
        let sink = Arc::new(Heard::default());
        let h = attached_host(sink.clone());
        let mut bad_n = attach();
        if let DeviceEvent::RegionAttached { region, .. } = &mut bad_n {
            region.nr_vcpus = 3;
        }
        for ev in [DeviceEvent::Kick { slot: 2 }, bad_n] {
            assert!(lock(&h).apply(ev.clone(), None).is_err(), "{ev:?}");
        }
        let mut cfg = DeviceConfig::new(2);
        cfg.features = abi::F_ALL & !abi::F_GUEST_REGION;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut no_guest = HostView::new(&cfg, sink.clone(), mem);
        assert!(no_guest.apply(attach(), None).is_err(), "mode not offered");
    }

    fn pair() -> (OwnedFd, OwnedFd) {
        pvsched_util::seqpacket_pair().unwrap()
    }

    fn send(fd: &OwnedFd, bytes: &[u8]) {
        // SAFETY: send of a buffer of the length passed on our own socket.
        let n = unsafe { libc::send(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        assert_eq!(n, bytes.len() as isize);
    }

    #[test]
    fn a_well_formed_stream_drains_without_blocking() {
        let sink = Arc::new(Heard::default());
        let h = host(sink.clone());
        sink.take();
        let (ours, theirs) = pair();
        drain_events(&ours, &h, None).expect("nothing waiting: returns at once");
        send(&theirs, &attach().encode());
        send(&theirs, &DeviceEvent::Kick { slot: 0 }.encode());
        drain_events(&ours, &h, None).expect("valid");
        assert_eq!(sink.take(), ["attached Guest 1 0x10000", "kick 0"]);
    }

    #[test]
    fn a_hostile_event_stream_is_refused_not_a_panic() {
        let big = vec![b' '; MAX_EVENT_SIZE + 1];
        let flood: Vec<Vec<u8>> = (0..=MAX_EVENTS_PER_DRAIN)
            .map(|_| DeviceEvent::Kick { slot: 0 }.encode())
            .collect();
        let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
            ("garbage", vec![b"\x00\xffnot json".to_vec()]),
            ("oversized", vec![big]),
            ("empty message", vec![Vec::new()]),
            ("unknown event", vec![b"{\"event\":\"reboot\"}".to_vec()]),
            (
                "slot out of range",
                vec![DeviceEvent::Kick { slot: 9 }.encode()],
            ),
            ("flood", flood),
        ];
        for (what, msgs) in cases {
            let sink = Arc::new(Heard::default());
            let h = attached_host(sink.clone());
            let (ours, theirs) = pair();
            for m in &msgs {
                send(&theirs, m);
            }
            let e = drain_events(&ours, &h, None).expect_err(what);
            println!("{what}: {e}");
        }
        let sink = Arc::new(Heard::default());
        let h = attached_host(sink);
        let (ours, theirs) = pair();
        drop(theirs);
        assert!(drain_events(&ours, &h, None).is_err(), "closed");
    }

    #[test]
    fn a_loss_detaches_answers_needs_reset_and_tells_the_embedder_once() {
        let sink = Arc::new(Heard::default());
        let h = attached_host(sink.clone());
        let link = RemoteDevice::link(42);
        let calls = Arc::new(AtomicU64::new(0));
        let c2 = calls.clone();
        let hook: OnLoss = Arc::new(move |l: &DeviceLoss| {
            assert_eq!(l.exit.signal, Some(libc::SIGKILL));
            c2.fetch_add(1, Ordering::SeqCst);
        });
        on_exit(&link, &h, &|| 7, Some(&hook), exit());
        assert!(link.is_lost());
        let loss = link.loss().expect("recorded");
        assert_eq!((loss.noticed_by, loss.events_at_loss), ("process", 7));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(sink.take(), ["detached"]);
        let g = lock(&h);
        assert!(g.region_view().is_none());
        let r = g.lost_registers();
        assert_eq!(
            r.status(),
            abi::STATUS_ACKNOWLEDGE
                | abi::STATUS_DRIVER
                | abi::STATUS_FEATURES_OK
                | abi::STATUS_DEVICE_NEEDS_RESET,
            "the bits it had, without DRIVER_OK"
        );
        assert_eq!(r.error(), abi::ERR_DEVICE_FAILED);
        let mut b = [0u8; 4];
        assert!(r.read_bar(u64::from(abi::REG_MAGIC), &mut b));
        assert_eq!(u32::from_le_bytes(b), abi::MAGIC);
        assert!(r.read_bar(u64::from(abi::REG_NR_VCPUS), &mut b));
        assert_eq!(u32::from_le_bytes(b), 2);
    }

    #[test]
    fn events_after_a_loss_are_ignored() {
        let sink = Arc::new(Heard::default());
        let h = attached_host(sink.clone());
        lock(&h).lose();
        assert_eq!(sink.take(), ["detached"]);
        lock(&h).apply(attach(), None).unwrap();
        lock(&h).apply(DeviceEvent::Kick { slot: 0 }, None).unwrap();
        assert!(sink.take().is_empty());
        assert!(lock(&h).region_view().is_none());
    }

    #[test]
    fn a_stop_the_vmm_asked_for_is_not_a_loss() {
        let sink = Arc::new(Heard::default());
        let h = attached_host(sink.clone());
        let link = RemoteDevice::link(42);
        link.stopping.store(true, Ordering::SeqCst);
        on_exit(&link, &h, &|| 0, None, exit());
        assert!(!link.is_lost());
        assert!(link.loss().is_none());
        assert!(sink.take().is_empty());
        assert!(lock(&h).region_view().is_some());
    }
}
