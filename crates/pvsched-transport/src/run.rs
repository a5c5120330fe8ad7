//! The device process for one VM: build the device, set up the transport,
//! enter the sandbox (unless `--no-sandbox`), serve, optionally dump the
//! region for the host.

use crate::events::{EventChannel, EventSink};
use crate::fault::{Fault, FaultyDevice, TestTrigger};
use crate::monitor::TransportMonitor;
use crate::mpqemu::{MpqemuError, MpqemuPeer};
use crate::sandbox::{DeviceSandbox, SandboxError};
use crate::slot_dump::{DumpError, SlotDumper};
use crate::vfio_user::{
    MAX_DMA_RANGES, VfioUserDevice, VfioUserError, VfioUserServer, attach_given_bar2_backing,
};
use nix::sys::stat::{SFlag, fstat};
use pvsched_abi as abi;
use pvsched_device::{DeviceConfig, PolicySink, PvschedDevice};
use pvsched_sandbox::SeccompProfile;
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
    /// The BAR2 backing fd given is not open, or BAR2 is not served here.
    #[error("--bar2-fd {fd}: {why}")]
    Bar2Fd {
        /// The fd number.
        fd: RawFd,
        /// Why it was rejected.
        why: String,
    },
    /// The event fd given is not a usable event socket.
    #[error("--event-fd {fd}: {why}")]
    EventFd {
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
    /// The sandbox could not be entered (the device did not serve).
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

/// The policy sink of the standalone device process: no policy in this
/// process, only the constant host flags the device reports in the region
/// header (`--host-flags`).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostFlagsSink(pub u32);

impl PolicySink for HostFlagsSink {
    fn host_flags(&self) -> u32 {
        self.0
    }
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
    /// `HOST_F_*` bits reported in the region header.
    pub host_flags: u32,
    /// Features offered; `None` = all of ABI v1 (over mpqemu without
    /// `F_DEVICE_REGION`, which QEMU's proxy cannot map).
    pub features: Option<u64>,
    /// Enter the sandbox before serving (default; `false` only to debug).
    pub sandbox: bool,
    /// Test-only trigger armed in the device.
    pub test_trigger: Option<TestTrigger>,
    /// Inherited fd backing BAR2 (vfio-user, device region), e.g. pvschedd's
    /// region map for this VM; `None`: a memfd of the device's own.
    pub bar2_fd: Option<RawFd>,
    /// Inherited `SOCK_SEQPACKET` socket on which the device reports what
    /// happens to the VMM that started it (vfio-user; see
    /// [`crate::events`]); `None`: no events (QEMU).
    pub event_fd: Option<RawFd>,
    /// vfio-user: give the socket to this uid and gid (mode 0600) before
    /// its path appears, for a VMM that runs as another user.
    pub socket_owner: Option<(u32, u32)>,
}

impl DeviceOptions {
    /// Defaults for `vcpus` slots: no fault, no dump, sandbox on.
    pub fn new(vcpus: u32) -> Self {
        DeviceOptions {
            fd: -1,
            vcpus,
            apic_ids: None,
            fault: None,
            dump_slots: None,
            sample_interval: Duration::from_micros(500),
            dump_interval: Duration::from_millis(100),
            host_flags: 0,
            features: None,
            sandbox: true,
            test_trigger: None,
            bar2_fd: None,
            event_fd: None,
            socket_owner: None,
        }
    }
}

/// Serve a pvsched device to QEMU's multi-process proxy on `opts.fd` until
/// QEMU closes the socket.
pub fn run_mpqemu(opts: &DeviceOptions) -> Result<(), RunError> {
    if let Some(fd) = opts.bar2_fd {
        return Err(RunError::Bar2Fd {
            fd,
            why: "QEMU's proxy (mpqemu) cannot map BAR2; use --transport vfio-user".into(),
        });
    }
    if let Some(fd) = opts.event_fd {
        return Err(RunError::EventFd {
            fd,
            why: "events are sent over vfio-user only (QEMU's proxy has no use for them)".into(),
        });
    }
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
    if cfg.features & abi::F_DEVICE_REGION != 0 {
        if opts.features.is_some() {
            log::warn!("mpqemu: F_DEVICE_REGION is not offered over QEMU's proxy; dropped");
        }
        cfg.features &= !abi::F_DEVICE_REGION;
    }
    let dev = PvschedDevice::new(cfg, Arc::new(HostFlagsSink(opts.host_flags)))
        .map_err(RunError::Device)?;
    let dev = FaultyDevice::new(dev, opts.fault).with_test_trigger(opts.test_trigger);

    let monitor = Arc::new(TransportMonitor::new());
    let dumper = open_dumper(opts)?;
    let mut keep = vec![opts.fd];
    keep.extend(dumper.as_ref().map(SlotDumper::fd));
    let mut peer = MpqemuPeer::new(sock, dev, monitor);
    if let Some(d) = dumper {
        peer.set_dumper(d);
    }
    if opts.sandbox {
        DeviceSandbox {
            keep_fds: keep,
            profile: SeccompProfile::DeviceMpqemu,
            accept_fd: None,
            // SYNC_SYSMEM: up to 8 new fds while the previous 8 are still
            // mapped, plus the two interrupt eventfds.
            nofile_margin: 64,
            writes_dump: opts.dump_slots.is_some(),
        }
        .enter()?;
    } else {
        log::warn!("mpqemu: --no-sandbox: serving UNSANDBOXED (debugging only)");
    }
    peer.serve()?;
    Ok(())
}

fn device_config(opts: &DeviceOptions) -> Result<DeviceConfig, RunError> {
    let mut cfg = DeviceConfig::new(opts.vcpus);
    if let Some(f) = opts.features {
        cfg.features = f;
    }
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

/// Takes ownership of the inherited fd `fd` (`--bar2-fd`) after checking
/// that it is open.
fn inherited_file(fd: RawFd) -> Result<std::fs::File, RunError> {
    fstat(fd).map_err(|e| RunError::Bar2Fd {
        fd,
        why: format!("not an open fd ({e})"),
    })?;
    if fd <= 2 {
        return Err(RunError::Bar2Fd {
            fd,
            why: "stdin/stdout/stderr cannot back BAR2".into(),
        });
    }
    // SAFETY: the fd is open (fstat succeeded), was handed to this process
    // to back BAR2, and nothing else in the process owns it.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Takes ownership of the inherited socket `fd` (`--event-fd`) after
/// checking that it is an open socket other than stdin/stdout/stderr.
fn inherited_socket(fd: RawFd) -> Result<OwnedFd, RunError> {
    let bad = |why: String| RunError::EventFd { fd, why };
    let st = fstat(fd).map_err(|e| bad(format!("not an open fd ({e})")))?;
    if fd <= 2 || SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
        return Err(bad("not a socket other than stdin/stdout/stderr".into()));
    }
    // SAFETY: the fd is open (fstat succeeded), was handed to this process
    // for its events, and nothing else in the process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_dumper(opts: &DeviceOptions) -> Result<Option<SlotDumper>, RunError> {
    Ok(match &opts.dump_slots {
        Some(p) => Some(SlotDumper::open(
            p,
            opts.sample_interval,
            opts.dump_interval,
        )?),
        None => None,
    })
}

/// Serve a pvsched device (device and guest region modes) to one vfio-user
/// client on a socket bound at `socket` (which must not exist) until the
/// client disconnects. `opts.fd` is not used.
///
/// The path is removed once the client's connection is pending; the
/// sandbox is entered then, before the first message is read.
pub fn run_vfio_user(socket: &Path, opts: &DeviceOptions) -> Result<(), RunError> {
    let cfg = device_config(opts)?;
    let (sink, events): (Arc<dyn PolicySink>, _) = match opts.event_fd {
        Some(fd) => {
            let sink = Arc::new(EventSink::new(opts.host_flags));
            let ch = EventChannel::new(inherited_socket(fd)?, sink.clone()).map_err(|e| {
                RunError::EventFd {
                    fd,
                    why: e.to_string(),
                }
            })?;
            (sink, Some(ch))
        }
        None => (Arc::new(HostFlagsSink(opts.host_flags)), None),
    };
    let mut dev = PvschedDevice::new(cfg, sink).map_err(RunError::Device)?;
    let given = opts.bar2_fd.map(inherited_file).transpose()?;
    let bar2 = attach_given_bar2_backing(&mut dev, given)?;
    let dev = FaultyDevice::new(dev, opts.fault).with_test_trigger(opts.test_trigger);
    let monitor = Arc::new(TransportMonitor::new());
    let mut backend = VfioUserDevice::with_backing(dev, bar2, monitor);
    if let Some(ch) = events {
        backend.set_event_channel(ch);
    }
    if let Some(d) = open_dumper(opts)? {
        backend.set_dumper(d);
    }
    let mut server = VfioUserServer::bind_for(socket, backend, opts.socket_owner)?;
    log::info!("vfio-user: listening on {}", socket.display());
    server.wait_for_client()?;
    if opts.sandbox {
        DeviceSandbox {
            keep_fds: server.fds(),
            profile: SeccompProfile::DeviceVfioUser,
            accept_fd: Some(server.listener_fd()),
            // The connection, one fd per DMA range, and room to spare.
            nofile_margin: MAX_DMA_RANGES as u64 + 16,
            writes_dump: opts.dump_slots.is_some(),
        }
        .enter()?;
    } else {
        log::warn!("vfio-user: --no-sandbox: serving UNSANDBOXED (debugging only)");
    }
    server.serve()?;
    Ok(())
}
