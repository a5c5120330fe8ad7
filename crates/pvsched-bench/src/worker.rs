//! `pvsched-bench run` (hidden): one measured run for `pvsched-bench`, in
//! its own process so every repetition starts from a fresh VM, agent and
//! BPF object. It wires the reference VMM and the embedded policy exactly
//! as `pvsched run --policy embedded --region device` does (the agent's
//! BPF map is BAR2's memslot) and talks to the bench in [`WorkerMsg`]
//! lines on stdout: when its measured time starts and ends, then one
//! [`WorkerReport`] with what `pvsched run --json` does not print: every
//! raw latency sample (for the CDF plots), the BPF run time per program
//! and the start-up time.

use super::hogs;
use clap::{Args, ValueEnum};
use pvsched_agent::intf::PROG_NAMES;
use pvsched_agent::object::REEVAL_PROG;
use pvsched_agent::{Agent, AgentConfig, AgentError, RegionSpec, VmHandle, VmSpec};
use pvsched_device::RegionMode;
use pvsched_host::embedded::{Embedded, EmbeddedError};
use pvsched_host::launch::{self, LaunchError, Launched};
use pvsched_host::summary::PolicySummary;
use pvsched_policy::event::EV_TICK;
use pvsched_policy::{BoostKind, Caps, CapsError};
use pvsched_util::exit::Exit;
use pvsched_vmm::{VmConfig, Workload};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What the worker tells the bench, one JSON object per line on stdout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerMsg {
    /// The measured time starts (the guest is in its loops): the bench
    /// counts the hogs' iterations from here...
    Measuring {
        /// The worker process's CPU time now, ns (all its threads), read
        /// by the worker itself: the bench may read this line after the
        /// worker has exited and been reaped, when its clock is gone.
        #[serde(default)]
        cpu_ns: Option<u64>,
    },
    /// ... to here (the policy's stats are read).
    Measured {
        /// As for `Measuring`.
        #[serde(default)]
        cpu_ns: Option<u64>,
    },
    /// The run's results; the last line.
    Report(Box<WorkerReport>),
}

impl WorkerMsg {
    /// The worker's CPU time the message carries.
    pub fn cpu_ns(&self) -> Option<u64> {
        match self {
            WorkerMsg::Measuring { cpu_ns } | WorkerMsg::Measured { cpu_ns } => *cpu_ns,
            WorkerMsg::Report(_) => None,
        }
    }
}

/// This process's CPU time, ns (every thread).
fn own_cpu_ns() -> Option<u64> {
    pvsched_util::cpu_clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// One BPF program's run count and time (`bpf_prog_info`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProgStat {
    /// Program name.
    pub name: String,
    /// Runs.
    pub run_cnt: u64,
    /// Total run time, ns.
    pub run_time_ns: u64,
    /// Runs past the program's prefilter (an event of a registered
    /// thread); `None` for a program with no prefilter.
    #[serde(default)]
    pub full_runs: Option<u64>,
}

/// Every program's run count and time, with the policy's count of runs
/// past each prefilter.
fn prog_stats(agent: &Agent) -> Vec<ProgStat> {
    let st = agent.bpf_stats().ok();
    agent
        .prog_stats()
        .into_iter()
        .map(|(name, run_cnt, run_time_ns)| {
            // The re-evaluation entry has no prefilter; one run of the
            // agent's timer re-evaluates every thread, so its count is
            // the threads re-evaluated (ticks and KICKs).
            let full_runs = if name == REEVAL_PROG {
                st.map(|s| s.events[EV_TICK as usize])
            } else {
                PROG_NAMES
                    .iter()
                    .position(|n| *n == name)
                    .and_then(|i| st.map(|s| s.full_runs[i]))
            };
            ProgStat {
                name,
                run_cnt,
                run_time_ns,
                full_runs,
            }
        })
        .collect()
}

