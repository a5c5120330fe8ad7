//! S6: throughput of real Linux guests under overcommit per CPU-second of
//! the whole VM. `pvsched-bench s6` runs `python3 -m pvsched_bench s6`
//! (the measurement: boots, workloads, hogs; one raw row per run), reads
//! its rows into [`S6Row`] and computes the report here: per topology,
//! workload and variant the spread of each figure, and paired ratios
//! against `vanilla` and `none` (index = repetition) with verdicts.

use super::BenchError;
use super::docgen::Render;
use super::paired::{Paired, Verdict, paired};
use super::plot_spread::Panel;
use super::s4::{self, Spread};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt::Write as _;

/// S6's targets, each judged by code on every pvsched variant that ran:
/// (name, what it asks, the workloads it is for (empty: every one),
/// whether it is on the hogs' rate rather than the work per CPU-second,
/// the lowest ratio to vanilla it accepts).
pub const TARGETS: &[(&str, &str, &[&str], bool, f64)] = &[
    (
        "s6_ipi_gain",
        "IPI-heavy workloads: >= 1.5x vanilla's work per CPU-second",
        &["hackbench", "tlb", "membarrier"],
        false,
        1.5,
    ),
    (
        "s6_dbench_gain",
        "dbench: >= 1.15x vanilla's work per CPU-second",
        &["dbench"],
        false,
        1.15,
    ),
    (
        "s6_no_loss",
        "no workload below 0.98x vanilla's work per CPU-second",
        &[],
        false,
        0.98,
    ),
    (
        "s6_hogs_kept",
        "the host's hogs keep >= 0.8x their rate beside vanilla",
        &[],
        true,
        0.8,
    ),
];

/// `pvsched-bench s6`: the options of `python3 -m pvsched_bench s6`, and
/// where the report goes.
#[derive(clap::Args, Debug)]
pub struct S6Args {
    /// A kernel of tests/linux-guest/kernels.conf.
    #[arg(long, default_value = "7.3-cloud")]
    pub kernel: String,
    /// NxV[,NxV...]: N guests of V vCPUs.
    #[arg(long, default_value = "1x2")]
    pub topology: String,
    /// Comma-separated, of cpu, batch, tlb, membarrier, hackbench, dbench;
    /// A+B+... gives VM i the i-th part (hackbench+cpu+cpu: one IPI-heavy
    /// VM beside two batch ones, judged VM by VM).
    #[arg(long)]
    pub workloads: Option<String>,
    /// Comma-separated, of none, vanilla, pvsched (and its ablations:
    /// pvsched-nocs, -nowait, -nolock, -lock, -kick, -nokick, -auto,
    /// -clamped, -cosched, -coauto, -coauto10, -coauto5, -coauto-noyield, -slice0, -noemu), fifo1, weight,
    /// slice; the order rotates per repetition.
    #[arg(long, default_value = "none,vanilla,pvsched,fifo1,weight")]
    pub variants: String,
    /// Repetitions.
    #[arg(long, default_value_t = 5)]
    pub reps: u32,
    /// Seconds per workload.
    #[arg(long, default_value_t = 20)]
    pub duration: u32,
    /// Host CPU hogs beside the guests (0: none; default one per CPU).
    #[arg(long)]
    pub hogs: Option<u32>,
    /// One repetition of 8 s per workload, workloads cpu,hackbench.
    #[arg(long)]
    pub quick: bool,
    /// A SCHED_OTHER cyclictest on the host beside every workload (its
    /// p99 and max: what a variant costs an ordinary host thread).
    #[arg(long)]
    pub host_probe: bool,
    /// With --host-probe: run it at SCHED_FIFO N (1-99) instead.
    #[arg(long, value_name = "N")]
    pub host_probe_prio: Option<u32>,
    /// QEMU's -cpu model for every guest.
    #[arg(long)]
    pub cpu: Option<String>,
    /// What S4 and S6 share.
    #[command(flatten)]
    pub common: s4::GuestArgs,
}

/// The CPU seconds one run's VMs cost over its window, by part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CostCpu {
    /// The VMs' QEMU processes.
    pub qemu: f64,
    /// Their device processes.
    pub device: f64,
    /// pvschedd's process with its applier (the run's, for all its VMs).
    pub pvschedd: f64,
    /// The policy's BPF programs' run time (the run's, for all its VMs;
    /// they run in the switching thread's context, so partly in qemu's).
    pub bpf: f64,
}

impl CostCpu {
    /// The whole VM's CPU seconds.
    pub fn total(&self) -> f64 {
        self.qemu + self.device + self.pvschedd + self.bpf
    }
}

/// The hogs of one run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hogs {
    /// stress-ng --cpu workers.
    pub n: u32,
    /// Their bogo ops.
    pub ops: u64,
    /// Their own elapsed time, s.
    pub elapsed_s: f64,
    /// ops / elapsed_s.
    pub rate: Option<f64>,
    /// Seconds they started before the workload's window.
    pub lead_s: f64,
    /// Seconds they stopped after it.
    pub tail_s: f64,
}

