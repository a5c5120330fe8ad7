//! PCI bus 0 with configuration mechanism #1 (ports 0xCF8/0xCFC) and BAR
//! decoding for MMIO dispatch.
//!
//! The bus holds [`PciDevice`]s by device number (function 0 each). After
//! every configuration write the function's decoded BARs are re-read; BAR
//! address changes the device reports (`ConfigWriteResult::bar_changes`)
//! move the BAR's memslot when the BAR is backed by memory
//! ([`BarMemslot`]). MMIO accesses that exit are matched against the
//! decoded BARs and forwarded to `read_bar`/`write_bar`; accesses nothing
//! decodes read as all-ones and are ignored on write (logged).

use crate::memslot::BarMemslot;
use pvsched_device::{BarIndex, PciDevice};
use std::sync::{Arc, Mutex, RwLock};

/// CONFIG_ADDRESS port.
pub const CONFIG_ADDRESS: u16 = 0xcf8;
/// CONFIG_DATA port (4 bytes, 0xCFC..=0xCFF).
pub const CONFIG_DATA: u16 = 0xcfc;
const ENABLE: u32 = 0x8000_0000;

/// A PCI function shared between the bus and its owner.
pub type SharedDevice = Arc<Mutex<dyn PciDevice>>;

#[derive(Clone, Copy, Debug)]
struct Decoded {
    base: u64,
    size: u64,
    func: usize,
    bar: BarIndex,
}

struct Function {
    device_number: u8,
    device: SharedDevice,
    memslots: Vec<(BarIndex, Arc<BarMemslot>)>,
}

/// Bus 0.
pub struct PciRoot {
    address: Mutex<u32>,
    functions: Vec<Function>,
    decoded: RwLock<Vec<Decoded>>,
}

use pvsched_util::lock;

impl Default for PciRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl PciRoot {
    /// An empty bus.
    pub fn new() -> Self {
        Self {
            address: Mutex::new(0),
            functions: Vec::new(),
            decoded: RwLock::new(Vec::new()),
        }
    }

    /// Add `device` as `00:<device_number>.0`; `memslots` back some of its BARs.
    pub fn add(
        &mut self,
        device_number: u8,
        device: SharedDevice,
        memslots: Vec<(BarIndex, Arc<BarMemslot>)>,
    ) {
        self.functions.push(Function {
            device_number: device_number & 0x1f,
            device,
            memslots,
        });
        self.refresh_decode();
    }

    fn find(&self, device_number: u8) -> Option<usize> {
        self.functions
            .iter()
            .position(|f| f.device_number == device_number)
    }

    fn refresh_decode(&self) {
        let mut table = Vec::new();
        for (func, f) in self.functions.iter().enumerate() {
            for bar in lock(&f.device).bars() {
                if let Some(base) = bar.address {
                    table.push(Decoded {
                        base,
                        size: bar.size,
                        func,
                        bar: bar.index,
                    });
                }
            }
        }
        *pvsched_util::write(&self.decoded) = table;
    }

    /// Read config dword `reg` of `00:<device_number>.0` (all-ones if absent).
    pub fn config_read(&self, device_number: u8, reg: usize) -> u32 {
        match self.find(device_number) {
            Some(i) => lock(&self.functions[i].device).read_config_register(reg),
            None => u32::MAX,
        }
    }

    /// Write config bytes at `reg`/`offset` of `00:<device_number>.0`, moving
    /// memslots as the device's BARs move.
    pub fn config_write(&self, device_number: u8, reg: usize, offset: u64, data: &[u8]) {
        let Some(i) = self.find(device_number) else {
            return;
        };
        let f = &self.functions[i];
        let result = lock(&f.device).write_config_register(reg, offset, data);
        for change in &result.bar_changes {
            if let Some((_, slot)) = f.memslots.iter().find(|(b, _)| *b == change.index)
                && let Err(e) = slot.move_to(change.new)
            {
                log::warn!("{} {}: {e}", lock(&f.device).debug_label(), change.index);
            }
        }
        self.refresh_decode();
    }

    /// Registers the memslots of `00:<device_number>.0` where its BARs
    /// decode now: after its configuration space was restored from a
    /// snapshot rather than written by the guest.
    pub fn sync_memslots(&self, device_number: u8) -> Result<(), crate::memslot::Error> {
        let Some(i) = self.find(device_number) else {
            return Ok(());
        };
        let f = &self.functions[i];
        let bars = lock(&f.device).bars();
        for (index, slot) in &f.memslots {
            let at = bars
                .iter()
                .find(|b| b.index == *index)
                .and_then(|b| b.address);
            slot.move_to(at)?;
        }
        self.refresh_decode();
        Ok(())
    }

    fn decode_address(&self, address: u32) -> Option<(u8, usize, u64)> {
        if address & ENABLE == 0 {
            return None;
        }
        let bus = (address >> 16) & 0xff;
        let function = (address >> 8) & 0x7;
        if bus != 0 || function != 0 {
            return None;
        }
        let device = ((address >> 11) & 0x1f) as u8;
        let reg = ((address >> 2) & 0x3f) as usize;
        Some((device, reg, 0))
    }

