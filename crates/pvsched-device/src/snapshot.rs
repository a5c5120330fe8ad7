//! Serialisable device state for snapshot/restore and migration.
//!
//! A [`DeviceSnapshot`] holds what the guest can observe or change: the
//! writable configuration space, the register file (including the
//! handshake state and GENERATION) and the identity the state belongs to.
//! It does not hold memory: the region's contents travel with guest RAM (or
//! with the device-region backing, which the embedder migrates). Restoring
//! re-validates the region against the memory the device has at that time.

use crate::config_space::{ConfigState, PciIds};
use crate::registers::RegisterState;
use serde::{Deserialize, Serialize};

/// Version of the snapshot format.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// Device state as serde data.
///
/// ```
/// use pvsched_device::{DeviceConfig, DeviceSnapshot, NullSink, PvschedDevice};
/// use std::sync::Arc;
/// let dev = PvschedDevice::new(DeviceConfig::new(4), Arc::new(NullSink)).unwrap();
/// let json = serde_json::to_string(&dev.snapshot()).unwrap();
/// let back: DeviceSnapshot = serde_json::from_str(&json).unwrap();
/// assert_eq!(back, dev.snapshot());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSnapshot {
    /// [`SNAPSHOT_FORMAT`] at the time of writing.
    pub format: u32,
    /// NR_VCPUS of the device the state came from.
    pub nr_vcpus: u32,
    /// Features that device offered.
    pub features: u64,
    /// Its PCI identity.
    pub ids: PciIds,
    /// Slot → APIC ID table.
    pub apic_ids: Vec<u32>,
    /// Writable configuration space.
    pub config: ConfigState,
    /// Register file and handshake state.
    pub registers: RegisterState,
}
