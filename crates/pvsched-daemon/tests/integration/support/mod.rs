//! What the daemon's integration tests share: a real pvschedd process with
//! its own socket, configuration and VM directory.
#![allow(dead_code)]

use pvsched_abi::{POLICY_BATCH, POLICY_FIFO, POLICY_NORMAL, SlotGuest};
use pvsched_agent::sched::{self, SchedAttr};
use pvsched_daemon::proto::Vcpu;
use pvsched_daemon::{Client, RegionMap};
use pvsched_testkit::wait_for;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

/// Liveness bound of the waits below (not a timing assertion).
pub const LIMIT: Duration = Duration::from_secs(20);

/// A pvschedd process with its own socket, config and VM directory.
pub struct Daemon {
    pub child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub metrics: String,
}

impl Daemon {
    /// A daemon whose socket only root may use.
    pub fn start(tag: &str, config: &str) -> Daemon {
        Self::start_for(tag, "", config)
    }

    /// A daemon whose socket members of `group` may use (`""`: root only).
    pub fn start_for(tag: &str, group: &str, config: &str) -> Daemon {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(tag, group, config, &format!("127.0.0.1:{port}"))
    }

    /// [`Daemon::start_for`] with its metrics endpoint on `metrics`.
    pub fn start_on(tag: &str, group: &str, config: &str, metrics: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!("pvschedd-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("vms")).unwrap();
        let socket = dir.join("pvschedd.sock");
        let metrics = metrics.to_string();
        let cfg = dir.join("pvschedd.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket = {:?}\nsocket_group = {group:?}\nvm_dir = {:?}\nmetrics_listen = {metrics:?}\n{config}",
                socket,
                dir.join("vms")
            ),
        )
        .unwrap();
        let child = spawn_pvschedd(&cfg);
        let d = Daemon {
            child,
            dir,
            socket,
            metrics,
        };
        wait_for("pvschedd's socket", LIMIT, || {
            Client::connect(&d.socket).ok()
        });
        d
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).unwrap()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn vm_file(&self, name: &str, caps: &str) {
        std::fs::write(self.dir.join("vms").join(format!("{name}.toml")), caps).unwrap();
    }
}

/// The pvschedd just built, with configuration file `cfg` (warnings only
/// on stderr). The caller owns the child and waits for its socket.
pub fn spawn_pvschedd(cfg: &std::path::Path) -> Child {
    // The flavor files beside it (none unless a test writes some), not
    // the host's /etc/pvsched/flavors.
    let flavors = cfg.parent().map(|d| d.join("flavors")).unwrap_or_default();
    Command::new(env!("CARGO_BIN_EXE_pvschedd"))
        .arg("--config")
        .arg(cfg)
        .arg("--flavor-dir")
        .arg(flavors)
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap()
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` on the metrics endpoint `addr` (with `Authorization: Bearer
/// token` if given): the body of a 200 reply, else None.
pub fn http_get(addr: &str, path: &str, token: Option<&str>) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    // A server that never answers must not hang the caller's wait.
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n{auth}\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    out.starts_with("HTTP/1.0 200").then_some(body)
}

/// The baselines the tests' VMM threads start from: two that differ from
/// each other and from a boost in policy and nice, so a thread left at
/// the other's baseline, or at any boosted state, is told apart.
pub const BASELINES: [SchedAttr; 2] = [
    SchedAttr {
        policy: POLICY_NORMAL,
        priority: 0,
        nice: 3,
        flags: 0,
        slice_ns: 0,
    },
    SchedAttr {
        policy: POLICY_BATCH,
        priority: 0,
        nice: 6,
        flags: 0,
        slice_ns: 0,
    },
];

/// One thread of this process per entry of [`BASELINES`], set to it and
/// sleeping 1 ms in a loop until the process ends: `(tid, baseline)` in
/// the order of [`BASELINES`].
pub fn baseline_threads() -> Vec<(u32, SchedAttr)> {
    BASELINES
        .into_iter()
        .map(|base| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let tid = sched::gettid();
                sched::set(tid, &base).unwrap();
                tx.send(tid).unwrap();
                loop {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            (rx.recv().unwrap(), base)
        })
        .collect()
}

/// `tids` as vCPUs 0, 1, ... with APIC IDs 0, 1, ...
pub fn vcpus(tids: impl IntoIterator<Item = u32>) -> Vec<Vcpu> {
    tids.into_iter()
        .enumerate()
        .map(|(i, tid)| Vcpu {
            tid,
            apic_id: i as u32,
        })
        .collect()
}

/// Every one of the `nr` slots of `region` asks for SCHED_FIFO 99 (the
/// caps decide what is granted).
pub fn ask_rt99(region: &RegionMap, nr: u32) {
    for i in 0..nr {
        region.write_guest(
            nr,
            i,
            &SlotGuest {
                policy: POLICY_FIFO,
                rt_prio: 99,
                ..Default::default()
            },
        );
    }
}
