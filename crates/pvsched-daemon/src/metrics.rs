//! Prometheus text exposition (format 0.0.4) of the daemon's status,
//! served to scrapers by [`crate::http`] on a localhost port; the same
//! text is available as `{"op":"metrics"}` on the UNIX socket. Names follow Prometheus conventions: `_total` for
//! counters, base units (seconds), one `vm` label (and `thread`) per
//! series.
//!
//! This module sees only plain status data ([`DaemonStatus`],
//! [`VmStatus`]): the HTTP thread is handed a function that returns a
//! snapshot, not the daemon's state, so it cannot change the registry and
//! holds the registry's lock only while the copy is taken (rendering and
//! writing to a slow scraper happen after).

use crate::proto::{DaemonStatus, ThreadStatus, VmStatus};
use pvsched_agent::agent::ThreadCounters;
use std::fmt::Write as _;

/// One metric family: name, type, help, and its samples as (labels,
/// value) in the order they were added.
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<(String, f64)>,
}

impl Family {
    fn new(name: &'static str, kind: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind,
            help,
            samples: Vec::new(),
        }
    }

    fn add(&mut self, labels: String, v: f64) {
        self.samples.push((labels, v));
    }

    fn write(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        for (labels, v) in &self.samples {
            if labels.is_empty() {
                let _ = writeln!(out, "{} {v}", self.name);
            } else {
                let _ = writeln!(out, "{}{{{labels}}} {v}", self.name);
            }
        }
    }
}

/// A family of one series, and how to read its value.
type Single<T> = (&'static str, &'static str, &'static str, fn(&T) -> f64);

/// The daemon-wide families (the VM count from the status list).
const DAEMON: [Single<(DaemonStatus, usize)>; 10] = [
    ("pvsched_vms", "gauge", "VMs registered.", |(_, n)| {
        *n as f64
    }),
    (
        "pvsched_clients",
        "gauge",
        "Connected clients.",
        |(d, _)| d.clients as f64,
    ),
    (
        "pvsched_registrations_total",
        "counter",
        "Registrations accepted.",
        |(d, _)| d.registrations as f64,
    ),
    (
        "pvsched_refused_requests_total",
        "counter",
        "Requests refused.",
        |(d, _)| d.refused as f64,
    ),
    (
        "pvsched_ring_dropped_total",
        "counter",
        "Decision records the ring buffer dropped (reconciliation corrects them).",
        |(d, _)| d.dropped as f64,
    ),
    (
        "pvsched_resident_memory_bytes",
        "gauge",
        "Resident set size of pvschedd.",
        |(d, _)| (d.rss_kib * 1024) as f64,
    ),
    (
        "pvsched_uptime_seconds",
        "gauge",
        "Seconds since pvschedd started (a drop is a restart).",
        |(d, _)| d.uptime_s as f64,
    ),
    (
        "pvsched_config_reloads_total",
        "counter",
        "Configurations read again on SIGHUP (systemctl reload) and taken.",
        |(d, _)| d.reloads as f64,
    ),
    (
        "pvsched_config_reload_errors_total",
        "counter",
        "SIGHUPs whose files were refused: the running configuration stayed (the journal says why).",
        |(d, _)| d.reload_errors as f64,
    ),
    (
        "pvsched_restore_errors_total",
        "counter",
        "Threads whose baseline could not be put back when their VM's registration ended.",
        |(d, _)| d.restore_errors as f64,
    ),
];

/// The per-VM families with one series per VM.
const PER_VM: [Single<VmStatus>; 3] = [
    (
        "pvsched_vcpus",
        "gauge",
        "vCPU threads registered per VM.",
        |v| v.vcpus.len() as f64,
    ),
    (
        "pvsched_decisions_total",
        "counter",
        "Decisions applied per VM.",
        |v| v.decisions as f64,
    ),
    (
        "pvsched_cosched_phase_seconds",
        "gauge",
        "Co-scheduled phase per VM now, of every cosched_period_us (0: not co-scheduled).",
        |v| v.cosched_now_us as f64 / 1e6,
    ),
];

/// The per-thread gauges (`vm` and `thread` labels); the counters are
/// [`ThreadCounters::ALL`].
const PER_THREAD: [Single<ThreadStatus>; 2] = [
    (
        "pvsched_boosted",
        "gauge",
        "1 while the thread is boosted.",
        |t| (t.boost != "none") as u8 as f64,
    ),
    (
        "pvsched_throttled",
        "gauge",
        "1 while the thread is throttled.",
        |t| t.throttled as u8 as f64,
    ),
];

/// How VMs are named in an exposition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmLabel {
    /// `vm="<name>"`: for root on the socket and scrapers that present the
    /// token.
    Name,
    /// `vm="<vm_id>"`: what anyone who can reach the HTTP port sees when
    /// no token is configured (VM names are not every local user's).
    Id,
}

