//! `pvsched-agent-attach`: attaches the pvsched policy agent to the vCPU
//! threads of an already running VMM (e.g. QEMU) whose guest uses the guest
//! region, until SIGINT/SIGTERM or until the VMM exits; restores every
//! thread's baseline on the way out.
//!
//! ```text
//! pvsched-agent-attach --pid 1234 --tids 1240,1241 --apic-ids 0,1 \
//!     --slot-addrs 0x7f00001000c0,0x7f0000100140 [--emulator-tids 1234] \
//!     [--caps caps.toml] [--stats-json stats.json] [--trace trace.jsonl]
//! ```
//!
//! `--emulator-tids` names the VM's emulator threads (QEMU's main loop is
//! the process's first thread, tid = pid; I/O threads): they hold the halt
//! boost while a vCPU is latency-sensitive, within the same caps.
//!
//! Every `--tids` and `--emulator-tids` entry must be a thread of `--pid` (`/proc/PID/task/TID`),
//! the rule the future multi-VM daemon enforces. `--slot-addrs` are the
//! VMM's virtual addresses of each slot (the BPF policy reads them with
//! `bpf_probe_read_user` in the vCPU thread's own context).
//!
//! If this process is killed (SIGKILL, OOM), its guardian process
//! (`pvsched-guard`, see `pvsched_agent::guardian`) puts every thread it
//! boosted back to its baseline; QEMU needs to do nothing.
//!
//! Exit codes (the workspace's one table, `pvsched_util::exit`): 0 stopped
//! (signal or VMM exit) and restored; 1 writing the statistics failed; 2 bad
//! arguments (clap) or a TID not in the VMM; 6 BPF unusable (the agent
//! refuses to start); 11 the VM was refused.

use clap::Parser;
use pvsched_agent::watch::pidfd_open;
use pvsched_agent::{Agent, AgentConfig, Caps, RegionSpec, VmSpec, VmStats};
use pvsched_util::exit::Exit;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Errors of this tool; each maps to an exit code.
#[derive(Debug, thiserror::Error)]
enum AttachError {
    /// An argument is wrong.
    #[error("{0}")]
    Usage(String),
    /// The agent could not load.
    #[error("{0} (needs root or CAP_BPF+CAP_PERFMON+CAP_SYS_NICE and a BTF kernel)")]
    Load(#[source] pvsched_agent::AgentError),
    /// register_vm refused.
    #[error("{0}")]
    Register(#[source] pvsched_agent::AgentError),
    /// A system call or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: String,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
}

impl AttachError {
    /// Its code in the workspace's exit table (`pvsched_util::exit`).
    fn code(&self) -> Exit {
        match self {
            AttachError::Io { .. } => Exit::Failure,
            AttachError::Usage(_) => Exit::Usage,
            AttachError::Load(_) => Exit::PolicyLoad,
            AttachError::Register(_) => Exit::Refused,
        }
    }
}

fn parse_addr(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let r = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    r.map_err(|e| format!("bad address {s:?}: {e}"))
}

/// Attach the pvsched BPF policy agent to a running VMM's vCPU threads.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Pid of the VMM process owning the vCPU threads.
    #[arg(long)]
    pid: u32,
    /// vCPU thread ids, by slot index (comma separated).
    #[arg(long, value_delimiter = ',', required = true)]
    tids: Vec<u32>,
    /// APIC ID of each slot (comma separated, same length as --tids).
    #[arg(long, value_delimiter = ',', required = true)]
    apic_ids: Vec<u32>,
    /// VMM virtual address of each slot (hex with 0x or decimal).
    #[arg(long, value_delimiter = ',', value_parser = parse_addr, required = true)]
    slot_addrs: Vec<u64>,
    /// Emulator threads of the VM (comma separated, at most 4): QEMU's main
    /// loop (tid = pid), I/O threads.
    #[arg(long, value_delimiter = ',')]
    emulator_tids: Vec<u32>,
    /// Admin caps (TOML, see pvsched_policy::caps); default caps otherwise.
    /// (`--policy-file` is the same, as `pvsched run` spells it.)
    #[arg(long, alias = "policy-file")]
    caps: Option<PathBuf>,
    /// Write the VM's statistics here (JSON) on exit.
    #[arg(long)]
    stats_json: Option<PathBuf>,
    /// Write every policy record (boosts, throttles, waiting pairs) here,
    /// one JSON object per line (`pvsched_agent::trace`).
    #[arg(long)]
    trace: Option<PathBuf>,
}

/// Checks that every tid is a thread of `pid`.
fn check_tids(pid: u32, tids: &[u32]) -> Result<(), AttachError> {
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(AttachError::Usage(format!("--pid {pid}: no such process")));
    }
    for &tid in tids {
        if !Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
            return Err(AttachError::Usage(format!(
                "thread {tid} is not a thread of process {pid} (no /proc/{pid}/task/{tid}); \
                 refusing to change the scheduling of another process's threads"
            )));
        }
    }
    Ok(())
}

