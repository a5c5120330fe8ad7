//! vfio-user server transport: the device served to a vfio-user client (a
//! VMM) over a UNIX socket with the rust-vmm `vfio_user` crate (0.1.7).
//!
//! Regions offered, at the VFIO PCI indices:
//! - BAR0 (index 0): the register file, every access a socket round trip.
//! - BAR2 (index 2, only when the device offers `F_DEVICE_REGION`): the
//!   device region, backed by a memfd of exactly
//!   [`PvschedDevice::region_bar_size`] bytes. It is declared mmapable with
//!   one sparse area covering it and its fd travels with the region info, so
//!   the client maps it and slot updates never cross the socket.
//! - Configuration space (index 7): 256 bytes, split into dword accesses.
//!
//! Guest RAM arrives as DMA_MAP messages with fds and is mapped with
//! `vm-memory`; DMA_UNMAP removes a range; DEVICE_RESET writes STATUS=0.
//!
//! Interrupts: the device has none, but QEMU's `vfio-user-pci` requires the
//! five VFIO PCI IRQ indices (INTx, MSI, MSI-X, ERR, REQ); each is declared
//! with count 0, and the configuration space has no interrupt pin and no
//! MSI capability, so the client never enables one.
//!
//! DMA ranges without an fd (QEMU's ROM and firmware areas) and ranges
//! whose fd the device never maps (not a memfd on shmem, or not sealed
//! against shrinking) are recorded (so their DMA_UNMAP succeeds) but not
//! mapped; see [`crate::guest_ram`]. They are not refused: QEMU takes a
//! failed DMA_MAP as fatal (the device's realize fails, or QEMU aborts at
//! runtime), and device-region mode needs no guest RAM.
//!
//! The server loop is the rust-vmm `vfio_user` crate, patched in-tree
//! (`third_party/vfio_user`, see its `PATCHES.md`): every message is read
//! whole before it is parsed, so unknown or malformed commands get an error
//! reply with an errno and the stream stays in sync; no client-chosen
//! length is allocated beyond [`MAX_ACCESS`] (advertised as
//! `max_data_xfer_size`); VERSION is parsed without panicking; a client
//! that stops halfway through a message is dropped after
//! [`crate::MESSAGE_DEADLINE`].
//! [`VfioUserServer::serve`] still runs the crate under `catch_unwind`, as
//! a second line of defence. Remaining shortcomings of the crate's
//! `Client` (used by the reference VMM and the tests, never facing a
//! hostile peer): it reads a full-size reply after an error reply, and it
//! computes `resettable` inverted.
//!
//! `Server::new` binds the path and removes it on drop with a path
//! lookup; [`VfioUserServer`] binds the listener itself and hands it to
//! `Server::from_owned_fd`, so the device can wait for the pending
//! connection, unlink the path and enter the sandbox before the crate
//! accepts (see [`crate::sandbox`]).

use crate::backend::TransportDevice;
use crate::events::EventChannel;
use crate::guest_ram::GuestRamRefusal;
use crate::monitor::TransportMonitor;
use crate::slot_dump::SlotDumper;
use pvsched_abi as abi;
use pvsched_device::{BarIndex, PvschedDevice};
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_NUM_IRQS,
    VFIO_PCI_NUM_REGIONS, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE, vfio_region_info, vfio_region_sparse_mmap_area,
};
use vfio_user::{
    DmaMapFlags, DmaUnmapFlags, IrqInfo, Server, ServerBackend, ServerRegion, SparseArea,
};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, MmapRegion};

/// Size of PCI configuration space served.
pub const CONFIG_SIZE: u64 = 256;
/// Largest single region access served; larger ones are refused.
pub const MAX_ACCESS: usize = 4096;
/// Largest number of DMA ranges kept at once.
pub const MAX_DMA_RANGES: usize = 64;

