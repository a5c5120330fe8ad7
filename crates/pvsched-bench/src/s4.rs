//! S4: cyclictest in real Linux guests under QEMU TCG with the guest
//! module, the host loaded with stress-ng. `pvsched-bench s4` runs
//! `python3 -m pvsched_bench s4` (the measurement; one raw row per phase
//! run, the host's floor per repetition), reads the rows into [`S4Run`]
//! and computes the report here: per kernel, load, interval and variant
//! the spread of the guest's and the host's p99 and max, and paired
//! ratios against vanilla (index = repetition) with verdicts.
//!
//! Also what S4 and S6 share: finding the repository and the binaries,
//! running the package, [`Spread`], and writing a report.

use super::BenchError;
use super::docgen::Render;
use super::paired::{Paired, Verdict, median_sorted, paired};
use super::plot_spread::{self, Panel};
use super::report::{FloorReport, FloorRow};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The package's entry point, relative to the repository.
const PACKAGE: &str = "python/pvsched_bench/__main__.py";
/// pvsched's guest max at most this share of vanilla's.
pub const GUEST_MAX_TARGET: f64 = 0.1;
/// The host's max at most this share of vanilla's.
pub const HOST_MAX_TARGET: f64 = 1.1;

/// The repository whose `python/pvsched_bench` runs: `--repo`, else
/// `$PVSCHED_ROOT`, else the current directory or the nearest parent of it
/// that has it (S4 and S6 need the repository: the harness, the guest
/// driver's source and the fetched guest kernels; nothing of it is baked
/// into this binary). `None` if none is found.
pub fn repo_root(arg: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = arg {
        return Some(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("PVSCHED_ROOT") {
        return Some(PathBuf::from(p));
    }
    let cwd = std::env::current_dir().ok()?;
    cwd.ancestors()
        .find(|d| d.join(PACKAGE).is_file())
        .map(Path::to_path_buf)
}

/// [`repo_root`], or the error that says how to give it.
pub fn repo_or_err(arg: Option<&Path>) -> Result<PathBuf, BenchError> {
    repo_root(arg).ok_or_else(|| {
        BenchError::Setup(format!(
            "the guest benchmarks run the repository's {PACKAGE}: run from the repository, or give it with --repo DIR or PVSCHED_ROOT"
        ))
    })
}

/// `name` next to this binary (same target dir), else in `<repo>/target/release`.
pub fn find_bin(name: &str, repo: &Path) -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(name)));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| repo.join("target"), PathBuf::from)
        .join("release")
        .join(name);
    [beside, Some(target)]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}

/// The binaries the guest benchmarks start.
pub struct Bins {
    device: PathBuf,
    pvsched: PathBuf,
    pvschedd: PathBuf,
}

impl Bins {
    /// The given ones, else found by [`find_bin`].
    pub fn find(
        repo: &Path,
        device: Option<&Path>,
        pvsched: Option<&Path>,
        pvschedd: Option<&Path>,
    ) -> Result<Bins, BenchError> {
        let need = |given: Option<&Path>, name: &str| {
            given.map(Path::to_path_buf).or_else(|| find_bin(name, repo)).ok_or_else(|| {
                BenchError::Setup(format!(
                    "{name} not found beside this binary or in target/release; build it with `cargo build --release -p pvsched-transport --bin pvsched-device -p pvsched --bin pvsched -p pvsched-daemon --bin pvschedd` or pass --device-bin/--pvsched-bin/--pvschedd-bin"
                ))
            })
        };
        Ok(Bins {
            device: need(device, "pvsched-device")?,
            pvsched: need(pvsched, "pvsched")?,
            pvschedd: need(pvschedd, "pvschedd")?,
        })
    }

    /// Their options for the package.
    pub fn args(&self) -> Vec<String> {
        [
            ("--device-bin", &self.device),
            ("--pvsched-bin", &self.pvsched),
            ("--pvschedd-bin", &self.pvschedd),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v.display().to_string()])
        .collect()
    }
}

