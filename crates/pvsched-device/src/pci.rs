//! In-process PCI transport traits, shaped like crosvm's `PciDevice`.
//!
//! A transport (the reference VMM's PCI bus, the QEMU multi-process proxy,
//! a vfio-user server) owns a `Box<dyn PciDevice>` and forwards the guest's
//! configuration-space and BAR accesses to it. The trait carries no KVM or
//! socket types: BAR accesses are addressed by [`BarIndex`] and offset
//! inside the BAR, never by guest-physical address.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Index of a base address register, `0..=5`.
///
/// ```
/// use pvsched_device::BarIndex;
/// assert!(BarIndex(2).is_valid());
/// assert!(!BarIndex(6).is_valid());
/// assert_eq!(BarIndex(4).config_dword(), Some(8));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BarIndex(pub u8);

impl BarIndex {
    /// Number of BARs in a type-0 header.
    pub const COUNT: u8 = 6;

    /// Whether the index names one of the six type-0 BARs.
    pub fn is_valid(self) -> bool {
        self.0 < Self::COUNT
    }

    /// Configuration dword holding this BAR (`4 + index`), or `None` if invalid.
    pub fn config_dword(self) -> Option<usize> {
        self.is_valid().then(|| 4 + usize::from(self.0))
    }
}

impl fmt::Display for BarIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BAR{}", self.0)
    }
}

/// A BAR the device declares, with its current decoded address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BarInfo {
    /// Which BAR.
    pub index: BarIndex,
    /// Size in bytes, a power of two.
    pub size: u64,
    /// Whether the BAR is marked prefetchable (memory semantics, no side effects).
    pub prefetchable: bool,
    /// `Some(base)` only while the BAR is decoded: the guest programmed an
    /// address (not 0, not the all-ones sizing pattern) and COMMAND.MEMORY is set.
    pub address: Option<u64>,
}

/// A change of a BAR's decoded address caused by a configuration write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BarChange {
    /// Which BAR.
    pub index: BarIndex,
    /// Decoded address before the write.
    pub old: Option<u64>,
    /// Decoded address after the write.
    pub new: Option<u64>,
}

/// What a configuration write changed that the transport must act on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigWriteResult {
    /// Decoded BAR address changes (moves, enable, disable), in BAR order.
    pub bar_changes: Vec<BarChange>,
}

/// A PCI function as seen by a transport.
///
/// Required methods must never panic, whatever the guest writes: bad
/// accesses are logged (rate-limited) and ignored.
pub trait PciDevice: Send {
    /// Short name for logs.
    fn debug_label(&self) -> String;

    /// Read 32-bit configuration dword `reg_idx` (byte offset `reg_idx * 4`),
    /// `0..=63` for the 256-byte space. Out of range returns `0xffff_ffff`.
    fn read_config_register(&self, reg_idx: usize) -> u32;

    /// Write `data` (1, 2 or 4 bytes) at byte `offset` (`0..=3`) inside dword
    /// `reg_idx`, honouring the exact write masks (BAR sizing: write
    /// `0xffff_ffff`, read back the size mask ORed with the type bits).
    fn write_config_register(
        &mut self,
        reg_idx: usize,
        offset: u64,
        data: &[u8],
    ) -> ConfigWriteResult;

    /// Declared BARs with their current decoded address.
    fn bars(&self) -> Vec<BarInfo>;

    /// MMIO read at `offset` inside BAR `bar` into `data` (1, 2, 4 or 8 bytes).
    fn read_bar(&mut self, bar: BarIndex, offset: u64, data: &mut [u8]);

    /// MMIO write of `data` (1, 2, 4 or 8 bytes) at `offset` inside BAR `bar`.
    fn write_bar(&mut self, bar: BarIndex, offset: u64, data: &[u8]);

    /// File descriptors the device needs to keep open when sandboxed.
    fn keep_fds(&self) -> Vec<std::os::fd::RawFd> {
        Vec::new()
    }

    /// Called once the device runs inside its sandbox.
    fn on_sandboxed(&mut self) {}
}
