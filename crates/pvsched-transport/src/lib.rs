//! Transports that connect the socket-free pvsched device model
//! ([`pvsched_device`]) to a VMM in another process.
//!
//! - [`mpqemu`]: QEMU's multi-process proxy (`-device x-pci-proxy-dev`),
//!   QEMU 7.2–10.0; guest region mode only.
//!
//! Around them: [`backend::TransportDevice`] (what a transport needs from a
//! device), [`fault::FaultyDevice`] (injected misbehaviour for the guest
//! driver's negative tests), [`monitor::Monitor`] (what the transport saw)
//! and [`slot_dump`] (a host-side JSON view of the region for tests).
//! [`run_mpqemu`] is the whole device process; the `pvsched-device` binary
//! and `pvsched device` wrap it through [`cli`].

pub mod backend;
pub mod cli;
pub mod fault;
pub mod monitor;
pub mod mpqemu;
pub mod run;
pub mod slot_dump;
pub mod vfio_user;

pub use run::{DeviceOptions, RunError, run_mpqemu};