/// Runs `python3 -m pvsched_bench COMMAND ARGS --json FILE` in `repo`
/// (PYTHONPATH=<repo>/python; its progress on our stderr) and reads FILE
/// (`keep`, else a temporary file removed after).
pub fn python_run<T: DeserializeOwned>(
    repo: &Path,
    command: &'static str,
    args: &[String],
    keep: Option<&Path>,
) -> Result<T, BenchError> {
    if !repo.join(PACKAGE).is_file() {
        return Err(BenchError::Setup(format!(
            "{} not found: give the repository with --repo DIR or PVSCHED_ROOT",
            repo.join(PACKAGE).display()
        )));
    }
    let tmp = std::env::temp_dir().join(format!(
        "pvsched-bench-{command}-{}.json",
        std::process::id()
    ));
    let file = keep.map_or(tmp.clone(), Path::to_path_buf);
    let mut cmd = Command::new("python3");
    cmd.args(["-B", "-m", "pvsched_bench", command])
        .args(args)
        .arg("--json")
        .arg(&file)
        .env("PYTHONPATH", repo.join("python"))
        .current_dir(repo)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    eprintln!("[{command}] {cmd:?}");
    let status = cmd.status().map_err(BenchError::Spawn)?;
    let text = std::fs::read_to_string(&file);
    if keep.is_none() {
        let _ = std::fs::remove_file(&tmp);
    }
    if !status.success() {
        return Err(BenchError::Worker {
            variant: command,
            code: status.code(),
        });
    }
    let text = text.map_err(|e| BenchError::Setup(format!("{}: {e}", file.display())))?;
    serde_json::from_str(&text).map_err(BenchError::Raw)
}

/// The command line that reproduces this run.
pub fn command_line(scenario: &str) -> String {
    let args: Vec<String> = std::env::args().skip(2).collect();
    format!("pvsched-bench {scenario} {}", args.join(" "))
        .trim_end()
        .to_owned()
}

/// Writes `report` as JSON to `json` (`-`: stdout) and prints its
/// markdown tables (on stderr when the JSON goes to stdout).
pub fn write_report<R: Serialize + Render>(
    report: &R,
    json: Option<&str>,
) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(report).map_err(BenchError::Raw)?;
    match json {
        Some("-") => {
            println!("{text}");
            eprintln!("{}", report.markdown());
        }
        Some(path) => {
            std::fs::write(path, text + "\n").map_err(|e| BenchError::Write {
                path: path.into(),
                source: e,
            })?;
            println!("{}", report.markdown());
        }
        None => println!("{}", report.markdown()),
    }
    Ok(())
}

/// The options S4 and S6 share: where the report goes, where the
/// repository, cache and binaries are, and the host's autogroup.
#[derive(clap::Args, Debug)]
pub struct GuestArgs {
    /// The host's autogroup during the run: off, on or host (as it is).
    #[arg(long)]
    pub autogroup: Option<String>,
    /// The report as JSON here ('-': stdout; the table then goes to stderr).
    #[arg(long, value_name = "FILE|-")]
    pub json: Option<String>,
    /// The raw rows as python wrote them (kept; default: a temporary file).
    #[arg(long, value_name = "FILE")]
    pub raw: Option<PathBuf>,
    /// A PNG of the headline figure per cell: every repetition and the
    /// median per variant.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// The repository (python/pvsched_bench); default $PVSCHED_ROOT, else
    /// the current directory or its nearest parent that has it.
    #[arg(long)]
    pub repo: Option<PathBuf>,
    /// The cache of scripts/setup (QEMU 11, kernels, chroots).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Work files (default CACHE/bench-s4 or bench-s6).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The pvsched-device binary (default: beside this one, else target/release).
    #[arg(long)]
    pub device_bin: Option<PathBuf>,
    /// The pvsched CLI binary (default: as --device-bin).
    #[arg(long)]
    pub pvsched_bin: Option<PathBuf>,
    /// The pvschedd binary (default: as --device-bin).
    #[arg(long)]
    pub pvschedd_bin: Option<PathBuf>,
    /// QEMU 11 (default CACHE/qemu11/qemu-system-x86_64).
    #[arg(long)]
    pub qemu11: Option<PathBuf>,
    /// Echo the guests' consoles.
    #[arg(short, long)]
    pub verbose: bool,
    /// Measure nothing: recompute the report (and --plot) from the raw
    /// rows of an earlier report of this scenario, keeping its command.
    #[arg(long, value_name = "REPORT.json")]
    pub from: Option<PathBuf>,
}

