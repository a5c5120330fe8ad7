//! PCI type-0 configuration space of the pvsched device.
//!
//! Layout (PCI Local Bus 3.0, §6.1), 256 bytes, no capabilities:
//!
//! | dword | contents | writable |
//! |---|---|---|
//! | 0 | vendor ID, device ID | no |
//! | 1 | command, status | command bits IO, MEMORY, BUS_MASTER, PARITY, SERR, INTX_DISABLE; status reads 0 |
//! | 2 | revision, class code 0x088000 | no |
//! | 3 | cache line size, latency timer, header type 0, BIST 0 | cache line size, latency timer |
//! | 4 | BAR0: 32-bit non-prefetchable memory, [`REG_BAR_SIZE`] bytes | address bits |
//! | 6 | BAR2: 32-bit prefetchable memory, `region_bar_size` bytes (only with `F_DEVICE_REGION`) | address bits |
//! | 5, 7, 8, 9 | absent BARs: read 0 | no |
//! | 11 | subsystem vendor ID, subsystem ID | no |
//! | 12 | expansion ROM: none, reads 0 | no |
//! | 15 | interrupt line, interrupt pin 0 (none), min_gnt 0, max_lat 0 | interrupt line |
//! | others | 0 | no |
//!
//! Writes of 1, 2 or 4 bytes at any offset inside a dword are merged into
//! the dword and then filtered through that dword's write mask, so BAR
//! sizing (write `0xffff_ffff`, read back) returns `!(size - 1) | type bits`
//! and absent BARs read back 0, exactly like hardware. QEMU's proxy forwards
//! guest configuration writes verbatim, so these masks are what the guest sees.

use crate::log_limit::{LogLimiter, warn_limited};
use crate::pci::{BarChange, BarIndex, BarInfo};
use pvsched_abi::{REG_BAR, REG_BAR_SIZE, REGION_BAR};
use serde::{Deserialize, Serialize};

/// Number of dwords in the configuration space.
pub const CONFIG_DWORDS: usize = 64;

/// COMMAND: I/O space enable.
pub const COMMAND_IO: u16 = 1 << 0;
/// COMMAND: memory space enable (BARs decode).
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// COMMAND: bus master enable.
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
/// COMMAND: parity error response.
pub const COMMAND_PARITY: u16 = 1 << 6;
/// COMMAND: SERR# enable.
pub const COMMAND_SERR: u16 = 1 << 8;
/// COMMAND: INTx emulation disable.
pub const COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// Writable COMMAND bits.
pub const COMMAND_WRITABLE: u16 = COMMAND_IO
    | COMMAND_MEMORY
    | COMMAND_BUS_MASTER
    | COMMAND_PARITY
    | COMMAND_SERR
    | COMMAND_INTX_DISABLE;

/// BAR type bit: prefetchable (bit 3 of a memory BAR).
pub const BAR_PREFETCHABLE: u32 = 1 << 3;

/// PCI identity of the device.
///
/// ```
/// use pvsched_device::PciIds;
/// let ids = PciIds::default();
/// assert_eq!(ids.vendor, pvsched_abi::PCI_VENDOR_ID);
/// assert_eq!(ids.device, pvsched_abi::PCI_DEVICE_ID);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciIds {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Subsystem vendor ID.
    pub subsys_vendor: u16,
    /// Subsystem ID.
    pub subsys: u16,
    /// Revision ID.
    pub revision: u8,
}

impl Default for PciIds {
    fn default() -> Self {
        Self {
            vendor: pvsched_abi::PCI_VENDOR_ID,
            device: pvsched_abi::PCI_DEVICE_ID,
            subsys_vendor: pvsched_abi::PCI_SUBSYS_VENDOR_ID,
            subsys: pvsched_abi::PCI_SUBSYS_ID,
            revision: pvsched_abi::PCI_REVISION,
        }
    }
}

/// The guest-writable part of the configuration space (what a snapshot holds).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigState {
    /// COMMAND register.
    pub command: u16,
    /// Raw BAR dwords (address bits only; type bits are added on read).
    pub bars: [u32; 6],
    /// Cache line size register.
    pub cache_line_size: u8,
    /// Latency timer register.
    pub latency_timer: u8,
    /// Interrupt line register.
    pub interrupt_line: u8,
}

/// Type-0 configuration space with exact write masks.
///
/// ```
/// use pvsched_device::config_space::ConfigSpace;
/// use pvsched_device::PciIds;
/// let mut cs = ConfigSpace::new(PciIds::default(), Some(8192));
/// cs.write(4, 0, &0xffff_ffffu32.to_le_bytes()); // size BAR0
/// assert_eq!(cs.read(4), 0xffff_f000);
/// cs.write(6, 0, &0xffff_ffffu32.to_le_bytes()); // size BAR2
/// assert_eq!(cs.read(6), 0xffff_e000 | 0x8);
/// ```
#[derive(Debug)]
pub struct ConfigSpace {
    ids: PciIds,
    /// Size of each declared BAR (0 = absent).
    bar_sizes: [u32; 6],
    /// Type bits of each declared BAR.
    bar_types: [u32; 6],
    state: ConfigState,
    bad_access: LogLimiter,
}

