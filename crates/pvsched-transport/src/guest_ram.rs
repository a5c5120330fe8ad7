//! Which guest RAM fds a device process may map.
//!
//! Guest RAM arrives from the VMM as fds (vfio-user DMA_MAP, mpqemu
//! SYNC_SYSMEM) and is mapped shared; the BAR2 backing given with
//! `--bar2-fd` is checked the same way. The VMM is not trusted, and a page
//! fault the kernel cannot satisfy on such a mapping is SIGBUS, which kills
//! the device. So [`check`] maps a range only when:
//!
//! - it lies inside the file;
//! - the file lives on shmem ([`MAPPED_FS`]): see there for why no other
//!   filesystem is safe, hugetlbfs in particular;
//! - the file is sealed against shrinking (`F_SEAL_SHRINK`): a VMM that
//!   truncated it would make the device's next access to the vanished
//!   pages fault. QEMU's `memory-backend-memfd` seals by default
//!   (`seal=on`), and so does the reference VMM.
//!
//! Together the last two admit exactly the memfds of `memfd_create(2)`
//! without `MFD_HUGETLB`: a tmpfs file opened by path is created with
//! `F_SEAL_SEAL` and can never gain `F_SEAL_SHRINK`, so a file on a
//! size-limited tmpfs mount (which faults with SIGBUS once full) never
//! passes. Other fds are not errors of the request: the transport accepts
//! the range but does not map it ([`GuestRamRefusal::never_mapped`]); the
//! guest-region handshake then refuses a region there
//! (`ERR_REGION_OUTSIDE_RAM`) and device-region mode is unaffected.

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
    /// The file is not on shmem: touching it can fault with SIGBUS.
    #[error(
        "guest RAM fd is on {0}, not shmem: touching a page of it can fault with SIGBUS (a hugetlbfs pool with no free huge page, a full disk). Use QEMU's memory-backend-memfd without hugetlb=on, or device-region mode"
    )]
    NotShmem(String),
    /// The file could be shrunk under the mapping.
    #[error(
        "guest RAM fd is not sealed with F_SEAL_SHRINK ({0}); the VMM could truncate it and crash the device with SIGBUS. Use QEMU's memory-backend-memfd (sealed by default) or device-region mode"
    )]
    NotSealed(String),
}

impl GuestRamRefusal {
    /// Whether the fd is of a kind the device never maps (the transport
    /// records the range unmapped), rather than a request that does not fit
    /// its fd (the transport refuses it).
    pub fn never_mapped(&self) -> bool {
        matches!(self, Self::NotShmem(_) | Self::NotSealed(_))
    }
}

/// The one filesystem (`statfs.f_type`) whose files the device maps:
/// shmem, where memfds live.
///
/// A sealed memfd is a file on the kernel's internal shmem mount, which has
/// no size limit: a fault on it finds its page or allocates one (a zeroed
/// page where the VMM punched a hole), and fails only when the whole
/// system or memory cgroup is out of memory, through the OOM killer, never
/// with SIGBUS. Its other seals cannot hurt a mapping either: with
/// `F_SEAL_WRITE` the mapping itself is refused, `F_SEAL_FUTURE_WRITE`
/// spares existing mappings, and `MFD_NOEXEC_SEAL`'s `F_SEAL_EXEC` only
/// concerns the file mode. Everything else is refused:
///
/// - hugetlbfs (`memfd_create(MFD_HUGETLB)` can be sealed like any memfd):
///   a fault with no free huge page in the pool is SIGBUS, and the VMM can
///   empty the pool or punch a hole into the file at will (`F_SEAL_SHRINK`
///   does not forbid `FALLOC_FL_PUNCH_HOLE`);
/// - disk filesystems: a fault on a hole with the disk full, or a read
///   error, is SIGBUS (such files cannot be sealed anyway);
/// - any other kind (a new sealable file type, say) until it is shown safe.
pub const MAPPED_FS: libc::__fsword_t = libc::TMPFS_MAGIC;

/// A name for filesystem type `f_type`, for the refusal message.
fn fs_name(f_type: libc::__fsword_t) -> String {
    match f_type {
        libc::HUGETLBFS_MAGIC => "hugetlbfs".into(),
        t => format!("a filesystem of type {t:#x}"),
    }
}

/// Check that `offset..offset+size` of `file` may be mapped for good.
pub fn check(file: &File, offset: u64, size: u64) -> Result<(), GuestRamRefusal> {
    let bad = GuestRamRefusal::BadRange { offset, size };
    let end = offset.checked_add(size).ok_or_else(|| bad.clone())?;
    if size == 0 || usize::try_from(size).is_err() {
        return Err(bad);
    }
    // First what the file is: a hugetlbfs file is refused as such, not as
    // "unsealed" (which would suggest a sealed hugetlb memfd).
    match pvsched_sandbox::fd_fs_type(file.as_fd()) {
        Ok(MAPPED_FS) => {}
        Ok(t) => return Err(GuestRamRefusal::NotShmem(fs_name(t))),
        Err(e) => {
            return Err(GuestRamRefusal::NotShmem(format!(
                "an unknown filesystem (fstatfs: {e})"
            )));
        }
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
    fn hugetlb_memfds_are_never_mapped_even_sealed() {
        let Some(f) = pvsched_testkit::sealed_hugetlb_memfd(c"t-huge", 4 << 20) else {
            pvsched_testkit::skip_or_fail("hugetlb guest RAM check", "no hugetlbfs memfd");
            return;
        };
        let refusal = check(&f, 0, 4 << 20).unwrap_err();
        assert_eq!(refusal, GuestRamRefusal::NotShmem("hugetlbfs".into()));
        assert!(refusal.never_mapped());
    }

    #[test]
    fn files_on_other_filesystems_are_never_mapped() {
        let f = File::open("/proc/self/status").unwrap();
        let refusal = check(&f, 0, 4096).unwrap_err();
        assert!(
            matches!(&refusal, GuestRamRefusal::NotShmem(fs) if fs.contains("0x9fa0")),
            "{refusal}"
        );
        assert!(refusal.never_mapped());
    }

    #[test]
    fn unsealed_past_end_empty_and_wrapping_ranges_are_refused() {
        let f = memfd(1 << 20, 0);
        let refusal = check(&f, 0, 4096).unwrap_err();
        assert!(matches!(refusal, GuestRamRefusal::NotSealed(_)));
        assert!(refusal.never_mapped());
        let f = memfd(1 << 20, libc::F_SEAL_SHRINK);
        let refusal = check(&f, 4096, 1 << 20).unwrap_err();
        assert!(matches!(refusal, GuestRamRefusal::PastEnd { .. }));
        assert!(!refusal.never_mapped());
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
