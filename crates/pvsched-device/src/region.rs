//! The shared region: validation, attachment and hostile-input-safe access.
//!
//! The region (header, slot→APIC-ID table, one 128-byte slot per vCPU; see
//! `include/pvsched_abi.h`) lives either in guest RAM at SHM_GPA (guest
//! region mode) or in memory the embedder backs BAR2 with (device region
//! mode). Either way the guest can change any byte at any time, so:
//!
//! * every access goes through a [`RegionView`] that bounds-checks offsets
//!   and uses atomic (single-copy) loads and stores, never references to
//!   guest-controlled memory;
//! * slot reads copy the guest half, then validate the sequence counter
//!   (bounded retries, then [`SlotError::Busy`]), then clamp every field
//!   ([`GuestSlotState`]);
//! * after a reset, failure or detach the view is revoked under a lock: once
//!   the revoking call returns, no access through any clone of the view is in
//!   flight or can start, so the device never touches memory the guest took
//!   back.
//!
//! Sequence protocol (both halves, each with its own writer): the writer
//! makes `seq` odd, publishes with a release fence, writes the fields, then
//! stores `seq + 1` (even) with release ordering. A reader loads `seq` with
//! acquire ordering, retries while it is odd, copies the fields, issues an
//! acquire fence and accepts the copy only if `seq` is unchanged.

use pvsched_abi::{
    CS_ALL, HEADER_SIZE, NICE_MAX, NICE_MIN, POLICY_BATCH, POLICY_DEADLINE, POLICY_FIFO,
    POLICY_IDLE, POLICY_NORMAL, POLICY_RR, RT_PRIO_MAX, RegionHeader, SLOT_SIZE, SlotGuest,
    SlotHost, TASK_F_ALL, WAIT_ANY, WAIT_NONE,
};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU8, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use vm_memory::{
    Address, ByteValued, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    MmapRegion,
};

pub use pvsched_abi::seq::SEQ_RETRIES;
use pvsched_abi::seq::{HALF_WORDS, SharedWords};

/// Bytes in one half of a slot (one cache line).
const HALF: usize = pvsched_abi::seq::HOST_HALF;

impl SharedWords for Mapping {
    fn word(&self, off: usize) -> Option<&AtomicU32> {
        Mapping::word(self, off)
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// Where the region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RegionMode {
    /// BAR2, backed by memory the embedder supplied (`F_DEVICE_REGION`).
    Device,
    /// Guest RAM at SHM_GPA (`F_GUEST_REGION`).
    Guest,
}

/// Where an attached region is and what it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Region mode.
    pub mode: RegionMode,
    /// GENERATION register value at attach (also in the header).
    pub generation: u32,
    /// Number of slots.
    pub nr_vcpus: u32,
    /// Size in bytes (guest mode: SHM_SIZE; device mode: BAR2 size).
    pub size: u64,
    /// Guest-physical address of the region start (guest mode: SHM_GPA;
    /// device mode: BAR2 base at attach).
    pub guest_addr: u64,
    /// Host virtual address of the region start in this process.
    pub host_addr: usize,
}

/// Why a slot access failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// The guest kept the sequence counter odd or changing.
    #[error(
        "slot {index} stayed busy for {attempts} read attempts; the guest is mid-update or stuck, retry later"
    )]
    Busy {
        /// Slot index.
        index: u32,
        /// Attempts made.
        attempts: u32,
    },
    /// The region was detached (reset, failure, memory change).
    #[error(
        "region is detached (device reset or failed); take a new view after the next region_attached"
    )]
    Detached,
    /// The slot index is not below NR_VCPUS.
    #[error("slot index {index} is out of range (the region has {nr_vcpus} slots)")]
    OutOfRange {
        /// Requested index.
        index: u32,
        /// Slots in the region.
        nr_vcpus: u32,
    },
}