/// One raw row: one workload run of one variant in one repetition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S6Row {
    /// NxV.
    pub topology: String,
    /// The workload.
    pub workload: String,
    /// The variant.
    pub variant: String,
    /// The repetition.
    pub rep: usize,
    /// Its place in the repetition's rotated order.
    pub order: usize,
    /// Why the run gave no figures (a failed repetition), or None.
    #[serde(default)]
    pub error: Option<String>,
    /// The tool's own rate, summed over the VMs.
    #[serde(default)]
    pub throughput: Option<f64>,
    /// Its unit.
    #[serde(default)]
    pub unit: Option<String>,
    /// Iterations behind it (invocations, bogo ops, operations).
    #[serde(default)]
    pub iterations: Option<u64>,
    /// From the workload command to the last guest's report, s.
    #[serde(default)]
    pub window_s: Option<f64>,
    /// The whole VM's CPU seconds over the window.
    #[serde(default)]
    pub cost_cpu_s: Option<CostCpu>,
    /// The hogs (None with --hogs 0).
    #[serde(default)]
    pub hogs: Option<Hogs>,
    /// The host probe, a cyclictest (None without --host-probe).
    #[serde(default)]
    pub host_probe: Option<s4::Cyc>,
    /// pvschedd's counters of the VMs (pvsched variants).
    #[serde(default)]
    pub policy: Option<Value>,
    /// The host's 1-minute load average as the run started.
    #[serde(default)]
    pub loadavg_start: Option<f64>,
    /// With "auto": each VM's guest-counted waits per vCPU and second as
    /// the run ended (pvschedd's `cosched_sync`).
    #[serde(default)]
    pub cosched_sync: Option<Vec<Option<u64>>>,
    /// Each VM's co-scheduled phase as the run ended, µs (absent: none
    /// held one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cosched_now_us: Option<Vec<u64>>,
    /// Per VM: its rate, iterations, CPU and the guest's counters.
    #[serde(default)]
    pub vms: Vec<Value>,
    /// Where the host's CPU went over the window, CPU-seconds per field of
    /// /proc/stat's first line (user, nice, system, idle, iowait, irq,
    /// softirq, steal): the time no column above accounts for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpu: Option<std::collections::BTreeMap<String, f64>>,
    /// What a wake-up, a sleep and a `sched_setattr` cost on the host as
    /// this variant's round started (`pvsched-bench host-costs`, µs of CPU
    /// each; [`crate::host_costs`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_costs: Option<std::collections::BTreeMap<String, f64>>,
}

impl S6Row {
    /// Work per CPU-second of the whole VM: the workload's rate times the
    /// window it ran in, over the CPU the VM used in that window. (A rate
    /// over CPU seconds would favour a variant whose window was shorter:
    /// the guests run at least a minimum of iterations, so windows differ.)
    pub fn per_cpu_s(&self) -> Option<f64> {
        let total = self.cost_cpu_s?.total();
        let work = self.throughput? * self.window_s?;
        (total > 0.0).then_some(work / total)
    }

    /// pvschedd's CPU over the window, % of one CPU per VM of the run.
    pub fn pvschedd_pct_per_vm(&self) -> Option<f64> {
        self.pct_per_vm(self.cost_cpu_s?.pvschedd)
    }

    /// pvsched's own CPU over the window, pvschedd's and its BPF
    /// programs', % of one CPU per VM of the run.
    pub fn own_pct_per_vm(&self) -> Option<f64> {
        let c = self.cost_cpu_s?;
        self.pct_per_vm(c.pvschedd + c.bpf)
    }

    /// `cpu_s` over the window, % of one CPU per VM of the run.
    /// The share of the host's CPU time over the window in /proc/stat's
    /// `fields`, %.
    pub fn host_pct(&self, fields: &[&str]) -> Option<f64> {
        let c = self.host_cpu.as_ref()?;
        let total: f64 = c.values().sum();
        (total > 0.0).then(|| fields.iter().filter_map(|f| c.get(*f)).sum::<f64>() / total * 100.0)
    }

    fn pct_per_vm(&self, cpu_s: f64) -> Option<f64> {
        let window = self.window_s.filter(|w| *w > 0.0)?;
        let vms = self.vms.len();
        (vms > 0).then(|| cpu_s / window / vms as f64 * 100.0)
    }

    /// Whether the VMs ran different workloads (A+B+...): the row has no
    /// summed throughput, only each VM's.
    pub fn mixed(&self) -> bool {
        self.workload.contains('+')
    }

    fn ok(&self) -> bool {
        self.error.is_none() && (self.throughput.is_some() || self.mixed())
    }

    /// VM `i`'s figure `key` (`throughput`, `cpu_s`: its QEMU process's).
    fn vm_fig(&self, i: usize, key: &str) -> Option<f64> {
        self.vms.get(i)?.get(key)?.as_f64()
    }

