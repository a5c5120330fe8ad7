//! Scenarios S1–S3 and S5: which variants run, how a repetition runs
//! them (and the idle host's floor) in an order that rotates from one
//! repetition to the next, and how their runs become the typed report:
//! medians and spread per variant, ratios paired per repetition, targets
//! with verdicts.

use super::BenchError;
use super::costs;
use super::floor::{self, Floor};
use super::hogs::{Hogs, Load};
use super::plot::Series;
use super::report::{
    BpfReport, Comparison, CostsReport, FloorReport, FloorRow, GreedyReport, GreedyRun, GreedyVcpu,
    Handshake, Options, PolicyRun, ProgCost, RunRow, ScalingRow, ScenarioReport, Side, Spread,
    Spreads, Target, VariantReport,
};
use super::runner::{self, Outcome, RunOpts, Variant};
use super::stats::{self, median, ratio};
use super::worker::{BenchWorkload, VariantPolicy};
use pvsched_agent::object::REEVAL_PROG;
use pvsched_host::summary::PolicySummary;
use std::collections::BTreeMap;
use std::path::Path;

/// S1–S3 and S5 (S4 and S6 boot Linux guests: `s4.rs`, `s6.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Wakeup latency, loaded host vs idle host.
    S1,
    /// IPI / spin round trips, vCPUs > pCPUs.
    S2,
    /// Costs.
    S3,
    /// A greedy guest (RT asked forever, every vCPU spinning) beside
    /// busy hogs: the caps' budget holds and the hogs keep their CPU.
    S5,
}

impl Scenario {
    /// `s1`, `s2`, `s3`, `s5`.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::S1 => "s1",
            Scenario::S2 => "s2",
            Scenario::S3 => "s3",
            Scenario::S5 => "s5",
        }
    }

    /// Hogs of the loaded variants when `--hogs` is not given, for
    /// `cpus` online CPUs: S1 two per CPU (so that vanilla's loaded tail
    /// shows the problem), the others one per CPU.
    pub fn default_hogs(self, cpus: usize) -> usize {
        match self {
            Scenario::S1 => 2 * cpus,
            _ => cpus,
        }
    }
}

fn v(
    name: &'static str,
    workload: BenchWorkload,
    vcpus: u32,
    policy: VariantPolicy,
    load: Load,
) -> Variant {
    Variant {
        name,
        workload,
        vcpus,
        policy,
        load,
        extra_vms: 0,
        prefilter_ms: 0,
    }
}

/// An S3 variant: `extra_vms` stand-in VMs beside the measured one, and a
/// prefilter window before it starts.
fn cost(
    name: &'static str,
    workload: BenchWorkload,
    vcpus: u32,
    extra_vms: u32,
    load: Load,
) -> Variant {
    Variant {
        extra_vms,
        prefilter_ms: S3_PREFILTER_MS,
        ..v(name, workload, vcpus, VariantPolicy::Default, load)
    }
}

/// S3's prefilter window per run: at ~20,000 host scheduler events a
/// second, enough runs for a stable mean.
const S3_PREFILTER_MS: u64 = 2000;

/// The variants of `s`, in run order within a repetition; `hogs` (CPU
/// hogs) load the host of every variant but S1's idle ones.
pub fn variants(s: Scenario, hogs: Load) -> Vec<Variant> {
    use BenchWorkload::*;
    use VariantPolicy::{Default as Pvsched, NoYield, None as Vanilla, WaitOn};
    match s {
        Scenario::S1 => vec![
            v("vanilla", Wakeup, 2, Vanilla, hogs),
            v("pvsched", Wakeup, 2, Pvsched, hogs),
            v("idle_vanilla", Wakeup, 2, Vanilla, Load::NONE),
            v("idle_pvsched", Wakeup, 2, Pvsched, Load::NONE),
        ],
        Scenario::S2 => vec![
            v("vanilla", Ipi, 4, Vanilla, hogs),
            v("pvsched", Ipi, 4, Pvsched, hogs),
            v("no_yield", Ipi, 4, NoYield, hogs),
            v("spin_vanilla", Spin, 4, Vanilla, hogs),
            // Four vCPUs on two CPUs: wider than the host, where the
            // default lends no yield for wait_on; these measure the yield.
            v("spin_pvsched", Spin, 4, WaitOn, hogs),
            v("spin_no_yield", Spin, 4, NoYield, hogs),
        ],
        // The measured VM alone, then beside 15 and 63 stand-in VMs
        // (1, 16 and 64 registered VMs; 64 is the agent's limit).
        Scenario::S3 => vec![
            cost("wakeup", Wakeup, 2, 0, hogs),
            cost("ipi", Ipi, 4, 0, hogs),
            cost("ipi_16vms", Ipi, 4, 15, hogs),
            cost("ipi_64vms", Ipi, 4, 63, hogs),
        ],
        Scenario::S5 => vec![
            v("vanilla", Greedy, 2, Vanilla, hogs),
            v("pvsched", Greedy, 2, Pvsched, hogs),
        ],
    }
}

/// One repetition of a variant: its place in the repetition's run order
/// and what it gave (or why it gave nothing).
pub struct Rep {
    /// 0-based place in its repetition's run order.
    pub order: usize,
    /// The run, or why it failed.
    pub outcome: Result<Outcome, String>,
}

impl Rep {
    /// The run's outcome, if it finished.
    pub fn ok(&self) -> Option<&Outcome> {
        self.outcome.as_ref().ok()
    }
}

/// Every run of one variant, in repetition order (index = repetition).
pub struct Runs {
    /// The variant.
    pub variant: Variant,
    /// One per repetition.
    pub reps: Vec<Rep>,
}

impl Runs {
    /// The runs that finished.
    pub fn outcomes(&self) -> impl Iterator<Item = &Outcome> {
        self.reps.iter().filter_map(Rep::ok)
    }
}

/// One repetition's idle-host floor.
pub struct FloorRun {
    /// 0-based place in its repetition's run order.
    pub order: usize,
    /// The floor, or why cyclictest gave none.
    pub floor: Result<Floor, String>,
}

/// Everything a scenario ran.
pub struct Executed {
    /// Per variant.
    pub runs: Vec<Runs>,
    /// The idle host's floor per repetition (`None`: not measured).
    pub floor: Option<Vec<FloorRun>>,
    /// The floor beside the loaded variants' hogs per repetition (`None`:
    /// not measured, or no variant is loaded).
    pub floor_loaded: Option<Vec<FloorRun>>,
}

/// The place in a repetition of step `j` of `k`, repetition `rep`
/// (0-based): repetition r starts at step r mod k, so over k repetitions
/// every variant runs first once, and a drift within a repetition (the
/// host warming, a neighbour arriving) does not always favour the same
/// variant.
fn rotated(rep: usize, j: usize, k: usize) -> usize {
    (rep + j) % k
}

/// Whether `e` is one run's failure, counted in its variant's `failed`,
/// rather than the bench's own (no KVM, no BPF, no hogs...), which stops
/// the scenario.
fn is_run_failure(e: &BenchError) -> bool {
    match e {
        BenchError::Worker { code, .. } => !matches!(code, Some(3..=8)),
        BenchError::Timeout { .. } | BenchError::Parse { .. } => true,
        _ => false,
    }
}

