//! `pvsched-device`: the pvsched PCI device as its own process, served to a
//! VMM over a socket transport: QEMU's multi-process proxy on an inherited
//! fd, or a vfio-user server on a socket path.
//!
//! ```text
//! pvsched-device --transport mpqemu --fd 3 --vcpus 2 [--apic-ids 0,1]
//! pvsched-device --transport vfio-user --socket PATH --vcpus 2 [--apic-ids 0,1]
//!                [--fault wrong-magic|wrong-version|refuse-region]
//!                [--dump-slots PATH]
//! ```

use clap::{Parser, ValueEnum};
use pvsched_transport::fault::Fault;
use pvsched_transport::run::run_vfio_user;
use pvsched_transport::{DeviceOptions, run_mpqemu};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Transport {
    /// QEMU multi-process proxy (`-device x-pci-proxy-dev,fd=N`).
    Mpqemu,
    /// vfio-user server on `--socket PATH` (one client).
    VfioUser,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FaultArg {
    /// Answer a wrong MAGIC.
    WrongMagic,
    /// Answer a wrong major VERSION.
    WrongVersion,
    /// Refuse the guest region at DRIVER_OK.
    RefuseRegion,
}

/// Serve the pvsched device to a VMM.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Transport to speak on --fd.
    #[arg(long, value_enum, default_value = "mpqemu")]
    transport: Transport,
    /// Inherited socket fd connected to the VMM (mpqemu).
    #[arg(long, required_if_eq("transport", "mpqemu"))]
    fd: Option<i32>,
    /// Socket path to bind and serve one client on (vfio-user; must not exist).
    #[arg(long, required_if_eq("transport", "vfio-user"))]
    socket: Option<PathBuf>,
    /// Number of vCPU slots.
    #[arg(long)]
    vcpus: u32,
    /// APIC ID of each slot, comma separated (default 0..vcpus).
    #[arg(long, value_delimiter = ',')]
    apic_ids: Option<Vec<u32>>,
    /// Misbehave on purpose (guest driver negative tests).
    #[arg(long, value_enum)]
    fault: Option<FaultArg>,
    /// Periodically write a JSON view of the region and handshake here.
    #[arg(long)]
    dump_slots: Option<PathBuf>,
    /// Slot sampling period in microseconds.
    #[arg(long, default_value_t = 500)]
    sample_us: u64,
    /// Dump file rewrite period in milliseconds.
    #[arg(long, default_value_t = 100)]
    dump_ms: u64,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let a = Args::parse();
    let opts = DeviceOptions {
        fd: a.fd.unwrap_or(-1),
        vcpus: a.vcpus,
        apic_ids: a.apic_ids,
        fault: a.fault.map(|f| match f {
            FaultArg::WrongMagic => Fault::WrongMagic,
            FaultArg::WrongVersion => Fault::WrongVersion,
            FaultArg::RefuseRegion => Fault::RefuseRegion,
        }),
        dump_slots: a.dump_slots,
        sample_interval: Duration::from_micros(a.sample_us.max(50)),
        dump_interval: Duration::from_millis(a.dump_ms.max(10)),
    };
    let res = match (a.transport, &a.socket) {
        (Transport::VfioUser, Some(socket)) => run_vfio_user(socket, &opts),
        _ => run_mpqemu(&opts),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pvsched-device: {e}");
            ExitCode::FAILURE
        }
    }
}