/// The command line of `python3 -m pvsched_bench SCENARIO`, built from
/// our options.
#[derive(Default)]
pub struct PyArgs(Vec<String>);

impl PyArgs {
    /// `NAME VALUE` when there is a value.
    pub fn opt(&mut self, name: &str, value: Option<impl ToString>) -> &mut Self {
        if let Some(v) = value {
            self.0.push(name.into());
            self.0.push(v.to_string());
        }
        self
    }

    /// `NAME PATH` when there is a path.
    pub fn path(&mut self, name: &str, value: Option<&Path>) -> &mut Self {
        self.opt(name, value.map(|p| p.display()))
    }

    /// `FLAG` when it is on.
    pub fn flag(&mut self, name: &str, on: bool) -> &mut Self {
        if on {
            self.0.push(name.into());
        }
        self
    }
}

impl GuestArgs {
    /// Runs `python3 -m pvsched_bench SCENARIO` with `args` and these
    /// options, and reads its raw rows.
    pub fn measure<T: DeserializeOwned>(
        &self,
        scenario: &'static str,
        mut args: PyArgs,
    ) -> Result<T, BenchError> {
        let repo = repo_or_err(self.repo.as_deref())?;
        let bins = Bins::find(
            &repo,
            self.device_bin.as_deref(),
            self.pvsched_bin.as_deref(),
            self.pvschedd_bin.as_deref(),
        )?;
        args.opt("--autogroup", self.autogroup.as_ref())
            .path("--cache", self.cache.as_deref())
            .path("--out", self.out.as_deref())
            .path("--qemu11", self.qemu11.as_deref())
            .flag("--verbose", self.verbose);
        args.0.extend(bins.args());
        python_run(&repo, scenario, &args.0, self.raw.as_deref())
    }

    /// The raw rows and the command that measured them: a new measurement
    /// (`python3 -m pvsched_bench SCENARIO`), or with `--from` the `raw`
    /// and `command` of an earlier report.
    pub fn measured<T: DeserializeOwned>(
        &self,
        scenario: &'static str,
        args: PyArgs,
    ) -> Result<(T, String), BenchError> {
        #[derive(serde::Deserialize)]
        struct Earlier<T> {
            scenario: String,
            command: String,
            raw: T,
        }
        let Some(path) = &self.from else {
            return Ok((self.measure(scenario, args)?, command_line(scenario)));
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| BenchError::Setup(format!("--from {}: {e}", path.display())))?;
        let e: Earlier<T> = serde_json::from_str(&text).map_err(|e| {
            BenchError::Setup(format!(
                "--from {}: not a pvsched-bench {scenario} report: {e}",
                path.display()
            ))
        })?;
        if e.scenario != scenario {
            return Err(BenchError::Setup(format!(
                "--from {}: a {} report, not {scenario}",
                path.display(),
                e.scenario
            )));
        }
        Ok((e.raw, e.command))
    }

    /// Draws `panels` (--plot) and writes `report` (--json, the tables).
    pub fn finish<R: Serialize + Render>(
        &self,
        report: &R,
        title: &str,
        panels: &[Panel],
    ) -> Result<(), BenchError> {
        if let Some(p) = &self.plot {
            plot_spread::png(p, title, panels)?;
            eprintln!("pvsched-bench: plot written to {}", p.display());
        }
        write_report(report, self.json.as_deref())
    }
}

/// The exit code of a guest benchmark's result (its error on stderr).
pub fn exit_code(r: Result<(), BenchError>) -> u8 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pvsched-bench: {e}");
            e.exit()
        }
    }
}