/// Errors of the vfio-user transport.
#[derive(Debug, Error)]
pub enum VfioUserError {
    /// The device-region memfd could not be created or sized.
    #[error("cannot create the BAR2 backing memfd of {size} bytes: {source}; check memory limits")]
    Memfd {
        /// Requested size.
        size: u64,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
    /// The memfd could not be mapped.
    #[error("cannot map the BAR2 backing: {0}; check memory limits")]
    Mmap(#[source] vm_memory::mmap::MmapRegionError),
    /// The device refused the BAR2 backing.
    #[error("device refused the BAR2 backing: {0}")]
    Device(#[source] pvsched_device::Error),
    /// A BAR2 backing was given but the device does not offer the device
    /// region.
    #[error(
        "a BAR2 backing fd was given but the device region (F_DEVICE_REGION) is not offered; drop --bar2-fd/--daemon-region or offer the feature"
    )]
    BackingUnused,
    /// The given BAR2 backing is a file that cannot back BAR2 for good.
    #[error("the given BAR2 backing cannot be used: {0}")]
    Backing(#[source] GuestRamRefusal),
    /// The socket path exists already.
    #[error("socket path {0} exists; remove it or choose another path")]
    SocketExists(PathBuf),
    /// Binding the socket failed.
    #[error("cannot bind the vfio-user socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
    /// Waiting for the client's connection failed.
    #[error("waiting for a vfio-user client on {path} failed: {source}")]
    Wait {
        /// The path.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: io::Error,
    },
    /// The socket could not be created or served.
    #[error("vfio-user server failed: {0}; check the socket path and the client")]
    Server(#[source] vfio_user::Error),
    /// The `vfio_user` crate panicked on client input (contained).
    #[error("the vfio_user crate panicked on client input ({0}); the connection is dropped")]
    ServerPanicked(String),
}

/// Counters other threads (tests, the monitor) may read while serving.
#[derive(Debug, Default)]
pub struct VfioUserStats {
    /// Messages that reached the device (region read/write, DMA map/unmap,
    /// reset, set IRQs). VERSION and info queries are answered by the crate
    /// from static data and are not counted.
    pub messages: AtomicU64,
    /// Accesses outside a region or of a refused size (answered, not applied).
    pub stray: AtomicU64,
    /// DMA_MAP requests refused.
    pub dma_refused: AtomicU64,
    /// DMA ranges accepted but not mapped (no fd, or an fd the device
    /// never maps: see [`crate::guest_ram`]).
    pub dma_unmapped: AtomicU64,
}

impl VfioUserStats {
    /// Messages served so far.
    pub fn messages(&self) -> u64 {
        self.messages.load(Ordering::SeqCst)
    }
}

struct DmaRange {
    size: u64,
    /// Shared with the mapping built from it: one fd per range. `None`: the
    /// range is recorded but not mapped (see [`crate::guest_ram`]).
    file: Option<Arc<File>>,
    offset: u64,
}

/// Makes the socket at `path` `owner`'s alone (uid, gid; mode 0600).
fn give_to(path: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

/// A [`TransportDevice`] as a `vfio_user::ServerBackend`.
pub struct VfioUserDevice<D: TransportDevice> {
    dev: D,
    bar0_size: u64,
    bar2: Option<(Arc<File>, u64)>,
    dma: BTreeMap<u64, DmaRange>,
    stats: Arc<VfioUserStats>,
    monitor: Arc<TransportMonitor>,
    dumper: Option<SlotDumper>,
    events: Option<EventChannel>,
}

fn einval(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_owned())
}

/// If `dev` offers the device region, create its BAR2 backing (a memfd of
/// exactly [`PvschedDevice::region_bar_size`] bytes), hand a mapping of it to
/// the device and return the memfd with its size, for
/// [`VfioUserDevice::with_backing`]. The mapping shares the returned file
/// (one fd for BAR2 in the process).
pub fn attach_bar2_backing(
    dev: &mut PvschedDevice,
) -> Result<Option<(Arc<File>, u64)>, VfioUserError> {
    attach_given_bar2_backing(dev, None)
}

/// [`attach_bar2_backing`] with the backing given: `given` (if any) backs
/// BAR2 instead of a new memfd, e.g. pvschedd's region map for this VM (a
/// mmapable BPF array: the policy then reads the guest's slots where the
/// guest writes them). A regular file must pass [`crate::guest_ram::check`]
/// (a memfd on shmem, sealed against shrinking) for the whole BAR; anything
/// else must accept a shared
/// mapping of the BAR's size (a BPF array map refuses one larger than its
/// data). Called before the sandbox is entered.
pub fn attach_given_bar2_backing(
    dev: &mut PvschedDevice,
    given: Option<File>,
) -> Result<Option<(Arc<File>, u64)>, VfioUserError> {
    if dev.config().features & abi::F_DEVICE_REGION == 0 {
        return match given {
            Some(_) => Err(VfioUserError::BackingUnused),
            None => Ok(None),
        };
    }
    let size = PvschedDevice::region_bar_size(dev.config().nr_vcpus);
    let file = match given {
        Some(f) => {
            if f.metadata().is_ok_and(|m| m.file_type().is_file()) {
                crate::guest_ram::check(&f, 0, size).map_err(VfioUserError::Backing)?;
            }
            Arc::new(f)
        }
        None => Arc::new(memfd(size).map_err(|source| VfioUserError::Memfd { size, source })?),
    };
    // `size` is at most a few hundred KiB (bounded by MAX_VCPUS).
    let region = MmapRegion::from_file(FileOffset::from_arc(file.clone(), 0), size as usize)
        .map_err(VfioUserError::Mmap)?;
    dev.set_device_region(Arc::new(region))
        .map_err(VfioUserError::Device)?;
    Ok(Some((file, size)))
}

impl VfioUserDevice<PvschedDevice> {
    /// Wrap `dev`, creating its BAR2 backing ([`attach_bar2_backing`]).
    pub fn new(
        mut dev: PvschedDevice,
        monitor: Arc<TransportMonitor>,
    ) -> Result<Self, VfioUserError> {
        let bar2 = attach_bar2_backing(&mut dev)?;
        Ok(Self::with_backing(dev, bar2, monitor))
    }
}

/// Destination of a region access (see `VfioUserDevice::target`).
enum Target {
    /// PCI configuration space.
    Config,
    /// The register BAR.
    Bar0,
    /// The device region (1, 2, 4 or 8 bytes), through the device's
    /// mapping of it.
    Bar2,
    /// Outside every region: logged, counted, not applied.
    Stray,
}

impl<D: TransportDevice> VfioUserDevice<D> {
    /// Wrap `dev` whose BAR2 (if any) is already backed by `bar2` = (memfd,
    /// size).
    pub fn with_backing(
        dev: D,
        bar2: Option<(Arc<File>, u64)>,
        monitor: Arc<TransportMonitor>,
    ) -> Self {
        let bar0_size = dev
            .bars()
            .iter()
            .find(|b| b.index == BarIndex(abi::REG_BAR))
            .map_or(0, |b| b.size);
        Self {
            dev,
            bar0_size,
            bar2,
            dma: BTreeMap::new(),
            stats: Arc::new(VfioUserStats::default()),
            monitor,
            dumper: None,
            events: None,
        }
    }

    /// Report what the device's sink hears to the VMM over `events` (the
    /// device must have been built with that channel's
    /// [`crate::events::EventSink`]). Each access's events are sent before
    /// its reply.
    pub fn set_event_channel(&mut self, events: EventChannel) {
        self.events = Some(events);
    }

    /// Sample the region into `dumper` after every message, every sample
    /// period while the client is silent (the server's idle hook) and at
    /// disconnect.
    pub fn set_dumper(&mut self, dumper: SlotDumper) {
        self.dumper = Some(dumper);
    }

    /// The fds this backend holds now: the BAR2 memfd and the dump file
    /// (DMA fds arrive later), for the sandbox's keep list.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut v: Vec<RawFd> = self.bar2.iter().map(|(f, _)| f.as_raw_fd()).collect();
        v.extend(self.dumper.as_ref().map(SlotDumper::fd));
        v.extend(self.events.as_ref().map(EventChannel::fd));
        v.extend(
            self.dma
                .values()
                .filter_map(|r| r.file.as_ref())
                .map(|f| f.as_raw_fd()),
        );
        v
    }

    /// The wrapped device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// Shared counters.
    pub fn stats(&self) -> Arc<VfioUserStats> {
        self.stats.clone()
    }

    /// The regions to declare to the `vfio_user::Server`, indexed by VFIO
    /// PCI region index. The BAR2 entry carries the memfd's raw fd, valid
    /// as long as `self` lives.
    pub fn server_regions(&self) -> Vec<ServerRegion> {
        let rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
        (0..VFIO_PCI_NUM_REGIONS)
            .map(|index| {
                let mut info = vfio_region_info {
                    argsz: size_of::<vfio_region_info>() as u32,
                    index,
                    ..Default::default()
                };
                let mut sparse_areas = Vec::new();
                let mut mmap_fd = None;
                if index == VFIO_PCI_BAR0_REGION_INDEX {
                    info.flags = rw;
                    info.size = self.bar0_size;
                } else if index == VFIO_PCI_CONFIG_REGION_INDEX {
                    info.flags = rw;
                    info.size = CONFIG_SIZE;
                } else if index == u32::from(abi::REGION_BAR)
                    && let Some((file, size)) = &self.bar2
                {
                    info.flags = rw | VFIO_REGION_INFO_FLAG_MMAP;
                    info.size = *size;
                    info.offset = 0;
                    sparse_areas.push(SparseArea {
                        area: vfio_region_sparse_mmap_area {
                            offset: 0,
                            size: *size,
                        },
                    });
                    mmap_fd = Some(file.as_raw_fd());
                }
                ServerRegion {
                    region_info: info,
                    sparse_areas,
                    mmap_fd,
                }
            })
            .collect()
    }

    /// Called once per message, before the crate sends its reply: events
    /// first (so the VMM has them once it has the reply), then counters.
    fn served(&mut self, name: &str) {
        if let Some(ch) = self.events.as_mut() {
            let dev = &self.dev;
            if let Err(e) = ch.flush(|| dev.registers()) {
                // The VMM's side would no longer match the device: stop,
                // and the VMM treats the device as lost.
                log::error!(
                    "vfio-user: cannot send events to the VMM ({e}); exiting so that the VMM sees the device lost"
                );
                std::process::exit(1);
            }
        }
        self.stats.messages.fetch_add(1, Ordering::SeqCst);
        self.monitor.after_message(name, &self.dev);
        if let Some(d) = self.dumper.as_mut() {
            d.tick(&self.monitor);
        }
    }

    fn stray(&self, what: &str, region: u32, offset: u64, len: usize) {
        self.stats.stray.fetch_add(1, Ordering::SeqCst);
        self.monitor.stray_bar_access();
        log::warn!(
            "vfio-user: {what} of region {region} at {offset:#x} len {len} outside the region; not applied"
        );
    }

    /// Whether `offset..offset+len` lies inside `size` bytes.
    /// Where an access of `len` bytes at `offset` in `region` goes; one
    /// classification for reads and writes.
    fn target(&self, region: u32, offset: u64, len: usize) -> Target {
        match region {
            VFIO_PCI_CONFIG_REGION_INDEX if Self::inside(offset, len, CONFIG_SIZE) => {
                Target::Config
            }
            VFIO_PCI_BAR0_REGION_INDEX
                if Self::inside(offset, len, self.bar0_size) && matches!(len, 1 | 2 | 4 | 8) =>
            {
                Target::Bar0
            }
            r if r == u32::from(abi::REGION_BAR) => match &self.bar2 {
                Some((_, size))
                    if Self::inside(offset, len, *size) && matches!(len, 1 | 2 | 4 | 8) =>
                {
                    Target::Bar2
                }
                _ => Target::Stray,
            },
            _ => Target::Stray,
        }
    }

    fn inside(offset: u64, len: usize, size: u64) -> bool {
        offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= size)
    }

    fn config_read(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset + i as u64;
            let dword = self.dev.read_config_register((at / 4) as usize);
            *b = dword.to_le_bytes()[(at % 4) as usize];
        }
    }

