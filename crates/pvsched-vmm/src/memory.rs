//! Guest RAM and device memory backed by memfds.
//!
//! Guest RAM is one `memfd` mapped shared, wrapped in a
//! `vm_memory::GuestMemoryMmap`, so a device process can map the same
//! pages later (the fd travels with the region). The device region (BAR2)
//! defaults to a memfd too; an embedder (the policy agent) may supply its
//! own mapping instead, e.g. an mmapped BPF array map.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `memfd_create` failed.
    #[error("memfd_create for {name} failed: {source}")]
    Memfd {
        /// Debug name of the memfd.
        name: String,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// Sizing the memfd failed.
    #[error("sizing memfd {name} to {size} bytes failed: {source}")]
    Truncate {
        /// Debug name.
        name: String,
        /// Requested size.
        size: u64,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// Mapping failed.
    #[error("mapping {size} bytes of {name} failed: {source}")]
    Mmap {
        /// Debug name.
        name: String,
        /// Requested size.
        size: u64,
        /// vm-memory error.
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    /// The size is zero, not page aligned or does not fit the address space.
    #[error("bad size {0:#x}: must be a non-zero multiple of 4096")]
    BadSize(u64),
    /// Building the guest memory map failed.
    #[error("building guest memory failed: {0}")]
    Guest(#[from] vm_memory::GuestRegionCollectionError),
    /// The region does not fit at its guest address.
    #[error("guest region of {size:#x} bytes does not fit at {base:#x}")]
    Overflow {
        /// Guest base address.
        base: u64,
        /// Size.
        size: u64,
    },
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, Error>;

/// Create a close-on-exec memfd of `size` bytes named `name` (shown in
/// /proc/PID/maps), sealed against any change of size (`F_SEAL_SHRINK`,
/// `F_SEAL_GROW`, `F_SEAL_SEAL`), as QEMU's `memory-backend-memfd` is: a
/// device process that maps it may rely on its pages staying (see
/// `pvsched_transport::guest_ram`).
pub fn memfd(name: &CStr, size: u64) -> Result<File> {
    let label = name.to_string_lossy().into_owned();
    if size == 0 || !size.is_multiple_of(4096) {
        return Err(Error::BadSize(size));
    }
    // SAFETY: `name` is a valid NUL-terminated string; the flags are valid.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(Error::Memfd {
            name: label,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(|source| Error::Truncate {
        name: label.clone(),
        size,
        source,
    })?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl(F_ADD_SEALS) on the fd owned by `file`; no pointers.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(Error::Memfd {
            name: label,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(file)
}

/// Map a fresh memfd of `size` bytes, shared.
pub fn memfd_region(name: &CStr, size: u64) -> Result<Arc<MmapRegion>> {
    let file = memfd(name, size)?;
    let len = usize::try_from(size).map_err(|_| Error::BadSize(size))?;
    let region =
        MmapRegion::from_file(FileOffset::new(file, 0), len).map_err(|source| Error::Mmap {
            name: name.to_string_lossy().into_owned(),
            size,
            source,
        })?;
    Ok(Arc::new(region))
}

/// Guest RAM of `size` bytes at guest address 0, backed by one memfd.
pub fn guest_ram(size: u64) -> Result<GuestMemoryMmap> {
    let region = memfd_region(c"pvsched-guest-ram", size)?;
    let r = GuestRegionMmap::with_arc(region, GuestAddress(0))
        .ok_or(Error::Overflow { base: 0, size })?;
    Ok(GuestMemoryMmap::from_regions(vec![r])?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend};

    #[test]
    fn ram_is_file_backed_and_shared() {
        let mem = guest_ram(0x10000).unwrap();
        mem.write_obj(0xdead_beef_u32, GuestAddress(0x100)).unwrap();
        let r: u32 = mem.read_obj(GuestAddress(0x100)).unwrap();
        assert_eq!(r, 0xdead_beef);
        let region = mem.iter().next().unwrap();
        assert!(region.file_offset().is_some());
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(matches!(memfd(c"x", 0), Err(Error::BadSize(0))));
        assert!(matches!(memfd(c"x", 100), Err(Error::BadSize(100))));
    }
}
