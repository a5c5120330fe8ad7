//! What a transport needs from a device beyond [`PciDevice`]: guest memory,
//! reset and a read-only view for monitoring.
//!
//! Implemented for [`PvschedDevice`] and for the fault-injecting wrapper
//! ([`crate::fault::FaultyDevice`]); transports are generic over it so
//! tests can drive them with either.

use pvsched_abi as abi;
use pvsched_device::registers::RegisterState;
use pvsched_device::{BarIndex, PciDevice, PvschedDevice, RegionView};
use vm_memory::GuestMemoryMmap;

/// A PCI device a socket transport can serve.
pub trait TransportDevice: PciDevice {
    /// Replace guest RAM (QEMU SYNC_SYSMEM).
    fn set_guest_memory(&mut self, mem: GuestMemoryMmap);
    /// Function-level reset (QEMU DEVICE_RESET).
    fn reset(&mut self);
    /// Current STATUS register.
    fn status(&self) -> u32;
    /// Current ERROR register.
    fn error(&self) -> u32;
    /// GENERATION register.
    fn generation(&self) -> u32;
    /// View onto the attached region, if any.
    fn region_view(&self) -> Option<RegionView>;
    /// The register file (what the event channel reports with each event).
    fn registers(&self) -> RegisterState;
}

impl TransportDevice for PvschedDevice {
    fn set_guest_memory(&mut self, mem: GuestMemoryMmap) {
        PvschedDevice::set_guest_memory(self, mem);
    }

    fn reset(&mut self) {
        // The device model has no separate reset entry point: writing 0 to
        // STATUS is the ABI's reset (detaches the region, clears the
        // handshake registers). Configuration space is left to QEMU, which
        // reprograms it after a system reset.
        self.write_bar(
            BarIndex(abi::REG_BAR),
            u64::from(abi::REG_STATUS),
            &abi::STATUS_RESET.to_le_bytes(),
        );
    }

    fn status(&self) -> u32 {
        PvschedDevice::status(self)
    }

    fn error(&self) -> u32 {
        PvschedDevice::error(self)
    }

    fn generation(&self) -> u32 {
        PvschedDevice::generation(self)
    }

    fn region_view(&self) -> Option<RegionView> {
        PvschedDevice::region_view(self)
    }

    fn registers(&self) -> RegisterState {
        self.snapshot().registers
    }
}
