//! Local users against pvschedd's metrics endpoint: the "user" is a child
//! process running as `nobody` (uid 65534), which holds the endpoint's
//! port before pvschedd starts, or floods it with idle connections. A
//! root scraper (another uid, as Prometheus is) must still be answered,
//! and pvschedd must stay up.

use crate::hostile::{NOGROUP, need_root_and_nobody, nobody_child};
use crate::support;

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};
use support::{Daemon, LIMIT, http_get};

/// The nuisance, a child running as nobody until its stdin closes.
struct Nuisance(Child);

impl Nuisance {
    /// `mode` "bind": holds a listener on `addr`; "idle N": keeps N idle
    /// connections to `addr` open, opening a new one for each closed.
    fn start(mode: &str, addr: &str) -> Nuisance {
        let mut child = nobody_child(module_path!(), "nuisance_child")
            .env("PVSCHED_NUISANCE", mode)
            .env("NUISANCE_ADDR", addr)
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "the nuisance ended");
            if line.contains("NUISANCE READY") {
                break;
            }
        }
        Nuisance(child)
    }
}

impl Drop for Nuisance {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The child side of [`Nuisance`]; does nothing in a normal test run.
#[test]
fn nuisance_child() {
    let Ok(mode) = std::env::var("PVSCHED_NUISANCE") else {
        return;
    };
    let addr = std::env::var("NUISANCE_ADDR").unwrap();
    // Ends when the test closes our stdin.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::stdin().lock().read_line(&mut String::new());
        s2.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let stopped = || stop.load(std::sync::atomic::Ordering::Relaxed);
    if mode == "bind" {
        let _l = TcpListener::bind(&addr).unwrap();
        println!("NUISANCE READY");
        while !stopped() {
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    let n: usize = mode.strip_prefix("idle ").unwrap().parse().unwrap();
    let mut conns: Vec<TcpStream> = Vec::new();
    let mut ready = false;
    while !stopped() {
        // Drop the ones the server closed (a read of 0), open new ones.
        conns.retain(|c| {
            let mut b = [0u8; 1];
            c.set_nonblocking(true).unwrap();
            !matches!(c.peek(&mut b), Ok(0))
        });
        while conns.len() < n {
            match TcpStream::connect(&addr) {
                Ok(c) => conns.push(c),
                Err(_) => break,
            }
        }
        if !ready {
            println!("NUISANCE READY");
            ready = true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A free port on localhost.
fn free_addr() -> String {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// A local user that binds `metrics_listen`'s port first does not keep
/// pvschedd down: it starts, serves its socket, says in status why its
/// endpoint is down, and once the port is free binds it and answers.
#[test]
fn a_taken_metrics_port_does_not_stop_pvschedd() {
    let test = "a_taken_metrics_port_does_not_stop_pvschedd";
    if !need_root_and_nobody(test) {
        return;
    }
    let addr = free_addr();
    let holder = Nuisance::start("bind", &addr);
    let mut d = Daemon::start_on("metrics-taken", NOGROUP, "", &addr);
    let (daemon, _) = d.client().status().expect("pvschedd serves its socket");
    assert!(
        daemon.metrics.contains(&addr) && daemon.metrics.contains("binding again"),
        "{}",
        daemon.metrics
    );
    // Longer than the unit's restart interval: it is still up.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(d.child.try_wait().unwrap().is_none(), "pvschedd exited");
    assert!(http_get(&addr, "/metrics", None).is_none());
    drop(holder);
    let body = pvsched_testkit::wait_for("the endpoint bound once the port is free", LIMIT, || {
        http_get(&addr, "/metrics", None)
    });
    assert!(body.contains("pvsched_vms 0"), "{body}");
    let (daemon, _) = d.client().status().unwrap();
    assert_eq!(daemon.metrics, format!("listening on {addr}"));
}

/// A local user that keeps 200 idle connections to the endpoint open
/// (opening a new one for each closed) does not starve the scrapers: 20
/// scrapes in a row by another uid are all answered.
#[test]
fn idle_connections_of_one_user_do_not_starve_scrapes() {
    let test = "idle_connections_of_one_user_do_not_starve_scrapes";
    if !need_root_and_nobody(test) {
        return;
    }
    let d = Daemon::start_for("metrics-flood", NOGROUP, "");
    pvsched_testkit::wait_for("the endpoint", LIMIT, || {
        http_get(&d.metrics, "/metrics", None)
    });
    let _flood = Nuisance::start("idle 200", &d.metrics);
    let t0 = Instant::now();
    let answered = (0..20)
        .filter(|_| {
            std::thread::sleep(Duration::from_millis(100));
            http_get(&d.metrics, "/metrics", None).is_some()
        })
        .count();
    println!(
        "{answered} of 20 scrapes answered beside the flood in {:?}",
        t0.elapsed()
    );
    assert_eq!(answered, 20);
}