impl ConfigSpace {
    /// A configuration space with BAR0 (registers) and, if `region_bar_size`
    /// is `Some`, BAR2 of that size (a power of two, at least 4096, at most
    /// 2 GiB; anything else leaves BAR2 absent and is logged).
    pub fn new(ids: PciIds, region_bar_size: Option<u64>) -> Self {
        let mut bar_sizes = [0u32; 6];
        let mut bar_types = [0u32; 6];
        bar_sizes[usize::from(REG_BAR)] = REG_BAR_SIZE;
        if let Some(size) = region_bar_size {
            match u32::try_from(size) {
                Ok(s) if s.is_power_of_two() && (4096..=1 << 31).contains(&s) => {
                    bar_sizes[usize::from(REGION_BAR)] = s;
                    bar_types[usize::from(REGION_BAR)] = BAR_PREFETCHABLE;
                }
                _ => log::error!(
                    "pvsched: BAR2 size {size:#x} is not a 32-bit power of two >= 4096; BAR2 left absent"
                ),
            }
        }
        Self {
            ids,
            bar_sizes,
            bar_types,
            state: ConfigState::default(),
            bad_access: LogLimiter::new(),
        }
    }

    /// The guest-writable state.
    pub fn state(&self) -> &ConfigState {
        &self.state
    }

    /// Replace the guest-writable state (restore). Values are re-masked, so
    /// a corrupt snapshot cannot produce a state the guest could not write.
    pub fn set_state(&mut self, s: ConfigState) {
        let mut bars = [0u32; 6];
        for (i, b) in bars.iter_mut().enumerate() {
            *b = s.bars[i] & self.bar_mask(i);
        }
        self.state = ConfigState {
            command: s.command & COMMAND_WRITABLE,
            bars,
            ..s
        };
    }

    /// The PCI identity.
    pub fn ids(&self) -> PciIds {
        self.ids
    }

    /// COMMAND register.
    pub fn command(&self) -> u16 {
        self.state.command
    }

    fn bar_mask(&self, i: usize) -> u32 {
        match self.bar_sizes[i] {
            0 => 0,
            size => !(size - 1),
        }
    }

    /// Read dword `reg_idx`; out of range reads `0xffff_ffff`.
    pub fn read(&self, reg_idx: usize) -> u32 {
        let s = &self.state;
        match reg_idx {
            0 => u32::from(self.ids.device) << 16 | u32::from(self.ids.vendor),
            // Status: no capabilities, no error reporting: reads 0.
            1 => u32::from(s.command),
            2 => pvsched_abi::PCI_CLASS << 8 | u32::from(self.ids.revision),
            // BIST 0, header type 0 (single function).
            3 => u32::from(s.latency_timer) << 8 | u32::from(s.cache_line_size),
            4..=9 => {
                let i = reg_idx - 4;
                s.bars[i] | self.bar_types[i]
            }
            11 => u32::from(self.ids.subsys) << 16 | u32::from(self.ids.subsys_vendor),
            // Interrupt pin 0: the device has no interrupt.
            15 => u32::from(s.interrupt_line),
            _ if reg_idx < CONFIG_DWORDS => 0,
            _ => 0xffff_ffff,
        }
    }

    /// Write mask of dword `reg_idx` (bits the guest can change).
    fn write_mask(&self, reg_idx: usize) -> u32 {
        match reg_idx {
            1 => u32::from(COMMAND_WRITABLE),
            3 => 0x0000_ffff,
            4..=9 => self.bar_mask(reg_idx - 4),
            15 => 0x0000_00ff,
            _ => 0,
        }
    }

    /// Write `data` (1, 2 or 4 bytes) at byte `offset` in dword `reg_idx`.
    /// Returns the decoded-address changes of the BARs. Invalid accesses
    /// (bad index, offset or length) are logged and ignored.
    pub fn write(&mut self, reg_idx: usize, offset: u64, data: &[u8]) -> Vec<BarChange> {
        let len = data.len() as u64;
        let valid = reg_idx < CONFIG_DWORDS
            && matches!(len, 1 | 2 | 4)
            && offset.checked_add(len).is_some_and(|end| end <= 4);
        if !valid {
            warn_limited!(
                self.bad_access,
                "pvsched: ignoring config write dword {reg_idx} offset {offset} len {len}"
            );
            return Vec::new();
        }
        let shift = (offset * 8) as u32;
        let mut value = 0u32;
        for (i, b) in data.iter().enumerate() {
            value |= u32::from(*b) << (8 * i);
        }
        let byte_mask: u32 = if len == 4 {
            u32::MAX
        } else {
            ((1u32 << (8 * len)) - 1) << shift
        };
        let value = value.wrapping_shl(shift);
        let mask = byte_mask & self.write_mask(reg_idx);
        if mask == 0 {
            return Vec::new();
        }
        let before = self.decoded_all();
        let old = self.raw(reg_idx);
        let new = (old & !mask) | (value & mask);
        self.set_raw(reg_idx, new);
        let after = self.decoded_all();
        (0..6)
            .filter(|&i| before[i] != after[i])
            .map(|i| BarChange {
                index: BarIndex(i as u8),
                old: before[i],
                new: after[i],
            })
            .collect()
    }

