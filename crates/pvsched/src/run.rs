//! `pvsched run`: boot the reference VMM with the test guest, run a
//! workload, print live progress and a summary (or one JSON object).

use crate::exit::Exit;
use clap::{Args, ValueEnum};
use pvsched::embedded::{Embedded, EmbeddedError};
use pvsched::launch::{self, LaunchError};
use pvsched::summary;
use pvsched_agent::{AgentConfig, AgentError, VmStats};
use pvsched_device::RegionMode;
use pvsched_policy::Caps;
use pvsched_vmm::{Run, RunReport, VmConfig, Workload};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;
use std::time::Instant;

/// Host policy to run beside the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    /// No host policy: the device only negotiates the region.
    None,
    /// The pvsched BPF policy, loaded in this process (needs root).
    Embedded,
    /// Register with a running pvschedd (`--daemon-socket`); the policy
    /// runs there, this process needs no privilege beyond the socket.
    Daemon,
}

/// Where the shared region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Region {
    /// BAR2 is the region (a memslot: guest writes never exit).
    Device,
    /// The guest hands the device a page range of its RAM.
    Guest,
}

/// Where the device runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceModeArg {
    /// In its own process (`pvsched device`, this binary), sandboxed,
    /// reached over vfio-user; the VMM survives its death.
    Sandboxed,
    /// In the VMM's process.
    InProcess,
}

/// Workloads selectable on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WorkloadArg {
    /// Halted vCPUs woken by injected interrupts; injection-to-handler latency.
    Wakeup,
    /// x2APIC IPI ping-pong between vCPU pairs; round-trip time.
    Ipi,
    /// A vCPU sets wait_on and spins until its partner answers an IPI.
    Spin,
    /// The guest writes garbage to the device; the device refuses.
    Hostile,
    /// Every vCPU asks for RT (FIFO 1) forever and spins; it never halts.
    Greedy,
}

impl From<WorkloadArg> for Workload {
    fn from(w: WorkloadArg) -> Self {
        match w {
            WorkloadArg::Wakeup => Workload::Wakeup,
            WorkloadArg::Ipi => Workload::Ipi,
            WorkloadArg::Spin => Workload::Spin,
            WorkloadArg::Hostile => Workload::Hostile,
            WorkloadArg::Greedy => Workload::Greedy,
        }
    }
}

/// Arguments of `pvsched run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Number of vCPUs (1..=64).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub vcpus: u32,
    /// What the test guest does.
    #[arg(long, value_enum, default_value_t = WorkloadArg::Wakeup)]
    pub workload: WorkloadArg,
    /// How long to run, e.g. 10s, 500ms, 1m.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Region mode the guest negotiates.
    #[arg(long, value_enum, default_value_t = Region::Device)]
    pub region: Region,
    /// Host policy.
    #[arg(long, value_enum, default_value_t = Policy::None)]
    pub policy: Policy,
    /// Admin caps of the VM for `--policy embedded` (TOML, see
    /// bpf-policy/caps.example.toml); default: the built-in caps.
    #[arg(long)]
    pub policy_file: Option<PathBuf>,
    /// With `--policy embedded`: write every policy record (boosts,
    /// throttles, waiting pairs) to this file, one JSON object per line.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Where the pvsched device runs.
    #[arg(long, value_enum, default_value_t = DeviceModeArg::Sandboxed)]
    pub device_mode: DeviceModeArg,
    /// Same as `--policy daemon`: register with the running pvschedd.
    #[arg(long, conflicts_with = "policy")]
    pub daemon: bool,
    /// With `--policy daemon`: pvschedd's socket.
    #[arg(long, env = "PVSCHED_SOCKET", default_value = pvsched_daemon::config::DEFAULT_SOCKET)]
    pub daemon_socket: PathBuf,
    /// With `--policy daemon`: the VM's name (its caps file on the host is
    /// /etc/pvsched/vms/NAME.toml). Default: pvsched-run-PID.
    #[arg(long)]
    pub vm_name: Option<String>,
}