    /// VM `i`'s work per CPU-second of its QEMU process: its tool's
    /// iterations (bogo ops, hackbench invocations, dbench operations) over
    /// that CPU. Not its rate times the run's window: in a mix, a VM whose
    /// workload ended early waited idle for the others, so the window is
    /// not its own. (The shared pvschedd and BPF time is the row's, not
    /// one VM's.)
    pub fn vm_per_cpu_s(&self, i: usize) -> Option<f64> {
        let cpu = self.vm_fig(i, "cpu_s").filter(|c| *c > 0.0)?;
        Some(self.vm_fig(i, "iterations")? / cpu)
    }
}

/// What `python3 -m pvsched_bench s6 --json` writes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct S6Raw {
    /// Cut short (a round failed or ^C).
    #[serde(default)]
    pub partial: bool,
    /// What every guest benchmark's raw result starts with.
    #[serde(flatten)]
    pub head: s4::RawHead,
    /// Hogs.
    pub hogs: u32,
    /// Guest kernel.
    pub kernel: String,
    /// hackbench's minimum invocations per run.
    #[serde(default)]
    pub min_iters: u32,
    /// One row per run.
    pub rows: Vec<S6Row>,
}

/// A variant against a base variant, repetition by repetition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Versus {
    /// The base variant.
    pub base: String,
    /// Throughput.
    pub throughput: Paired,
    /// Throughput per CPU-second of the whole VM.
    pub per_cpu_s: Paired,
    /// The hogs' rate.
    pub hog_rate: Paired,
}

/// One variant in one topology and workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VariantStats {
    /// The variant.
    pub variant: String,
    /// Repetitions with figures.
    pub n: usize,
    /// Failed repetitions (rows with an error).
    pub failed: usize,
    /// Throughput.
    pub throughput: Spread,
    /// Throughput per CPU-second of the whole VM.
    pub per_cpu_s: Spread,
    /// The parts of the cost, s.
    pub cost_qemu_s: Spread,
    /// See [`CostCpu::device`].
    pub cost_device_s: Spread,
    /// See [`CostCpu::pvschedd`].
    pub cost_pvschedd_s: Spread,
    /// See [`CostCpu::bpf`].
    pub cost_bpf_s: Spread,
    /// pvschedd's CPU over the window per VM, % of one CPU: what the
    /// daemon (its applier and scan included, the BPF programs not) costs
    /// the host for each VM it serves.
    #[serde(default)]
    pub pvschedd_pct_per_vm: Spread,
    /// pvsched's own CPU per VM, % of one CPU: pvschedd's and its BPF
    /// programs' (which run in the context of the threads they trace).
    #[serde(default)]
    pub own_pct_per_vm: Spread,
    /// The hogs' rate, bogo ops/s.
    pub hog_rate: Spread,
    /// The host probe's p99, µs.
    pub probe_p99_us: Spread,
    /// The host probe's max, µs.
    pub probe_max_us: Spread,
    /// Co-scheduling phase changes pvschedd applied to the VMs' threads
    /// in the window (pvsched variants; 0: no phase at all).
    #[serde(default)]
    pub phase_changes: Spread,
    /// Of them, the changes that moved a vCPU out of its phase for a host
    /// thread woken on its CPU and back (two per yield), as a share of all.
    #[serde(default)]
    pub yield_share: Spread,
    /// pvschedd's CPU per phase change, µs (runs with at least one): what
    /// one change costs, its wake-up and system calls.
    #[serde(default)]
    pub pvschedd_us_per_change: Spread,
    /// The host's CPU left idle over the window (idle and iowait), %.
    #[serde(default)]
    pub host_idle_pct: Spread,
    /// The host's CPU in the kernel over the window (system, irq,
    /// softirq), %.
    #[serde(default)]
    pub host_system_pct: Spread,
    /// The host's CPU its hypervisor took over the window (steal), %.
    #[serde(default)]
    pub host_steal_pct: Spread,
    /// A wake-up from another CPU, µs of the woken thread's CPU, as each
    /// round started ([`crate::host_costs`]): the host's price of what
    /// pvschedd does at every change.
    #[serde(default)]
    pub host_wake_other_cpu_us: Spread,
    /// Against vanilla (not for vanilla itself).
    pub vs_vanilla: Option<Versus>,
    /// Against none (not for none itself).
    pub vs_none: Option<Versus>,
    /// With a mix of workloads (A+B+...): each VM's figures, VM by VM.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_vm: Vec<VmFigures>,
}

