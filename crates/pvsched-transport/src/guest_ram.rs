//! Which guest RAM fds a device process may map.
//!
//! Guest RAM arrives from the VMM as fds (vfio-user DMA_MAP, mpqemu
//! SYNC_SYSMEM) and is mapped shared. A VMM that later shrinks such a file
//! would make the device's next access to the vanished pages fault with
//! SIGBUS, killing the device. So a range is mapped only when it lies
//! inside the file and the file is sealed against shrinking
//! (`F_SEAL_SHRINK`): QEMU's `memory-backend-memfd` seals by default
//! (`seal=on`), and so does the reference VMM. Other files (a
//! `memory-backend-file` on tmpfs or hugetlbfs without the seal) are
//! accepted by the transport but not mapped: the guest-region handshake
//! then refuses the region (`ERR_REGION_OUTSIDE_RAM`) and device-region mode
//! is unaffected.

use std::fs::File;
use std::os::fd::AsFd;
use thiserror::Error;

/// Why a guest RAM range is not mapped.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum GuestRamRefusal {
    /// Zero size, or offset + size wraps.
    #[error("guest RAM range of {size:#x} bytes at file offset {offset:#x} is empty or wraps")]
    BadRange {
        /// File offset.
        offset: u64,
        /// Size.
        size: u64,
    },
    /// The fd cannot be sized.
    #[error("guest RAM fd cannot be sized (fstat: {0})")]
    Unsized(String),
    /// The range goes past the end of the file.
    #[error(
        "guest RAM range ends at file offset {end:#x}, past the file's {len:#x} bytes; the VMM must share the whole range"
    )]
    PastEnd {
        /// End of the range in the file.
        end: u64,
        /// File length.
        len: u64,
    },
    /// The file could be shrunk under the mapping.
    #[error(
        "guest RAM fd is not sealed with F_SEAL_SHRINK ({0}); the VMM could truncate it and crash the device with SIGBUS. Use QEMU's memory-backend-memfd (sealed by default) or device-region mode"
    )]
    NotSealed(String),
}

/// Check that `offset..offset+size` of `file` may be mapped for good.
pub fn check(file: &File, offset: u64, size: u64) -> Result<(), GuestRamRefusal> {
    let bad = GuestRamRefusal::BadRange { offset, size };
    let end = offset.checked_add(size).ok_or_else(|| bad.clone())?;
    if size == 0 || usize::try_from(size).is_err() {
        return Err(bad);
    }
    // The fstat syscall itself: File::metadata (statx) and glibc's fstat
    // (newfstatat) are outside the sandbox's allowlist.
    let len = pvsched_sandbox::fd_size(file.as_fd())
        .map_err(|e| GuestRamRefusal::Unsized(e.to_string()))?;
    if end > len {
        return Err(GuestRamRefusal::PastEnd { end, len });
    }
    match pvsched_sandbox::fd_seals(file.as_fd()) {
        Ok(seals) if seals & libc::F_SEAL_SHRINK != 0 => Ok(()),
        Ok(seals) => Err(GuestRamRefusal::NotSealed(format!("seals {seals:#x}"))),
        Err(e) => Err(GuestRamRefusal::NotSealed(format!("F_GET_SEALS: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd};

    fn memfd(size: u64, seals: i32) -> File {
        // SAFETY: memfd_create with a valid C string; the fd is owned below.
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        // SAFETY: fcntl on an fd this test owns.
        let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) };
        assert_eq!(rc, 0);
        f
    }

    #[test]
    fn sealed_ranges_inside_the_file_pass() {
        let f = memfd(1 << 20, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        assert_eq!(check(&f, 0, 1 << 20), Ok(()));
        assert_eq!(check(&f, 4096, 8192), Ok(()));
    }

    #[test]
    fn unsealed_past_end_empty_and_wrapping_ranges_are_refused() {
        let f = memfd(1 << 20, 0);
        assert!(matches!(
            check(&f, 0, 4096),
            Err(GuestRamRefusal::NotSealed(_))
        ));
        let f = memfd(1 << 20, libc::F_SEAL_SHRINK);
        assert!(matches!(
            check(&f, 4096, 1 << 20),
            Err(GuestRamRefusal::PastEnd { .. })
        ));
        assert!(matches!(
            check(&f, 0, 0),
            Err(GuestRamRefusal::BadRange { .. })
        ));
        assert!(matches!(
            check(&f, u64::MAX, 2),
            Err(GuestRamRefusal::BadRange { .. })
        ));
    }
}