/// Runs `reps` repetitions of `variants` and, with `cyclictest`, the
/// host's floor (idle, and beside the loaded variants' hogs when there
/// are any); within repetition r the steps run in their order rotated by
/// r. A failed run is recorded and the repetitions go on.
pub fn execute(
    scenario: Scenario,
    variants: Vec<Variant>,
    reps: u32,
    opts: &RunOpts,
    cyclictest: Option<&Path>,
) -> Result<Executed, BenchError> {
    // The loaded floor runs beside the hogs of the first loaded variant.
    let load = variants.iter().map(|v| v.load).find(|l| l.threads() > 0);
    let mut all: Vec<Runs> = variants
        .into_iter()
        .map(|variant| Runs {
            variant,
            reps: Vec::new(),
        })
        .collect();
    let mut floors = cyclictest.map(|_| Vec::new());
    let mut loaded_floors = cyclictest.and(load).map(|_| Vec::new());
    let k = all.len() + usize::from(floors.is_some()) + usize::from(loaded_floors.is_some());
    for rep in 0..reps as usize {
        let shown = rep + 1;
        for order in 0..k {
            let step = rotated(rep, order, k);
            let name = scenario.name();
            if let Some(bin) = cyclictest
                && step >= all.len()
            {
                let loaded = step > all.len();
                let (what, hogs) = if loaded {
                    ("floor_loaded", load)
                } else {
                    ("floor", None)
                };
                let f = measure_floor(bin, opts, hogs, &format!("{name}-rep{shown}-{what}"));
                match &f {
                    Ok(f) => eprintln!(
                        "[{name} rep {shown}/{reps}] {what:<14} p99 {:>9} max {:>9} µs  ({} host, cyclictest, {} samples, stolen {} ms)",
                        fmt(f.p99_us),
                        fmt(f.max_us),
                        if loaded { "loaded" } else { "idle" },
                        f.samples,
                        fmt(f.steal_ms)
                    ),
                    Err(e) => eprintln!("[{name} rep {shown}/{reps}] {what} FAILED: {e}"),
                }
                let into = if loaded {
                    loaded_floors.as_mut()
                } else {
                    floors.as_mut()
                };
                if let Some(v) = into {
                    v.push(FloorRun { order, floor: f });
                }
                continue;
            }
            let r = &mut all[step];
            let tag = format!("{name}-rep{shown}-{}", r.variant.name);
            let outcome = match runner::run(&r.variant, opts, &tag) {
                Ok(o) => {
                    let l = &o.latency;
                    eprintln!(
                        "[{name} rep {shown}/{reps}] {:<14} p50 {:>8} p99 {:>9} max {:>9} µs  ({} samples{}{})",
                        r.variant.name,
                        fmt(l.p50_us),
                        fmt(l.p99_us),
                        fmt(l.max_us),
                        l.samples,
                        hog_brief(&o),
                        policy_brief(&o)
                    );
                    if let Some(t) = &o.trace {
                        eprintln!(
                            "[{name} rep {shown}/{reps}] {:<14} {}",
                            r.variant.name,
                            t.brief()
                        );
                    }
                    Ok(o)
                }
                Err(e) if is_run_failure(&e) => {
                    eprintln!(
                        "[{name} rep {shown}/{reps}] {:<14} FAILED: {e}",
                        r.variant.name
                    );
                    Err(e.to_string())
                }
                Err(e) => return Err(e),
            };
            r.reps.push(Rep { order, outcome });
        }
    }
    Ok(Executed {
        runs: all,
        floor: floors,
        floor_loaded: loaded_floors,
    })
}

/// One floor measurement, beside `hogs` when given (started before and
/// stopped after it, like a loaded variant's).
fn measure_floor(
    bin: &Path,
    opts: &RunOpts,
    hogs: Option<Load>,
    tag: &str,
) -> Result<Floor, String> {
    let _hogs = match hogs {
        Some(l) => Some(Hogs::start(l).map_err(|e| format!("starting the hogs: {e}"))?),
        None => None,
    };
    floor::measure(bin, opts.duration, tag).map_err(|e| e.to_string())
}

/// Runs that failed, over every variant and the floor.
pub fn failed_runs(ex: &Executed) -> usize {
    let runs = ex
        .runs
        .iter()
        .flat_map(|r| &r.reps)
        .filter(|r| r.outcome.is_err())
        .count();
    let floors = [&ex.floor, &ex.floor_loaded]
        .into_iter()
        .flatten()
        .flatten()
        .filter(|f| f.floor.is_err())
        .count();
    runs + floors
}

fn fmt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

fn hog_brief(o: &Outcome) -> String {
    match o.hog.per_s() {
        Some(r) => format!(", hogs {:.3e} it/s", r),
        None => String::new(),
    }
}

fn policy_brief(o: &Outcome) -> String {
    let Some(r) = policy_run(o.report.policy.as_ref()) else {
        return String::new();
    };
    format!(
        ", boosts {}, throttles {}, boosted {:.2} s, apply p50 {} p99 {} µs",
        r.boosts, r.throttles, r.boosted_s, r.apply_p50_us, r.apply_p99_us
    )
}

/// The per-run policy numbers: sums over vCPUs plus the VM's totals.
fn policy_run(p: Option<&PolicySummary>) -> Option<PolicyRun> {
    let p = p?;
    Some(PolicyRun {
        decisions: p.decisions,
        dropped: p.dropped,
        boosts: p.vcpu_sum(|v| v.boosts),
        boosts_applied: p.vcpu_sum(|v| v.boosts_applied),
        throttles: p.vcpu_sum(|v| v.throttles),
        slot_hits: p.vcpu_sum(|v| v.slot_hits),
        ipis: p.vcpu_sum(|v| v.ipis),
        apply_samples: p.apply_samples,
        apply_p50_us: p.apply_p50_us,
        apply_p99_us: p.apply_p99_us,
        boosted_s: (p.per_vcpu.iter().map(|v| v.boosted_ms).sum::<f64>()
            + p.emulators.iter().map(|e| e.boosted_ms).sum::<f64>())
            / 1e3,
    })
}

/// One repetition's row: its figures, or its error.
fn run_row(i: usize, rep: &Rep) -> RunRow {
    let x = match &rep.outcome {
        Ok(x) => x,
        Err(e) => {
            return RunRow {
                rep: i + 1,
                order: rep.order,
                error: Some(e.clone()),
                ..RunRow::default()
            };
        }
    };
    let l = &x.latency;
    let vm_cpu_s = x.hog.vm_cpu_s();
    RunRow {
        rep: i + 1,
        order: rep.order,
        error: None,
        p50_us: l.p50_us,
        p90_us: l.p90_us,
        p99_us: l.p99_us,
        p999_us: l.p999_us,
        max_us: l.max_us,
        samples: l.samples,
        events: x.report.events,
        lost_wakeups: x.report.lost_wakeups,
        stalls: x.report.stalls,
        stalls_injector: x.report.stalls_injector,
        inject_max_us: x.report.inject_max_us,
        start_ms: Some(x.report.start_ms),
        loadavg_1m_before: x.loadavg_1m_before,
        hog_iterations: x.hog.iterations(),
        hog_window_s: x.hog.window_s(),
        hog_iterations_per_s: x.hog.per_s(),
        vm_cpu_s,
        hog_cpu_s: x.hog.hog_cpu_s(),
        events_per_vm_cpu_s: vm_cpu_s
            .filter(|&c| c > 0.0)
            .map(|c| x.report.events as f64 / c),
        policy: policy_run(x.report.policy.as_ref()),
        trace: x.trace.clone(),
    }
}

