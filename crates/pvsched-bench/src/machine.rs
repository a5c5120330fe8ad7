//! The machine a bench ran on: CPU count and model, kernel, load average.

use serde_json::{Value, json};

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// First `model name` of /proc/cpuinfo.
fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
}

/// Online CPUs.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The kernel's clock ticks per second (`USER_HZ`), the unit of /proc's
/// CPU times; `None` if sysconf gives none.
pub fn clock_ticks_per_s() -> Option<u64> {
    // SAFETY: sysconf reads a constant and has no memory effects.
    u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .ok()
        .filter(|&hz| hz > 0)
}

/// `machine` of the bench JSON.
pub fn describe() -> Value {
    let kernel = read("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned());
    let model = read("/proc/cpuinfo").and_then(|c| cpu_model(&c));
    let load =
        read("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    json!({
        "cpus": cpus(),
        "kernel": kernel,
        "cpu_model": model,
        "kvm": std::path::Path::new("/dev/kvm").exists(),
        "loadavg_at_start": load,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_from_cpuinfo() {
        let c = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: fpu\n";
        assert_eq!(cpu_model(c).as_deref(), Some("AMD EPYC 7B13"));
        assert_eq!(cpu_model("nothing"), None);
        assert!(describe()["cpus"].as_u64().unwrap() >= 1);
    }
}
