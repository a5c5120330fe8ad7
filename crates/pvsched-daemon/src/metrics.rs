//! Prometheus text exposition (format 0.0.4) of the daemon's state, and a
//! minimal HTTP/1.0 endpoint serving it (`GET /metrics`) on a localhost
//! port for scrapers; the same text is available as `{"op":"metrics"}` on
//! the UNIX socket. Names follow Prometheus conventions: `_total` for
//! counters, base units (seconds), one `vm` label (and `thread`) per
//! series.

use crate::server::{State, daemon_status, vm_statuses};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// The exposition of `s`.
pub fn render(s: &State) -> String {
    let d = daemon_status(s);
    let vms = vm_statuses(s);
    let mut fams = vec![
        Family::new("pvsched_vms", "gauge", "VMs registered."),
        Family::new("pvsched_clients", "gauge", "Connected clients."),
        Family::new(
            "pvsched_registrations_total",
            "counter",
            "Registrations accepted.",
        ),
        Family::new(
            "pvsched_refused_requests_total",
            "counter",
            "Requests refused.",
        ),
        Family::new(
            "pvsched_ring_dropped_total",
            "counter",
            "Decision records the ring buffer dropped (reconciliation corrects them).",
        ),
        Family::new(
            "pvsched_resident_memory_bytes",
            "gauge",
            "Resident set size of pvschedd.",
        ),
        Family::new("pvsched_vcpus", "gauge", "vCPU threads registered per VM."),
        Family::new(
            "pvsched_decisions_total",
            "counter",
            "Decisions applied per VM.",
        ),
        Family::new(
            "pvsched_apply_latency_seconds",
            "gauge",
            "Decision to sched_setattr latency per VM (quantile 0.5 and 0.99 of recent decisions).",
        ),
        Family::new(
            "pvsched_boosts_total",
            "counter",
            "Boosts the policy decided per thread.",
        ),
        Family::new(
            "pvsched_boosts_applied_total",
            "counter",
            "Boosts applied with sched_setattr per thread.",
        ),
        Family::new(
            "pvsched_throttles_total",
            "counter",
            "Throttles (continuous or budget limit) per thread.",
        ),
        Family::new(
            "pvsched_boosted_seconds_total",
            "counter",
            "Boosted on-CPU time per thread.",
        ),
        Family::new("pvsched_boosted", "gauge", "1 while the thread is boosted."),
        Family::new(
            "pvsched_throttled",
            "gauge",
            "1 while the thread is throttled.",
        ),
        Family::new(
            "pvsched_corrections_total",
            "counter",
            "Reconciliation corrections per thread.",
        ),
        Family::new(
            "pvsched_setattr_errors_total",
            "counter",
            "Failed sched_setattr calls per thread.",
        ),
    ];
    fams[0].add(String::new(), vms.len() as f64);
    fams[1].add(String::new(), d.clients as f64);
    fams[2].add(String::new(), d.registrations as f64);
    fams[3].add(String::new(), d.refused as f64);
    fams[4].add(String::new(), d.dropped as f64);
    fams[5].add(String::new(), (d.rss_kib * 1024) as f64);
    for (vm, _) in &vms {
        let l = format!("vm=\"{}\"", vm.name);
        fams[6].add(l.clone(), vm.vcpus.len() as f64);
        fams[7].add(l.clone(), vm.decisions as f64);
        fams[8].add(
            format!("{l},quantile=\"0.5\""),
            vm.apply_p50_ns as f64 / 1e9,
        );
        fams[8].add(
            format!("{l},quantile=\"0.99\""),
            vm.apply_p99_ns as f64 / 1e9,
        );
        for (name, t) in vm.threads() {
            let l = format!("vm=\"{}\",thread=\"{name}\"", vm.name);
            fams[9].add(l.clone(), t.boosts as f64);
            fams[10].add(l.clone(), t.boosts_applied as f64);
            fams[11].add(l.clone(), t.throttles as f64);
            fams[12].add(l.clone(), t.boosted_ns as f64 / 1e9);
            fams[13].add(l.clone(), (t.boost != "none") as u8 as f64);
            fams[14].add(l.clone(), t.throttled as u8 as f64);
            fams[15].add(l.clone(), t.corrections as f64);
            fams[16].add(l, t.errors as f64);
        }
    }
    let mut out = String::new();
    for f in &fams {
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
        let s = state.lock().unwrap_or_else(|p| p.into_inner());
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
