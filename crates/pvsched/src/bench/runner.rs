//! Running one variant of a scenario once: CPU hogs in this process, the
//! measured VM in a child `pvsched bench-run` (see [`super::worker`]),
//! whose JSON is parsed here. A child that overruns its time is killed.

use super::BenchError;
use super::hogs::Hogs;
use super::stats::{self, Latency};
use super::worker::{BenchDeviceMode, BenchWorkload};
use serde_json::Value;
use std::io::Read;
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
    /// CPU hogs beside the VM.
    pub hogs: usize,
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
    let _hogs = Hogs::start(v.hogs).map_err(BenchError::Hogs)?;
    let mut cmd = Command::new(exe);
    cmd.arg("bench-run")
        .arg(format!("--vcpus={}", v.vcpus))
        .arg(format!(
            "--workload={}",
            match v.workload {
                BenchWorkload::Wakeup => "wakeup",
                BenchWorkload::Ipi => "ipi",
                BenchWorkload::Spin => "spin",
            }
        ))
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
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| BenchError::Spawn(std::io::Error::other("the child has no stdout pipe")))?;
    // Read while waiting: a full pipe would block the child.
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).map(|_| s)
    });
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
    let text = reader
        .join()
        .map_err(|_| BenchError::Spawn(std::io::Error::other("the reader thread panicked")))?
        .map_err(BenchError::Spawn)?;
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
    }
    Ok(out)
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
}