/// The distinct `key`s of `rows`, in their first row's order.
pub fn distinct<R, K: PartialEq>(rows: &[R], key: impl Fn(&R) -> K) -> Vec<K> {
    let mut out: Vec<K> = Vec::new();
    for r in rows {
        let k = key(r);
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

/// A figure over repetitions: how many have it, their median and range.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Repetitions with the figure.
    pub n: usize,
    /// Their median.
    pub median: Option<f64>,
    /// The smallest.
    pub min: Option<f64>,
    /// The largest.
    pub max: Option<f64>,
}

impl Spread {
    /// The spread of `xs`.
    pub fn of(xs: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = xs.into_iter().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        Spread {
            n: v.len(),
            median: median_sorted(&v),
            min: v.first().copied(),
            max: v.last().copied(),
        }
    }

    /// `MEDIAN [MIN-MAX]` with `d` decimals ("-" without figures).
    pub fn cell(&self, d: usize) -> String {
        match (self.median, self.min, self.max) {
            (Some(m), Some(lo), Some(hi)) => format!("{m:.d$} [{lo:.d$}-{hi:.d$}]"),
            _ => "-".into(),
        }
    }

    /// The median alone with `d` decimals.
    pub fn median_cell(&self, d: usize) -> String {
        self.median
            .map_or_else(|| "-".into(), |m| format!("{m:.d$}"))
    }
}

/// `pvsched-bench s4`: the options of `python3 -m pvsched_bench s4`, and
/// where the report goes.
#[derive(clap::Args, Debug)]
pub struct S4Args {
    /// Comma-separated kernels of tests/linux-guest/kernels.conf
    /// (default 7.3-cloud,6.1-cloud).
    #[arg(long)]
    pub kernels: Option<String>,
    /// Comma-separated, of vanilla, pvsched, pvsched-noemu, -kick,
    /// -nokick, -auto, -flat, -halt4, -cosched, -coauto, fifo1, weight;
    /// the order rotates per repetition.
    #[arg(long)]
    pub variants: Option<String>,
    /// One repetition of 8 s phases, the first kernel only.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions (default 3, quick 1).
    #[arg(long)]
    pub reps: Option<u32>,
    /// Seconds per cyclictest phase (default 20, quick 8).
    #[arg(long)]
    pub duration: Option<u32>,
    /// Skip the idle-host phases.
    #[arg(long)]
    pub no_idle: bool,
    /// The guest cyclictest's threads (-t).
    #[arg(long)]
    pub guest_threads: Option<u32>,
    /// The VM's caps (TOML; default: pvschedd's default caps).
    #[arg(long)]
    pub caps: Option<PathBuf>,
    /// Appended to the pvschedd.toml the bench writes.
    #[arg(long)]
    pub daemon_toml: Option<PathBuf>,
    /// Do not register QEMU's main loop as the emulator thread.
    #[arg(long)]
    pub no_emulator: bool,
    /// Trace the host's scheduler in each loaded phase and name the VM
    /// threads' waits over 1 ms.
    #[arg(long)]
    pub trace: bool,
    /// Stop each guest cyclictest at its first latency over this, µs.
    #[arg(long)]
    pub break_us: Option<u32>,
    /// Keep each phase's trace.
    #[arg(long)]
    pub keep_trace: bool,
    /// The raw 1 µs histograms here (JSON).
    #[arg(long)]
    pub samples: Option<PathBuf>,
    /// What S4 and S6 share.
    #[command(flatten)]
    pub common: GuestArgs,
}

/// One cyclictest's result (S4's guest and host, S6's host probe).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cyc {
    /// Mean, µs.
    #[serde(default)]
    pub avg_us: Option<f64>,
    /// Median, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile, µs (None past the histogram).
    pub p99_us: Option<f64>,
    /// Maximum, µs.
    pub max_us: Option<f64>,
    /// Wake-ups.
    pub cycles: u64,
}

