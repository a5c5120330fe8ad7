//! Transports that connect the socket-free pvsched device model
//! ([`pvsched_device`]) to a VMM in another process.
//!
//! - [`mpqemu`]: QEMU's multi-process proxy (`-device x-pci-proxy-dev`),
//!   QEMU 7.2–10.0; guest region mode only.
//! - [`vfio_user`]: a vfio-user server (rust-vmm `vfio_user` crate); device
//!   and guest region modes, BAR2 mmapable through its fd.
//!
//! Around them: [`events`] (the optional typed event channel to a VMM
//! that drives a policy sink, e.g. the reference VMM), [`backend::TransportDevice`] (what a transport needs from a
//! device), [`fault::FaultyDevice`] (injected misbehaviour for the guest
//! driver's negative tests), [`monitor::TransportMonitor`] (what the transport saw)
//! and [`slot_dump`] (a host-side JSON view of the region for tests).
//!
//! [`run_mpqemu`] and [`run_vfio_user`] are the whole device process
//! (setup, then [`sandbox`], then serving); the `pvsched-device` binary and
//! `pvsched device` wrap them through [`cli`].

pub mod backend;
pub mod cli;
pub mod events;
pub mod fault;
pub mod guest_ram;
pub mod monitor;
pub mod mpqemu;
pub mod run;
pub mod sandbox;
pub mod slot_dump;
pub mod vfio_user;

pub use run::{DeviceOptions, HostFlagsSink, RunError, run_mpqemu, run_vfio_user};

/// How long the rest of a message may take to arrive once its first byte
/// has, over either transport. A peer that sends part of a message and then
/// nothing is dropped after this, instead of holding the device in its read
/// for good (the region sampling goes on while it waits). Benign peers are
/// far inside it: QEMU sends each message with one `sendmsg`, the
/// `vfio_user` crate's client with two or three back-to-back writes; the
/// margin is for a VMM descheduled between two of them on a loaded host.
pub const MESSAGE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);
