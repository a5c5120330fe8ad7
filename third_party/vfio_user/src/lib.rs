// Copyright © 2021 Intel Corporation
//
// SPDX-License-Identifier: Apache-2.0
//

use bitflags::bitflags;
use libc::{c_void, iovec};
use libc::{sysconf, _SC_PAGESIZE};
use std::ffi::CString;
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::mem::size_of;
use std::num::Wrapping;
use std::os::fd::OwnedFd;
use std::os::unix::{
    io::{FromRawFd, RawFd},
    net::{UnixListener, UnixStream},
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;
use vfio_bindings::bindings::vfio::*;
use vm_memory::{ByteValued, FileOffset};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

#[macro_use]
extern crate serde_derive;

#[macro_use]
extern crate log;

#[allow(dead_code)]
#[repr(u16)]
#[derive(Clone, Copy, Debug, Default, enumn::N)]
pub enum Command {
    #[default]
    Unknown = 0,
    Version = 1,
    DmaMap = 2,
    DmaUnmap = 3,
    DeviceGetInfo = 4,
    DeviceGetRegionInfo = 5,
    GetRegionIoFds = 6,
    GetIrqInfo = 7,
    SetIrqs = 8,
    RegionRead = 9,
    RegionWrite = 10,
    DmaRead = 11,
    DmaWrite = 12,
    DeviceReset = 13,
    UserDirtyPages = 14,
}

#[allow(dead_code)]
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum HeaderFlags {
    #[default]
    Command = 0,
    Reply = 1,
    NoReply = 1 << 4,
    Error = 1 << 5,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct Header {
    message_id: u16,
    command: u16,
    message_size: u32,
    flags: u32,
    error: u32,
}

impl Header {
    fn no_reply(&self) -> bool {
        self.flags & HeaderFlags::NoReply as u32 != 0
    }
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct Version {
    header: Header,
    major: u16,
    minor: u16,
}

#[derive(Serialize, Deserialize, Debug)]
struct MigrationCapabilities {
    pgsize: u32,
}

const fn default_max_msg_fds() -> u32 {
    1
}

const fn default_max_data_xfer_size() -> u32 {
    1048576
}

#[inline(always)]
fn pagesize() -> u32 {
    // SAFETY: sysconf
    unsafe { sysconf(_SC_PAGESIZE) as u32 }
}

fn default_migration_capabilities() -> MigrationCapabilities {
    MigrationCapabilities { pgsize: pagesize() }
}

bitflags! {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct DmaMapFlags: u32 {
        const READ = 1 << 0;
        const WRITE = 1 << 1;
        const READ_WRITE = Self::READ.bits() | Self::WRITE.bits();

        // There might be unknown bits and we don't want bitflags to clear them.
        const _ = !0;
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct DmaUnmapFlags: u32 {
        const GET_DIRTY_PAGE_INFO = 1 << 1;
        const UNMAP_ALL = 1 << 2;

        // See above.
        const _ = !0;
    }
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct DmaMap {
    header: Header,
    argsz: u32,
    flags: u32,
    offset: u64,
    address: u64,
    size: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct DmaUnmap {
    header: Header,
    argsz: u32,
    flags: u32,
    address: u64,
    size: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct DeviceGetInfo {
    header: Header,
    argsz: u32,
    flags: u32,
    num_regions: u32,
    num_irqs: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct DeviceGetRegionInfo {
    header: Header,
    region_info: vfio_region_info,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct RegionAccess {
    header: Header,
    offset: u64,
    region: u32,
    count: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct GetIrqInfo {
    header: Header,
    argsz: u32,
    flags: u32,
    index: u32,
    count: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct SetIrqs {
    header: Header,
    argsz: u32,
    flags: u32,
    index: u32,
    start: u32,
    count: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct DeviceReset {
    header: Header,
}

// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for Header {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for Version {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for DmaMap {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for DmaUnmap {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for DeviceGetInfo {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for DeviceGetRegionInfo {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for RegionAccess {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for GetIrqInfo {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for SetIrqs {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for DeviceReset {}

#[derive(Serialize, Deserialize, Debug)]
struct Capabilities {
    #[serde(default = "default_max_msg_fds")]
    max_msg_fds: u32,
    #[serde(default = "default_max_data_xfer_size")]
    max_data_xfer_size: u32,
    #[serde(default = "default_migration_capabilities")]
    migration: MigrationCapabilities,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_dma_maps: Option<u32>,
}

#[derive(Serialize, Deserialize, Debug, Default)]
struct CapabilitiesData {
    #[serde(default)]
    capabilities: Capabilities,
}

impl Default for Capabilities {
    fn default() -> Self {
        Self {
            max_msg_fds: default_max_msg_fds(),
            max_data_xfer_size: default_max_data_xfer_size(),
            migration: default_migration_capabilities(),
            max_dma_maps: None,
        }
    }
}

pub struct Client {
    stream: UnixStream,
    next_message_id: Wrapping<u16>,
    num_irqs: u32,
    resettable: bool,
    regions: Vec<Region>,
}

#[derive(Debug)]
pub struct Region {
    pub flags: u32,
    pub index: u32,
    pub size: u64,
    pub file_offset: Option<FileOffset>,
    pub sparse_areas: Vec<vfio_region_sparse_mmap_area>,
}

#[derive(Clone, Copy, Debug)]
pub struct IrqInfo {
    pub index: u32,
    pub flags: u32,
    pub count: u32,
}

#[derive(Error, Debug)]
pub enum Error {
    #[error("Error connecting: {0}")]
    Connect(#[source] std::io::Error),
    #[error("Error serializing capabilities: {0}")]
    SerializeCapabilites(#[source] serde_json::Error),
    #[error("Error deserializing capabilities: {0}")]
    DeserializeCapabilites(#[source] serde_json::Error),
    #[error("Error writing to stream: {0}")]
    StreamWrite(#[source] std::io::Error),
    #[error("Error reading from stream: {0}")]
    StreamRead(#[source] std::io::Error),
    #[error("Error shutting down stream: {0}")]
    StreamShutdown(#[source] std::io::Error),
    #[error("Error writing with file descriptors: {0}")]
    SendWithFd(#[source] vmm_sys_util::errno::Error),
    #[error("Error reading with file descriptors: {0}")]
    ReceiveWithFd(#[source] vmm_sys_util::errno::Error),
    #[error("Not a PCI device")]
    NotPciDevice,
    #[error("Socket path already exists")]
    SocketPathExists,
    #[error("Error binding to socket: {0}")]
    SocketBind(#[source] std::io::Error),
    #[error("Error accepting connection: {0}")]
    SocketAccept(#[source] std::io::Error),
    #[error("Unknown command: {0}")]
    UnknownCommand(u16),
    #[error("Unsupported command: {0:?}")]
    UnsupportedCommand(Command),
    #[error("Unsupported feature")]
    UnsupportedFeature,
    #[error("Error from backend: {0:?}")]
    Backend(#[source] std::io::Error),
    #[error("Invalid input")]
    InvalidInput,
    #[error("No_reply bit unexpectedly set for command: {0:?}")]
    UnexpectedNoReply(Command),
    #[error("Message of command {command} is {size} bytes, shorter than the command's fixed part")]
    ShortMessage { command: u16, size: u32 },
    #[error("Message size {0} is smaller than a header")]
    MessageSize(u32),
    #[error("Message size {0} exceeds the largest message this server reads")]
    MessageTooLarge(u32),
    #[error("Transfer count {0} exceeds max_data_xfer_size")]
    CountTooLarge(u32),
    #[error("Message with flags {0:#x} is not a command")]
    NotACommand(u32),
    #[error("Unsupported protocol major version {0}")]
    UnsupportedVersion(u16),
    #[error("Message incomplete: {received} of its {expected} bytes arrived within {deadline:?} of its first byte")]
    IncompleteMessage {
        received: usize,
        expected: usize,
        deadline: Duration,
    },
}

impl Error {
    /// The errno an error reply carries for this error.
    fn errno(&self) -> i32 {
        match self {
            Error::UnknownCommand(_) | Error::UnsupportedCommand(_) => libc::ENOSYS,
            Error::UnsupportedFeature | Error::UnsupportedVersion(_) => libc::ENOTSUP,
            Error::MessageTooLarge(_) | Error::CountTooLarge(_) => libc::E2BIG,
            Error::Backend(e) => e.raw_os_error().unwrap_or(match e.kind() {
                std::io::ErrorKind::InvalidInput => libc::EINVAL,
                std::io::ErrorKind::Unsupported => libc::ENOTSUP,
                std::io::ErrorKind::PermissionDenied => libc::EPERM,
                std::io::ErrorKind::OutOfMemory => libc::ENOMEM,
                _ => libc::EIO,
            }),
            _ => libc::EINVAL,
        }
    }
}

/// The header every capability of a region begins with.
#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct CapabilityHeader {
    id: u16,
    version: u16,
    next: u32,
}

/// Fixed-size header at the start of a sparse mmap capability.
#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct SparseMmapHeader {
    nr_areas: u32,
    reserved: u32,
}

// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for CapabilityHeader {}
// SAFETY: data structure only contain a series of integers
unsafe impl ByteValued for SparseMmapHeader {}

/// Error encountered while walking a region's capability list.
#[derive(Debug, Error)]
enum CapabilityError {
    #[error("offset {0} does not advance")]
    NotAdvancing(usize),
    #[error("offset {offset} is outside the {len} bytes of capability data")]
    Outside { offset: usize, len: usize },
    #[error("capability at offset {offset} is truncated")]
    Truncated {
        offset: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("sparse mmap capability at offset {offset} claims {count} areas, which do not fit")]
    AreaCount {
        offset: usize,
        count: usize,
        #[source]
        source: std::io::Error,
    },
}

impl Client {
    pub fn new(path: &Path) -> Result<Client, Error> {
        let stream = UnixStream::connect(path).map_err(Error::Connect)?;

        let mut client = Client {
            next_message_id: Wrapping(0),
            stream,
            num_irqs: 0,
            resettable: false,
            regions: Vec::new(),
        };

        client.negotiate_version()?;

        client.regions = client.get_regions()?;

        Ok(client)
    }

    fn negotiate_version(&mut self) -> Result<(), Error> {
        let caps = CapabilitiesData::default();

        let version_data = serde_json::to_string(&caps).map_err(Error::SerializeCapabilites)?;

        let version = Version {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::Version as u16,
                flags: HeaderFlags::Command as u32,
                message_size: (size_of::<Version>() + version_data.len() + 1) as u32,
                ..Default::default()
            },
            major: 0,
            minor: 1,
        };
        debug!("Command: {version:?}");

        let version_data = CString::new(version_data.as_bytes()).unwrap();
        let bufs = vec![
            IoSlice::new(version.as_slice()),
            IoSlice::new(version_data.as_bytes_with_nul()),
        ];

        // TODO: Use write_all_vectored() when ready
        let _ = self
            .stream
            .write_vectored(&bufs)
            .map_err(Error::StreamWrite)?;

        debug!(
            "Sent client version information: major = {} minor = {} capabilities = {:?}",
            version.major, version.minor, caps.capabilities
        );

        self.next_message_id += Wrapping(1);

        let mut server_version: Version = Version::default();
        self.stream
            .read_exact(server_version.as_mut_slice())
            .map_err(Error::StreamRead)?;

        debug!("Reply: {server_version:?}");

        let mut server_version_data =
            vec![0; server_version.header.message_size as usize - size_of::<Version>()];
        self.stream
            .read_exact(server_version_data.as_mut_slice())
            .map_err(Error::StreamRead)?;

        let server_caps: CapabilitiesData =
            serde_json::from_slice(&server_version_data[0..server_version_data.len() - 1])
                .map_err(Error::DeserializeCapabilites)?;

        debug!(
            "Received server version information: major = {} minor = {} capabilities = {:?}",
            server_version.major, server_version.minor, server_caps.capabilities
        );

        Ok(())
    }

    pub fn dma_map(
        &mut self,
        offset: u64,
        address: u64,
        size: u64,
        fd: RawFd,
    ) -> Result<(), Error> {
        let dma_map = DmaMap {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::DmaMap as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<DmaMap>() as u32,
                ..Default::default()
            },
            argsz: (size_of::<DmaMap>() - size_of::<Header>()) as u32,
            flags: DmaMapFlags::READ_WRITE.bits(),
            offset,
            address,
            size,
        };
        debug!("Command: {dma_map:?}");
        self.next_message_id += Wrapping(1);
        self.stream
            .send_with_fd(dma_map.as_slice(), fd)
            .map_err(Error::SendWithFd)?;

        let mut reply = Header::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");

        Ok(())
    }

    pub fn dma_unmap(&mut self, address: u64, size: u64) -> Result<(), Error> {
        let dma_unmap = DmaUnmap {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::DmaUnmap as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<DmaUnmap>() as u32,
                ..Default::default()
            },
            argsz: (size_of::<DmaUnmap>() - size_of::<Header>()) as u32,
            flags: 0,
            address,
            size,
        };
        debug!("Command: {dma_unmap:?}");
        self.next_message_id += Wrapping(1);
        self.stream
            .write_all(dma_unmap.as_slice())
            .map_err(Error::StreamWrite)?;

        let mut reply = DmaUnmap::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");

        Ok(())
    }

    pub fn reset(&mut self) -> Result<(), Error> {
        let reset = DeviceReset {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::DeviceReset as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<DeviceReset>() as u32,
                ..Default::default()
            },
        };
        debug!("Command: {reset:?}");
        self.next_message_id += Wrapping(1);
        self.stream
            .write_all(reset.as_slice())
            .map_err(Error::StreamWrite)?;

        let mut reply = Header::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");

        Ok(())
    }

    fn get_regions(&mut self) -> Result<Vec<Region>, Error> {
        let get_info = DeviceGetInfo {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::DeviceGetInfo as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<DeviceGetInfo>() as u32,
                ..Default::default()
            },
            argsz: size_of::<DeviceGetInfo>() as u32,
            ..Default::default()
        };
        debug!("Command: {get_info:?}");
        self.next_message_id += Wrapping(1);

        self.stream
            .write_all(get_info.as_slice())
            .map_err(Error::StreamWrite)?;

        let mut reply = DeviceGetInfo::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");
        self.num_irqs = reply.num_irqs;

        if reply.flags & VFIO_DEVICE_FLAGS_PCI != VFIO_DEVICE_FLAGS_PCI {
            return Err(Error::NotPciDevice);
        }

        self.resettable = reply.flags & VFIO_DEVICE_FLAGS_RESET != VFIO_DEVICE_FLAGS_RESET;

        let num_regions = reply.num_regions;
        let mut regions = Vec::new();
        for index in 0..num_regions {
            let (region_info, fd, sparse_areas) = self.get_region_info(index)?;
            regions.push(Region {
                flags: region_info.flags,
                index: region_info.index,
                size: region_info.size,
                file_offset: fd.map(|fd| FileOffset::new(fd, region_info.offset)),
                sparse_areas,
            });
        }

        Ok(regions)
    }

    fn get_region_info(
        &mut self,
        index: u32,
    ) -> Result<
        (
            vfio_region_info,
            Option<File>,
            Vec<vfio_region_sparse_mmap_area>,
        ),
        Error,
    > {
        // Retrieve the region info without capability
        let mut get_region_info = DeviceGetRegionInfo {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::DeviceGetRegionInfo as u16,
                flags: HeaderFlags::Command as u32,
                message_size: std::mem::size_of::<DeviceGetRegionInfo>() as u32,
                ..Default::default()
            },
            region_info: vfio_region_info {
                argsz: size_of::<vfio_region_info>() as u32,
                index,
                ..Default::default()
            },
        };
        debug!("Command: {get_region_info:?}");
        self.next_message_id += Wrapping(1);

        self.stream
            .write_all(get_region_info.as_slice())
            .map_err(Error::StreamWrite)?;

        let mut reply = DeviceGetRegionInfo::default();
        let (_, fd) = self
            .stream
            .recv_with_fd(reply.as_mut_slice())
            .map_err(Error::ReceiveWithFd)?;
        debug!("Reply: {reply:?}");

        // Retrieve the region info again with capabilities if needed
        if reply.region_info.argsz > std::mem::size_of::<vfio_region_info>() as u32 {
            get_region_info.region_info.argsz = reply.region_info.argsz;
            debug!("Command: {get_region_info:?}");
            self.next_message_id += Wrapping(1);

            self.stream
                .write_all(get_region_info.as_slice())
                .map_err(Error::StreamWrite)?;

            let mut reply = DeviceGetRegionInfo::default();
            let (_, fd) = self
                .stream
                .recv_with_fd(reply.as_mut_slice())
                .map_err(Error::ReceiveWithFd)?;
            debug!("Reply: {reply:?}");

            let cap_size = reply.region_info.argsz - std::mem::size_of::<vfio_region_info>() as u32;
            assert_eq!(
                cap_size,
                reply.header.message_size - size_of::<DeviceGetRegionInfo>() as u32
            );
            let mut cap_data = vec![0; cap_size as usize];
            self.stream
                .read_exact(cap_data.as_mut_slice())
                .map_err(Error::StreamRead)?;

            let sparse_areas = Self::parse_region_caps(&cap_data, &reply.region_info)
                .inspect_err(|error| warn!("Region {index}: {error}"))
                .map_err(|_| Error::InvalidInput)?;

            Ok((reply.region_info, fd, sparse_areas))
        } else {
            Ok((reply.region_info, fd, Vec::new()))
        }
    }

    /// Collects the mmap-able areas of every sparse mmap capability in the
    /// list that follows `vfio_region_info` in a `DEVICE_GET_REGION_INFO`
    /// reply.
    ///
    /// Offsets in the list are relative to the start of the
    /// `vfio_region_info` structure, which `cap_data` does not include.
    fn parse_region_caps(
        cap_data: &[u8],
        region_info: &vfio_region_info,
    ) -> Result<Vec<vfio_region_sparse_mmap_area>, CapabilityError> {
        let mut sparse_areas = Vec::new();
        let mut next = region_info.cap_offset as usize;
        let mut previous = 0;

        while next != 0 {
            let offset = next;
            if next <= previous {
                return Err(CapabilityError::NotAdvancing(offset));
            }
            previous = next;

            let mut capability = next
                .checked_sub(size_of::<vfio_region_info>())
                .and_then(|from| cap_data.get(from..))
                .ok_or(CapabilityError::Outside {
                    offset,
                    len: cap_data.len(),
                })?;

            let header = CapabilityHeader::read_exact_from(&mut capability)
                .map_err(|source| CapabilityError::Truncated { offset, source })?;
            next = header.next as usize;

            if u32::from(header.id) != VFIO_REGION_INFO_CAP_SPARSE_MMAP {
                warn!(
                    "Ignoring unsupported vfio region capability (id = '{}')",
                    header.id
                );
                continue;
            }

            let sparse = SparseMmapHeader::read_exact_from(&mut capability)
                .map_err(|source| CapabilityError::Truncated { offset, source })?;
            let count = sparse.nr_areas as usize;

            for _ in 0..count {
                sparse_areas.push(vfio_region_sparse_mmap_area {
                    offset: u64::read_exact_from(&mut capability).map_err(|source| {
                        CapabilityError::AreaCount {
                            offset,
                            count,
                            source,
                        }
                    })?,
                    size: u64::read_exact_from(&mut capability).map_err(|source| {
                        CapabilityError::AreaCount {
                            offset,
                            count,
                            source,
                        }
                    })?,
                });
            }
        }

        Ok(sparse_areas)
    }

    pub fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), Error> {
        let region_read = RegionAccess {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::RegionRead as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<RegionAccess>() as u32,
                ..Default::default()
            },
            offset,
            count: data.len() as u32,
            region,
        };
        debug!("Command: {region_read:?}");
        self.next_message_id += Wrapping(1);
        self.stream
            .write_all(region_read.as_slice())
            .map_err(Error::StreamWrite)?;

        let mut reply = RegionAccess::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");
        self.stream.read_exact(data).map_err(Error::StreamRead)?;
        Ok(())
    }

    pub fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), Error> {
        let region_write = RegionAccess {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::RegionWrite as u16,
                flags: HeaderFlags::Command as u32,
                message_size: (size_of::<RegionAccess>() + data.len()) as u32,
                ..Default::default()
            },
            offset,
            count: data.len() as u32,
            region,
        };
        debug!("Command: {region_write:?}");
        self.next_message_id += Wrapping(1);

        let bufs = vec![IoSlice::new(region_write.as_slice()), IoSlice::new(data)];

        // TODO: Use write_all_vectored() when ready
        let _ = self
            .stream
            .write_vectored(&bufs)
            .map_err(Error::StreamWrite)?;

        let mut reply = RegionAccess::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");
        Ok(())
    }

    pub fn get_irq_info(&mut self, index: u32) -> Result<IrqInfo, Error> {
        let get_irq_info = GetIrqInfo {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::GetIrqInfo as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<GetIrqInfo>() as u32,
                ..Default::default()
            },
            argsz: (size_of::<GetIrqInfo>() - size_of::<Header>()) as u32,
            flags: 0,
            index,
            count: 0,
        };
        debug!("Command: {get_irq_info:?}");
        self.next_message_id += Wrapping(1);

        self.stream
            .write_all(get_irq_info.as_slice())
            .map_err(Error::StreamWrite)?;

        let mut reply = GetIrqInfo::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");

        Ok(IrqInfo {
            index: reply.index,
            flags: reply.flags,
            count: reply.count,
        })
    }

    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: &[RawFd],
    ) -> Result<(), Error> {
        let set_irqs = SetIrqs {
            header: Header {
                message_id: self.next_message_id.0,
                command: Command::SetIrqs as u16,
                flags: HeaderFlags::Command as u32,
                message_size: size_of::<SetIrqs>() as u32,
                ..Default::default()
            },
            argsz: (size_of::<SetIrqs>() - size_of::<Header>()) as u32,
            flags,
            start,
            index,
            count,
        };
        debug!("Command: {set_irqs:?}");
        self.next_message_id += Wrapping(1);

        self.stream
            .send_with_fds(&[set_irqs.as_slice()], fds)
            .map_err(Error::SendWithFd)?;

        let mut reply = Header::default();
        self.stream
            .read_exact(reply.as_mut_slice())
            .map_err(Error::StreamRead)?;
        debug!("Reply: {reply:?}");

        Ok(())
    }

    pub fn region(&self, region_index: u32) -> Option<&Region> {
        self.regions
            .iter()
            .find(|&region| region.index == region_index)
    }

    pub fn resettable(&self) -> bool {
        self.resettable
    }

    pub fn shutdown(&self) -> Result<(), Error> {
        self.stream
            .shutdown(std::net::Shutdown::Both)
            .map_err(Error::StreamShutdown)
    }
}

pub trait ServerBackend {
    fn region_read(
        &mut self,
        _region: u32,
        _offset: u64,
        _data: &mut [u8],
    ) -> Result<(), std::io::Error>;
    fn region_write(
        &mut self,
        _region: u32,
        _offset: u64,
        _data: &[u8],
    ) -> Result<(), std::io::Error>;
    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        _offset: u64,
        _address: u64,
        _size: u64,
        _fd: Option<File>,
    ) -> Result<(), std::io::Error>;
    fn dma_unmap(
        &mut self,
        _flags: DmaUnmapFlags,
        _address: u64,
        _size: u64,
    ) -> Result<(), std::io::Error>;
    fn reset(&mut self) -> Result<(), std::io::Error>;
    /// How long the server may wait for the next message before calling
    /// [`ServerBackend::idle`]; `None` (the default) waits indefinitely.
    /// Lets a backend do periodic work (sampling device memory the client
    /// writes through an mmap, without any message) on the server's
    /// thread.
    fn idle_timeout(&self) -> Option<std::time::Duration> {
        None
    }
    /// Called when no message arrived within [`ServerBackend::idle_timeout`].
    fn idle(&mut self) {}
    fn set_irqs(
        &mut self,
        _index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        _fds: Vec<File>,
    ) -> Result<(), std::io::Error>;
}

#[derive(Clone, Copy)]
pub struct SparseArea {
    pub area: vfio_region_sparse_mmap_area,
}

#[derive(Clone)]
pub struct ServerRegion {
    pub region_info: vfio_region_info,
    pub sparse_areas: Vec<SparseArea>,
    pub mmap_fd: Option<RawFd>,
}

pub struct Server {
    listener: UnixListener,
    path: Option<PathBuf>,
    resettable: bool,
    irqs: Vec<IrqInfo>,
    regions: Vec<ServerRegion>,
    max_data_xfer_size: u32,
    max_dma_maps: Option<u32>,
    message_deadline: Option<Duration>,
}

/// How long the rest of a message may take to arrive once its first byte
/// has, by default (see [`Server::set_message_deadline`]).
pub const DEFAULT_MESSAGE_DEADLINE: Duration = Duration::from_secs(5);

impl Server {
    pub fn new(
        path: &Path,
        resettable: bool,
        irqs: Vec<IrqInfo>,
        regions: Vec<ServerRegion>,
    ) -> Result<Server, Error> {
        if path.exists() {
            return Err(Error::SocketPathExists);
        }

        let listener = UnixListener::bind(path).map_err(Error::SocketBind)?;

        Ok(Server {
            listener,
            path: Some(path.to_path_buf()),
            resettable,
            irqs,
            regions,
            max_data_xfer_size: default_max_data_xfer_size(),
            max_dma_maps: None,
            message_deadline: Some(DEFAULT_MESSAGE_DEADLINE),
        })
    }

    pub fn from_owned_fd(
        fd: OwnedFd,
        resettable: bool,
        irqs: Vec<IrqInfo>,
        regions: Vec<ServerRegion>,
    ) -> Server {
        let listener = UnixListener::from(fd);

        Server {
            listener,
            path: None,
            resettable,
            irqs,
            regions,
            max_data_xfer_size: default_max_data_xfer_size(),
            max_dma_maps: None,
            message_deadline: Some(DEFAULT_MESSAGE_DEADLINE),
        }
    }

    /// Largest `count` of one REGION_READ/REGION_WRITE this server accepts
    /// (advertised in the VERSION reply; default 1 MiB). Larger requests
    /// are refused with E2BIG before anything is allocated.
    pub fn set_max_data_xfer_size(&mut self, size: u32) {
        self.max_data_xfer_size = size;
    }

    /// Number of DMA mappings the backend keeps at once, advertised to the
    /// client as `max_dma_maps` (default: not advertised, which the
    /// protocol reads as 65535).
    pub fn set_max_dma_maps(&mut self, maps: u32) {
        self.max_dma_maps = Some(maps);
    }

    /// How long the rest of a message may take to arrive once its first
    /// byte has (default [`DEFAULT_MESSAGE_DEADLINE`]). A client that sends
    /// part of a message and then stalls would otherwise block the server
    /// in its read for good; past the deadline the connection is closed
    /// with [`Error::IncompleteMessage`]. `None` waits indefinitely.
    /// Waiting for the first byte of the next message is not bounded.
    pub fn set_message_deadline(&mut self, deadline: Option<Duration>) {
        self.message_deadline = deadline;
    }

    /// Handle one command whose header and whole body (`body`, the
    /// `message_size - 16` bytes after the header) have been read. Returns
    /// the reply to send, if any. An error leaves the stream in sync: the
    /// caller answers it with an error reply.
    fn handle_command(
        &self,
        backend: &mut dyn ServerBackend,
        header: Header,
        body: &[u8],
        fds: Vec<File>,
    ) -> Result<Option<Reply>, Error> {
        if header.flags & HEADER_TYPE_MASK != HeaderFlags::Command as u32 {
            return Err(Error::NotACommand(header.flags));
        }
        let command = Command::n(header.command).ok_or(Error::UnknownCommand(header.command))?;
        let reply = match command {
            Command::Unknown
            | Command::GetRegionIoFds
            | Command::DmaRead
            | Command::DmaWrite
            | Command::UserDirtyPages => {
                return Err(Error::UnsupportedCommand(command));
            }
            Command::Version => {
                if header.no_reply() {
                    return Err(Error::UnexpectedNoReply(Command::Version));
                }
                let client_version: Version = parse(header, body)?;
                let client_capabilities = parse_version_data(&body[VERSION_FIXED..])?;
                info!(
                    "Received client version: major = {} minor = {} capabilities = {:?}",
                    client_version.major, client_version.minor, client_capabilities.capabilities,
                );
                if client_version.major != 0 {
                    return Err(Error::UnsupportedVersion(client_version.major));
                }

                let server_capabilities = CapabilitiesData {
                    capabilities: Capabilities {
                        max_data_xfer_size: self.max_data_xfer_size,
                        max_dma_maps: self.max_dma_maps,
                        ..Default::default()
                    },
                };
                let mut server_version_data = serde_json::to_vec(&server_capabilities)
                    .map_err(Error::SerializeCapabilites)?;
                server_version_data.push(0);
                let server_version = Version {
                    header: reply_header(header, size_of::<Version>() + server_version_data.len()),
                    major: 0,
                    minor: 0,
                };
                info!(
                    "Sent server version: major = {} minor = {} capabilities = {:?}",
                    server_version.major, server_version.minor, server_capabilities.capabilities
                );
                Reply::new(server_version.as_slice(), &server_version_data)
            }
            Command::DmaMap => {
                let cmd: DmaMap = parse(header, body)?;
                let mut fds = fds;
                // The specification demands that the caller passes 0
                // or 1 file descriptor.
                if fds.len() > 1 {
                    return Err(Error::InvalidInput);
                }
                backend
                    .dma_map(
                        DmaMapFlags::from_bits_truncate(cmd.flags),
                        cmd.offset,
                        cmd.address,
                        cmd.size,
                        fds.pop(),
                    )
                    .map_err(Error::Backend)?;
                Reply::new(reply_header(header, size_of::<Header>()).as_slice(), &[])
            }
            Command::DmaUnmap => {
                let cmd: DmaUnmap = parse(header, body)?;
                if DmaUnmapFlags::from_bits_retain(cmd.flags)
                    .contains(DmaUnmapFlags::GET_DIRTY_PAGE_INFO)
                {
                    return Err(Error::UnsupportedFeature);
                }
                backend
                    .dma_unmap(
                        DmaUnmapFlags::from_bits_truncate(cmd.flags),
                        cmd.address,
                        cmd.size,
                    )
                    .map_err(Error::Backend)?;
                let reply = DmaUnmap {
                    header: reply_header(header, size_of::<DmaUnmap>()),
                    ..cmd
                };
                Reply::new(reply.as_slice(), &[])
            }
            Command::DeviceGetInfo => {
                if header.no_reply() {
                    return Err(Error::UnexpectedNoReply(Command::DeviceGetInfo));
                }
                let _: DeviceGetInfo = parse(header, body)?;
                let reply = DeviceGetInfo {
                    header: reply_header(header, size_of::<DeviceGetInfo>()),
                    argsz: (size_of::<DeviceGetInfo>() - size_of::<Header>()) as u32,
                    // TODO: Consider non-PCI devices
                    flags: VFIO_DEVICE_FLAGS_PCI
                        | if self.resettable {
                            VFIO_DEVICE_FLAGS_RESET
                        } else {
                            0
                        },
                    num_regions: self.regions.len() as u32,
                    num_irqs: self.irqs.len() as u32,
                };
                Reply::new(reply.as_slice(), &[])
            }
            Command::DeviceGetRegionInfo => {
                if header.no_reply() {
                    return Err(Error::UnexpectedNoReply(Command::DeviceGetRegionInfo));
                }
                let cmd: DeviceGetRegionInfo = parse(header, body)?;
                let server_region = self
                    .regions
                    .get(cmd.region_info.index as usize)
                    .ok_or(Error::InvalidInput)?;
                self.region_info_reply(header, cmd.region_info.argsz, server_region)
            }
            Command::GetIrqInfo => {
                if header.no_reply() {
                    return Err(Error::UnexpectedNoReply(Command::GetIrqInfo));
                }
                let cmd: GetIrqInfo = parse(header, body)?;
                let irq = self
                    .irqs
                    .get(cmd.index as usize)
                    .ok_or(Error::InvalidInput)?;
                let reply = GetIrqInfo {
                    header: reply_header(header, size_of::<GetIrqInfo>()),
                    argsz: (size_of::<GetIrqInfo>() - size_of::<Header>()) as u32,
                    index: irq.index,
                    flags: irq.flags,
                    count: irq.count,
                };
                Reply::new(reply.as_slice(), &[])
            }
            Command::SetIrqs => {
                let cmd: SetIrqs = parse(header, body)?;
                if cmd.index as usize >= self.irqs.len() {
                    return Err(Error::InvalidInput);
                }
                if cmd.flags & VFIO_IRQ_SET_DATA_BOOL > 0 {
                    return Err(Error::UnsupportedFeature);
                }
                backend
                    .set_irqs(cmd.index, cmd.flags, cmd.start, cmd.count, fds)
                    .map_err(Error::Backend)?;
                Reply::new(reply_header(header, size_of::<Header>()).as_slice(), &[])
            }
            Command::RegionRead => {
                if header.no_reply() {
                    return Err(Error::UnexpectedNoReply(Command::RegionRead));
                }
                let cmd: RegionAccess = parse(header, body)?;
                let (region, offset, count) = (cmd.region, cmd.offset, cmd.count);
                if count > self.max_data_xfer_size {
                    return Err(Error::CountTooLarge(count));
                }
                if region as usize >= self.regions.len() {
                    return Err(Error::InvalidInput);
                }
                // Bounded by max_data_xfer_size, checked above.
                let mut data = vec![0u8; count as usize];
                backend
                    .region_read(region, offset, &mut data)
                    .map_err(Error::Backend)?;
                let reply = RegionAccess {
                    header: reply_header(header, size_of::<RegionAccess>() + data.len()),
                    region,
                    offset,
                    count,
                };
                Reply::new(reply.as_slice(), &data)
            }
            Command::RegionWrite => {
                let cmd: RegionAccess = parse(header, body)?;
                let (region, offset, count) = (cmd.region, cmd.offset, cmd.count);
                if count > self.max_data_xfer_size {
                    return Err(Error::CountTooLarge(count));
                }
                // The payload is exactly `count` bytes after the fixed part.
                let data = &body[REGION_ACCESS_FIXED..];
                if data.len() != count as usize {
                    return Err(Error::InvalidInput);
                }
                if region as usize >= self.regions.len() {
                    return Err(Error::InvalidInput);
                }
                backend
                    .region_write(region, offset, data)
                    .map_err(Error::Backend)?;
                let reply = RegionAccess {
                    header: reply_header(header, size_of::<RegionAccess>()),
                    region,
                    offset,
                    count,
                };
                Reply::new(reply.as_slice(), &[])
            }
            Command::DeviceReset => {
                backend.reset().map_err(Error::Backend)?;
                Reply::new(reply_header(header, size_of::<Header>()).as_slice(), &[])
            }
        };

        Ok((!header.no_reply()).then_some(reply))
    }

    /// The DEVICE_GET_REGION_INFO reply for `server_region`, with its
    /// sparse-mmap capability and fd when the client's `argsz` has room for
    /// them (otherwise `argsz` in the reply says how much room is needed).
    fn region_info_reply(
        &self,
        header: Header,
        client_argsz: u32,
        server_region: &ServerRegion,
    ) -> Reply {
        let mut region_info = server_region.region_info;
        let sparse_areas = &server_region.sparse_areas;

        let mut cap_data: Vec<u8> = Vec::new();
        if !sparse_areas.is_empty() {
            // The structures the client reads the list back through,
            // in the order it reads them.
            let cap_header = CapabilityHeader {
                id: VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16,
                version: 1,
                next: 0,
            };
            cap_data.extend_from_slice(cap_header.as_slice());

            let sparse = SparseMmapHeader {
                nr_areas: sparse_areas.len() as u32,
                reserved: 0,
            };
            cap_data.extend_from_slice(sparse.as_slice());

            for sparse_area in sparse_areas {
                cap_data.extend_from_slice(sparse_area.area.offset.as_slice());
                cap_data.extend_from_slice(sparse_area.area.size.as_slice());
            }
        }

        let send_cap_data = if !cap_data.is_empty() {
            let full_argsz = (size_of::<vfio_region_info>() + cap_data.len()) as u32;
            region_info.flags |= VFIO_REGION_INFO_FLAG_CAPS;
            region_info.argsz = full_argsz;
            region_info.cap_offset = size_of::<vfio_region_info>() as u32;
            client_argsz >= full_argsz
        } else {
            false
        };
        if !send_cap_data {
            cap_data.clear();
        }

        let reply = DeviceGetRegionInfo {
            header: reply_header(header, size_of::<DeviceGetRegionInfo>() + cap_data.len()),
            region_info,
        };
        let mut reply = Reply::new(reply.as_slice(), &cap_data);
        if send_cap_data {
            reply.fd = server_region.mmap_fd;
        }
        reply
    }

    /// Largest message body (bytes after the header) this server reads: a
    /// REGION_WRITE of `max_data_xfer_size` bytes, or a VERSION with its
    /// capability string.
    fn max_body(&self) -> usize {
        (REGION_ACCESS_FIXED + self.max_data_xfer_size as usize)
            .max(VERSION_FIXED + MAX_VERSION_DATA)
    }

    /// Accept one client on the listening socket and serve it until it
    /// disconnects (see [`Server::serve_connection`]).
    pub fn run(&self, backend: &mut dyn ServerBackend) -> Result<(), Error> {
        let (stream, _) = self.listener.accept().map_err(Error::SocketAccept)?;
        self.serve_connection(backend, stream)
    }

    /// Serve one connected client until it disconnects.
    ///
    /// Every message is read whole (header, then exactly `message_size`
    /// bytes) before it is parsed, so a command the server refuses or does
    /// not know is answered with an error reply carrying an errno and the
    /// next message is read from the right place. Nothing the client sends
    /// makes the server allocate more than one message of at most
    /// `max_data_xfer_size` bytes plus the fixed part of a command: a header
    /// announcing a larger (or smaller than a header) message is answered
    /// with E2BIG (EINVAL) and the connection is closed, since its body
    /// cannot be skipped without reading it. Once a message's first byte
    /// has arrived, the rest must follow within the message deadline
    /// ([`Server::set_message_deadline`]), else the connection is closed;
    /// while the server waits for it, [`ServerBackend::idle`] keeps being
    /// called every [`ServerBackend::idle_timeout`].
    pub fn serve_connection(
        &self,
        backend: &mut dyn ServerBackend,
        mut stream: UnixStream,
    ) -> Result<(), Error> {
        loop {
            if let Some(timeout) = backend.idle_timeout() {
                if !wait_readable(&stream, timeout)? {
                    backend.idle();
                    continue;
                }
            }
            let Some((header, fds, mut rest)) =
                recv_header(&mut stream, backend, self.message_deadline)?
            else {
                info!("Connection closed");
                return Ok(());
            };

            let size = header.message_size as usize;
            if size < size_of::<Header>() || size - size_of::<Header>() > self.max_body() {
                let error = if size < size_of::<Header>() {
                    Error::MessageSize(header.message_size)
                } else {
                    Error::MessageTooLarge(header.message_size)
                };
                error!("Closing the connection: {error}");
                send_error(&mut stream, header, &error)?;
                return Err(error);
            }
            let mut body = vec![0u8; size - size_of::<Header>()];
            rest.expected = size;
            rest.read(&mut stream, &mut body, backend)?;

            match self.handle_command(backend, header, &body, fds) {
                Ok(Some(reply)) => reply.send(&mut stream)?,
                Ok(None) => {}
                Err(e) if header.no_reply() => {
                    warn!(
                        "Error handling command {} (no reply requested): {e}",
                        header.command
                    );
                }
                Err(e) => {
                    warn!("Error handling command {}: {e}", header.command);
                    send_error(&mut stream, header, &e)?;
                }
            }
        }
    }
}

/// Size of VERSION's fixed part after the header (major, minor).
const VERSION_FIXED: usize = size_of::<Version>() - size_of::<Header>();
/// Size of REGION_READ/WRITE's fixed part after the header.
const REGION_ACCESS_FIXED: usize = size_of::<RegionAccess>() - size_of::<Header>();
/// Longest VERSION capability string accepted.
const MAX_VERSION_DATA: usize = 4096;
/// The message-type bits of a header's flags.
const HEADER_TYPE_MASK: u32 = 0xf;

/// A reply ready to send: its bytes and the fd that travels with it.
struct Reply {
    bytes: Vec<u8>,
    fd: Option<RawFd>,
}

impl Reply {
    fn new(fixed: &[u8], data: &[u8]) -> Reply {
        let mut bytes = Vec::with_capacity(fixed.len() + data.len());
        bytes.extend_from_slice(fixed);
        bytes.extend_from_slice(data);
        Reply { bytes, fd: None }
    }

    fn send(&self, stream: &mut UnixStream) -> Result<(), Error> {
        match self.fd {
            Some(fd) => {
                let sent = stream
                    .send_with_fds(&[&self.bytes[..]], &[fd])
                    .map_err(Error::SendWithFd)?;
                // The fd went with the first byte; the rest is plain data.
                stream
                    .write_all(&self.bytes[sent..])
                    .map_err(Error::StreamWrite)
            }
            None => stream.write_all(&self.bytes).map_err(Error::StreamWrite),
        }
    }
}

/// The header of a reply to `header`, `size` bytes long in all.
fn reply_header(header: Header, size: usize) -> Header {
    Header {
        message_id: header.message_id,
        command: header.command,
        flags: HeaderFlags::Reply as u32,
        message_size: size as u32,
        error: 0,
    }
}

/// Answer `header` with an error reply (header only) carrying `error`'s
/// errno.
fn send_error(stream: &mut UnixStream, header: Header, error: &Error) -> Result<(), Error> {
    let reply = Header {
        flags: HeaderFlags::Error as u32 | HeaderFlags::Reply as u32,
        error: error.errno() as u32,
        ..reply_header(header, size_of::<Header>())
    };
    stream
        .write_all(reply.as_slice())
        .map_err(Error::StreamWrite)
}

/// Wait up to `timeout` for `stream` to become readable (or closed).
fn wait_readable(stream: &UnixStream, timeout: std::time::Duration) -> Result<bool, Error> {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is one valid pollfd that outlives the call.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(Error::StreamRead(e));
    }
    Ok(n > 0)
}

/// The rest of a message whose first byte has arrived: it must be read
/// by `deadline` (if any).
struct MessageRest {
    deadline: Option<Instant>,
    limit: Option<Duration>,
    /// Bytes of the message read so far.
    received: usize,
    /// Bytes of the whole message (a header until the header is read).
    expected: usize,
}

impl MessageRest {
    /// The first `received` bytes of a message arrived just now.
    fn new(limit: Option<Duration>, received: usize) -> MessageRest {
        MessageRest {
            deadline: limit.and_then(|l| Instant::now().checked_add(l)),
            limit,
            received,
            expected: size_of::<Header>(),
        }
    }

    /// Fill `buf` from `stream` before the deadline. While waiting, the
    /// backend's idle hook keeps its period, as between messages.
    fn read(
        &mut self,
        stream: &mut UnixStream,
        buf: &mut [u8],
        backend: &mut dyn ServerBackend,
    ) -> Result<(), Error> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = match self.deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Err(self.overdue(filled)),
                },
            };
            let idle = backend.idle_timeout();
            let wait = match (left, idle) {
                (Some(l), Some(i)) => Some(l.min(i)),
                (l, i) => l.or(i),
            };
            if let Some(wait) = wait {
                if !wait_readable(stream, wait)? {
                    if idle.is_some_and(|i| left.is_none_or(|l| i <= l)) {
                        backend.idle();
                    }
                    continue;
                }
            }
            match stream.read(&mut buf[filled..]) {
                Ok(0) => return Err(Error::StreamRead(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::StreamRead(e)),
            }
        }
        self.received += filled;
        Ok(())
    }

    /// The deadline passed with `filled` more bytes read: the error that
    /// closes the connection, logged.
    fn overdue(&self, filled: usize) -> Error {
        let error = Error::IncompleteMessage {
            received: self.received + filled,
            expected: self.expected,
            deadline: self.limit.unwrap_or_default(),
        };
        error!("Closing the connection: {error}");
        error
    }
}

/// Read one message header and the fds sent with it, or `None` when the
/// client closed the connection. Waiting for the header's first byte is
/// unbounded; a header split across reads is completed within `deadline`
/// of it, and the returned [`MessageRest`] bounds reading the body.
fn recv_header(
    stream: &mut UnixStream,
    backend: &mut dyn ServerBackend,
    deadline: Option<Duration>,
) -> Result<Option<(Header, Vec<File>, MessageRest)>, Error> {
    let mut header = Header::default();
    // The maximum number of FDs that can be sent is 16 so that is
    // also the maximum that can be received.
    let mut fds = vec![0; 16];
    let mut iovecs = vec![iovec {
        iov_base: header.as_mut_slice().as_mut_ptr() as *mut c_void,
        iov_len: header.as_mut_slice().len(),
    }];
    // SAFETY: Safe as the iovect is correctly initialised and fds is big enough
    let (bytes, fds_received) = unsafe {
        stream
            .recv_with_fds(&mut iovecs, &mut fds)
            .map_err(Error::ReceiveWithFd)?
    };
    fds.truncate(fds_received);
    let fds: Vec<File> = fds
        .iter()
        // SAFETY: Safe as we have only valid FDs in the vector now
        .map(|fd| unsafe { File::from_raw_fd(*fd) })
        .collect();

    // Other end closed connection
    if bytes == 0 {
        return Ok(None);
    }
    let mut rest = MessageRest::new(deadline, bytes);
    if bytes < size_of::<Header>() {
        rest.read(stream, &mut header.as_mut_slice()[bytes..], backend)?;
    }
    Ok(Some((header, fds, rest)))
}

/// The command structure `T` (header first) from `header` and the body
/// that followed it; a body shorter than `T`'s fixed part is refused.
fn parse<T: ByteValued>(header: Header, body: &[u8]) -> Result<T, Error> {
    let fixed = size_of::<T>() - size_of::<Header>();
    let part = body.get(..fixed).ok_or(Error::ShortMessage {
        command: header.command,
        size: header.message_size,
    })?;
    let mut bytes = Vec::with_capacity(size_of::<T>());
    bytes.extend_from_slice(header.as_slice());
    bytes.extend_from_slice(part);
    T::from_slice(&bytes).copied().ok_or(Error::InvalidInput)
}

/// The client's capabilities from VERSION's optional, NUL-terminated JSON
/// string (absent or empty: the defaults).
fn parse_version_data(data: &[u8]) -> Result<CapabilitiesData, Error> {
    if data.len() > MAX_VERSION_DATA {
        return Err(Error::InvalidInput);
    }
    let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let json = &data[..end];
    if json.is_empty() {
        return Ok(CapabilitiesData::default());
    }
    serde_json::from_slice(json).map_err(Error::DeserializeCapabilites)
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            if path.exists() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    mod message_deadline {
        use super::*;

        /// A backend that refuses every access and counts its idle calls.
        struct Idler {
            idle: usize,
        }

        fn refused() -> std::io::Error {
            std::io::ErrorKind::Unsupported.into()
        }

        impl ServerBackend for Idler {
            fn region_read(&mut self, _: u32, _: u64, _: &mut [u8]) -> Result<(), std::io::Error> {
                Err(refused())
            }
            fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> Result<(), std::io::Error> {
                Err(refused())
            }
            fn dma_map(
                &mut self,
                _: DmaMapFlags,
                _: u64,
                _: u64,
                _: u64,
                _: Option<File>,
            ) -> Result<(), std::io::Error> {
                Err(refused())
            }
            fn dma_unmap(
                &mut self,
                _: DmaUnmapFlags,
                _: u64,
                _: u64,
            ) -> Result<(), std::io::Error> {
                Err(refused())
            }
            fn reset(&mut self) -> Result<(), std::io::Error> {
                Err(refused())
            }
            fn idle_timeout(&self) -> Option<Duration> {
                Some(Duration::from_millis(1))
            }
            fn idle(&mut self) {
                self.idle += 1;
            }
            fn set_irqs(
                &mut self,
                _: u32,
                _: u32,
                _: u32,
                _: u32,
                _: Vec<File>,
            ) -> Result<(), std::io::Error> {
                Err(refused())
            }
        }

        /// A server with `deadline` and the server end of a connection
        /// whose client end is returned too.
        fn serving(deadline: Duration) -> (Server, UnixStream, UnixStream) {
            // `serve_connection` is driven directly: the listener is never
            // accepted on, so any socket will do.
            let (unused, _) = UnixStream::pair().expect("socketpair");
            let mut server = Server::from_owned_fd(OwnedFd::from(unused), false, vec![], vec![]);
            server.set_message_deadline(Some(deadline));
            let (client, conn) = UnixStream::pair().expect("socketpair");
            (server, client, conn)
        }

        /// A header of unknown command 99 announcing `size` bytes.
        fn header(size: u32) -> Vec<u8> {
            let h = Header {
                message_id: 1,
                command: 99,
                flags: 0,
                message_size: size,
                error: 0,
            };
            h.as_slice().to_vec()
        }

        #[test]
        fn a_message_that_stops_halfway_closes_the_connection() {
            let mut header_then_part = header(32);
            header_then_part.extend_from_slice(&[0; 4]);
            for (sent, received, expected) in [
                (header(32)[..8].to_vec(), 8, 16),
                (header_then_part, 20, 32),
            ] {
                let (server, mut client, conn) = serving(Duration::from_millis(500));
                client.write_all(&sent).expect("send");
                let mut backend = Idler { idle: 0 };
                let err = server
                    .serve_connection(&mut backend, conn)
                    .expect_err("the connection is dropped");
                assert!(
                    matches!(
                        err,
                        Error::IncompleteMessage { received: r, expected: e, .. }
                            if (r, e) == (received, expected)
                    ),
                    "{err}"
                );
                assert!(backend.idle > 0, "the idle hook ran while waiting");
            }
        }

        #[test]
        fn a_message_split_across_writes_in_time_is_served() {
            let (server, mut client, conn) = serving(Duration::from_secs(60));
            let peer = std::thread::spawn(move || {
                let h = header(16);
                client.write_all(&h[..8]).expect("send");
                std::thread::sleep(Duration::from_millis(50));
                client.write_all(&h[8..]).expect("send");
                let mut reply = Header::default();
                client.read_exact(reply.as_mut_slice()).expect("reply");
                reply
            });
            let mut backend = Idler { idle: 0 };
            server
                .serve_connection(&mut backend, conn)
                .expect("served until the client left");
            let reply = peer.join().expect("client");
            assert_eq!(reply.message_id, 1);
            assert_eq!(reply.error, libc::ENOSYS as u32, "unknown command refused");
        }
    }

    mod capability {
        use super::*;

        /// Offsets in a capability list are relative to the region info
        /// structure.
        const FIRST_CAPABILITY: u32 = size_of::<vfio_region_info>() as u32;

        fn sparse_cap(next: u32, nr_areas: u32, areas: &[(u64, u64)]) -> Vec<u8> {
            let header = CapabilityHeader {
                id: VFIO_REGION_INFO_CAP_SPARSE_MMAP as u16,
                version: 1,
                next,
            };
            let sparse = SparseMmapHeader {
                nr_areas,
                reserved: 0,
            };

            let mut data = Vec::new();
            data.extend_from_slice(header.as_slice());
            data.extend_from_slice(sparse.as_slice());
            for (offset, size) in areas {
                data.extend_from_slice(offset.as_slice());
                data.extend_from_slice(size.as_slice());
            }
            data
        }

        fn area(offset: u64, size: u64) -> vfio_region_sparse_mmap_area {
            vfio_region_sparse_mmap_area { offset, size }
        }

        fn walk(
            cap_offset: u32,
            cap_data: &[u8],
        ) -> Result<Vec<vfio_region_sparse_mmap_area>, CapabilityError> {
            let region_info = vfio_region_info {
                argsz: (size_of::<vfio_region_info>() + cap_data.len()) as u32,
                flags: VFIO_REGION_INFO_FLAG_CAPS,
                cap_offset,
                ..Default::default()
            };
            Client::parse_region_caps(cap_data, &region_info)
        }

        #[test]
        fn absent_list_collects_none() {
            assert_eq!(walk(0, &[]).ok(), Some(vec![]));
        }

        #[test]
        fn unsupported_id_is_skipped() {
            let mut cap_data = sparse_cap(0, 1, &[(0x0, 0x1000)]);
            cap_data[0..2].copy_from_slice(&0xffffu16.to_ne_bytes());

            assert_eq!(walk(FIRST_CAPABILITY, &cap_data).ok(), Some(vec![]));
        }

        #[test]
        fn offset_inside_region_info_fails() {
            let cap_data = sparse_cap(0, 1, &[(0x0, 0x1000)]);

            assert!(matches!(
                walk(FIRST_CAPABILITY - 4, &cap_data),
                Err(CapabilityError::Outside { .. })
            ));
        }

        #[test]
        fn offset_past_list_fails() {
            let cap_data = sparse_cap(0, 1, &[(0x0, 0x1000)]);
            let past = FIRST_CAPABILITY + cap_data.len() as u32;

            assert!(matches!(
                walk(past, &cap_data),
                Err(CapabilityError::Truncated { .. })
            ));
        }

        #[test]
        fn next_pointing_at_itself_fails() {
            let cap_data = sparse_cap(FIRST_CAPABILITY, 1, &[(0x0, 0x1000)]);

            assert!(matches!(
                walk(FIRST_CAPABILITY, &cap_data),
                Err(CapabilityError::NotAdvancing(_))
            ));
        }

        mod sparse {
            use super::*;

            #[test]
            fn areas_keep_wire_order() {
                let cap_data = sparse_cap(0, 2, &[(0x0, 0x1000), (0x2000, 0x3000)]);

                assert_eq!(
                    walk(FIRST_CAPABILITY, &cap_data).ok(),
                    Some(vec![area(0x0, 0x1000), area(0x2000, 0x3000)])
                );
            }

            #[test]
            fn count_of_zero_collects_none() {
                let cap_data = sparse_cap(0, 0, &[]);

                assert_eq!(walk(FIRST_CAPABILITY, &cap_data).ok(), Some(vec![]));
            }

            #[test]
            fn count_beyond_list_fails() {
                let cap_data = sparse_cap(0, u32::MAX, &[(0x0, 0x1000)]);

                assert!(matches!(
                    walk(FIRST_CAPABILITY, &cap_data),
                    Err(CapabilityError::AreaCount { .. })
                ));
            }

            #[test]
            fn truncated_areas_fail() {
                let cap_data = sparse_cap(0, 2, &[(0x0, 0x1000)]);

                assert!(matches!(
                    walk(FIRST_CAPABILITY, &cap_data),
                    Err(CapabilityError::AreaCount { .. })
                ));
            }
        }
    }
}