/// One raw row: one phase of one boot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4Run {
    /// The guest kernel.
    pub kernel: String,
    /// The variant.
    pub variant: String,
    /// The repetition.
    pub rep: usize,
    /// Its place in the repetition's rotated order.
    #[serde(default)]
    pub order: usize,
    /// "loaded" or "idle".
    pub load: String,
    /// cyclictest's interval, µs.
    pub interval_us: u32,
    /// The guest's cyclictest.
    pub guest: Cyc,
    /// The host's, beside it.
    pub host: Cyc,
    /// pvschedd's counters (pvsched variants).
    #[serde(default)]
    pub policy: Option<Value>,
    /// What the variant left in force.
    #[serde(default)]
    pub setup: Option<Value>,
    /// CPU seconds per QEMU thread.
    #[serde(default)]
    pub cpu_s: Option<Value>,
    /// Context switches per QEMU thread.
    #[serde(default)]
    pub switches: Option<Value>,
}

/// A boot that failed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4Failed {
    /// The guest kernel.
    pub kernel: String,
    /// The variant.
    pub variant: String,
    /// The repetition.
    pub rep: usize,
    /// Why.
    pub error: String,
}

/// The idle host's floor in one repetition (measured as S1 and S2's,
/// [`crate::floor`], before the repetition's boots).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4Floor {
    /// The kernel whose repetition it opened.
    pub kernel: String,
    /// The repetition (0-based, as the runs').
    pub rep: usize,
    /// Why there is none (cyclictest failed).
    #[serde(default)]
    pub error: Option<String>,
    /// 99th percentile over every CPU, µs.
    pub p99_us: Option<f64>,
    /// Largest over every CPU, µs.
    pub max_us: Option<f64>,
    /// Samples over every CPU.
    #[serde(default)]
    pub samples: u64,
}

/// What the raw results of S4 and S6 both start with.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RawHead {
    /// Repetitions asked for.
    pub reps: u32,
    /// Seconds per phase (S4) or workload (S6).
    pub duration_s: u32,
    /// Variants in their order of repetition 0.
    pub variants: Vec<String>,
    /// The caps pvschedd gave the pvsched variants' VMs (S4: the first's).
    #[serde(default)]
    pub caps: Value,
    /// The machine.
    #[serde(default)]
    pub machine: Value,
    /// How python was run.
    #[serde(default)]
    pub command: String,
    /// How long it took, s.
    #[serde(default)]
    pub seconds: f64,
}

/// What `python3 -m pvsched_bench s4 --json` writes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct S4Raw {
    /// What every guest benchmark's raw result starts with.
    #[serde(flatten)]
    pub head: RawHead,
    /// Kernels.
    pub kernels: Vec<String>,
    /// One row per phase run.
    pub runs: Vec<S4Run>,
    /// The failed boots.
    #[serde(default)]
    pub failed: Vec<S4Failed>,
    /// The host's floor per repetition.
    #[serde(default)]
    pub floors: Vec<S4Floor>,
    /// How the floor was measured.
    #[serde(default)]
    pub floor_cmd: String,
    /// --trace's waits per traced phase.
    #[serde(default)]
    pub stalls: Value,
    /// --break-us's breaks.
    #[serde(default)]
    pub breaks: Value,
}

/// A variant against vanilla, repetition by repetition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4Versus {
    /// The guest's max.
    pub guest_max: Paired,
    /// The guest's p99.
    pub guest_p99: Paired,
    /// The host's max.
    pub host_max: Paired,
    /// guest_max at most [`GUEST_MAX_TARGET`].
    pub guest_max_verdict: Verdict,
    /// host_max at most [`HOST_MAX_TARGET`].
    pub host_max_verdict: Verdict,
}

/// One variant in one kernel, load and interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4VariantStats {
    /// The variant.
    pub variant: String,
    /// Repetitions with figures.
    pub n: usize,
    /// Failed repetitions (boots that failed).
    pub failed: usize,
    /// The guest's p99, µs.
    pub guest_p99_us: Spread,
    /// The guest's max, µs.
    pub guest_max_us: Spread,
    /// The host's p99, µs.
    pub host_p99_us: Spread,
    /// The host's max, µs.
    pub host_max_us: Spread,
    /// Against vanilla (not for vanilla itself).
    pub vs_vanilla: Option<S4Versus>,
}

