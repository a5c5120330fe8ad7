//! `pvsched-bench <s1|s2|s3|s4|s5|s6>`: vanilla vs pvsched back to back in
//! one invocation, repetitions interleaved, medians and spread, ratios
//! pvsched/vanilla and the targets, as a table or one JSON object (the same
//! top-level shape for every scenario), with optional PNG CDFs. A developer's
//! and evaluator's tool, kept out of the operator's `pvsched` binary.
//!
//! * [`scenario`]: S1–S3 and S5 variants, the run order of a repetition
//!   (rotated from one repetition to the next) and their report; [`runner`]
//!   runs one variant once in a child [`worker`] (`pvsched-bench run`)
//!   beside [`hogs`], counting the hogs' work; [`floor`] measures the idle
//!   host's own floor (cyclictest) in every repetition of S1 and S2;
//!   [`costs`] holds S3's host-only measurements; [`host_costs`] what
//!   the applier's operations (wake-up, sleep, `sched_setattr`) cost here.
//! * [`s4`], [`s6`]: the Linux-guest scenarios: run `python3 -m
//!   pvsched_bench s4|s6` (the measurement) and compute the report from
//!   its raw rows; [`plot_spread`] draws their spread.
//! * [`report`]: the typed report of S1–S3 and S5 (variants, runs, paired
//!   ratios, floor, targets with verdicts, BPF costs), its JSON and its
//!   markdown tables; [`paired`]: ratios paired per repetition and their
//!   verdicts; [`docgen`]: the results page drawn from the reports.
//! * [`plot`] + [`font`]: PNG CDFs; [`stats`]: percentiles and medians;
//!   [`machine`]: what it ran on.

pub mod costs;
pub mod docgen;
pub mod floor;
pub mod font;
pub mod host_costs;
pub use pvsched_host::hogs;
pub mod machine;
pub mod paired;
pub mod plot;
pub mod plot_spread;
pub mod report;
pub mod runner;
pub mod s4;
pub mod s6;
pub mod scenario;
pub mod sched_trace;
pub mod stats;
pub mod worker;

use clap::{Args, Parser, Subcommand};
use hogs::{Load, LoadKind};
use pvsched_util::exit::{self, Exit};
use scenario::Scenario;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;
use worker::BenchDeviceMode;

