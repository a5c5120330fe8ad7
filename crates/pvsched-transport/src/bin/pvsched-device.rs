//! `pvsched-device`: the pvsched PCI device as its own process, served to a
//! VMM over a socket transport: QEMU's multi-process proxy on an inherited
//! fd, or a vfio-user server on a socket path. Same arguments as
//! `pvsched device` (see [`pvsched_transport::cli`]).

use clap::Parser;
use pvsched_transport::cli::DeviceArgs;
use std::process::ExitCode;

/// Serve the pvsched device to a VMM.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    args: DeviceArgs,
}

fn main() -> ExitCode {
    pvsched_util::logging::init("info", pvsched_util::logging::Clock::Time);
    let cli = Cli::parse();
    pvsched_transport::cli::main("pvsched-device", &cli.args)
}
