//! Hostile VMMs against a real pvschedd: the "VMM" is a child process
//! running as `nobody` (uid 65534, group `nogroup`, the socket's group),
//! driven line by line from this test, which runs as root and owns
//! bystander threads. Whatever the VMM asks, nothing outside its own
//! threads may change and its own threads stay within the operator's
//! maximum; every outcome is read back with `sched_getattr`.

use crate::common;
use crate::support;

use common::{FakeVcpu, need_bpf, wait_for};
use pvsched_abi::{POLICY_FIFO, POLICY_IDLE, POLICY_NORMAL, SlotGuest};
use pvsched_agent::sched::{self, SchedAttr};
use pvsched_daemon::proto::{Region, Vcpu};
use pvsched_daemon::{Client, ClientError, ErrorKind, RegionMap, RegisterVm};
use pvsched_policy::Caps;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use support::{Daemon, LIMIT};

pub(crate) const NOBODY: u32 = 65534;
pub(crate) const NOGROUP: &str = "nogroup";

/// The operator maximum of these tests: every `[max]` key set.
const MAX: &str = "[max]\nallow_rt = true\nmax_rt_prio = 5\nnice_floor = -10\n\
max_boost_us = 20000\nmax_budget_pct = 50\nhalt_always = false\nmin_throttle_us = 10000\n\
max_window_us = 1000000\nmax_halt_hold_us = 1000000\nmax_ipi_window_us = 50000\n\
max_cosched_period_us = 100000\nmax_cosched_phase_us = 20000\n";

/// Caps exactly at every limit of [`MAX`].
const AT_MAX: &str = "max_rt_prio = 5; cs_rt_prio = 5; halt_prio = 5; yield_prio = 5; \
nice_floor = -10; max_boost_us = 20000; budget_us = 500000; window_us = 1000000; \
throttle_us = 10000; halt_hold_us = 1000000; ipi_window_us = 50000; \
cosched_period_us = 100000; cosched_us = 20000";

/// One step beyond each limit of [`MAX`] (or out of range), and the key
/// the refusal must name.
const BEYOND_MAX: [(&str, &str); 17] = [
    ("max_rt_prio = 6", "max_rt_prio"),
    ("cs_rt_prio = 6", "cs_rt_prio"),
    ("halt_prio = 6", "halt_prio"),
    ("yield_prio = 6", "yield_prio"),
    ("nice_floor = -11", "nice_floor"),
    ("max_boost_us = 0", "max_boost_us"),
    ("max_boost_us = 20001", "max_boost_us"),
    ("budget_us = 500001", "budget_us"),
    ("halt_always = true", "halt_always"),
    ("throttle_us = 9999", "throttle_us"),
    ("window_us = 1000001; budget_us = 500000", "window_us"),
    ("halt_hold_us = 1000001", "halt_hold_us"),
    ("ipi_window_us = 50001", "ipi_window_us"),
    ("halt_prio = 200", "halt_prio"),
    // Co-scheduling is a FIFO run like a boost: its period and phase are
    // bounded too (the review's 750 ms in every second first).
    (
        "cosched_period_us = 1000000; cosched_us = 750000",
        "cosched_period_us",
    ),
    ("cosched_period_us = 100001", "cosched_period_us"),
    (
        "cosched_period_us = 100000; cosched_us = 20001",
        "cosched_us",
    ),
];

/// Whether the unprivileged child can run here: root (to switch uid) and
/// the `nogroup` group.
pub(crate) fn need_root_and_nobody(test: &str) -> bool {
    if !need_bpf(test) {
        return false;
    }
    if nix::unistd::Group::from_name(NOGROUP)
        .ok()
        .flatten()
        .is_none()
    {
        return pvsched_testkit::skip_or_fail(test, "group nogroup missing");
    }
    true
}

/// Test `name` of `module` in a child of this test binary running as
/// nobody (group nogroup), its stdin and stdout piped to this test.
pub(crate) fn nobody_child(module: &str, name: &str) -> Command {
    let gid = nix::unistd::Group::from_name(NOGROUP)
        .unwrap()
        .unwrap()
        .gid
        .as_raw();
    let mut cmd = pvsched_testkit::test_child(module, name);
    cmd.uid(NOBODY)
        .gid(gid)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    cmd
}