/// A validated snapshot of a slot's guest half.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestSlotState {
    /// The (even) sequence value the copy was taken at.
    pub seq: u32,
    /// `CS_*` bits; reserved bits are masked off.
    pub kern_cs: u32,
    /// `POLICY_*`; an unknown value becomes `POLICY_NORMAL` (and sets `clamped`).
    pub policy: u32,
    /// Nice value clamped to `NICE_MIN..=NICE_MAX`.
    pub nice: i32,
    /// RT priority: `1..=RT_PRIO_MAX` for FIFO/RR, 0 for every other policy.
    pub rt_prio: u32,
    /// Slot index waited for; `None` if not waiting, out of range, or a
    /// lock wait (`lock_wait`).
    pub wait_on: Option<u32>,
    /// The vCPU spins on a contended lock, holder unknown (`WAIT_ANY`).
    pub lock_wait: bool,
    /// `TASK_F_*` bits of the running task (0 unless the guest negotiated
    /// `F_TASK_FLAGS`); unknown bits are masked off.
    pub task_flags: u32,
    /// Completed updates counter, as written.
    pub updates: u64,
    /// Wake-ups of a task that last ran on another vCPU, as written (0
    /// unless the guest negotiated `F_SYNC_COUNTS`).
    pub wakes: u64,
    /// Waits for another vCPU, as written (the same).
    pub waits: u64,
    /// Some field was out of range and was clamped.
    pub clamped: bool,
}

impl GuestSlotState {
    /// Validate and clamp a raw guest half of a region with `nr_vcpus` slots.
    ///
    /// ```
    /// use pvsched_abi::{SlotGuest, POLICY_FIFO};
    /// use pvsched_device::GuestSlotState;
    /// let raw = SlotGuest { policy: POLICY_FIFO, rt_prio: 500, nice: -99, wait_on: 9, kern_cs: 0xffff_ffff, ..Default::default() };
    /// let s = GuestSlotState::from_raw(&raw, 4);
    /// assert_eq!((s.rt_prio, s.nice, s.wait_on, s.kern_cs), (99, -20, None, 0xf));
    /// assert!(s.clamped);
    /// ```
    pub fn from_raw(raw: &SlotGuest, nr_vcpus: u32) -> Self {
        let mut clamped = false;
        let policy = match raw.policy {
            POLICY_NORMAL | POLICY_FIFO | POLICY_RR | POLICY_BATCH | POLICY_IDLE
            | POLICY_DEADLINE => raw.policy,
            _ => {
                clamped = true;
                POLICY_NORMAL
            }
        };
        let nice = raw.nice.clamp(NICE_MIN, NICE_MAX);
        clamped |= nice != raw.nice;
        let rt_prio = if matches!(policy, POLICY_FIFO | POLICY_RR) {
            raw.rt_prio.clamp(1, RT_PRIO_MAX)
        } else {
            0
        };
        clamped |= rt_prio != raw.rt_prio;
        let lock_wait = raw.wait_on == WAIT_ANY;
        let wait_on = match raw.wait_on {
            WAIT_NONE | WAIT_ANY => None,
            v if v - 1 < nr_vcpus => Some(v - 1),
            _ => {
                clamped = true;
                None
            }
        };
        Self {
            seq: raw.seq,
            kern_cs: raw.kern_cs & CS_ALL,
            policy,
            nice,
            rt_prio,
            wait_on,
            lock_wait,
            task_flags: raw.flags & TASK_F_ALL,
            updates: raw.updates,
            wakes: raw.wakes,
            waits: raw.waits,
            clamped,
        }
    }
}

/// A bounds-checked window onto the host mapping of a region.
#[derive(Debug, Clone)]
pub(crate) struct Mapping {
    mmap: Arc<MmapRegion>,
    offset: usize,
    len: usize,
}

impl Mapping {
    /// A window of `len` bytes at `offset` in `mmap`; `None` if it does not
    /// fit or its host address is not cache-line aligned.
    pub(crate) fn new(mmap: Arc<MmapRegion>, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        if end > mmap.size() || len == 0 {
            return None;
        }
        let addr = (mmap.as_ptr() as usize).checked_add(offset)?;
        if !addr.is_multiple_of(HALF) {
            return None;
        }
        Some(Self { mmap, offset, len })
    }

