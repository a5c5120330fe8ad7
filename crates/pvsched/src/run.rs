//! `pvsched run`: boot the reference VMM with the test guest, run a
//! workload, print live progress and a summary (or one JSON object).

use crate::exit::Exit;
use clap::{Args, ValueEnum};
use pvsched_agent::{AgentConfig, AgentError, VmStats};
use pvsched_device::RegionMode;
use pvsched_host::embedded::{Embedded, EmbeddedError};
use pvsched_host::hogs::{Hogs, Load, LoadKind};
use pvsched_host::launch::{self, LaunchError};
use pvsched_host::summary;
use pvsched_policy::Caps;
use pvsched_vmm::{Run, RunReport, VmConfig, Workload};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;
use std::time::Instant;

/// Host policy to run beside the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Policy {
    /// The pvsched BPF policy in this process if it loads here (root, BPF
    /// with BTF); otherwise the run says why and goes on without it.
    Auto,
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
    #[arg(long, value_enum, default_value_t = Policy::Auto)]
    pub policy: Policy,
    /// Admin caps of the VM for the policy (TOML, see
    /// bpf-policy/caps.example.toml); default: the built-in caps.
    #[arg(long, alias = "caps")]
    pub policy_file: Option<PathBuf>,
    /// Run twice on a loaded host, first without the host policy, then
    /// with it, and print both side by side: latency, boosts, throttles
    /// and how much of their work the host's other threads kept.
    #[arg(long)]
    pub compare: bool,
    /// Load the host with this many busy threads (SCHED_OTHER, nice 0)
    /// during the run and report the work they got done; default 0, and
    /// two per online CPU with `--compare`.
    #[arg(long)]
    pub hogs: Option<usize>,
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
    /// At the end of `--duration`, save the whole VM (vCPUs, interrupt
    /// controllers, clock, RAM, the device's state) into this directory
    /// instead of stopping the guest; `--restore DIR` runs it on. Needs
    /// `--device-mode in-process`.
    #[arg(long, value_name = "DIR", conflicts_with = "compare")]
    pub snapshot_to: Option<PathBuf>,
    /// Run on the VM saved by `--snapshot-to DIR` in this process, for
    /// `--duration`: the guest continues where it was, with its device
    /// state; its vCPUs, workload and region come from the snapshot. Needs
    /// `--device-mode in-process`.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with_all = ["compare", "vcpus", "workload", "region"]
    )]
    pub restore: Option<PathBuf>,
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
    /// `--compare` with `--policy none`.
    #[error("--compare runs with and without the host policy; it cannot run with --policy none")]
    CompareWithoutPolicy,
    /// `--snapshot-to` or `--restore` with the sandboxed device.
    #[error(
        "--snapshot-to and --restore need --device-mode in-process: the sandboxed device's \
         state cannot be read out of its process yet"
    )]
    SnapshotSandboxed,
    /// The snapshot could not be read.
    #[error("--restore: {0}")]
    Restore(#[source] pvsched_vmm::snapshot::Error),
    /// The host load's threads could not be started.
    #[error("starting the host load's threads (--hogs) failed: {0}")]
    Hogs(#[source] std::io::Error),
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
            RunError::TraceWithoutEmbedded
            | RunError::CompareWithoutPolicy
            | RunError::SnapshotSandboxed => Exit::Usage,
            RunError::Restore(_) => Exit::Failure,
            RunError::Policy(e) => policy_exit(e),
            RunError::Vm(e) => exit_for(e),
            RunError::CurrentExe(_)
            | RunError::Hogs(_)
            | RunError::Json(_)
            | RunError::Write(_) => Exit::Failure,
        }
    }
}

/// Run the subcommand; returns the exit code.
pub fn main(args: &RunArgs) -> Exit {
    // Warnings and errors (e.g. the device process dying) on stderr.
    pvsched_util::logging::init("warn", pvsched_util::logging::Clock::NoTime);
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pvsched run: {e}");
            e.exit()
        }
    }
}

