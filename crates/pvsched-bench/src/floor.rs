//! The host's own floor: what this host's wake-up latency is with no VM,
//! measured in every repetition of S1 and S2 beside the variants, on the
//! idle host and beside the loaded variants' hogs.
//!
//! The host may itself be a VM whose hypervisor stops its CPUs for
//! milliseconds; no scheduling policy inside it can beat that. So a tail
//! target is judged against the floor of the same repetition: a pvsched
//! max at or under the idle host's max is as good as this host can do.
//! The loaded floor is the same RT thread beside the same busy hogs: a
//! hypervisor may take more from CPUs that never idle, and no policy
//! inside the host beats an RT thread at priority 99 there either. Each
//! floor also records the CPU time the hypervisor stole from this host
//! meanwhile (`steal` in /proc/stat).
//!
//! The floor is `cyclictest` (rt-tests) with one SCHED_FIFO 99 thread
//! pinned per CPU (`-S`), memory locked, a 1 ms interval, for the run
//! duration, with its histogram in its JSON output. It runs with
//! `--default-system`: it does not lower `/dev/cpu_dma_latency`, which the
//! variants' runs do not do either, so the floor is that of the host the
//! variants ran on.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// cyclictest's histogram range, µs: a sample beyond it is an overflow
/// (counted, its value unknown; the maximum is still exact).
const HIST_US: u64 = 100_000;

/// Errors of one floor measurement.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    /// cyclictest could not be started.
    #[error("floor: starting {path}: {source}")]
    Spawn {
        /// The program.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// cyclictest failed.
    #[error("floor: cyclictest exited with {0:?}: {1}")]
    Exit(Option<i32>, String),
    /// Its JSON output is missing or not what cyclictest writes.
    #[error("floor: cyclictest's JSON output: {0}")]
    Output(String),
}

/// `cyclictest` on `$PATH`, if there is one.
pub fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("cyclictest"))
        .find(|p| p.is_file())
}

/// One floor measurement, µs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Floor {
    /// Samples over every CPU.
    pub samples: u64,
    /// 99th percentile over every CPU (nearest rank); `None` if it lies
    /// beyond the histogram's range.
    pub p99_us: Option<f64>,
    /// The largest over every CPU.
    pub max_us: Option<f64>,
    /// CPU time the hypervisor stole from this host's CPUs meanwhile, ms
    /// (`None` where /proc/stat has no steal).
    pub steal_ms: Option<f64>,
}

/// The host's stolen CPU time so far, ms: /proc/stat's aggregate `cpu`
/// line, eighth figure, in clock ticks.
pub fn steal_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: f64 = line.split_whitespace().nth(8)?.parse().ok()?;
    let hz = crate::machine::clock_ticks_per_s()?;
    Some(ticks * 1000.0 / hz as f64)
}

/// cyclictest's `--json` file, the parts read here.
#[derive(Deserialize)]
struct Output {
    thread: BTreeMap<String, Thread>,
}

#[derive(Deserialize)]
struct Thread {
    #[serde(default)]
    histogram: BTreeMap<String, u64>,
    cycles: u64,
    max: u64,
}

/// Measures the floor for `duration` (whole seconds, at least one: what
/// cyclictest's `-D` takes) with the cyclictest at `bin`.
pub fn measure(bin: &Path, duration: Duration, tag: &str) -> Result<Floor, FloorError> {
    let file = std::env::temp_dir().join(format!(
        "pvsched-bench-floor-{}-{tag}.json",
        std::process::id()
    ));
    let secs = duration.as_secs_f64().ceil().max(1.0) as u64;
    let steal0 = steal_ms();
    let out = Command::new(bin)
        .args([
            "-m",
            "-q",
            "-S",
            "-p",
            "99",
            "-i",
            "1000",
            "--default-system",
        ])
        .arg(format!("-h{HIST_US}"))
        .arg(format!("-D{secs}"))
        .arg(format!("--json={}", file.display()))
        .stdin(Stdio::null())
        // The histogram also goes to stdout, a line per bucket.
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|source| FloorError::Spawn {
            path: bin.into(),
            source,
        })?;
    let steal = steal_ms().zip(steal0).map(|(b, a)| b - a);
    let text = std::fs::read_to_string(&file);
    let _ = std::fs::remove_file(&file);
    if !out.status.success() {
        return Err(FloorError::Exit(
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    let text = text.map_err(|e| FloorError::Output(format!("{}: {e}", file.display())))?;
    Ok(Floor {
        steal_ms: steal,
        ..parse(&text)?
    })
}

/// The floor in cyclictest's JSON output: its threads' histograms merged.
fn parse(text: &str) -> Result<Floor, FloorError> {
    let out: Output = serde_json::from_str(text).map_err(|e| FloorError::Output(e.to_string()))?;
    let mut hist: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut samples, mut max) = (0u64, None::<u64>);
    for t in out.thread.values() {
        samples += t.cycles;
        max = max.max(Some(t.max));
        for (us, n) in &t.histogram {
            let us = us
                .parse::<u64>()
                .map_err(|e| FloorError::Output(format!("histogram bucket {us:?}: {e}")))?;
            *hist.entry(us).or_default() += n;
        }
    }
    // Nearest rank over every sample; the overflows (beyond HIST_US) are
    // the largest, so a rank past the histogram's count is unknown.
    let rank = (samples as f64 * 0.99).ceil() as u64;
    let mut seen = 0;
    let p99 = hist.iter().find_map(|(&us, &n)| {
        seen += n;
        (seen >= rank.max(1)).then_some(us as f64)
    });
    Ok(Floor {
        samples,
        p99_us: p99.filter(|_| samples > 0),
        max_us: max.filter(|_| samples > 0).map(|m| m as f64),
        steal_ms: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_of_every_cpu_are_merged() {
        // 100 samples: 98 at 10 µs, then 50 and 900 µs on the other CPU.
        let j = r#"{"thread": {
            "0": {"histogram": {"10": 60}, "cycles": 60, "min": 10, "max": 10},
            "1": {"histogram": {"10": 38, "50": 1, "900": 1}, "cycles": 40, "min": 10, "max": 900}
        }}"#;
        let f = parse(j).unwrap();
        assert_eq!(f.samples, 100);
        assert_eq!(f.p99_us, Some(50.0));
        assert_eq!(f.max_us, Some(900.0));
    }

    #[test]
    fn a_p99_among_the_overflows_is_unknown_not_guessed() {
        // 10 samples, 2 beyond the histogram: the 99th is one of them.
        let j = r#"{"thread": {"0": {"histogram": {"5": 8}, "cycles": 10, "max": 150000}}}"#;
        let f = parse(j).unwrap();
        assert_eq!(f.p99_us, None);
        assert_eq!(f.max_us, Some(150_000.0));
        assert!(parse("{}").is_err());
    }
}
