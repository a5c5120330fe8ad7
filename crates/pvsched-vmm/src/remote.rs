//! The pvsched device in its own (sandboxed) process, behind the same
//! [`PciDevice`] interface as the in-process device: the VMM is a
//! vfio-user client (`vfio_user` 0.1.7).
//!
//! * Configuration space (region 7) and BAR0 (region 0) accesses are socket
//!   round trips ([`Link::messages`] counts them).
//! * BAR2 (region 2) is mapped from the memfd the device sent with the
//!   region info; that mapping is BAR2's KVM memslot, so the guest's slot
//!   updates never cross the socket.
//! * Guest RAM (a memfd) is handed over once with DMA_MAP.
//! * A local **mirror** [`PvschedDevice`] with the VM's policy sink follows
//!   the remote device: it sees every configuration write (BAR decoding for
//!   the memslot), and after each BAR0 write that can attach or detach the
//!   region (STATUS; SHM_* while attached) the device's register state is
//!   re-read and, if it changed, restored into the mirror (`PvschedDevice::restore`, which re-validates the region
//!   against the VMM's own mappings without rewriting the header). So the
//!   mirror's [`PvschedDevice::region_view`] points into this process (RAM
//!   or the BAR2 mapping), and the policy sink gets `region_attached` /
//!   `region_detached` as with an in-process device. KICK is forwarded to
//!   the device and given to the mirror, which calls the sink's `kick`
//!   (the device process has no policy).
//!
//! Fault isolation: when the device process dies (socket error on an
//! access, or the watcher reaping it) or hangs (an access times out after
//! [`crate::device_process::REPLY_TIMEOUT`]; the VMM then kills it), the
//! remote is marked lost, the mirror goes DEVICE_NEEDS_RESET (STATUS gains
//! 0x40 and loses DRIVER_OK, ERROR = `ERR_DEVICE_FAILED`, region detached:
//! the sink hears
//! `region_detached`) and from then on answers the guest: BAR0 reads come
//! from the mirror, BAR0 writes are dropped (so the device stays
//! DEVICE_NEEDS_RESET, even across a reset), configuration space is served
//! from the mirror's copy (last values the device had, and it keeps
//! following writes so BAR sizing and memslot moves still work). No new
//! device process is attached.

