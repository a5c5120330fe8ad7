//! The operator's commands against a real pvschedd: `pvsched qemu-attach`
//! on a real QEMU (vCPU threads from QMP), `pvsched status`, `vm set`,
//! `vm unregister`, `metrics`, and their exit codes.

use crate::common;

use common::{LIMIT, Pvschedd, wait_for};
use std::process::{Child, Command, Output};

fn pvsched(args: &[&str], socket: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pvsched"))
        .args(args)
        .env("PVSCHED_SOCKET", socket)
        .output()
        .expect("pvsched runs")
}

/// The VMs `pvsched status --json` lists (the command must succeed).
fn vms(socket: &std::path::Path) -> Vec<serde_json::Value> {
    let o = pvsched(&["status", "--json"], socket);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status --json");
    v["vms"].as_array().expect("a vms array").clone()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A QEMU with stopped vCPUs (`-S`: no guest needed) and a QMP socket.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Qemu {
    /// Starts it with 2 TCG vCPUs and QMP at `qmp`; returns it with its
    /// vCPU thread ids.
    fn start(qmp: &std::path::Path, name: &str) -> (Qemu, Vec<u32>) {
        let qemu = Qemu(
            Command::new("qemu-system-x86_64")
                .args([
                    "-machine",
                    "q35",
                    "-accel",
                    "tcg,thread=multi",
                    "-smp",
                    "2",
                    "-m",
                    "64",
                    "-S",
                    "-display",
                    "none",
                    "-nodefaults",
                    "-name",
                ])
                .arg(format!("{name},debug-threads=on"))
                .arg("-qmp")
                .arg(format!("unix:{},server=on,wait=off", qmp.display()))
                .spawn()
                .expect("qemu starts"),
        );
        let pid = qemu.0.id();
        let tids = wait_for("QEMU's two vCPU threads", LIMIT, || {
            let t = qemu_vcpu_tids(pid);
            (t.len() == 2 && qmp.exists()).then_some(t)
        });
        (qemu, tids)
    }
}

/// vCPU thread ids of a QEMU process (threads named "CPU n/TCG" or
/// "CPU n/KVM"), by CPU index.
fn qemu_vcpu_tids(pid: u32) -> Vec<u32> {
    let mut v: Vec<(u32, u32)> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| {
                let tid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
                let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
                let idx = comm.strip_prefix("CPU ")?.split('/').next()?.parse().ok()?;
                Some((idx, tid))
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.into_iter().map(|(_, t)| t).collect()
}

#[test]
fn qemu_attach_registers_a_running_qemu_until_it_exits() {
    let test = "qemu_attach_registers_a_running_qemu_until_it_exits";
    if !common::root_bpf(test) || !common::have_program(test, "qemu-system-x86_64") {
        return;
    }
    let d = Pvschedd::start("qemu-attach");
    let qmp = d.socket.with_file_name("qmp.sock");
    let (qemu, tids) = Qemu::start(&qmp, "tcg-1");
    let pid = qemu.0.id();
    let o = pvsched(
        &[
            "qemu-attach",
            "--qmp",
            qmp.to_str().unwrap(),
            "--name",
            "tcg-1",
            "--pid",
            &pid.to_string(),
        ],
        &d.socket,
    );
    assert!(o.status.success(), "{}", text(&o));
    let listed = vms(&d.socket);
    let vm = &listed[0];
    assert_eq!(vm["name"], "tcg-1");
    assert_eq!(vm["pid"], pid);
    let got: Vec<u64> = vm["vcpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tid"].as_u64().unwrap())
        .collect();
    assert_eq!(got, tids.iter().map(|&t| t as u64).collect::<Vec<_>>());
    assert_eq!(vm["emulators"][0]["tid"], pid, "QEMU's main loop");
    // Live caps change from the command line; refused above the maximum.
    let o = pvsched(
        &["vm", "set", "tcg-1", "max_rt_prio=2", "halt_boost=nice"],
        &d.socket,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("max_rt_prio = 2"), "{}", text(&o));
    let o = pvsched(&["vm", "set", "tcg-1", "max_rt_prio=50"], &d.socket);
    assert_eq!(o.status.code(), Some(11), "{}", text(&o));
    assert!(text(&o).contains("operator maximum"), "{}", text(&o));
    let o = pvsched(&["vm", "set", "nope", "max_rt_prio=1"], &d.socket);
    assert_eq!(o.status.code(), Some(11), "{}", text(&o));
    let o = pvsched(&["metrics"], &d.socket);
    assert!(
        text(&o).contains("pvsched_vcpus{vm=\"tcg-1\"} 2"),
        "{}",
        text(&o)
    );
    let o = pvsched(&["status"], &d.socket);
    assert!(text(&o).contains("tcg-1"), "{}", text(&o));
    // QEMU exits: the daemon unregisters the VM (pidfd).
    drop(qemu);
    wait_for("tcg-1 unregistered after QEMU exited", LIMIT, || {
        vms(&d.socket).is_empty().then_some(())
    });
}

#[test]
fn no_daemon_exits_10() {
    let o = pvsched(
        &["status"],
        std::path::Path::new("/nonexistent/pvschedd.sock"),
    );
    assert_eq!(o.status.code(), Some(10), "{}", text(&o));
    assert!(text(&o).contains("is it running?"), "{}", text(&o));
}

/// dist/libvirt/qemu.d/pvsched, called as libvirt calls it (the domain
/// XML on standard input), registers a started domain that opts in with
/// `<pvsched:vm>` in its metadata, with the caps written there, and
/// nothing else: not the other operations, not a domain without the
/// metadata, not vCPU threads that are not threads of the pid libvirt
/// recorded, not caps above pvschedd's [max]. libvirt's monitor is stood
/// in for by a `virsh` that answers `query-cpus-fast` with the QEMU's
/// threads (tests/libvirt runs the hook under a real libvirtd).
#[test]
fn the_libvirt_hook_registers_a_started_domain() {
    let test = "the_libvirt_hook_registers_a_started_domain";
    if !common::root_bpf(test) || !common::have_program(test, "qemu-system-x86_64") {
        return;
    }
    let d = Pvschedd::start("hook");
    let run_dir = d.socket.with_file_name("libvirt-run");
    std::fs::create_dir_all(&run_dir).unwrap();
    let (qemu, tids) = Qemu::start(&run_dir.join("qmp.sock"), "dom-1");
    let pidfile = run_dir.join("dom-1.pid");
    let hook = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../dist/libvirt/qemu.d/pvsched"
    );
    // A virsh whose qemu-monitor-command answers as QEMU does through
    // libvirt; it records how it was called.
    let cpus: Vec<String> = tids
        .iter()
        .enumerate()
        .map(|(i, t)| {
            format!(
                r#"{{"cpu-index":{i},"thread-id":{t},"props":{{"socket-id":0,"core-id":{i},"thread-id":0}}}}"#
            )
        })
        .collect();
    let virsh = run_dir.join("virsh");
    let virsh_log = run_dir.join("virsh.log");
    std::fs::write(
        &virsh,
        format!(
            "#!/bin/sh\necho \"$*\" >>{log:?}\ncase \"$*\" in\n\
             *query-cpus-fast*) echo '{{\"return\":[{cpus}],\"id\":\"libvirt-7\"}}' ;;\n\
             *qom-list*) echo '{{\"return\":[],\"id\":\"libvirt-8\"}}' ;;\n\
             *query-status*) echo '{{\"return\":{{\"status\":\"running\",\"running\":true}},\"id\":\"libvirt-10\"}}' ;;\n\
             *query-version*) echo '{{\"return\":{{\"qemu\":{{\"major\":7,\"minor\":2,\"micro\":22}},\"package\":\"\"}},\"id\":\"libvirt-9\"}}' ;;\n\
             *) echo 'error: unsupported' >&2; exit 1 ;;\nesac\n",
            log = virsh_log,
            cpus = cpus.join(",")
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&virsh, std::fs::Permissions::from_mode(0o755)).unwrap();
    // What the hook's background attach says (the journal otherwise).
    let hook_log = run_dir.join("hook.log");
    let run_hook = |op: &str, xml: &str| {
        use std::io::Write;
        let mut c = Command::new(hook)
            .args(["dom-1", op, "begin", "-"])
            .env("PVSCHED_BIN", env!("CARGO_BIN_EXE_pvsched"))
            .env("PVSCHED_VIRSH", &virsh)
            .env("PVSCHED_LIBVIRT_RUN", &run_dir)
            .env("PVSCHED_SOCKET", &d.socket)
            .env("PVSCHED_HOOK_LOG", &hook_log)
            .env("PVSCHED_HOOK_CONF", "/nonexistent")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let _ = c.stdin.take().unwrap().write_all(xml.as_bytes());
        // Returns at once: the registration runs in the background, with
        // none of the hook's pipes (libvirt waits for them to close).
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    };
    let domain = |caps: &str| {
        format!(
            "<domain type='qemu' id='1'>\n  <name>dom-1</name>\n  <metadata>\n    \
             <pvsched:vm xmlns:pvsched=\"https://pvsched.dev/xmlns/libvirt/1\">\n      \
             <pvsched:caps {caps}/>\n    </pvsched:vm>\n  </metadata>\n</domain>\n"
        )
    };
    let hook_said = |what: &str| {
        wait_for(&format!("the hook's attach saying {what:?}"), LIMIT, || {
            std::fs::read_to_string(&hook_log)
                .ok()
                .filter(|t| t.contains(what))
        })
    };
    std::fs::write(&pidfile, format!("{}\n", qemu.0.id())).unwrap();
    // Any other operation, or a domain without pvsched metadata, returns
    // at once having started nothing.
    run_hook("prepare", &domain("max_rt_prio=\"2\""));
    run_hook(
        "started",
        "<domain type='qemu'><name>dom-1</name></domain>\n",
    );
    assert_eq!(vms(&d.socket).len(), 0, "nothing registered");
    assert!(!virsh_log.exists(), "virsh not even called");
    // libvirt recorded another pid: QEMU's threads are not its threads.
    std::fs::write(&pidfile, "1\n").unwrap();
    run_hook("started", &domain("max_rt_prio=\"2\""));
    hook_said("is not a thread of QEMU process 1");
    assert_eq!(vms(&d.socket).len(), 0, "another process's threads refused");
    std::fs::write(&pidfile, format!("{}\n", qemu.0.id())).unwrap();
    // Caps above pvschedd's [max] (max_rt_prio = 10): refused by pvschedd.
    run_hook("started", &domain("max_rt_prio=\"20\""));
    hook_said("operator maximum");
    assert_eq!(vms(&d.socket).len(), 0, "caps above [max] refused");
    // A cap that does not exist: refused by attach, naming it.
    run_hook("started", &domain("max_rt_prio=\"2\" bogus=\"1\""));
    hook_said("bogus");
    assert_eq!(vms(&d.socket).len(), 0, "unknown cap refused");
    run_hook("started", &domain("max_rt_prio=\"2\" halt_boost=\"nice\""));
    let vm = wait_for("dom-1 registered by the hook", LIMIT, || {
        vms(&d.socket).first().cloned()
    });
    assert_eq!(vm["name"], "dom-1");
    assert_eq!(vm["pid"], qemu.0.id());
    assert_eq!(vm["vcpus"][0]["tid"], tids[0]);
    assert_eq!(vm["vcpus"][1]["tid"], tids[1]);
    assert_eq!(vm["caps_source"], "client");
    assert_eq!(vm["caps"]["max_rt_prio"], 2);
    assert_eq!(vm["caps"]["halt_boost"], "nice");
    let calls = std::fs::read_to_string(&virsh_log).unwrap();
    assert!(
        calls.contains(
            r#"-c qemu:///system qemu-monitor-command dom-1 {"execute":"query-cpus-fast"}"#
        ),
        "{calls}"
    );
    hook_said("registered with pvschedd");
    // QEMU 7.2 cannot take the device: caps only, and the hook says why.
    hook_said("caps only: QEMU 7.2.22 has no vfio-user-pci");
    assert_eq!(vm["region"], "none");
    drop(qemu);
    wait_for("dom-1 unregistered after QEMU exited", LIMIT, || {
        vms(&d.socket).is_empty().then_some(())
    });
}

/// Must show: one pvschedd, three reference-VMM processes (`pvsched run
/// --policy daemon`, real KVM, `greedy` guests asking for RT) registered at
/// once with different caps (their VM files): each VM's vCPU threads
/// boosted within its own caps only, read back with sched_getattr; a VM's
/// caps changed live.
#[test]
fn three_reference_vmms_each_within_its_own_caps() {
    let test = "three_reference_vmms_each_within_its_own_caps";
    if !common::kvm_root_bpf(test) {
        return;
    }
    use pvsched_abi::{POLICY_FIFO, POLICY_NORMAL};
    let d = Pvschedd::start("three-vmm");
    // (name, caps file, what a boosted vCPU thread must look like, bound)
    d.vm_file("ref-a", "allow_rt = false\nnice_floor = -3\n");
    d.vm_file("ref-b", "allow_rt = false\nnice_floor = -8\n");
    d.vm_file("ref-c", "max_rt_prio = 1\n");
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let runs: Vec<(&str, Killed)> = ["ref-a", "ref-b", "ref-c"]
        .into_iter()
        .map(|name| {
            let c = Command::new(env!("CARGO_BIN_EXE_pvsched"))
                .args([
                    "run",
                    "--policy",
                    "daemon",
                    "--vm-name",
                    name,
                    "--workload",
                    "greedy",
                    "--duration",
                    "12s",
                    "--device-mode",
                    "in-process",
                    "--json",
                ])
                .env("PVSCHED_SOCKET", &d.socket)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            (name, Killed(c))
        })
        .collect();
    let tids: Vec<(&str, Vec<u32>)> = runs
        .iter()
        .map(|(name, k)| {
            let pid = k.0.id();
            let v = wait_for("two vCPU threads", LIMIT, || {
                let v = common::vcpu_threads(pid);
                (v.len() == 2).then_some(v)
            });
            (*name, v.into_iter().map(|(_, t)| t).collect())
        })
        .collect();
    wait_for("three VMs registered", LIMIT, || {
        (vms(&d.socket).len() == 3).then_some(())
    });
    let attr = |t: u32| pvsched_agent::sched::get(t).ok();
    let within = |name: &str, a: &pvsched_agent::sched::SchedAttr| match name {
        "ref-a" => a.policy == POLICY_NORMAL && a.nice >= -3,
        "ref-b" => a.policy == POLICY_NORMAL && a.nice >= -8,
        _ => a.policy == POLICY_NORMAL || (a.policy == POLICY_FIFO && a.priority <= 1),
    };
    // Each VM's threads reach their own cap (throttling lets them go in
    // between: greedy vCPUs never halt) ...
    for (name, ts) in &tids {
        let want = |a: &pvsched_agent::sched::SchedAttr| match *name {
            "ref-a" => a.nice == -3,
            "ref-b" => a.nice == -8,
            _ => a.policy == POLICY_FIFO && a.priority == 1,
        };
        wait_for(&format!("{name} boosted to its cap"), LIMIT, || {
            ts.iter()
                .any(|&t| attr(t).is_some_and(|a| want(&a)))
                .then_some(())
        });
    }
    // ... and never beyond it.
    for _ in 0..300 {
        for (name, ts) in &tids {
            for &t in ts {
                if let Some(a) = attr(t) {
                    assert!(within(name, &a), "{name} thread {t}: {a:?} beyond its caps");
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // A live change: ref-b down to nice -2.
    let o = pvsched(&["vm", "set", "ref-b", "nice_floor=-2"], &d.socket);
    assert!(o.status.success(), "{}", text(&o));
    let b = &tids[1].1;
    wait_for("ref-b at its new nice floor", LIMIT, || {
        b.iter()
            .any(|&t| attr(t).is_some_and(|a| a.nice == -2))
            .then_some(())
    });
    for _ in 0..200 {
        for &t in b {
            if let Some(a) = attr(t) {
                assert!(a.nice >= -2, "ref-b thread {t}: {a:?} below the new floor");
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    drop(runs);
}