impl RunArgs {
    /// The host policy asked for (`--daemon` is `--policy daemon`).
    pub fn policy(&self) -> Policy {
        if self.daemon {
            Policy::Daemon
        } else {
            self.policy
        }
    }
}

/// The admin caps from `--policy-file`, or the defaults.
fn load_caps(path: Option<&PathBuf>) -> Result<Caps, String> {
    path.map_or(Ok(Caps::default()), |p| read_policy_file(p))
}

/// The caps in `--policy-file PATH`, or what is wrong with it.
pub(crate) fn read_policy_file(path: &std::path::Path) -> Result<Caps, String> {
    Caps::from_file(path).map_err(|e| format!("--policy-file: {e}"))
}

/// Exit code for a policy that could not be set up.
fn policy_exit(e: &EmbeddedError) -> Exit {
    match e {
        EmbeddedError::Agent(AgentError::Bpf(_)) => Exit::PolicyLoad,
        EmbeddedError::Vm(v) => exit_for(v),
        EmbeddedError::Daemon(c) => crate::daemon_cli::exit_for(c),
        _ => Exit::Failure,
    }
}

/// Why `pvsched run` stopped before its verdict; each maps to one exit code
/// ([`RunError::exit`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// `--policy-file` with `--policy none`.
    #[error("--policy-file needs --policy embedded")]
    PolicyFileWithoutPolicy,
    /// `--trace` without the embedded policy.
    #[error("--trace needs --policy embedded (pvschedd has no trace option yet)")]
    TraceWithoutEmbedded,
    /// The sandboxed device process is this binary, which could not be
    /// found (the message says to use --device-mode in-process).
    #[error("{0}")]
    CurrentExe(#[source] LaunchError),
    /// `--policy-file` unreadable or invalid (the message names the file).
    #[error("{0}")]
    PolicyFile(String),
    /// The policy could not be loaded, registered or attached.
    #[error("{0}")]
    Policy(#[source] EmbeddedError),
    /// The VM could not start.
    #[error("{0}")]
    Vm(#[from] pvsched_vmm::Error),
    /// `--json`: the report could not be encoded.
    #[error("encoding JSON failed: {0}")]
    Json(#[source] serde_json::Error),
    /// The summary could not be written to stdout.
    #[error("writing the summary failed: {0}")]
    Write(#[source] std::io::Error),
}

impl From<LaunchError> for RunError {
    fn from(e: LaunchError) -> Self {
        match e {
            LaunchError::Vm(e) => RunError::Vm(e),
            LaunchError::Policy(e) => RunError::Policy(e),
            e @ LaunchError::CurrentExe(_) => RunError::CurrentExe(e),
        }
    }
}

impl RunError {
    /// The exit code `pvsched run` returns for this error.
    pub fn exit(&self) -> Exit {
        match self {
            RunError::PolicyFileWithoutPolicy | RunError::PolicyFile(_) => Exit::PolicyFile,
            RunError::TraceWithoutEmbedded => Exit::Usage,
            RunError::Policy(e) => policy_exit(e),
            RunError::Vm(e) => exit_for(e),
            RunError::CurrentExe(_) | RunError::Json(_) | RunError::Write(_) => Exit::Failure,
        }
    }
}

/// Run the subcommand; returns the exit code.
pub fn main(args: &RunArgs) -> Exit {
    // Warnings and errors (e.g. the device process dying) on stderr.
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .try_init();
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pvsched run: {e}");
            e.exit()
        }
    }
}

/// Checks the flags, loads the policy, runs the VM, prints the summary;
/// the verdict ([`verdict`]) or why it stopped.
fn run(args: &RunArgs) -> Result<Exit, RunError> {
    let policy_kind = args.policy();
    if policy_kind == Policy::None && args.policy_file.is_some() {
        return Err(RunError::PolicyFileWithoutPolicy);
    }
    if policy_kind != Policy::Embedded && args.trace.is_some() {
        return Err(RunError::TraceWithoutEmbedded);
    }
    let vm = vm_config(args)?;
    // Declared before the run: dropped (unregistered, baselines restored)
    // only after the VM is shut down.
    let mut policy = load_policy(args)?;
    eprintln!(
        "pvsched run: {} vCPUs, workload {}, {} region, {} device, {}, policy {}",
        args.vcpus,
        Workload::from(args.workload),
        region_name(args.region),
        vm.device_mode.name(),
        humantime::format_duration(args.duration),
        policy_name(args.policy())
    );
    let run = launch::start(vm, args.duration, policy.as_mut())?.run;
    let report = wait_with_progress(run, args.duration);
    let stats = policy.as_ref().and_then(Embedded::stats);
    // Unregister (restores every vCPU thread) before printing.
    drop(policy);
    print_report(args, &report, stats.as_ref())?;
    Ok(verdict(&report))
}

/// The VM's configuration from the flags (the device program is this
/// binary's `device` subcommand when sandboxed).
fn vm_config(args: &RunArgs) -> Result<VmConfig, RunError> {
    let mut vm = VmConfig::new(args.vcpus, args.workload.into());
    vm.region = match args.region {
        Region::Device => RegionMode::Device,
        Region::Guest => RegionMode::Guest,
    };
    if args.device_mode == DeviceModeArg::Sandboxed {
        vm.device_mode = launch::sandboxed_device()?;
    }
    Ok(vm)
}

/// The embedded policy or the pvschedd registration `--policy` asks for,
/// with the caps of `--policy-file`; `None` for `--policy none`.
fn load_policy(args: &RunArgs) -> Result<Option<Embedded>, RunError> {
    let kind = args.policy();
    if kind == Policy::None {
        return Ok(None);
    }
    let caps = load_caps(args.policy_file.as_ref()).map_err(RunError::PolicyFile)?;
    let loaded = if kind == Policy::Embedded {
        let cfg = AgentConfig {
            trace: args.trace.clone(),
            ..AgentConfig::default()
        };
        Embedded::load(caps, cfg)
    } else {
        let name = args
            .vm_name
            .clone()
            .unwrap_or_else(|| format!("pvsched-run-{}", std::process::id()));
        Embedded::daemon(caps, &args.daemon_socket, &name)
    };
    loaded.map(Some).map_err(RunError::Policy)
}

/// Prints the summary (table or JSON) with the policy section, if any.
fn print_report(
    args: &RunArgs,
    report: &RunReport,
    stats: Option<&VmStats>,
) -> Result<(), RunError> {
    let name = policy_name(args.policy());
    if args.json {
        let mut v = serde_json::to_value(report).map_err(RunError::Json)?;
        if let Some(obj) = v.as_object_mut() {
            obj.insert(
                "policy".into(),
                stats.map_or_else(
                    || serde_json::json!({ "name": name }),
                    |s| summary::to_json(name, s),
                ),
            );
        }
        println!("{v}");
    } else {
        let mut out = std::io::stdout().lock();
        print_table(&mut out, report)
            .and_then(|()| stats.map_or(Ok(()), |s| summary::print_table(&mut out, name, s)))
            .map_err(RunError::Write)?;
    }
    Ok(())
}

fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::None => "none",
        Policy::Embedded => "embedded",
        Policy::Daemon => "daemon",
    }
}