/// One variant over every repetition: its rows, medians and spread.
pub fn variant_report(r: &Runs) -> VariantReport {
    let runs: Vec<RunRow> = r
        .reps
        .iter()
        .enumerate()
        .map(|(i, x)| run_row(i, x))
        .collect();
    let col = |f: fn(&RunRow) -> Option<f64>| -> Vec<Option<f64>> { runs.iter().map(f).collect() };
    let p50 = col(|x| x.p50_us);
    let p99 = col(|x| x.p99_us);
    let max = col(|x| x.max_us);
    let hog_rate = col(|x| x.hog_iterations_per_s);
    let failed = runs.iter().filter(|x| x.error.is_some()).count();
    let v = &r.variant;
    VariantReport {
        workload: v.workload.name().into(),
        vcpus: v.vcpus,
        hogs: v.load.threads(),
        load: v.load.report(),
        policy: v.policy_name().into(),
        caps: v.caps_name().map(Into::into),
        n: runs.len() - failed,
        failed,
        p50_us: median(&p50),
        p90_us: median(&col(|x| x.p90_us)),
        p99_us: median(&p99),
        p999_us: median(&col(|x| x.p999_us)),
        max_us: median(&max),
        spread: Spreads {
            p50_us: Spread::of(&p50),
            p99_us: Spread::of(&p99),
            max_us: Spread::of(&max),
            hog_iterations_per_s: Spread::of(&hog_rate),
        },
        samples: runs.iter().map(|x| x.samples).sum(),
        hog_iterations_per_s: median(&hog_rate),
        vm_cpu_s: median(&col(|x| x.vm_cpu_s)),
        hog_cpu_s: median(&col(|x| x.hog_cpu_s)),
        events_per_vm_cpu_s: median(&col(|x| x.events_per_vm_cpu_s)),
        runs,
        bpf: None,
    }
}

/// Every variant's report, by name.
type Reports = BTreeMap<String, VariantReport>;

fn reports(runs: &[Runs]) -> Reports {
    runs.iter()
        .map(|r| (r.variant.name.to_owned(), variant_report(r)))
        .collect()
}

/// The comparisons `(name, test, base)` present in `v`, by name.
fn comparisons(v: &Reports, which: &[(&str, &str, &str)]) -> BTreeMap<String, Comparison> {
    which
        .iter()
        .filter_map(|&(name, test, base)| {
            Some((
                name.to_owned(),
                Comparison::of(test, v.get(test)?, base, v.get(base)?),
            ))
        })
        .collect()
}

/// The floor's report, if it was measured.
fn floor_report(floor: Option<&[FloorRun]>, tool: &str) -> Option<FloorReport> {
    let runs: Vec<FloorRow> = floor?
        .iter()
        .enumerate()
        .map(|(i, f)| match &f.floor {
            Ok(x) => FloorRow {
                rep: i + 1,
                order: f.order,
                error: None,
                p99_us: x.p99_us,
                max_us: x.max_us,
                samples: x.samples,
                steal_ms: x.steal_ms,
            },
            Err(e) => FloorRow {
                rep: i + 1,
                order: f.order,
                error: Some(e.clone()),
                ..FloorRow::default()
            },
        })
        .collect();
    let failed = runs.iter().filter(|r| r.error.is_some()).count();
    Some(FloorReport {
        tool: format!("cyclictest -m -S -p 99 -i 1000 --default-system, no VM, {tool}"),
        n: runs.len() - failed,
        failed,
        p99_us: median(&runs.iter().map(|r| r.p99_us).collect::<Vec<_>>()),
        max_us: median(&runs.iter().map(|r| r.max_us).collect::<Vec<_>>()),
        runs,
    })
}

/// `variant`'s max over the floor's max of the same repetition, per
/// repetition.
fn max_vs_floor(v: &Reports, variant: &str, floor: Option<&FloorReport>) -> Vec<Option<f64>> {
    match (v.get(variant), floor) {
        (Some(p), Some(f)) => p
            .runs
            .iter()
            .zip(&f.runs)
            .map(|(x, f)| ratio(x.max_us, f.max_us))
            .collect(),
        _ => Vec::new(),
    }
}

/// Vanilla's loaded p99 over its idle p99 at or above which S1's load
/// shows the problem pvsched is for.
pub const LOAD_SHOWS_PROBLEM: f64 = 5.0;

/// `test`'s max over the same repetition's `base` max, per repetition.
fn max_per_rep(v: &Reports, test: &str, base: &str) -> Vec<Option<f64>> {
    let (Some(t), Some(b)) = (v.get(test), v.get(base)) else {
        return Vec::new();
    };
    t.runs
        .iter()
        .zip(&b.runs)
        .map(|(x, y)| ratio(x.max_us, y.max_us))
        .collect()
}

/// A comparison's figure, or an empty one if the comparison is missing.
fn fig(
    r: &BTreeMap<String, Comparison>,
    name: &str,
    f: fn(&Comparison) -> &crate::paired::Paired,
) -> crate::paired::Paired {
    r.get(name)
        .map(f)
        .cloned()
        .unwrap_or_else(|| crate::paired::paired(&[], &[]))
}

/// The scenario's report from what it ran.
pub fn assemble(
    s: Scenario,
    ex: &Executed,
    command: String,
    options: Options,
) -> Result<ScenarioReport, BenchError> {
    let mut report = ScenarioReport {
        scenario: s.name().into(),
        machine: crate::machine::describe(),
        command,
        options,
        variants: reports(&ex.runs),
        ratios: BTreeMap::new(),
        floor: floor_report(ex.floor.as_deref(), "no hogs"),
        floor_loaded: floor_report(
            ex.floor_loaded.as_deref(),
            "beside the loaded variants' hogs",
        ),
        load_shows_problem: None,
        targets: Vec::new(),
        costs: None,
        greedy: None,
    };
    match s {
        Scenario::S1 => s1(&mut report),
        Scenario::S2 => s2(&mut report),
        Scenario::S3 => s3(&ex.runs, &mut report)?,
        Scenario::S5 => s5(&ex.runs, &mut report),
    }
    Ok(report)
}