/// CPU time (user + system) this process's agent thread (`pvsched-apply`,
/// which applies decisions and runs the policy's timer) has used, ns;
/// `None` without one.
fn agent_cpu_ns() -> Option<u64> {
    let hz = crate::machine::clock_ticks_per_s()?;
    for e in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let p = e.path();
        if std::fs::read_to_string(p.join("comm")).ok()?.trim() != "pvsched-apply" {
            continue;
        }
        let stat = std::fs::read_to_string(p.join("stat")).ok()?;
        // Fields after the parenthesised comm: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        return ticks.checked_mul(1_000_000_000)?.checked_div(hz);
    }
    None
}

/// `after - before`, program by program.
fn prog_delta(before: &[ProgStat], after: &[ProgStat]) -> Vec<ProgStat> {
    after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.name == a.name);
            let sub = |x: u64, y: Option<u64>| x.saturating_sub(y.unwrap_or(0));
            ProgStat {
                name: a.name.clone(),
                run_cnt: sub(a.run_cnt, b.map(|b| b.run_cnt)),
                run_time_ns: sub(a.run_time_ns, b.map(|b| b.run_time_ns)),
                full_runs: a.full_runs.map(|f| sub(f, b.and_then(|b| b.full_runs))),
            }
        })
        .collect()
}

/// Stand-in VMs registered beside the measured one, to see what the
/// number of registered VMs costs: each has four threads that, once
/// [`ExtraVms::go`] is called, sleep `EXTRA_PERIOD` in a loop (vCPUs whose
/// guests halt at 100 Hz and ask for nothing), a region of its own and the
/// run's caps. Until then they block and make no event, so a prefilter
/// window sees only what their registration costs other threads.
struct ExtraVms {
    stop: Arc<AtomicBool>,
    go: Vec<std::sync::mpsc::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    vms: Vec<VmHandle>,
}

const EXTRA_VCPUS: usize = 4;
const EXTRA_PERIOD: Duration = Duration::from_millis(10);

impl ExtraVms {
    fn start(agent: &Agent, n: u32, caps: &Caps) -> Result<ExtraVms, WorkerError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut extra = ExtraVms {
            stop: stop.clone(),
            go: Vec::new(),
            threads: Vec::new(),
            vms: Vec::new(),
        };
        for _ in 0..n {
            let (tx, rx) = std::sync::mpsc::channel();
            for _ in 0..EXTRA_VCPUS {
                let (stop, tx) = (stop.clone(), tx.clone());
                let (go, wait) = std::sync::mpsc::channel::<()>();
                extra.go.push(go);
                extra.threads.push(std::thread::spawn(move || {
                    let _ = tx.send(pvsched_agent::sched::gettid());
                    // Also returns when the sender is dropped.
                    let _ = wait.recv();
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EXTRA_PERIOD);
                    }
                }));
            }
            let tids: Vec<u32> = rx.iter().take(EXTRA_VCPUS).collect();
            let vm = agent
                .register_vm(VmSpec {
                    apic_ids: (0..tids.len() as u32).collect(),
                    vcpu_tids: tids,
                    emulator_tids: Vec::new(),
                    caps: caps.clone(),
                    region: RegionSpec::DeviceMap,
                    owner: None,
                })
                .map_err(WorkerError::ExtraVm)?;
            extra.vms.push(vm);
        }
        Ok(extra)
    }

    /// The stand-in vCPUs start halting and waking.
    fn go(&mut self) {
        for g in self.go.drain(..) {
            let _ = g.send(());
        }
    }
}