/// Let `run` go for `duration`, printing a progress line to stderr each second.
fn wait_with_progress(run: Run, duration: Duration) -> RunReport {
    let start = Instant::now();
    let end = start + duration;
    let mut next = start + Duration::from_secs(1);
    let mut last = 0u64;
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        std::thread::sleep(end.min(next).saturating_duration_since(now));
        if Instant::now() >= next {
            let p = run.progress();
            eprintln!(
                "[{:>4}s] events {:>8} (+{}/s){}{}",
                p.elapsed.as_secs(),
                p.events,
                p.events.saturating_sub(last),
                if p.ready { "" } else { "  (guest starting)" },
                if p.device_lost {
                    "  (device process lost)"
                } else {
                    ""
                }
            );
            last = p.events;
            next += Duration::from_secs(1);
        }
    }
    run.finish()
}

fn region_name(r: Region) -> &'static str {
    match r {
        Region::Device => "device",
        Region::Guest => "guest",
    }
}

/// Exit code for a VM that could not start.
fn exit_for(e: &pvsched_vmm::Error) -> Exit {
    match e {
        pvsched_vmm::Error::KvmMissing => Exit::NoKvm,
        pvsched_vmm::Error::KvmPermission => Exit::KvmPermission,
        _ => Exit::Failure,
    }
}

