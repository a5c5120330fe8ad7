//! Process exit codes, one table for every pvsched binary (`pvsched`,
//! `pvschedd`, `pvsched-agent-attach`, `pvsched-device`): a code means the
//! same thing whichever binary returns it; each binary returns the subset
//! that can happen to it.

/// Exit codes, as documented in `--help`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// Success.
    Ok = 0,
    /// Anything else went wrong (see the message).
    Failure = 1,
    /// Bad command line (clap exits with 2 itself; this is for
    /// combinations it cannot check, e.g. `--trace` without a policy).
    Usage = 2,
    /// /dev/kvm does not exist.
    NoKvm = 3,
    /// /dev/kvm exists but may not be opened.
    KvmPermission = 4,
    /// The guest did not reach DRIVER_OK or a vCPU crashed.
    Guest = 5,
    /// The BPF policy could not be loaded or attached (not root / no
    /// CAP_BPF+CAP_PERFMON+CAP_SYS_NICE, no BTF, ...).
    PolicyLoad = 6,
    /// The policy or configuration file (`--policy-file`, `--caps`,
    /// pvschedd's `--config`) could not be read or is invalid.
    PolicyFile = 7,
    /// `--device-mode sandboxed`: the device process died during the run;
    /// the run itself went to the end (the summary has `device_lost`).
    DeviceLost = 8,
    /// `pvsched bench`: the benchmark could not run (a run failed or
    /// overran, bench/s4.py or a binary it needs is missing, ...).
    Bench = 9,
    /// pvschedd's socket could not be reached (not running, or no
    /// permission on the socket).
    NoDaemon = 10,
    /// The policy refused the request or registration (pvschedd, or the
    /// agent's `register_vm`: the message says why); nothing changed.
    Refused = 11,
}

/// The exit-code table shown at the end of `--help`.
pub const HELP: &str = "\
Exit codes:
  0  success
  1  other failure (the message says what failed)
  2  bad command line
  3  /dev/kvm does not exist (load kvm_intel/kvm_amd, enable virtualization)
  4  permission denied on /dev/kvm (join the 'kvm' group or run as root)
  5  the guest did not reach DRIVER_OK, or a vCPU crashed
  6  the BPF policy could not load or attach (run as root; the message says
     why); nothing was started
  7  the policy or configuration file could not be read or is invalid
  8  the sandboxed device process died during the run; the VM ran to the
     end without it (guest saw DEVICE_NEEDS_RESET, policy boosts dropped)
     and the summary reports device_lost
  9  pvsched bench: the benchmark could not run (the message says what
     failed; a measured run's own code 3-8 is passed through)
 10  pvschedd's socket could not be reached (is it running? are you in
     the socket's group?)
 11  the policy refused the request or registration (the message says
     why); nothing changed";

impl From<Exit> for std::process::ExitCode {
    fn from(e: Exit) -> Self {
        std::process::ExitCode::from(e as u8)
    }
}