/// One VM of a run that gave its VMs different workloads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VmFigures {
    /// Its place among the run's VMs.
    pub index: usize,
    /// Its workload.
    pub workload: String,
    /// Its tool's rate.
    pub throughput: Spread,
    /// Its QEMU process's CPU seconds over the window.
    pub cpu_s: Spread,
    /// Its work per CPU-second of its QEMU process
    /// ([`S6Row::vm_per_cpu_s`]).
    pub per_cpu_s: Spread,
    /// Its co-scheduling gate's windows (about a second each) that found
    /// its vCPUs waiting for each other, per run (pvsched variants).
    #[serde(default)]
    pub gate_open_windows: Spread,
    /// Against the same VM in vanilla, repetition by repetition: its rate.
    pub vs_vanilla_throughput: Option<Paired>,
    /// Its CPU.
    pub vs_vanilla_cpu_s: Option<Paired>,
    /// Its work per CPU-second.
    pub vs_vanilla_per_cpu_s: Option<Paired>,
}

/// Each VM's figures of `variant` in a cell of mixed workloads (none for
/// one workload on every VM: the row's sums say it).
fn per_vm(rows: &[&S6Row], variant: &str, reps: usize) -> Vec<VmFigures> {
    let mine: Vec<&S6Row> = rows
        .iter()
        .copied()
        .filter(|r| r.variant == variant && r.mixed())
        .collect();
    let nvm = mine.iter().map(|r| r.vms.len()).max().unwrap_or(0);
    let has_vanilla = variant != "vanilla" && rows.iter().any(|r| r.variant == "vanilla");
    (0..nvm)
        .map(|i| {
            let pair = |f: &dyn Fn(&S6Row) -> Option<f64>| {
                has_vanilla.then(|| {
                    paired(
                        &by_rep(rows, "vanilla", reps, f),
                        &by_rep(rows, variant, reps, f),
                    )
                })
            };
            let tp = move |r: &S6Row| r.vm_fig(i, "throughput");
            let cpu = move |r: &S6Row| r.vm_fig(i, "cpu_s");
            let pcs = move |r: &S6Row| r.vm_per_cpu_s(i);
            let gate = move |r: &S6Row| {
                let on = r.vms.get(i)?.get("gate")?.get("on")?.as_array()?;
                Some(on.iter().filter(|w| w.as_bool() == Some(true)).count() as f64)
            };
            VmFigures {
                index: i,
                workload: mine
                    .iter()
                    .find_map(|r| r.vms.get(i)?.get("workload")?.as_str().map(String::from))
                    .unwrap_or_default(),
                throughput: spread_of(&mine, tp),
                cpu_s: spread_of(&mine, cpu),
                per_cpu_s: spread_of(&mine, pcs),
                gate_open_windows: spread_of(&mine, gate),
                vs_vanilla_throughput: pair(&tp),
                vs_vanilla_cpu_s: pair(&cpu),
                vs_vanilla_per_cpu_s: pair(&pcs),
            }
        })
        .collect()
}

/// One topology and workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S6Cell {
    /// NxV.
    pub topology: String,
    /// The workload.
    pub workload: String,
    /// Its throughput's unit.
    pub unit: String,
    /// Each variant that ran, in the order asked for.
    pub variants: Vec<VariantStats>,
}

/// The S6 report: the raw run and what it shows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct S6Report {
    /// "s6".
    pub scenario: String,
    /// pvsched-bench's command line.
    pub command: String,
    /// Repetitions that failed, of all rows.
    pub failed: usize,
    /// Per topology and workload.
    pub cells: Vec<S6Cell>,
    /// What python measured, every row kept.
    pub raw: S6Raw,
}

fn spread_of(rows: &[&S6Row], f: impl Fn(&S6Row) -> Option<f64>) -> Spread {
    Spread::of(rows.iter().filter(|r| r.ok()).filter_map(|r| f(r)))
}

/// The figure `f` of `variant` per repetition (None: no row or no figure).
fn by_rep(
    rows: &[&S6Row],
    variant: &str,
    reps: usize,
    f: &dyn Fn(&S6Row) -> Option<f64>,
) -> Vec<Option<f64>> {
    (0..reps)
        .map(|rep| {
            rows.iter()
                .find(|r| r.variant == variant && r.rep == rep && r.ok())
                .and_then(|r| f(r))
        })
        .collect()
}

/// pvschedd's counter `key` of the run's VMs.
fn policy_fig(r: &S6Row, key: &str) -> Option<f64> {
    r.policy.as_ref()?.get(key)?.as_f64()
}

fn hog_rate(r: &S6Row) -> Option<f64> {
    r.hogs.as_ref()?.rate
}

fn versus(rows: &[&S6Row], base: &str, variant: &str, reps: usize) -> Versus {
    let pair = |f: &dyn Fn(&S6Row) -> Option<f64>| {
        paired(
            &by_rep(rows, base, reps, f),
            &by_rep(rows, variant, reps, f),
        )
    };
    let per_cpu_s = pair(&S6Row::per_cpu_s);
    let hog = pair(&hog_rate);
    Versus {
        base: base.into(),
        throughput: pair(&|r| r.throughput),
        per_cpu_s,
        hog_rate: hog,
    }
}