/// The hostile VMM, a child process running as nobody.
struct HostileVmm {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl HostileVmm {
    fn start(socket: &Path) -> HostileVmm {
        let mut child = nobody_child(module_path!(), "hostile_vmm_child")
            .env("PVSCHED_HOSTILE_VMM", "1")
            .env("HOSTILE_SOCKET", socket)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut v = HostileVmm {
            child,
            stdin,
            stdout,
        };
        assert_eq!(v.read(), "READY");
        v
    }

    fn read(&mut self) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(
                self.stdout.read_line(&mut line).unwrap() > 0,
                "the hostile VMM ended"
            );
            if let Some(at) = line.find("HOSTILE ") {
                return line[at + 8..].trim().to_string();
            }
        }
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        self.read()
    }

    /// Starts `n` threads; their TIDs.
    fn threads(&mut self, n: usize) -> Vec<u32> {
        let a = self.ask(&format!("threads {n}"));
        a.strip_prefix("TIDS ")
            .unwrap_or_else(|| panic!("{a}"))
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for HostileVmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A thread of the hostile VMM: sleeps in a loop (a vCPU that halts) and
/// calls execve when told to.
struct ChildThread {
    tid: u32,
    exec: Arc<AtomicBool>,
}

fn spawn_child_thread() -> ChildThread {
    let exec = Arc::new(AtomicBool::new(false));
    let e2 = exec.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tx.send(sched::gettid()).unwrap();
        loop {
            if e2.load(Ordering::Relaxed) {
                let err = Command::new("sleep").arg("120").exec();
                panic!("exec failed: {err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    ChildThread {
        tid: rx.recv().unwrap(),
        exec,
    }
}

fn caps_text(spec: &str) -> String {
    spec.split(';')
        .map(|kv| format!("{}\n", kv.trim()))
        .collect()
}

/// The child side of [`HostileVmm`]; does nothing in a normal test run.
/// Commands (one per line): `threads N`, `register NAME IDX,IDX.. CAPS|-`
/// (caps as `k = v; k = v`), `boost NAME`, `peek NAME` (vCPU 0's guest
/// half in its region), `hold` (fork a process that keeps this one's
/// connection open), `exec IDX` (that thread calls execve), `foreign NAME
/// TID` (register another process's thread), `flood VMS PER_VM REQUESTS`
/// (VM-holding connections asking status and never reading the replies).
#[test]
fn hostile_vmm_child() {
    if std::env::var("PVSCHED_HOSTILE_VMM").as_deref() != Ok("1") {
        return;
    }
    let socket = std::path::PathBuf::from(std::env::var("HOSTILE_SOCKET").unwrap());
    let mut client = Client::connect(&socket).unwrap();
    let mut threads: Vec<ChildThread> = Vec::new();
    let mut regions = BTreeMap::new();
    let mut extra: Vec<Client> = Vec::new();
    let mut held_fds: Vec<std::os::fd::OwnedFd> = Vec::new();
    println!("HOSTILE READY");
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let (cmd, rest) = line.split_once(' ').unwrap_or((&line, ""));
        match cmd {
            "threads" => {
                let n: usize = rest.parse().unwrap();
                let new: Vec<ChildThread> = (0..n).map(|_| spawn_child_thread()).collect();
                let tids: Vec<String> = new.iter().map(|t| t.tid.to_string()).collect();
                threads.extend(new);
                println!("HOSTILE TIDS {}", tids.join(" "));
            }
            "register" | "foreign" => {
                let mut w = rest.splitn(3, ' ');
                let name = w.next().unwrap().to_string();
                let tids: Vec<u32> = if cmd == "foreign" {
                    vec![w.next().unwrap().parse().unwrap()]
                } else {
                    w.next()
                        .unwrap()
                        .split(',')
                        .map(|i| threads[i.parse::<usize>().unwrap()].tid)
                        .collect()
                };
                let caps = match w.next() {
                    None | Some("-") => None,
                    Some(c) => match Caps::from_toml(&caps_text(c)) {
                        Ok(c) => Some(c),
                        // Out-of-range values never parse here; send them
                        // as the daemon would get them from a raw client.
                        Err(_) => Some(raw_caps(&caps_text(c))),
                    },
                };
                let r = client.register(RegisterVm {
                    name: name.clone(),
                    vcpus: support::vcpus(tids.iter().copied()),
                    emulator_tids: vec![],
                    region: Region::Device,
                    caps,
                    pid: None,
                    detach: false,
                });
                match r {
                    Ok(reg) => {
                        regions.insert(name, (reg.region, tids.len() as u32));
                        println!("HOSTILE OK");
                    }
                    Err(ClientError::Refused { kind, message }) => {
                        println!("HOSTILE REFUSED {kind}: {message}")
                    }
                    Err(e) => println!("HOSTILE ERROR {e}"),
                }
            }
            "boost" => {
                let (region, nr) = &regions[rest];
                for i in 0..*nr {
                    region.as_ref().unwrap().write_guest(
                        *nr,
                        i,
                        &SlotGuest {
                            policy: POLICY_FIFO,
                            rt_prio: 99,
                            ..Default::default()
                        },
                    );
                }
                println!("HOSTILE BOOSTING");
            }
            "hold" => {
                // SAFETY: the forked child only calls pause/_exit (it is a
                // copy of a multi-threaded process: nothing that allocates
                // or locks) and keeps every inherited fd, the connection
                // to pvschedd among them, open while it waits.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: as above.
                    unsafe {
                        libc::pause();
                        libc::_exit(0);
                    }
                }
                println!("HOSTILE HOLDER {pid}");
            }
            "conns" => {
                // Open N more connections; each asks for status.
                let n: usize = rest.parse().unwrap();
                let (mut ok, mut busy) = (0, 0);
                let mut held = Vec::new();
                for _ in 0..n {
                    let Ok(mut c) = Client::connect(&socket) else {
                        busy += 1;
                        continue;
                    };
                    match c.status() {
                        Ok(_) => {
                            ok += 1;
                            held.push(c);
                        }
                        Err(ClientError::Refused {
                            kind: ErrorKind::Busy,
                            ..
                        }) => busy += 1,
                        Err(_) => busy += 1,
                    }
                }
                println!("HOSTILE CONNS ok={ok} busy={busy}");
                extra.extend(held);
            }
            "status" => match client.status() {
                Ok((_, vms)) => {
                    let threads: usize = vms.iter().map(|v| v.vcpus.len()).sum();
                    println!("HOSTILE STATUS vms={} threads={threads}", vms.len())
                }
                Err(e) => println!("HOSTILE ERROR {e}"),
            },
            "metrics" => match client.metrics() {
                Ok(text) => println!("HOSTILE METRICS bytes={}", text.len()),
                Err(e) => println!("HOSTILE ERROR {e}"),
            },
            "peek" => {
                // What this VMM's region shows in vCPU 0's guest half.
                let (region, nr) = &regions[rest];
                let words = region.as_ref().unwrap().words();
                match pvsched_abi::seq::read_guest(&words, *nr, 0) {
                    Some(g) => println!("HOSTILE PEEK policy={} rt_prio={}", g.policy, g.rt_prio),
                    None => println!("HOSTILE PEEK none"),
                }
            }
            "flood" => {
                // `flood VMS PER_VM REQUESTS`: VMS more connections, each
                // holding a VM of PER_VM threads (from the pool), then
                // REQUESTS status requests on each, none of whose replies
                // is ever read.
                let a: Vec<usize> = rest.split(' ').map(|n| n.parse().unwrap()).collect();
                let (vms, per_vm, requests) = (a[0], a[1], a[2]);
                let mut buf = vec![0u8; 1 << 16];
                let mut sent = 0;
                for vm in 0..vms {
                    let fd = pvsched_daemon::wire::connect_to(&socket).unwrap();
                    let tids = threads[vm * per_vm..(vm + 1) * per_vm]
                        .iter()
                        .map(|t| t.tid);
                    let req = pvsched_daemon::proto::Request::Register(RegisterVm {
                        name: format!("flood-{vm}"),
                        vcpus: support::vcpus(tids),
                        emulator_tids: vec![],
                        region: Region::None,
                        caps: None,
                        pid: None,
                        detach: false,
                    });
                    let bytes = serde_json::to_vec(&req).unwrap();
                    pvsched_daemon::wire::send(fd.as_fd(), &bytes, None).unwrap();
                    let got = pvsched_daemon::wire::recv(fd.as_fd(), &mut buf).unwrap();
                    let reply = String::from_utf8_lossy(&buf[..got.len]);
                    assert!(reply.contains("registered"), "{reply}");
                    use nix::sys::socket::MsgFlags;
                    for _ in 0..requests {
                        let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
                        match nix::sys::socket::send(fd.as_raw_fd(), br#"{"op":"status"}"#, flags) {
                            Ok(_) => sent += 1,
                            Err(_) => break,
                        }
                    }
                    held_fds.push(fd);
                }
                println!("HOSTILE FLOODED sent={sent}");
            }
            "exec" => {
                threads[rest.parse::<usize>().unwrap()]
                    .exec
                    .store(true, Ordering::Relaxed);
                println!("HOSTILE EXECING");
            }
            _ => println!("HOSTILE UNKNOWN"),
        }
    }
}

/// Caps with any values, as a hostile client may send them (the client
/// library would refuse to parse out-of-range ones).
fn raw_caps(text: &str) -> Caps {
    let mut t = toml::Table::try_from(Caps::default()).unwrap();
    for (k, v) in toml::from_str::<toml::Table>(text).unwrap() {
        t.insert(k, v);
    }
    // Deserialising does not validate: this is what goes on the wire.
    toml::Value::Table(t).try_into().unwrap()
}

/// Bystander threads of this (root) process and their attributes.
struct Bystanders {
    threads: Vec<FakeVcpu>,
    before: Vec<SchedAttr>,
}

impl Bystanders {
    fn new() -> Bystanders {
        let threads: Vec<FakeVcpu> = (0..3)
            .map(|i| FakeVcpu::spawn(i, Duration::from_millis(1)))
            .collect();
        let before = threads.iter().map(|t| t.attr()).collect();
        Bystanders { threads, before }
    }

    fn check(&self, when: &str) {
        for (t, b) in self.threads.iter().zip(&self.before) {
            assert_eq!(t.attr(), *b, "bystander {} changed {when}", t.tid);
        }
    }
}

fn attr(tid: u32) -> SchedAttr {
    sched::get(tid).unwrap()
}

/// Caps beyond every `[max]` field are refused naming the field; caps at
/// every limit are accepted and hold the VMM's threads at the limit; a
/// thread of another process is refused; a second VM on the same
/// connection is watched like the first (both end with the VMM). No
/// bystander thread changes at any point.
#[test]
fn an_unprivileged_vmm_gets_its_own_threads_within_the_maximum() {
    let test = "an_unprivileged_vmm_gets_its_own_threads_within_the_maximum";
    if !need_root_and_nobody(test) {
        return;
    }
    let by = Bystanders::new();
    let d = Daemon::start_for("hostile-caps", NOGROUP, MAX);
    let mut vmm = HostileVmm::start(&d.socket);
    let tids = vmm.threads(3);
    for (i, (caps, key)) in BEYOND_MAX.iter().enumerate() {
        let a = vmm.ask(&format!("register beyond-{i} 0 {caps}"));
        assert!(
            (a.starts_with("REFUSED caps:") || a.starts_with("REFUSED invalid:"))
                && a.contains(key),
            "{caps}: {a} (should be refused naming {key})"
        );
    }
    by.check("after the refused caps");
    let a = vmm.ask(&format!("foreign stolen {}", by.threads[0].tid));
    assert!(a.starts_with("REFUSED denied:"), "{a}");
    assert_eq!(vmm.ask(&format!("register at-max 0,1 {AT_MAX}")), "OK");
    // A second VM on the same connection.
    assert_eq!(vmm.ask("register second 2 -"), "OK");
    assert_eq!(vmm.ask("boost at-max"), "BOOSTING");
    assert_eq!(vmm.ask("boost second"), "BOOSTING");
    for &t in &tids[..2] {
        wait_for("the VMM's thread at FIFO 5", LIMIT, || {
            Some(attr(t)).filter(|a| a.policy == POLICY_FIFO && a.priority == 5)
        });
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        for &t in &tids {
            assert!(attr(t).priority <= 5, "thread {t} above the maximum");
        }
        by.check("while the VMM is boosted");
        std::thread::sleep(Duration::from_millis(1));
    }
    let (_, vms) = d.client().status().unwrap();
    let mut names: Vec<&str> = vms.iter().map(|v| v.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["at-max", "second"]);
    // The VMM dies: both of its VMs end with it.
    drop(vmm);
    wait_for("both VMs unregistered", LIMIT, || {
        d.client().status().ok().filter(|(_, vms)| vms.is_empty())
    });
    by.check("after the VMM ended");
}

/// A registered vCPU thread of an unprivileged VMM calls execve while a
/// forked holder keeps the VMM's connection open (so the VM stays
/// registered and the VMM's pidfd never fires). Its TID, freed by the
/// exec, goes to a new thread of this root process: that thread is never
/// touched though the VM's slot keeps asking for RT, the exec'd program
/// (the VMM's leader now) is back at the thread's baseline, and the new
/// thread's owner can register it.
#[test]
fn an_exec_frees_a_tid_that_is_never_touched_again() {
    let test = "an_exec_frees_a_tid_that_is_never_touched_again";
    if !need_root_and_nobody(test) {
        return;
    }
    if std::fs::metadata("/proc/sys/kernel/ns_last_pid").is_err()
        && !pvsched_testkit::skip_or_fail(test, "/proc/sys/kernel/ns_last_pid missing")
    {
        return;
    }
    let by = Bystanders::new();
    let d = Daemon::start_for(
        "hostile-exec",
        NOGROUP,
        "[defaults]\nhalt_boost = \"none\"\nyield_boost = \"none\"\n",
    );
    let mut vmm = HostileVmm::start(&d.socket);
    let pid = vmm.pid();
    let tids = vmm.threads(1);
    let tid = tids[0];
    assert_eq!(vmm.ask("register execer 0 -"), "OK");
    assert_eq!(vmm.ask("boost execer"), "BOOSTING");
    wait_for("the VMM's thread boosted", LIMIT, || {
        Some(attr(tid)).filter(|a| a.policy == POLICY_FIFO)
    });
    let holder: i32 = vmm
        .ask("hold")
        .strip_prefix("HOLDER ")
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(vmm.ask("exec 0"), "EXECING");
    wait_for("the exec", LIMIT, || {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        (comm.trim() == "sleep" && !Path::new(&format!("/proc/{pid}/task/{tid}")).exists())
            .then_some(())
    });
    wait_for(
        "the exec'd program back at the thread's baseline",
        LIMIT,
        || Some(attr(pid)).filter(|a| a.policy == POLICY_NORMAL),
    );
    let (_, vms) = d.client().status().unwrap();
    assert_eq!(vms.len(), 1, "the VM is still registered (its holder)");
    let new = common::vcpu_with_tid(tid).expect("a new thread with the freed TID (ns_last_pid)");
    let t0 = Instant::now();
    let mut samples = 0;
    while t0.elapsed() < Duration::from_millis(500) {
        let a = new.attr();
        assert_eq!(
            (a.policy, a.priority, a.nice),
            (POLICY_NORMAL, 0, 0),
            "the new thread with the freed TID {tid} was touched"
        );
        by.check("after the exec");
        samples += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    // Its owner (root here) registers it; the hostile VM's end leaves it be.
    let mut root = d.client();
    root.register(root_registration("owner", tid, Region::None, false))
        .expect("the TID's new owner registers it");
    // SAFETY: kills the holder process the child forked (its pid came back
    // from the child; it is ours to end).
    unsafe { libc::kill(holder, libc::SIGKILL) };
    drop(vmm);
    wait_for("the hostile VM unregistered", LIMIT, || {
        d.client()
            .status()
            .ok()
            .filter(|(_, vms)| vms.iter().all(|v| v.name != "execer"))
    });
    let a = new.attr();
    assert_eq!((a.policy, a.nice), (POLICY_NORMAL, 0), "left alone");
    assert_ne!(a.policy, POLICY_IDLE);
    by.check("at the end");
    println!("TID {tid} freed by an exec: the new thread was never touched over {samples} samples");
}

/// Quotas and replies: one unprivileged uid cannot take every client or VM
/// slot (its extra connections and VMs are refused `busy` while root is
/// still served), and asking `status` and `metrics` on its own connection
/// with 1 024 registered threads (replies far larger than one socket
/// message) gets the whole replies and keeps every VM.
#[test]
fn one_uid_cannot_take_every_slot_and_large_replies_arrive_whole() {
    let test = "one_uid_cannot_take_every_slot_and_large_replies_arrive_whole";
    if !need_root_and_nobody(test) {
        return;
    }
    let by = Bystanders::new();
    let d = Daemon::start_for(
        "hostile-quota",
        NOGROUP,
        "max_clients_per_uid = 4\nmax_vms_per_uid = 16\n",
    );
    let mut vmm = HostileVmm::start(&d.socket);
    vmm.threads(16 * 64 + 1);
    for vm in 0..16 {
        let idx: Vec<String> = (vm * 64..vm * 64 + 64).map(|i| i.to_string()).collect();
        let a = vmm.ask(&format!("register big-{vm} {} -", idx.join(",")));
        assert_eq!(a, "OK", "VM {vm}");
    }
    let a = vmm.ask("register one-too-many 1024 -");
    assert!(a.starts_with("REFUSED busy:"), "{a}");
    // The VMM holds one connection: 3 more are its quota.
    assert_eq!(vmm.ask("conns 8"), "CONNS ok=3 busy=5");
    let (_, vms) = d.client().status().expect("root is still served");
    assert_eq!(vms.len(), 16);
    // The whole status on the VMM's own connection, and its VMs stay.
    assert_eq!(vmm.ask("status"), "STATUS vms=16 threads=1024");
    // Larger than any socket buffer the kernel's default wmem_max allows
    // (2 x 212 992 bytes).
    let a = vmm.ask("metrics");
    let bytes: usize = a
        .strip_prefix("METRICS bytes=")
        .unwrap_or_else(|| panic!("{a}"))
        .parse()
        .unwrap();
    assert!(bytes > 2 * 212_992, "{bytes} bytes");
    let (_, vms) = d.client().status().unwrap();
    assert_eq!(vms.len(), 16, "the VMM kept its VMs");
    by.check("after the quotas");
}

/// Scrapers that trickle a byte at a time cannot hold the metrics
/// endpoint: a normal scrape is answered while they are still sending,
/// and without a token the exposition names VMs by id, not by name.
#[test]
fn slow_scrapers_cannot_hold_the_metrics_endpoint() {
    let test = "slow_scrapers_cannot_hold_the_metrics_endpoint";
    if !need_root_and_nobody(test) {
        return;
    }
    let d = Daemon::start_for("hostile-scrape", NOGROUP, "");
    let mut vmm = HostileVmm::start(&d.socket);
    vmm.threads(1);
    assert_eq!(vmm.ask("register secret-name 0 -"), "OK");
    let stop = Arc::new(AtomicBool::new(false));
    let slow: Vec<_> = (0..6)
        .map(|_| {
            let (addr, stop) = (d.metrics.clone(), stop.clone());
            std::thread::spawn(move || {
                let Ok(mut c) = std::net::TcpStream::connect(&addr) else {
                    return;
                };
                for b in b"GET /metrics HTTP/1.0\r\nHost: x\r\n".iter().cycle() {
                    if stop.load(Ordering::Relaxed) || c.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let body = wait_for("a scrape answered beside the slow scrapers", LIMIT, || {
        support::http_get(&d.metrics, "/metrics", None)
    });
    assert!(!stop.load(Ordering::Relaxed));
    assert!(body.contains("pvsched_vcpus{vm=\"0\"} 1"), "{body}");
    assert!(
        !body.contains("secret-name"),
        "a VM name shown without the token"
    );
    stop.store(true, Ordering::Relaxed);
    for t in slow {
        let _ = t.join();
    }
}

/// VM names are bound to their VMMs: an unprivileged VMM cannot register
/// under the name of a VM whose file names other owners (and so get its
/// caps, or lock it out), nor under a file that names no owner (root's
/// registrations only), nor without a file when the operator requires
/// one; a file that names its uid lets it in, with that file's caps, and
/// the real owner of the victim's name still registers.
#[test]
fn vm_names_are_bound_to_their_vmms() {
    let test = "vm_names_are_bound_to_their_vmms";
    if !need_root_and_nobody(test) {
        return;
    }
    let by = Bystanders::new();
    let d = Daemon::start_for("hostile-names", NOGROUP, "require_vm_file = true\n");
    d.vm_file("victim", "owner_uids = [0]\nmax_rt_prio = 4\n");
    d.vm_file("plain", "max_rt_prio = 4\n");
    d.vm_file(
        "mine",
        &format!("owner_uids = [{NOBODY}]\nmax_rt_prio = 3\n"),
    );
    let mut vmm = HostileVmm::start(&d.socket);
    let tids = vmm.threads(1);
    for name in ["victim", "plain", "nofile"] {
        let a = vmm.ask(&format!("register {name} 0 -"));
        assert!(a.starts_with("REFUSED denied:"), "{name}: {a}");
    }
    assert_eq!(vmm.ask("register mine 0 -"), "OK");
    assert_eq!(vmm.ask("boost mine"), "BOOSTING");
    wait_for("the VMM's thread at its file's FIFO 3", LIMIT, || {
        Some(attr(tids[0])).filter(|a| a.policy == POLICY_FIFO && a.priority == 3)
    });
    // The victim's own (root) VMM is not locked out.
    let mut root = d.client();
    root.register(root_registration(
        "victim",
        by.threads[0].tid,
        Region::None,
        false,
    ))
    .expect("the victim's owner registers it");
    root.unregister("victim").unwrap();
    by.check("after the name squatting");
}

/// The registration root makes for a thread of its own, as the libvirt
/// hook does for a QEMU it found (root, with the process named).
fn root_registration(name: &str, tid: u32, region: Region, detach: bool) -> RegisterVm {
    RegisterVm {
        name: name.into(),
        vcpus: vec![Vcpu { tid, apic_id: 0 }],
        emulator_tids: vec![],
        region,
        caps: None,
        pid: detach.then(std::process::id),
        detach,
    }
}

/// A VM's device region belongs to one owner. An unprivileged VMM that
/// registers the name of a VM with no file (region "device") before root
/// starts that VM's device process (`pvsched device --daemon-region`) is
/// never handed to it: root's reservation ends the squatter's
/// registration and gets a fresh region, whose bytes (the real guest's)
/// the squatter never sees; the squatter cannot register the reserved
/// name, nor drop root's reservation by trying; root's registration then
/// consumes it, and the name stays root's.
#[test]
fn a_squatter_never_gets_or_holds_a_vms_device_region() {
    let test = "a_squatter_never_gets_or_holds_a_vms_device_region";
    if !need_root_and_nobody(test) {
        return;
    }
    let by = Bystanders::new();
    let d = Daemon::start_for("hostile-region", NOGROUP, MAX);
    let mut vmm = HostileVmm::start(&d.socket);
    vmm.threads(1);
    assert_eq!(vmm.ask("register guest-a 0 -"), "OK");
    // The squatter's own guest half says FIFO 99 (what it would feed the
    // real guest, or read back from it).
    assert_eq!(vmm.ask("boost guest-a"), "BOOSTING");
    let mut root = d.client();
    let (fd, len) = root.reserve("guest-a").expect("root reserves the name");
    let region = RegionMap::new(fd, len).unwrap();
    // SAFETY: `len` bytes mapped, live for this scope.
    let fresh = unsafe { std::slice::from_raw_parts(region.as_ptr(), len as usize) }
        .iter()
        .all(|&b| b == 0);
    assert!(
        fresh,
        "root's device process was handed the squatter's region"
    );
    let (daemon, vms) = root.status().unwrap();
    assert!(vms.is_empty(), "the squatter's registration did not end");
    assert_eq!(daemon.unregistrations.superseded, 1);
    // The real guest writes its slot: the squatter's map does not show it.
    assert!(region.write_guest(
        1,
        0,
        &SlotGuest {
            policy: POLICY_FIFO,
            rt_prio: 7,
            ..Default::default()
        },
    ));
    assert_eq!(
        vmm.ask("peek guest-a"),
        format!("PEEK policy={POLICY_FIFO} rt_prio=99")
    );
    // The reservation is root's: the squatter cannot register the name,
    // and trying does not drop it.
    let a = vmm.ask("register guest-a 0 -");
    assert!(
        a.starts_with("REFUSED denied:") && a.contains("reserved"),
        "{a}"
    );
    let (fd2, len2) = root.reserve("guest-a").unwrap();
    let again = RegionMap::new(fd2, len2).unwrap();
    let seen = pvsched_abi::seq::read_guest(&again.words(), 1, 0).unwrap();
    assert_eq!(
        (seen.policy, seen.rt_prio),
        (POLICY_FIFO, 7),
        "reservation lost"
    );
    // Root's registration consumes it; the name is root's from then on.
    root.register(root_registration(
        "guest-a",
        by.threads[0].tid,
        Region::Reserved,
        false,
    ))
    .expect("root registers the VM with its reserved region");
    let a = vmm.ask("register guest-a 0 -");
    assert!(a.starts_with("REFUSED exists:"), "{a}");
    root.unregister("guest-a").unwrap();
    by.check("after the region squatting");
}

/// Predictable names (Nova's `instance-0000002a`) cannot be squatted:
/// an unprivileged VMM that registers one first loses it, threads
/// restored, when root's hook registers the domain, even with
/// `require_vm_file = true` and no file for the name (root's
/// registrations are the operator's own opt-in: a Nova flavor's caps);
/// the unprivileged VMM still cannot register without a file.
#[test]
fn root_takes_a_squatted_name_back() {
    let test = "root_takes_a_squatted_name_back";
    if !need_root_and_nobody(test) {
        return;
    }
    let by = Bystanders::new();
    let d = Daemon::start_for("hostile-squat", NOGROUP, "");
    let mut vmm = HostileVmm::start(&d.socket);
    let tids = vmm.threads(1);
    let name = "instance-0000002a";
    assert_eq!(vmm.ask(&format!("register {name} 0 max_rt_prio = 4")), "OK");
    assert_eq!(vmm.ask(&format!("boost {name}")), "BOOSTING");
    wait_for("the squatter's thread boosted", LIMIT, || {
        Some(attr(tids[0])).filter(|a| a.policy == POLICY_FIFO)
    });
    let mut root = d.client();
    root.register(root_registration(
        name,
        by.threads[0].tid,
        Region::None,
        true,
    ))
    .expect("the hook's registration takes the name back");
    wait_for("the squatter's thread restored", LIMIT, || {
        Some(attr(tids[0])).filter(|a| a.policy == POLICY_NORMAL)
    });
    let (daemon, vms) = root.status().unwrap();
    assert_eq!(vms.len(), 1);
    assert_eq!(vms[0].pid, std::process::id(), "the name is root's VM's");
    assert_eq!(daemon.unregistrations.superseded, 1);
    let a = vmm.ask(&format!("register {name} 0 -"));
    assert!(a.starts_with("REFUSED exists:"), "{a}");
    root.unregister(name).unwrap();
    drop(d);

    // The same with the operator requiring a file for every VM.
    let d = Daemon::start_for("hostile-squat-file", NOGROUP, "require_vm_file = true\n");
    let mut vmm = HostileVmm::start(&d.socket);
    vmm.threads(1);
    let a = vmm.ask(&format!("register {name} 0 -"));
    assert!(a.starts_with("REFUSED denied:"), "{a}");
    let mut root = d.client();
    root.register(root_registration(
        name,
        by.threads[0].tid,
        Region::None,
        true,
    ))
    .expect("root's registration needs no file (its caps came from the flavor)");
    root.unregister(name).unwrap();
    by.check("after the name squatting");
}

/// CPU time of the main thread of process `pid` (pvschedd's socket
/// loop), clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat")).unwrap();
    // After the command's closing parenthesis: utime and stime are the
    // 12th and 13th fields.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|v| v.parse().unwrap())
        .collect();
    f[0] + f[1]
}

/// Waits until the main thread of process `pid` has used no CPU over
/// three 300 ms samples in a row (60 s at most).
fn wait_idle(pid: u32) {
    let (t0, mut last, mut still) = (Instant::now(), cpu_ticks(pid), 0);
    while still < 3 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(300));
        let now = cpu_ticks(pid);
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
}

/// Resident memory of process `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// A VMM that asks for status on its 16 VM-holding connections and never
/// reads the replies (each about 1 024 threads' worth) makes pvschedd
/// hold at most one reply per connection: its memory grows by a few MiB,
/// not by the hundreds a queue per connection would take; every VM stays
/// registered and root is still served.
#[test]
fn a_client_that_never_reads_cannot_grow_the_daemons_memory() {
    let test = "a_client_that_never_reads_cannot_grow_the_daemons_memory";
    if !need_root_and_nobody(test) {
        return;
    }
    let d = Daemon::start_for("hostile-memory", NOGROUP, "");
    let mut vmm = HostileVmm::start(&d.socket);
    vmm.threads(16 * 64);
    let before = rss_kib(d.pid());
    let a = vmm.ask("flood 16 64 300");
    let sent: usize = a
        .strip_prefix("FLOODED sent=")
        .unwrap_or_else(|| panic!("{a}"))
        .parse()
        .unwrap();
    let (_, vms) = d.client().status().expect("root is still served");
    assert_eq!(vms.len(), 16, "a VM of the flooding VMM was lost");
    // pvschedd has read every request it will read once its socket loop
    // stops using CPU (it answers them in turn, one per connection per
    // loop).
    wait_idle(d.pid());
    let (_, vms) = d.client().status().unwrap();
    assert_eq!(vms.len(), 16);
    let grown = rss_kib(d.pid()).saturating_sub(before);
    println!("{sent} status requests never read: pvschedd grew by {grown} KiB");
    assert!(sent >= 16 * 50, "only {sent} requests sent");
    assert!(
        grown < 48 * 1024,
        "pvschedd grew by {grown} KiB for replies nobody reads"
    );
}