    fn config_write(&mut self, offset: u64, data: &[u8]) {
        let mut pos = 0usize;
        while pos < data.len() {
            let at = offset + pos as u64;
            let left = data.len() - pos;
            let chunk = [4usize, 2, 1]
                .into_iter()
                .find(|&n| n <= left && at.is_multiple_of(n as u64))
                .unwrap_or(1);
            self.dev
                .write_config_register((at / 4) as usize, at % 4, &data[pos..pos + chunk]);
            pos += chunk;
        }
    }

    /// Map every DMA range and hand the result to the device. On failure
    /// nothing changes and the error is returned.
    fn rebuild_guest_memory(&mut self) -> Result<(), String> {
        let mut ranges = Vec::with_capacity(self.dma.len());
        for (&iova, r) in &self.dma {
            if let Some(file) = &r.file {
                ranges.push((
                    GuestAddress(iova),
                    r.size as usize,
                    Some(FileOffset::from_arc(file.clone(), r.offset)),
                ));
            }
        }
        let mem = if ranges.is_empty() {
            GuestMemoryMmap::new()
        } else {
            GuestMemoryMmap::from_ranges_with_files(ranges)
                .map_err(|e| format!("cannot map guest RAM: {e}"))?
        };
        self.dev.set_guest_memory(mem);
        Ok(())
    }