/// Checks the flags, loads the policy, runs the VM (twice with
/// `--compare`), prints the summary; the verdict ([`verdict`]) or why it
/// stopped.
fn run(args: &RunArgs) -> Result<Exit, RunError> {
    let policy_kind = args.policy();
    if policy_kind == Policy::None && args.policy_file.is_some() {
        return Err(RunError::PolicyFileWithoutPolicy);
    }
    if matches!(policy_kind, Policy::None | Policy::Daemon) && args.trace.is_some() {
        return Err(RunError::TraceWithoutEmbedded);
    }
    if (args.snapshot_to.is_some() || args.restore.is_some())
        && args.device_mode != DeviceModeArg::InProcess
    {
        return Err(RunError::SnapshotSandboxed);
    }
    if args.compare {
        if policy_kind == Policy::None {
            return Err(RunError::CompareWithoutPolicy);
        }
        return crate::compare::main(args);
    }
    // Declared before the run: dropped (unregistered, baselines restored)
    // only after the VM is shut down.
    let mut policy = load_policy(args)?;
    // A restored VM's vCPUs, workload and region are the snapshot's: said
    // once it is read.
    if args.restore.is_none() {
        eprintln!(
            "pvsched run: {} vCPUs, workload {}, {} region, {} device, {}, policy {}",
            args.vcpus,
            Workload::from(args.workload),
            region_name(args.region),
            device_mode_name(args.device_mode),
            humantime::format_duration(args.duration),
            policy.name
        );
    }
    let mut m = measure(args, policy.policy.as_mut(), args.hogs.unwrap_or(0))?;
    if let Some(dir) = &args.snapshot_to {
        eprintln!("pvsched run: VM saved in {}", dir.display());
    }
    m.stats = policy.policy.as_ref().and_then(Embedded::stats);
    // Unregister (restores every vCPU thread) before printing.
    drop(policy.policy.take());
    print_report(args, &policy, &m)?;
    Ok(verdict(&m.report))
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

/// The host policy of a run, as `--policy` resolved.
pub(crate) struct LoadedPolicy {
    /// The policy, `None` for none.
    pub policy: Option<Embedded>,
    /// What runs: `embedded`, `daemon` or `none`.
    pub name: &'static str,
    /// Why `--policy auto` runs without it.
    pub unavailable: Option<String>,
}

/// The embedded policy or the pvschedd registration `--policy` asks for,
/// with the caps of `--policy-file`. `--policy auto` without a caps file
/// or a trace falls back to none, saying why; `strict` (for `--compare`,
/// which needs the policy) turns that into an error.
pub(crate) fn load_policy_as(args: &RunArgs, strict: bool) -> Result<LoadedPolicy, RunError> {
    let kind = args.policy();
    let loaded = |policy, name| LoadedPolicy {
        policy: Some(policy),
        name,
        unavailable: None,
    };
    if kind == Policy::None {
        return Ok(LoadedPolicy {
            policy: None,
            name: "none",
            unavailable: None,
        });
    }
    let caps = load_caps(args.policy_file.as_ref()).map_err(RunError::PolicyFile)?;
    if kind == Policy::Daemon {
        let name = args
            .vm_name
            .clone()
            .unwrap_or_else(|| format!("pvsched-run-{}", std::process::id()));
        return Embedded::daemon(caps, &args.daemon_socket, &name)
            .map(|p| loaded(p, "daemon"))
            .map_err(RunError::Policy);
    }
    let cfg = AgentConfig {
        trace: args.trace.clone(),
        ..AgentConfig::default()
    };
    let fallback =
        kind == Policy::Auto && !strict && args.policy_file.is_none() && args.trace.is_none();
    match Embedded::load(caps, cfg) {
        Ok(p) => Ok(loaded(p, "embedded")),
        Err(e) if fallback => {
            let why = e.to_string();
            eprintln!(
                "pvsched run: running WITHOUT the host policy: {why}\n  (run as root for the \
                 embedded policy, or --policy daemon to register with a running pvschedd; \
                 --policy none runs without it silently)"
            );
            Ok(LoadedPolicy {
                policy: None,
                name: "none",
                unavailable: Some(why),
            })
        }
        Err(e) => Err(RunError::Policy(e)),
    }
}

fn load_policy(args: &RunArgs) -> Result<LoadedPolicy, RunError> {
    load_policy_as(args, false)
}

/// The host load's work during a run.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub(crate) struct HogWork {
    /// Busy threads.
    pub threads: usize,
    /// Units of work ([`pvsched_host::hogs::UNIT_STEPS`] xorshift steps) per
    /// second, all threads, while the guest ran its workload.
    pub units_per_s: f64,
}

/// One measured run: the VM's report, the policy's statistics (filled by
/// the caller before it drops the policy) and the host load's work.
pub(crate) struct Measured {
    pub report: RunReport,
    pub stats: Option<VmStats>,
    pub hogs: Option<HogWork>,
    /// CPU time the VM took over the workload's time, s: this process's
    /// (the VMM's threads, an in-process device, an embedded policy) less
    /// the hogs'. A sandboxed device's own process is not in it. `None`
    /// if a CPU-time clock could not be read.
    pub vm_cpu_s: Option<f64>,
}