fn s1(rep: &mut ScenarioReport) {
    let v = &rep.variants;
    rep.ratios = comparisons(
        v,
        &[
            ("pvsched", "pvsched", "vanilla"),
            ("idle", "idle_pvsched", "idle_vanilla"),
            ("vanilla_loaded_vs_idle", "vanilla", "idle_vanilla"),
            ("pvsched_loaded_vs_idle", "pvsched", "idle_vanilla"),
        ],
    );
    let r = &rep.ratios;
    // Whether the load showed the problem at all: without it the latency
    // targets say little.
    rep.load_shows_problem =
        Some(fig(r, "vanilla_loaded_vs_idle", |c| &c.p99_us).at_least(LOAD_SHOWS_PROBLEM));
    // pvsched's max against the host's own in the same repetition: the
    // idle host's, and an RT thread's beside the same hogs.
    let vs_floor = max_vs_floor(v, "pvsched", rep.floor.as_ref());
    let vs_loaded_floor = max_vs_floor(v, "pvsched", rep.floor_loaded.as_ref());
    rep.targets = vec![
        Target::paired(
            "s1_p99_vs_idle",
            "loaded host: pvsched p99 <= 1.0x the idle host's p99 (idle_vanilla), paired per repetition",
            &fig(r, "pvsched_loaded_vs_idle", |c| &c.p99_us),
            Side::AtMost,
            1.0,
        ),
        Target::paired(
            "s1_p99_ratio",
            "loaded host: pvsched p99 <= 0.05x vanilla p99, paired per repetition",
            &fig(r, "pvsched", |c| &c.p99_us),
            Side::AtMost,
            0.05,
        ),
        Target::paired(
            "s1_max_ratio",
            "loaded host: pvsched max <= 0.1x vanilla max, paired per repetition",
            &fig(r, "pvsched", |c| &c.max_us),
            Side::AtMost,
            0.1,
        ),
        Target::every_rep(
            "s1_max_every_rep",
            "loaded host: pvsched max <= 0.2x the same repetition's vanilla max, in every repetition",
            &max_per_rep(v, "pvsched", "vanilla"),
            Side::AtMost,
            0.2,
        ),
        Target::every_rep(
            "s1_max_vs_floor",
            "loaded host: pvsched max <= the idle host's floor max (cyclictest, same repetition), in every repetition",
            &vs_floor,
            Side::AtMost,
            1.0,
        ),
        Target::every_rep(
            "s1_max_vs_loaded_floor",
            "loaded host: pvsched max <= the loaded host's floor max (cyclictest beside the same hogs, same repetition), in every repetition",
            &vs_loaded_floor,
            Side::AtMost,
            1.0,
        ),
        Target::paired(
            "s1_host_cost",
            "pvsched hog iterations >= 0.95x vanilla (per second of measured time), paired per repetition",
            &fig(r, "pvsched", |c| &c.hog_iterations_per_s),
            Side::AtLeast,
            0.95,
        ),
    ];
}

fn s2(rep: &mut ScenarioReport) {
    let v = &rep.variants;
    rep.ratios = comparisons(
        v,
        &[
            ("pvsched", "pvsched", "vanilla"),
            ("no_yield", "no_yield", "vanilla"),
            ("spin", "spin_pvsched", "spin_vanilla"),
            ("spin_no_yield", "spin_no_yield", "spin_vanilla"),
        ],
    );
    let r = &rep.ratios;
    rep.targets = vec![
        Target::paired(
            "ipi_p99_ratio",
            "ipi round trip: pvsched p99 <= 0.2x vanilla p99, paired per repetition",
            &fig(r, "pvsched", |c| &c.p99_us),
            Side::AtMost,
            0.2,
        ),
        Target::paired(
            "spin_p99_ratio",
            "spin (wait_on) round trip: pvsched p99 <= 0.3x vanilla p99, paired per repetition",
            &fig(r, "spin", |c| &c.p99_us),
            Side::AtMost,
            0.3,
        ),
        Target::every_rep(
            "ipi_max_ratio",
            "ipi round trip: pvsched max <= 1.0x the same repetition's vanilla max, in every repetition",
            &max_per_rep(v, "pvsched", "vanilla"),
            Side::AtMost,
            1.0,
        ),
        Target::every_rep(
            "spin_max_ratio",
            "spin (wait_on) round trip: pvsched max <= 1.0x the same repetition's vanilla max, in every repetition",
            &max_per_rep(v, "spin_pvsched", "spin_vanilla"),
            Side::AtMost,
            1.0,
        ),
        Target::paired(
            "ipi_host_cost",
            "ipi: pvsched hog iterations >= 0.8x vanilla (per second of measured time), paired per repetition",
            &fig(r, "pvsched", |c| &c.hog_iterations_per_s),
            Side::AtLeast,
            0.8,
        ),
    ];
}

/// The caps' budget and window of a pvsched run (the caps the worker ran
/// with), µs.
fn budget_window(o: &Outcome) -> (Option<u64>, Option<u64>) {
    let c = o.report.caps.as_ref();
    (c.map(|c| c.budget_us), c.map(|c| c.window_us))
}

/// One pvsched run of S5: per vCPU boosted time per budget window against
/// the budget, and the worst vCPU's share of the budget.
fn greedy_run(rep: usize, o: &Outcome) -> GreedyRun {
    let (budget, window) = budget_window(o);
    let budget = budget.filter(|&b| b > 0);
    let window = window.filter(|&w| w > 0);
    let policy_s = o.report.policy_s.filter(|&s| s > 0.0);
    let windows = match (policy_s, window) {
        (Some(s), Some(w)) => Some(s / (w as f64 / 1e6)),
        _ => None,
    };
    let per_vcpu: Vec<GreedyVcpu> = o
        .report
        .boosted_ns
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, &ns)| {
            let per_window_us = windows.map(|w| ns as f64 / 1e3 / w);
            let pv = o.report.policy.as_ref().and_then(|p| p.per_vcpu.get(i));
            GreedyVcpu {
                index: i,
                boosted_ns: ns,
                boosts: pv.map(|v| v.boosts),
                throttles: pv.map(|v| v.throttles),
                boosted_us_per_window: per_window_us,
                of_budget: per_window_us.zip(budget).map(|(u, b)| u / b as f64),
            }
        })
        .collect();
    GreedyRun {
        rep,
        policy_s,
        windows,
        worst_of_budget: per_vcpu.iter().filter_map(|v| v.of_budget).reduce(f64::max),
        per_vcpu,
    }
}

