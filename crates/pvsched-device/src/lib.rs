//! The pvsched PCI device model, transport-agnostic.
//!
//! The device lets a guest driver negotiate (virtio-like STATUS handshake,
//! 64-bit features) a shared region of per-vCPU slots with the host, either
//! in BAR2 (device region mode) or in guest RAM (guest region mode), and
//! reports what happens to a [`PolicySink`]. The ABI is defined in
//! `include/pvsched_abi.h` (Rust mirror: [`pvsched_abi`]); `docs/abi.md` is
//! the prose specification.
//!
//! This crate has no KVM and no sockets: a transport (in-process bus,
//! vfio-user, QEMU's multi-process proxy) drives a [`PvschedDevice`]
//! through the [`PciDevice`] trait, hands it guest memory as a
//! `vm_memory::GuestMemoryMmap` and, for device region mode, the BAR2
//! backing as an `Arc<vm_memory::MmapRegion>`.
//!
//! Nothing the guest writes (configuration space, registers, region bytes)
//! can make the device panic; see the property test
//! `tests/integration/proptest_sequences.rs` and the fuzz target in `fuzz/`.
//!
//! ```
//! use pvsched_abi as abi;
//! use pvsched_device::{BarIndex, DeviceConfig, NullSink, PciDevice, PvschedDevice};
//! use std::sync::Arc;
//!
//! let mut dev = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).unwrap();
//! let mut buf = [0u8; 4];
//! dev.read_bar(BarIndex(0), u64::from(abi::REG_MAGIC), &mut buf);
//! assert_eq!(u32::from_le_bytes(buf), abi::MAGIC);
//! ```

pub mod config_space;
mod device;
pub mod event;
mod log_limit;
pub mod pci;
pub mod region;
pub mod registers;
mod sink;
pub mod snapshot;
#[doc(hidden)]
pub mod testing;

pub use config_space::PciIds;
pub use device::{DeviceConfig, Error, PvschedDevice};
pub use pci::{BarChange, BarIndex, BarInfo, ConfigWriteResult, PciDevice};
pub use region::{GuestSlotState, RegionInfo, RegionMode, RegionView, SlotError};
pub use sink::{NullSink, PolicySink};
pub use snapshot::DeviceSnapshot;
