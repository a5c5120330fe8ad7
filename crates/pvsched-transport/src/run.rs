//! The device process for one VM: build the device, serve it over a
//! transport, optionally dump the region for the host.

use crate::fault::{Fault, FaultyDevice};
use crate::monitor::Monitor;
use crate::mpqemu::{MpqemuError, MpqemuPeer};
use crate::slot_dump::{DumpError, SlotDumper};
use crate::vfio_user::{VfioUserDevice, VfioUserError, VfioUserServer, attach_bar2_backing};
use nix::sys::stat::{SFlag, fstat};
use pvsched_abi as abi;
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Errors of the device process.
#[derive(Debug, Error)]
pub enum RunError {
    /// The fd given is not an open UNIX socket.
    #[error(
        "fd {fd} is not an open socket ({why}); pass one end of a socketpair whose other end QEMU has"
    )]
    BadFd {
        /// The fd number.
        fd: RawFd,
        /// Why it was rejected.
        why: String,
    },
    /// The device configuration was refused.
    #[error("device configuration refused: {0}")]
    Device(#[source] pvsched_device::Error),
    /// The APIC-ID list does not match the vCPU count.
    #[error("{got} APIC IDs given for {vcpus} vCPUs; give exactly one per vCPU")]
    ApicIds {
        /// IDs given.
        got: usize,
        /// vCPUs.
        vcpus: u32,
    },
    /// The slot dumper failed to start.
    #[error(transparent)]
    Dump(#[from] DumpError),
    /// The transport failed.
    #[error(transparent)]
    Mpqemu(#[from] MpqemuError),
    /// The vfio-user transport failed.
    #[error(transparent)]
    VfioUser(#[from] VfioUserError),
}

/// Options of the device process.
#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// Socket fd (inherited) connected to QEMU.
    pub fd: RawFd,
    /// Number of vCPU slots.
    pub vcpus: u32,
    /// APIC ID per slot; `None` = 0..vcpus.
    pub apic_ids: Option<Vec<u32>>,
    /// Injected fault (driver negative tests).
    pub fault: Option<Fault>,
    /// Write a JSON view of the region here.
    pub dump_slots: Option<PathBuf>,
    /// How often to sample the slots.
    pub sample_interval: Duration,
    /// How often to rewrite the dump file.
    pub dump_interval: Duration,
}

/// Serve a pvsched device to QEMU's multi-process proxy on `opts.fd` until
/// QEMU closes the socket.
pub fn run_mpqemu(opts: &DeviceOptions) -> Result<(), RunError> {
    let st = fstat(opts.fd).map_err(|e| RunError::BadFd {
        fd: opts.fd,
        why: e.to_string(),
    })?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
        return Err(RunError::BadFd {
            fd: opts.fd,
            why: "not a socket".into(),
        });
    }
    // SAFETY: the fd is open (fstat succeeded), was handed to this process
    // for this purpose, and nothing else in the process owns it.
    let sock = UnixStream::from(unsafe { OwnedFd::from_raw_fd(opts.fd) });

    let mut cfg = device_config(opts)?;
    // QEMU's proxy cannot map device memory into the guest: no BAR2.
    cfg.features = abi::F_ALL & !abi::F_DEVICE_REGION;
    let dev = PvschedDevice::new(cfg, Arc::new(NullSink)).map_err(RunError::Device)?;
    let dev = FaultyDevice::new(dev, opts.fault);

    let monitor = Arc::new(Monitor::new());
    let _dumper = start_dumper(opts, &monitor)?;
    let mut peer = MpqemuPeer::new(sock, dev, monitor);
    peer.serve()?;
    Ok(())
}

fn device_config(opts: &DeviceOptions) -> Result<DeviceConfig, RunError> {
    let mut cfg = DeviceConfig::new(opts.vcpus);
    if let Some(ids) = &opts.apic_ids {
        if ids.len() != opts.vcpus as usize {
            return Err(RunError::ApicIds {
                got: ids.len(),
                vcpus: opts.vcpus,
            });
        }
        cfg.apic_ids = ids.clone();
    }
    Ok(cfg)
}

fn start_dumper(
    opts: &DeviceOptions,
    monitor: &Arc<Monitor>,
) -> Result<Option<SlotDumper>, RunError> {
    Ok(match &opts.dump_slots {
        Some(p) => Some(SlotDumper::start(
            monitor.clone(),
            p.clone(),
            opts.sample_interval,
            opts.dump_interval,
        )?),
        None => None,
    })
}

/// Serve a pvsched device (device and guest region modes) to one vfio-user
/// client on a socket bound at `socket` (which must not exist) until the
/// client disconnects. `opts.fd` is not used.
pub fn run_vfio_user(socket: &Path, opts: &DeviceOptions) -> Result<(), RunError> {
    let cfg = device_config(opts)?;
    let mut dev = PvschedDevice::new(cfg, Arc::new(NullSink)).map_err(RunError::Device)?;
    let bar2 = attach_bar2_backing(&mut dev)?;
    let dev = FaultyDevice::new(dev, opts.fault);
    let monitor = Arc::new(Monitor::new());
    let _dumper = start_dumper(opts, &monitor)?;
    let backend = VfioUserDevice::with_backing(dev, bar2, monitor);
    let mut server = VfioUserServer::bind(socket, backend)?;
    log::info!("vfio-user: serving on {}", socket.display());
    server.serve()?;
    Ok(())
}
