//! Whatever kills pvschedd and its guardian together (`systemctl kill -s
//! KILL` signals every process of the unit), the threads they left boosted
//! get their exact baselines back from the ledger in the runtime directory:
//! from `pvschedd --restore` (the unit's ExecStopPost), or from the next
//! pvschedd before it loads its policy; and the next pvschedd, serving the
//! same threads again, restores them to the baselines they had before the
//! first boost, never to a boosted state. Without systemd: the daemon and
//! its guardian are SIGKILLed here, by pid.

use crate::common;
use crate::support;

use common::{need_bpf, wait_for};
use pvsched_abi::POLICY_FIFO;
use pvsched_agent::sched::{self, SchedAttr};
use pvsched_daemon::proto::Region;
use pvsched_daemon::{Client, RegisterVm};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(20);

/// A pvschedd process, killed when dropped (a failing test leaves none).
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(dir: &Path) -> Daemon {
    let cfg = dir.join("pvschedd.toml");
    std::fs::write(
        &cfg,
        format!(
            "socket = {:?}\nsocket_group = \"\"\nmetrics_listen = \"\"\n",
            dir.join("pvschedd.sock")
        ),
    )
    .unwrap();
    let d = Daemon(support::spawn_pvschedd(&cfg));
    wait_for("pvschedd's socket", LIMIT, || {
        Client::connect(&dir.join("pvschedd.sock")).ok()
    });
    d
}

/// Registers `threads` (of this process) as VM `name` with slots asking
/// for RT 99 and waits until both are boosted; the connection holds the VM.
fn register_boosted(dir: &Path, name: &str, threads: &[(u32, SchedAttr)]) -> Client {
    let mut c = Client::connect(&dir.join("pvschedd.sock")).unwrap();
    let reg = c
        .register(RegisterVm {
            name: name.into(),
            vcpus: support::vcpus(threads.iter().map(|t| t.0)),
            emulator_tids: vec![],
            region: Region::Device,
            caps: None,
            pid: None,
            detach: false,
        })
        .unwrap();
    let region = reg.region.unwrap();
    support::ask_rt99(&region, threads.len() as u32);
    for &(tid, _) in threads {
        wait_for("the boost", LIMIT, || {
            sched::get(tid).ok().filter(|a| a.policy == POLICY_FIFO)
        });
    }
    c
}

/// The guardian: the child of `daemon` named pvsched-guard.
fn guardian_of(daemon: u32) -> u32 {
    let kids = std::fs::read_to_string(format!("/proc/{daemon}/task/{daemon}/children")).unwrap();
    kids.split_whitespace()
        .filter_map(|k| k.parse::<u32>().ok())
        .find(|k| {
            std::fs::read_to_string(format!("/proc/{k}/comm"))
                .is_ok_and(|c| c.trim() == "pvsched-guard")
        })
        .expect("pvschedd's guardian")
}

/// SIGKILLs the guardian, then the daemon: nothing of theirs restores.
fn kill_both(daemon: &mut Daemon) {
    let daemon = &mut daemon.0;
    let g = guardian_of(daemon.id());
    for pid in [g, daemon.id()] {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    let _ = daemon.wait();
    // The guardian was the daemon's child: reaped by init now; wait until
    // it is gone.
    wait_for("the guardian gone", LIMIT, || {
        (!Path::new(&format!("/proc/{g}")).exists()
            || std::fs::read_to_string(format!("/proc/{g}/stat")).is_ok_and(|s| s.contains(") Z ")))
        .then_some(())
    });
}

fn at_baseline(threads: &[(u32, SchedAttr)]) -> bool {
    threads.iter().all(|&(tid, b)| {
        sched::get(tid)
            .is_ok_and(|a| (a.policy, a.priority, a.nice) == (b.policy, b.priority, b.nice))
    })
}

fn boosted(threads: &[(u32, SchedAttr)]) -> bool {
    threads
        .iter()
        .all(|&(tid, _)| sched::get(tid).is_ok_and(|a| a.policy == POLICY_FIFO))
}

#[test]
fn daemon_and_guardian_killed_together_are_restored_from_the_ledger() {
    const TEST: &str = "daemon_and_guardian_killed_together_are_restored_from_the_ledger";
    if !need_bpf(TEST) || !pvsched_testkit::root(TEST, "boosting to SCHED_FIFO") {
        return;
    }
    let dir: PathBuf =
        std::env::temp_dir().join(format!("pvschedd-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let threads = support::baseline_threads();

    // 1. Killed together; the next pvschedd restores before anything else.
    let mut d = start(&dir);
    let vm = register_boosted(&dir, "vm", &threads);
    kill_both(&mut d);
    drop(vm);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        boosted(&threads),
        "nothing restored them yet (the test's premise)"
    );
    let t0 = Instant::now();
    let mut d = start(&dir);
    assert!(
        at_baseline(&threads),
        "the next pvschedd is ready, and the threads it found boosted are not at their baselines"
    );
    println!(
        "killed together: baselines back before the next pvschedd answered ({:?})",
        t0.elapsed()
    );

    // 2. Served again by this pvschedd and boosted: its baselines are the
    //    real ones (a clean stop restores exactly them).
    let vm = register_boosted(&dir, "vm", &threads);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let _ = d.0.wait();
    drop(vm);
    wait_for("baselines after SIGTERM", LIMIT, || {
        at_baseline(&threads).then_some(())
    });

    // 3. Killed together again; `pvschedd --restore` (ExecStopPost) puts
    //    them back without starting a daemon.
    let mut d = start(&dir);
    let vm = register_boosted(&dir, "vm", &threads);
    kill_both(&mut d);
    drop(vm);
    assert!(boosted(&threads));
    let out = Command::new(env!("CARGO_BIN_EXE_pvschedd"))
        .arg("--restore")
        .arg("--config")
        .arg(dir.join("pvschedd.toml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("pvschedd --restore: {}", text.trim());
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        at_baseline(&threads),
        "pvschedd --restore left them boosted"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