/// The standard `process_*` series of the Prometheus client libraries,
/// of the calling process (pvschedd), read from /proc/self: CPU, memory,
/// file descriptors and start time, so the usual process dashboards and
/// alerts work on pvschedd unchanged. A figure /proc does not give is
/// left out.
fn process_families(out: &mut String) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's closing parenthesis: index 0 is
    // field 3 of proc(5).
    let after: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| after.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    // SAFETY: sysconf takes a constant and reads no memory of ours.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as f64)
        .ok();
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3)?.parse::<f64>().ok())
        });
    let series = [
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            field(14)
                .zip(field(15))
                .filter(|_| tck > 0.0)
                .map(|(u, s)| (u + s) / tck),
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            field(24).filter(|_| page > 0.0).map(|r| r * page),
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            field(23),
        ),
        (
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            open_fds,
        ),
        (
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            max_fds,
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            pvsched_agent::guardian::start_unix_s(std::process::id()),
        ),
    ];
    for (name, kind, help, value) in series {
        if let Some(v) = value {
            let mut f = Family::new(name, kind, help);
            f.add(String::new(), v);
            f.write(out);
        }
    }
}

/// The exposition of the daemon's figures and of `vms`, labelled as
/// `label` says.
pub fn render(daemon: DaemonStatus, mut vms: Vec<VmStatus>, label: VmLabel) -> String {
    if label == VmLabel::Id {
        for vm in &mut vms {
            vm.name = vm.vm_id.to_string();
        }
    }
    let d = (daemon, vms.len());
    let mut out = String::new();
    process_families(&mut out);
    for (name, kind, help, value) in DAEMON {
        let mut f = Family::new(name, kind, help);
        f.add(String::new(), value(&d));
        f.write(&mut out);
    }
    // The running release and the guest ABI it speaks, as labels (the
    // `*_build_info` convention): `pvsched_build_info * on (instance)`
    // joins them to any series, and a change of value marks an upgrade.
    let mut build = Family::new(
        "pvsched_build_info",
        "gauge",
        "1, labelled with pvschedd's release (version) and the guest ABI it speaks (abi).",
    );
    build.add(
        format!(
            "version=\"{}\",abi=\"{}\"",
            crate::proto::VERSION,
            crate::proto::abi()
        ),
        1.0,
    );
    build.write(&mut out);
    let mut gone = Family::new(
        "pvsched_unregistrations_total",
        "counter",
        "Registrations ended, by reason: vmm_exited (the VMM process ended while registered), connection_closed, request, failed, shutdown, superseded (root took the name of an unprivileged VMM's VM that no VM file bound to it).",
    );
    for (reason, n) in d.0.unregistrations.by_reason() {
        gone.add(format!("reason=\"{reason}\""), n as f64);
    }
    gone.write(&mut out);
    let mut ended = Family::new(
        "pvsched_vm_unregistered_timestamp_seconds",
        "gauge",
        "When a VM's registration ended lately (the last 15 minutes), by reason: a VM that vanished from pvsched_vcpus without one of these (vmm_exited, request) left while its VMM may still run.",
    );
    for e in &d.0.ended {
        let vm = match label {
            VmLabel::Name => e.name.clone(),
            VmLabel::Id => e.vm_id.to_string(),
        };
        ended.add(
            format!("vm=\"{vm}\",reason=\"{}\"", e.reason),
            e.at_unix_s as f64,
        );
    }
    ended.write(&mut out);
    let vm_label = |vm: &VmStatus| format!("vm=\"{}\"", vm.name);
    for (name, kind, help, value) in PER_VM {
        let mut f = Family::new(name, kind, help);
        for vm in &vms {
            f.add(vm_label(vm), value(vm));
        }
        f.write(&mut out);
    }
    // The guest side of each VM as labels, as build_info is for the
    // daemon: which driver ABI a fleet's guests run.
    let mut guest = Family::new(
        "pvsched_vm_guest_info",
        "gauge",
        "1 per VM, labelled with its region mode and the guest ABI its driver says it speaks (guest_abi; empty without a device region or before a driver attached; the guest writes it, so it is shown, never acted on).",
    );
    for vm in &vms {
        guest.add(
            format!(
                "{},region=\"{}\",guest_abi=\"{}\"",
                vm_label(vm),
                vm.region,
                vm.guest_abi.as_deref().unwrap_or("")
            ),
            1.0,
        );
    }
    guest.write(&mut out);
    // A histogram is three kinds of sample under one family; written out
    // here rather than through Family, which holds one value per series.
    let hist = "pvsched_apply_latency_seconds";
    let _ = writeln!(
        out,
        "# HELP {hist} Decision to sched_setattr latency per VM, every decision since it registered.\n# TYPE {hist} histogram"
    );
    for vm in &vms {
        let h = &vm.apply_latency;
        for (bound, n) in h.cumulative() {
            let le = bound.map_or_else(|| "+Inf".to_string(), |ns| format!("{}", ns as f64 / 1e9));
            let _ = writeln!(out, "{hist}_bucket{{{},le=\"{le}\"}} {n}", vm_label(vm));
        }
        let _ = writeln!(
            out,
            "{hist}_sum{{{}}} {}",
            vm_label(vm),
            h.sum_ns as f64 / 1e9
        );
        let _ = writeln!(out, "{hist}_count{{{}}} {}", vm_label(vm), h.count());
    }
    let thread_label =
        |vm: &VmStatus, thread: &str| format!("vm=\"{}\",thread=\"{thread}\"", vm.name);
    for c in ThreadCounters::ALL {
        let mut f = Family::new(c.metric, "counter", c.help);
        for vm in &vms {
            for (thread, t) in vm.threads() {
                f.add(thread_label(vm, &thread), (c.value)(&t.counters));
            }
        }
        f.write(&mut out);
    }
    for (name, kind, help, value) in PER_THREAD {
        let mut f = Family::new(name, kind, help);
        for vm in &vms {
            for (thread, t) in vm.threads() {
                f.add(thread_label(vm, &thread), value(t));
            }
        }
        f.write(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::UnregisterReason;

    /// Daemon-wide families without VMs: one series each, the
    /// unregistrations by reason, and nothing that `promtool check
    /// metrics` rejects (no `quantile` label outside a summary).
    #[test]
    fn daemon_families_and_unregistrations_by_reason() {
        let mut d = DaemonStatus {
            uptime_s: 42,
            restore_errors: 2,
            ..Default::default()
        };
        d.unregistrations.count(UnregisterReason::VmmExited);
        d.unregistrations.count(UnregisterReason::VmmExited);
        d.unregistrations.count(UnregisterReason::Request);
        let text = render(d, Vec::new(), VmLabel::Name);
        let lines: Vec<&str> = text.lines().collect();
        for want in [
            "pvsched_vms 0",
            "pvsched_uptime_seconds 42",
            &format!(
                "pvsched_build_info{{version=\"{}\",abi=\"{}\"}} 1",
                crate::proto::VERSION,
                crate::proto::abi()
            ),
            "pvsched_restore_errors_total 2",
            "pvsched_unregistrations_total{reason=\"vmm_exited\"} 2",
            "pvsched_unregistrations_total{reason=\"request\"} 1",
            "pvsched_unregistrations_total{reason=\"connection_closed\"} 0",
            "# TYPE pvsched_apply_latency_seconds histogram",
        ] {
            assert!(lines.contains(&want), "no line {want:?} in\n{text}");
        }
        assert!(!text.contains("quantile"), "{text}");
        // The standard process series, of this test process.
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ] {
            assert!(
                lines.iter().any(|l| l.starts_with(&format!("{name} "))),
                "no {name} in\n{text}"
            );
        }
    }
}