/// One kernel, load and interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4Cell {
    /// The guest kernel.
    pub kernel: String,
    /// "loaded" or "idle".
    pub load: String,
    /// cyclictest's interval, µs.
    pub interval_us: u32,
    /// Each variant that ran.
    pub variants: Vec<S4VariantStats>,
}

/// The idle host's floor over one kernel's repetitions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct S4FloorStats {
    /// The kernel.
    pub kernel: String,
    /// Its floor, as S1 and S2 report theirs.
    pub floor: FloorReport,
}

/// The S4 report: the raw run and what it shows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct S4Report {
    /// "s4".
    pub scenario: String,
    /// pvsched-bench's command line.
    pub command: String,
    /// Boots that failed.
    pub failed: usize,
    /// The floor per kernel.
    pub floors: Vec<S4FloorStats>,
    /// Per kernel, load and interval.
    pub cells: Vec<S4Cell>,
    /// What python measured, every row kept.
    pub raw: S4Raw,
}

fn s4_versus(runs: &[&S4Run], variant: &str, reps: usize) -> S4Versus {
    let by = |v: &str, f: &dyn Fn(&S4Run) -> Option<f64>| -> Vec<Option<f64>> {
        (0..reps)
            .map(|rep| {
                runs.iter()
                    .find(|r| r.variant == v && r.rep == rep)
                    .and_then(|r| f(r))
            })
            .collect()
    };
    let pair = |f: &dyn Fn(&S4Run) -> Option<f64>| paired(&by("vanilla", f), &by(variant, f));
    let guest_max = pair(&|r| r.guest.max_us);
    let host_max = pair(&|r| r.host.max_us);
    S4Versus {
        guest_p99: pair(&|r| r.guest.p99_us),
        guest_max_verdict: guest_max.at_most(GUEST_MAX_TARGET),
        host_max_verdict: host_max.at_most(HOST_MAX_TARGET),
        guest_max,
        host_max,
    }
}

impl S4Report {
    /// The report of `raw`'s rows.
    pub fn new(raw: S4Raw, command: String) -> S4Report {
        let reps = raw.head.reps as usize;
        let cells = distinct(&raw.runs, |r| {
            (r.kernel.clone(), r.load.clone(), r.interval_us)
        })
        .into_iter()
        .map(|(kernel, load, interval_us)| {
            let runs: Vec<&S4Run> = raw
                .runs
                .iter()
                .filter(|r| r.kernel == kernel && r.load == load && r.interval_us == interval_us)
                .collect();
            let has = |v: &str| runs.iter().any(|r| r.variant == v);
            let variants = raw
                .head
                .variants
                .iter()
                .filter(|v| has(v) || raw.failed.iter().any(|f| &f.variant == *v))
                .map(|v| {
                    let mine: Vec<&S4Run> =
                        runs.iter().copied().filter(|r| &r.variant == v).collect();
                    let sp =
                        |f: fn(&S4Run) -> Option<f64>| Spread::of(mine.iter().filter_map(|r| f(r)));
                    S4VariantStats {
                        variant: v.clone(),
                        n: mine.len(),
                        failed: raw
                            .failed
                            .iter()
                            .filter(|f| &f.variant == v && f.kernel == kernel)
                            .count(),
                        guest_p99_us: sp(|r| r.guest.p99_us),
                        guest_max_us: sp(|r| r.guest.max_us),
                        host_p99_us: sp(|r| r.host.p99_us),
                        host_max_us: sp(|r| r.host.max_us),
                        vs_vanilla: (v != "vanilla" && has("vanilla"))
                            .then(|| s4_versus(&runs, v, reps)),
                    }
                })
                .collect();
            S4Cell {
                kernel,
                load,
                interval_us,
                variants,
            }
        })
        .collect();
        let floors = raw
            .kernels
            .iter()
            .map(|k| {
                let runs: Vec<FloorRow> = raw
                    .floors
                    .iter()
                    .filter(|f| &f.kernel == k)
                    .map(|f| FloorRow {
                        rep: f.rep + 1,
                        order: 0,
                        error: f.error.clone(),
                        p99_us: f.p99_us,
                        max_us: f.max_us,
                        samples: f.samples,
                        steal_ms: None,
                    })
                    .collect();
                let ok = || runs.iter().filter(|r| r.error.is_none());
                S4FloorStats {
                    kernel: k.clone(),
                    floor: FloorReport {
                        tool: raw.floor_cmd.clone(),
                        n: ok().count(),
                        failed: runs.len() - ok().count(),
                        p99_us: Spread::of(ok().filter_map(|r| r.p99_us)).median,
                        max_us: Spread::of(ok().filter_map(|r| r.max_us)).median,
                        runs,
                    },
                }
            })
            .collect();
        S4Report {
            scenario: "s4".into(),
            command,
            failed: raw.failed.len(),
            floors,
            cells,
            raw,
        }
    }