/// S5: a greedy guest beside busy hogs. Latency figures are missing (the
/// guest spins; nothing is timed); what counts is the policy's boosted
/// time per budget window and the hogs' work against vanilla's.
fn s5(runs: &[Runs], rep: &mut ScenarioReport) {
    rep.ratios = comparisons(&rep.variants, &[("pvsched", "pvsched", "vanilla")]);
    let pv = runs.iter().find(|r| r.variant.policy.enabled());
    let (budget_us, window_us) = pv
        .and_then(|r| r.outcomes().next())
        .map_or((None, None), budget_window);
    let share = match (budget_us, window_us) {
        (Some(b), Some(w)) if b > 0 && w > 0 => Some((b as f64 / w as f64).min(1.0)),
        _ => None,
    };
    // Index = repetition; a failed run has no share of the budget.
    let per_rep: Vec<Option<GreedyRun>> = pv
        .map(|r| {
            r.reps
                .iter()
                .enumerate()
                .map(|(i, x)| x.ok().map(|o| greedy_run(i + 1, o)))
                .collect()
        })
        .unwrap_or_default();
    let worst_per_rep: Vec<Option<f64>> = per_rep
        .iter()
        .map(|g| {
            g.as_ref()
                .and_then(|g| g.worst_of_budget)
                .filter(|_| share.is_some())
        })
        .collect();
    let reps: Vec<GreedyRun> = per_rep.into_iter().flatten().collect();
    let hog = fig(&rep.ratios, "pvsched", |c| &c.hog_iterations_per_s);
    rep.greedy = Some(GreedyReport {
        budget_us,
        window_us,
        budget_share: share,
        worst_of_budget: reps
            .iter()
            .filter_map(|r| r.worst_of_budget)
            .reduce(f64::max),
        reps,
    });
    let hog_target = |limit| {
        Target::paired(
            "s5_hog_share",
            "hog keeps >= (1 - budget_us/window_us - 0.05) of its CPU: hog iterations pvsched / vanilla, paired per repetition",
            &hog,
            Side::AtLeast,
            limit,
        )
    };
    rep.targets = vec![
        // The budget must hold in every run.
        Target::every_rep(
            "s5_greedy_budget",
            "greedy guest: boosted on-CPU time per vCPU <= budget per window + 5%, in every repetition (max over vCPUs of boosted_ns / windows / budget_us)",
            &worst_per_rep,
            Side::AtMost,
            1.05,
        ),
        match share {
            Some(s) => hog_target(1.0 - s - 0.05),
            // Without caps there is no share to keep.
            None => Target::value(
                "s5_hog_share",
                "hog share (no budget known)",
                None,
                0,
                Side::AtLeast,
                1.0,
            ),
        },
    ];
}

/// S5's bars: each vCPU's boosted ms per window (worst repetition) and
/// the budget in ms, or `None` without a budget.
pub fn s5_bars(r: &ScenarioReport) -> (Vec<(String, f64)>, Option<f64>) {
    let Some(g) = &r.greedy else {
        return (Vec::new(), None);
    };
    let mut worst: Vec<f64> = Vec::new();
    for rep in &g.reps {
        for (i, v) in rep.per_vcpu.iter().enumerate() {
            let x = v.boosted_us_per_window.unwrap_or(0.0) / 1e3;
            match worst.get_mut(i) {
                Some(w) => *w = w.max(x),
                None => worst.push(x),
            }
        }
    }
    let bars = worst
        .into_iter()
        .enumerate()
        .map(|(i, x)| (format!("VCPU {i}"), x))
        .collect();
    let budget = g.budget_us.filter(|&b| b > 0).map(|b| b as f64 / 1e3);
    (bars, budget)
}

/// S3: costs. Each variant is one workload of the pvsched policy (no
/// vanilla: without the policy there is nothing to pay).
fn s3(runs: &[Runs], rep: &mut ScenarioReport) -> Result<(), BenchError> {
    let mut totals = ProgTotals::default();
    for r in runs {
        let mut progs = ProgTotals::default();
        for o in r.outcomes() {
            progs.add(&o.report);
            totals.add(&o.report);
        }
        if let Some(v) = rep.variants.get_mut(r.variant.name) {
            v.bpf = Some(bpf_report(&progs));
        }
    }
    let bpf = bpf_report(&totals);
    // The worst full path of any workload (pooling them would hide one).
    let worst_full = rep
        .variants
        .values()
        .filter_map(|w| w.bpf.as_ref()?.worst_full_ns_per_event)
        .reduce(f64::max);
    let apply = |f: fn(&PolicyRun) -> f64| -> Vec<Option<f64>> {
        runs.iter()
            .filter_map(|r| rep.variants.get(r.variant.name))
            .flat_map(|v| v.runs.iter().map(move |x| x.policy.as_ref().map(f)))
            .collect()
    };
    let (apply50, apply99) = (apply(|p| p.apply_p50_us), apply(|p| p.apply_p99_us));
    let measured = apply50.iter().flatten().count();
    rep.targets = vec![
        Target::value(
            "bpf_ns_per_event",
            "BPF run time per event <= 300 ns (worst program, run_time_ns / run_cnt, every run)",
            bpf.worst_ns_per_event,
            measured,
            Side::AtMost,
            300.0,
        ),
        Target::value(
            "bpf_full_ns_per_event",
            "BPF run time per event of a registered thread <= 300 ns (worst program of any workload, prefilter included)",
            worst_full,
            measured,
            Side::AtMost,
            300.0,
        ),
        Target::every_rep(
            "apply_p50",
            "decision -> applied p50 <= 20 us, in every run",
            &apply50,
            Side::AtMost,
            20.0,
        ),
        Target::every_rep(
            "apply_p99",
            "decision -> applied p99 <= 100 us, in every run",
            &apply99,
            Side::AtMost,
            100.0,
        ),
    ];
    rep.costs = Some(CostsReport {
        apply_p50_us: median(&apply50),
        apply_p99_us: median(&apply99),
        scaling: s3_scaling(runs, &rep.variants),
        apply_p50_us_runs: apply50,
        apply_p99_us_runs: apply99,
        bpf,
        handshake: s3_handshake(runs)?,
        bytes_per_vcpu: costs::bytes_per_vcpu(),
    });
    Ok(())
}

/// S3's scaling table: per workload, how many VMs were registered, the
/// BPF costs (sched_switch's prefilter and full path, the worst full
/// path) and decision→applied, medians over its runs.
fn s3_scaling(runs: &[Runs], variants: &Reports) -> Vec<ScalingRow> {
    runs.iter()
        .filter_map(|r| {
            let w = variants.get(r.variant.name)?;
            let bpf = w.bpf.as_ref()?;
            let switch = bpf.programs.iter().find(|p| p.name == "pvs_sched_switch");
            let timer = bpf.programs.iter().find(|p| p.name == REEVAL_PROG);
            let apply = |f: fn(&PolicyRun) -> f64| median(&w.per_rep(|x| x.policy.as_ref().map(f)));
            Some(ScalingRow {
                workload: r.variant.name.into(),
                registered_vms: 1 + r.variant.extra_vms,
                switch_prefilter_ns: switch.and_then(|p| p.prefilter_ns_per_event),
                switch_full_ns: switch.and_then(|p| p.full_ns_per_event),
                worst_full_ns: bpf.worst_full_ns_per_event,
                timer_ns_per_thread: timer.and_then(|p| p.full_ns_per_event),
                worst_ns: bpf.worst_ns_per_event,
                apply_p50_us: apply(|p| p.apply_p50_us),
                apply_p99_us: apply(|p| p.apply_p99_us),
                agent_cpu: median(&r.outcomes().map(|o| o.report.agent_cpu).collect::<Vec<_>>()),
            })
        })
        .collect()
}

/// Per program: its runs in the measured windows and in the prefilter
/// windows, summed over runs.
#[derive(Default)]
struct ProgTotals(Vec<ProgAcc>);

#[derive(Default)]
struct ProgAcc {
    name: String,
    run: (u64, u64),
    full: Option<u64>,
    prefilter: (u64, u64),
}

impl ProgTotals {
    fn entry(&mut self, name: &str) -> &mut ProgAcc {
        let i = match self.0.iter().position(|p| p.name == name) {
            Some(i) => i,
            None => {
                self.0.push(ProgAcc {
                    name: name.to_owned(),
                    ..ProgAcc::default()
                });
                self.0.len() - 1
            }
        };
        &mut self.0[i]
    }

