//! The PCI host bridge at 00:00.0: identity only, no BARs, writes ignored.

use pvsched_device::{BarIndex, BarInfo, ConfigWriteResult, PciDevice};

/// Vendor ID (Intel) and device ID (440FX host bridge), what guests expect.
const VENDOR_DEVICE: u32 = 0x1237_8086;
/// Class 0x06 (bridge), subclass 0x00 (host bridge).
const CLASS_REVISION: u32 = 0x0600_0000;

/// A host bridge that only identifies itself.
#[derive(Debug, Default)]
pub struct HostBridge;

impl PciDevice for HostBridge {
    fn debug_label(&self) -> String {
        "host bridge".to_owned()
    }

    fn read_config_register(&self, reg_idx: usize) -> u32 {
        match reg_idx {
            0 => VENDOR_DEVICE,
            2 => CLASS_REVISION,
            1..=63 => 0,
            _ => u32::MAX,
        }
    }

    fn write_config_register(&mut self, _: usize, _: u64, _: &[u8]) -> ConfigWriteResult {
        ConfigWriteResult::default()
    }

    fn bars(&self) -> Vec<BarInfo> {
        Vec::new()
    }

    fn read_bar(&mut self, _: BarIndex, _: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write_bar(&mut self, _: BarIndex, _: u64, _: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifies_as_a_host_bridge() {
        let b = HostBridge;
        assert_eq!(b.read_config_register(0), 0x1237_8086);
        assert_eq!(b.read_config_register(2) >> 24, 0x06);
        assert_eq!(b.read_config_register(64), u32::MAX);
        assert!(b.bars().is_empty());
    }
}