    pub(crate) fn host_addr(&self) -> usize {
        self.mmap.as_ptr() as usize + self.offset
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Pointer to `size` bytes at `off`, if in bounds and `size`-aligned.
    fn ptr(&self, off: usize, size: usize) -> Option<*mut u8> {
        let end = off.checked_add(size)?;
        if end > self.len || !off.is_multiple_of(size) {
            return None;
        }
        // The window was checked to lie inside the mapping in `new`, and
        // `off + size <= len`, so this stays inside the same allocation.
        Some(self.mmap.as_ptr().wrapping_add(self.offset + off))
    }

    fn word(&self, off: usize) -> Option<&AtomicU32> {
        let p = self.ptr(off, 4)?;
        // SAFETY: `p` is 4-byte aligned (the window start is 64-byte aligned
        // and `off` is a multiple of 4) and points to 4 bytes inside a live
        // mapping that `self.mmap` keeps alive for the returned lifetime.
        // The memory is shared with the guest, which may write it at any
        // time; it is only ever accessed through atomics here.
        Some(unsafe { AtomicU32::from_ptr(p.cast::<u32>()) })
    }

    /// `off` as an index if `size` bytes from it lie inside the mapping.
    fn in_bounds(&self, off: u64, size: usize) -> Option<usize> {
        let off = usize::try_from(off).ok()?;
        off.checked_add(size)
            .is_some_and(|end| end <= self.len)
            .then_some(off)
    }

    /// Copy `data.len()` bytes at `off` out of the mapping. Returns false
    /// (and leaves `data` untouched) if the range is out of bounds.
    pub(crate) fn read_bytes(&self, off: u64, data: &mut [u8]) -> bool {
        let size = data.len();
        let Some(off) = self.in_bounds(off, size) else {
            return false;
        };
        match (size, self.ptr(off, size)) {
            (8, Some(p)) => {
                // SAFETY: 8-byte aligned, in bounds of the live mapping; atomic access only.
                let v = unsafe { AtomicU64::from_ptr(p.cast::<u64>()) }.load(Ordering::Acquire);
                data.copy_from_slice(&v.to_ne_bytes());
            }
            (4, Some(p)) => {
                // SAFETY: 4-byte aligned, in bounds of the live mapping; atomic access only.
                let v = unsafe { AtomicU32::from_ptr(p.cast::<u32>()) }.load(Ordering::Acquire);
                data.copy_from_slice(&v.to_ne_bytes());
            }
            (2, Some(p)) => {
                // SAFETY: 2-byte aligned, in bounds of the live mapping; atomic access only.
                let v = unsafe { AtomicU16::from_ptr(p.cast::<u16>()) }.load(Ordering::Acquire);
                data.copy_from_slice(&v.to_ne_bytes());
            }
            _ => {
                for (i, b) in data.iter_mut().enumerate() {
                    let p = self.mmap.as_ptr().wrapping_add(self.offset + off + i);
                    // SAFETY: byte `off + i < len` is inside the live mapping;
                    // a byte is always aligned; atomic access only.
                    *b = unsafe { AtomicU8::from_ptr(p) }.load(Ordering::Acquire);
                }
            }
        }
        true
    }

    /// Copy `data` into the mapping at `off`. Returns false (and writes
    /// nothing) if the range is out of bounds.
    pub(crate) fn write_bytes(&self, off: u64, data: &[u8]) -> bool {
        let size = data.len();
        let Some(off) = self.in_bounds(off, size) else {
            return false;
        };
        match (size, self.ptr(off, size)) {
            (8, Some(p)) => {
                let v = u64::from_ne_bytes(data.try_into().unwrap_or([0; 8]));
                // SAFETY: 8-byte aligned, in bounds of the live mapping; atomic access only.
                unsafe { AtomicU64::from_ptr(p.cast::<u64>()) }.store(v, Ordering::Release);
            }
            (4, Some(p)) => {
                let v = u32::from_ne_bytes(data.try_into().unwrap_or([0; 4]));
                // SAFETY: 4-byte aligned, in bounds of the live mapping; atomic access only.
                unsafe { AtomicU32::from_ptr(p.cast::<u32>()) }.store(v, Ordering::Release);
            }
            (2, Some(p)) => {
                let v = u16::from_ne_bytes(data.try_into().unwrap_or([0; 2]));
                // SAFETY: 2-byte aligned, in bounds of the live mapping; atomic access only.
                unsafe { AtomicU16::from_ptr(p.cast::<u16>()) }.store(v, Ordering::Release);
            }
            _ => {
                for (i, b) in data.iter().enumerate() {
                    let p = self.mmap.as_ptr().wrapping_add(self.offset + off + i);
                    // SAFETY: byte `off + i < len` is inside the live mapping;
                    // a byte is always aligned; atomic access only.
                    unsafe { AtomicU8::from_ptr(p) }.store(*b, Ordering::Release);
                }
            }
        }
        true
    }

    /// Read a 64-byte half at `off` with the sequence protocol.
    fn read_half(&self, off: usize, index: u32) -> Result<[u32; HALF_WORDS], SlotError> {
        pvsched_abi::seq::read_half(self, off).ok_or(SlotError::Busy {
            index,
            attempts: SEQ_RETRIES,
        })
    }

    /// Write a 64-byte half at `off` with the sequence protocol as its
    /// writer; `words[0]` (the seq slot) is ignored.
    fn write_half(&self, off: usize, words: &[u32; HALF_WORDS]) {
        pvsched_abi::seq::write_half(self, off, words)
    }

    /// Write the header, the APIC table and zeroed host halves.
    pub(crate) fn initialize(&self, header: &RegionHeader, apic_ids: &[u32]) {
        let words = to_words(header.as_slice());
        for (i, w) in words.iter().enumerate().skip(1) {
            self.store(4 * i, *w, Ordering::Relaxed);
        }
        let nr = apic_ids.len() as u32;
        for (i, id) in apic_ids.iter().enumerate() {
            self.store(
                header.apic_table_offset as usize + 4 * i,
                *id,
                Ordering::Relaxed,
            );
        }
        for i in 0..nr {
            let host = pvsched_abi::slot_offset(nr, i) as usize + HALF;
            for w in 0..HALF_WORDS {
                self.store(host + 4 * w, 0, Ordering::Relaxed);
            }
        }
        // Magic last: a reader that sees it sees the rest.
        self.store(0, words[0], Ordering::Release);
    }
}

fn to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn from_words<T: ByteValued + Default>(words: &[u32]) -> T {
    let mut v = T::default();
    for (dst, w) in v.as_mut_slice().chunks_exact_mut(4).zip(words) {
        dst.copy_from_slice(&w.to_le_bytes());
    }
    v
}

/// Region header for `nr_vcpus` slots at `generation`, recording the
/// features the driver negotiated so the host policy can tell what this
/// guest reports (a guest without `F_WAIT_ON` cannot say whom it waits on),
/// and the ABI version the driver said it speaks (shown to operators).
pub(crate) fn header(
    nr_vcpus: u32,
    generation: u32,
    host_flags: u32,
    driver_features: u64,
    driver_version: u32,
) -> RegionHeader {
    RegionHeader {
        magic: pvsched_abi::REGION_MAGIC,
        version: pvsched_abi::ABI_VERSION,
        nr_vcpus,
        slot_size: SLOT_SIZE,
        header_size: HEADER_SIZE,
        apic_table_offset: pvsched_abi::APIC_TABLE_OFFSET,
        slots_offset: pvsched_abi::slots_offset(nr_vcpus),
        generation,
        host_flags,
        driver_features_lo: driver_features as u32,
        driver_features_hi: (driver_features >> 32) as u32,
        driver_version,
        reserved: [0; 4],
    }
}

/// Resolve a guest region against guest RAM, checking in the ABI's order:
/// zero size, alignment, wrap, inside one RAM range, large enough.
/// Returns the `ERR_*` code on refusal.
pub(crate) fn resolve_guest_region(
    mem: Option<&GuestMemoryMmap>,
    gpa: u64,
    size: u64,
    nr_vcpus: u32,
) -> Result<Mapping, u32> {
    use pvsched_abi as abi;
    let page = u64::from(abi::PAGE_SIZE);
    if size == 0 {
        return Err(abi::ERR_REGION_ZERO_SIZE);
    }
    if !gpa.is_multiple_of(page) || !size.is_multiple_of(page) {
        return Err(abi::ERR_REGION_UNALIGNED);
    }
    let last = gpa
        .checked_add(size)
        .and_then(|end| end.checked_sub(1))
        .ok_or(abi::ERR_REGION_WRAPS)?;
    let mem = mem.ok_or(abi::ERR_REGION_OUTSIDE_RAM)?;
    let region = mem
        .find_region(GuestAddress(gpa))
        .ok_or(abi::ERR_REGION_OUTSIDE_RAM)?;
    if last > region.last_addr().raw_value() {
        return Err(abi::ERR_REGION_OUTSIDE_RAM);
    }
    let need = u64::from(abi::region_size(nr_vcpus));
    if size < need {
        return Err(abi::ERR_REGION_TOO_SMALL);
    }
    let offset = gpa
        .checked_sub(region.start_addr().raw_value())
        .and_then(|o| usize::try_from(o).ok())
        .ok_or(abi::ERR_REGION_OUTSIDE_RAM)?;
    Mapping::new(region.get_mmap(), offset, need as usize).ok_or(abi::ERR_REGION_UNALIGNED)
}

/// Map a device region: the whole BAR2 `backing`; the `ERR_*` code on
/// refusal (no backing, or one that is not cache-line aligned).
pub(crate) fn resolve_device_region(backing: Option<Arc<MmapRegion>>) -> Result<Mapping, u32> {
    use pvsched_abi as abi;
    let backing = backing.ok_or(abi::ERR_REGION_UNAVAILABLE)?;
    let size = backing.size();
    Mapping::new(backing, 0, size).ok_or(abi::ERR_REGION_UNAVAILABLE)
}

type Shared = Arc<RwLock<Option<Mapping>>>;

/// Cloneable handle onto an attached region, usable from any thread.
///
/// A view stops working (every access returns [`SlotError::Detached`], reads
/// of the header return zeros) as soon as the device detaches the region.
///
/// ```
/// use pvsched_abi as abi;
/// use pvsched_device::testing::guest_handshake;
/// use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
/// use std::sync::Arc;
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
/// let mut dev = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).unwrap();
/// dev.set_guest_memory(mem);
/// guest_handshake(&mut dev, 0x10000, 4096);
/// let view = dev.region_view().expect("attached");
/// assert_eq!(view.read_header().magic, abi::REGION_MAGIC);
/// view.write_guest_slot(1, &abi::SlotGuest { nice: 5, ..Default::default() }).unwrap();
/// assert_eq!(view.read_guest_slot(1).unwrap().nice, 5);
/// ```
#[derive(Clone, Debug)]
pub struct RegionView {
    info: RegionInfo,
    shared: Shared,
    apic_ids: Arc<[u32]>,
}

impl RegionView {
    pub(crate) fn new(info: RegionInfo, mapping: Mapping, apic_ids: Arc<[u32]>) -> Self {
        Self {
            info,
            shared: Arc::new(RwLock::new(Some(mapping))),
            apic_ids,
        }
    }