fn stats_json(pid: u32, stats: &VmStats, why: &str) -> serde_json::Value {
    // One shape for vCPU and emulator threads (an emulator thread's IPI
    // and slot counters stay 0).
    let threads = |list: &[pvsched_agent::agent::ThreadStats]| -> Vec<serde_json::Value> {
        list.iter()
            .map(|v| {
                serde_json::json!({
                    "tid": v.tid, "boosts": v.counters.boosts, "throttles": v.counters.throttles,
                    "boosted_ns": v.counters.boosted_ns, "ipis": v.ipis, "slot_hits": v.slot_hits,
                    "boosts_applied": v.counters.boosts_applied, "errors": v.counters.errors,
                })
            })
            .collect()
    };
    let vcpus = threads(&stats.vcpus);
    let emulators = threads(&stats.emulators);
    serde_json::json!({
        "pid": pid,
        "emulators": emulators,
        "stopped_by": why,
        "decisions": stats.decisions,
        "dropped": stats.dropped,
        "apply_samples": stats.apply_samples,
        "apply_p50_ns": stats.apply_p50_ns,
        "apply_p99_ns": stats.apply_p99_ns,
        "vcpus": vcpus,
    })
}

/// Blocks until a signal arrives on `sig` or the process behind `pidfd`
/// exits; says which.
fn wait_stop(sig: &UnixStream, pidfd: &std::os::fd::OwnedFd) -> Result<&'static str, AttachError> {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: sig.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: pidfd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds, infinite timeout.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(AttachError::Io {
                what: "poll".into(),
                source: e,
            });
        }
        if fds[0].revents != 0 {
            return Ok("signal");
        }
        if fds[1].revents != 0 {
            return Ok("vmm-exit");
        }
    }
}

fn run(args: Args) -> Result<(), AttachError> {
    let n = args.tids.len();
    if args.apic_ids.len() != n || args.slot_addrs.len() != n {
        return Err(AttachError::Usage(format!(
            "--tids ({n}), --apic-ids ({}) and --slot-addrs ({}) must have the same length",
            args.apic_ids.len(),
            args.slot_addrs.len()
        )));
    }
    check_tids(args.pid, &args.tids)?;
    check_tids(args.pid, &args.emulator_tids)?;
    let caps = match &args.caps {
        Some(p) => Caps::from_file(p).map_err(|e| match e {
            pvsched_policy::CapsError::Read { path, source } => AttachError::Io {
                what: format!("reading caps {}", path.display()),
                source,
            },
            e => AttachError::Usage(e.to_string()),
        })?,
        None => Caps::default(),
    };
    let pidfd = pidfd_open(args.pid).map_err(|e| AttachError::Usage(e.to_string()))?;
    // Signals go to a socket pair we poll with the pidfd; the agent's own
    // signal thread is not installed (we restore by dropping, then exit 0).
    let (sig_rx, sig_tx) = UnixStream::pair().map_err(|source| AttachError::Io {
        what: "socketpair".into(),
        source,
    })?;
    for s in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let tx = sig_tx.try_clone().map_err(|source| AttachError::Io {
            what: "dup socket".into(),
            source,
        })?;
        signal_hook::low_level::pipe::register(s, tx).map_err(|source| AttachError::Io {
            what: format!("installing the handler of signal {s}"),
            source,
        })?;
    }
    let agent = Agent::load(AgentConfig {
        handle_signals: false,
        trace: args.trace.clone(),
        ..AgentConfig::default()
    })
    .map_err(AttachError::Load)?;
    let vm = agent
        .register_vm(VmSpec {
            owner: None,
            vcpu_tids: args.tids.clone(),
            emulator_tids: args.emulator_tids.clone(),
            apic_ids: args.apic_ids.clone(),
            caps,
            region: RegionSpec::GuestAddrs(args.slot_addrs.clone()),
        })
        .map_err(AttachError::Register)?;
    log::info!(
        "pvsched-agent-attach: serving pid {} ({} vCPUs)",
        args.pid,
        n
    );
    eprintln!("pvsched-agent-attach: ready");
    let why = wait_stop(&sig_rx, &pidfd)?;
    let stats = vm.stats();
    drop(vm);
    drop(agent);
    eprintln!("pvsched-agent-attach: stopped ({why}), baselines restored");
    if let Some(p) = &args.stats_json {
        let text = serde_json::to_string_pretty(&stats_json(args.pid, &stats, why))
            .unwrap_or_else(|_| "{}".into());
        std::fs::write(p, text + "\n").map_err(|source| AttachError::Io {
            what: format!("writing {}", p.display()),
            source,
        })?;
    }
    Ok(())
}

fn main() -> ExitCode {
    pvsched_util::logging::init("warn", pvsched_util::logging::Clock::Time);
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pvsched-agent-attach: {e}");
            e.code().into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_hex_and_decimal() {
        assert_eq!(parse_addr("0x10"), Ok(16));
        assert_eq!(parse_addr("16"), Ok(16));
        assert!(parse_addr("0xzz").is_err());
    }

    #[test]
    fn foreign_tid_is_refused() {
        let me = std::process::id();
        assert!(check_tids(me, &[me]).is_ok());
        // pid 1's main thread is not one of our threads.
        let e = check_tids(me, &[1]).unwrap_err();
        assert_eq!(e.code(), Exit::Usage);
        assert!(e.to_string().contains("not a thread of process"));
    }
}
