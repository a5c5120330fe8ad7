//! `--trace DIR`: each measured run recorded in a tracefs instance of its
//! own (the scheduler's switches, wake-ups and migrations, the timer,
//! reschedule, function-call and irq_work interrupts: what
//! `bench/trace-run.sh` records), and every wait of a vCPU thread over
//! [`OVER_US`] in the run's measured time named by `pvsched_bench stall-trace`
//! (stolen, unboosted, behind-rt, behind-fair, other), into the run's JSON.
//! The trace and its analysis are taken in the same run as the figures
//! they explain.

use crate::worker::StallWindow;
use serde::{Deserialize, Serialize};
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

/// With [`TraceOpts::kvm`]: KVM's work for a vCPU (VM entries and exits
/// where the CPU has VT-x/AMD-V; on this nested host, whose KVM runs the
/// test guest's interrupt handler through its instruction emulator, each
/// emulated instruction, FPU switch and exit to the VMM), so a vCPU thread
/// on a CPU that recorded nothing at all is told from one running its
/// guest (a `wakeup` sample's handler is a few dozen such events).
const KVM_EVENTS: &[&str] = &[
    "kvm/kvm_entry",
    "kvm/kvm_exit",
    "kvm/kvm_emulate_insn",
    "kvm/kvm_fpu",
    "kvm/kvm_userspace_exit",
    "kvm/kvm_msi_set_irq",
    "kvm/kvm_vcpu_wakeup",
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
    /// `python/pvsched_bench/stall_trace.py`, run as `python3 -m
    /// pvsched_bench stall-trace` with its package's directory on
    /// PYTHONPATH.
    pub script: PathBuf,
    /// The instance's buffer per CPU, KiB.
    pub buffer_kb: u64,
    /// Only these variants are recorded (`None`: every one).
    pub variants: Option<Vec<String>>,
    /// Record [`KVM_EVENTS`] too (S1; S2's guests exit far more often).
    pub kvm: bool,
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

fn write_err(path: &Path) -> impl FnOnce(io::Error) -> TraceError + '_ {
    move |source| TraceError::Write {
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
    /// bench's CLOCK_MONOTONIC), `buffer_kb` per CPU and [`EVENTS`] (and
    /// with `kvm` [`KVM_EVENTS`]) on, recording.
    pub fn start(buffer_kb: u64, kvm: bool) -> Result<Recorder, TraceError> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        mount_tracefs()?;
        remove_stale();
        let n = N.fetch_add(1, Ordering::Relaxed);
        let inst = Path::new(TRACEFS)
            .join("instances")
            .join(format!("pvsched-bench-{}-{n}", std::process::id()));
        std::fs::create_dir(&inst).map_err(tracefs_err("creating the instance", &inst))?;
        let r = Recorder { inst };
        put(&r.inst.join("trace_clock"), "mono")?;
        put(&r.inst.join("buffer_size_kb"), &buffer_kb.to_string())?;
        let extra = if kvm { KVM_EVENTS } else { &[] };
        for e in EVENTS.iter().chain(extra) {
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
        let to = std::fs::File::create(out).map_err(write_err(out))?;
        let mut to = io::BufWriter::new(to);
        // A plain read loop: tracefs files report size 0, which copy
        // helpers take for an empty file.
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = from.read(&mut buf).map_err(tracefs_err("reading", &src))?;
            if n == 0 {
                break;
            }
            to.write_all(&buf[..n]).map_err(write_err(out))?;
        }
        to.flush().map_err(write_err(out))?;
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

/// Removes the instances of benches that are gone (killed before their
/// recorder's drop ran): `pvsched-bench-PID-N` whose PID does not exist.
fn remove_stale() {
    let dir = Path::new(TRACEFS).join("instances");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("pvsched-bench-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::write(e.path().join("tracing_on"), "0");
            match std::fs::remove_dir(e.path()) {
                Ok(()) => log::warn!("--trace: removed {name}, left by a bench that is gone"),
                Err(err) => log::warn!("--trace: removing the stale instance {name}: {err}"),
            }
        }
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
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
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
    /// Switches out of an idle task the kernel did not record (some hosts
    /// never record them on some CPUs), put back from the switched-in
    /// thread's own records by `stall_trace.py`.
    pub idle_switch_ins: u64,
    /// The run's samples over 1 ms, each named by where the vCPU thread
    /// that recorded it was meanwhile (`stall_trace.py --windows`:
    /// queued-CAUSE, asleep, running, running-silent, mixed, untraced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<SampleCauses>,
}

/// The stalls of a run's samples, named ([`TraceRow::samples`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleCauses {
    /// Samples over 1 ms.
    pub stalls: u64,
    /// By cause.
    pub causes: BTreeMap<String, u64>,
    /// The longest, ms.
    pub longest_ms: Option<f64>,
    /// Its cause.
    pub longest_cause: Option<String>,
    /// With the policy's decision trace (pvsched variants): the samples by
    /// the boost their vCPU had when each began (`boosted`, `throttled`:
    /// its budget spent, `none`: between two boosts).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub boost: BTreeMap<String, u64>,
    /// The same, by cause and boost (`queued-unboosted/throttled`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cause_boost: BTreeMap<String, u64>,
}

/// The counts of a `{"causes": {cause: n}}` analysis.
fn causes(j: &Value) -> BTreeMap<String, u64> {
    counts_of(&j["causes"])
}

/// A `{name: n}` object's counts.
fn counts_of(j: &Value) -> BTreeMap<String, u64> {
    j.as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
        .collect()
}

/// The largest number under `key` of `items`, and that item's `cause`.
fn longest(items: &[Value], key: &str) -> (Option<f64>, Option<String>) {
    let ms = |x: &Value| x[key].as_f64().unwrap_or(0.0);
    let top = items.iter().max_by(|a, b| ms(a).total_cmp(&ms(b)));
    (
        top.and_then(|x| x[key].as_f64()),
        top.and_then(|x| x["cause"].as_str().map(str::to_owned)),
    )
}

/// `"a 1, b 2"`, or `"none"`.
fn counts(c: &BTreeMap<String, u64>) -> String {
    if c.is_empty() {
        return "none".to_owned();
    }
    let v: Vec<String> = c.iter().map(|(k, n)| format!("{k} {n}")).collect();
    v.join(", ")
}

/// `", longest 4.90 ms stolen"`, or nothing.
fn longest_brief(ms: Option<f64>, cause: &Option<String>) -> String {
    match (ms, cause) {
        (Some(ms), Some(c)) => format!(", longest {ms:.2} ms {c}"),
        _ => String::new(),
    }
}

impl SampleCauses {
    /// `stall_trace.py --windows --json`'s output.
    pub fn from_analysis(j: &Value) -> SampleCauses {
        let w = j["windows"].as_array().map_or(&[][..], Vec::as_slice);
        let (longest_ms, longest_cause) = longest(w, "ms");
        SampleCauses {
            stalls: w.len() as u64,
            causes: causes(j),
            longest_ms,
            longest_cause,
            boost: counts_of(&j["boost"]),
            cause_boost: counts_of(&j["cause_boost"]),
        }
    }
}

impl TraceRow {
    /// `stall_trace.py --json`'s output as a row.
    pub fn from_analysis(file: String, overrun: u64, j: &Value) -> TraceRow {
        let waits = j["waits"].as_array().map_or(&[][..], Vec::as_slice);
        let (longest_ms, longest_cause) = longest(waits, "wait_ms");
        let gaps = j["host_gaps"].as_array().map_or(&[][..], Vec::as_slice);
        TraceRow {
            file,
            overrun,
            over_us: OVER_US,
            waits: waits.len() as u64,
            causes: causes(j),
            longest_ms,
            longest_cause,
            host_stops: gaps
                .iter()
                .filter(|g| g["ms"].as_f64().is_some_and(|ms| ms >= HOST_STOP_MS))
                .count() as u64,
            host_silence_max_ms: gaps
                .iter()
                .filter_map(|g| g["ms"].as_f64())
                .max_by(f64::total_cmp),
            idle_switch_ins: j["idle_switch_ins"].as_u64().unwrap_or(0),
            samples: None,
        }
    }

    /// One line for the bench's progress output.
    pub fn brief(&self) -> String {
        let lost = if self.overrun > 0 {
            format!(", {} events LOST (raise --trace-buffer-mb)", self.overrun)
        } else {
            String::new()
        };
        let samples = self.samples.as_ref().map_or_else(String::new, |s| {
            let boost = if s.boost.is_empty() {
                String::new()
            } else {
                format!("; their vCPU's boost then: {}", counts(&s.boost))
            };
            format!(
                "; samples > 1 ms: {} ({}){}{boost}",
                s.stalls,
                counts(&s.causes),
                longest_brief(s.longest_ms, &s.longest_cause)
            )
        });
        format!(
            "trace: {} vCPU wait(s) > {} ms ({}){}; host stops >= {HOST_STOP_MS} ms: {}{}{samples}{lost}",
            self.waits,
            self.over_us / 1000,
            counts(&self.causes),
            longest_brief(self.longest_ms, &self.longest_cause),
            self.host_stops,
            self.host_silence_max_ms
                .map_or_else(String::new, |ms| format!(" (longest silence {ms:.2} ms)")),
        )
    }
}

/// Runs `stall_trace.py --json` on `trace` for the waits that overlap
/// `window` (trace clock, s) and, with `stalls`, `--windows` for where each
/// stalled sample's vCPU thread was; keeps their outputs beside the trace
/// (`.stalls.json`, `.samples.json`) and returns the row.
pub fn analyse(
    opts: &TraceOpts,
    trace: &Path,
    overrun: u64,
    window: Option<(f64, f64)>,
    stalls: &[StallWindow],
    decisions: Option<&Path>,
) -> Result<TraceRow, TraceError> {
    let range = window.map_or_else(Vec::new, |(lo, hi)| {
        vec![format!("--from={lo:.6}"), format!("--to={hi:.6}")]
    });
    let j = run_script(opts, trace, range)?;
    write(
        &trace.with_extension("stalls.json"),
        j.to_string().as_bytes(),
    )?;
    let mut row = TraceRow::from_analysis(trace.display().to_string(), overrun, &j);
    if !stalls.is_empty() {
        let list: Vec<Value> = stalls
            .iter()
            .map(|w| {
                serde_json::json!({
                    "label": format!("vcpu {}", w.vcpu),
                    "tid": w.tid,
                    "from": w.from_ns as f64 / 1e9,
                    "to": w.to_ns as f64 / 1e9,
                })
            })
            .collect();
        let file = trace.with_extension("windows.json");
        write(&file, Value::Array(list).to_string().as_bytes())?;
        let mut args = vec![format!("--windows={}", file.display())];
        if let Some(d) = decisions.filter(|d| d.is_file()) {
            args.push(format!("--decisions={}", d.display()));
        }
        let j = run_script(opts, trace, args)?;
        write(
            &trace.with_extension("samples.json"),
            j.to_string().as_bytes(),
        )?;
        row.samples = Some(SampleCauses::from_analysis(&j));
    }
    Ok(row)
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), TraceError> {
    std::fs::write(path, bytes).map_err(write_err(path))
}

/// `stall_trace.py TRACE --json --over-us OVER_US ARGS`'s JSON.
fn run_script(opts: &TraceOpts, trace: &Path, args: Vec<String>) -> Result<Value, TraceError> {
    let python = opts
        .script
        .parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("."));
    let out = Command::new("python3")
        .args(["-m", "pvsched_bench", "stall-trace"])
        .env("PYTHONPATH", python)
        .arg(trace)
        .arg("--json")
        .arg(format!("--over-us={OVER_US}"))
        .args(args)
        .output()
        .map_err(|source| TraceError::Spawn {
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
    serde_json::from_slice(&out.stdout).map_err(|source| TraceError::Json {
        script: opts.script.clone(),
        source,
    })
}

/// CLOCK_MONOTONIC now, s: the trace's clock (`trace_clock` mono).
pub fn mono_s() -> f64 {
    pvsched_util::mono_ns() as f64 / 1e9
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
            "host_gaps": [{"at": 5.0, "ms": 3.2}, {"at": 6.0, "ms": 17.5}],
            "idle_switch_ins": 7
        });
        let r = TraceRow::from_analysis("t.trace".into(), 0, &j);
        assert_eq!(r.waits, 3);
        assert_eq!(r.idle_switch_ins, 7);
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
    fn stalled_samples_are_counted_by_where_their_vcpu_was() {
        let j = json!({
            "windows": [
                {"label": "vcpu 0", "from": 1.0, "ms": 3.3, "cause": "stolen"},
                {"label": "vcpu 1", "from": 2.0, "ms": 1.2, "cause": "queued-unboosted"}
            ],
            "causes": {"stolen": 1, "queued-unboosted": 1},
            "boost": {"throttled": 1, "boosted": 1},
            "cause_boost": {"stolen/boosted": 1, "queued-unboosted/throttled": 1}
        });
        let s = SampleCauses::from_analysis(&j);
        assert_eq!(s.stalls, 2);
        assert_eq!(s.boost["throttled"], 1);
        assert_eq!(s.cause_boost["queued-unboosted/throttled"], 1);
        assert_eq!(
            (s.longest_ms, s.longest_cause.as_deref()),
            (Some(3.3), Some("stolen"))
        );
        let mut r = TraceRow::from_analysis("t".into(), 0, &json!({}));
        r.samples = Some(s);
        let b = r.brief();
        assert!(
            b.contains(
                "samples > 1 ms: 2 (queued-unboosted 1, stolen 1), longest 3.30 ms stolen; \
                 their vCPU's boost then: boosted 1, throttled 1"
            ),
            "{b}"
        );
    }

    #[test]
    fn variants_filter() {
        let mut o = TraceOpts {
            dir: "/tmp".into(),
            script: "s.py".into(),
            buffer_kb: 1024,
            variants: None,
            kvm: false,
        };
        assert!(o.wants("vanilla"));
        o.variants = Some(vec!["pvsched".into()]);
        assert!(o.wants("pvsched") && !o.wants("vanilla"));
    }
}
