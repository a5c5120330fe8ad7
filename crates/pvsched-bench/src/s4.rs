//! S4: runs `bench/s4.py` (Linux guest under QEMU TCG with the real guest
//! module, cyclictest, host loaded with stress-ng; written and owned by
//! the S4 harness) and relays its JSON; the CDF plot comes from its raw
//! histograms (`--samples`).

use super::BenchError;
use super::plot::Series;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The repository whose `bench/s4.py` runs: `--repo`, else
/// `$PVSCHED_ROOT`, else the current directory or the nearest parent of it
/// that has `bench/s4.py` (S4 needs the repository: the harness, the guest
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
        .find(|d| d.join("bench/s4.py").is_file())
        .map(Path::to_path_buf)
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

/// What to pass to s4.py.
pub struct S4Args<'a> {
    /// Repository root.
    pub repo: &'a Path,
    /// `pvsched-device` binary.
    pub device_bin: &'a Path,
    /// `pvsched` binary (registers the VM: `pvsched qemu-attach`).
    pub pvsched_bin: &'a Path,
    /// `pvschedd` binary (the host daemon s4.py starts).
    pub pvschedd_bin: &'a Path,
    /// `--caps`: the VM's caps file (default: pvschedd's default caps).
    pub caps: Option<&'a Path>,
    /// `--quick`.
    pub quick: bool,
    /// `--reps`.
    pub reps: Option<u32>,
    /// `--duration` (seconds per phase).
    pub duration_s: Option<u64>,
    /// Where s4.py writes its raw histograms.
    pub samples: &'a Path,
}

