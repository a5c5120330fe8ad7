//! Prometheus text exposition (format 0.0.4) of the daemon's state, and a
//! minimal HTTP/1.0 endpoint serving it (`GET /metrics`) on a localhost
//! port for scrapers; the same text is available as `{"op":"metrics"}` on
//! the UNIX socket. Names follow Prometheus conventions: `_total` for
//! counters, base units (seconds), one `vm` label (and `thread`) per
//! series.

use crate::proto::{DaemonStatus, ThreadStatus, VmStatus};
use crate::server::{State, daemon_status, vm_statuses};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
const DAEMON: [Single<(DaemonStatus, usize)>; 6] = [
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
];

/// The per-VM families with one series per VM.
const PER_VM: [Single<VmStatus>; 2] = [
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
];

/// The per-thread families (`vm` and `thread` labels).
const PER_THREAD: [Single<ThreadStatus>; 8] = [
    (
        "pvsched_boosts_total",
        "counter",
        "Boosts the policy decided per thread.",
        |t| t.boosts as f64,
    ),
    (
        "pvsched_boosts_applied_total",
        "counter",
        "Boosts applied with sched_setattr per thread.",
        |t| t.boosts_applied as f64,
    ),
    (
        "pvsched_throttles_total",
        "counter",
        "Throttles (continuous or budget limit) per thread.",
        |t| t.throttles as f64,
    ),
    (
        "pvsched_boosted_seconds_total",
        "counter",
        "Boosted on-CPU time per thread.",
        |t| t.boosted_ns as f64 / 1e9,
    ),
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
    (
        "pvsched_corrections_total",
        "counter",
        "Reconciliation corrections per thread.",
        |t| t.corrections as f64,
    ),
    (
        "pvsched_setattr_errors_total",
        "counter",
        "Failed sched_setattr calls per thread.",
        |t| t.errors as f64,
    ),
];

/// The exposition of `s`.
pub fn render(s: &State) -> String {
    let vms = vm_statuses(s);
    let d = (daemon_status(s), vms.len());
    let mut out = String::new();
    for (name, kind, help, value) in DAEMON {
        let mut f = Family::new(name, kind, help);
        f.add(String::new(), value(&d));
        f.write(&mut out);
    }
    let vm_label = |vm: &VmStatus| format!("vm=\"{}\"", vm.name);
    for (name, kind, help, value) in PER_VM {
        let mut f = Family::new(name, kind, help);
        for vm in &vms {
            f.add(vm_label(vm), value(vm));
        }
        f.write(&mut out);
    }
    let mut lat = Family::new(
        "pvsched_apply_latency_seconds",
        "gauge",
        "Decision to sched_setattr latency per VM (quantile 0.5 and 0.99 of recent decisions).",
    );
    for vm in &vms {
        let l = vm_label(vm);
        lat.add(
            format!("{l},quantile=\"0.5\""),
            vm.apply_p50_ns as f64 / 1e9,
        );
        lat.add(
            format!("{l},quantile=\"0.99\""),
            vm.apply_p99_ns as f64 / 1e9,
        );
    }
    lat.write(&mut out);
    for (name, kind, help, value) in PER_THREAD {
        let mut f = Family::new(name, kind, help);
        for vm in &vms {
            for (thread, t) in vm.threads() {
                f.add(format!("vm=\"{}\",thread=\"{thread}\"", vm.name), value(t));
            }
        }
        f.write(&mut out);
    }
    out
}

/// Serves `GET /metrics` on `listener`, one connection at a time with a 2 s
/// I/O timeout each (scrapers are few; a stalled one cannot hold it long).
pub fn serve_http(listener: TcpListener, state: Arc<Mutex<State>>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        if let Err(e) = answer(conn, &state) {
            tracing::debug!("metrics request failed: {e}");
        }
    }
}

fn answer(mut conn: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut req = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && !req.windows(2).any(|w| w == b"\n\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 || req.len() > 8192 {
            break;
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = req.split(|&b| b == b'\n').next().unwrap_or_default();
    let (status, body) = if line.starts_with(b"GET /metrics ") || line.starts_with(b"GET / ") {
        let s = pvsched_util::lock(state);
        ("200 OK", render(&s))
    } else {
        ("404 Not Found", "try GET /metrics\n".into())
    };
    write!(
        conn,
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    conn.flush()
}
