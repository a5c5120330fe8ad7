//! A region shared by file descriptor (a VM's BPF region map, the fd
//! pvschedd hands a VMM), mapped once with vm-memory and used through the
//! slot protocol of this module.

extern crate std;

use super::{RawWords, SharedWords};
use crate::{SlotGuest, SlotHost};
use core::sync::atomic::Ordering;
use std::fs::File;
use vm_memory::FileOffset;
use vm_memory::mmap::{MmapRegion, MmapRegionError};

/// `len` bytes of a file mapped shared and read-write at offset 0: every
/// process (and BPF) that maps the same file sees the same bytes. The agent's
/// `RegionMmap` and pvschedd's client `RegionMap` are this mapping.
pub struct SharedRegion {
    mmap: MmapRegion<()>,
}

impl SharedRegion {
    /// Maps `len` bytes of `file` at offset 0, shared and read-write
    /// (vm-memory's file-backed [`MmapRegion::from_file`]).
    pub fn map(file: File, len: usize) -> Result<SharedRegion, MmapRegionError> {
        let mmap = MmapRegion::from_file(FileOffset::new(file, 0), len)?;
        Ok(SharedRegion { mmap })
    }

    /// Start of the mapping (a VMM registers it as BAR2's KVM memslot).
    pub fn as_ptr(&self) -> *mut u8 {
        self.mmap.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mmap.size()
    }

    /// Whether the mapping has no bytes (never, for a region).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The mapping as shared words, for the slot protocol.
    pub fn words(&self) -> RawWords {
        // SAFETY: the mapping is live and read-write for `len()` bytes while
        // self exists, and page aligned (mmap); RawWords accesses are atomic.
        unsafe { RawWords::new(self.as_ptr(), self.len()) }
    }

    /// Zeroes the whole mapping.
    pub fn clear(&self) {
        let w = self.words();
        for off in (0..self.len()).step_by(4) {
            w.store(off, 0, Ordering::Relaxed);
        }
    }

    /// Writes slot `index`'s guest half (`nr` vCPUs) with the seq protocol,
    /// as a guest would (tests, and VMMs that play the guest); false if the
    /// slot is outside the mapping.
    pub fn write_guest(&self, nr: u32, index: u32, g: &SlotGuest) -> bool {
        super::write_guest(&self.words(), nr, index, g)
    }

    /// Reads slot `index`'s host half as the guest would: a consistent
    /// copy, or None if the slot is outside the mapping or its writer stayed
    /// busy.
    pub fn read_host(&self, nr: u32, index: u32) -> Option<SlotHost> {
        super::read_host(&self.words(), nr, index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom};

    #[test]
    fn a_written_guest_half_is_in_the_file_and_clear_zeroes_it() {
        let path =
            std::env::temp_dir().join(std::format!("pvsched-abi-shared-{}", std::process::id()));
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(4096).unwrap();
        let r = SharedRegion::map(file.try_clone().unwrap(), 4096).unwrap();
        let g = SlotGuest {
            seq: 0,
            kern_cs: 3,
            ..SlotGuest::default()
        };
        assert!(r.write_guest(2, 1, &g));
        assert!(!r.write_guest(2, 2, &g), "slot 2 of 2 is outside");
        let mut bytes = std::vec![0u8; 4096];
        let mut f = file;
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_exact(&mut bytes).unwrap();
        let off = crate::slot_offset(2, 1) as usize;
        assert_eq!(
            super::super::read_guest(&r.words(), 2, 1).unwrap().kern_cs,
            3
        );
        assert_ne!(bytes[off..off + 64], [0u8; 64]);
        r.clear();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_exact(&mut bytes).unwrap();
        assert!(bytes.iter().all(|&b| b == 0));
        let _ = std::fs::remove_file(&path);
    }
}
