//! Measures the policy on this host: BPF run time per
//! event per program (run_time_ns / run_cnt, counted while a BPF_ENABLE_STATS
//! fd is held, like `sysctl kernel.bpf_stats_enabled=1`) and the agent's
//! decision → applied latency p50/p99, with two stand-in vCPU threads whose
//! "guest" toggles HARDIRQ every millisecond, optionally beside busy hogs.
//!
//! `cargo run --release -p pvsched-agent --example measure -- [seconds] [hogs] [novm]`
//! (`novm`: register nothing, to measure the cost of events of other threads)

use pvsched_abi::{CS_HARDIRQ, SlotGuest};
use pvsched_agent::{Agent, AgentConfig, RegionSpec, VmSpec, sched};
use pvsched_policy::Caps;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn main() {
    let mut args = std::env::args().skip(1);
    let secs: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let hogs: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let novm = args.next().as_deref() == Some("novm");
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("BPF_ENABLE_STATS");
    let agent = match Agent::load(AgentConfig::default()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut joins = Vec::new();
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..2 {
        let (s, tx) = (stop.clone(), tx.clone());
        joins.push(std::thread::spawn(move || {
            tx.send(sched::gettid()).unwrap();
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_micros(200));
            }
        }));
    }
    for _ in 0..hogs {
        let s = stop.clone();
        joins.push(std::thread::spawn(move || {
            let mut x = 0u64;
            while !s.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }));
    }
    let tids: Vec<u32> = (0..2).map(|_| rx.recv().unwrap()).collect();
    if novm {
        std::thread::sleep(Duration::from_secs(secs));
        for (name, cnt, ns) in agent.prog_stats() {
            let avg = ns.checked_div(cnt).unwrap_or(0);
            println!("{name:<26} {cnt:>8} {ns:>13} {avg:>10}");
        }
        stop.store(true, Ordering::Relaxed);
        for j in joins {
            let _ = j.join();
        }
        return;
    }
    let vm = agent
        .register_vm(VmSpec {
            owner: None,
            emulator_tids: vec![],
            vcpu_tids: tids.clone(),
            apic_ids: vec![0, 1],
            caps: Caps {
                max_boost_us: 0,
                budget_us: 0,
                ..Caps::default()
            },
            region: RegionSpec::DeviceMap,
        })
        .expect("register");
    let region = vm.region().unwrap();
    let t0 = Instant::now();
    let mut on = false;
    while t0.elapsed() < Duration::from_secs(secs) {
        on = !on;
        let g = SlotGuest {
            kern_cs: if on { CS_HARDIRQ } else { 0 },
            ..Default::default()
        };
        for i in 0..2 {
            region.write_guest(2, i, &g);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = vm.stats();
    println!("program                     run_cnt   run_time_ns   ns/event");
    for (name, cnt, ns) in agent.prog_stats() {
        let avg = ns.checked_div(cnt).unwrap_or(0);
        println!("{name:<26} {cnt:>8} {ns:>13} {avg:>10}");
    }
    println!(
        "decisions {} applied-latency samples {} p50 {} ns p99 {} ns dropped {}",
        st.decisions, st.apply_samples, st.apply_p50_ns, st.apply_p99_ns, st.dropped
    );
    for v in &st.vcpus {
        println!(
            "vcpu tid {} boosts {} applied {} throttles {} boosted_ns {}",
            v.tid,
            v.counters.boosts,
            v.counters.boosts_applied,
            v.counters.throttles,
            v.counters.boosted_ns
        );
    }
    stop.store(true, Ordering::Relaxed);
    drop(vm);
    for j in joins {
        let _ = j.join();
    }
}
