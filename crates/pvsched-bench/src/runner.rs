//! Running one variant of a scenario once: CPU hogs in this process, the
//! measured VM in a child `pvsched-bench run` (see [`super::worker`]),
//! whose [`WorkerMsg`] lines are read here. A child that overruns its time
//! is killed.

use super::BenchError;
use super::hogs::{HogCounter, Hogs, Load};
use super::sched_trace::{self, Recorder, TraceOpts, TraceRow};
use super::stats::{self, Latency};
use super::worker::{BenchDeviceMode, BenchWorkload, VariantPolicy, WorkerMsg, WorkerReport};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Time a child gets beyond its workload's duration (boot, stop, report).
const GRACE: Duration = Duration::from_secs(60);

/// One variant of a scenario.
#[derive(Clone, Debug)]
pub struct Variant {
    /// Key in the JSON (`vanilla`, `pvsched`, `idle_vanilla`, ...).
    pub name: &'static str,
    /// Workload.
    pub workload: BenchWorkload,
    /// vCPUs.
    pub vcpus: u32,
    /// The host policy.
    pub policy: VariantPolicy,
    /// CPU hogs beside the VM ([`Load::NONE`]: idle host).
    pub load: Load,
    /// Stand-in VMs registered beside the measured one (`--extra-vms`).
    pub extra_vms: u32,
    /// Prefilter window before the VM starts, ms (`--prefilter-ms`; 0: none).
    pub prefilter_ms: u64,
}

impl Variant {
    /// Policy name for the JSON.
    pub fn policy_name(&self) -> &'static str {
        if self.policy.enabled() {
            "embedded"
        } else {
            "none"
        }
    }

    /// Caps name for the JSON.
    pub fn caps_name(&self) -> Option<&'static str> {
        match self.policy {
            VariantPolicy::None => None,
            VariantPolicy::Default => Some("default"),
            VariantPolicy::NoYield => Some("default, yield_boost = \"none\""),
            VariantPolicy::WaitOn => Some("default, wait_on = true"),
        }
    }
}

/// What one run gave.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Summary of the raw samples.
    pub latency: Latency,
    /// Raw samples, ns, sorted.
    pub samples: Vec<u64>,
    /// The worker's report, its samples moved to `samples`.
    pub report: WorkerReport,
    /// The 1-minute load average before the hogs started.
    pub loadavg_1m_before: Option<f64>,
    /// The hogs' work during the measured time.
    pub hog: HogWork,
    /// `--trace`: the run's vCPU stalls, named.
    pub trace: Option<TraceRow>,
}

impl Outcome {
    /// The outcome of `report`, its samples sorted and summarised.
    pub fn new(mut report: WorkerReport) -> Self {
        let mut samples = std::mem::take(&mut report.samples_ns);
        let latency = stats::latency(&mut samples);
        Outcome {
            latency,
            samples,
            report,
            ..Outcome::default()
        }
    }
}

/// How every run of a scenario is done.
#[derive(Clone, Debug)]
pub struct RunOpts {
    /// Workload time.
    pub duration: Duration,
    /// Where the device runs.
    pub mode: BenchDeviceMode,
    /// Caps file for the pvsched variants (default caps if `None`).
    pub caps: Option<std::path::PathBuf>,
    /// `--trace`: record each run and name its vCPU threads' stalls.
    pub trace: Option<TraceOpts>,
}

