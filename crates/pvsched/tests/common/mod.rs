//! Helpers shared by the device-mode tests: the two device modes (the
//! sandboxed one runs this package's `pvsched device`), capability checks,
//! bounded waits, and a policy sink that records what the device told it.

#![allow(dead_code)]

use pvsched_device::{PolicySink, RegionInfo};
use pvsched_vmm::{DeviceMode, DeviceProgram};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bound for waits on the guest (bounded waits, not timing assertions).
pub const LIMIT: Duration = Duration::from_secs(30);

/// The device in this process.
pub fn in_process() -> DeviceMode {
    DeviceMode::InProcess
}

/// The device as `pvsched device` (this package's binary), sandboxed.
pub fn sandboxed() -> DeviceMode {
    DeviceMode::Sandboxed(DeviceProgram::new(
        env!("CARGO_BIN_EXE_pvsched"),
        ["device"],
    ))
}

#[allow(unused_imports)] // not every test binary uses both
pub use pvsched_testkit::{skip_or_fail, wait_for};

/// Whether /dev/kvm works; SKIP (or fail under PVSCHED_REQUIRE_REAL=1) if not.
pub fn kvm(test: &str) -> bool {
    match pvsched_vmm::open_kvm() {
        Ok(_) => true,
        Err(e) => skip_or_fail(test, &format!("KVM is unusable: {e}")),
    }
}

/// Whether root, /dev/kvm and BPF are there; SKIP (or fail) if not.
pub fn kvm_root_bpf(test: &str) -> bool {
    if !kvm(test) {
        return false;
    }
    if !pvsched_testkit::root(test, "the BPF policy") {
        return false;
    }
    match pvsched_agent::PolicyObject::load(false) {
        Ok(_) => true,
        Err(e) => skip_or_fail(test, &format!("BPF unavailable: {e}")),
    }
}

/// Whether root and BPF are there (no KVM needed); SKIP (or fail) if not.
pub fn root_bpf(test: &str) -> bool {
    if !pvsched_testkit::root(test, "the BPF policy") {
        return false;
    }
    match pvsched_agent::PolicyObject::load(false) {
        Ok(_) => true,
        Err(e) => skip_or_fail(test, &format!("BPF unavailable: {e}")),
    }
}

/// Whether `program` runs (`program --version`); SKIP (or fail) if not.
pub fn have_program(test: &str, program: &str) -> bool {
    match std::process::Command::new(program)
        .arg("--version")
        .output()
    {
        Ok(o) if o.status.success() => true,
        _ => skip_or_fail(
            test,
            &format!("{program} is not installed (scripts/setup installs it)"),
        ),
    }
}

/// What the device reported to the host policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkEvent {
    /// `region_attached` (mode, generation, guest address).
    Attached(pvsched_device::RegionMode, u32, u64),
    /// `region_detached`.
    Detached,
    /// `kick(slot)`.
    Kick(u32),
}

/// A policy sink that records every call and publishes `host_flags`.
#[derive(Default)]
pub struct Recorder {
    /// Calls in order.
    pub events: Mutex<Vec<SinkEvent>>,
    /// What `host_flags` answers.
    pub flags: u32,
}

impl Recorder {
    /// The calls so far.
    pub fn events(&self) -> Vec<SinkEvent> {
        self.events.lock().unwrap().clone()
    }
}

impl PolicySink for Recorder {
    fn region_attached(&self, r: &RegionInfo) {
        self.events
            .lock()
            .unwrap()
            .push(SinkEvent::Attached(r.mode, r.generation, r.guest_addr));
    }

    fn region_detached(&self) {
        self.events.lock().unwrap().push(SinkEvent::Detached);
    }

    fn kick(&self, slot: u32) {
        self.events.lock().unwrap().push(SinkEvent::Kick(slot));
    }

    fn host_flags(&self) -> u32 {
        self.flags
    }
}

/// Children of process `pid` with `needle` as one of their arguments.
pub fn children_with(pid: u32, needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{child}/status")) else {
            continue;
        };
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|v| v.trim().parse::<u32>().ok());
        if ppid != Some(pid) {
            continue;
        }
        // One whole argument, not a substring: the agent's guardian is a
        // fork of `pvsched run` whose arguments include `--device-mode`.
        let cmd = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
        if cmd.split(|&b| b == 0).any(|arg| arg == needle.as_bytes()) {
            out.push(child);
        }
    }
    out
}

/// TIDs of process `pid`'s threads named `vcpu N`, by N.
pub fn vcpu_threads(pid: u32) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let comm =
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap_or_default();
        if let Some(n) = comm
            .trim()
            .strip_prefix("vcpu ")
            .and_then(|n| n.parse().ok())
        {
            out.push((n, tid));
        }
    }
    out.sort_unstable();
    out
}

/// A pvschedd process (the binary built beside `pvsched`) with its own
/// socket and an empty VM directory; killed on drop.
pub struct Pvschedd {
    child: std::process::Child,
    dir: std::path::PathBuf,
    /// Its socket.
    pub socket: std::path::PathBuf,
}

impl Pvschedd {
    /// Starts it and waits for its socket.
    pub fn start(tag: &str) -> Pvschedd {
        let bin = std::path::Path::new(env!("CARGO_BIN_EXE_pvsched")).with_file_name("pvschedd");
        assert!(
            bin.exists(),
            "{} missing: build the workspace (cargo build -p pvsched-daemon)",
            bin.display()
        );
        let dir = std::env::temp_dir().join(format!("pvsched-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("vms")).unwrap();
        let socket = dir.join("pvschedd.sock");
        let cfg = dir.join("pvschedd.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket = {socket:?}\nsocket_group = \"\"\nvm_dir = {:?}\nmetrics_listen = \"\"\n",
                dir.join("vms")
            ),
        )
        .unwrap();
        let child = std::process::Command::new(bin)
            .arg("--config")
            .arg(&cfg)
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap();
        let d = Pvschedd { child, dir, socket };
        wait_for("pvschedd's socket", LIMIT, || {
            pvsched_daemon::Client::connect(&d.socket).ok()
        });
        d
    }
}

impl Pvschedd {
    /// Writes VM `name`'s caps file.
    pub fn vm_file(&self, name: &str, caps: &str) {
        std::fs::write(self.dir.join("vms").join(format!("{name}.toml")), caps).unwrap();
    }
}

impl Drop for Pvschedd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
