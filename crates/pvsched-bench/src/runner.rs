//! Running one variant of a scenario once: CPU hogs in this process, the
//! measured VM in a child `pvsched-bench run` (see [`super::worker`]),
//! whose JSON is parsed here. A child that overruns its time is killed.

use super::BenchError;
use super::hogs::{HogCounter, Hogs, Load};
use super::stats::{self, Latency};
use super::worker::{self, BenchDeviceMode, BenchWorkload};
use serde_json::{Value, json};
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
    /// Embedded policy on.
    pub policy: bool,
    /// Caps without the directed-yield boost.
    pub no_yield: bool,
    /// CPU hogs beside the VM ([`Load::NONE`]: idle host).
    pub load: Load,
}

impl Variant {
    /// Policy name for the JSON.
    pub fn policy_name(&self) -> &'static str {
        if self.policy { "embedded" } else { "none" }
    }

    /// Caps name for the JSON.
    pub fn caps_name(&self) -> Option<&'static str> {
        match (self.policy, self.no_yield) {
            (false, _) => None,
            (true, false) => Some("default"),
            (true, true) => Some("default, yield_boost = \"none\""),
        }
    }
}

/// What one run gave.
#[derive(Debug)]
pub struct Outcome {
    /// Summary of the raw samples.
    pub latency: Latency,
    /// Raw samples, ns, sorted.
    pub samples: Vec<u64>,
    /// The worker's JSON without its samples.
    pub json: Value,
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
}

/// Runs `v` once.
pub fn run(v: &Variant, opts: &RunOpts) -> Result<Outcome, BenchError> {
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
    if v.policy {
        cmd.arg("--policy");
    }
    if v.no_yield {
        cmd.arg("--no-yield");
    }
    if let (true, Some(c)) = (v.policy, &opts.caps) {
        cmd.arg("--policy-file").arg(c);
    }
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
    let reader = std::thread::spawn(move || read_child(stdout, &counter));
    let deadline = Instant::now() + duration + GRACE;
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
    let (text, hog) = reader
        .join()
        .map_err(|_| BenchError::Spawn(std::io::Error::other("the reader thread panicked")))?
        .map_err(BenchError::Spawn)?;
    drop(hogs);
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
    let mut out = parse(&text).map_err(|e| BenchError::Parse {
        variant: v.name,
        source: e,
    })?;
    if let Some(o) = out.json.as_object_mut() {
        o.insert("loadavg_1m_before".into(), load.into());
        o.insert("load".into(), v.load.to_json());
        for (k, x) in hog.to_json(v.load.threads()) {
            o.insert(k, x);
        }
    }
    Ok(out)
}

/// The hogs' work during a run's measured time (between the worker's
/// [`worker::MARK_START`] and [`worker::MARK_END`] lines).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HogWork {
    /// Iterations counted at the start marker.
    start: Option<(u64, Instant)>,
    /// Iterations and seconds between the markers.
    done: Option<(u64, f64)>,
}

impl HogWork {
    /// Marker `line` seen with the counters at `total`; `false` if the
    /// line is no marker.
    fn on_line(&mut self, line: &str, total: u64, now: Instant) -> bool {
        match line.trim_end() {
            worker::MARK_START => {
                self.start = Some((total, now));
                true
            }
            worker::MARK_END => {
                if let Some((t0, i0)) = self.start {
                    let secs = now.duration_since(i0).as_secs_f64();
                    self.done = Some((total.saturating_sub(t0), secs));
                }
                true
            }
            _ => false,
        }
    }

    /// `hog_iterations` (total over every hog, measured time only),
    /// `hog_window_s` and `hog_iterations_per_s`; nulls without hogs or
    /// markers.
    pub fn to_json(self, threads: usize) -> Vec<(String, Value)> {
        let d = self.done.filter(|_| threads > 0);
        vec![
            ("hog_iterations".into(), json!(d.map(|x| x.0))),
            (
                "hog_window_s".into(),
                json!(d.map(|x| (x.1 * 1000.0).round() / 1000.0)),
            ),
            (
                "hog_iterations_per_s".into(),
                json!(d.and_then(|(n, s)| (s > 0.0).then(|| (n as f64 / s).round()))),
            ),
        ]
    }
}

/// Reads the child's stdout to the end: marker lines drive `HogWork`, the
/// rest is its JSON.
fn read_child(out: impl std::io::Read, counter: &HogCounter) -> std::io::Result<(String, HogWork)> {
    let mut text = String::new();
    let mut hog = HogWork::default();
    for line in BufReader::new(out).lines() {
        let line = line?;
        if !hog.on_line(&line, counter.total(), Instant::now()) {
            text.push_str(&line);
            text.push('\n');
        }
    }
    Ok((text, hog))
}

/// Parses the worker's JSON, moving its samples out.
pub fn parse(text: &str) -> Result<Outcome, serde_json::Error> {
    let mut json: Value = serde_json::from_str(text.trim())?;
    let mut samples: Vec<u64> = json
        .get("samples_ns")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    if let Some(o) = json.as_object_mut() {
        o.remove("samples_ns");
    }
    let latency = stats::latency(&mut samples);
    Ok(Outcome {
        latency,
        samples,
        json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_moves_samples_out() {
        let o = parse(r#"{"ok":true,"samples_ns":[3000,1000,2000]}"#).unwrap();
        assert_eq!(o.samples, vec![1000, 2000, 3000]);
        assert_eq!(o.latency.p50_us, Some(2.0));
        assert_eq!(o.latency.max_us, Some(3.0));
        assert!(o.json.get("samples_ns").is_none());
        assert!(parse("not json").is_err());
    }

    #[test]
    fn hog_work_counts_between_the_markers() {
        let t = Instant::now();
        let mut h = HogWork::default();
        assert!(!h.on_line("{\"ok\":true}", 5, t));
        assert!(h.on_line(worker::MARK_START, 100, t));
        assert!(h.on_line(worker::MARK_END, 400, t + Duration::from_secs(2)));
        let j: serde_json::Map<String, Value> = h.to_json(2).into_iter().collect();
        assert_eq!(j["hog_iterations"], 300);
        assert_eq!(j["hog_window_s"], 2.0);
        assert_eq!(j["hog_iterations_per_s"], 150.0);
        let idle: serde_json::Map<String, Value> = h.to_json(0).into_iter().collect();
        assert!(idle["hog_iterations"].is_null());
        let none: serde_json::Map<String, Value> =
            HogWork::default().to_json(2).into_iter().collect();
        assert!(none["hog_iterations"].is_null() && none["hog_iterations_per_s"].is_null());
    }

    #[test]
    fn read_child_strips_the_markers() {
        let out = format!(
            "{}\n{}\n{{\"ok\":true}}\n",
            worker::MARK_START,
            worker::MARK_END
        );
        let (text, hog) = read_child(out.as_bytes(), &HogCounter::default()).unwrap();
        assert_eq!(text.trim(), "{\"ok\":true}");
        assert_eq!(hog.done.map(|d| d.0), Some(0));
    }
}