/// Runs `v` once; `tag` names its trace file (`--trace`).
pub fn run(v: &Variant, opts: &RunOpts, tag: &str) -> Result<Outcome, BenchError> {
    let (duration, mode) = (opts.duration, opts.mode);
    let exe = std::env::current_exe().map_err(BenchError::Exe)?;
    // What else ran: the 1-minute load average before the hogs start.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok());
    let hogs = Hogs::start(v.load).map_err(BenchError::Hogs)?;
    let counter = hogs.counter();
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg(format!("--vcpus={}", v.vcpus))
        .arg(format!("--workload={}", v.workload.name()))
        .arg(format!("--duration={}ms", duration.as_millis()))
        .arg(format!(
            "--device-mode={}",
            match mode {
                BenchDeviceMode::InProcess => "in-process",
                BenchDeviceMode::Sandboxed => "sandboxed",
            }
        ));
    cmd.arg(format!("--policy={}", v.policy.name()));
    if let (true, Some(c)) = (v.policy.enabled(), &opts.caps) {
        cmd.arg("--policy-file").arg(c);
    }
    if v.policy.enabled() {
        cmd.arg(format!("--extra-vms={}", v.extra_vms))
            .arg(format!("--prefilter-ms={}", v.prefilter_ms));
    }
    let trace = opts.trace.as_ref().filter(|t| t.wants(v.name));
    // The policy's decisions beside the trace: each stalled sample's boost.
    let decisions = trace
        .filter(|_| v.policy.enabled())
        .map(|t| t.dir.join(format!("{tag}.decisions.jsonl")));
    if let Some(d) = &decisions {
        cmd.arg("--decisions").arg(d);
    }
    let recorder = match trace {
        Some(t) => Some(Recorder::start(t.buffer_kb, t.kvm)?),
        None => None,
    };
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(BenchError::Spawn)?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| BenchError::Spawn(std::io::Error::other("the child has no stdout pipe")))?;
    // Read while waiting: a full pipe would block the child. The reader
    // also counts the hogs' iterations between the child's markers.
    // The VMM's CPU time: its process's clock, all threads (vCPUs, the
    // injector, an in-process device, the embedded policy).
    let worker_clock = pvsched_util::process_cpu_clock(child.id());
    let reader = std::thread::spawn(move || read_child(stdout, &counter, worker_clock));
    let deadline = Instant::now() + duration + Duration::from_millis(v.prefilter_ms) + GRACE;
    let status = loop {
        match child.try_wait().map_err(BenchError::Spawn)? {
            Some(st) => break Some(st),
            None if Instant::now() >= deadline => {
                // Our own child, by its handle.
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let (report, hog) = reader
        .join()
        .map_err(|_| BenchError::Spawn(std::io::Error::other("the reader thread panicked")))?
        .map_err(BenchError::Spawn)?;
    drop(hogs);
    let traced = match (trace, recorder) {
        (Some(t), Some(r)) => {
            let file = t.dir.join(format!("{tag}.trace"));
            let overrun = r.finish(&file)?;
            Some((t, file, overrun))
        }
        _ => None,
    };
    let Some(status) = status else {
        return Err(BenchError::Timeout {
            variant: v.name,
            secs: (duration + GRACE).as_secs(),
        });
    };
    if !status.success() {
        return Err(BenchError::Worker {
            variant: v.name,
            code: status.code(),
        });
    }
    let report = report.map_err(|e| BenchError::Parse {
        variant: v.name,
        source: e,
    })?;
    let trace = match traced {
        Some((t, file, overrun)) => Some(sched_trace::analyse(
            t,
            &file,
            overrun,
            hog.mono,
            &report.stall_windows,
            decisions.as_deref(),
        )?),
        None => None,
    };
    Ok(Outcome {
        loadavg_1m_before: load,
        hog: hog.only_with(v.load.threads()),
        trace,
        ..Outcome::new(report)
    })
}

/// The hogs' work, and the CPU time of the VMM and of the hogs, during a
/// run's measured time (between the worker's [`WorkerMsg::Measuring`] and
/// [`WorkerMsg::Measured`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HogWork {
    /// Iterations counted at the start.
    start: Option<(u64, Instant)>,
    /// Iterations and seconds between the two.
    done: Option<(u64, f64)>,
    /// The two markers' CLOCK_MONOTONIC times, s (a trace's window).
    pub mono: Option<(f64, f64)>,
    /// The first marker's.
    mono_start: Option<f64>,
    /// CPU time at the first marker, ns.
    cpu_start: CpuNow,
    /// CPU time between the markers, ns.
    cpu: CpuNow,
}

/// CPU time so far, ns: the worker process's (every thread of the VMM)
/// and the hogs'. `None` where a clock could not be read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuNow {
    /// The worker process.
    pub vm_ns: Option<u64>,
    /// Every hog thread.
    pub hog_ns: Option<u64>,
}