    /// Revoke every clone of this view. When this returns no access through
    /// any clone is in flight. For the view's owner: the device, or a VMM
    /// that built the view from a device process's event
    /// ([`crate::event::view_of_reported_region`]) and is told it detached.
    pub fn revoke(&self) {
        *pvsched_util::write(&self.shared) = None;
    }

    /// Point every clone at `mapping` (same host address, new owner).
    pub(crate) fn replace_mapping(&self, mapping: Mapping) {
        let mut g = pvsched_util::write(&self.shared);
        if g.is_some() {
            *g = Some(mapping);
        }
    }

    fn guard(&self) -> RwLockReadGuard<'_, Option<Mapping>> {
        pvsched_util::read(&self.shared)
    }

    fn with<R>(&self, f: impl FnOnce(&Mapping) -> R) -> Result<R, SlotError> {
        let g = self.guard();
        g.as_ref().map(f).ok_or(SlotError::Detached)
    }

    fn slot_off(&self, index: u32) -> Result<usize, SlotError> {
        if index >= self.info.nr_vcpus {
            return Err(SlotError::OutOfRange {
                index,
                nr_vcpus: self.info.nr_vcpus,
            });
        }
        Ok(pvsched_abi::slot_offset(self.info.nr_vcpus, index) as usize)
    }