    /// Whether a DMA range at `address` of `size` bytes may be recorded
    /// (whether it is also mapped is [`crate::guest_ram::check`]'s call).
    fn check_dma(&self, address: u64, size: u64) -> Result<(), &'static str> {
        if size == 0 || usize::try_from(size).is_err() {
            return Err("DMA_MAP size 0 or too large");
        }
        let end = address
            .checked_add(size)
            .ok_or("DMA_MAP range wraps the address space")?;
        if self.dma.len() >= MAX_DMA_RANGES {
            return Err("too many DMA ranges");
        }
        let overlaps = self
            .dma
            .range(..end)
            .next_back()
            .is_some_and(|(&a, r)| a + r.size > address);
        if overlaps {
            return Err("DMA_MAP overlaps a mapped range");
        }
        Ok(())
    }
}

/// The BAR2 backing: a memfd of `size` bytes sealed against any change of
/// size. Its fd goes to the client with the region info; without the seals
/// the client could shrink it under the device's mapping (SIGBUS).
fn memfd(size: u64) -> io::Result<File> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    use nix::sys::memfd::{MemFdCreateFlag, memfd_create};
    let fd = memfd_create(
        c"pvsched-bar2",
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .map_err(io::Error::from)?;
    let file = File::from(fd);
    file.set_len(size)?;
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(file.as_raw_fd(), FcntlArg::F_ADD_SEALS(seals)).map_err(io::Error::from)?;
    Ok(file)
}

