//! The device process's command line, shared by `pvsched device` and the
//! standalone `pvsched-device` binary: parse [`DeviceArgs`], then [`main`].
//!
//! ```text
//! pvsched device --transport mpqemu --fd 3 --vcpus 2 [--apic-ids 0,1]
//! pvsched device --transport vfio-user --socket PATH --vcpus 2 [--apic-ids 0,1]
//!                [--fault wrong-magic|wrong-version|refuse-region]
//!                [--dump-slots PATH]
//! ```

use crate::fault::Fault;
use crate::run::{DeviceOptions, run_mpqemu, run_vfio_user};
use clap::{Args, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Transport the device speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    /// QEMU multi-process proxy (`-device x-pci-proxy-dev,fd=N`).
    Mpqemu,
    /// vfio-user server on `--socket PATH` (one client).
    VfioUser,
}

/// Injected misbehaviour (guest driver negative tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FaultArg {
    /// Answer a wrong MAGIC.
    WrongMagic,
    /// Answer a wrong major VERSION.
    WrongVersion,
    /// Refuse the guest region at DRIVER_OK.
    RefuseRegion,
}

impl From<FaultArg> for Fault {
    fn from(f: FaultArg) -> Self {
        match f {
            FaultArg::WrongMagic => Fault::WrongMagic,
            FaultArg::WrongVersion => Fault::WrongVersion,
            FaultArg::RefuseRegion => Fault::RefuseRegion,
        }
    }
}

/// Serve the pvsched device to a VMM, one VM per process.
#[derive(Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Transport to speak.
    #[arg(long, value_enum, default_value = "mpqemu")]
    pub transport: Transport,
    /// Inherited socket fd connected to the VMM (mpqemu).
    #[arg(long, required_if_eq("transport", "mpqemu"))]
    pub fd: Option<i32>,
    /// Socket path to bind and serve one client on (vfio-user; must not exist).
    #[arg(long, required_if_eq("transport", "vfio-user"))]
    pub socket: Option<PathBuf>,
    /// Number of vCPU slots.
    #[arg(long)]
    pub vcpus: u32,
    /// APIC ID of each slot, comma separated (default 0..vcpus).
    #[arg(long, value_delimiter = ',')]
    pub apic_ids: Option<Vec<u32>>,
    /// Misbehave on purpose (guest driver negative tests).
    #[arg(long, value_enum)]
    pub fault: Option<FaultArg>,
    /// Periodically write a JSON view of the region and handshake here.
    #[arg(long)]
    pub dump_slots: Option<PathBuf>,
    /// Slot sampling period in microseconds.
    #[arg(long, default_value_t = 500)]
    pub sample_us: u64,
    /// Dump file rewrite period in milliseconds.
    #[arg(long, default_value_t = 100)]
    pub dump_ms: u64,
}

impl DeviceArgs {
    /// The options of the device process.
    pub fn options(&self) -> DeviceOptions {
        DeviceOptions {
            fd: self.fd.unwrap_or(-1),
            vcpus: self.vcpus,
            apic_ids: self.apic_ids.clone(),
            fault: self.fault.map(Fault::from),
            dump_slots: self.dump_slots.clone(),
            sample_interval: Duration::from_micros(self.sample_us.max(50)),
            dump_interval: Duration::from_millis(self.dump_ms.max(10)),
        }
    }
}

/// Run the device process until the VMM goes; `name` prefixes messages.
pub fn main(name: &str, args: &DeviceArgs) -> ExitCode {
    let opts = args.options();
    let res = match (args.transport, &args.socket) {
        (Transport::VfioUser, Some(socket)) => run_vfio_user(socket, &opts),
        _ => run_mpqemu(&opts),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
    }
}