/// Runs s4.py and returns its JSON.
pub fn run(a: &S4Args<'_>) -> Result<Value, BenchError> {
    let script = a.repo.join("bench/s4.py");
    if !script.is_file() {
        return Err(BenchError::Setup(format!(
            "{} not found: give the repository with --repo DIR or PVSCHED_ROOT",
            script.display()
        )));
    }
    let mut cmd = Command::new("python3");
    cmd.arg(&script)
        .arg("--device-bin")
        .arg(a.device_bin)
        .arg("--pvsched-bin")
        .arg(a.pvsched_bin)
        .arg("--pvschedd-bin")
        .arg(a.pvschedd_bin)
        .arg("--json")
        .arg("-")
        .arg("--samples")
        .arg(a.samples)
        .current_dir(a.repo);
    if a.quick {
        cmd.arg("--quick");
    }
    if let Some(r) = a.reps {
        cmd.arg("--reps").arg(r.to_string());
    }
    if let Some(c) = a.caps {
        cmd.arg("--caps").arg(c);
    }
    if let Some(d) = a.duration_s {
        cmd.arg("--duration").arg(d.to_string());
    }
    eprintln!("[s4] {cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(BenchError::Spawn)?;
    if !out.status.success() {
        return Err(BenchError::Worker {
            variant: "s4.py",
            code: out.status.code(),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(BenchError::S4Json)
}

/// s4.py's `targets` as the bench's list of `{name, goal, value, met}`:
/// an object keyed by name (`{"guest_max_i500": {"target": "<= 0.5x
/// vanilla", "value", "met"}}`) becomes that list; a list is kept.
pub fn normalize_targets(t: Value) -> Value {
    match t {
        Value::Object(m) => Value::Array(
            m.into_iter()
                .map(|(name, v)| {
                    let mut o = serde_json::Map::new();
                    o.insert("name".into(), Value::String(name));
                    let goal = v.get("goal").or_else(|| v.get("target")).cloned();
                    o.insert("goal".into(), goal.unwrap_or(Value::Null));
                    if let Value::Object(rest) = v {
                        for (k, x) in rest {
                            o.entry(k).or_insert(x);
                        }
                    }
                    Value::Object(o)
                })
                .collect(),
        ),
        other => other,
    }
}

type Curve = (String, Vec<(u64, u64)>, u64);

/// CDF series from s4.py's raw histograms: guest and host latency per
/// kernel and variant for the loaded host at `interval_us`, all
/// repetitions merged.
pub fn series(samples: &Value, interval_us: u64) -> Vec<Series> {
    // (name, histogram buckets (µs, count), cycles) per curve.
    let mut out: Vec<Curve> = Vec::new();
    for run in samples["runs"].as_array().into_iter().flatten() {
        if run["load"].as_str() != Some("loaded")
            || run["interval_us"].as_u64() != Some(interval_us)
        {
            continue;
        }
        let Some(variant) = run["variant"].as_str() else {
            continue;
        };
        let kernel = run["kernel"]
            .as_str()
            .map_or(String::new(), |k| format!("{k} "));
        for side in ["guest", "host"] {
            let name = format!("{kernel}{variant} {side}");
            let h = &run[side];
            let hist: Vec<(u64, u64)> = h["hist"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|b| Some((b.get(0)?.as_u64()?, b.get(1)?.as_u64()?)))
                .collect();
            let total = h["cycles"].as_u64().unwrap_or(0);
            match out.iter_mut().find(|x| x.0 == name) {
                Some(x) => {
                    x.1.extend(hist);
                    x.2 = x.2.saturating_add(total);
                }
                None => out.push((name, hist, total)),
            }
        }
    }
    out.into_iter()
        .filter_map(|(name, mut hist, cycles)| {
            hist.sort_unstable();
            let n = cycles.max(hist.iter().map(|b| b.1).sum());
            if n == 0 {
                return None;
            }
            let mut acc = 0u64;
            let mut points: Vec<(f64, f64)> = Vec::new();
            for (us, c) in hist {
                acc = acc.saturating_add(c);
                let p = (us.max(1) as f64, acc as f64 / n as f64);
                match points.last_mut() {
                    Some(last) if last.0 == p.0 => *last = p,
                    _ => points.push(p),
                }
            }
            Some(Series {
                name,
                points,
                n: n as f64,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keyed_targets_become_a_list() {
        let t = normalize_targets(json!({
            "guest_max_i500": {"target": "<= 0.5x vanilla", "value": 0.84, "met": false}
        }));
        assert_eq!(t[0]["name"], "guest_max_i500");
        assert_eq!(t[0]["goal"], "<= 0.5x vanilla");
        assert_eq!(t[0]["value"], 0.84);
        assert_eq!(t[0]["met"], false);
        assert_eq!(normalize_targets(json!([1])), json!([1]));
    }

    #[test]
    fn histograms_become_cdfs() {
        let s = json!({"unit": "us", "runs": [
            {"variant": "vanilla", "load": "loaded", "interval_us": 500, "rep": 1,
             "guest": {"hist": [[10, 2], [100, 2]], "cycles": 4, "overflow": 0},
             "host": {"hist": [[5, 1]], "cycles": 1, "overflow": 0}},
            {"variant": "vanilla", "load": "loaded", "interval_us": 500, "rep": 2,
             "guest": {"hist": [[10, 4]], "cycles": 4, "overflow": 0},
             "host": {"hist": [], "cycles": 0, "overflow": 0}},
            {"variant": "vanilla", "load": "idle", "interval_us": 500, "rep": 1,
             "guest": {"hist": [[1, 9]], "cycles": 9, "overflow": 0}},
            {"kernel": "6.1-cloud", "variant": "pvsched", "load": "loaded",
             "interval_us": 500, "rep": 1,
             "guest": {"hist": [[7, 1]], "cycles": 1, "overflow": 0}}
        ]});
        let v = series(&s, 500);
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].name, "vanilla guest");
        assert_eq!(v[2].name, "6.1-cloud pvsched guest");
        assert_eq!(v[0].points, vec![(10.0, 0.75), (100.0, 1.0)]);
        assert_eq!(v[1].points, vec![(5.0, 1.0)]);
        assert_eq!(repo_root(Some(Path::new("/x"))), Some(PathBuf::from("/x")));
    }
}