impl CpuNow {
    /// Read now from the worker's clock and the hogs' counter.
    fn read(worker: Option<libc::clockid_t>, hogs: &HogCounter) -> CpuNow {
        CpuNow {
            vm_ns: worker.and_then(pvsched_util::cpu_clock_ns),
            hog_ns: hogs.cpu_ns(),
        }
    }

    /// `self - before`, field by field.
    fn since(self, before: CpuNow) -> CpuNow {
        let d = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b?));
        CpuNow {
            vm_ns: d(self.vm_ns, before.vm_ns),
            hog_ns: d(self.hog_ns, before.hog_ns),
        }
    }
}

impl HogWork {
    /// `msg` seen with the counters at `total`.
    fn on_msg(&mut self, msg: &WorkerMsg, total: u64, now: Instant, cpu: CpuNow) {
        match msg {
            WorkerMsg::Measuring { .. } => {
                self.start = Some((total, now));
                self.mono_start = Some(sched_trace::mono_s());
                self.cpu_start = cpu;
            }
            WorkerMsg::Measured { .. } => {
                self.mono = self.mono_start.map(|s| (s, sched_trace::mono_s()));
                self.cpu = cpu.since(self.cpu_start);
                if let Some((t0, i0)) = self.start {
                    let secs = now.duration_since(i0).as_secs_f64();
                    self.done = Some((total.saturating_sub(t0), secs));
                }
            }
            WorkerMsg::Report(_) => {}
        }
    }

    /// `iterations` over `secs` of measured time (for tests of what is
    /// built from outcomes).
    #[cfg(test)]
    pub(crate) fn measured(iterations: u64, secs: f64) -> Self {
        HogWork {
            done: Some((iterations, secs)),
            ..HogWork::default()
        }
    }

    /// The hogs' counts only when hogs ran (`threads` > 0); the VMM's CPU
    /// time either way.
    fn only_with(self, threads: usize) -> Self {
        if threads > 0 {
            self
        } else {
            HogWork {
                cpu: CpuNow {
                    vm_ns: self.cpu.vm_ns,
                    hog_ns: None,
                },
                ..Self::default()
            }
        }
    }

    /// The VMM process's CPU time over the measured time, s.
    pub fn vm_cpu_s(self) -> Option<f64> {
        self.cpu.vm_ns.map(|n| n as f64 / 1e9)
    }

    /// The hogs' CPU time over the measured time, s.
    pub fn hog_cpu_s(self) -> Option<f64> {
        self.cpu.hog_ns.map(|n| n as f64 / 1e9)
    }

    /// Iterations of every hog over the measured time.
    pub fn iterations(self) -> Option<u64> {
        self.done.map(|d| d.0)
    }

    /// The measured time the iterations were counted over, s.
    pub fn window_s(self) -> Option<f64> {
        self.done.map(|d| d.1)
    }

    /// Iterations per second of measured time.
    pub fn per_s(self) -> Option<f64> {
        self.done.and_then(|(n, s)| (s > 0.0).then(|| n as f64 / s))
    }
}

/// What went wrong reading the worker's messages.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum ReadError {
    /// The pipe failed.
    #[error("reading the run's output: {0}")]
    Io(#[from] std::io::Error),
    /// A line was no [`WorkerMsg`].
    #[error("a line of the run's output is not a message ({source}): {line}")]
    Json {
        /// The line.
        line: String,
        #[source]
        source: serde_json::Error,
    },
    /// The run ended without its report.
    #[error("the run ended without its report")]
    NoReport,
}