    /// Adds one run's statistics.
    fn add(&mut self, report: &crate::worker::WorkerReport) {
        for s in &report.prog_stats {
            let e = self.entry(&s.name);
            e.run.0 = e.run.0.saturating_add(s.run_cnt);
            e.run.1 = e.run.1.saturating_add(s.run_time_ns);
            if let Some(f) = s.full_runs {
                e.full = Some(e.full.unwrap_or(0).saturating_add(f));
            }
        }
        for s in &report.prefilter_stats {
            let e = self.entry(&s.name);
            e.prefilter.0 = e.prefilter.0.saturating_add(s.run_cnt);
            e.prefilter.1 = e.prefilter.1.saturating_add(s.run_time_ns);
        }
    }
}

/// S3's handshake section: an in-process device handshake's host CPU time,
/// and the VM start times of the runs.
fn s3_handshake(runs: &[Runs]) -> Result<Handshake, BenchError> {
    let mut hs = costs::device_handshake_ns(1000).map_err(BenchError::Costs)?;
    let hsl = stats::latency(&mut hs);
    let starts: Vec<Option<f64>> = runs
        .iter()
        .flat_map(|r| r.outcomes().map(|o| Some(o.report.start_ms)))
        .collect();
    Ok(Handshake {
        device_in_process_p50_us: hsl.p50_us,
        device_in_process_p99_us: hsl.p99_us,
        device_in_process_max_us: hsl.max_us,
        iterations: hsl.samples,
        vm_start_ms: median(&starts),
    })
}

/// Per-program BPF costs (all runs, prefiltered runs, full runs) plus the
/// worst of each and the overall mean.
fn bpf_report(progs: &ProgTotals) -> BpfReport {
    let per = |c: u64, ns: f64| {
        if c == 0 { None } else { Some(ns / c as f64) }
    };
    let programs: Vec<ProgCost> = progs
        .0
        .iter()
        .map(|p| {
            let (n, t) = p.run;
            let pre = per(p.prefilter.0, p.prefilter.1 as f64);
            // The runs that returned at the prefilter cost what they cost
            // in the prefilter window; the rest of the time is the full
            // runs'.
            let full_ns = match (p.full, pre) {
                // Every run was a full one (the KVM tracepoints fire only
                // while a VM runs: no prefilter window for them).
                (Some(f), _) if f > 0 && f >= n => per(f, t as f64),
                (Some(f), Some(c)) if f > 0 => {
                    per(f, (t as f64 - n.saturating_sub(f) as f64 * c).max(0.0))
                }
                _ => None,
            };
            ProgCost {
                name: p.name.clone(),
                run_cnt: n,
                run_time_ns: t,
                // A run that handles several threads' events (the agent's
                // timer) is counted per thread.
                ns_per_event: per(n.max(p.full.unwrap_or(0)), t as f64),
                prefilter_ns_per_event: pre,
                full_runs: p.full,
                full_ns_per_event: full_ns,
            }
        })
        .collect();
    let worst = |f: fn(&ProgCost) -> Option<f64>| programs.iter().filter_map(f).reduce(f64::max);
    let (c, ns) = progs.0.iter().fold((0u64, 0u64), |(a, b), p| {
        (a.saturating_add(p.run.0), b.saturating_add(p.run.1))
    });
    BpfReport {
        worst_ns_per_event: worst(|p| p.ns_per_event),
        // Events on the tracepoints: the agent's timer is reported apart.
        worst_full_ns_per_event: worst(|p| p.full_ns_per_event.filter(|_| p.name != REEVAL_PROG)),
        worst_prefilter_ns_per_event: worst(|p| {
            p.prefilter_ns_per_event.filter(|_| p.name != REEVAL_PROG)
        }),
        mean_ns_per_event: per(c, ns as f64),
        programs,
    }
}

/// CDF series of the variants (all repetitions merged).
pub fn series(runs: &[Runs]) -> Vec<Series> {
    runs.iter()
        .map(|r| {
            let mut all: Vec<u64> = r
                .outcomes()
                .flat_map(|o| o.samples.iter().copied())
                .collect();
            all.sort_unstable();
            Series {
                name: r.variant.name.to_owned(),
                points: stats::cdf(&all, 400),
                n: all.len() as f64,
            }
        })
        .collect()
}

