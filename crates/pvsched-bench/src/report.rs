//! The typed parts of a scenario's JSON: one variant's medians, spread and
//! runs, ratios, targets and BPF costs. Each serializes to the documented
//! shape of bench/README.md ("Output").

use serde::Serialize;

pub use pvsched_host::hogs::LoadReport;

/// The smallest and largest value over repetitions.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    /// The spread of the values present in `values`, if any.
    pub fn of(values: &[Option<f64>]) -> Option<Spread> {
        crate::stats::spread(values).map(|(min, max)| Spread { min, max })
    }
}

/// A variant's latency spreads over repetitions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Spreads {
    /// Of the p50s.
    pub p50_us: Option<Spread>,
    /// Of the p99s.
    pub p99_us: Option<Spread>,
    /// Of the maxima.
    pub max_us: Option<Spread>,
}

/// One run's policy numbers: sums over vCPUs plus the VM's totals.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyRun {
    /// Decisions the BPF policy emitted.
    pub decisions: u64,
    /// Decisions lost.
    pub dropped: u64,
    /// Boosts decided, all vCPUs.
    pub boosts: u64,
    /// Boosts applied, all vCPUs.
    pub boosts_applied: u64,
    /// Boosts ended by the caps, all vCPUs.
    pub throttles: u64,
    /// Decisions taken from the guest's slots, all vCPUs.
    pub slot_hits: u64,
    /// IPIs sent, all vCPUs.
    pub ipis: u64,
    /// Decision→applied samples.
    pub apply_samples: usize,
    /// Decision→applied median, µs.
    pub apply_p50_us: f64,
    /// Decision→applied 99th percentile, µs.
    pub apply_p99_us: f64,
    /// On-CPU time the VM's threads ran boosted, all of them, s: what the
    /// boosts took from the host (the caps' budgets bound it).
    pub boosted_s: f64,
}

/// One repetition of a variant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunRow {
    /// 1-based repetition.
    pub rep: usize,
    /// Latency median, µs.
    pub p50_us: Option<f64>,
    /// 90th percentile, µs.
    pub p90_us: Option<f64>,
    /// 99th percentile, µs.
    pub p99_us: Option<f64>,
    /// 99.9th percentile, µs.
    pub p999_us: Option<f64>,
    /// Maximum, µs.
    pub max_us: Option<f64>,
    /// Latency samples.
    pub samples: usize,
    /// Workload events.
    pub events: u64,
    /// Wakeups never acknowledged.
    pub lost_wakeups: u64,
    /// `wakeup`: samples above 1 ms ...
    pub stalls: u64,
    /// ... of which the interrupt was still in the VMM's injector for more
    /// than half of the sample.
    pub stalls_injector: u64,
    /// `wakeup`: the longest injection (timestamp to the end of the
    /// injection ioctl), µs.
    pub inject_max_us: Option<f64>,
    /// VM start to every vCPU in its loop, ms.
    pub start_ms: f64,
    /// The 1-minute load average before the hogs started.
    pub loadavg_1m_before: Option<f64>,
    /// The hogs' iterations over the measured time.
    pub hog_iterations: Option<u64>,
    /// The measured time they were counted over, s.
    pub hog_window_s: Option<f64>,
    /// Iterations per second of measured time.
    pub hog_iterations_per_s: Option<f64>,
    /// The VMM process's CPU time over the measured time (every thread:
    /// vCPUs, injector, an in-process device, the embedded policy), s.
    pub vm_cpu_s: Option<f64>,
    /// The hogs' CPU time over the measured time, s.
    pub hog_cpu_s: Option<f64>,
    /// Workload events per second of the VMM's CPU time.
    pub events_per_vm_cpu_s: Option<f64>,
    /// The policy's numbers (pvsched variants).
    pub policy: Option<PolicyRun>,
    /// `--trace`: the run's vCPU stalls by cause.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<crate::sched_trace::TraceRow>,
}