    /// Stored value of a writable dword, without read-only type bits.
    fn raw(&self, reg_idx: usize) -> u32 {
        let s = &self.state;
        match reg_idx {
            1 => u32::from(s.command),
            3 => u32::from(s.latency_timer) << 8 | u32::from(s.cache_line_size),
            4..=9 => s.bars[reg_idx - 4],
            15 => u32::from(s.interrupt_line),
            _ => 0,
        }
    }

    fn set_raw(&mut self, reg_idx: usize, v: u32) {
        let s = &mut self.state;
        match reg_idx {
            1 => s.command = v as u16,
            3 => {
                s.cache_line_size = v as u8;
                s.latency_timer = (v >> 8) as u8;
            }
            4..=9 => s.bars[reg_idx - 4] = v,
            15 => s.interrupt_line = v as u8,
            _ => {}
        }
    }

    fn decoded_all(&self) -> [Option<u64>; 6] {
        std::array::from_fn(|i| self.decoded(i))
    }

    /// Decoded address of BAR `i`: programmed (not 0, not the sizing
    /// pattern) and COMMAND.MEMORY set.
    fn decoded(&self, i: usize) -> Option<u64> {
        let mask = self.bar_mask(i);
        let addr = self.state.bars[i] & mask;
        (mask != 0 && self.state.command & COMMAND_MEMORY != 0 && addr != 0 && addr != mask)
            .then_some(u64::from(addr))
    }

    /// Decoded address of BAR `bar` (see [`BarInfo::address`]).
    pub fn bar_address(&self, bar: BarIndex) -> Option<u64> {
        bar.is_valid()
            .then(|| self.decoded(usize::from(bar.0)))
            .flatten()
    }

    /// Address bits programmed in BAR `bar`, decoded or not (0 if absent).
    pub fn bar_programmed(&self, bar: BarIndex) -> u64 {
        bar.config_dword().map_or(0, |d| {
            u64::from(self.state.bars[d - 4] & self.bar_mask(d - 4))
        })
    }

    /// Size of BAR `bar`, or `None` if the device does not declare it.
    pub fn bar_size(&self, bar: BarIndex) -> Option<u64> {
        if !bar.is_valid() {
            return None;
        }
        match self.bar_sizes[usize::from(bar.0)] {
            0 => None,
            s => Some(u64::from(s)),
        }
    }

    /// Declared BARs.
    pub fn bars(&self) -> Vec<BarInfo> {
        (0..6)
            .filter(|&i| self.bar_sizes[i] != 0)
            .map(|i| BarInfo {
                index: BarIndex(i as u8),
                size: u64::from(self.bar_sizes[i]),
                prefetchable: self.bar_types[i] & BAR_PREFETCHABLE != 0,
                address: self.decoded(i),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cs() -> ConfigSpace {
        ConfigSpace::new(PciIds::default(), Some(4096))
    }

    #[test]
    fn identity() {
        let c = cs();
        assert_eq!(c.read(0), 0x5c4e_5056);
        assert_eq!(c.read(2), 0x0880_0001);
        assert_eq!(c.read(3) >> 16, 0, "header type 0");
        assert_eq!(c.read(11), 0x0001_5056);
        assert_eq!(c.read(15) >> 8 & 0xff, 0, "no interrupt pin");
        assert_eq!(c.read(64), 0xffff_ffff);
    }

    #[test]
    fn read_only_ignored() {
        let mut c = cs();
        for idx in [0, 2, 11, 12, 13, 20, 63] {
            let before = c.read(idx);
            assert!(c.write(idx, 0, &[0xff; 4]).is_empty());
            assert_eq!(c.read(idx), before, "dword {idx}");
        }
    }

    #[test]
    fn partial_writes_merge() {
        let mut c = cs();
        c.write(4, 1, &[0x12]); // BAR0 byte 1: bits 8..11 are size bits
        assert_eq!(c.read(4), 0x0000_1000);
        c.write(4, 2, &[0x34, 0x56]);
        assert_eq!(c.read(4), 0x5634_1000);
        c.write(1, 0, &[0x06, 0x00]);
        assert_eq!(c.read(1), 0x6);
        c.write(3, 0, &[0x10]);
        c.write(3, 1, &[0x20]);
        c.write(3, 2, &[0xff, 0xff]);
        assert_eq!(c.read(3), 0x2010);
        // bad offsets/lengths are ignored
        assert!(c.write(4, 3, &[1, 2]).is_empty());
        assert!(c.write(4, 0, &[1, 2, 3]).is_empty());
        assert!(c.write(4, u64::MAX, &[1]).is_empty());
        assert_eq!(c.read(4), 0x5634_1000);
    }
}