    /// Where the region is.
    pub fn info(&self) -> &RegionInfo {
        &self.info
    }

    /// Whether the region is still attached.
    pub fn is_attached(&self) -> bool {
        self.guard().is_some()
    }

    /// Copy then validate slot `index`'s guest half (bounded retries while
    /// the guest is mid-update), then clamp it ([`GuestSlotState::from_raw`]).
    pub fn read_guest_slot(&self, index: u32) -> Result<GuestSlotState, SlotError> {
        let off = self.slot_off(index)?;
        let words = self.with(|m| m.read_half(off, index))??;
        let raw = SlotGuest::from_words(&words);
        Ok(GuestSlotState::from_raw(&raw, self.info.nr_vcpus))
    }

    /// Copy then validate slot `index`'s host half.
    pub fn read_host_slot(&self, index: u32) -> Result<SlotHost, SlotError> {
        let off = self.slot_off(index)? + HALF;
        let words = self.with(|m| m.read_half(off, index))??;
        Ok(SlotHost::from_words(&words))
    }

    /// Write slot `index`'s host half with the sequence protocol (the host is
    /// its only writer; `host.seq` is ignored and advanced by 2).
    pub fn write_host_slot(&self, index: u32, host: &SlotHost) -> Result<(), SlotError> {
        let off = self.slot_off(index)? + HALF;
        self.with(|m| m.write_half(off, &host.to_words()))
    }