impl Drop for ExtraVms {
    fn drop(&mut self) {
        // Unregistered (each thread restored) while the threads still run.
        self.vms.clear();
        self.stop.store(true, Ordering::Relaxed);
        self.go();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The results of one measured run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    /// The guest reached DRIVER_OK, shut down cleanly, no vCPU faulted and
    /// the device was not lost.
    pub ok: bool,
    /// Workload events, all vCPUs.
    pub events: u64,
    /// `wakeup`: injections never acknowledged.
    pub lost_wakeups: u64,
    /// `wakeup`: samples above 1 ms, all vCPUs ...
    #[serde(default)]
    pub stalls: u64,
    /// ... of which the interrupt was still in the VMM's injector for more
    /// than half of the sample.
    #[serde(default)]
    pub stalls_injector: u64,
    /// `wakeup`: the longest injection (timestamp to the end of the
    /// injection ioctl), µs.
    #[serde(default)]
    pub inject_max_us: Option<f64>,
    /// Wall time the workload ran, s.
    pub duration_s: f64,
    /// VM build to every vCPU in its loop, ms.
    pub start_ms: f64,
    /// The policy's numbers at the end of the measured time (pvsched
    /// variants).
    pub policy: Option<PolicySummary>,
    /// How long the VM had been registered when `policy` was read, s.
    pub policy_s: Option<f64>,
    /// Per vCPU, time boosted, ns.
    pub boosted_ns: Option<Vec<u64>>,
    /// The caps the run used (pvsched variants).
    pub caps: Option<Caps>,
    /// Per BPF program.
    pub prog_stats: Vec<ProgStat>,
    /// Per BPF program, the `--prefilter-ms` window before the VM started
    /// (no thread registered but the `--extra-vms` ones: the prefilter's
    /// early return, on the same loaded host); empty without the window.
    #[serde(default)]
    pub prefilter_stats: Vec<ProgStat>,
    /// Stand-in VMs registered beside the measured one.
    #[serde(default)]
    pub extra_vms: u32,
    /// CPU the agent thread used over the measured window, in CPUs (1.0 =
    /// one CPU all the time; clock-tick resolution).
    #[serde(default)]
    pub agent_cpu: Option<f64>,
    /// Each sample over 1 ms (a `wakeup` stall, an IPI, round trip or spin
    /// that long): the vCPU that recorded it and its window on
    /// CLOCK_MONOTONIC (`--trace` finds where the vCPU thread was then).
    #[serde(default)]
    pub stall_windows: Vec<StallWindow>,
    /// Every latency sample, all vCPUs, ns.
    pub samples_ns: Vec<u64>,
}

/// One sample over 1 ms ([`WorkerReport::stall_windows`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StallWindow {
    /// The vCPU that recorded it (its thread is named `vcpu N`): the one
    /// woken by the injection or the IPI, the sender waiting for its
    /// pong, the spinner.
    pub vcpu: u32,
    /// Its thread's ID (0: unknown).
    #[serde(default)]
    pub tid: i32,
    /// The sample's start, CLOCK_MONOTONIC ns.
    pub from_ns: u64,
    /// Its end, CLOCK_MONOTONIC ns.
    pub to_ns: u64,
}

/// Errors of one measured run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The embedded policy could not be loaded or attached.
    #[error("bench run: {0}")]
    Policy(#[from] EmbeddedError),
    /// The caps file could not be read or is invalid.
    #[error("bench run: {0}")]
    Caps(#[from] CapsError),
    /// The VM could not be launched with its policy.
    #[error("bench run: {0}")]
    Launch(#[from] LaunchError),
    /// A stand-in VM of `--extra-vms` could not be registered.
    #[error("bench run: registering a stand-in VM (--extra-vms) failed: {0}")]
    ExtraVm(#[source] AgentError),
    /// The test guest of this build has no such workload.
    #[error(
        "bench run: the test guest of this build has no `{0}` workload (pvsched-vmm's Workload does not parse \"{0}\"); rebuild with a pvsched-vmm that has it"
    )]
    NoWorkload(&'static str),
}

impl WorkerError {
    fn exit(&self) -> Exit {
        match self {
            WorkerError::Launch(LaunchError::Vm(pvsched_vmm::Error::KvmMissing)) => Exit::NoKvm,
            WorkerError::Launch(LaunchError::Vm(pvsched_vmm::Error::KvmPermission)) => {
                Exit::KvmPermission
            }
            WorkerError::Policy(EmbeddedError::Agent(AgentError::Bpf(_)))
            | WorkerError::Launch(LaunchError::Policy(EmbeddedError::Agent(AgentError::Bpf(_)))) => {
                Exit::PolicyLoad
            }
            WorkerError::Caps(_) => Exit::PolicyFile,
            _ => Exit::Failure,
        }
    }
}

/// Test-guest workloads the bench uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchWorkload {
    /// Interrupt injection → guest handler latency.
    Wakeup,
    /// x2APIC IPI ping-pong round trip.
    Ipi,
    /// wait_on + spin until the partner answers an IPI.
    Spin,
    /// The guest asks for RT forever and spins on every vCPU.
    Greedy,
}

impl BenchWorkload {
    /// The CLI spelling, as the test guest's workload names.
    pub fn name(self) -> &'static str {
        match self {
            BenchWorkload::Wakeup => "wakeup",
            BenchWorkload::Ipi => "ipi",
            BenchWorkload::Spin => "spin",
            BenchWorkload::Greedy => "greedy",
        }
    }

    /// The test guest's workload of that name; an error if this build's
    /// guest does not have it (looked up by name, so the bench builds
    /// against a guest without `greedy`).
    pub fn workload(self) -> Result<Workload, WorkerError> {
        self.name()
            .parse::<Workload>()
            .map_err(|_| WorkerError::NoWorkload(self.name()))
    }
}