    /// Port read inside 0xCF8..=0xCFF.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        if port == CONFIG_ADDRESS && data.len() == 4 {
            data.copy_from_slice(&lock(&self.address).to_le_bytes());
            return;
        }
        data.fill(0xff);
        let Some(offset) = port.checked_sub(CONFIG_DATA) else {
            return;
        };
        let address = *lock(&self.address);
        let Some((device, reg, _)) = self.decode_address(address) else {
            return;
        };
        let value = self.config_read(device, reg).to_le_bytes();
        let start = usize::from(offset);
        for (i, b) in data.iter_mut().enumerate() {
            if let Some(v) = value.get(start + i) {
                *b = *v;
            }
        }
    }

    /// Port write inside 0xCF8..=0xCFF.
    pub fn pio_write(&self, port: u16, data: &[u8]) {
        if port == CONFIG_ADDRESS {
            if let Ok(bytes) = <[u8; 4]>::try_from(data) {
                *lock(&self.address) = u32::from_le_bytes(bytes);
            }
            return;
        }
        let Some(offset) = port.checked_sub(CONFIG_DATA) else {
            return;
        };
        if usize::from(offset) + data.len() > 4 {
            log::debug!("config data write crosses the dword at {port:#x}");
            return;
        }
        let address = *lock(&self.address);
        if let Some((device, reg, _)) = self.decode_address(address) {
            self.config_write(device, reg, u64::from(offset), data);
        }
    }

    fn find_bar(&self, addr: u64, len: usize) -> Option<(Decoded, u64)> {
        let table = pvsched_util::read(&self.decoded);
        table.iter().find_map(|d| {
            let off = addr.checked_sub(d.base)?;
            let end = off.checked_add(len as u64)?;
            (end <= d.size).then_some((*d, off))
        })
    }

    /// MMIO read that exited to the VMM. Returns whether a BAR decoded it.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find_bar(addr, data.len()) {
            Some((d, off)) => {
                lock(&self.functions[d.func].device).read_bar(d.bar, off, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// MMIO write that exited to the VMM. Returns whether a BAR decoded it.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find_bar(addr, data.len()) {
            Some((d, off)) => {
                lock(&self.functions[d.func].device).write_bar(d.bar, off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_bridge::HostBridge;
    use pvsched_abi as abi;
    use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};

    fn bus() -> PciRoot {
        let mut pci = PciRoot::new();
        pci.add(0, Arc::new(Mutex::new(HostBridge)), Vec::new());
        let dev = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).unwrap();
        pci.add(1, Arc::new(Mutex::new(dev)), Vec::new());
        pci
    }

    fn cfg_read(pci: &PciRoot, dev: u32, reg: u32) -> u32 {
        pci.pio_write(CONFIG_ADDRESS, &(ENABLE | dev << 11 | reg).to_le_bytes());
        let mut d = [0u8; 4];
        pci.pio_read(CONFIG_DATA, &mut d);
        u32::from_le_bytes(d)
    }

    #[test]
    fn mechanism_one_finds_both_functions() {
        let pci = bus();
        assert_eq!(cfg_read(&pci, 0, 0), 0x1237_8086);
        let id = u32::from(abi::PCI_DEVICE_ID) << 16 | u32::from(abi::PCI_VENDOR_ID);
        assert_eq!(cfg_read(&pci, 1, 0), id);
        assert_eq!(cfg_read(&pci, 7, 0), u32::MAX, "empty slot");
        // Function 1 and bus 1 are empty; without the enable bit nothing decodes.
        pci.pio_write(CONFIG_ADDRESS, &(ENABLE | 1 << 11 | 1 << 8).to_le_bytes());
        let mut d = [0u8; 4];
        pci.pio_read(CONFIG_DATA, &mut d);
        assert_eq!(u32::from_le_bytes(d), u32::MAX);
        pci.pio_write(CONFIG_ADDRESS, &(1u32 << 11).to_le_bytes());
        pci.pio_read(CONFIG_DATA, &mut d);
        assert_eq!(u32::from_le_bytes(d), u32::MAX);
        // Byte reads at 0xCFE give the device ID's bytes.
        pci.pio_write(CONFIG_ADDRESS, &(ENABLE | 1 << 11).to_le_bytes());
        let mut b = [0u8; 2];
        pci.pio_read(CONFIG_DATA + 2, &mut b);
        assert_eq!(u16::from_le_bytes(b), abi::PCI_DEVICE_ID);
        // A read crossing the dword does not panic.
        let mut w = [0u8; 4];
        pci.pio_read(CONFIG_DATA + 3, &mut w);
    }

    #[test]
    fn mmio_reaches_bar0_once_decoded() {
        let pci = bus();
        let mut d = [0u8; 4];
        assert!(!pci.mmio_read(0xc000_0000, &mut d), "nothing decoded yet");
        assert_eq!(d, [0xff; 4]);
        pci.config_write(1, 4, 0, &0xc000_0000u32.to_le_bytes());
        pci.config_write(1, 1, 0, &2u16.to_le_bytes());
        assert!(pci.mmio_read(0xc000_0000 + u64::from(abi::REG_MAGIC), &mut d));
        assert_eq!(u32::from_le_bytes(d), abi::MAGIC);
        // Past the end of BAR0, and an access straddling its end.
        assert!(!pci.mmio_read(0xc000_1000, &mut d));
        assert!(!pci.mmio_write(0xc000_0ffe, &[0; 4]));
        assert!(!pci.mmio_read(u64::MAX - 1, &mut d));
    }
}