impl<D: TransportDevice> ServerBackend for VfioUserDevice<D> {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        if data.len() > MAX_ACCESS {
            self.stray("oversized read", region, offset, data.len());
            self.served("region_read");
            return Err(einval("region read larger than MAX_ACCESS"));
        }
        data.fill(0xff);
        match self.target(region, offset, data.len()) {
            Target::Config => self.config_read(offset, data),
            Target::Bar0 => self.dev.read_bar(BarIndex(abi::REG_BAR), offset, data),
            Target::Bar2 => self.dev.read_bar(BarIndex(abi::REGION_BAR), offset, data),
            Target::Stray => self.stray("read", region, offset, data.len()),
        }
        self.served("region_read");
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        if data.len() > MAX_ACCESS {
            self.stray("oversized write", region, offset, data.len());
            self.served("region_write");
            return Err(einval("region write larger than MAX_ACCESS"));
        }
        match self.target(region, offset, data.len()) {
            Target::Config => self.config_write(offset, data),
            Target::Bar0 => self.dev.write_bar(BarIndex(abi::REG_BAR), offset, data),
            Target::Bar2 => self.dev.write_bar(BarIndex(abi::REGION_BAR), offset, data),
            Target::Stray => self.stray("write", region, offset, data.len()),
        }
        self.served("region_write");
        Ok(())
    }

    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        let res = self.check_dma(address, size).and_then(|()| {
            let file = match fd.map(|file| (crate::guest_ram::check(&file, offset, size), file)) {
                None => None,
                Some((Ok(()), file)) => Some(Arc::new(file)),
                Some((Err(why), _)) if why.never_mapped() => {
                    log::warn!(
                        "vfio-user: DMA range {address:#x}+{size:#x} recorded but not mapped: {why}"
                    );
                    None
                }
                Some((Err(why), _)) => {
                    log::warn!("vfio-user: DMA range {address:#x}+{size:#x}: {why}");
                    return Err("DMA_MAP range does not fit its fd");
                }
            };
            if file.is_none() {
                // QEMU maps its ROM and firmware areas without an fd; the
                // device never needs them.
                self.stats.dma_unmapped.fetch_add(1, Ordering::SeqCst);
                log::debug!("vfio-user: DMA range {address:#x}+{size:#x} not mapped");
            }
            let mapped = file.is_some();
            self.dma.insert(address, DmaRange { size, file, offset });
            if !mapped {
                return Ok(());
            }
            // A range that cannot be mapped (e.g. a read-only fd) is
            // refused and the previous map kept.
            self.rebuild_guest_memory().map_err(|e| {
                self.dma.remove(&address);
                log::warn!("vfio-user: DMA_MAP {address:#x}+{size:#x}: {e}");
                "DMA_MAP range cannot be mapped"
            })
        });
        self.served("dma_map");
        res.map_err(|e| {
            self.stats.dma_refused.fetch_add(1, Ordering::SeqCst);
            log::warn!("vfio-user: {e}: iova {address:#x} size {size:#x} offset {offset:#x}");
            einval(e)
        })
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> io::Result<()> {
        let res = if flags.contains(DmaUnmapFlags::UNMAP_ALL) {
            self.dma.clear();
            Ok(())
        } else {
            match self.dma.get(&address) {
                Some(r) if r.size == size => {
                    self.dma.remove(&address);
                    Ok(())
                }
                _ => Err(einval("DMA_UNMAP of a range that is not mapped")),
            }
        };
        if res.is_ok() {
            if let Err(e) = self.rebuild_guest_memory() {
                // Removing ranges cannot make the rest unmappable unless
                // mmap fails; then guest RAM goes away entirely.
                log::warn!("vfio-user: after DMA_UNMAP: {e}; guest memory now empty");
                self.dev.set_guest_memory(GuestMemoryMmap::new());
            }
        } else {
            log::warn!("vfio-user: DMA_UNMAP {address:#x}+{size:#x} matches no mapping");
        }
        self.served("dma_unmap");
        res
    }

    fn reset(&mut self) -> io::Result<()> {
        self.dev.reset();
        self.served("device_reset");
        Ok(())
    }

    /// With a dumper, wake up to sample the region even when the client is
    /// silent (in device-region mode the guest writes slots through the
    /// mapping and sends no message at all).
    fn idle_timeout(&self) -> Option<std::time::Duration> {
        self.dumper.as_ref().map(|d| {
            d.until_next_sample()
                .max(std::time::Duration::from_millis(1))
        })
    }

    fn idle(&mut self) {
        if let Some(d) = self.dumper.as_mut() {
            d.tick(&self.monitor);
        }
    }

    fn set_irqs(
        &mut self,
        index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        _fds: Vec<File>,
    ) -> io::Result<()> {
        self.served("set_irqs");
        log::warn!("vfio-user: SET_IRQS index {index}: the device has no interrupts");
        Err(einval("the device has no interrupts"))
    }
}

