//! pvschedd end to end: the real daemon binary (real BPF on real
//! tracepoints) serving "VMM" processes — child processes that own real
//! threads, register them over the socket, map the region fd they get back
//! and write guest slots into it — with every outcome read back with
//! `sched_getattr`.

use crate::common;
use crate::support;

use common::{need_bpf, wait_for};
use pvsched_abi::{POLICY_FIFO, POLICY_NORMAL, SlotGuest};
use pvsched_agent::sched::{self, SchedAttr};
use pvsched_daemon::proto::{Region, Vcpu};
use pvsched_daemon::{Client, ClientError, ErrorKind, RegionMap, RegisterVm};
use pvsched_policy::Caps;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::time::{Duration, Instant};
use support::{Daemon, LIMIT, http_get};

/// A VMM stand-in: a child process (this test binary, running
/// `fake_vmm_child`) with `vcpus` real threads that registers them as VM
/// `name` and, on "boost", writes an RT 99 request into every slot.
struct FakeVmm {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    tids: Vec<u32>,
}

impl FakeVmm {
    fn start(socket: &Path, name: &str, vcpus: u32, caps: Option<&str>) -> FakeVmm {
        Self::start_with(socket, name, vcpus, caps, false)
    }

    /// `reserved`: register with the region reserved for `name`
    /// ([`Region::Reserved`]) instead of a new one.
    fn start_with(
        socket: &Path,
        name: &str,
        vcpus: u32,
        caps: Option<&str>,
        reserved: bool,
    ) -> FakeVmm {
        let mut cmd = pvsched_testkit::test_child(module_path!(), "fake_vmm_child");
        if reserved {
            cmd.env("FAKE_VMM_RESERVED", "1");
        }
        cmd.env("PVSCHED_FAKE_VMM", "1")
            .env("FAKE_VMM_SOCKET", socket)
            .env("FAKE_VMM_NAME", name)
            .env("FAKE_VMM_VCPUS", vcpus.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(c) = caps {
            cmd.env("FAKE_VMM_CAPS", c);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let line = read_line(&mut stdout, "REGISTERED");
        let tids = line
            .split_whitespace()
            .skip(1)
            .map(|t| t.parse().unwrap())
            .collect();
        FakeVmm {
            child,
            stdin,
            stdout,
            tids,
        }
    }

    /// Sends a command and returns its one-line answer.
    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        read_line(&mut self.stdout, "")
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for FakeVmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The text after "FAKE " of the next line that has it followed by
/// `prefix` (other lines are the test harness's own output).
fn read_line(r: &mut impl BufRead, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            panic!("the fake VMM ended before answering {prefix:?}");
        }
        // libtest may have printed "test fake_vmm_child ... " first.
        if let Some(at) = line.find("FAKE ")
            && line[at + 5..].starts_with(prefix)
        {
            return line[at + 5..].trim().to_string();
        }
    }
}

/// The child side of [`FakeVmm`]; does nothing in a normal test run.
#[test]
fn fake_vmm_child() {
    if std::env::var("PVSCHED_FAKE_VMM").as_deref() != Ok("1") {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap();
    let socket = PathBuf::from(var("FAKE_VMM_SOCKET"));
    let name = var("FAKE_VMM_NAME");
    let nr: u32 = var("FAKE_VMM_VCPUS").parse().unwrap();
    let caps = std::env::var("FAKE_VMM_CAPS")
        .ok()
        .map(|t| Caps::from_toml(&t).unwrap());
    let vcpus: Vec<common::FakeVcpu> = (0..nr)
        .map(|_| common::FakeVcpu::spawn(0, Duration::from_millis(1)))
        .collect();
    let mut client = Client::connect(&socket).unwrap();
    let reg = client
        .register(RegisterVm {
            name: name.clone(),
            vcpus: vcpus
                .iter()
                .enumerate()
                .map(|(i, v)| Vcpu {
                    tid: v.tid,
                    apic_id: i as u32,
                })
                .collect(),
            emulator_tids: vec![],
            region: if std::env::var("FAKE_VMM_RESERVED").is_ok() {
                Region::Reserved
            } else {
                Region::Device
            },
            caps,
            pid: None,
            detach: false,
        })
        .unwrap();
    let region = reg.region;
    let tids: Vec<String> = vcpus.iter().map(|v| v.tid.to_string()).collect();
    println!("FAKE REGISTERED {}", tids.join(" "));
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.unwrap();
        let mut words = line.split_whitespace();
        match words.next() {
            Some("boost") => {
                let region = region.as_ref().expect("boost needs Region::Device");
                support::ask_rt99(region, nr);
                println!("FAKE BOOSTING");
            }
            Some("register-foreign") => {
                // Name another process's thread as this VMM's own.
                let tid: u32 = words.next().unwrap().parse().unwrap();
                let r = Client::connect(&socket).unwrap().register(RegisterVm {
                    name: format!("{name}-stolen"),
                    vcpus: vec![Vcpu { tid, apic_id: 0 }],
                    emulator_tids: vec![],
                    region: Region::None,
                    caps: None,
                    pid: None,
                    detach: false,
                });
                match r {
                    Err(ClientError::Refused { kind, message }) => {
                        println!("FAKE REFUSED {kind} {message}")
                    }
                    Err(e) => println!("FAKE ERROR {e}"),
                    Ok(_) => println!("FAKE ACCEPTED"),
                }
            }
            _ => println!("FAKE UNKNOWN"),
        }
    }
    drop(client);
}

fn attr(tid: u32) -> Option<SchedAttr> {
    sched::get(tid).ok()
}

fn wait_attr(what: &str, tid: u32, f: impl Fn(&SchedAttr) -> bool) -> SchedAttr {
    wait_for(what, LIMIT, || attr(tid).filter(|a| f(a)))
}

const OPERATOR_MAX: &str = "[max]\nmax_rt_prio = 5\nnice_floor = -10\n";

/// Must show (a): one pvschedd, three VMMs with different caps (from a VM
/// file, from the client, the defaults), each VM's threads boosted within
/// its own caps only; a VMM naming another VMM's thread refused; a VM's
/// caps changed live (and a change above the operator maximum refused).
#[test]
fn three_vmms_each_within_its_own_caps() {
    if !need_bpf("three_vmms_each_within_its_own_caps") {
        return;
    }
    let d = Daemon::start("three", OPERATOR_MAX);
    d.vm_file("vm-a", "max_rt_prio = 2\n");
    let mut a = FakeVmm::start(&d.socket, "vm-a", 2, Some("max_rt_prio = 5\n"));
    let mut b = FakeVmm::start(&d.socket, "vm-b", 2, Some("max_rt_prio = 3\n"));
    let mut c = FakeVmm::start(
        &d.socket,
        "vm-c",
        2,
        Some("allow_rt = false\nnice_floor = -5\n"),
    );
    for v in [&mut a, &mut b, &mut c] {
        assert_eq!(v.ask("boost"), "BOOSTING");
    }
    // Each VM reaches its own cap (the VM file's for vm-a, the caps its
    // VMM sent for vm-b, no RT for vm-c) ...
    for &t in &a.tids {
        wait_attr("vm-a at FIFO 2 (its file's cap)", t, |x| {
            x.policy == POLICY_FIFO && x.priority == 2
        });
    }
    for &t in &b.tids {
        wait_attr("vm-b at FIFO 3 (its VMM's caps)", t, |x| {
            x.policy == POLICY_FIFO && x.priority == 3
        });
    }
    for &t in &c.tids {
        wait_attr("vm-c at nice -5 (no RT)", t, |x| {
            x.policy == POLICY_NORMAL && x.nice == -5
        });
    }
    // ... and never goes beyond it: 300 samples over ~300 ms.
    for _ in 0..300 {
        for (tids, max_prio, rt) in [(&a.tids, 2, true), (&b.tids, 3, true), (&c.tids, 0, false)] {
            for &t in tids {
                let x = attr(t).unwrap();
                if rt {
                    assert!(x.priority <= max_prio, "{t}: {x:?} above FIFO {max_prio}");
                } else {
                    assert_eq!(x.policy, POLICY_NORMAL, "{t}: RT in a no-RT VM");
                    assert!(x.nice >= -5, "{t}: {x:?} below nice_floor -5");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut admin = d.client();
    let (daemon, vms) = admin.status().unwrap();
    assert_eq!(vms.len(), 3);
    assert_eq!(daemon.registrations, 3);
    let src: BTreeMap<_, _> = vms
        .iter()
        .map(|v| (v.name.as_str(), v.caps_source.as_str()))
        .collect();
    assert_eq!(src["vm-a"], "file");
    assert_eq!(src["vm-b"], "client");

    // A VMM naming another VMM's thread is refused, and nothing changes.
    let answer = b.ask(&format!("register-foreign {}", a.tids[0]));
    assert!(answer.starts_with("REFUSED denied"), "{answer}");
    assert_eq!(admin.status().unwrap().1.len(), 3);

    // Caps changed live: vm-b down to FIFO 1 without restarting anything.
    let new = admin
        .set("vm-b", BTreeMap::from([("max_rt_prio".into(), "1".into())]))
        .unwrap();
    assert_eq!(new.max_rt_prio, 1);
    for &t in &b.tids {
        wait_attr("vm-b at FIFO 1 after `set`", t, |x| {
            x.policy == POLICY_FIFO && x.priority == 1
        });
    }
    // Above the operator maximum: refused, nothing changed.
    match admin.set("vm-b", BTreeMap::from([("max_rt_prio".into(), "6".into())])) {
        Err(ClientError::Refused { kind, message }) => {
            assert_eq!(kind, ErrorKind::Caps, "{message}");
            assert!(message.contains("operator maximum"), "{message}");
        }
        other => panic!(
            "max_rt_prio above the maximum accepted: {:?}",
            other.map(|_| ())
        ),
    }
    // vm-b stays within its new cap; vm-a, untouched by vm-b's change,
    // still reaches its own.
    for _ in 0..200 {
        for &t in &b.tids {
            let x = attr(t).unwrap();
            assert!(x.priority <= 1, "{t}: {x:?} above vm-b's new cap");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    wait_attr("vm-a still at FIFO 2", a.tids[0], |x| x.priority == 2);
    // Unregistering restores the exact baseline.
    admin.unregister("vm-a").unwrap();
    for &t in &a.tids {
        let back = wait_attr("vm-a restored", t, |x| x.policy == POLICY_NORMAL);
        assert_eq!(
            back,
            SchedAttr {
                policy: POLICY_NORMAL,
                priority: 0,
                nice: 0,
                flags: 0,
                slice_ns: 0,
            }
        );
    }
    drop((a, b, c));
}

/// Bad input gets a clear error and changes nothing.
#[test]
fn bad_registrations_are_refused_and_change_nothing() {
    if !need_bpf("bad_registrations_are_refused_and_change_nothing") {
        return;
    }
    let d = Daemon::start("bad", OPERATOR_MAX);
    let me = sched::gettid();
    let reg = |name: &str, tid: u32, caps: Option<Caps>| RegisterVm {
        name: name.into(),
        vcpus: vec![Vcpu { tid, apic_id: 0 }],
        emulator_tids: vec![],
        region: Region::None,
        caps,
        pid: None,
        detach: false,
    };
    let refused = |r: Result<pvsched_daemon::Registered, ClientError>| match r {
        Err(ClientError::Refused { kind, .. }) => kind,
        Ok(_) => panic!("accepted"),
        Err(e) => panic!("{e}"),
    };
    let mut c = d.client();
    // Caps above the operator maximum.
    let hot = Caps {
        max_rt_prio: 9,
        ..Caps::default()
    };
    assert_eq!(
        refused(c.register(reg("hot", me, Some(hot)))),
        ErrorKind::Caps
    );
    // Co-scheduling at FIFO 75 % of the time in 750 ms runs: above the
    // default [max] max_cosched_period_us, refused naming the key.
    let long_phases = Caps {
        cosched_us: pvsched_policy::CoschedUs::Us(750_000),
        cosched_period_us: 1_000_000,
        ..Caps::default()
    };
    match c.register(reg("long-phases", me, Some(long_phases))) {
        Err(ClientError::Refused { kind, message }) => {
            assert_eq!(kind, ErrorKind::Caps, "{message}");
            assert!(message.contains("cosched_period_us"), "{message}");
        }
        other => panic!("long phases accepted: {:?}", other.map(|_| ())),
    }
    // A thread that is not ours (pid 1's).
    assert_eq!(refused(c.register(reg("init", 1, None))), ErrorKind::Denied);
    // Registered once; the same name or thread again is refused.
    c.register(reg("ok", me, None)).unwrap();
    let mut c2 = d.client();
    assert_eq!(refused(c2.register(reg("ok", me, None))), ErrorKind::Exists);
    assert_eq!(
        refused(c2.register(reg("ok2", me, None))),
        ErrorKind::Invalid
    );
    // Nor can a registered VM be set to them, or to a phase within the
    // period limit but longer than [max] max_cosched_phase_us (20 ms).
    for (settings, key) in [
        (
            [("cosched_us", "750000"), ("cosched_period_us", "1000000")],
            "cosched_period_us",
        ),
        (
            [("cosched_us", "50000"), ("cosched_period_us", "100000")],
            "cosched_us",
        ),
    ] {
        let settings = settings.map(|(k, v)| (k.to_string(), v.to_string()));
        match c2.set("ok", BTreeMap::from(settings)) {
            Err(ClientError::Refused { kind, message }) => {
                assert_eq!(kind, ErrorKind::Caps, "{message}");
                assert!(message.contains(key), "{key}: {message}");
            }
            other => panic!("{key}: accepted: {:?}", other.map(|_| ())),
        }
    }
    // Unknown VM names.
    assert!(matches!(
        c2.set("nope", BTreeMap::from([("max_rt_prio".into(), "1".into())])),
        Err(ClientError::Refused {
            kind: ErrorKind::UnknownVm,
            ..
        })
    ));
    // Raw malformed and oversized messages on the socket.
    let raw = pvsched_daemon::wire::connect_to(&d.socket).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for msg in [
        b"{not json".to_vec(),
        vec![b'x'; pvsched_daemon::proto::MAX_REQUEST + 10],
        br#"{"op":"register"}"#.to_vec(),
    ] {
        use std::os::fd::AsFd;
        pvsched_daemon::wire::send(raw.as_fd(), &msg, None).unwrap();
        let got = pvsched_daemon::wire::recv(raw.as_fd(), &mut buf).unwrap();
        let text = String::from_utf8_lossy(&buf[..got.len]).into_owned();
        assert!(text.contains("\"error\""), "{text}");
        assert!(text.contains("malformed"), "{text}");
    }
    let (daemon, vms) = c2.status().unwrap();
    assert_eq!(vms.len(), 1, "only `ok` registered");
    assert!(daemon.refused >= 8, "{daemon:?}");
    // The VM of a closed connection is unregistered.
    drop(c);
    wait_for("`ok` gone with its connection", LIMIT, || {
        d.client().status().ok().filter(|(_, v)| v.is_empty())
    });
}

/// A client that connects and never speaks is closed after the timeout;
/// 1,000 clients at once are served or refused, and the daemon stays up.
#[test]
fn silent_and_many_clients() {
    if !need_bpf("silent_and_many_clients") {
        return;
    }
    // 1,000 sockets in this process: more than the usual soft limit.
    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    let d = Daemon::start("many", "client_timeout_ms = 300\n");
    let silent = pvsched_daemon::wire::connect_to(&d.socket).unwrap();
    let mut buf = vec![0u8; 4096];
    use std::os::fd::AsFd;
    let got = pvsched_daemon::wire::recv(silent.as_fd(), &mut buf).unwrap();
    let text = String::from_utf8_lossy(&buf[..got.len]).into_owned();
    assert!(text.contains("timeout"), "{text}");
    // 1,030 clients at once: the first 1,024 (max_clients) are served, the
    // rest refused ("busy", or a reset if they spoke before the close).
    let conns: Vec<_> = (0..1030)
        .map(|_| pvsched_daemon::wire::connect_to(&d.socket).unwrap())
        .collect();
    let (mut served, mut refused) = (0, 0);
    for c in &conns {
        let _ = pvsched_daemon::wire::send(c.as_fd(), br#"{"op":"status"}"#, None);
    }
    for c in &conns {
        match pvsched_daemon::wire::recv(c.as_fd(), &mut buf) {
            Ok(got) => {
                let t = String::from_utf8_lossy(&buf[..got.len]).into_owned();
                if t.contains("\"status\"") {
                    served += 1;
                } else if t.contains("busy") || got.len == 0 {
                    refused += 1;
                } else {
                    panic!("unexpected reply: {t}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    println!("1030 clients at once: {served} served, {refused} refused");
    assert_eq!((served, refused), (1024, 6));
    drop(conns);
    d.client().status().unwrap();
}

/// The Prometheus exposition, over HTTP, parsed by a Prometheus text
/// parser, with the values of a boosted VM.
#[test]
fn prometheus_scrape_parses() {
    if !need_bpf("prometheus_scrape_parses") {
        return;
    }
    let token = "prometheus-scrapes-with-this-token";
    let token_file = std::env::temp_dir().join(format!("pvschedd-token-{}", std::process::id()));
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let d = Daemon::start(
        "prom",
        &format!("metrics_token_file = {token_file:?}\n{OPERATOR_MAX}"),
    );
    let mut v = FakeVmm::start(&d.socket, "web-1", 2, None);
    assert_eq!(v.ask("boost"), "BOOSTING");
    for &t in &v.tids {
        wait_attr("boosted", t, |x| x.policy == POLICY_FIFO);
    }
    let text = wait_for("a scrape with applied boosts", LIMIT, || {
        let t = http_get(&d.metrics, "/metrics", Some(token))?;
        let applied = t.lines().any(|l| {
            l.starts_with("pvsched_boosts_applied_total{vm=\"web-1\",thread=\"vcpu1\"}")
                && !l.ends_with(" 0")
        });
        applied.then_some(t)
    });
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the exposition parses");
    let get = |name: &str, thread: &str| {
        scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == name
                    && s.labels.get("vm") == Some("web-1")
                    && s.labels.get("thread") == Some(thread)
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(x)
                | prometheus_parse::Value::Gauge(x)
                | prometheus_parse::Value::Untyped(x) => x,
                _ => f64::NAN,
            })
    };
    for th in ["vcpu0", "vcpu1"] {
        assert!(get("pvsched_boosts_applied_total", th).unwrap() >= 1.0);
        assert_eq!(get("pvsched_boosted", th), Some(1.0));
    }
    assert!(scrape.docs.contains_key("pvsched_boosts_total"));
    let vms = scrape
        .samples
        .iter()
        .find(|s| s.metric == "pvsched_vms")
        .unwrap();
    assert!(matches!(vms.value, prometheus_parse::Value::Gauge(x) if x == 1.0));
    // The same text over the socket.
    assert!(
        d.client()
            .metrics()
            .unwrap()
            .contains("pvsched_vcpus{vm=\"web-1\"} 2")
    );
    // Without the token: refused; with a wrong one too.
    assert_eq!(http_get(&d.metrics, "/metrics", None), None);
    assert_eq!(
        http_get(&d.metrics, "/metrics", Some("wrong-token-wrong-token")),
        None
    );
    drop(v);
    // The VMM is gone: its registration ended (its exit or its closed
    // connection, whichever pvschedd saw first), and the count says so.
    let ended = |t: &str| -> f64 {
        ["vmm_exited", "connection_closed"]
            .iter()
            .filter_map(|r| {
                let l = format!("pvsched_unregistrations_total{{reason=\"{r}\"}} ");
                t.lines()
                    .find_map(|x| x.strip_prefix(l.as_str())?.parse::<f64>().ok())
            })
            .sum()
    };
    pvsched_testkit::wait_for(
        "the unregistration counted",
        Duration::from_secs(10),
        || {
            let t = http_get(&d.metrics, "/metrics", Some(token))?;
            (ended(&t) == 1.0 && t.contains("pvsched_vms 0")).then_some(())
        },
    );
    let _ = std::fs::remove_file(&token_file);
}

/// Must show (b): pvschedd killed with SIGKILL at random moments while
/// threads are boosted, 20 times, then 5 times with SIGABRT (how a panic
/// ends it: its panic hook aborts): every thread back at its exact baseline
/// (its guardian restores them). The worst restore time is printed, not
/// asserted: a test checks outcomes, timing goals belong to benchmarks.
#[test]
fn sigkill_of_the_daemon_restores_every_thread() {
    if !need_bpf("sigkill_of_the_daemon_restores_every_thread") {
        return;
    }
    use nix::sys::signal::Signal;
    let mut worst = [Duration::ZERO; 2];
    let mut rng = 0x9e37_79b9_u32;
    for round in 0..25 {
        let (sig, which) = if round < 20 {
            (Signal::SIGKILL, 0)
        } else {
            (Signal::SIGABRT, 1)
        };
        let mut d = Daemon::start(&format!("kill{round}"), OPERATOR_MAX);
        let mut v = FakeVmm::start(&d.socket, "victim", 2, None);
        let baseline: Vec<SchedAttr> = v.tids.iter().map(|&t| attr(t).unwrap()).collect();
        assert_eq!(v.ask("boost"), "BOOSTING");
        for &t in &v.tids {
            wait_attr("boosted", t, |x| x.policy == POLICY_FIFO);
        }
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        std::thread::sleep(Duration::from_millis(u64::from(rng % 50)));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(d.pid() as i32), sig).unwrap();
        let t0 = Instant::now();
        let _ = d.child.wait();
        for (i, &t) in v.tids.iter().enumerate() {
            wait_for("baseline after the kill", LIMIT, || {
                (attr(t).as_ref() == Some(&baseline[i])).then_some(())
            });
        }
        worst[which] = worst[which].max(t0.elapsed());
        drop(v);
        drop(d);
    }
    println!(
        "pvschedd killed: SIGKILL x20 worst restore {:?}, SIGABRT x5 worst restore {:?}",
        worst[0], worst[1]
    );
}

/// Must show (b): a VMM killed with SIGKILL: its VM is unregistered (the
/// daemon sees its pidfd), the other VMs keep their boosts.
#[test]
fn sigkill_of_a_vmm_unregisters_only_its_vm() {
    if !need_bpf("sigkill_of_a_vmm_unregisters_only_its_vm") {
        return;
    }
    let d = Daemon::start("vmmkill", OPERATOR_MAX);
    let mut keep = FakeVmm::start(&d.socket, "keep", 1, None);
    assert_eq!(keep.ask("boost"), "BOOSTING");
    wait_attr("keep boosted", keep.tids[0], |x| x.policy == POLICY_FIFO);
    let mut worst = Duration::ZERO;
    for round in 0..20 {
        let mut v = FakeVmm::start(&d.socket, &format!("gone{round}"), 2, None);
        assert_eq!(v.ask("boost"), "BOOSTING");
        for &t in &v.tids {
            wait_attr("boosted", t, |x| x.policy == POLICY_FIFO);
        }
        let pid = v.pid();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let t0 = Instant::now();
        let _ = v.child.wait();
        let mut admin = d.client();
        wait_for("the killed VMM's VM unregistered", LIMIT, || {
            admin
                .status()
                .ok()
                .filter(|(_, vms)| vms.iter().all(|x| x.pid != pid))
        });
        worst = worst.max(t0.elapsed());
        assert_eq!(
            attr(keep.tids[0]).unwrap().policy,
            POLICY_FIFO,
            "another VM's boost is untouched"
        );
    }
    // Reported, not asserted: a test checks outcomes, timing goals belong
    // to benchmarks.
    println!("SIGKILL of a VMM x20: worst unregistration {worst:?}");
}

/// A device region reserved before the VMM exists (QEMU + `pvsched device
/// --daemon-region`): the guest's requests written into it before the
/// registration are the VM's slots once its threads register with
/// `Region::Reserved` (nothing cleared), a second reservation returns the
/// same bytes, and without a reservation `Region::Reserved` is refused.
#[test]
fn a_reserved_region_becomes_the_vms_region_without_losing_a_byte() {
    if !need_bpf("a_reserved_region_becomes_the_vms_region_without_losing_a_byte") {
        return;
    }
    if !nix::unistd::geteuid().is_root()
        && !pvsched_testkit::skip_or_fail(
            "a_reserved_region_becomes_the_vms_region_without_losing_a_byte",
            "reserving a region is root only",
        )
    {
        return;
    }
    let d = Daemon::start("reserve", OPERATOR_MAX);
    let mut admin = d.client();
    // No reservation: refused, clearly.
    match FakeVmm::try_reserved_without_reservation(&d.socket) {
        Err(ClientError::Refused { kind, message }) => {
            assert_eq!(kind, ErrorKind::Invalid, "{message}");
            assert!(message.contains("--daemon-region"), "{message}");
        }
        other => panic!("Region::Reserved without a reservation: {other:?}"),
    }
    let (fd, len) = admin.reserve("vm-r").unwrap();
    let first = RegionMap::new(fd, len).unwrap();
    // The "guest" asks for FIFO 99 on both vCPUs before the VMM registers.
    let nr = 2;
    for i in 0..nr {
        assert!(first.write_guest(
            nr,
            i,
            &SlotGuest {
                policy: POLICY_FIFO,
                rt_prio: 99,
                ..Default::default()
            },
        ));
    }
    // Asked again (a restarted device process): the same bytes.
    let (fd2, len2) = admin.reserve("vm-r").unwrap();
    assert_eq!(len2, len);
    let second = RegionMap::new(fd2, len2).unwrap();
    // SAFETY: both mappings are `len` bytes, live for this scope.
    let same = unsafe {
        std::slice::from_raw_parts(first.as_ptr(), len as usize)
            == std::slice::from_raw_parts(second.as_ptr(), len as usize)
    };
    assert!(same, "a second reservation returned other bytes");
    // The VMM registers its threads with the reserved region: the policy
    // reads the requests written before, and boosts within the caps.
    let v = FakeVmm::start_with(&d.socket, "vm-r", nr, Some("max_rt_prio = 3\n"), true);
    for &t in &v.tids {
        wait_attr(
            "vm-r at FIFO 3 from the slots written before it registered",
            t,
            |x| x.policy == POLICY_FIFO && x.priority == 3,
        );
    }
    let (_, vms) = admin.status().unwrap();
    assert_eq!(vms[0].region, "device");
    // The region is the registered VM's now: reserving again returns it.
    let (fd3, len3) = admin.reserve("vm-r").unwrap();
    let third = RegionMap::new(fd3, len3).unwrap();
    // (The same memory: what one mapping writes the other reads. The host
    // halves cannot be compared by value, as the policy keeps writing them.)
    let mark = SlotGuest {
        policy: POLICY_FIFO,
        rt_prio: 2,
        ..Default::default()
    };
    assert!(third.write_guest(nr, 0, &mark));
    let seen = pvsched_abi::seq::read_guest(&first.words(), nr, 0).unwrap();
    assert_eq!((seen.policy, seen.rt_prio), (POLICY_FIFO, 2));
    assert_ne!(seen.seq, 0, "written with the seq protocol");
    // Gone with its VM: restored, and a new reservation is a new region.
    admin.unregister("vm-r").unwrap();
    for &t in &v.tids {
        wait_attr("vm-r restored", t, |x| x.policy == POLICY_NORMAL);
    }
    drop(v);
    let (fd4, len4) = admin.reserve("vm-r").unwrap();
    let fresh = RegionMap::new(fd4, len4).unwrap();
    // SAFETY: `len4` bytes mapped, live for this scope.
    let zero = unsafe { std::slice::from_raw_parts(fresh.as_ptr(), len4 as usize) }
        .iter()
        .all(|&b| b == 0);
    assert!(
        zero,
        "a new reservation after the VM went is not a fresh region"
    );
    // Unregistering a reservation drops it.
    admin.unregister("vm-r").unwrap();
    assert!(matches!(
        admin.unregister("vm-r"),
        Err(ClientError::Refused { .. })
    ));
}

impl FakeVmm {
    /// Registers this test process's own thread as `vm-none` with
    /// `Region::Reserved`, which no reservation backs.
    fn try_reserved_without_reservation(socket: &Path) -> Result<(), ClientError> {
        Client::connect(socket)?
            .register(RegisterVm {
                name: "vm-none".into(),
                vcpus: vec![Vcpu {
                    tid: sched::gettid(),
                    apic_id: 0,
                }],
                emulator_tids: vec![],
                region: Region::Reserved,
                caps: None,
                pid: None,
                detach: false,
            })
            .map(|_| ())
    }
}