/// The host policy of a variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VariantPolicy {
    /// No host policy (vanilla).
    None,
    /// The embedded BPF policy with the run's caps.
    Default,
    /// The same without the directed-yield boost (`yield_boost = "none"`).
    NoYield,
    /// The run's caps with the guest's `wait_on` honoured whatever the
    /// VM's width (`wait_on = true`): S2's spinning VM has more vCPUs than
    /// the host has CPUs, where the default ("auto") lends no yield.
    WaitOn,
}

impl VariantPolicy {
    /// Whether the BPF policy runs.
    pub fn enabled(self) -> bool {
        self != VariantPolicy::None
    }

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            VariantPolicy::None => "none",
            VariantPolicy::Default => "default",
            VariantPolicy::NoYield => "no-yield",
            VariantPolicy::WaitOn => "wait-on",
        }
    }

    /// The caps of this variant from the run's `base` caps (the defaults if
    /// `None`); `None` for no policy.
    pub fn caps(self, base: Option<Caps>) -> Option<Caps> {
        let mut c = base.unwrap_or_default();
        match self {
            VariantPolicy::None => return None,
            VariantPolicy::Default => {}
            VariantPolicy::NoYield => c.yield_boost = BoostKind::None,
            VariantPolicy::WaitOn => c.wait_on = pvsched_policy::WaitOn::On,
        }
        Some(c)
    }
}

/// Where the device runs (as `pvsched run --device-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchDeviceMode {
    /// In the VMM's process: the agent's map is BAR2's memslot.
    InProcess,
    /// In its own sandboxed process (`pvsched device`).
    Sandboxed,
}

/// Arguments of the hidden `pvsched-bench run`.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// vCPUs.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub vcpus: u32,
    /// Workload.
    #[arg(long, value_enum, default_value_t = BenchWorkload::Wakeup)]
    pub workload: BenchWorkload,
    /// How long the workload runs.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// The host policy.
    #[arg(long, value_enum, default_value_t = VariantPolicy::None)]
    pub policy: VariantPolicy,
    /// Where the device runs.
    #[arg(long, value_enum, default_value_t = BenchDeviceMode::InProcess)]
    pub device_mode: BenchDeviceMode,
    /// With --policy: caps from this TOML file instead of the defaults.
    #[arg(long)]
    pub policy_file: Option<std::path::PathBuf>,
    /// With --policy: register this many stand-in VMs (four sleeping
    /// threads each) beside the measured one.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=63))]
    pub extra_vms: u32,
    /// With --policy: before the VM starts, count the BPF programs' runs
    /// for this long with only the stand-in VMs registered.
    #[arg(long, default_value_t = 0)]
    pub prefilter_ms: u64,
    /// With --policy: write every decision record of the policy here, one
    /// JSON object per line (the agent's decision trace; `--trace` reads
    /// each stalled sample's boost from it).
    #[arg(long)]
    pub decisions: Option<std::path::PathBuf>,
}

/// Runs and prints the JSON; returns the exit code.
pub fn main(a: &WorkerArgs) -> Exit {
    pvsched_util::logging::init("warn", pvsched_util::logging::Clock::NoTime);
    match run(a) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{e}");
            e.exit()
        }
    }
}