    /// Write slot `index`'s guest half with the sequence protocol, as the
    /// guest driver does (`guest.seq` is ignored and advanced by 2). For
    /// tests and simulated guests: a real guest writes its half itself.
    pub fn write_guest_slot(&self, index: u32, guest: &SlotGuest) -> Result<(), SlotError> {
        let off = self.slot_off(index)?;
        self.with(|m| m.write_half(off, &guest.to_words()))
    }

    /// The header as it is in memory now (zeros once detached). The guest
    /// can overwrite it; trust [`RegionView::info`] instead for decisions.
    pub fn read_header(&self) -> RegionHeader {
        self.with(|m| {
            let words: Vec<u32> = (0..HEADER_SIZE as usize / 4)
                .map(|i| m.load(4 * i, Ordering::Acquire))
                .collect();
            from_words(&words)
        })
        .unwrap_or_default()
    }

    /// APIC ID of slot `index`, from the device configuration (not from the
    /// guest-writable table).
    pub fn apic_id(&self, index: u32) -> Option<u32> {
        self.apic_ids.get(index as usize).copied()
    }

    /// Raw bytes of the region at `offset` (bounds-checked, atomic loads).
    /// Returns false if detached or out of bounds.
    pub fn read_bytes(&self, offset: u64, data: &mut [u8]) -> bool {
        self.with(|m| m.read_bytes(offset, data)).unwrap_or(false)
    }

    /// Write raw bytes into the region at `offset` (bounds-checked). For
    /// tests and simulated guests. Returns false if detached or out of bounds.
    pub fn write_bytes(&self, offset: u64, data: &[u8]) -> bool {
        self.with(|m| m.write_bytes(offset, data)).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_abi as abi;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10000),
            (GuestAddress(0x10_0000), 0x10000),
        ])
        .unwrap()
    }

    #[test]
    fn validation_order() {
        let m = mem();
        let r = |gpa, size| resolve_guest_region(Some(&m), gpa, size, 2).map(|_| ());
        assert_eq!(r(0x1000, 0), Err(abi::ERR_REGION_ZERO_SIZE));
        assert_eq!(r(0x1001, 0x1000), Err(abi::ERR_REGION_UNALIGNED));
        assert_eq!(r(0x1000, 0x1001), Err(abi::ERR_REGION_UNALIGNED));
        assert_eq!(r(u64::MAX - 0xfff, 0x2000), Err(abi::ERR_REGION_WRAPS));
        assert_eq!(r(u64::MAX - 0xfff, 0x1000), Err(abi::ERR_REGION_WRAPS));
        assert_eq!(r(0x2_0000, 0x1000), Err(abi::ERR_REGION_OUTSIDE_RAM));
        assert_eq!(r(0xf000, 0x2000), Err(abi::ERR_REGION_OUTSIDE_RAM));
        assert_eq!(
            resolve_guest_region(Some(&m), 0, 0x1000, 100).map(|_| ()),
            Err(abi::ERR_REGION_TOO_SMALL)
        );
        assert_eq!(
            resolve_guest_region(None, 0, 0x1000, 2).map(|_| ()),
            Err(abi::ERR_REGION_OUTSIDE_RAM)
        );
        assert!(r(0x10_f000, 0x1000).is_ok());
    }

    #[test]
    fn clamp_rules() {
        let s = GuestSlotState::from_raw(
            &SlotGuest {
                policy: 77,
                rt_prio: 5,
                nice: 40,
                wait_on: 2,
                ..Default::default()
            },
            2,
        );
        assert_eq!(
            (s.policy, s.rt_prio, s.nice, s.wait_on),
            (POLICY_NORMAL, 0, 19, Some(1))
        );
        assert!(s.clamped);
        let s = GuestSlotState::from_raw(
            &SlotGuest {
                policy: POLICY_RR,
                rt_prio: 0,
                ..Default::default()
            },
            2,
        );
        assert_eq!(s.rt_prio, 1);
        let s = GuestSlotState::from_raw(
            &SlotGuest {
                policy: POLICY_IDLE,
                nice: 3,
                ..Default::default()
            },
            2,
        );
        assert!(!s.clamped);
        // A lock wait is a wait with no slot, not an out-of-range value.
        let s = GuestSlotState::from_raw(
            &SlotGuest {
                wait_on: WAIT_ANY,
                ..Default::default()
            },
            2,
        );
        assert_eq!((s.wait_on, s.lock_wait, s.clamped), (None, true, false));
    }
}