/// S3's bars: ns/event per program over all runs.
pub fn s3_bars(r: &ScenarioReport) -> Vec<(String, f64)> {
    r.costs
        .iter()
        .flat_map(|c| &c.bpf.programs)
        .filter_map(|p| Some((p.name.clone(), p.ns_per_event?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::docgen::Render;
    use crate::hogs::LoadKind;
    use crate::paired::Verdict;
    use crate::runner::HogWork;
    use crate::worker::{ProgStat, WorkerReport};
    use pvsched_host::summary::VcpuSummary;
    use pvsched_policy::Caps;

    /// An outcome of `report` with the hogs at `hog_per_s` over 2 s.
    fn with_hogs(report: WorkerReport, hog_per_s: f64) -> Outcome {
        Outcome {
            hog: HogWork::measured((hog_per_s * 2.0) as u64, 2.0),
            ..Outcome::new(report)
        }
    }

    fn policy(vcpus: &[(u64, u64)]) -> PolicySummary {
        PolicySummary {
            decisions: 4,
            apply_samples: 2,
            apply_p50_us: 10.0,
            apply_p99_us: 50.0,
            per_vcpu: vcpus
                .iter()
                .map(|&(boosts, throttles)| VcpuSummary {
                    boosts,
                    throttles,
                    ..VcpuSummary::default()
                })
                .collect(),
            ..PolicySummary::default()
        }
    }

    fn outcome(p50: u64, p99: u64, hog_per_s: f64) -> Outcome {
        let mut samples_ns = vec![p50; 98];
        samples_ns.extend([p99, p99]);
        let report = WorkerReport {
            ok: true,
            events: 3,
            policy: Some(policy(&[(2, 1)])),
            prog_stats: vec![ProgStat {
                name: "switch".into(),
                run_cnt: 10,
                run_time_ns: 9000,
                full_runs: Some(4),
            }],
            prefilter_stats: vec![ProgStat {
                name: "switch".into(),
                run_cnt: 10,
                run_time_ns: 1000,
                full_runs: Some(0),
            }],
            start_ms: 40.0,
            samples_ns,
            ..WorkerReport::default()
        };
        with_hogs(report, hog_per_s)
    }

    const LOAD: Load = Load {
        kind: LoadKind::Busy,
        n: 2,
    };

    fn ok(outcomes: Vec<Outcome>) -> Vec<Rep> {
        outcomes
            .into_iter()
            .enumerate()
            .map(|(i, o)| Rep {
                order: i,
                outcome: Ok(o),
            })
            .collect()
    }

    /// Two repetitions of every variant; `scale` multiplies a variant's
    /// latencies.
    fn runs(s: Scenario, scale: &[(&str, u64)]) -> Vec<Runs> {
        variants(s, LOAD)
            .into_iter()
            .map(|variant| {
                let k = scale
                    .iter()
                    .find(|x| x.0 == variant.name)
                    .map_or(1, |x| x.1);
                // pvsched's hogs get 96 % of vanilla's work.
                let hog = if variant.policy.enabled() {
                    960.0
                } else {
                    1000.0
                };
                Runs {
                    variant,
                    reps: ok(vec![
                        outcome(1000 * k, 100_000 * k, hog),
                        outcome(2000 * k, 90_000 * k, hog),
                    ]),
                }
            })
            .collect()
    }

    fn options() -> Options {
        Options {
            quick: false,
            reps: 2,
            duration_s: 2.0,
            hogs: LOAD.n,
            load: "busy".into(),
            hog_threads: LOAD.threads(),
            device_mode: "in-process".into(),
            caps: "default".into(),
            trace_dir: None,
            floor: true,
        }
    }

    /// The idle host's floor with these maxima, µs.
    fn floors(max_us: &[f64]) -> Vec<FloorRun> {
        max_us
            .iter()
            .enumerate()
            .map(|(i, &m)| FloorRun {
                order: i,
                floor: Ok(Floor {
                    samples: 2000,
                    p99_us: Some(m / 10.0),
                    max_us: Some(m),
                    steal_ms: Some(1.0),
                }),
            })
            .collect()
    }

    /// A report with `floor` as the idle floor and the loaded floor at
    /// half its maxima.
    fn report(s: Scenario, runs: Vec<Runs>, floor: Option<Vec<FloorRun>>) -> ScenarioReport {
        let floor_loaded = floor.as_ref().map(|f| {
            let maxima: Vec<f64> = f
                .iter()
                .map(|r| r.floor.as_ref().unwrap().max_us.unwrap() / 2.0)
                .collect();
            floors(&maxima)
        });
        let ex = Executed {
            runs,
            floor,
            floor_loaded,
        };
        assemble(s, &ex, "pvsched-bench test".into(), options()).unwrap()
    }

    fn target<'a>(r: &'a ScenarioReport, name: &str) -> &'a Target {
        r.targets
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no target {name}"))
    }

    #[test]
    fn every_variant_runs_first_once_over_k_repetitions() {
        let k = 5;
        let firsts: Vec<usize> = (0..k).map(|rep| rotated(rep, 0, k)).collect();
        assert_eq!(firsts, [0, 1, 2, 3, 4]);
        let rep1: Vec<usize> = (0..3).map(|j| rotated(1, j, 3)).collect();
        assert_eq!(rep1, [1, 2, 0]);
    }

    #[test]
    fn s1_ratios_are_paired_and_targets_have_verdicts() {
        let r = report(
            Scenario::S1,
            runs(Scenario::S1, &[("vanilla", 10)]),
            Some(floors(&[200.0, 200.0])),
        );
        let v = &r.variants;
        assert_eq!(v["vanilla"].p99_us, Some(950.0));
        assert_eq!(v["pvsched"].p99_us, Some(95.0));
        assert_eq!((v["pvsched"].n, v["pvsched"].failed), (2, 0));
        assert_eq!(v["pvsched"].runs[1].order, 1);
        assert_eq!(
            v["pvsched"].spread.p50_us,
            Some(Spread { min: 1.0, max: 2.0 })
        );
        assert_eq!(v["pvsched"].runs[0].policy.as_ref().unwrap().boosts, 2);
        assert_eq!(v["vanilla"].load.busy, 2);
        assert_eq!(v["idle_vanilla"].load.kind, "none");
        assert_eq!(v["pvsched"].runs[1].hog_iterations_per_s, Some(960.0));
        let p99 = &r.ratios["pvsched"].p99_us;
        assert_eq!((p99.n, p99.failed), (2, 0));
        assert!((p99.ratio.unwrap() - 0.1).abs() < 1e-12, "{p99:?}");
        let names: Vec<&str> = r.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "s1_p99_vs_idle",
                "s1_p99_ratio",
                "s1_max_ratio",
                "s1_max_every_rep",
                "s1_max_vs_floor",
                "s1_max_vs_loaded_floor",
                "s1_host_cost"
            ]
        );
        // p99 0.1x in both repetitions: not the 0.05x asked.
        assert_eq!(target(&r, "s1_p99_ratio").verdict, Verdict::NotMet);
        assert_eq!(target(&r, "s1_max_every_rep").verdict, Verdict::Met);
        assert_eq!(target(&r, "s1_host_cost").verdict, Verdict::Met);
        // pvsched's max (100, 90 µs) under the floor's 200 µs.
        let f = target(&r, "s1_max_vs_floor");
        assert_eq!((f.verdict, f.value), (Verdict::Met, Some(0.5)));
        let floor = r.floor.as_ref().unwrap();
        assert_eq!((floor.n, floor.failed, floor.max_us), (2, 0, Some(200.0)));
        assert_eq!(floor.runs[0].steal_ms, Some(1.0));
        // 1.0 and 0.9 of the loaded floor's 100 µs: met; the worst is the
        // value shown.
        let lf = target(&r, "s1_max_vs_loaded_floor");
        assert_eq!((lf.verdict, lf.value), (Verdict::Met, Some(1.0)));
        // vanilla loaded p99 10x its idle p99: the load shows the problem.
        assert_eq!(r.load_shows_problem, Some(Verdict::Met));
        assert_eq!(series(&runs(Scenario::S1, &[])).len(), 4);
        let weak = report(Scenario::S1, runs(Scenario::S1, &[]), None);
        assert_eq!(weak.load_shows_problem, Some(Verdict::NotMet));
        // Without a floor, the floor target cannot tell.
        assert_eq!(
            target(&weak, "s1_max_vs_floor").verdict,
            Verdict::Unresolved
        );
    }

    #[test]
    fn a_repetition_over_the_floor_is_named() {
        // Repetition 1: pvsched max 100 µs over the floor's 95 µs.
        let r = report(
            Scenario::S1,
            runs(Scenario::S1, &[]),
            Some(floors(&[95.0, 300.0])),
        );
        let f = target(&r, "s1_max_vs_floor");
        assert_eq!(f.verdict, Verdict::NotMet);
        assert_eq!(f.missed_reps, [1]);
        assert!(r.markdown().contains("missed in repetition 1"));
    }

    #[test]
    fn a_failed_run_is_counted_not_dropped() {
        let mut r = runs(Scenario::S1, &[("vanilla", 10)]);
        let vanilla = r.iter_mut().find(|r| r.variant.name == "vanilla").unwrap();
        vanilla.reps[1].outcome = Err("the run overran".into());
        let r = report(Scenario::S1, r, None);
        let v = &r.variants["vanilla"];
        assert_eq!((v.n, v.failed), (1, 1));
        assert_eq!(v.runs[1].error.as_deref(), Some("the run overran"));
        assert_eq!(v.runs[1].p99_us, None);
        let p99 = &r.ratios["pvsched"].p99_us;
        assert_eq!((p99.n, p99.failed), (1, 1));
        // One pair cannot resolve a verdict; one repetition missing
        // leaves an every-repetition target open.
        assert_eq!(target(&r, "s1_p99_ratio").verdict, Verdict::Unresolved);
        let every = target(&r, "s1_max_every_rep");
        assert_eq!((every.verdict, every.failed), (Verdict::Unresolved, 1));
    }

    #[test]
    fn the_report_reads_back_from_its_json_and_renders() {
        let r = report(
            Scenario::S1,
            runs(Scenario::S1, &[("vanilla", 10)]),
            Some(floors(&[200.0, 200.0])),
        );
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["targets"][1]["verdict"], "not_met");
        assert_eq!(j["variants"]["pvsched"]["runs"][0]["order"], 0);
        let back: ScenarioReport = serde_json::from_value(j).unwrap();
        assert_eq!(back, r);
        let md = back.markdown();
        for s in [
            "| pvsched | 2 | 0 |",
            "| pvsched: pvsched / vanilla | p99 | 0.100 (0.100–0.100) | 2 | 0 |",
            "| s1_p99_ratio |",
            "not met",
            "Idle host floor",
        ] {
            assert!(md.contains(s), "{s:?} in\n{md}");
        }
    }

    /// A greedy pvsched run: 10.5 s registered, window 1 s, budget 0.2 s.
    fn greedy(boosted_ns: [u64; 2], hog_per_s: f64) -> Outcome {
        let report = WorkerReport {
            ok: true,
            policy: Some(policy(&[(3, 9), (4, 8)])),
            policy_s: Some(10.5),
            boosted_ns: Some(boosted_ns.into()),
            caps: Some(Caps {
                budget_us: 200_000,
                window_us: 1_000_000,
                ..Caps::default()
            }),
            ..WorkerReport::default()
        };
        with_hogs(report, hog_per_s)
    }

    fn s5_runs(pv: [Outcome; 2], vanilla_hogs: f64) -> Vec<Runs> {
        let mut v = variants(Scenario::S5, LOAD).into_iter();
        let van = v.next().unwrap();
        let pvs = v.next().unwrap();
        assert!(!van.policy.enabled() && pvs.policy.enabled());
        assert_eq!(van.workload, BenchWorkload::Greedy);
        let idle = || {
            with_hogs(
                WorkerReport {
                    ok: true,
                    ..WorkerReport::default()
                },
                vanilla_hogs,
            )
        };
        vec![
            Runs {
                variant: van,
                reps: ok(vec![idle(), idle()]),
            },
            Runs {
                variant: pvs,
                reps: ok(pv.into()),
            },
        ]
    }

    #[test]
    fn s5_budget_and_hog_share() {
        // 2.1 s boosted over 10.5 windows = 200 ms per window = the budget.
        let r = report(
            Scenario::S5,
            s5_runs(
                [
                    greedy([2_100_000_000, 1_050_000_000], 800.0),
                    greedy([1_000_000_000, 2_205_000_000], 800.0),
                ],
                1000.0,
            ),
            None,
        );
        let g = r.greedy.as_ref().unwrap();
        assert_eq!(g.budget_us, Some(200_000));
        assert_eq!(g.budget_share, Some(0.2));
        assert_eq!(g.reps[0].windows, Some(10.5));
        let v0 = &g.reps[0].per_vcpu[0];
        assert!((v0.boosted_us_per_window.unwrap() - 200_000.0).abs() < 1e-6);
        assert!((v0.of_budget.unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(g.reps[0].per_vcpu[1].throttles, Some(8));
        assert!((g.worst_of_budget.unwrap() - 1.05).abs() < 1e-12);
        let budget = target(&r, "s5_greedy_budget");
        assert_eq!(budget.verdict, Verdict::Met, "{budget:?}");
        // 0.8 of vanilla's work, against 1 - 0.2 - 0.05.
        let hogs = target(&r, "s5_hog_share");
        assert!((hogs.limit - 0.75).abs() < 1e-12);
        assert_eq!(hogs.verdict, Verdict::Met, "{hogs:?}");
        assert_eq!(r.variants["vanilla"].p99_us, None);
        let (bars, budget) = s5_bars(&r);
        assert_eq!(bars[0].0, "VCPU 0");
        assert!((bars[1].1 - 210.0).abs() < 1e-9, "{bars:?}");
        assert_eq!(budget, Some(200.0));
        // Over budget in repetition 1, hogs starved.
        let bad = report(
            Scenario::S5,
            s5_runs(
                [greedy([4_200_000_000, 0], 500.0), greedy([0, 0], 500.0)],
                1000.0,
            ),
            None,
        );
        let budget = target(&bad, "s5_greedy_budget");
        assert_eq!(
            (budget.verdict, budget.missed_reps.clone()),
            (Verdict::NotMet, vec![1])
        );
        assert_eq!(target(&bad, "s5_hog_share").verdict, Verdict::NotMet);
    }

    #[test]
    fn s2_has_no_yield_and_spin() {
        let r = report(
            Scenario::S2,
            runs(Scenario::S2, &[("spin_vanilla", 4)]),
            Some(floors(&[1e6, 1e6])),
        );
        assert!(r.variants["no_yield"].p99_us.is_some());
        let spin = &r.ratios["spin"];
        assert_eq!(
            (spin.test.as_str(), spin.base.as_str()),
            ("spin_pvsched", "spin_vanilla")
        );
        assert!((spin.p50_us.ratio.unwrap() - 0.25).abs() < 1e-12);
        assert_eq!(target(&r, "spin_p99_ratio").verdict, Verdict::Met);
        // Every repetition's spin max is 0.25x its vanilla's.
        assert_eq!(target(&r, "spin_max_ratio").value, Some(0.25));
        // The ipi hogs keep 0.96 of vanilla's work.
        assert_eq!(target(&r, "ipi_host_cost").verdict, Verdict::Met);
        assert!(r.floor.is_some());
    }

    #[test]
    fn s3_costs() {
        let ex = Executed {
            runs: runs(Scenario::S3, &[]),
            floor: None,
            floor_loaded: None,
        };
        let r = assemble(Scenario::S3, &ex, String::new(), options()).unwrap();
        let c = r.costs.as_ref().unwrap();
        assert_eq!(c.apply_p50_us, Some(10.0));
        assert_eq!(c.apply_p50_us_runs.len(), 8);
        assert!(r.ratios.is_empty());
        assert_eq!(c.bpf.worst_ns_per_event, Some(900.0));
        assert_eq!(c.bpf.programs[0].run_cnt, 80);
        // 100 ns per prefiltered run; the 6 others of each 10 leave
        // 9000 - 600 ns to the 4 full runs.
        let w = r.variants["ipi_64vms"].bpf.as_ref().unwrap();
        assert_eq!(w.programs[0].prefilter_ns_per_event, Some(100.0));
        assert_eq!(w.programs[0].full_ns_per_event, Some(2100.0));
        assert_eq!(w.worst_full_ns_per_event, Some(2100.0));
        let scaling: Vec<u32> = c.scaling.iter().map(|r| r.registered_vms).collect();
        assert_eq!(scaling, [1, 1, 16, 64]);
        assert_eq!(c.scaling[3].switch_full_ns, None);
        assert_eq!(target(&r, "bpf_ns_per_event").verdict, Verdict::NotMet);
        assert_eq!(target(&r, "bpf_full_ns_per_event").verdict, Verdict::NotMet);
        assert_eq!(target(&r, "apply_p50").verdict, Verdict::Met);
        assert!(c.handshake.device_in_process_p50_us.is_some());
        assert_eq!(s3_bars(&r), vec![("switch".to_owned(), 900.0)]);
    }
}
