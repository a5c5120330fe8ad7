//! Load on a running pvschedd: `--vms` VMs of `--vcpus` real threads each,
//! registered from one process over `--vms` connections (device region),
//! then every slot flipped between "RT 99" and "nothing" every `--flip` so
//! the policy decides and the daemon applies boosts and restores for the
//! whole run. Prints one JSON object: registration latency (p50/p99/max),
//! decisions applied per second, ring drops, the daemon's RSS before and
//! after, refused requests. docs/benchmarks.md ("pvschedd under load") has
//! the command and a result.
//!
//! ```sh
//! pvschedd --socket /tmp/l/pvschedd.sock --socket-group "" --metrics-listen "" &
//! cargo run --release -p pvsched-daemon --example load -- --socket /tmp/l/pvschedd.sock
//! ```

use clap::Parser;
use pvsched_abi::{POLICY_FIFO, SlotGuest};
use pvsched_daemon::proto::{Region, Vcpu};
use pvsched_daemon::{Client, RegisterVm};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// pvschedd's socket.
    #[arg(long, default_value = pvsched_daemon::config::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// VMs.
    #[arg(long, default_value_t = 64)]
    vms: u32,
    /// vCPU threads per VM.
    #[arg(long, default_value_t = 4)]
    vcpus: u32,
    /// How long to drive decisions after registering.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Each thread sleeps this long in a loop (a vCPU halting this often).
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    period: Duration,
    /// Register without a region (no region map, no slot flips): shows
    /// what the region map costs a registration.
    #[arg(long)]
    no_region: bool,
    /// Slot flip period (each flip is a boost or a restore per vCPU).
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    flip: Duration,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let a = Args::parse();
    let stop = Arc::new(AtomicBool::new(false));
    // Real threads standing in for vCPU threads: each sleeps `period` in a
    // loop (a switch-out and a wakeup each time).
    let (tx, rx) = std::sync::mpsc::channel();
    let threads: Vec<_> = (0..a.vms * a.vcpus)
        .map(|_| {
            let (tx, stop, period) = (tx.clone(), stop.clone(), a.period);
            std::thread::spawn(move || {
                tx.send(pvsched_agent::sched::gettid()).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(period);
                }
            })
        })
        .collect();
    let tids: Vec<u32> = (0..threads.len()).map(|_| rx.recv().unwrap()).collect();
    let mut status = Client::connect(&a.socket).expect("pvschedd is running");
    let rss_before = status.status().unwrap().0.rss_kib;
    let mut lat_ms = Vec::new();
    let mut vms = Vec::new();
    for vm in 0..a.vms {
        let mut c = Client::connect(&a.socket).unwrap();
        let vcpus = (0..a.vcpus)
            .map(|i| Vcpu {
                tid: tids[(vm * a.vcpus + i) as usize],
                apic_id: i,
            })
            .collect();
        let t0 = Instant::now();
        let r = c
            .register(RegisterVm {
                name: format!("load-{vm}"),
                vcpus,
                emulator_tids: vec![],
                region: if a.no_region {
                    Region::None
                } else {
                    Region::Device
                },
                caps: None,
                pid: None,
                detach: false,
            })
            .expect("registration");
        lat_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        vms.push((c, r.region));
    }
    let (_, st) = status.status().unwrap();
    let decisions0: u64 = st.iter().map(|v| v.decisions).sum();
    let dropped0 = status.status().unwrap().0.dropped;
    let load0 = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let t0 = Instant::now();
    let rt = SlotGuest {
        policy: POLICY_FIFO,
        rt_prio: 99,
        ..Default::default()
    };
    let idle = SlotGuest::default();
    let mut on = false;
    while t0.elapsed() < a.duration {
        on = !on;
        for region in vms.iter().filter_map(|(_, r)| r.as_ref()) {
            for i in 0..a.vcpus {
                region.write_guest(a.vcpus, i, if on { &rt } else { &idle });
            }
        }
        std::thread::sleep(a.flip);
    }
    let secs = t0.elapsed().as_secs_f64();
    // A fresh connection: the daemon closes idle clients that hold no VM.
    let mut status = Client::connect(&a.socket).unwrap();
    let (d, st) = status.status().unwrap();
    let decisions: u64 = st.iter().map(|v| v.decisions).sum::<u64>() - decisions0;
    let mut p99_apply: Vec<f64> = st.iter().map(|v| v.apply_p99_ns as f64 / 1e3).collect();
    let n = lat_ms.len();
    let out = serde_json::json!({
        "vms": a.vms,
        "vcpus_per_vm": a.vcpus,
        "threads": tids.len(),
        "registration_ms": {
            "p50": pct(&mut lat_ms, 0.5),
            "p99": pct(&mut lat_ms, 0.99),
            "max": pct(&mut lat_ms, 1.0),
            "samples": n,
        },
        "duration_s": secs,
        "region": if a.no_region { "none" } else { "device" },
        "flip_ms": a.flip.as_secs_f64() * 1e3,
        "period_ms": a.period.as_secs_f64() * 1e3,
        "decisions": decisions,
        "decisions_per_s": decisions as f64 / secs,
        "ring_dropped": d.dropped - dropped0,
        "apply_p99_us_median_over_vms": pct(&mut p99_apply, 0.5),
        "daemon_rss_kib_before": rss_before,
        "daemon_rss_kib_loaded": d.rss_kib,
        "refused": d.refused,
        "loadavg_before": load0.trim(),
        "loadavg_after": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
    });
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
    stop.store(true, Ordering::Relaxed);
    drop(vms);
    for t in threads {
        let _ = t.join();
    }
}