impl S6Report {
    /// The report of `raw`'s rows.
    pub fn new(raw: S6Raw, command: String) -> S6Report {
        let reps = raw.rows.iter().map(|r| r.rep + 1).max().unwrap_or(0);
        let cells = s4::distinct(&raw.rows, |r| (r.topology.clone(), r.workload.clone()))
            .into_iter()
            .map(|(topology, workload)| {
                let rows: Vec<&S6Row> = raw
                    .rows
                    .iter()
                    .filter(|r| r.topology == topology && r.workload == workload)
                    .collect();
                let has = |v: &str| rows.iter().any(|r| r.variant == v);
                let variants = raw
                    .head
                    .variants
                    .iter()
                    .filter(|v| has(v))
                    .map(|v| {
                        let mine: Vec<&S6Row> =
                            rows.iter().copied().filter(|r| &r.variant == v).collect();
                        let cost = |f: fn(&CostCpu) -> f64| {
                            spread_of(&mine, move |r| r.cost_cpu_s.as_ref().map(f))
                        };
                        let vs = |base: &str| {
                            (v != base && has(base)).then(|| versus(&rows, base, v, reps))
                        };
                        VariantStats {
                            variant: v.clone(),
                            n: mine.iter().filter(|r| r.ok()).count(),
                            failed: mine.iter().filter(|r| !r.ok()).count(),
                            throughput: spread_of(&mine, |r| r.throughput),
                            per_cpu_s: spread_of(&mine, S6Row::per_cpu_s),
                            cost_qemu_s: cost(|c| c.qemu),
                            cost_device_s: cost(|c| c.device),
                            cost_pvschedd_s: cost(|c| c.pvschedd),
                            cost_bpf_s: cost(|c| c.bpf),
                            pvschedd_pct_per_vm: spread_of(&mine, S6Row::pvschedd_pct_per_vm),
                            own_pct_per_vm: spread_of(&mine, S6Row::own_pct_per_vm),
                            hog_rate: spread_of(&mine, hog_rate),
                            probe_p99_us: spread_of(&mine, |r| r.host_probe.as_ref()?.p99_us),
                            probe_max_us: spread_of(&mine, |r| r.host_probe.as_ref()?.max_us),
                            phase_changes: spread_of(&mine, |r| policy_fig(r, "phase_changes")),
                            yield_share: spread_of(&mine, |r| {
                                let changes =
                                    policy_fig(r, "phase_changes").filter(|c| *c > 0.0)?;
                                Some(2.0 * policy_fig(r, "phase_yields")? / changes)
                            }),
                            pvschedd_us_per_change: spread_of(&mine, |r| {
                                let changes =
                                    policy_fig(r, "phase_changes").filter(|c| *c > 0.0)?;
                                Some(r.cost_cpu_s?.pvschedd * 1e6 / changes)
                            }),
                            host_idle_pct: spread_of(&mine, |r| r.host_pct(&["idle", "iowait"])),
                            host_system_pct: spread_of(&mine, |r| {
                                r.host_pct(&["system", "irq", "softirq"])
                            }),
                            host_steal_pct: spread_of(&mine, |r| r.host_pct(&["steal"])),
                            host_wake_other_cpu_us: spread_of(&mine, |r| {
                                r.host_costs.as_ref()?.get("wake_other_cpu_us").copied()
                            }),
                            vs_vanilla: vs("vanilla"),
                            vs_none: vs("none"),
                            per_vm: per_vm(&rows, v, reps),
                        }
                    })
                    .collect();
                let unit = rows.iter().find_map(|r| r.unit.clone()).unwrap_or_default();
                S6Cell {
                    topology,
                    workload,
                    unit,
                    variants,
                }
            })
            .collect();
        S6Report {
            scenario: "s6".into(),
            command,
            failed: raw.rows.iter().filter(|r| !r.ok()).count(),
            cells,
            raw,
        }
    }

    /// Each cell's per-CPU-second figure, every repetition and the median,
    /// per variant.
    pub fn panels(&self) -> Vec<Panel> {
        self.cells
            .iter()
            .map(|c| {
                let rows: Vec<&S6Row> = self
                    .raw
                    .rows
                    .iter()
                    .filter(|r| r.topology == c.topology && r.workload == c.workload && r.ok())
                    .collect();
                Panel::of(
                    format!("{} {} per CPU-s", c.topology, c.workload),
                    c.variants.iter().map(|v| v.variant.clone()),
                    &rows,
                    |r| &r.variant,
                    S6Row::per_cpu_s,
                )
            })
            .collect()
    }
}