/// Boots the VM with `policy` wired to it, loads the host with `hogs` busy
/// threads once the guest runs its workload, waits `--duration` printing
/// progress, and shuts the VM down. The hogs' work is counted over the
/// workload's time only, and they stop before the VM shuts down.
pub(crate) fn measure(
    args: &RunArgs,
    policy: Option<&mut Embedded>,
    hogs: usize,
) -> Result<Measured, RunError> {
    let run = match &args.restore {
        Some(dir) => {
            let snap = pvsched_vmm::Snapshot::read(dir).map_err(RunError::Restore)?;
            eprintln!(
                "pvsched run: restoring {}: {} vCPUs, workload {}, {} events before, \
                 in-process device, {}",
                dir.display(),
                snap.state.vcpus,
                snap.state.workload,
                snap.state.events,
                humantime::format_duration(args.duration)
            );
            launch::restore(snap, args.duration, policy)?.run
        }
        None => launch::start(vm_config(args)?, args.duration, policy)?.run,
    };
    let load = Load {
        kind: LoadKind::Busy,
        n: hogs,
    };
    let running = match Hogs::start(load) {
        Ok(h) => h,
        Err(e) => {
            let _ = run.finish();
            return Err(RunError::Hogs(e));
        }
    };
    let counter = running.counter();
    let me = pvsched_util::process_cpu_clock(std::process::id());
    // Everything this process ran but the hogs (none: 0).
    let vm_ns = || {
        let all = pvsched_util::cpu_clock_ns(me?)?;
        Some(all.saturating_sub(if hogs > 0 { counter.cpu_ns()? } else { 0 }))
    };
    let (t0, c0, cpu0) = (Instant::now(), counter.total(), vm_ns());
    wait_with_progress(&run, args.duration);
    let work = counter.total().saturating_sub(c0);
    let secs = t0.elapsed().as_secs_f64();
    let vm_cpu_s = vm_ns()
        .zip(cpu0)
        .map(|(b, a)| b.saturating_sub(a) as f64 / 1e9);
    drop(running);
    let report = match &args.snapshot_to {
        Some(dir) => run.snapshot_to(dir)?,
        None => run.finish(),
    };
    Ok(Measured {
        report,
        stats: None,
        hogs: (hogs > 0 && secs > 0.0).then(|| HogWork {
            threads: hogs,
            units_per_s: work as f64 / secs,
        }),
        vm_cpu_s,
    })
}

/// Prints the summary (table or JSON) with the policy section, if any.
fn print_report(args: &RunArgs, policy: &LoadedPolicy, m: &Measured) -> Result<(), RunError> {
    let name = policy.name;
    let stats = m.stats.as_ref();
    if args.json {
        let mut v = serde_json::to_value(&m.report).map_err(RunError::Json)?;
        if let Some(obj) = v.as_object_mut() {
            let mut p = stats.map_or_else(
                || serde_json::json!({ "name": name }),
                |s| summary::to_json(name, s),
            );
            if let (Some(why), Some(p)) = (&policy.unavailable, p.as_object_mut()) {
                p.insert("unavailable".into(), why.clone().into());
            }
            obj.insert("policy".into(), p);
            if let Some(h) = m.hogs {
                obj.insert(
                    "hogs".into(),
                    serde_json::to_value(h).map_err(RunError::Json)?,
                );
            }
        }
        println!("{v}");
    } else {
        let mut out = std::io::stdout().lock();
        print_table(&mut out, &m.report)
            .and_then(|()| {
                m.hogs.map_or(Ok(()), |h| {
                    writeln!(
                        out,
                        "host load: {} busy threads did {:.3e} units of work per second",
                        h.threads, h.units_per_s
                    )
                })
            })
            .and_then(|()| stats.map_or(Ok(()), |s| summary::print_table(&mut out, name, s)))
            .and_then(|()| {
                policy.unavailable.as_ref().map_or(Ok(()), |why| {
                    writeln!(out, "policy none: the host policy did not load: {why}")
                })
            })
            .map_err(RunError::Write)?;
    }
    Ok(())
}

pub(crate) fn device_mode_name(d: DeviceModeArg) -> &'static str {
    match d {
        DeviceModeArg::Sandboxed => "sandboxed",
        DeviceModeArg::InProcess => "in-process",
    }
}

/// Let `run` go for `duration`, printing a progress line to stderr each second.
fn wait_with_progress(run: &Run, duration: Duration) {
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
}

pub(crate) fn region_name(r: Region) -> &'static str {
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
pub(crate) fn verdict(r: &RunReport) -> Exit {
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

pub(crate) fn us(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"))
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

/// What a workload's latency samples measure.
pub(crate) fn what_is_measured(w: Workload) -> &'static str {
    match w {
        Workload::Wakeup => "latency: MSI injection to the guest handler's acknowledgement",
        Workload::Ipi => "latency: ping round trip (driver), ping one-way (partner)",
        Workload::Spin => "latency: wait_on set until the partner answered",
        Workload::Hostile => "hostile: the device's refusals are listed above",
        Workload::Idle => "idle",
        Workload::Greedy => "greedy: every vCPU asks for FIFO 1 and spins; no latency samples",
    }
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
    writeln!(
        out,
        "{}; host monotonic clock on both ends",
        what_is_measured(r.workload)
    )?;
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
    if r.workload == Workload::Wakeup {
        let sum = |f: fn(&pvsched_vmm::VcpuReport) -> u64| r.per_vcpu.iter().map(f).sum::<u64>();
        let longest = r
            .per_vcpu
            .iter()
            .filter_map(|v| v.inject_max_us)
            .reduce(f64::max);
        writeln!(
            out,
            "stalls over 1 ms: {} ({} with the interrupt still in the VMM's injector); longest injection {} µs",
            sum(|v| v.stalls),
            sum(|v| v.stalls_injector),
            us(longest)
        )?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use pvsched_vmm::{VcpuEnd, VcpuReport};

    /// A one-vCPU wakeup report with handshake status `status`.
    pub(crate) fn report(status: u32) -> RunReport {
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
                stalls: 0,
                stalls_injector: 0,
                inject_max_us: None,
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