/// Reads the child's messages to the end: the markers drive `HogWork`, the
/// last one is the report.
fn read_child(
    out: impl std::io::Read,
    counter: &HogCounter,
    worker_clock: Option<libc::clockid_t>,
) -> std::io::Result<(Result<WorkerReport, ReadError>, HogWork)> {
    let mut report = Err(ReadError::NoReport);
    let mut hog = HogWork::default();
    for line in BufReader::new(out).lines() {
        let line = line?;
        match serde_json::from_str::<WorkerMsg>(&line) {
            Ok(WorkerMsg::Report(r)) => report = Ok(*r),
            Ok(m) => {
                let mut cpu = CpuNow::read(worker_clock, counter);
                // The worker's own reading: this line may be read after
                // the worker exited and was reaped (its clock gone).
                if let Some(n) = m.cpu_ns() {
                    cpu.vm_ns = Some(n);
                }
                hog.on_msg(&m, counter.total(), Instant::now(), cpu)
            }
            // Keep reading (a full pipe would block the child); the first
            // bad line is the error.
            Err(source) if report.is_err() => report = Err(ReadError::Json { line, source }),
            Err(_) => {}
        }
    }
    Ok((report, hog))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn outcome_moves_samples_out() {
        let o = Outcome::new(WorkerReport {
            ok: true,
            samples_ns: vec![3000, 1000, 2000],
            ..WorkerReport::default()
        });
        assert_eq!(o.samples, vec![1000, 2000, 3000]);
        assert_eq!(o.latency.p50_us, Some(2.0));
        assert_eq!(o.latency.max_us, Some(3.0));
        assert!(o.report.samples_ns.is_empty());
    }

    #[test]
    fn hog_work_counts_between_the_markers() {
        let t = Instant::now();
        let mut h = HogWork::default();
        let cpu = |vm, hog| CpuNow {
            vm_ns: Some(vm),
            hog_ns: Some(hog),
        };
        h.on_msg(
            &WorkerMsg::Measuring { cpu_ns: None },
            100,
            t,
            cpu(1_000_000_000, 0),
        );
        h.on_msg(
            &WorkerMsg::Measured { cpu_ns: None },
            400,
            t + Duration::from_secs(2),
            cpu(2_500_000_000, 1_234_500_000),
        );
        assert_eq!(h.iterations(), Some(300));
        assert_eq!(h.window_s(), Some(2.0));
        assert_eq!(h.per_s(), Some(150.0));
        assert_eq!((h.vm_cpu_s(), h.hog_cpu_s()), (Some(1.5), Some(1.2345)));
        assert_eq!(h.only_with(0).iterations(), None);
        assert_eq!(h.only_with(0).vm_cpu_s(), Some(1.5));
        assert_eq!(h.only_with(0).hog_cpu_s(), None);
        assert_eq!(HogWork::default().per_s(), None);
    }

    fn line(m: &WorkerMsg) -> String {
        serde_json::to_string(m).unwrap() + "\n"
    }

    #[test]
    fn read_child_takes_the_markers_and_the_report() {
        let report = WorkerReport {
            ok: true,
            events: 7,
            ..WorkerReport::default()
        };
        let out = line(&WorkerMsg::Measuring { cpu_ns: None })
            + &line(&WorkerMsg::Measured { cpu_ns: None })
            + &line(&WorkerMsg::Report(Box::new(report.clone())));
        let (r, hog) = read_child(out.as_bytes(), &HogCounter::default(), None).unwrap();
        assert_eq!(r.unwrap(), report);
        assert_eq!(hog.iterations(), Some(0));
        // The worker's own CPU readings give the VMM's CPU time even when
        // its clock cannot be read here (the worker already reaped).
        let out = line(&WorkerMsg::Measuring {
            cpu_ns: Some(2_000_000_000),
        }) + &line(&WorkerMsg::Measured {
            cpu_ns: Some(3_500_000_000),
        }) + &line(&WorkerMsg::Report(Box::new(report.clone())));
        let (_, hog) = read_child(out.as_bytes(), &HogCounter::default(), None).unwrap();
        assert_eq!(hog.vm_cpu_s(), Some(1.5));
        let (r, _) = read_child(&b"not json\n"[..], &HogCounter::default(), None).unwrap();
        assert!(matches!(r, Err(ReadError::Json { .. })), "{r:?}");
        let (r, _) = read_child(
            line(&WorkerMsg::Measuring { cpu_ns: None }).as_bytes(),
            &HogCounter::default(),
            None,
        )
        .unwrap();
        assert!(matches!(r, Err(ReadError::NoReport)), "{r:?}");
    }
}