/// One variant over every repetition: medians, spread, per-rep arrays.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VariantReport {
    /// The test guest's workload.
    pub workload: &'static str,
    /// vCPUs.
    pub vcpus: u32,
    /// Hog threads.
    pub hogs: usize,
    /// The hogs by kind.
    pub load: LoadReport,
    /// `embedded` or `none`.
    pub policy: &'static str,
    /// Which caps, for a pvsched variant.
    pub caps: Option<&'static str>,
    /// Median over repetitions of each run's p50, µs.
    pub p50_us: Option<f64>,
    /// ... of each run's p90.
    pub p90_us: Option<f64>,
    /// ... of each run's p99.
    pub p99_us: Option<f64>,
    /// ... of each run's p99.9.
    pub p999_us: Option<f64>,
    /// ... of each run's maximum.
    pub max_us: Option<f64>,
    /// Each run's p50, in repetition order.
    pub p50_us_reps: Vec<Option<f64>>,
    /// Each run's p99.
    pub p99_us_reps: Vec<Option<f64>>,
    /// Each run's maximum.
    pub max_us_reps: Vec<Option<f64>>,
    /// Spreads over repetitions.
    pub spread: Spreads,
    /// Latency samples, all runs.
    pub samples: usize,
    /// Median of the hogs' iterations.
    pub hog_iterations: Option<f64>,
    /// Median of the hogs' iterations per second.
    pub hog_iterations_per_s: Option<f64>,
    /// The hogs' iterations of each run.
    pub hog_iterations_reps: Vec<Option<f64>>,
    /// Median of the runs' VMM CPU time, s.
    pub vm_cpu_s: Option<f64>,
    /// Median of the runs' hog CPU time, s.
    pub hog_cpu_s: Option<f64>,
    /// Median of the runs' workload events per VMM CPU-second.
    pub events_per_vm_cpu_s: Option<f64>,
    /// Each run's workload events per VMM CPU-second.
    pub events_per_vm_cpu_s_reps: Vec<Option<f64>>,
    /// Every repetition.
    pub runs: Vec<RunRow>,
    /// S3: each run's decision→applied p50, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apply_p50_us_reps: Option<Vec<Option<f64>>>,
    /// S3: ... and p99.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apply_p99_us_reps: Option<Vec<Option<f64>>>,
    /// S3: each run's decisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions_reps: Option<Vec<Option<u64>>>,
    /// S3: this variant's BPF costs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bpf: Option<BpfReport>,
}

/// One variant against another: p50, p99 and max ratios.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Ratios {
    /// p50 over p50.
    pub ratio_p50: Option<f64>,
    /// p99 over p99.
    pub ratio_p99: Option<f64>,
    /// max over max.
    pub ratio_max: Option<f64>,
    /// The VMM's CPU time over the measured time, over the other's.
    pub ratio_vm_cpu_s: Option<f64>,
    /// Workload events per second of the VMM's CPU time, over the other's:
    /// the work done for the host CPU it took.
    pub ratio_events_per_vm_cpu_s: Option<f64>,
}

impl Ratios {
    /// `a` over `b`; every ratio `None` if either is missing.
    pub fn of(a: Option<&VariantReport>, b: Option<&VariantReport>) -> Ratios {
        let r = |f: fn(&VariantReport) -> Option<f64>| {
            crate::stats::ratio(a.and_then(f), b.and_then(f))
        };
        Ratios {
            ratio_p50: r(|v| v.p50_us),
            ratio_p99: r(|v| v.p99_us),
            ratio_max: r(|v| v.max_us),
            ratio_vm_cpu_s: r(|v| v.vm_cpu_s),
            ratio_events_per_vm_cpu_s: r(|v| v.events_per_vm_cpu_s),
        }
    }
}

/// A target: reported, never asserted.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Target {
    /// Short name.
    pub name: &'static str,
    /// What it asks, in words.
    pub goal: &'static str,
    /// The limit.
    pub limit: f64,
    /// The measured value (`None`: not measured).
    pub value: Option<f64>,
    /// Whether the value meets the limit.
    pub met: bool,
}

impl Target {
    /// `value <= limit`.
    pub fn at_most(name: &'static str, goal: &'static str, value: Option<f64>, limit: f64) -> Self {
        Target {
            name,
            goal,
            limit,
            value,
            met: value.is_some_and(|v| v <= limit),
        }
    }

    /// `value >= limit`.
    pub fn at_least(
        name: &'static str,
        goal: &'static str,
        value: Option<f64>,
        limit: f64,
    ) -> Self {
        Target {
            name,
            goal,
            limit,
            value,
            met: value.is_some_and(|v| v >= limit),
        }
    }
}

/// One BPF program's cost.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProgCost {
    /// Program name.
    pub name: String,
    /// Runs.
    pub run_cnt: u64,
    /// Total run time, ns.
    pub run_time_ns: u64,
    /// Run time per run, ns.
    pub ns_per_event: Option<f64>,
    /// Run time per run in the prefilter window (no event of a registered
    /// thread: the early return), ns.
    pub prefilter_ns_per_event: Option<f64>,
    /// Runs past the prefilter (events of registered threads).
    pub full_runs: Option<u64>,
    /// Run time per full run, ns: the run time less the other runs at the
    /// prefilter's cost, over the full runs.
    pub full_ns_per_event: Option<f64>,
}

/// BPF costs per program, the worst and the mean.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BpfReport {
    /// Per program.
    pub programs: Vec<ProgCost>,
    /// The worst program's ns per event.
    pub worst_ns_per_event: Option<f64>,
    /// The worst program's ns per full run (an event of a registered thread).
    pub worst_full_ns_per_event: Option<f64>,
    /// The worst program's ns per prefiltered run.
    pub worst_prefilter_ns_per_event: Option<f64>,
    /// All programs' run time over all their runs.
    pub mean_ns_per_event: Option<f64>,
}

/// `v` as a JSON value (these types always serialize).
pub fn value<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}