/// Exit code for a finished run.
fn verdict(r: &RunReport) -> Exit {
    if let Some(l) = &r.device_lost {
        eprintln!(
            "pvsched run: the device process {} died {:.1} s into the run ({}); the VM ran to the end without it",
            l.pid,
            l.at_s,
            how_it_died(l)
        );
        return Exit::DeviceLost;
    }
    if !r.driver_ok() {
        eprintln!("pvsched run: handshake {}", r.handshake);
        return Exit::Guest;
    }
    if !r.clean_shutdown || r.per_vcpu.iter().any(|v| v.fault.is_some()) {
        eprintln!("pvsched run: a vCPU crashed (see the table)");
        return Exit::Guest;
    }
    Exit::Ok
}

fn how_it_died(l: &pvsched_vmm::runner::DeviceLostReport) -> String {
    match (l.signal, l.exit_code) {
        (Some(sig), _) => format!(
            "killed by signal {sig}, {}",
            pvsched_vmm::device_process::signal_name(sig)
        ),
        (None, Some(c)) => format!("exit code {c}"),
        (None, None) => "ended".to_owned(),
    }
}

fn us(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

/// The human summary.
pub fn print_table(out: &mut impl Write, r: &RunReport) -> std::io::Result<()> {
    writeln!(
        out,
        "\npvsched run: {} vCPUs, {} workload, {} region, {:.1} s, handshake {}",
        r.vcpus, r.workload, r.region, r.duration_s, r.handshake
    )?;
    writeln!(
        out,
        "{:>4} {:>8} {:>4} {:>4} {:>9} {:>9} {:>9} {:>9} {:>10} {:>11}  end",
        "vCPU",
        "TID",
        "APIC",
        "slot",
        "events",
        "p50 µs",
        "p99 µs",
        "max µs",
        "MMIO exits",
        "burst exits"
    )?;
    for v in &r.per_vcpu {
        let end = match &v.end {
            Some(pvsched_vmm::VcpuEnd::Stopped) => "stopped".to_owned(),
            Some(e) => format!("{e:?}"),
            None => "-".to_owned(),
        };
        let end = match v.fault {
            Some(f) => format!("{end}, guest fault #{f}"),
            None => end,
        };
        writeln!(
            out,
            "{:>4} {:>8} {:>4} {:>4} {:>9} {:>9} {:>9} {:>9} {:>10} {:>11}  {end}",
            v.index,
            v.tid,
            opt(v.apic_id),
            opt(v.slot),
            v.events,
            us(v.p50_us),
            us(v.p99_us),
            us(v.max_us),
            v.mmio_exits,
            opt(v.burst_mmio_exits),
        )?;
    }
    writeln!(
        out,
        "{:>4} {:>8} {:>4} {:>4} {:>9} {:>9} {:>9} {:>9}",
        "all",
        "",
        "",
        "",
        r.events,
        us(r.p50_us),
        us(r.p99_us),
        us(r.max_us)
    )?;
    for v in r.per_vcpu.iter().filter(|v| !v.hostile.is_empty()) {
        let steps: Vec<String> = v
            .hostile
            .iter()
            .map(|(step, err)| format!("{step}:{}", pvsched_vmm::runner::error_name(*err)))
            .collect();
        writeln!(out, "vCPU {} refusals: {}", v.index, steps.join(" "))?;
    }
    if r.workload == Workload::Greedy {
        let loops: Vec<String> = r
            .per_vcpu
            .iter()
            .map(|v| format!("vCPU {} {}", v.index, v.greedy_loops))
            .collect();
        writeln!(out, "greedy loop iterations: {}", loops.join(", "))?;
    }
    let what = match r.workload {
        Workload::Wakeup => "latency: MSI injection to the guest handler's acknowledgement",
        Workload::Ipi => "latency: ping round trip (driver), ping one-way (partner)",
        Workload::Spin => "latency: wait_on set until the partner answered",
        Workload::Hostile => "hostile: the device's refusals are listed above",
        Workload::Idle => "idle",
        Workload::Greedy => "greedy: every vCPU asks for FIFO 1 and spins; no latency samples",
    };
    writeln!(out, "{what}; host monotonic clock on both ends")?;
    let (rd, wr) = (&r.mmio_read_service, &r.mmio_write_service);
    let pid = r
        .device_pid
        .map_or_else(String::new, |p| format!(" (pid {p})"));
    writeln!(
        out,
        "device {}{pid}: MMIO reads served p50 {} µs p99 {} µs ({}), writes p50 {} µs p99 {} µs ({}){}",
        r.device_mode,
        us(rd.p50_us),
        us(rd.p99_us),
        rd.samples,
        us(wr.p50_us),
        us(wr.p99_us),
        wr.samples,
        r.device_messages
            .map_or_else(String::new, |n| format!("; {n} vfio-user messages"))
    )?;
    if let Some(l) = &r.device_lost {
        writeln!(
            out,
            "device process {} LOST at {:.1} s ({}); events before {}, after {}",
            l.pid,
            l.at_s,
            how_it_died(l),
            l.events_at_loss,
            r.events.saturating_sub(l.events_at_loss)
        )?;
    }
    if r.lost_wakeups > 0 {
        writeln!(out, "lost wakeups: {}", r.lost_wakeups)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_vmm::{VcpuEnd, VcpuReport};

    fn report(status: u32) -> RunReport {
        RunReport {
            vcpus: 1,
            workload: Workload::Wakeup,
            region: "device",
            device_mode: "sandboxed",
            device_pid: Some(77),
            device_messages: Some(40),
            device_lost: None,
            mmio_read_service: pvsched_vmm::stats::Summary::default(),
            mmio_write_service: pvsched_vmm::stats::Summary::default(),
            duration_s: 1.0,
            events: 3,
            samples: 3,
            p50_us: Some(40.0),
            p99_us: Some(90.5),
            max_us: Some(100.0),
            handshake: "DRIVER_OK".into(),
            handshake_status: Some(status),
            handshake_error: Some(0),
            device_status: status,
            device_error: 0,
            lost_wakeups: 0,
            clean_shutdown: true,
            per_vcpu: vec![VcpuReport {
                index: 0,
                tid: 42,
                apic_id: Some(0),
                slot: Some(0),
                events: 3,
                samples: 3,
                p50_us: Some(40.0),
                p99_us: Some(90.5),
                max_us: Some(100.0),
                mmio_exits: 12,
                pio_exits: 20,
                burst_updates: Some(16),
                burst_mmio_exits: Some(0),
                burst_device_messages: Some(0),
                ipi_sent: 0,
                ipi_received: 0,
                spins: 0,
                pause_iterations: 0,
                hostile: Vec::new(),
                greedy_loops: 0,
                fault: None,
                guest_slot: None,
                end: Some(VcpuEnd::Stopped),
            }],
            console: String::new(),
        }
    }

    #[test]
    fn verdicts_and_exit_codes() {
        assert_eq!(verdict(&report(0xf)), Exit::Ok);
        assert_eq!(verdict(&report(0x8b)), Exit::Guest);
        let mut crashed = report(0xf);
        crashed.clean_shutdown = false;
        assert_eq!(verdict(&crashed), Exit::Guest);
        let mut lost = report(0xf);
        lost.device_lost = Some(pvsched_vmm::runner::DeviceLostReport {
            pid: 77,
            signal: Some(9),
            exit_code: None,
            at_s: 2.0,
            noticed_by: "process",
            events_at_loss: 1,
        });
        assert_eq!(verdict(&lost), Exit::DeviceLost);
        let mut out = Vec::new();
        print_table(&mut out, &lost).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("device process 77 LOST at 2.0 s (killed by signal 9, SIGKILL)"),
            "{text}"
        );
        assert_eq!(exit_for(&pvsched_vmm::Error::KvmMissing), Exit::NoKvm);
        assert_eq!(
            exit_for(&pvsched_vmm::Error::KvmPermission),
            Exit::KvmPermission
        );
        assert_eq!(
            exit_for(&pvsched_vmm::Error::Config("x".into())),
            Exit::Failure
        );
    }

    #[test]
    fn run_errors_say_what_failed_and_map_to_their_exit_code() {
        let cases = [
            (
                RunError::PolicyFileWithoutPolicy,
                "--policy-file needs --policy embedded",
                Exit::PolicyFile,
            ),
            (
                RunError::TraceWithoutEmbedded,
                "--trace needs --policy embedded (pvschedd has no trace option yet)",
                Exit::Usage,
            ),
            (
                RunError::PolicyFile("--policy-file /x: bad".into()),
                "--policy-file /x: bad",
                Exit::PolicyFile,
            ),
            (
                RunError::Vm(pvsched_vmm::Error::KvmMissing),
                &pvsched_vmm::Error::KvmMissing.to_string(),
                Exit::NoKvm,
            ),
            (
                RunError::Write(std::io::Error::other("full")),
                "writing the summary failed: full",
                Exit::Failure,
            ),
        ];
        for (e, text, code) in cases {
            assert_eq!(e.to_string(), text);
            assert_eq!(e.exit(), code, "{e}");
        }
        let e = RunError::from(LaunchError::CurrentExe(std::io::Error::other("gone")));
        assert!(
            e.to_string().ends_with("use --device-mode in-process"),
            "{e}"
        );
        assert_eq!(e.exit(), Exit::Failure);
    }

    #[test]
    fn cli_workload_names_match_the_vmm_and_greedy_reports_its_loops() {
        for arg in WorkloadArg::value_variants() {
            let name = arg.to_possible_value().unwrap().get_name().to_owned();
            assert_eq!(name.parse::<Workload>().unwrap(), Workload::from(*arg));
        }
        assert_eq!(
            WorkloadArg::from_str("greedy", false),
            Ok(WorkloadArg::Greedy)
        );
        let mut r = report(0xf);
        r.workload = Workload::Greedy;
        r.per_vcpu[0].greedy_loops = 1234;
        let mut out = Vec::new();
        print_table(&mut out, &r).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("greedy loop iterations: vCPU 0 1234"),
            "{text}"
        );
    }

    #[test]
    fn table_has_one_row_per_vcpu_and_a_total() {
        let mut out = Vec::new();
        print_table(&mut out, &report(0xf)).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("handshake DRIVER_OK"));
        assert!(text.contains("      90.5"));
        assert_eq!(
            text.lines()
                .filter(|l| l.trim_start().starts_with("0 "))
                .count(),
            1
        );
        assert!(text.lines().any(|l| l.trim_start().starts_with("all")));
    }
}