use crate::device_process::{DeviceProcess, ExitInfo};
use pvsched_abi as abi;
use pvsched_device::{
    BarIndex, BarInfo, ConfigWriteResult, PciDevice, PvschedDevice, registers::RegisterState,
};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vm_memory::{FileOffset, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, MmapRegion};

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
    /// The mirror refused its configuration.
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
    /// What the VMM noticed first: `"socket"` (an access failed) or
    /// `"process"` (the watcher reaped it).
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
    /// counted).
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
/// mark the link lost, put the mirror in DEVICE_NEEDS_RESET (the sink hears
/// `region_detached`), record and log the loss, tell the embedder.
pub(crate) fn on_exit(
    link: &Arc<Link>,
    mirror: &Arc<Mutex<PvschedDevice>>,
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
    lock(mirror).set_needs_reset();
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

/// The device behind a vfio-user socket, with its local mirror.
pub struct RemoteDevice {
    client: Mutex<Option<vfio_user::Client>>,
    mirror: Arc<Mutex<PvschedDevice>>,
    link: Arc<Link>,
    process: Arc<DeviceProcess>,
    bar2: Option<Arc<MmapRegion>>,
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

    /// Wrap a connected `client`: check that the device is the one the
    /// mirror models, map BAR2, DMA-map `ram`. `mirror` gets `ram` and the
    /// BAR2 mapping.
    pub fn new(
        client: vfio_user::Client,
        process: Arc<DeviceProcess>,
        link: Arc<Link>,
        mirror: Arc<Mutex<PvschedDevice>>,
        ram: &GuestMemoryMmap,
    ) -> Result<Self> {
        let mut me = Self {
            client: Mutex::new(Some(client)),
            mirror,
            link,
            process,
            bar2: None,
            dropped_writes: 0,
        };
        me.check_identity()?;
        let (features, nr) = {
            let m = lock(&me.mirror);
            (m.config().features, m.config().nr_vcpus)
        };
        if features & abi::F_DEVICE_REGION != 0 {
            let want = PvschedDevice::region_bar_size(nr);
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
            lock(&me.mirror).set_device_region(map.clone())?;
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
        lock(&me.mirror).set_guest_memory(ram.clone());
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
        let (want_nr, want_features, want_id) = {
            let m = lock(&self.mirror);
            (
                m.config().nr_vcpus,
                m.config().features,
                m.read_config_register(0),
            )
        };
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

    /// The mirror device.
    pub fn mirror(&self) -> &Arc<Mutex<PvschedDevice>> {
        &self.mirror
    }

    /// The device process.
    pub fn process(&self) -> &Arc<DeviceProcess> {
        &self.process
    }

    /// One request on the socket; on failure the device is lost (killed,
    /// mirror DEVICE_NEEDS_RESET) and `false` is returned.
    fn access(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut vfio_user::Client) -> std::result::Result<(), vfio_user::Error>,
    ) -> bool {
        if self.link.is_lost() {
            return false;
        }
        self.messages_inc();
        match self.with_client(what, f) {
            Ok(()) => true,
            Err(e) => {
                self.lose(&e);
                false
            }
        }
    }

    fn lose(&self, e: &Error) {
        if self.link.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        self.link.socket_failed.store(true, Ordering::Release);
        log::debug!(
            "device process {}: {e}; killing it, the watcher reports how it ended",
            self.link.pid
        );
        if let Some(c) = lock(&self.client).take() {
            let _ = c.shutdown();
        }
        lock(&self.mirror).set_needs_reset();
        self.process.kill();
    }

    /// Re-read the device's register state; restore it into the mirror if
    /// it changed (attach/detach follow, with the sink told).
    fn sync(&self) {
        let r4 = |off: u32| -> Option<u32> {
            let mut b = [0u8; 4];
            self.access("BAR0 read", |c| c.region_read(0, u64::from(off), &mut b))
                .then(|| u32::from_le_bytes(b))
        };
        let (Some(status), Some(error), Some(shm_size), Some(generation), Some(driver_version)) = (
            r4(abi::REG_STATUS),
            r4(abi::REG_ERROR),
            r4(abi::REG_SHM_SIZE),
            r4(abi::REG_GENERATION),
            r4(abi::REG_DRIVER_VERSION),
        ) else {
            return;
        };
        let r8 = |off: u32| -> Option<u64> {
            let mut b = [0u8; 8];
            self.access("BAR0 read", |c| c.region_read(0, u64::from(off), &mut b))
                .then(|| u64::from_le_bytes(b))
        };
        let (Some(drv_features), Some(shm_gpa)) =
            (r8(abi::REG_DRV_FEATURES_LO), r8(abi::REG_SHM_GPA_LO))
        else {
            return;
        };
        let remote = RegisterState {
            drv_features,
            status,
            error,
            shm_gpa,
            shm_size,
            generation,
            driver_version,
        };
        let mut m = lock(&self.mirror);
        let mut snap = m.snapshot();
        if snap.registers == remote {
            return;
        }
        snap.registers = remote;
        if let Err(e) = m.restore(snap) {
            log::warn!(
                "pvsched: the VMM's view of the device's region is invalid ({e}); the host policy sees no region"
            );
        }
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
        lock(&self.mirror).read_config_register(reg_idx)
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
        lock(&self.mirror).write_config_register(reg_idx, offset, data)
    }

    fn bars(&self) -> Vec<BarInfo> {
        lock(&self.mirror).bars()
    }

    fn read_bar(&mut self, bar: BarIndex, offset: u64, data: &mut [u8]) {
        if bar.0 == abi::REG_BAR
            && self.access("BAR0 read", |c| {
                c.region_read(u32::from(abi::REG_BAR), offset, data)
            })
        {
            return;
        }
        // Lost device (BAR0: DEVICE_NEEDS_RESET), or BAR2 through the
        // VMM's own mapping of it, or a BAR that does not exist.
        lock(&self.mirror).read_bar(bar, offset, data);
    }

    fn write_bar(&mut self, bar: BarIndex, offset: u64, data: &[u8]) {
        if bar.0 != abi::REG_BAR {
            lock(&self.mirror).write_bar(bar, offset, data);
            return;
        }
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
            return;
        }
        match u32::try_from(offset) {
            Ok(abi::REG_KICK) if data.len() == 4 => {
                // The mirror calls the sink's kick if DRIVER_OK and in range.
                lock(&self.mirror).write_bar(bar, offset, data);
            }
            // Only a STATUS write attaches, refuses or resets; an SHM write
            // detaches only while attached (ERR_REGION_CHANGED).
            Ok(abi::REG_STATUS) => self.sync(),
            Ok(abi::REG_SHM_GPA_LO | abi::REG_SHM_GPA_HI | abi::REG_SHM_SIZE)
                if lock(&self.mirror).region_view().is_some() =>
            {
                self.sync()
            }
            _ => {}
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

    /// STATUS and ERROR: from the device while it lives, else the mirror's.
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
        let m = lock(&self.mirror);
        (m.status(), m.error())
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
    use pvsched_device::testing::guest_handshake;
    use pvsched_device::{DeviceConfig, PolicySink};
    use std::time::Instant;
    use vm_memory::GuestAddress;

    #[derive(Default)]
    struct Detaches(AtomicU64);

    impl PolicySink for Detaches {
        fn region_detached(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
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

    fn attached_mirror(sink: Arc<Detaches>) -> Arc<Mutex<PvschedDevice>> {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut dev = PvschedDevice::new(DeviceConfig::new(2), sink).unwrap();
        dev.set_guest_memory(mem);
        guest_handshake(&mut dev, 0x10000, 4096);
        assert!(dev.region_view().is_some());
        Arc::new(Mutex::new(dev))
    }

    #[test]
    fn a_loss_detaches_marks_needs_reset_and_tells_the_embedder_once() {
        let sink = Arc::new(Detaches::default());
        let mirror = attached_mirror(sink.clone());
        let link = RemoteDevice::link(42);
        let calls = Arc::new(AtomicU64::new(0));
        let c2 = calls.clone();
        let hook: OnLoss = Arc::new(move |l: &DeviceLoss| {
            assert_eq!(l.exit.signal, Some(libc::SIGKILL));
            c2.fetch_add(1, Ordering::SeqCst);
        });
        on_exit(&link, &mirror, &|| 7, Some(&hook), exit());
        assert!(link.is_lost());
        let loss = link.loss().expect("recorded");
        assert_eq!((loss.noticed_by, loss.events_at_loss), ("process", 7));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(sink.0.load(Ordering::SeqCst), 1, "region_detached");
        let m = lock(&mirror);
        assert!(m.region_view().is_none());
        assert_ne!(m.status() & abi::STATUS_DEVICE_NEEDS_RESET, 0);
        assert_eq!(m.status() & abi::STATUS_DRIVER_OK, 0);
        assert_eq!(m.error(), abi::ERR_DEVICE_FAILED);
    }

    #[test]
    fn a_stop_the_vmm_asked_for_is_not_a_loss() {
        let sink = Arc::new(Detaches::default());
        let mirror = attached_mirror(sink.clone());
        let link = RemoteDevice::link(42);
        link.stopping.store(true, Ordering::SeqCst);
        on_exit(&link, &mirror, &|| 0, None, exit());
        assert!(!link.is_lost());
        assert!(link.loss().is_none());
        assert_eq!(sink.0.load(Ordering::SeqCst), 0);
        assert!(lock(&mirror).region_view().is_some());
    }
}
