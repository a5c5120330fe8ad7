//! The slot sequence protocol (docs/abi.md), host side, written once: the
//! device (`RegionView`), the agent and pvschedd's client (both through
//! [`SharedRegion`], the fd-shared mapping) and every test that plays the
//! guest use these functions.
//!
//! Each 64-byte half of a slot has one writer. The writer makes `seq` odd,
//! writes the other fifteen words, then makes `seq` even again (release);
//! a reader takes a copy only if `seq` was even and unchanged around it
//! (acquire), retrying a bounded number of times while the writer is busy.
//! Every access is a 32-bit atomic load or store, so a hostile writer can
//! make a reader see garbage values but never tear a word or fault.

use crate::{CACHELINE, MAX_VCPUS, SLOT_SIZE, SlotGuest, SlotHost, slot_offset};
use core::sync::atomic::{AtomicU32, Ordering, fence};

/// Words in a 64-byte half.
pub const HALF_WORDS: usize = CACHELINE as usize / 4;
/// Byte offset of the host half in a slot.
pub const HOST_HALF: usize = CACHELINE as usize;
/// Copies a reader attempts while the writer is mid-update.
pub const SEQ_RETRIES: u32 = 256;

/// Shared memory a half lives in, as 32-bit words at byte offsets. Loads
/// and stores out of bounds read 0 and do nothing.
pub trait SharedWords {
    /// The little-endian word at byte offset `off`, or None if `off` is
    /// not 4-byte aligned or the word is not inside the memory.
    fn word(&self, off: usize) -> Option<&AtomicU32>;
    /// Bytes of the memory.
    fn len(&self) -> usize;
    /// The word at byte offset `off` (0 outside the memory).
    fn load(&self, off: usize, order: Ordering) -> u32 {
        self.word(off).map_or(0, |w| u32::from_le(w.load(order)))
    }
    /// Stores `v` at byte offset `off` (nothing outside the memory).
    fn store(&self, off: usize, v: u32, order: Ordering) {
        if let Some(w) = self.word(off) {
            w.store(v.to_le(), order);
        }
    }
    /// Whether it has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A live shared mapping given by its address and length.
#[derive(Clone, Copy, Debug)]
pub struct RawWords {
    base: *mut u8,
    len: usize,
}

impl RawWords {
    /// # Safety
    /// `base..base + len` must stay mapped read-write, and `base` 4-byte
    /// aligned, for as long as the value (or a copy) is used; other
    /// processes may write it concurrently (every access is atomic).
    pub unsafe fn new(base: *mut u8, len: usize) -> RawWords {
        RawWords { base, len }
    }
}

impl SharedWords for RawWords {
    fn word(&self, off: usize) -> Option<&AtomicU32> {
        if !off.is_multiple_of(4) || off.checked_add(4)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 4-byte aligned (base aligned, off % 4 == 0)
        // inside the live mapping `new`'s caller vouched for; only atomic
        // accesses are made through it.
        Some(unsafe { AtomicU32::from_ptr(self.base.add(off).cast::<u32>()) })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A consistent copy of the half at byte offset `off`, or None if the
/// writer stayed mid-update for [`SEQ_RETRIES`] attempts.
pub fn read_half<W: SharedWords + ?Sized>(m: &W, off: usize) -> Option<[u32; HALF_WORDS]> {
    let mut words = [0u32; HALF_WORDS];
    for _ in 0..SEQ_RETRIES {
        let s1 = m.load(off, Ordering::Acquire);
        if s1 & 1 == 0 {
            words[0] = s1;
            for (i, w) in words.iter_mut().enumerate().skip(1) {
                *w = m.load(off + 4 * i, Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            if m.load(off, Ordering::Relaxed) == s1 {
                return Some(words);
            }
        }
        core::hint::spin_loop();
    }
    None
}

/// Writes the half at byte offset `off` as its writer; `words[0]` (the
/// `seq` word) is ignored: `seq` advances by 2.
pub fn write_half<W: SharedWords + ?Sized>(m: &W, off: usize, words: &[u32; HALF_WORDS]) {
    let odd = m.load(off, Ordering::Relaxed) | 1;
    m.store(off, odd, Ordering::Relaxed);
    fence(Ordering::Release);
    for (i, w) in words.iter().enumerate().skip(1) {
        m.store(off + 4 * i, *w, Ordering::Relaxed);
    }
    m.store(off, odd.wrapping_add(1), Ordering::Release);
}

/// Byte offset of slot `index` of an `nr`-vCPU region in `m`, if the whole
/// slot lies inside it.
pub fn slot_in<W: SharedWords + ?Sized>(m: &W, nr: u32, index: u32) -> Option<usize> {
    if index >= nr || nr > MAX_VCPUS {
        return None;
    }
    let off = slot_offset(nr, index) as usize;
    (off.checked_add(SLOT_SIZE as usize)? <= m.len()).then_some(off)
}

impl SlotGuest {
    /// The half as the words it is stored as.
    pub fn to_words(&self) -> [u32; HALF_WORDS] {
        // SAFETY: SlotGuest is #[repr(C)], 64 bytes of integers with no
        // padding (checked at compile time in lib.rs), so it is 16 words.
        unsafe { core::mem::transmute::<SlotGuest, [u32; HALF_WORDS]>(*self) }
    }

    /// The half from the words it is stored as.
    pub fn from_words(w: &[u32; HALF_WORDS]) -> SlotGuest {
        // SAFETY: as to_words; every bit pattern is a valid SlotGuest.
        unsafe { core::mem::transmute::<[u32; HALF_WORDS], SlotGuest>(*w) }
    }
}

impl SlotHost {
    /// The half as the words it is stored as.
    pub fn to_words(&self) -> [u32; HALF_WORDS] {
        // SAFETY: SlotHost is #[repr(C)], 64 bytes of integers with no
        // padding (checked at compile time in lib.rs), so it is 16 words.
        unsafe { core::mem::transmute::<SlotHost, [u32; HALF_WORDS]>(*self) }
    }

    /// The half from the words it is stored as.
    pub fn from_words(w: &[u32; HALF_WORDS]) -> SlotHost {
        // SAFETY: as to_words; every bit pattern is a valid SlotHost.
        unsafe { core::mem::transmute::<[u32; HALF_WORDS], SlotHost>(*w) }
    }
}

/// Writes slot `index`'s guest half as the guest driver does; false if the
/// slot is not inside `m`.
pub fn write_guest<W: SharedWords + ?Sized>(m: &W, nr: u32, index: u32, g: &SlotGuest) -> bool {
    slot_in(m, nr, index)
        .map(|off| write_half(m, off, &g.to_words()))
        .is_some()
}

/// A consistent copy of slot `index`'s guest half (not clamped).
pub fn read_guest<W: SharedWords + ?Sized>(m: &W, nr: u32, index: u32) -> Option<SlotGuest> {
    let off = slot_in(m, nr, index)?;
    read_half(m, off).map(|w| SlotGuest::from_words(&w))
}

/// Writes slot `index`'s host half as the host does; false if the slot is
/// not inside `m`.
pub fn write_host<W: SharedWords + ?Sized>(m: &W, nr: u32, index: u32, h: &SlotHost) -> bool {
    slot_in(m, nr, index)
        .map(|off| write_half(m, off + HOST_HALF, &h.to_words()))
        .is_some()
}

/// A consistent copy of slot `index`'s host half, as the guest reads it.
pub fn read_host<W: SharedWords + ?Sized>(m: &W, nr: u32, index: u32) -> Option<SlotHost> {
    let off = slot_in(m, nr, index)?;
    read_half(m, off + HOST_HALF).map(|w| SlotHost::from_words(&w))
}

#[cfg(feature = "vm-memory")]
mod mapped;
#[cfg(feature = "vm-memory")]
pub use mapped::SharedRegion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_round_trip_through_a_mapping() {
        let mut mem = [0u32; 1024];
        // SAFETY: `mem` outlives `m` and is 4-byte aligned.
        let m = unsafe { RawWords::new(mem.as_mut_ptr().cast(), 4096) };
        let g = SlotGuest {
            nice: -5,
            updates: 1 << 40,
            ..Default::default()
        };
        assert!(write_guest(&m, 2, 1, &g));
        let back = read_guest(&m, 2, 1).expect("consistent");
        assert_eq!(back.seq, 2);
        assert_eq!(SlotGuest { seq: 0, ..back }, g);
        let h = SlotHost {
            boost: 2,
            ..Default::default()
        };
        assert!(write_host(&m, 2, 0, &h));
        assert_eq!(read_host(&m, 2, 0).expect("consistent").boost, 2);
        // Out of the mapping or of the region: refused, nothing written.
        assert!(!write_guest(&m, 2, 2, &g));
        assert!(!write_guest(&m, 200, 190, &g));
        // An odd seq (writer stuck mid-update) is never copied.
        let off = slot_offset(2, 0) as usize;
        m.store(off, 7, Ordering::Relaxed);
        assert_eq!(read_guest(&m, 2, 0), None);
    }
}