fn run(a: &WorkerArgs) -> Result<Exit, WorkerError> {
    // vCPU threads inherit this thread's nice: 0, like the hogs.
    hogs::normal_nice0();
    let mut vm = VmConfig::new(a.vcpus, a.workload.workload()?);
    vm.region = RegionMode::Device;
    if a.device_mode == BenchDeviceMode::Sandboxed {
        vm.device_mode = launch::sandboxed_device()?;
    }
    let base = match (&a.policy_file, a.policy.enabled()) {
        (Some(p), true) => Some(Caps::from_file(p)?),
        _ => None,
    };
    let caps = a.policy.caps(base);
    let mut policy = match &caps {
        Some(c) => Some(Embedded::load(
            c.clone(),
            AgentConfig {
                trace: a.decisions.clone(),
                ..AgentConfig::default()
            },
        )?),
        None => None,
    };
    let mut extra = match (policy.as_ref().and_then(Embedded::agent), &caps) {
        (Some(agent), Some(c)) if a.extra_vms > 0 => Some(ExtraVms::start(agent, a.extra_vms, c)?),
        _ => None,
    };
    let prefilter_stats = match policy.as_ref().and_then(Embedded::agent) {
        Some(agent) if a.prefilter_ms > 0 => {
            let before = prog_stats(agent);
            std::thread::sleep(Duration::from_millis(a.prefilter_ms));
            prog_delta(&before, &prog_stats(agent))
        }
        _ => Vec::new(),
    };
    if let Some(e) = extra.as_mut() {
        e.go();
    }
    let t0 = Instant::now();
    let Launched { run, attached } = launch::start(vm, a.duration, policy.as_mut())?;
    let start_ms = t0.elapsed().as_secs_f64() * 1e3;
    let monitor = run.vm().monitor().clone();
    send(&WorkerMsg::Measuring {
        cpu_ns: own_cpu_ns(),
    });
    let cpu0 = (Instant::now(), agent_cpu_ns());
    std::thread::sleep(a.duration);
    let agent_cpu = match (cpu0, agent_cpu_ns()) {
        ((t, Some(c0)), Some(c1)) => {
            Some(c1.saturating_sub(c0) as f64 / 1e9 / t.elapsed().as_secs_f64())
        }
        _ => None,
    };
    // The policy's numbers at the end of the measured time; then the VM
    // is unregistered (every vCPU thread back at its baseline) while its
    // threads still exist, and only then stopped. The agent's map stays
    // mapped as BAR2's backing until `policy` is dropped, after the VM.
    let stats = policy.as_ref().and_then(Embedded::stats);
    // How long the VM had been registered (boot + workload) when its
    // stats were read: the time its boosted_ns were collected over.
    let policy_s = attached.map(|t| t.elapsed().as_secs_f64());
    send(&WorkerMsg::Measured {
        cpu_ns: own_cpu_ns(),
    });
    let prog_stats = policy
        .as_ref()
        .and_then(Embedded::agent)
        .map(prog_stats)
        .unwrap_or_default();
    drop(extra);
    if let Some(p) = policy.as_mut() {
        p.detach();
    }
    let report = run.finish();
    drop(policy);
    let samples: Vec<u64> = (0..monitor.nr_vcpus())
        .flat_map(|v| monitor.stats(v).samples_ns)
        .collect();
    let tids: Vec<i32> = (0..monitor.nr_vcpus())
        .map(|v| {
            report
                .per_vcpu
                .iter()
                .find(|r| r.index == v)
                .map_or(0, |r| r.tid)
        })
        .collect();
    let stall_windows: Vec<StallWindow> = (0..monitor.nr_vcpus())
        .flat_map(|v| {
            let m = &monitor;
            let tid = tids.get(v as usize).copied().unwrap_or(0);
            m.stats(v)
                .stall_windows
                .into_iter()
                .map(move |(at, len)| StallWindow {
                    vcpu: v,
                    tid,
                    from_ns: m.mono_ns(at),
                    to_ns: m.mono_ns(at).saturating_add(len),
                })
        })
        .collect();
    let ok = report.driver_ok()
        && report.clean_shutdown
        && report.device_lost.is_none()
        && report.per_vcpu.iter().all(|v| v.fault.is_none());
    send(&WorkerMsg::Report(Box::new(WorkerReport {
        ok,
        events: report.events,
        lost_wakeups: report.lost_wakeups,
        stalls: report.per_vcpu.iter().map(|v| v.stalls).sum(),
        stalls_injector: report.per_vcpu.iter().map(|v| v.stalls_injector).sum(),
        inject_max_us: report
            .per_vcpu
            .iter()
            .filter_map(|v| v.inject_max_us)
            .reduce(f64::max),
        duration_s: report.duration_s,
        start_ms,
        policy: stats.as_ref().map(|s| PolicySummary::new("embedded", s)),
        policy_s,
        boosted_ns: stats
            .as_ref()
            .map(|s| s.vcpus.iter().map(|v| v.counters.boosted_ns).collect()),
        caps,
        prog_stats,
        prefilter_stats,
        extra_vms: a.extra_vms,
        agent_cpu,
        stall_windows,
        samples_ns: samples,
    })));
    if !ok {
        eprintln!(
            "bench run: the guest did not run cleanly (handshake {}, clean shutdown {})",
            report.handshake, report.clean_shutdown
        );
        return Ok(Exit::Guest);
    }
    Ok(Exit::Ok)
}