    /// Each loaded cell's guest max, every repetition and the median, per
    /// variant.
    pub fn panels(&self) -> Vec<Panel> {
        self.cells
            .iter()
            .filter(|c| c.load == "loaded")
            .map(|c| {
                let rows: Vec<&S4Run> = self
                    .raw
                    .runs
                    .iter()
                    .filter(|r| {
                        r.kernel == c.kernel && r.load == c.load && r.interval_us == c.interval_us
                    })
                    .collect();
                Panel::of(
                    format!("{} loaded i{} guest max us", c.kernel, c.interval_us),
                    c.variants.iter().map(|v| v.variant.clone()),
                    &rows,
                    |r| &r.variant,
                    |r| r.guest.max_us,
                )
            })
            .collect()
    }
}

/// `xRATIO [MIN-MAX] (p P, res R, n N, failed F)` of a paired figure.
pub fn ratio_cell(p: &Paired) -> String {
    let f = |x: Option<f64>, d: usize| x.map_or_else(|| "-".into(), |x| format!("{x:.d$}"));
    format!(
        "x{} [{}-{}] (p {}, res {}, n {}, failed {})",
        f(p.ratio, 3),
        f(p.min, 2),
        f(p.max, 2),
        f(p.p, 3),
        p.resolution_text(),
        p.n,
        p.failed
    )
}

impl Render for S4Report {
    fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "S4, {} reps of {} s phases; {} failed boots.\n",
            self.raw.head.reps, self.raw.head.duration_s, self.failed
        );
        s.push_str(
            "| kernel | idle host floor p99 µs | floor max µs | n (failed) |\n| --- | --- | --- | --- |\n",
        );
        for f in &self.floors {
            let spread =
                |g: fn(&FloorRow) -> Option<f64>| Spread::of(f.floor.runs.iter().filter_map(g));
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} ({}) |",
                f.kernel,
                spread(|r| r.p99_us).cell(0),
                spread(|r| r.max_us).cell(0),
                f.floor.n,
                f.floor.failed
            );
        }
        s.push('\n');
        // One table: a cell's variants in consecutive rows, the cell named
        // in the first.
        s.push_str(
            "| kernel, host, -i µs | variant | n (failed) | guest p99 µs | guest max µs | host p99 µs | host max µs | guest p99 vs vanilla | guest max vs vanilla | host max vs vanilla |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for c in &self.cells {
            for (k, v) in c.variants.iter().enumerate() {
                let cell = if k == 0 {
                    format!("{} {} {}", c.kernel, c.load, c.interval_us)
                } else {
                    String::new()
                };
                let (gp, gm, hm) = v.vs_vanilla.as_ref().map_or_else(
                    || ("-".to_owned(), "-".to_owned(), "-".to_owned()),
                    |x| {
                        (
                            ratio_cell(&x.guest_p99),
                            format!(
                                "{} {} (<= {GUEST_MAX_TARGET})",
                                ratio_cell(&x.guest_max),
                                x.guest_max_verdict.word()
                            ),
                            format!(
                                "{} {} (<= {HOST_MAX_TARGET})",
                                ratio_cell(&x.host_max),
                                x.host_max_verdict.word()
                            ),
                        )
                    },
                );
                let _ = writeln!(
                    s,
                    "| {cell} | {} | {} ({}) | {} | {} | {} | {} | {gp} | {gm} | {hm} |",
                    v.variant,
                    v.n,
                    v.failed,
                    v.guest_p99_us.cell(0),
                    v.guest_max_us.cell(0),
                    v.host_p99_us.cell(0),
                    v.host_max_us.cell(0),
                );
            }
        }
        s
    }
}

