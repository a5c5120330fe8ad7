//! `pvsched-bench <s1|s2|s3|s4|s5|s6>`: vanilla vs pvsched back to back in
//! one invocation, repetitions interleaved, medians and spread, ratios
//! pvsched/vanilla and the targets, as a table or one JSON object (the same
//! top-level shape for every scenario), with optional PNG CDFs. A developer's
//! and evaluator's tool, kept out of the operator's `pvsched` binary.
//!
//! * [`scenario`]: S1–S3 and S5 variants and their JSON; [`runner`] runs
//!   one variant once in a child [`worker`] (`pvsched-bench run`) beside
//!   [`hogs`], counting the hogs' work; [`costs`] holds S3's host-only
//!   measurements.
//! * [`s4`], [`s6`]: the Linux-guest scenarios: run `python3 -m
//!   pvsched_bench s4|s6` (the measurement) and compute the report from
//!   its raw rows, with [`paired`] ratios; [`plot_spread`] draws their
//!   spread; the reports render through [`docgen`].
//! * [`report`]: the typed parts of the JSON (variants, runs, ratios,
//!   targets, BPF costs).
//! * [`plot`] + [`font`]: PNG CDFs; [`stats`]: percentiles and medians;
//!   [`machine`]: what it ran on.

pub mod costs;
pub mod docgen;
pub mod font;
pub use pvsched::hogs;
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
use serde_json::{Map, Value, json};
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
    /// A run failed (its own message is above on stderr).
    #[error("bench: the {variant} run failed (exit code {code:?}; its message is above)")]
    Worker {
        variant: &'static str,
        code: Option<i32>,
    },
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
        Command::Run(a) => return std::process::ExitCode::from(worker::main(&a) as u8),
        Command::Device(a) => {
            env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
                .init();
            return pvsched_transport::cli::main("pvsched-bench device", &a);
        }
    };
    std::process::ExitCode::from(run(scenario, &args))
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
    /// Repetitions, interleaved vanilla, pvsched, ... (default 3, quick 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub reps: Option<u32>,
    /// Workload time of each run, e.g. 10s (default 10s, quick 2s; S4:
    /// whole seconds per phase, passed to s4.py).
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
    /// S3: an S4 result (JSON) to take `guest_hook_ns` from.
    #[arg(long)]
    pub s4_json: Option<PathBuf>,
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
    let _ = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .try_init();
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
    let mut head = Map::new();
    let name = format!("{:?}", scenario).to_lowercase();
    head.insert("scenario".into(), json!(name));
    head.insert("quick".into(), json!(a.quick));
    head.insert("reps".into(), json!(reps));
    head.insert("machine".into(), machine::describe());
    head.insert("command".into(), json!(command_line()));
    // One arm since S4 left; a match still, so that the block keeps its
    // indentation until the S1-S5 rework lands.
    #[allow(clippy::match_single_binding)]
    let (body, plot_fn): (Map<String, Value>, PlotFn) = match scenario {
        s => {
            let sc = match s {
                ScenarioArg::S1 => Scenario::S1,
                ScenarioArg::S2 => Scenario::S2,
                ScenarioArg::S5 => Scenario::S5,
                _ => Scenario::S3,
            };
            if sc == Scenario::S5 {
                // Fail before any run if this build's guest lacks it.
                worker::BenchWorkload::Greedy
                    .workload()
                    .map_err(|e| BenchError::Setup(format!("s5 needs the greedy workload: {e}")))?;
            }
            let load = Load {
                kind: a.load,
                n: a.hogs.unwrap_or_else(|| sc.default_hogs(machine::cpus())),
            };
            head.insert("duration_s".into(), json!(duration.as_secs_f64()));
            head.insert("hogs".into(), json!(load.n));
            head.insert("load".into(), json!(load.kind.name()));
            head.insert("hog_threads".into(), json!(load.threads()));
            head.insert(
                "device_mode".into(),
                json!(match a.device_mode {
                    BenchDeviceMode::InProcess => "in-process",
                    BenchDeviceMode::Sandboxed => "sandboxed",
                }),
            );
            let guest_hook = match &a.s4_json {
                Some(p) => Some(read_json(p)?),
                None => None,
            };
            // S3 counts BPF run time; on for the whole scenario.
            let _stats = if sc == Scenario::S3 {
                Some(costs::BpfStats::enable()?)
            } else {
                None
            };
            head.insert(
                "caps".into(),
                json!(
                    a.caps
                        .as_ref()
                        .map_or_else(|| "default".to_owned(), |p| p.display().to_string())
                ),
            );
            let opts = runner::RunOpts {
                duration,
                mode: a.device_mode,
                caps: a.caps.clone(),
                trace: trace_opts(sc, a)?,
            };
            if let Some(t) = &opts.trace {
                head.insert("trace_dir".into(), json!(t.dir.display().to_string()));
            }
            let runs = scenario::execute(sc, scenario::variants(sc, load), reps, &opts)?;
            let body = scenario::assemble(sc, &runs, guest_hook.as_ref())?;
            let series = scenario::series(&runs);
            let title = match sc {
                Scenario::S1 => "S1 WAKEUP: MSI INJECTION TO GUEST HANDLER",
                Scenario::S2 => "S2 IPI/SPIN ROUND TRIP, 4 VCPUS, HOGS",
                Scenario::S3 => "S3 BPF NS PER EVENT (RUN_TIME_NS/RUN_CNT)",
                Scenario::S5 => "S5 GREEDY GUEST: BOOSTED MS PER BUDGET WINDOW (WORST REP)",
            };
            let plot_fn: PlotFn = match (&a.plot, sc) {
                (None, _) => Box::new(|_| Ok(())),
                (Some(p), Scenario::S3) => {
                    let p = p.clone();
                    Box::new(move |j| {
                        plot::bars_png(&p, title, "NS/EVENT", &scenario::s3_bars(j), Some(300.0))
                            .map_err(BenchError::from)
                    })
                }
                (Some(p), Scenario::S5) => {
                    let p = p.clone();
                    Box::new(move |j| {
                        let (bars, budget) = scenario::s5_bars(j);
                        plot::bars_png(
                            &p,
                            title,
                            "MS BOOSTED PER WINDOW (TARGET: BUDGET)",
                            &bars,
                            budget,
                        )
                        .map_err(BenchError::from)
                    })
                }
                (Some(p), _) => {
                    let p = p.clone();
                    Box::new(move |_| {
                        plot::cdf_png(&p, title, "LATENCY (US)", &series).map_err(BenchError::from)
                    })
                }
            };
            (body, plot_fn)
        }
    };
    let mut all = head;
    all.extend(body);
    let j = Value::Object(all);
    plot_fn(&j)?;
    if let Some(p) = &a.plot {
        eprintln!("pvsched-bench: plot written to {}", p.display());
    }
    match a.json.as_deref() {
        Some("-") => println!("{j}"),
        Some(path) => {
            let text = serde_json::to_string_pretty(&j).unwrap_or_else(|_| j.to_string());
            std::fs::write(path, text + "\n").map_err(|e| BenchError::Write {
                path: path.into(),
                source: e,
            })?;
            print_table(&j);
        }
        None => print_table(&j),
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

fn read_json(p: &std::path::Path) -> Result<Value, BenchError> {
    let text = std::fs::read_to_string(p)
        .map_err(|e| BenchError::Setup(format!("reading {}: {e}", p.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| BenchError::Setup(format!("{} is not JSON: {e}", p.display())))
}

/// Draws the scenario's plot from its final JSON.
type PlotFn = Box<dyn Fn(&Value) -> Result<(), BenchError>>;

fn num(v: &Value) -> String {
    v.as_f64().map_or_else(|| "-".into(), |x| format!("{x:.1}"))
}

/// The human summary: one row per variant, ratios, targets.
fn print_table(j: &Value) {
    println!(
        "\npvsched-bench {}: {} rep(s){}",
        j["scenario"].as_str().unwrap_or("?"),
        j["reps"],
        if j["quick"] == true { ", quick" } else { "" }
    );
    println!(
        "{:<16} {:>10} {:>10} {:>10} {:>14} {:>8} {:>8} {:>12}   (medians over reps, µs; hog \
         iterations/s; CPU-s of the VMM and the hogs; events per VMM CPU-s)",
        "variant", "p50", "p99", "max", "hogs it/s", "vm cpu", "hog cpu", "ev/vm cpu-s"
    );
    let sci = |v: &Value| {
        v.as_f64()
            .map_or_else(|| "-".into(), |x| format!("{x:.3e}"))
    };
    let secs = |v: &Value| v.as_f64().map_or_else(|| "-".into(), |x| format!("{x:.2}"));
    if let Some(o) = j.as_object() {
        for (k, v) in o {
            if v.get("p99_us").is_some() && v.get("p50_us").is_some() {
                println!(
                    "{k:<16} {:>10} {:>10} {:>10} {:>14} {:>8} {:>8} {:>12}",
                    num(&v["p50_us"]),
                    num(&v["p99_us"]),
                    num(&v["max_us"]),
                    sci(&v["hog_iterations_per_s"]),
                    secs(&v["vm_cpu_s"]),
                    secs(&v["hog_cpu_s"]),
                    sci(&v["events_per_vm_cpu_s"]),
                );
            }
        }
    }
    println!(
        "pvsched/vanilla: p50 {}  p99 {}  max {}  VMM CPU {}  events per VMM CPU-s {}",
        j["ratio_p50"],
        j["ratio_p99"],
        j["ratio_max"],
        j["ratio_vm_cpu_s"],
        j["ratio_events_per_vm_cpu_s"]
    );
    if let Some(r) = j.get("vanilla_loaded_vs_idle_p99") {
        println!(
            "vanilla loaded/idle p99 {r}: the load {} the problem (wanted >= {}x)",
            if j["load_shows_problem"] == true {
                "shows"
            } else {
                "does NOT show"
            },
            scenario::LOAD_SHOWS_PROBLEM
        );
    }
    let g = &j["greedy"];
    for (i, rep) in g["reps"].as_array().into_iter().flatten().enumerate() {
        for v in rep["per_vcpu"].as_array().into_iter().flatten() {
            println!(
                "greedy rep {} vCPU {}: boosted {} µs per {} µs window = {} of budget {} µs (boosts {}, throttles {})",
                i + 1,
                v["index"],
                num(&v["boosted_us_per_window"]),
                g["window_us"],
                v["of_budget"],
                g["budget_us"],
                v["boosts"],
                v["throttles"]
            );
        }
    }
    for t in j["targets"].as_array().into_iter().flatten() {
        println!(
            "target {:<20} {:<7} value {}  ({})",
            t["name"].as_str().unwrap_or("?"),
            if t["met"] == true { "MET" } else { "NOT MET" },
            t["value"],
            t["goal"].as_str().unwrap_or("")
        );
    }
}
