//! `pvsched` command line. Each subcommand lives in its own module; this
//! file only parses and dispatches.

mod attach;
mod compare;
mod daemon_cli;
mod device_cmd;
mod doctor;
mod exit;
mod man;
mod migrate;
mod monitor;
mod qemu_attach;
mod run;

use clap::{CommandFactory, Parser, Subcommand};

/// pvsched: paravirtualized scheduling hints between guest and host.
#[derive(Parser)]
#[command(name = "pvsched", version, about, after_help = exit::help(&exit::Exit::ALL))]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot the reference VMM with the test guest and measure a workload.
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Run(run::RunArgs),
    /// Serve the pvsched device to a VMM as its own (sandboxed) process.
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Device(device_cmd::DeviceCmd),
    /// pvschedd and every VM it serves: boosts, throttles, errors.
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Status(daemon_cli::StatusArgs),
    /// `status`, refreshed live, with boost rates.
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Top(daemon_cli::TopArgs),
    /// Change or end a VM's registration with pvschedd.
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Vm(daemon_cli::VmArgs),
    /// Register a running QEMU with pvschedd: a libvirt domain (through
    /// libvirt's own monitor; what the libvirt hook runs) or a QEMU's QMP
    /// socket.
    #[command(name = "qemu-attach", after_help = exit::help(&exit::Exit::ALL))]
    QemuAttach(qemu_attach::QemuAttachArgs),
    /// Give a running QEMU the pvsched device: start the sandboxed device
    /// process, hot-plug it, register the VM with pvschedd (root).
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Attach(attach::AttachArgs),
    /// Take the pvsched device away from a running QEMU: unregister the
    /// VM, unplug the device, stop its process (root).
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Detach(attach::DetachArgs),
    /// Live-migrate a QEMU with the pvsched device to a QEMU waiting with
    /// -incoming: detach, migrate, attach on the destination (or on the
    /// source again if the migration fails) (root).
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Migrate(migrate::MigrateArgs),
    /// pvschedd's Prometheus metrics (text exposition).
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Metrics(daemon_cli::MetricsArgs),
    /// Check whether this host can run pvsched: kernel, BTF, the BPF
    /// policy, RT bandwidth, QEMU, the libvirt hook, pvschedd and its VMs.
    #[command(after_help = exit::help(&exit::Exit::ALL))]
    Doctor(doctor::DoctorArgs),
    /// Write the manual pages of pvsched and pvschedd (for packagers).
    #[command(hide = true)]
    Man(man::ManArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run(args) => run::main(&args),
        Command::Status(args) => daemon_cli::status(&args),
        Command::Top(args) => daemon_cli::top(&args),
        Command::Vm(args) => daemon_cli::vm(&args),
        Command::Metrics(args) => daemon_cli::metrics(&args),
        Command::QemuAttach(args) => qemu_attach::main(&args),
        Command::Attach(args) => attach::attach(&args),
        Command::Detach(args) => attach::detach(&args),
        Command::Migrate(args) => migrate::migrate(&args),
        Command::Doctor(args) => doctor::main(&args),
        Command::Man(args) => man::main(&args, Cli::command()),
        Command::Device(cmd) => {
            pvsched_util::logging::init("info", pvsched_util::logging::Clock::Time);
            return device_cmd::main(cmd);
        }
    };
    std::process::ExitCode::from(code as u8)
}
