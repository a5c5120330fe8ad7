//! `--trace DIR`: each measured run recorded in a tracefs instance of its
//! own (the scheduler's switches, wake-ups and migrations, the timer,
//! reschedule, function-call and irq_work interrupts: what
//! `bench/trace-run.sh` records), and every wait of a vCPU thread over
//! [`OVER_US`] in the run's measured time named by `bench/stall_trace.py`
//! (stolen, unboosted, behind-rt, behind-fair, other), into the run's JSON.
//! The trace and its analysis are taken in the same run as the figures
//! they explain.

use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where tracefs is (mounted here if it is not).
const TRACEFS: &str = "/sys/kernel/tracing";

/// The events recorded: what `stall_trace.py` reads to name a wait.
const EVENTS: &[&str] = &[
    "sched/sched_switch",
    "sched/sched_wakeup",
    "sched/sched_waking",
    "sched/sched_migrate_task",
    "irq_vectors/local_timer_entry",
    "irq_vectors/reschedule_entry",
    "irq_vectors/call_function_single_entry",
    "irq_vectors/irq_work_entry",
];

/// A wait of a vCPU thread longer than this, µs, is a stall (the bench's
/// `stalls` count samples over the same 1 ms).
pub const OVER_US: u64 = 1000;

/// A silence of every CPU at once this long, ms, is the host stopped by
/// its own hypervisor: a busy CPU of a HZ=250 host records its timer tick
/// every 4 ms, so shorter silences of a host running busy loops are
/// normal.
pub const HOST_STOP_MS: f64 = 10.0;