/// Runs S4 and writes its report; the exit code.
pub fn main(a: &S4Args) -> u8 {
    exit_code(run(a))
}

fn run(a: &S4Args) -> Result<(), BenchError> {
    let mut args = PyArgs::default();
    args.opt("--kernels", a.kernels.as_ref())
        .opt("--variants", a.variants.as_ref())
        .opt("--reps", a.reps)
        .opt("--duration", a.duration)
        .opt("--guest-threads", a.guest_threads)
        .path("--caps", a.caps.as_deref())
        .path("--daemon-toml", a.daemon_toml.as_deref())
        .opt("--break-us", a.break_us)
        .path("--samples", a.samples.as_deref())
        .flag("--quick", a.quick)
        .flag("--no-idle", a.no_idle)
        .flag("--no-emulator", a.no_emulator)
        .flag("--trace", a.trace)
        .flag("--keep-trace", a.keep_trace);
    let (raw, command): (S4Raw, String) = a.common.measured("s4", args)?;
    let report = S4Report::new(raw, command);
    a.common.finish(
        &report,
        "S4 CYCLICTEST GUEST MAX, HOST LOADED (TCG)",
        &report.panels(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn options_are_well_formed() {
        use clap::Args as _;
        S4Args::augment_args(clap::Command::new("t")).debug_assert();
    }

    fn run(variant: &str, rep: usize, gmax: f64, hmax: f64) -> Value {
        let cyc = |max: f64| {
            json!({"avg_us": 10.0, "p50_us": 9.0, "p99_us": max / 2.0,
                                    "max_us": max, "cycles": 1000, "overflow": 0})
        };
        json!({"kernel": "7.3-cloud", "variant": variant, "rep": rep, "order": 0,
               "load": "loaded", "interval_us": 500, "guest": cyc(gmax), "host": cyc(hmax)})
    }

    #[test]
    fn pairs_follow_the_rep_and_the_floor_is_kept() {
        let raw: S4Raw = serde_json::from_value(json!({
            "reps": 2, "duration_s": 3, "variants": ["vanilla", "pvsched"],
            "kernels": ["7.3-cloud"],
            "runs": [run("vanilla", 0, 1000.0, 50.0), run("pvsched", 0, 100.0, 50.0),
                     run("vanilla", 1, 2000.0, 50.0)],
            "failed": [{"kernel": "7.3-cloud", "variant": "pvsched", "rep": 1,
                        "order": 0, "error": "boot"}],
            "floors": [{"kernel": "7.3-cloud", "rep": 0, "p50_us": 2, "p99_us": 4,
                        "max_us": 9, "cycles": 10},
                       {"kernel": "7.3-cloud", "rep": 1, "p50_us": 2, "p99_us": 6,
                        "max_us": 11, "cycles": 10}]
        }))
        .unwrap();
        let r = S4Report::new(raw, "pvsched-bench s4".into());
        assert_eq!(r.floors[0].floor.max_us, Some(10.0));
        assert_eq!(r.floors[0].floor.runs[1].rep, 2);
        let pv = &r.cells[0].variants[1];
        assert_eq!((pv.n, pv.failed), (1, 1));
        let vs = pv.vs_vanilla.as_ref().unwrap();
        assert_eq!((vs.guest_max.n, vs.guest_max.failed), (1, 1));
        assert_eq!(vs.guest_max.ratio, Some(0.1));
        let back: S4Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        let md = back.markdown();
        assert!(md.contains("| pvsched | 1 (1) |"), "{md}");
        assert!(
            md.contains("| 7.3-cloud | 5 [4-6] | 10 [9-11] | 2 (0) |"),
            "{md}"
        );
        assert_eq!(r.panels()[0].groups[0].1, vec![1000.0, 2000.0]);
        assert_eq!(repo_root(Some(Path::new("/x"))), Some(PathBuf::from("/x")));
    }
}