/// The IRQ indices declared to the client: the five of a VFIO PCI device,
/// each with no interrupt behind it (the device has none).
pub fn server_irqs() -> Vec<IrqInfo> {
    (0..VFIO_PCI_NUM_IRQS)
        .map(|index| IrqInfo {
            index,
            flags: 0,
            count: 0,
        })
        .collect()
}

/// Bytes of `sockaddr_un.sun_path` on Linux; the standard library binds
/// and connects only paths shorter than that (room for the NUL).
const SUN_PATH_MAX: usize = 108;

/// A vfio-user server for one device and one client connection.
///
/// The listening socket is bound here (not by the crate), so the device
/// process can wait for the client's connection to be pending, unlink the
/// path ([`VfioUserServer::wait_for_client`]) and enter the sandbox before
/// the crate accepts it: everything the client sends, VERSION included, is
/// then handled sandboxed (the sandbox allows `accept4` on the listener
/// only).
pub struct VfioUserServer<D: TransportDevice> {
    server: Server,
    listener_fd: RawFd,
    path: PathBuf,
    path_removed: bool,
    dev: VfioUserDevice<D>,
}

impl<D: TransportDevice> VfioUserServer<D> {
    /// Bind `path` (which must not exist) and prepare to serve `dev`. The
    /// path appears only once the socket is listening.
    pub fn bind(path: &Path, dev: VfioUserDevice<D>) -> Result<Self, VfioUserError> {
        Self::bind_for(path, dev, None)
    }