impl Render for S6Report {
    fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "S6, {} reps of {} s, {} hogs, kernel {}; {} failed runs{}.\n",
            self.raw.head.reps,
            self.raw.head.duration_s,
            self.raw.hogs,
            self.raw.kernel,
            self.failed,
            if self.raw.partial {
                " (partial run)"
            } else {
                ""
            }
        );
        for c in &self.cells {
            let _ = writeln!(s, "### {} {} ({})\n", c.topology, c.workload, c.unit);
            s.push_str(
                "| variant | n (failed) | throughput | per CPU-s | CPU s qemu / device / pvschedd / bpf | hog rate | pvschedd % of a CPU per VM | probe p99 / max µs | per CPU-s vs vanilla | vs none | hogs vs vanilla |\n\
                 | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
            );
            for v in &c.variants {
                // Verdicts are the targets' (below), not the cells'.
                let vs = |x: &Option<Versus>, hogs: bool| {
                    x.as_ref().map_or_else(
                        || "-".into(),
                        |x| s4::ratio_cell(if hogs { &x.hog_rate } else { &x.per_cpu_s }),
                    )
                };
                let _ = writeln!(
                    s,
                    "| {} | {} ({}) | {} | {} | {} / {} / {} / {} | {} | {} | {} / {} | {} | {} | {} |",
                    v.variant,
                    v.n,
                    v.failed,
                    v.throughput.cell(1),
                    v.per_cpu_s.cell(2),
                    v.cost_qemu_s.median_cell(2),
                    v.cost_device_s.median_cell(2),
                    v.cost_pvschedd_s.median_cell(2),
                    v.cost_bpf_s.median_cell(3),
                    v.hog_rate.cell(0),
                    v.pvschedd_pct_per_vm.median_cell(2),
                    v.probe_p99_us.median_cell(0),
                    v.probe_max_us.median_cell(0),
                    vs(&v.vs_vanilla, false),
                    vs(&v.vs_none, false),
                    vs(&v.vs_vanilla, true),
                );
            }
            s.push('\n');
            s.push_str(&per_vm_markdown(c));
        }
        s.push_str(&self.targets_markdown());
        s
    }
}

/// A mixed cell's VMs, each against the same VM in vanilla.
fn per_vm_markdown(c: &S6Cell) -> String {
    let mut s = String::new();
    if c.variants.iter().all(|v| v.per_vm.is_empty()) {
        return s;
    }
    s.push_str(
        "| variant | VM | workload | throughput | CPU s | per CPU-s | throughput vs vanilla | CPU vs vanilla | per CPU-s vs vanilla |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let ratio = |p: &Option<Paired>| p.as_ref().map_or_else(|| "-".into(), s4::ratio_cell);
    for v in &c.variants {
        for m in &v.per_vm {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                v.variant,
                m.index,
                m.workload,
                m.throughput.cell(1),
                m.cpu_s.cell(2),
                m.per_cpu_s.cell(2),
                ratio(&m.vs_vanilla_throughput),
                ratio(&m.vs_vanilla_cpu_s),
                ratio(&m.vs_vanilla_per_cpu_s),
            );
        }
    }
    s.push('\n');
    s
}

impl S6Report {
    /// Every target of [`TARGETS`] on every pvsched variant and workload it
    /// is for, with its verdict: met only when the ratio's whole 95 %
    /// interval is on the target's side.
    fn targets_markdown(&self) -> String {
        let mut s = String::from(
            "### Targets\n\n| target | goal | variant | cell | ratio to vanilla | verdict |\n| --- | --- | --- | --- | --- | --- |\n",
        );
        for &(name, goal, workloads, on_hogs, limit) in TARGETS {
            for c in &self.cells {
                // A mix has no summed work; its VMs are judged below.
                let mixed = c.workload.contains('+');
                if (mixed && !on_hogs)
                    || (!workloads.is_empty() && !workloads.contains(&c.workload.as_str()))
                {
                    continue;
                }
                for v in c
                    .variants
                    .iter()
                    .filter(|v| v.variant.starts_with("pvsched"))
                {
                    let Some(vs) = &v.vs_vanilla else { continue };
                    let p = if on_hogs { &vs.hog_rate } else { &vs.per_cpu_s };
                    let _ = writeln!(
                        s,
                        "| {name} | {goal} | {} | {} {} | {} | {} |",
                        v.variant,
                        c.topology,
                        c.workload,
                        s4::ratio_cell(p),
                        p.at_least(limit).word()
                    );
                }
            }
        }
        for c in &self.cells {
            for v in c
                .variants
                .iter()
                .filter(|v| v.variant.starts_with("pvsched"))
            {
                for m in v
                    .per_vm
                    .iter()
                    .filter(|m| BATCH.contains(&m.workload.as_str()))
                {
                    for (what, p) in [
                        ("work", &m.vs_vanilla_throughput),
                        ("CPU", &m.vs_vanilla_cpu_s),
                    ] {
                        let Some(p) = p else { continue };
                        let word = match (p.at_least(1.0 - FAIR_BAND), p.at_most(1.0 + FAIR_BAND)) {
                            (Verdict::Met, Verdict::Met) => Verdict::Met,
                            (Verdict::NotMet, _) | (_, Verdict::NotMet) => Verdict::NotMet,
                            _ => Verdict::Unresolved,
                        };
                        let _ = writeln!(
                            s,
                            "| s6_batch_fair | a batch VM beside a co-scheduled one: its {what} within ±{:.0} % of vanilla's | {} | {} {} VM {} ({}) | {} | {} |",
                            FAIR_BAND * 100.0,
                            v.variant,
                            c.topology,
                            c.workload,
                            m.index,
                            m.workload,
                            s4::ratio_cell(p),
                            word.word()
                        );
                    }
                }
            }
        }
        s
    }
}

