//! Port and MMIO dispatch for exits of the vCPU threads.
//!
//! Ports: PCI configuration mechanism #1 (0xCF8..=0xCFF), a COM1 stub whose
//! transmit register collects console bytes (0x3F8..=0x3FF), the debug
//! console port 0xE9 and the test guest's 32-bit event port. MMIO: the PCI
//! BARs that exit (BAR0 always; BAR2 only while it has no memslot).
//! Anything else reads as all-ones and is ignored on write.

use crate::guest::events::{DEBUG_PORT, EVENT_PORT, SERIAL_PORT};
use crate::monitor::GuestMonitor;
use crate::pci_root::{CONFIG_ADDRESS, PciRoot};
use std::sync::Arc;
use std::time::Instant;

/// COM1 line status: transmitter empty and holding register empty.
const LSR_IDLE: u8 = 0x60;
const SERIAL_LSR: u16 = SERIAL_PORT + 5;

/// Everything a vCPU thread dispatches exits to.
pub struct IoHub {
    /// PCI bus 0.
    pub pci: Arc<PciRoot>,
    /// Event and exit accounting.
    pub monitor: Arc<GuestMonitor>,
}

impl IoHub {
    /// `in` from `port` by `vcpu`.
    pub fn pio_read(&self, vcpu: u32, port: u16, data: &mut [u8]) {
        self.monitor.count_pio(vcpu);
        match port {
            CONFIG_ADDRESS..=0xcff => self.pci.pio_read(port, data),
            SERIAL_LSR => data.fill(LSR_IDLE),
            p if (SERIAL_PORT..SERIAL_PORT + 8).contains(&p) => data.fill(0),
            _ => data.fill(0xff),
        }
    }

    /// `out` to `port` by `vcpu`.
    pub fn pio_write(&self, vcpu: u32, port: u16, data: &[u8]) {
        self.monitor.count_pio(vcpu);
        match port {
            CONFIG_ADDRESS..=0xcff => self.pci.pio_write(port, data),
            SERIAL_PORT | DEBUG_PORT => {
                if let Some(b) = data.first() {
                    self.monitor.console_byte(*b);
                }
            }
            EVENT_PORT => match <[u8; 4]>::try_from(data) {
                Ok(v) => self.monitor.on_event(vcpu, u32::from_le_bytes(v)),
                Err(_) => log::debug!("vcpu {vcpu}: {}-byte write to the event port", data.len()),
            },
            _ => {}
        }
    }

    /// MMIO read at `addr` by `vcpu`.
    pub fn mmio_read(&self, vcpu: u32, addr: u64, data: &mut [u8]) {
        self.monitor.count_mmio(vcpu);
        let t0 = Instant::now();
        if self.pci.mmio_read(addr, data) {
            self.monitor.mmio_service(false, elapsed_ns(t0));
        } else {
            log::debug!("vcpu {vcpu}: MMIO read at {addr:#x} hits nothing");
        }
    }

    /// MMIO write at `addr` by `vcpu`.
    pub fn mmio_write(&self, vcpu: u32, addr: u64, data: &[u8]) {
        self.monitor.count_mmio(vcpu);
        let t0 = Instant::now();
        if self.pci.mmio_write(addr, data) {
            self.monitor.mmio_service(true, elapsed_ns(t0));
        } else {
            log::debug!("vcpu {vcpu}: MMIO write at {addr:#x} hits nothing");
        }
    }
}

fn elapsed_ns(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