    /// [`bind`](Self::bind), with the socket given to `owner` (uid, gid;
    /// mode 0600) before its path appears: a VMM that runs as another
    /// user (libvirt's QEMU) can connect, and no one else ever could.
    pub fn bind_for(
        path: &Path,
        dev: VfioUserDevice<D>,
        owner: Option<(u32, u32)>,
    ) -> Result<Self, VfioUserError> {
        if path.exists() {
            return Err(VfioUserError::SocketExists(path.to_owned()));
        }
        // Bind under a temporary name and rename into place: `path` appears
        // only once the socket listens, so a client that connects as soon as
        // it sees the path is never refused (bind and listen are two calls).
        let bind_err = |source| VfioUserError::Bind {
            path: path.to_owned(),
            source,
        };
        // The temporary name is short (".pvsPID" beside the path), so that
        // any path short enough for a socket address has one that is too,
        // unless its own file name is shorter still: that path is bound
        // directly, and a client that connects between the bind and the
        // listen (microseconds apart) is refused.
        let len = path.as_os_str().len();
        if len >= SUN_PATH_MAX {
            return Err(bind_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the path is {len} bytes; a unix socket path must be shorter than {SUN_PATH_MAX}: choose a shorter one"
                ),
            )));
        }
        let tmp = path.with_file_name(format!(".pvs{}", std::process::id()));
        let listener = if tmp.as_os_str().len() < SUN_PATH_MAX {
            let _ = std::fs::remove_file(&tmp);
            let listener = UnixListener::bind(&tmp).map_err(bind_err)?;
            if let Err(e) = give_to(&tmp, owner).and_then(|()| std::fs::rename(&tmp, path)) {
                let _ = std::fs::remove_file(&tmp);
                return Err(bind_err(e));
            }
            listener
        } else {
            let listener = UnixListener::bind(path).map_err(bind_err)?;
            if let Err(e) = give_to(path, owner) {
                let _ = std::fs::remove_file(path);
                return Err(bind_err(e));
            }
            listener
        };
        let listener_fd = listener.as_raw_fd();
        let regions = dev.server_regions();
        let mut server =
            Server::from_owned_fd(OwnedFd::from(listener), true, server_irqs(), regions);
        server.set_max_data_xfer_size(MAX_ACCESS as u32);
        server.set_max_dma_maps(MAX_DMA_RANGES as u32);
        server.set_message_deadline(Some(crate::MESSAGE_DEADLINE));
        Ok(Self {
            server,
            listener_fd,
            path: path.to_owned(),
            path_removed: false,
            dev,
        })
    }

    /// The listening socket's fd (owned by the server).
    pub fn listener_fd(&self) -> RawFd {
        self.listener_fd
    }

    /// The fds serving needs before the client is accepted: the listener,
    /// the BAR2 memfd and the dump file.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut v = vec![self.listener_fd];
        v.extend(self.dev.fds());
        v
    }

    /// Block until a client's connection is pending on the listener, then
    /// remove the socket path so no other client can connect. The
    /// connection stays queued until [`Self::serve`] accepts it.
    pub fn wait_for_client(&mut self) -> Result<(), VfioUserError> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let wait_err = |e: io::Error| VfioUserError::Wait {
            path: self.path.clone(),
            source: e,
        };
        // SAFETY: `listener_fd` is owned by `self.server`, which lives as
        // long as `self`; the borrow ends before this function returns.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.listener_fd) };
        loop {
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(n) if n > 0 => break,
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(wait_err(e.into())),
            }
        }
        std::fs::remove_file(&self.path).map_err(wait_err)?;
        self.path_removed = true;
        Ok(())
    }

    /// Shared counters.
    pub fn stats(&self) -> Arc<VfioUserStats> {
        self.dev.stats()
    }

    /// The backend (device and DMA state).
    pub fn backend(&self) -> &VfioUserDevice<D> {
        &self.dev
    }

    /// Accept one client and serve it until it disconnects. A panic inside
    /// the `vfio_user` crate on hostile input is contained and reported.
    pub fn serve(&mut self) -> Result<(), VfioUserError> {
        self.serve_with(|server, dev| server.run(dev))
    }

    /// Serve an already connected `stream` (a socketpair end: tests and
    /// fuzzing drive the server without the listening path) until it
    /// closes, exactly as [`Self::serve`] serves an accepted client.
    pub fn serve_connection(&mut self, stream: UnixStream) -> Result<(), VfioUserError> {
        self.serve_with(|server, dev| server.serve_connection(dev, stream))
    }

    fn serve_with(
        &mut self,
        f: impl FnOnce(&Server, &mut VfioUserDevice<D>) -> Result<(), vfio_user::Error>,
    ) -> Result<(), VfioUserError> {
        let server = &self.server;
        let dev = &mut self.dev;
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(server, dev)));
        self.dev.monitor.disconnected();
        if let Some(d) = self.dev.dumper.as_mut() {
            d.finish(&self.dev.monitor);
        }
        match res {
            Ok(r) => r.map_err(VfioUserError::Server),
            Err(p) => {
                let why = p
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                log::error!("vfio-user: crate panicked on client input: {why}");
                Err(VfioUserError::ServerPanicked(why))
            }
        }
    }
}

