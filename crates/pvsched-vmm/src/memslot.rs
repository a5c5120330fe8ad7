//! A KVM memslot that follows a memory BAR (device-region mode).
//!
//! The BAR's backing is a mapping the embedder provides (a memfd by
//! default, the policy agent's mmapable BPF array map later). While the BAR
//! is decoded the mapping is registered at the BAR's address, so guest
//! accesses never exit; when the guest moves or disables the BAR the slot
//! is deleted and, if decoded again, re-created at the new address.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use pvsched_util::lock;
use std::sync::{Arc, Mutex};
use vm_memory::MmapRegion;

/// Errors updating the memslot.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// KVM refused the slot (overlap with RAM or another slot, bad address).
    #[error("KVM refused memslot {slot} at {gpa:#x} (+{size:#x}): {source}")]
    SetRegion {
        /// Slot number.
        slot: u32,
        /// Guest address.
        gpa: u64,
        /// Size.
        size: u64,
        /// KVM error.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// A memslot backing one memory BAR.
pub struct BarMemslot {
    vm: Arc<VmFd>,
    slot: u32,
    backing: Mutex<Arc<MmapRegion>>,
    mapped_at: Mutex<Option<u64>>,
}

impl BarMemslot {
    /// A slot number `slot` (unused by anything else) for `backing`.
    pub fn new(vm: Arc<VmFd>, slot: u32, backing: Arc<MmapRegion>) -> Self {
        Self {
            vm,
            slot,
            backing: Mutex::new(backing),
            mapped_at: Mutex::new(None),
        }
    }

    /// The backing mapping.
    pub fn backing(&self) -> Arc<MmapRegion> {
        lock(&self.backing).clone()
    }

    /// Replaces the backing; a registered slot is re-registered at the same
    /// address over the new mapping (the guest then sees its bytes).
    pub fn set_backing(&self, backing: Arc<MmapRegion>) -> Result<(), Error> {
        let at = self.mapped_at();
        self.move_to(None)?;
        *lock(&self.backing) = backing;
        self.move_to(at)
    }

    /// Guest address the slot is registered at, if any.
    pub fn mapped_at(&self) -> Option<u64> {
        *lock(&self.mapped_at)
    }

    fn set(&self, gpa: u64, size: u64) -> Result<(), Error> {
        let region = kvm_userspace_memory_region {
            slot: self.slot,
            flags: 0,
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: self.backing().as_ptr() as u64,
        };
        // SAFETY: the userspace range is `backing`, which this struct keeps
        // alive; the slot is deleted (size 0) in `move_to(None)`, in
        // `set_backing` and in Drop before the Arc can be released.
        unsafe { self.vm.set_user_memory_region(region) }.map_err(|source| Error::SetRegion {
            slot: self.slot,
            gpa,
            size,
            source,
        })
    }

    /// Register the slot at `new` (or delete it for `None`).
    ///
    /// On error the slot stays deleted (the BAR then reads through MMIO exits).
    pub fn move_to(&self, new: Option<u64>) -> Result<(), Error> {
        let mut at = lock(&self.mapped_at);
        if *at == new {
            return Ok(());
        }
        if let Some(old) = at.take() {
            self.set(old, 0)?;
        }
        if let Some(gpa) = new {
            self.set(gpa, self.backing().size() as u64)?;
            *at = Some(gpa);
        }
        Ok(())
    }
}

impl Drop for BarMemslot {
    fn drop(&mut self) {
        if let Err(e) = self.move_to(None) {
            log::warn!("deleting BAR memslot failed: {e}");
        }
    }
}
