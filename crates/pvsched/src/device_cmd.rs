//! `pvsched device`: the device process (`pvsched_transport::cli`), plus
//! `--daemon-region NAME`: BAR2 is pvschedd's region map for VM NAME,
//! reserved before the VMM starts, so the policy reads the guest's slots
//! where the guest writes them (no copy, any context). For a QEMU started
//! by hand (a libvirt domain says `region="device"` in its metadata and the
//! libvirt hook runs `qemu-attach --libvirt` instead):
//!
//! ```text
//! pvsched device --transport vfio-user --socket /run/vm1.sock --vcpus 2 --daemon-region vm1 &
//! qemu-system-x86_64 ... -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/run/vm1.sock"}}' -pidfile /run/vm1.pid ...
//! pvsched qemu-attach --qmp /run/vm1.qmp --name vm1 --pid "$(cat /run/vm1.pid)" --device-region
//! ```

use crate::exit::Exit;
use clap::Args;
use pvsched_transport::cli::{DeviceArgs, Transport};
use std::os::fd::IntoRawFd;
use std::path::PathBuf;
use std::process::ExitCode;

/// `pvsched device`.
#[derive(Args, Debug)]
pub struct DeviceCmd {
    #[command(flatten)]
    args: DeviceArgs,
    /// Back BAR2 with pvschedd's region for VM NAME (vfio-user, device
    /// region; root): reserved now, given to the VM when `pvsched
    /// qemu-attach --device-region --name NAME` registers its vCPU
    /// threads. Instead of --bar2-fd.
    #[arg(long, value_name = "NAME", conflicts_with = "bar2_fd")]
    daemon_region: Option<String>,
    /// pvschedd's socket (with --daemon-region).
    #[arg(long, env = "PVSCHED_SOCKET", default_value = pvsched_daemon::config::DEFAULT_SOCKET)]
    daemon_socket: PathBuf,
}

/// Runs `pvsched device`.
pub fn main(mut cmd: DeviceCmd) -> ExitCode {
    if let Some(name) = &cmd.daemon_region {
        if cmd.args.transport != Transport::VfioUser {
            eprintln!(
                "pvsched device: --daemon-region needs --transport vfio-user (QEMU's proxy cannot map BAR2)"
            );
            return ExitCode::from(Exit::Usage as u8);
        }
        let reserved =
            pvsched_daemon::Client::connect(&cmd.daemon_socket).and_then(|mut c| c.reserve(name));
        match reserved {
            Ok((fd, len)) => {
                log::info!("BAR2 is pvschedd's region for VM {name} ({len} bytes)");
                // Owned by the device process from here (`--bar2-fd`).
                cmd.args.bar2_fd = Some(fd.into_raw_fd());
            }
            Err(e) => {
                eprintln!("pvsched device: reserving VM {name}'s region with pvschedd: {e}");
                return ExitCode::from(crate::daemon_cli::exit_for(&e) as u8);
            }
        }
    }
    pvsched_transport::cli::main("pvsched device", &cmd.args)
}