impl<D: TransportDevice> Drop for VfioUserServer<D> {
    fn drop(&mut self) {
        // Sandboxed servers removed the path before entering (unlink is
        // forbidden afterwards); an unsandboxed one cleans up here.
        if !self.path_removed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_device::{DeviceConfig, NullSink};

    fn dev() -> VfioUserDevice<PvschedDevice> {
        let d = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).expect("device");
        VfioUserDevice::new(d, Arc::new(TransportMonitor::new())).expect("backend")
    }

    #[test]
    fn regions_declare_bar2_mmap_with_fd() {
        let d = dev();
        let r = d.server_regions();
        assert_eq!(r.len(), VFIO_PCI_NUM_REGIONS as usize);
        let bar2 = &r[usize::from(abi::REGION_BAR)];
        assert_ne!(bar2.region_info.flags & VFIO_REGION_INFO_FLAG_MMAP, 0);
        assert_eq!(bar2.region_info.size, PvschedDevice::region_bar_size(2));
        assert!(bar2.mmap_fd.is_some());
        assert_eq!(
            r[VFIO_PCI_CONFIG_REGION_INDEX as usize].region_info.size,
            256
        );
        assert_eq!(r[1].region_info.size, 0);
    }

    #[test]
    fn hostile_accesses_do_not_panic() {
        let mut d = dev();
        let mut big = vec![0u8; MAX_ACCESS + 1];
        assert!(d.region_read(0, 0, &mut big).is_err());
        let mut b = [0u8; 8];
        for (region, offset) in [(0, u64::MAX), (7, 255), (2, u64::MAX - 2), (5, 0), (99, 0)] {
            d.region_read(region, offset, &mut b).expect("answered");
            assert_eq!(b, [0xff; 8]);
            d.region_write(region, offset, &b).expect("answered");
        }
        let mut three = [0u8; 3];
        d.region_read(0, 0, &mut three).expect("answered");
        assert_eq!(three, [0xff; 3]);
        assert!(
            d.dma_map(DmaMapFlags::READ_WRITE, 0, u64::MAX, 4096, None)
                .is_err()
        );
        assert!(d.dma_unmap(DmaUnmapFlags::empty(), 0, 4096).is_err());
    }
}
