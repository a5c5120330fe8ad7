//! Process exit codes, one table for every pvsched binary (`pvsched`,
//! `pvschedd`, `pvsched-agent-attach`, `pvsched-device`): a code means the
//! same thing whichever binary returns it; each binary returns the subset
//! that can happen to it.

/// Exit codes; what each tells the user is [`Exit::meaning`], the text
/// `--help` shows ([`help`]).
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
    /// `pvsched-bench`: the benchmark could not run (a run failed or
    /// overran, the bench's Python package or a binary it needs is missing, ...).
    Bench = 9,
    /// pvschedd's socket could not be reached (not running, or no
    /// permission on the socket).
    NoDaemon = 10,
    /// The policy refused the request or registration (pvschedd, or the
    /// agent's `register_vm`: the message says why); nothing changed.
    Refused = 11,
}

impl Exit {
    /// Every code, in order.
    pub const ALL: [Exit; 12] = [
        Exit::Ok,
        Exit::Failure,
        Exit::Usage,
        Exit::NoKvm,
        Exit::KvmPermission,
        Exit::Guest,
        Exit::PolicyLoad,
        Exit::PolicyFile,
        Exit::DeviceLost,
        Exit::Bench,
        Exit::NoDaemon,
        Exit::Refused,
    ];

    /// What the code tells a user, and what to do: the one text `--help`
    /// shows (lines after the first indented to the table's text column).
    pub fn meaning(self) -> &'static str {
        match self {
            Exit::Ok => "success",
            Exit::Failure => "other failure (the message says what failed)",
            Exit::Usage => "bad command line",
            Exit::NoKvm => {
                "/dev/kvm does not exist (load kvm_intel/kvm_amd, enable virtualization)"
            }
            Exit::KvmPermission => {
                "permission denied on /dev/kvm (join the 'kvm' group or run as root)"
            }
            Exit::Guest => "the guest did not reach DRIVER_OK, or a vCPU crashed",
            Exit::PolicyLoad => {
                "the BPF policy could not load or attach (run as root; the message says\n     why); nothing was started"
            }
            Exit::PolicyFile => "the policy or configuration file could not be read or is invalid",
            Exit::DeviceLost => {
                "the sandboxed device process died during the run; the VM ran to the\n     end without it (guest saw DEVICE_NEEDS_RESET, policy boosts dropped)\n     and the summary reports device_lost"
            }
            Exit::Bench => {
                "pvsched-bench: the benchmark could not run (the message says what\n     failed; a measured run's own code 3-8 is passed through)"
            }
            Exit::NoDaemon => {
                "pvschedd's socket could not be reached (is it running? are you in\n     the socket's group?)"
            }
            Exit::Refused => {
                "the policy refused the request or registration (the message says\n     why); nothing changed"
            }
        }
    }
}

/// The exit-code table shown at the end of `--help`, for `codes` (a
/// binary lists the ones it can return; `pvsched` all of [`Exit::ALL`]).
pub fn help(codes: &[Exit]) -> String {
    let mut out = String::from("Exit codes:");
    for c in codes {
        out.push_str(&format!("\n{:>3}  {}", *c as u8, c.meaning()));
    }
    out
}

impl From<Exit> for std::process::ExitCode {
    fn from(e: Exit) -> Self {
        std::process::ExitCode::from(e as u8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_code_once_in_order() {
        for (i, c) in Exit::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        let h = help(&Exit::ALL);
        assert!(
            h.starts_with("Exit codes:\n  0  success\n  1  other failure"),
            "{h}"
        );
        assert!(h.contains("\n 11  the policy refused"), "{h}");
        assert_eq!(help(&[Exit::Ok, Exit::PolicyFile]).lines().count(), 3);
    }
}