/// Errors of `--trace`.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum TraceError {
    /// A tracefs file or directory could not be set up or read.
    #[error("--trace: {what} {path}: {source} (it needs root and tracefs at /sys/kernel/tracing)")]
    Tracefs {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The trace could not be written where `--trace` asked.
    #[error("--trace: writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The analysis could not start.
    #[error("--trace: running python3 {script}: {source} (install python3)")]
    Spawn {
        script: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The analysis failed.
    #[error("--trace: {script} failed on {trace} (exit {code:?}): {stderr}")]
    Analyse {
        script: PathBuf,
        trace: PathBuf,
        code: Option<i32>,
        stderr: String,
    },
    /// The analysis printed something else than its JSON.
    #[error("--trace: the output of {script} is not its JSON: {source}")]
    Json {
        script: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// What `--trace` asked for.
#[derive(Clone, Debug)]
pub struct TraceOpts {
    /// Where each run's trace (`NAME.trace`) and its analysis
    /// (`NAME.stalls.json`) go.
    pub dir: PathBuf,
    /// `bench/stall_trace.py`.
    pub script: PathBuf,
    /// The instance's buffer per CPU, KiB.
    pub buffer_kb: u64,
    /// Only these variants are recorded (`None`: every one).
    pub variants: Option<Vec<String>>,
}

impl TraceOpts {
    /// Whether runs of `variant` are recorded.
    pub fn wants(&self, variant: &str) -> bool {
        self.variants
            .as_ref()
            .is_none_or(|v| v.iter().any(|x| x == variant))
    }
}

/// One tracefs instance, recording from [`Recorder::start`] until
/// [`Recorder::finish`]; removed when dropped, whatever happened.
#[derive(Debug)]
pub struct Recorder {
    inst: PathBuf,
}

fn tracefs_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> TraceError + 'a {
    move |source| TraceError::Tracefs {
        what,
        path: path.to_owned(),
        source,
    }
}

fn put(path: &Path, text: &str) -> Result<(), TraceError> {
    std::fs::write(path, text).map_err(tracefs_err("writing", path))
}

/// Mounts tracefs at [`TRACEFS`] unless it is there already.
fn mount_tracefs() -> Result<(), TraceError> {
    let root = Path::new(TRACEFS);
    if root.join("instances").is_dir() {
        return Ok(());
    }
    let (src, dst, fs) = (
        c"nodev",
        CString::new(TRACEFS).unwrap_or_default(),
        c"tracefs",
    );
    // SAFETY: three NUL-terminated strings that outlive the call and no
    // mount data; mount(2) only reads them.
    let rc = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), fs.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(TraceError::Tracefs {
            what: "mounting tracefs at",
            path: root.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

impl Recorder {
    /// A new instance (`pvsched-bench-PID-N`) with the mono clock (the
    /// bench's CLOCK_MONOTONIC), `buffer_kb` per CPU and [`EVENTS`] on,
    /// recording.
    pub fn start(buffer_kb: u64) -> Result<Recorder, TraceError> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        mount_tracefs()?;
        let n = N.fetch_add(1, Ordering::Relaxed);
        let inst = Path::new(TRACEFS)
            .join("instances")
            .join(format!("pvsched-bench-{}-{n}", std::process::id()));
        std::fs::create_dir(&inst).map_err(tracefs_err("creating the instance", &inst))?;
        let r = Recorder { inst };
        put(&r.inst.join("trace_clock"), "mono")?;
        put(&r.inst.join("buffer_size_kb"), &buffer_kb.to_string())?;
        for e in EVENTS {
            let enable = r.inst.join("events").join(e).join("enable");
            // An event this kernel lacks (no irq_vectors off x86) is left out.
            if enable.exists() {
                put(&enable, "1")?;
            }
        }
        put(&r.inst.join("tracing_on"), "1")?;
        Ok(r)
    }

    /// Stops recording and writes the trace's text to `out`; returns the
    /// events the buffer lost (0: the trace is whole).
    pub fn finish(self, out: &Path) -> Result<u64, TraceError> {
        put(&self.inst.join("tracing_on"), "0")?;
        let src = self.inst.join("trace");
        let mut from = std::fs::File::open(&src).map_err(tracefs_err("opening", &src))?;
        let to = std::fs::File::create(out).map_err(|source| TraceError::Write {
            path: out.to_owned(),
            source,
        })?;
        let mut to = io::BufWriter::new(to);
        // A plain read loop: tracefs files report size 0, which copy
        // helpers take for an empty file.
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = from.read(&mut buf).map_err(tracefs_err("reading", &src))?;
            if n == 0 {
                break;
            }
            to.write_all(&buf[..n])
                .map_err(|source| TraceError::Write {
                    path: out.to_owned(),
                    source,
                })?;
        }
        to.flush().map_err(|source| TraceError::Write {
            path: out.to_owned(),
            source,
        })?;
        let mut overrun = 0u64;
        let per_cpu = self.inst.join("per_cpu");
        let cpus = std::fs::read_dir(&per_cpu).map_err(tracefs_err("listing", &per_cpu))?;
        for cpu in cpus.flatten() {
            let stats = std::fs::read_to_string(cpu.path().join("stats")).unwrap_or_default();
            overrun += stats
                .lines()
                .filter_map(|l| l.strip_prefix("overrun:"))
                .filter_map(|v| v.trim().parse::<u64>().ok())
                .sum::<u64>();
        }
        Ok(overrun)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        let _ = std::fs::write(self.inst.join("tracing_on"), "0");
        if let Err(e) = std::fs::remove_dir(&self.inst) {
            log::warn!(
                "--trace: removing the tracefs instance {} failed: {e}; remove it with rmdir",
                self.inst.display()
            );
        }
    }
}

/// What one run's trace says about its vCPU threads' waits over
/// [`OVER_US`] in the measured time.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TraceRow {
    /// The trace's text (the per-wait analysis is beside it,
    /// `.stalls.json`).
    pub file: String,
    /// Events the buffer lost (0: the trace is whole; else raise
    /// `--trace-buffer-mb`).
    pub overrun: u64,
    /// A wait over this is counted, µs.
    pub over_us: u64,
    /// Waits of vCPU threads over `over_us` in the measured time.
    pub waits: u64,
    /// Those waits by cause (`stall_trace.py`: stolen, unboosted,
    /// behind-rt, behind-fair, other).
    pub causes: BTreeMap<String, u64>,
    /// The longest of them, ms, and its cause.
    pub longest_ms: Option<f64>,
    /// The cause of the longest.
    pub longest_cause: Option<String>,
    /// Intervals of at least [`HOST_STOP_MS`] in which no CPU recorded
    /// anything, not even a timer tick: the whole host stopped by its own
    /// hypervisor.
    pub host_stops: u64,
    /// The longest interval in which no CPU recorded anything, ms.
    pub host_silence_max_ms: Option<f64>,
}

impl TraceRow {
    /// `stall_trace.py --json`'s output as a row.
    pub fn from_analysis(file: String, overrun: u64, j: &Value) -> TraceRow {
        let waits = j["waits"].as_array().map_or(&[][..], Vec::as_slice);
        let longest = waits.iter().max_by(|a, b| {
            let ms = |w: &Value| w["wait_ms"].as_f64().unwrap_or(0.0);
            ms(a).total_cmp(&ms(b))
        });
        let gaps = j["host_gaps"].as_array().map_or(&[][..], Vec::as_slice);
        TraceRow {
            file,
            overrun,
            over_us: OVER_US,
            waits: waits.len() as u64,
            causes: j["causes"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                .collect(),
            longest_ms: longest.and_then(|w| w["wait_ms"].as_f64()),
            longest_cause: longest.and_then(|w| w["cause"].as_str().map(str::to_owned)),
            host_stops: gaps
                .iter()
                .filter(|g| g["ms"].as_f64().is_some_and(|ms| ms >= HOST_STOP_MS))
                .count() as u64,
            host_silence_max_ms: gaps
                .iter()
                .filter_map(|g| g["ms"].as_f64())
                .max_by(f64::total_cmp),
        }
    }

    /// One line for the bench's progress output.
    pub fn brief(&self) -> String {
        let causes: Vec<String> = self
            .causes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        let longest = match (self.longest_ms, &self.longest_cause) {
            (Some(ms), Some(c)) => format!(", longest {ms:.2} ms {c}"),
            _ => String::new(),
        };
        let lost = if self.overrun > 0 {
            format!(", {} events LOST (raise --trace-buffer-mb)", self.overrun)
        } else {
            String::new()
        };
        format!(
            "trace: {} vCPU wait(s) > {} ms ({}){longest}; host stops >= {HOST_STOP_MS} ms: {}{}{lost}",
            self.waits,
            self.over_us / 1000,
            if causes.is_empty() {
                "none".to_owned()
            } else {
                causes.join(", ")
            },
            self.host_stops,
            self.host_silence_max_ms
                .map_or_else(String::new, |ms| format!(" (longest silence {ms:.2} ms)")),
        )
    }
}

/// Runs `stall_trace.py --json` on `trace` for the waits that overlap
/// `window` (trace clock, s), keeps its output beside the trace
/// (`.stalls.json`) and returns the row.
pub fn analyse(
    opts: &TraceOpts,
    trace: &Path,
    overrun: u64,
    window: Option<(f64, f64)>,
) -> Result<TraceRow, TraceError> {
    let mut cmd = Command::new("python3");
    cmd.arg(&opts.script)
        .arg(trace)
        .arg("--json")
        .arg(format!("--over-us={OVER_US}"));
    if let Some((lo, hi)) = window {
        cmd.arg(format!("--from={lo:.6}"))
            .arg(format!("--to={hi:.6}"));
    }
    let out = cmd.output().map_err(|source| TraceError::Spawn {
        script: opts.script.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(TraceError::Analyse {
            script: opts.script.clone(),
            trace: trace.to_owned(),
            code: out.status.code(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    let j: Value = serde_json::from_slice(&out.stdout).map_err(|source| TraceError::Json {
        script: opts.script.clone(),
        source,
    })?;
    let detail = trace.with_extension("stalls.json");
    std::fs::write(&detail, &out.stdout).map_err(|source| TraceError::Write {
        path: detail,
        source,
    })?;
    Ok(TraceRow::from_analysis(
        trace.display().to_string(),
        overrun,
        &j,
    ))
}

/// CLOCK_MONOTONIC now, s: the trace's clock (`trace_clock` mono).
pub fn mono_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write into; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_row_counts_the_waits_their_causes_and_the_host_stops() {
        let j = json!({
            "over_us": 1000.0,
            "waits": [
                {"at": 1.0, "wait_ms": 1.5, "cause": "unboosted"},
                {"at": 2.0, "wait_ms": 4.9, "cause": "stolen"},
                {"at": 3.0, "wait_ms": 2.0, "cause": "unboosted"}
            ],
            "causes": {"unboosted": 2, "stolen": 1},
            "host_gaps": [{"at": 5.0, "ms": 3.2}, {"at": 6.0, "ms": 17.5}]
        });
        let r = TraceRow::from_analysis("t.trace".into(), 0, &j);
        assert_eq!(r.waits, 3);
        assert_eq!(r.causes["unboosted"], 2);
        assert_eq!(r.causes["stolen"], 1);
        assert_eq!(r.longest_ms, Some(4.9));
        assert_eq!(r.longest_cause.as_deref(), Some("stolen"));
        // Only the silence of several ticks is a host stop.
        assert_eq!((r.host_stops, r.host_silence_max_ms), (1, Some(17.5)));
        let b = r.brief();
        assert!(
            b.contains("3 vCPU wait(s) > 1 ms (stolen 1, unboosted 2)"),
            "{b}"
        );
        assert!(b.contains("longest 4.90 ms stolen"), "{b}");
        assert!(!b.contains("LOST"), "{b}");
    }

    #[test]
    fn an_empty_analysis_and_a_lost_event_are_said() {
        let j = json!({"over_us": 1000.0, "waits": [], "causes": {}, "host_gaps": []});
        let r = TraceRow::from_analysis("t.trace".into(), 12, &j);
        assert_eq!(
            (r.waits, r.longest_ms, r.host_silence_max_ms),
            (0, None, None)
        );
        let b = r.brief();
        assert!(b.contains("0 vCPU wait(s) > 1 ms (none)"), "{b}");
        assert!(b.contains("12 events LOST"), "{b}");
    }

    #[test]
    fn variants_filter() {
        let mut o = TraceOpts {
            dir: "/tmp".into(),
            script: "s.py".into(),
            buffer_kb: 1024,
            variants: None,
        };
        assert!(o.wants("vanilla"));
        o.variants = Some(vec!["pvsched".into()]);
        assert!(o.wants("pvsched") && !o.wants("vanilla"));
    }
}