/// Errors of `pvsched-bench`.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum BenchError {
    /// S3's host-side measurements failed.
    #[error("{0}")]
    Costs(#[from] costs::CostError),
    /// This program's path is unknown (needed to start the runs).
    #[error("bench: cannot find this program to start the measured runs: {0}")]
    Exe(#[source] std::io::Error),
    /// The CPU hogs could not start.
    #[error("bench: starting the CPU hog threads failed: {0}")]
    Hogs(#[source] std::io::Error),
    /// A run's output could not be read.
    #[error("bench: the output of the {variant} run: {source}")]
    Parse {
        variant: &'static str,
        #[source]
        source: runner::ReadError,
    },
    /// `--trace` could not record or name a run's stalls.
    #[error("bench: {0}")]
    Trace(#[from] sched_trace::TraceError),
    /// The raw rows of `pvsched_bench s4|s6`, or a report, are not what
    /// this program reads or writes.
    #[error("bench: the raw rows or the report are not the JSON expected: {0}")]
    Raw(#[source] serde_json::Error),
    /// A plot could not be drawn.
    #[error("bench: {0}")]
    Plot(#[from] plot::PlotError),
    /// An S4 or S6 plot could not be drawn.
    #[error("bench: {0}")]
    SpreadPlot(#[from] plot_spread::SpreadPlotError),
    /// Something the bench needs is missing.
    #[error("bench: {0}")]
    Setup(String),
    /// A child process could not be started or read.
    #[error("bench: running a measured child process failed: {0}")]
    Spawn(#[source] std::io::Error),
    /// A run overran and was killed.
    #[error("bench: the {variant} run did not finish within {secs} s and was killed")]
    Timeout { variant: &'static str, secs: u64 },
    /// `cyclictest` (rt-tests), which measures the idle host's floor, is
    /// not installed.
    #[error(
        "bench: cyclictest not found on PATH: it measures the idle host's floor in every repetition (install rt-tests, or pass --no-floor)"
    )]
    NoCyclictest,
    /// Some runs failed; the report counts them (`failed`).
    #[error("bench: {0} run(s) failed; the report counts them and says why")]
    RunsFailed(usize),
    /// A run failed (its own message is above on stderr).
    #[error("bench: the {variant} run failed (exit code {code:?}; its message is above)")]
    Worker {
        variant: &'static str,
        code: Option<i32>,
    },
    /// The report could not be turned into JSON.
    #[error("bench: the report is not JSON: {0}")]
    Report(#[source] serde_json::Error),
    /// The JSON or plot file could not be written.
    #[error("bench: writing {path} failed: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl BenchError {
    /// The exit code: a run's own code (no KVM, no BPF...) when it has
    /// one, else "the bench could not run".
    pub fn exit(&self) -> u8 {
        match self {
            BenchError::Worker {
                code: Some(c @ 3..=8),
                ..
            } => *c as u8,
            // A missing capability of this host, as a run without KVM
            // reports it: tests skip on it.
            _ => Exit::Bench as u8,
        }
    }
}

/// pvsched-bench: vanilla vs pvsched, measured back to back.
#[derive(Parser)]
#[command(name = "pvsched-bench", version, about, after_help = exit::help(&Exit::ALL))]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Wakeup latency, host loaded with CPU hogs, plus an idle-host baseline.
    #[command(after_help = exit::help(&Exit::ALL))]
    S1(BenchArgs),
    /// IPI and spin round trips with vCPUs > pCPUs, with and without the
    /// directed-yield boost.
    #[command(after_help = exit::help(&Exit::ALL))]
    S2(BenchArgs),
    /// Costs: BPF ns/event, decision→applied, handshake, bytes per vCPU.
    #[command(after_help = exit::help(&Exit::ALL))]
    S3(BenchArgs),
    /// Seed reproduction: cyclictest in Linux guests under QEMU TCG (runs
    /// `python3 -m pvsched_bench s4`, reports from its rows).
    #[command(after_help = exit::help(&Exit::ALL))]
    S4(s4::S4Args),
    /// Greedy guest (asks for RT forever, spins on every vCPU) beside busy
    /// hogs: boosted time per budget window and the hogs' share.
    #[command(after_help = exit::help(&Exit::ALL))]
    S5(BenchArgs),
    /// Throughput of Linux guests under overcommit per CPU-second of the
    /// whole VM (runs `python3 -m pvsched_bench s6`, reports from its rows).
    #[command(after_help = exit::help(&Exit::ALL))]
    S6(s6::S6Args),
    /// What a wake-up, a sleep and a sched_setattr cost in CPU time on this
    /// host (the operations pvschedd's applier is made of).
    #[command(after_help = exit::help(&Exit::ALL))]
    HostCosts(host_costs::HostCostsArgs),
    /// Redraw the results page's figures from the JSON reports it cites
    /// (`--check`: only compare, exit 1 on any difference).
    #[command(after_help = exit::help(&Exit::ALL))]
    Doc(DocArgs),
    /// One measured run (internal: the bench starts one per variant and
    /// repetition).
    #[command(hide = true)]
    Run(worker::WorkerArgs),
    /// The sandboxed device process of a measured run (internal).
    #[command(hide = true)]
    Device(pvsched_transport::cli::DeviceArgs),
}

fn main() -> std::process::ExitCode {
    let (scenario, args) = match Cli::parse().command {
        Command::S1(a) => (ScenarioArg::S1, a),
        Command::S2(a) => (ScenarioArg::S2, a),
        Command::S3(a) => (ScenarioArg::S3, a),
        Command::S4(a) => return std::process::ExitCode::from(s4::main(&a)),
        Command::S5(a) => (ScenarioArg::S5, a),
        Command::S6(a) => return std::process::ExitCode::from(s6::main(&a)),
        Command::HostCosts(a) => {
            return std::process::ExitCode::from(host_costs::main(&a, command_line()));
        }
        Command::Doc(a) => return std::process::ExitCode::from(doc(&a)),
        Command::Run(a) => return std::process::ExitCode::from(worker::main(&a) as u8),
        Command::Device(a) => {
            pvsched_util::logging::init("info", pvsched_util::logging::Clock::Time);
            return pvsched_transport::cli::main("pvsched-bench device", &a);
        }
    };
    std::process::ExitCode::from(run(scenario, &args))
}

/// Arguments of `pvsched-bench doc`.
#[derive(Args, Debug)]
pub struct DocArgs {
    /// Compare only: list every figure that differs from its JSON and exit
    /// 1, leaving the page as it is.
    #[arg(long)]
    pub check: bool,
    /// The page (its markers name JSON files relative to the repository
    /// that holds it: the nearest parent with a Cargo.lock).
    #[arg(default_value = "docs/benchmarks.md")]
    pub page: PathBuf,
}

/// `pvsched-bench doc`: 0 when the page matches its JSON (or was
/// rewritten), 1 on a difference under `--check`, 2 when a marker, a file
/// or a figure it names is wrong.
fn doc(a: &DocArgs) -> u8 {
    let page = std::path::absolute(&a.page).unwrap_or_else(|_| a.page.clone());
    let Some(root) = page.ancestors().find(|d| d.join("Cargo.lock").is_file()) else {
        eprintln!(
            "pvsched-bench doc: no repository (a parent with Cargo.lock) holds {}",
            page.display()
        );
        return Exit::Usage as u8;
    };
    match docgen::run(&page, root, a.check) {
        Ok(diffs) if diffs.is_empty() => 0,
        Ok(diffs) => {
            for d in &diffs {
                eprintln!(
                    "{}:{}: the page says {:?}, its JSON gives {:?}",
                    a.page.display(),
                    d.line,
                    d.page,
                    d.json
                );
            }
            if a.check {
                eprintln!(
                    "pvsched-bench doc: {} figure(s) differ from their JSON; run `pvsched-bench doc` to redraw them",
                    diffs.len()
                );
                Exit::Failure as u8
            } else {
                0
            }
        }
        Err(e) => {
            eprintln!("pvsched-bench {e}");
            Exit::Usage as u8
        }
    }
}

/// Scenarios of `pvsched-bench` (what each measures: its subcommand's help).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScenarioArg {
    /// S1.
    S1,
    /// S2.
    S2,
    /// S3.
    S3,
    /// S5.
    S5,
}

/// Arguments of every `pvsched-bench` scenario.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Short runs (1 repetition, 2 s each unless given): S1 takes ~15 s.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions (default 3, quick 1). Each runs every variant once (S1,
    /// S2: and the idle host's floor), in an order that rotates from one
    /// repetition to the next.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub reps: Option<u32>,
    /// Workload time of each run, e.g. 10s (default 10s, quick 2s).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Write the JSON result here (`-` = stdout; progress stays on stderr).
    #[arg(long)]
    pub json: Option<String>,
    /// Write a PNG plot here (latency CDFs, log x; S3: BPF ns/event).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// CPU hogs on the loaded host, of the --load kind (mixed: this many
    /// of each); default: S1 two per online CPU, others one per online CPU.
    #[arg(long)]
    pub hogs: Option<usize>,
    /// Kind of CPU hogs: busy (never sleep), sleepy (run 0.5-5 ms, sleep
    /// 0.1-1 ms), mixed (--hogs of each).
    #[arg(long, value_enum, default_value_t = LoadKind::Busy)]
    pub load: LoadKind,
    /// Where the pvsched device runs during the measured runs.
    #[arg(long, value_enum, default_value_t = BenchDeviceMode::InProcess)]
    pub device_mode: BenchDeviceMode,
    /// Caps (TOML, see bpf-policy/caps.example.toml) for the pvsched
    /// variants; default: the built-in caps.
    #[arg(long)]
    pub caps: Option<PathBuf>,
    /// S1, S2: do not measure the idle host's floor (cyclictest, no VM, no
    /// hogs, in every repetition); without it the floor target is
    /// unresolved.
    #[arg(long)]
    pub no_floor: bool,
    /// S1, S2, S5: record each run's scheduler events in a tracefs
    /// instance (as root) and name every wait of a vCPU thread over 1 ms
    /// in its measured time with `pvsched_bench stall-trace` (stolen, unboosted,
    /// behind-rt, behind-fair, other); writes DIR/SCENARIO-repN-VARIANT.trace
    /// and .stalls.json, and puts the counts in the run's JSON (`trace`).
    /// The tracer's own cost is in every traced run.
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// With --trace: the trace buffer per CPU, MiB (a lost event is
    /// reported in the run's `trace.overrun`).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub trace_buffer_mb: u64,
    /// With --trace: record only these variants (comma-separated names as
    /// in the JSON, e.g. vanilla,pvsched); default every one.
    #[arg(long, value_delimiter = ',')]
    pub trace_variants: Option<Vec<String>>,
    /// --trace: the repository (python/pvsched_bench); default
    /// $PVSCHED_ROOT, else the current directory or its nearest parent
    /// that has it.
    #[arg(long)]
    pub repo: Option<PathBuf>,
}

/// Runs scenario `s`; returns the exit code.
fn run(s: ScenarioArg, a: &BenchArgs) -> u8 {
    pvsched_util::logging::init("warn", pvsched_util::logging::Clock::NoTime);
    match bench(s, a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pvsched-bench: {e}");
            e.exit()
        }
    }
}

/// The command line that reproduces this run.
fn command_line() -> String {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    args.insert(0, "pvsched-bench".into());
    args.join(" ")
}

fn bench(scenario: ScenarioArg, a: &BenchArgs) -> Result<(), BenchError> {
    let reps = a.reps.unwrap_or(if a.quick { 1 } else { 3 });
    let duration = a
        .duration
        .unwrap_or(Duration::from_secs(if a.quick { 2 } else { 10 }));
    let sc = match scenario {
        ScenarioArg::S1 => Scenario::S1,
        ScenarioArg::S2 => Scenario::S2,
        ScenarioArg::S3 => Scenario::S3,
        ScenarioArg::S5 => Scenario::S5,
    };
    if sc == Scenario::S5 {
        // Fail before any run if this build's guest lacks it.
        worker::BenchWorkload::Greedy
            .workload()
            .map_err(|e| BenchError::Setup(format!("s5 needs the greedy workload: {e}")))?;
    }
    // The idle host's floor, for the scenarios with latency tails; found
    // before any run.
    let cyclictest = match sc {
        Scenario::S1 | Scenario::S2 if !a.no_floor => {
            Some(floor::find().ok_or(BenchError::NoCyclictest)?)
        }
        _ => None,
    };
    let load = Load {
        kind: a.load,
        n: a.hogs.unwrap_or_else(|| sc.default_hogs(machine::cpus())),
    };
    // S3 counts BPF run time; on for the whole scenario.
    let _stats = if sc == Scenario::S3 {
        Some(costs::BpfStats::enable()?)
    } else {
        None
    };
    let opts = runner::RunOpts {
        duration,
        mode: a.device_mode,
        caps: a.caps.clone(),
        trace: trace_opts(sc, a)?,
    };
    let options = report::Options {
        quick: a.quick,
        reps,
        duration_s: duration.as_secs_f64(),
        hogs: load.n,
        load: load.kind.name().into(),
        hog_threads: load.threads(),
        device_mode: match a.device_mode {
            BenchDeviceMode::InProcess => "in-process",
            BenchDeviceMode::Sandboxed => "sandboxed",
        }
        .into(),
        caps: a
            .caps
            .as_ref()
            .map_or_else(|| "default".to_owned(), |p| p.display().to_string()),
        trace_dir: opts.trace.as_ref().map(|t| t.dir.display().to_string()),
        floor: cyclictest.is_some(),
    };
    let ex = scenario::execute(
        sc,
        scenario::variants(sc, load),
        reps,
        &opts,
        cyclictest.as_deref(),
    )?;
    let report = scenario::assemble(sc, &ex, command_line(), options)?;
    if let Some(p) = &a.plot {
        let title = match sc {
            Scenario::S1 => "S1 WAKEUP: MSI INJECTION TO GUEST HANDLER",
            Scenario::S2 => "S2 IPI/SPIN ROUND TRIP, 4 VCPUS, HOGS",
            Scenario::S3 => "S3 BPF NS PER EVENT (RUN_TIME_NS/RUN_CNT)",
            Scenario::S5 => "S5 GREEDY GUEST: BOOSTED MS PER BUDGET WINDOW (WORST REP)",
        };
        match sc {
            Scenario::S3 => plot::bars_png(
                p,
                title,
                "NS/EVENT",
                &scenario::s3_bars(&report),
                Some(300.0),
            )?,
            Scenario::S5 => {
                let (bars, budget) = scenario::s5_bars(&report);
                plot::bars_png(
                    p,
                    title,
                    "MS BOOSTED PER WINDOW (TARGET: BUDGET)",
                    &bars,
                    budget,
                )?
            }
            _ => plot::cdf_png(p, title, "LATENCY (US)", &scenario::series(&ex.runs))?,
        }
        eprintln!("pvsched-bench: plot written to {}", p.display());
    }
    let j = serde_json::to_value(&report).map_err(BenchError::Report)?;
    emit(a, &j, || {
        println!("\n{}", docgen::Render::markdown(&report))
    })?;
    // Written first: the report says which runs failed and why.
    match scenario::failed_runs(&ex) {
        0 => Ok(()),
        n => Err(BenchError::RunsFailed(n)),
    }
}

/// Writes the JSON where `--json` says (`-`: stdout) and, unless it went
/// to stdout, the human summary.
fn emit(a: &BenchArgs, j: &Value, table: impl FnOnce()) -> Result<(), BenchError> {
    match a.json.as_deref() {
        Some("-") => println!("{j}"),
        Some(path) => {
            let text = serde_json::to_string_pretty(j).unwrap_or_else(|_| j.to_string());
            std::fs::write(path, text + "\n").map_err(|e| BenchError::Write {
                path: path.into(),
                source: e,
            })?;
            table();
        }
        None => table(),
    }
    Ok(())
}

/// `--trace`: where, with what, checked before any run.
fn trace_opts(sc: Scenario, a: &BenchArgs) -> Result<Option<sched_trace::TraceOpts>, BenchError> {
    let Some(dir) = &a.trace else {
        return Ok(None);
    };
    if sc == Scenario::S3 {
        return Err(BenchError::Setup(
            "--trace is for s1, s2 and s5 (S3 measures the policy's own cost, which a trace would add to)".into(),
        ));
    }
    let repo = s4::repo_or_err(a.repo.as_deref())?;
    let script = repo.join("python/pvsched_bench/stall_trace.py");
    if !script.is_file() {
        return Err(BenchError::Setup(format!(
            "--trace: {} is missing",
            script.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| BenchError::Write {
        path: dir.clone(),
        source: e,
    })?;
    Ok(Some(sched_trace::TraceOpts {
        dir: dir.clone(),
        script,
        buffer_kb: a.trace_buffer_mb * 1024,
        variants: a.trace_variants.clone(),
        kvm: sc == Scenario::S1,
    }))
}