/// One message line on stdout, flushed at once (the bench reads it live).
fn send(msg: &WorkerMsg) {
    let mut out = std::io::stdout().lock();
    // A message always serializes (no maps with non-string keys).
    if let Ok(line) = serde_json::to_string(msg) {
        let _ = writeln!(out, "{line}");
    }
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_yield_caps_disable_only_the_yield_boost() {
        let c = VariantPolicy::NoYield.caps(None).unwrap();
        assert_eq!(c.yield_boost, BoostKind::None);
        assert_eq!(
            Caps {
                yield_boost: Caps::default().yield_boost,
                ..c
            },
            Caps::default()
        );
        assert_eq!(VariantPolicy::Default.caps(None), Some(Caps::default()));
        assert_eq!(VariantPolicy::None.caps(None), None);
        let c = VariantPolicy::WaitOn.caps(None).unwrap();
        assert_eq!(
            (
                c.wait_on,
                Caps {
                    wait_on: Caps::default().wait_on,
                    ..c
                }
            ),
            (pvsched_policy::WaitOn::On, Caps::default())
        );
        let base = Caps {
            max_boost_us: 0,
            ..Caps::default()
        };
        assert_eq!(VariantPolicy::Default.caps(Some(base.clone())), Some(base));
    }

    #[test]
    fn messages_are_one_tagged_json_line_each() {
        let r = WorkerMsg::Report(Box::new(WorkerReport {
            ok: true,
            samples_ns: vec![3, 1],
            ..WorkerReport::default()
        }));
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n') && line.contains(r#""event":"report""#));
        assert_eq!(serde_json::from_str::<WorkerMsg>(&line).unwrap(), r);
        assert_eq!(
            serde_json::to_string(&WorkerMsg::Measuring { cpu_ns: Some(7) }).unwrap(),
            r#"{"event":"measuring","cpu_ns":7}"#
        );
        // A line without the CPU time (an older worker) still parses.
        assert_eq!(
            serde_json::from_str::<WorkerMsg>(r#"{"event":"measured"}"#).unwrap(),
            WorkerMsg::Measured { cpu_ns: None }
        );
    }

    #[test]
    fn workloads_by_name() {
        for w in [
            BenchWorkload::Wakeup,
            BenchWorkload::Ipi,
            BenchWorkload::Spin,
        ] {
            assert_eq!(w.workload().unwrap().name(), w.name());
        }
        // `greedy` resolves only if this build's test guest has it.
        match BenchWorkload::Greedy.workload() {
            Ok(w) => assert_eq!(w.name(), "greedy"),
            Err(e) => assert!(e.to_string().contains("no `greedy` workload"), "{e}"),
        }
    }
}