/// The batch workloads: no synchronisation, nothing to gain.
const BATCH: &[&str] = &["cpu", "batch"];

/// How far a batch VM's work and CPU beside a co-scheduled VM may be from
/// vanilla's.
const FAIR_BAND: f64 = 0.05;

/// Runs S6 and writes its report; the exit code.
pub fn main(a: &S6Args) -> u8 {
    s4::exit_code(run(a))
}

fn run(a: &S6Args) -> Result<(), BenchError> {
    let mut args = s4::PyArgs::default();
    args.opt("--kernel", Some(&a.kernel))
        .opt("--topology", Some(&a.topology))
        .opt("--variants", Some(&a.variants))
        .opt("--reps", Some(a.reps))
        .opt("--duration", Some(a.duration))
        .opt("--workloads", a.workloads.as_ref())
        .opt("--hogs", a.hogs)
        .opt("--host-probe-prio", a.host_probe_prio)
        .opt("--cpu", a.cpu.as_ref())
        .flag("--quick", a.quick)
        .flag("--host-probe", a.host_probe);
    // The host's price of a wake-up and a change, before every round: a
    // host that is itself a VM changes it severalfold over a day.
    let exe = std::env::current_exe().ok();
    args.path("--host-costs-bin", exe.as_deref());
    let (raw, command): (S6Raw, String) = a.common.measured("s6", args)?;
    let report = S6Report::new(raw, command);
    a.common
        .finish(&report, "S6 THROUGHPUT PER CPU-SECOND", &report.panels())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn options_are_well_formed() {
        use clap::Args as _;
        S6Args::augment_args(clap::Command::new("t")).debug_assert();
    }

    fn row(variant: &str, rep: usize, tp: Option<f64>, qemu: f64, hog: f64) -> Value {
        json!({"topology": "1x2", "workload": "cpu", "variant": variant, "rep": rep,
               "order": 0, "tag": "t", "error": tp.is_none().then_some("no result"),
               "throughput": tp, "unit": "bogo ops/s", "iterations": 1000,
               "window_s": 10.0,
               "cost_cpu_s": {"qemu": qemu, "device": 0.5, "pvschedd": 0.25, "bpf": 0.25},
               "hogs": {"n": 2, "ops": 100, "elapsed_s": 11.0, "rate": hog,
                        "lead_s": 1.0, "tail_s": 0.1},
               "host_probe": null, "vms": []})
    }

    #[test]
    fn per_cpu_s_is_over_the_whole_vm_and_pairs_follow_the_rep() {
        let raw: S6Raw = serde_json::from_value(json!({
            "reps": 3, "duration_s": 5, "hogs": 2, "kernel": "7.3-cloud",
            "variants": ["none", "vanilla", "pvsched"],
            "rows": [row("vanilla", 0, Some(100.0), 9.0, 10.0),
                     row("vanilla", 1, Some(200.0), 9.0, 10.0),
                     row("vanilla", 2, Some(100.0), 9.0, 10.0),
                     row("pvsched", 0, Some(200.0), 9.0, 10.0),
                     row("pvsched", 1, None, 9.0, 10.0),
                     row("pvsched", 2, Some(200.0), 9.0, 10.0),
                     row("none", 0, Some(100.0), 4.0, 10.0)]
        }))
        .unwrap();
        assert_eq!(raw.rows[0].per_cpu_s(), Some(100.0));
        let r = S6Report::new(raw, "pvsched-bench s6".into());
        assert_eq!(r.failed, 1);
        let c = &r.cells[0];
        let names: Vec<&str> = c.variants.iter().map(|v| v.variant.as_str()).collect();
        assert_eq!(names, ["none", "vanilla", "pvsched"]);
        let pv = &c.variants[2];
        assert_eq!((pv.n, pv.failed), (2, 1));
        let vs = pv.vs_vanilla.as_ref().unwrap();
        // Reps 0 and 2 pair (x2 each); rep 1 failed in pvsched.
        assert_eq!((vs.per_cpu_s.n, vs.per_cpu_s.failed), (2, 1));
        assert_eq!(vs.per_cpu_s.ratio, Some(2.0));
        assert!(c.variants[0].vs_none.is_none() && c.variants[1].vs_vanilla.is_none());
        let back: S6Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        let md = back.markdown();
        assert!(md.contains("| pvsched | 2 (1) |"), "{md}");
        assert!(md.contains("x2.000 [2.00-2.00] (p "), "{md}");
        assert!(md.contains(", n 2, failed 1)"), "{md}");
        assert_eq!(r.panels()[0].groups[2].1, vec![200.0, 200.0]);
    }

    fn mixed_row(variant: &str, rep: usize, batch_tp: f64, batch_cpu: f64) -> Value {
        let vm = |w: &str, tp: f64, cpu: f64| {
            json!({"vm": "v", "workload": w, "unit": "u", "throughput": tp,
                   "iterations": 1, "cpu_s": cpu})
        };
        json!({"topology": "3x2", "workload": "hackbench+cpu+cpu", "variant": variant,
               "rep": rep, "order": 0, "tag": "t", "error": null, "throughput": null,
               "unit": "mixed", "iterations": 3, "window_s": 10.0,
               "cost_cpu_s": {"qemu": 30.0, "device": 0.0, "pvschedd": 0.0, "bpf": 0.0},
               "hogs": {"n": 2, "ops": 100, "elapsed_s": 11.0, "rate": 10.0,
                        "lead_s": 1.0, "tail_s": 0.1},
               "host_probe": null,
               "vms": [vm("hackbench", 1000.0, 10.0), vm("cpu", batch_tp, batch_cpu),
                       vm("cpu", batch_tp, batch_cpu)]})
    }

    #[test]
    fn where_the_hosts_cpu_went_and_its_costs_are_per_variant() {
        let mut a = row("pvsched", 0, Some(100.0), 9.0, 10.0);
        a["host_cpu"] = json!({"user": 30.0, "nice": 5.0, "system": 3.0, "idle": 1.0,
                               "iowait": 1.0, "irq": 0.0, "softirq": 0.0, "steal": 0.0});
        a["host_costs"] = json!({"wake_other_cpu_us": 18.0, "wake_same_cpu_us": 1.2});
        // A row of a run before these were recorded has neither.
        let b = row("pvsched", 1, Some(100.0), 9.0, 10.0);
        let raw: S6Raw = serde_json::from_value(json!({
            "reps": 2, "duration_s": 5, "hogs": 2, "kernel": "7.3-cloud",
            "variants": ["pvsched"], "rows": [a, b]
        }))
        .unwrap();
        assert_eq!(raw.rows[0].host_pct(&["idle", "iowait"]), Some(5.0));
        assert_eq!(raw.rows[1].host_pct(&["idle"]), None);
        let r = S6Report::new(raw, "pvsched-bench s6".into());
        let v = &r.cells[0].variants[0];
        assert_eq!((v.host_idle_pct.n, v.host_idle_pct.median), (1, Some(5.0)));
        assert_eq!(v.host_system_pct.median, Some(7.5));
        assert_eq!(v.host_steal_pct.median, Some(0.0));
        assert_eq!(v.host_wake_other_cpu_us.median, Some(18.0));
        // Kept through the JSON, and absent again where it was absent.
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["raw"]["rows"][0]["host_costs"]["wake_same_cpu_us"], 1.2);
        assert!(j["raw"]["rows"][1].get("host_cpu").is_none());
    }

    #[test]
    fn a_mix_is_judged_vm_by_vm_against_the_same_vm_in_vanilla() {
        let raw: S6Raw = serde_json::from_value(json!({
            "reps": 2, "duration_s": 5, "hogs": 2, "kernel": "7.3-cloud",
            "variants": ["vanilla", "pvsched"],
            "rows": [mixed_row("vanilla", 0, 100.0, 10.0), mixed_row("vanilla", 1, 100.0, 10.0),
                     mixed_row("pvsched", 0, 99.0, 10.0), mixed_row("pvsched", 1, 101.0, 10.0)]
        }))
        .unwrap();
        let r = S6Report::new(raw, "pvsched-bench s6".into());
        assert_eq!(r.failed, 0);
        let pv = &r.cells[0].variants[1];
        assert_eq!(pv.n, 2);
        let names: Vec<&str> = pv.per_vm.iter().map(|m| m.workload.as_str()).collect();
        assert_eq!(names, ["hackbench", "cpu", "cpu"]);
        let tp = pv.per_vm[1].vs_vanilla_throughput.as_ref().unwrap();
        assert_eq!((tp.n, tp.min, tp.max), (2, Some(0.99), Some(1.01)));
        assert_eq!(
            pv.per_vm[1].vs_vanilla_cpu_s.as_ref().unwrap().ratio,
            Some(1.0)
        );
        assert!(
            r.cells[0].variants[0]
                .per_vm
                .iter()
                .all(|m| m.vs_vanilla_cpu_s.is_none())
        );
        let md = r.markdown();
        assert!(md.contains("| s6_batch_fair |"), "{md}");
        assert!(md.contains("3x2 hackbench+cpu+cpu VM 1 (cpu)"), "{md}");
        // The summed targets skip the mix: it has no summed work.
        assert!(!md.contains("| s6_no_loss |"), "{md}");
    }
}
