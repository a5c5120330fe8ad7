//! The device process's command line, shared by `pvsched device` and the
//! standalone `pvsched-device` binary: parse [`DeviceArgs`], then [`main`].
//!
//! ```text
//! pvsched device --transport mpqemu --fd 3 --vcpus 2 [--apic-ids 0,1]
//! pvsched device --transport vfio-user --socket PATH --vcpus 2 [--apic-ids 0,1]
//!                [--host-flags N] [--features N|0xN] [--no-sandbox]
//!                [--fault wrong-magic|wrong-version|refuse-region|hostile-header]
//!                [--dump-slots PATH] [--event-fd N]
//! ```
//!
//! The device enters its sandbox before it reads the first guest data
//! (`docs/sandbox.md`); `--no-sandbox` is for debugging only. The hidden
//! `--test-trigger open-on-reset` exists for the sandbox tests.

use crate::fault::{Fault, TestTrigger};
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
    /// Corrupt the region header after each DRIVER_OK (a different way
    /// each time; from the fifth on, after the driver validated it).
    HostileHeader,
}

impl From<FaultArg> for Fault {
    fn from(f: FaultArg) -> Self {
        match f {
            FaultArg::WrongMagic => Fault::WrongMagic,
            FaultArg::WrongVersion => Fault::WrongVersion,
            FaultArg::RefuseRegion => Fault::RefuseRegion,
            FaultArg::HostileHeader => Fault::HostileHeader,
        }
    }
}

/// Test-only triggers (hidden from `--help`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TestTriggerArg {
    /// On device reset, try to open a file (a sandboxed device dies with SIGSYS).
    OpenOnReset,
    /// On device reset, panic (the sandboxed panic path: exit 1, no SIGSYS).
    PanicOnReset,
}

impl From<TestTriggerArg> for TestTrigger {
    fn from(t: TestTriggerArg) -> Self {
        match t {
            TestTriggerArg::OpenOnReset => TestTrigger::OpenOnReset,
            TestTriggerArg::PanicOnReset => TestTrigger::PanicOnReset,
        }
    }
}

/// Parses a `u64` in decimal or `0x` hexadecimal.
pub fn parse_u64(s: &str) -> Result<u64, String> {
    let t = s.trim().replace('_', "");
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    };
    r.map_err(|e| format!("{s:?} is not a number (decimal or 0x hex): {e}"))
}

/// Parses a `u32` in decimal or `0x` hexadecimal.
pub fn parse_u32(s: &str) -> Result<u32, String> {
    let v = parse_u64(s)?;
    u32::try_from(v).map_err(|_| format!("{s:?} does not fit in 32 bits"))
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
    /// Host flags (HOST_F_* bits) the device reports in the region header.
    #[arg(long, value_parser = parse_u32, default_value = "0")]
    pub host_flags: u32,
    /// Features offered to the driver (F_* bits, decimal or 0x hex);
    /// default all of ABI v1 (mpqemu never offers F_DEVICE_REGION).
    #[arg(long, value_parser = parse_u64)]
    pub features: Option<u64>,
    /// Do not enter the sandbox (debugging only: the device then serves
    /// with every privilege and fd it was started with).
    #[arg(long)]
    pub no_sandbox: bool,
    /// Test only: arm a trigger inside the device.
    #[arg(long, value_enum, hide = true)]
    pub test_trigger: Option<TestTriggerArg>,
    /// Inherited fd that backs BAR2 instead of a memfd of the device's own
    /// (vfio-user, device region): e.g. pvschedd's region map for this VM,
    /// so the policy reads the slots where the guest writes them. A memfd
    /// must be sealed against shrinking; `pvsched device --daemon-region`
    /// fetches and passes pvschedd's.
    #[arg(long)]
    pub bar2_fd: Option<i32>,
    /// Inherited SOCK_SEQPACKET socket fd on which the device reports
    /// region attach/detach and kicks to the VMM that started it, each
    /// before the reply to the access that caused it (vfio-user; the
    /// reference VMM passes it, QEMU does not).
    #[arg(long)]
    pub event_fd: Option<i32>,
    /// vfio-user: give the socket to UID:GID, mode 0600, before its path
    /// appears (for a VMM running as another user, e.g. libvirt's QEMU as
    /// libvirt-qemu): nothing has to chown it after the fact.
    #[arg(long, value_name = "UID:GID", value_parser = parse_owner, requires = "socket")]
    pub socket_owner: Option<(u32, u32)>,
}

/// Parses `UID:GID` (numbers).
fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected UID:GID (numbers)"))?;
    Ok((parse_u32(u)?, parse_u32(g)?))
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
            host_flags: self.host_flags,
            features: self.features,
            sandbox: !self.no_sandbox,
            test_trigger: self.test_trigger.map(TestTrigger::from),
            bar2_fd: self.bar2_fd,
            event_fd: self.event_fd,
            socket_owner: self.socket_owner,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: DeviceArgs,
    }

    fn parse(args: &[&str]) -> DeviceOptions {
        Cli::try_parse_from(std::iter::once("pvsched-device").chain(args.iter().copied()))
            .expect("parses")
            .args
            .options()
    }

    #[test]
    fn numbers_accept_decimal_and_hex() {
        assert_eq!(parse_u64("0x1f"), Ok(0x1f));
        assert_eq!(parse_u64("31"), Ok(31));
        assert_eq!(parse_u32("0xffff_ffff"), Ok(u32::MAX));
        assert!(parse_u32("0x1_0000_0000").is_err());
        assert!(parse_u64("ten").is_err());
    }

    #[test]
    fn new_flags_reach_the_options() {
        let o = parse(&[
            "--transport",
            "vfio-user",
            "--socket",
            "/tmp/x",
            "--vcpus",
            "2",
            "--host-flags",
            "0x1",
            "--features",
            "0x3",
            "--no-sandbox",
            "--test-trigger",
            "open-on-reset",
        ]);
        assert_eq!(o.host_flags, 1);
        assert_eq!(o.features, Some(3));
        assert!(!o.sandbox);
        assert_eq!(o.test_trigger, Some(TestTrigger::OpenOnReset));
        let d = parse(&["--fd", "3", "--vcpus", "1"]);
        assert!(d.sandbox, "sandbox on by default");
        assert_eq!((d.host_flags, d.features, d.test_trigger), (0, None, None));
    }
}
