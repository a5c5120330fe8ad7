//! `pvsched attach` and `pvsched detach`: give a running QEMU the pvsched
//! device, or take it away, with nothing on QEMU's command line.
//!
//! `attach` (root) resolves the VM as `qemu-attach` does (a libvirt
//! domain through libvirt's monitor, or QEMU's own QMP socket whose peer
//! must be `--pid`), then:
//!
//! 1. checks that QEMU can hot-plug `vfio-user-pci` (QEMU 10.1 or later)
//!    and finds where: a free PCI bridge port (a q35 machine's
//!    `pcie-root-port` with nothing behind it), or the root bus of a `pc`
//!    machine;
//! 2. starts the sandboxed device process for the VM, supervised: the
//!    systemd unit `pvsched-device@NAME.service` where systemd runs, else a
//!    process of its own (its pid file, socket and log in `--device-dir`),
//!    with the APIC IDs of QEMU's own topology and its socket given to
//!    QEMU's user before it appears; the device reserves the VM's region
//!    with pvschedd and serves it as BAR2;
//! 3. hot-plugs `vfio-user-pci` (id `pvsched0`) over the monitor;
//! 4. registers the vCPU threads with pvschedd in device-region mode;
//! 5. waits (`--wait-driver`) for the guest driver's DRIVER_OK, seen as the
//!    driver's ABI in pvschedd's status.
//!
//! Attaching an attached VM changes nothing. A QEMU that already has a
//! `vfio-user-pci` device (the by-hand recipe) is registered with it, not
//! given a second one. With `--or-caps-only` (the libvirt hook's choice) a
//! VM that cannot get the device is registered with its caps only, and the
//! reason is printed.
//!
//! `detach` reverses it: unregisters the VM (every thread back to its
//! baseline), unplugs the device (the guest's hot-plug driver releases it)
//! and stops the device process. Detaching a VM that has nothing attached
//! changes nothing.

use crate::exit::Exit;
use crate::monitor::{Monitor, Qmp};
use crate::qemu_attach::{Failed, QemuAttachArgs, VmTarget};
use clap::{Args, ValueEnum};
use pvsched_daemon::RegisterVm;
use pvsched_daemon::proto::Region;
use serde_json::{Value, json};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The QEMU device id pvsched's device is plugged as.
pub const DEVICE_ID: &str = "pvsched0";
/// The QEMU release whose `vfio-user-pci` pvsched's device needs.
const MIN_QEMU: (u64, u64) = (10, 1);
/// Where the systemd template unit is looked for (installed by the
/// package, or by an administrator under /etc).
const UNIT_DIRS: [&str; 3] = [
    "/etc/systemd/system",
    "/lib/systemd/system",
    "/usr/lib/systemd/system",
];
/// The systemd template unit of the device process.
const UNIT: &str = "pvsched-device@.service";
/// Longest wait for the device process's socket to appear.
const LISTEN_DEADLINE: Duration = Duration::from_secs(15);
/// How often a wait polls.
const POLL: Duration = Duration::from_millis(200);

/// How the device process is run.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Supervisor {
    /// systemd's unit where systemd runs and the unit is installed, else
    /// `child`.
    Auto,
    /// `pvsched-device@NAME.service` (started with `systemctl start`).
    Systemd,
    /// A process of its own, in its own session, its pid file and log in
    /// --device-dir.
    Child,
}

/// Where and how the device process runs.
#[derive(Args, Debug, Clone)]
pub struct DeviceDir {
    /// Directory of the device processes' sockets (NAME.sock), settings
    /// for the systemd unit (NAME.env), pid files and logs (NAME.pid,
    /// NAME.log; without systemd).
    #[arg(
        long,
        value_name = "DIR",
        env = "PVSCHED_DEVICE_DIR",
        default_value = "/run/pvsched/device"
    )]
    device_dir: PathBuf,
    /// How the device process is supervised.
    #[arg(long, value_enum, default_value = "auto")]
    supervisor: Supervisor,
}

/// `pvsched attach`.
#[derive(Args, Debug, Clone)]
pub struct AttachArgs {
    #[command(flatten)]
    pub(crate) vm: QemuAttachArgs,
    /// How long to wait for the guest driver's DRIVER_OK (`0s`: do not
    /// wait). A guest without the driver keeps the device and its caps;
    /// the exit status is 5.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) wait_driver: Duration,
    /// When the device cannot be given (QEMU older than 10.1, no free
    /// slot, the device process fails), register the VM with its caps
    /// only and say why, instead of failing (the libvirt hook's choice).
    #[arg(long)]
    pub(crate) or_caps_only: bool,
    #[command(flatten)]
    pub(crate) dir: DeviceDir,
}

/// `pvsched detach`.
#[derive(Args, Debug, Clone)]
pub struct DetachArgs {
    #[command(flatten)]
    pub(crate) target: VmTarget,
    /// How long the guest has to release the device.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) timeout: Duration,
    #[command(flatten)]
    pub(crate) dir: DeviceDir,
}

/// What QEMU has now, and where a device can go.
struct Slots {
    /// `pvsched0` is plugged.
    ours: bool,
    /// Another `vfio-user-pci` device's id (the by-hand recipe).
    other: Option<String>,
}

/// `qom-list /machine/peripheral`: what is plugged.
fn plugged(mon: &mut Monitor) -> Result<Slots, String> {
    let list = mon.execute("qom-list", Some(&json!({ "path": "/machine/peripheral" })))?;
    let mut s = Slots {
        ours: false,
        other: None,
    };
    for c in list.as_array().map(Vec::as_slice).unwrap_or_default() {
        let (name, ty) = (
            c["name"].as_str().unwrap_or(""),
            c["type"].as_str().unwrap_or(""),
        );
        if ty != "child<vfio-user-pci>" {
            continue;
        }
        if name == DEVICE_ID {
            s.ours = true;
        } else {
            s.other = Some(name.to_string());
        }
    }
    Ok(s)
}

/// An error when QEMU waits for an incoming migration (`query-status`):
/// its device set must stay the source's until the migration is done.
fn incoming(mon: &mut Monitor) -> Result<(), String> {
    let st = mon.execute("query-status", None)?;
    match st["status"].as_str() {
        Some("inmigrate") => Err(
            "QEMU is waiting for an incoming migration: a device plugged now would differ from \
             the source's; attach once the migration has completed"
                .into(),
        ),
        _ => Ok(()),
    }
}

/// QEMU's release (`query-version`): an error naming it when it cannot
/// hot-plug pvsched's device.
fn check_version(mon: &mut Monitor) -> Result<String, String> {
    let v = mon.execute("query-version", None)?;
    let q = &v["qemu"];
    let (maj, min, mic) = (
        q["major"].as_u64().unwrap_or(0),
        q["minor"].as_u64().unwrap_or(0),
        q["micro"].as_u64().unwrap_or(0),
    );
    let version = format!("{maj}.{min}.{mic}");
    if (maj, min) < MIN_QEMU {
        return Err(format!(
            "QEMU {version} has no vfio-user-pci (QEMU {}.{} or later has): the device cannot \
             be attached",
            MIN_QEMU.0, MIN_QEMU.1
        ));
    }
    Ok(version)
}

/// Where to plug: `Some(bus)` (a free bridge port's id) or `None` (the
/// root bus of a `pc` machine, where QEMU picks a free slot).
fn pick_bus(mon: &mut Monitor) -> Result<Option<String>, String> {
    let buses = mon.execute("query-pci", None)?;
    let mut free = Vec::new();
    fn walk(devs: &[Value], free: &mut Vec<String>) {
        for d in devs {
            if let Some(b) = d.get("pci_bridge") {
                let below = b["devices"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let id = d["qdev_id"].as_str().unwrap_or("");
                if below.is_empty() && !id.is_empty() {
                    free.push(id.to_string());
                }
                walk(below, free);
            }
        }
    }
    for b in buses.as_array().map(Vec::as_slice).unwrap_or_default() {
        walk(
            b["devices"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default(),
            &mut free,
        );
    }
    if let Some(id) = free.into_iter().next() {
        return Ok(Some(id));
    }
    let machine = mon
        .execute(
            "qom-get",
            Some(&json!({ "path": "/machine", "property": "type" })),
        )?
        .as_str()
        .unwrap_or("")
        .to_string();
    if machine.contains("q35") {
        return Err(format!(
            "no free PCIe root port on this {machine}: a q35 machine hot-plugs only into an \
             empty pcie-root-port (libvirt: add <controller type='pci' index='N' \
             model='pcie-root-port'/>, N above the domain's other PCI controllers; QEMU: \
             -device pcie-root-port,id=rp1,bus=pcie.0,chassis=1)"
        ));
    }
    Ok(None)
}

/// The process's effective uid and gid (/proc/PID/status).
fn owner_of(pid: u32) -> Result<(u32, u32), String> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    match (field("Uid:"), field("Gid:")) {
        (Some(u), Some(g)) => Ok((u, g)),
        _ => Err(format!("{path}: no Uid/Gid lines")),
    }
}

/// systemd's escaping of a unit instance, for the characters a VM name
/// may hold (`[A-Za-z0-9._-]`, not `.`-led): `-` is `\x2d`.
fn unit_of(name: &str) -> String {
    format!("pvsched-device@{}.service", name.replace('-', "\\x2d"))
}

impl DeviceDir {
    fn socket(&self, name: &str) -> PathBuf {
        self.device_dir.join(format!("{name}.sock"))
    }
    fn file(&self, name: &str, ext: &str) -> PathBuf {
        self.device_dir.join(format!("{name}.{ext}"))
    }

    /// systemd runs this host and the template unit is installed.
    fn systemd(&self) -> Result<bool, String> {
        let has_unit = UNIT_DIRS.iter().any(|d| Path::new(d).join(UNIT).exists());
        let runs = Path::new("/run/systemd/system").is_dir();
        match self.supervisor {
            Supervisor::Auto => Ok(runs && has_unit),
            Supervisor::Child => Ok(false),
            Supervisor::Systemd if runs && has_unit => Ok(true),
            Supervisor::Systemd => Err(format!(
                "--supervisor systemd: {}",
                if runs {
                    format!("{UNIT} is not installed (the Debian package installs it)")
                } else {
                    "systemd is not running on this host".into()
                }
            )),
        }
    }

    /// Starts VM `name`'s device process with `args`; returns once its
    /// socket listens, or why not.
    fn start(&self, name: &str, args: &[String]) -> Result<(), String> {
        std::fs::create_dir_all(&self.device_dir)
            .map_err(|e| format!("{}: {e}", self.device_dir.display()))?;
        let sock = self.socket(name);
        // A socket left by a device process that never got its client.
        let _ = std::fs::remove_file(&sock);
        let start = Instant::now();
        if self.systemd()? {
            let env = self.file(name, "env");
            std::fs::write(&env, format!("PVSCHED_DEVICE_ARGS={}\n", args.join(" ")))
                .map_err(|e| format!("{}: {e}", env.display()))?;
            let unit = unit_of(name);
            systemctl(&["start", &unit])?;
            while !sock.exists() {
                if start.elapsed() > LISTEN_DEADLINE
                    || systemctl(&["is-active", "--quiet", &unit]).is_err()
                {
                    let _ = systemctl(&["stop", &unit]);
                    return Err(format!(
                        "the device process ({unit}) did not listen on {} within {LISTEN_DEADLINE:?} \
                         (journalctl -u '{unit}' says why)",
                        sock.display()
                    ));
                }
                std::thread::sleep(POLL / 4);
            }
            return Ok(());
        }
        let log_path = self.file(name, "log");
        let log =
            std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
        let err = log
            .try_clone()
            .map_err(|e| format!("{}: {e}", log_path.display()))?;
        let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
        let mut child = Command::new(exe)
            .arg("device")
            .args(args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            // A process group of its own: it outlives this command, and a
            // signal to the caller's group (a terminal's ^C) does not reach it.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("starting the device process: {e}"))?;
        let pid_file = self.file(name, "pid");
        std::fs::write(&pid_file, format!("{}\n", child.id()))
            .map_err(|e| format!("{}: {e}", pid_file.display()))?;
        while !sock.exists() {
            let gone = child.try_wait().ok().flatten();
            if gone.is_some() || start.elapsed() > LISTEN_DEADLINE {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_file(&pid_file);
                return Err(format!(
                    "the device process {} without listening on {}: {}",
                    gone.map_or("timed out".into(), |s| format!("exited ({s})")),
                    sock.display(),
                    tail(&log_path)
                ));
            }
            std::thread::sleep(POLL / 4);
        }
        Ok(())
    }

    /// Stops VM `name`'s device process, if one runs, and removes its
    /// files. The process ends by itself when QEMU lets go of the device;
    /// this covers one that never got (or kept) its client.
    fn stop(&self, name: &str) {
        if self.systemd().unwrap_or(false) {
            let _ = systemctl(&["stop", &unit_of(name)]);
        } else if let Some(pid) = self.child_pid(name) {
            use nix::sys::signal::{Signal, kill};
            let target = nix::unistd::Pid::from_raw(pid as i32);
            let _ = kill(target, Signal::SIGTERM);
            // Until it is gone or a zombie (whose command line is empty:
            // `child_pid` no longer finds it); SIGKILL after 5 s.
            let start = Instant::now();
            while self.child_pid(name) == Some(pid) {
                if start.elapsed() > Duration::from_secs(5) {
                    let _ = kill(target, Signal::SIGKILL);
                    break;
                }
                std::thread::sleep(POLL / 4);
            }
        }
        for ext in ["sock", "pid", "env"] {
            let _ = std::fs::remove_file(self.file(name, ext));
        }
    }

    /// The pid in NAME.pid, if that process is still `pvsched device`
    /// for this VM's socket (a pid file outlives its process; the pid may
    /// have been reused).
    fn child_pid(&self, name: &str) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.file(name, "pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let want = self.socket(name);
        let ours = cmdline
            .split(|&b| b == 0)
            .any(|a| a == want.as_os_str().as_encoded_bytes());
        ours.then_some(pid)
    }
}

/// `systemctl ARGS`: Ok if it succeeded.
fn systemctl(args: &[&str]) -> Result<(), String> {
    let out = Command::new("systemctl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("systemctl {}: {e}", args.join(" ")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "systemctl {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}

/// The last lines of a log, for a message.
fn tail(path: &Path) -> String {
    let mut buf = Vec::new();
    let _ = std::fs::File::open(path).and_then(|f| f.take(1 << 16).read_to_end(&mut buf));
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let shown: Vec<&str> = lines.into_iter().rev().collect();
    format!("{} (log: {})", shown.join(" | "), path.display())
}

/// The monitor `a` names; for a QMP socket, its peer must be `pid`.
fn monitor(a: &VmTarget, pid: u32) -> Result<Monitor, String> {
    match (&a.libvirt, &a.qmp) {
        (Some(domain), _) => Ok(Monitor::Libvirt {
            virsh: a.virsh(),
            domain: domain.clone(),
        }),
        (None, Some(path)) => qmp_of(path, pid),
        (None, None) => Err("--qmp or --libvirt is needed".into()),
    }
}

pub(crate) fn qmp_of(path: &Path, pid: u32) -> Result<Monitor, String> {
    let q = Qmp::open(path).map_err(|e| e.to_string())?;
    let peer = q.peer_pid().map_err(|e| e.to_string())?;
    if peer != pid {
        return Err(format!(
            "QMP {}: the socket is served by process {peer}, not QEMU {pid}",
            path.display()
        ));
    }
    Ok(Monitor::Qmp(q))
}

/// Whether pvschedd has VM `name` registered; its guest ABI if a driver
/// attached.
fn registered(socket: &Path, name: &str) -> Result<Option<Option<String>>, Failed> {
    let failed =
        |e: pvsched_daemon::ClientError| (crate::daemon_cli::exit_for(&e), format!("{name}: {e}"));
    let mut c = pvsched_daemon::Client::connect(socket).map_err(failed)?;
    let (_, vms) = c.status().map_err(failed)?;
    Ok(vms
        .into_iter()
        .find(|v| v.name == name)
        .map(|v| v.guest_abi))
}

/// Runs `pvsched attach`.
pub fn attach(a: &AttachArgs) -> Exit {
    match attach_inner(a) {
        Ok(code) => code,
        Err((code, e)) => {
            eprintln!("pvsched attach: {e}");
            code
        }
    }
}

pub(crate) fn attach_inner(a: &AttachArgs) -> Result<Exit, Failed> {
    let fail = |e: String| (Exit::Failure, e);
    let Some((mut reg, said)) = crate::qemu_attach::registration(&a.vm)? else {
        return Ok(Exit::Ok);
    };
    if said == Some(false) {
        // The domain's metadata asks for caps only.
        reg.region = Region::None;
        crate::qemu_attach::register(&a.vm, reg, "; caps only: region=\"none\" in its metadata")?;
        return Ok(Exit::Ok);
    }
    let name = reg.name.clone();
    let pid = reg.pid.unwrap_or(0);
    let socket = a.vm.target.socket.socket.clone();
    // pvschedd first: without it nothing below can be kept.
    let before = registered(&socket, &name)?;
    let mut mon = monitor(&a.vm.target, pid).map_err(fail)?;
    let caps_only = |mut reg: RegisterVm, why: &str| -> Result<Exit, Failed> {
        reg.region = Region::None;
        crate::qemu_attach::register(&a.vm, reg, &format!("; caps only: {why}"))?;
        Ok(Exit::Ok)
    };
    let now = match plugged(&mut mon).and_then(|now| incoming(&mut mon).map(|()| now)) {
        Ok(now) => now,
        Err(why) if a.or_caps_only => return caps_only(reg, &why),
        Err(why) => return Err(fail(format!("{name}: {why}"))),
    };
    if before.is_some() && !now.ours && now.other.is_none() {
        println!(
            "{name}: already registered with pvschedd without a device (caps only); nothing \
             changed (`pvsched vm unregister {name}`, then attach, gives it the device)"
        );
        return Ok(Exit::Ok);
    }
    if now.ours || now.other.is_some() {
        reg.region = Region::Reserved;
        if before.is_some() {
            println!("{name}: already attached (device {DEVICE_ID}); nothing changed");
            return Ok(Exit::Ok);
        }
        // QEMU has the device (plugged by an earlier attach whose
        // registration ended, or on its command line): register only.
        let how = match &now.other {
            Some(id) if !now.ours => format!("; the device {id} QEMU already has"),
            _ => format!("; device {DEVICE_ID} already plugged"),
        };
        crate::qemu_attach::register(&a.vm, reg, &how)?;
        return wait_driver(a, &socket, &name);
    }
    // Give the device, or say why not.
    match plug(a, &mut mon, &reg) {
        Ok(how) => {
            reg.region = Region::Reserved;
            if let Err(e) = crate::qemu_attach::register(&a.vm, reg, &how) {
                // Leave nothing behind for a registration that failed.
                let _ = unplug(&mut mon, &name, Duration::from_secs(10));
                a.dir.stop(&name);
                return Err(e);
            }
            wait_driver(a, &socket, &name)
        }
        Err(why) if a.or_caps_only => caps_only(reg, &why),
        Err(why) => Err(fail(format!("{name}: {why}"))),
    }
}

/// Starts the device process and hot-plugs it; what was done, or why not
/// (then nothing is left running).
fn plug(a: &AttachArgs, mon: &mut Monitor, reg: &RegisterVm) -> Result<String, String> {
    let name = &reg.name;
    let version = check_version(mon)?;
    let bus = pick_bus(mon)?;
    let (uid, gid) = owner_of(reg.pid.unwrap_or(0))?;
    let apic: Vec<String> = reg.vcpus.iter().map(|v| v.apic_id.to_string()).collect();
    let sock = a.dir.socket(name);
    let args = vec![
        "--transport".into(),
        "vfio-user".into(),
        "--socket".into(),
        sock.display().to_string(),
        "--vcpus".into(),
        reg.vcpus.len().to_string(),
        "--apic-ids".into(),
        apic.join(","),
        "--daemon-region".into(),
        name.clone(),
        "--daemon-socket".into(),
        a.vm.target.socket.socket.display().to_string(),
        "--socket-owner".into(),
        format!("{uid}:{gid}"),
    ];
    a.dir.start(name, &args)?;
    let mut dev = json!({
        "driver": "vfio-user-pci",
        "id": DEVICE_ID,
        "socket": { "type": "unix", "path": sock.display().to_string() },
    });
    if let Some(b) = &bus {
        dev["bus"] = json!(b);
    }
    if let Err(e) = mon.execute("device_add", Some(&dev)) {
        a.dir.stop(name);
        // The device process reserved the region; drop it with the device.
        if let Ok(mut c) = pvsched_daemon::Client::connect(&a.vm.target.socket.socket) {
            let _ = c.unregister(name);
        }
        return Err(format!("device_add {DEVICE_ID}: {e}"));
    }
    Ok(format!(
        "; device {DEVICE_ID} hot-plugged into QEMU {version} {}, APIC IDs {}",
        bus.map_or("on the root bus".to_string(), |b| format!("behind {b}")),
        apic.join(",")
    ))
}

/// Waits for the guest driver's DRIVER_OK (its ABI in pvschedd's status).
fn wait_driver(a: &AttachArgs, socket: &Path, name: &str) -> Result<Exit, Failed> {
    if a.wait_driver.is_zero() {
        return Ok(Exit::Ok);
    }
    let start = Instant::now();
    loop {
        match registered(socket, name)? {
            Some(Some(abi)) => {
                println!("{name}: the guest driver attached (ABI {abi})");
                return Ok(Exit::Ok);
            }
            None => {
                return Err((
                    Exit::Failure,
                    format!("{name}: no longer registered with pvschedd"),
                ));
            }
            Some(None) if start.elapsed() >= a.wait_driver => {
                println!(
                    "{name}: no guest driver answered within {}: the VM keeps its caps (halt and \
                     IPI boosts) and the device, so a driver loaded later reports through it",
                    humantime::format_duration(a.wait_driver)
                );
                return Ok(Exit::Guest);
            }
            Some(None) => std::thread::sleep(POLL),
        }
    }
}

/// Unplugs `pvsched0` and waits up to `timeout` for the guest to release
/// it; whether it is gone.
fn unplug(mon: &mut Monitor, name: &str, timeout: Duration) -> Result<bool, String> {
    match mon.execute("device_del", Some(&json!({ "id": DEVICE_ID }))) {
        Ok(_) => {}
        // Already gone (an earlier detach whose guest released it late).
        Err(e) if e.contains("not found") => return Ok(true),
        Err(e) => return Err(format!("{name}: device_del {DEVICE_ID}: {e}")),
    }
    let start = Instant::now();
    loop {
        if !plugged(mon)?.ours {
            return Ok(true);
        }
        if start.elapsed() >= timeout {
            return Ok(false);
        }
        std::thread::sleep(POLL);
    }
}

/// Runs `pvsched detach`.
pub fn detach(a: &DetachArgs) -> Exit {
    match detach_inner(a) {
        Ok(code) => code,
        Err((code, e)) => {
            eprintln!("pvsched detach: {e}");
            code
        }
    }
}

pub(crate) fn detach_inner(a: &DetachArgs) -> Result<Exit, Failed> {
    let fail = |e: String| (Exit::Failure, e);
    let t = &a.target;
    let name = t.vm_name()?;
    let mut done = Vec::new();
    // First the registration: every thread back to its baseline.
    let mut c = pvsched_daemon::Client::connect(&t.socket.socket)
        .map_err(|e| (crate::daemon_cli::exit_for(&e), e.to_string()))?;
    match c.unregister(&name) {
        Ok(()) => done.push("unregistered (its threads are at their baseline)".to_string()),
        Err(pvsched_daemon::ClientError::Refused {
            kind: pvsched_daemon::proto::ErrorKind::UnknownVm,
            ..
        }) => {}
        Err(e) => return Err((crate::daemon_cli::exit_for(&e), format!("{name}: {e}"))),
    }
    // Then the device, if QEMU still runs.
    // (A QMP socket that is gone: QEMU with it.)
    let mon = match (&t.libvirt, &t.qmp) {
        (None, Some(path)) if !path.exists() => None,
        _ => Some(monitor(t, t.pid.unwrap_or(0)).map_err(fail)?),
    };
    let mut left = None;
    if let Some(mut mon) = mon {
        match plugged(&mut mon) {
            Ok(s) if s.ours => match unplug(&mut mon, &name, a.timeout).map_err(fail)? {
                true => done.push(format!("device {DEVICE_ID} unplugged")),
                false => {
                    left = Some(format!(
                        "{name}: the guest did not release device {DEVICE_ID} within {} (a guest \
                         still in its firmware, or without PCI hot-plug, cannot); it stays \
                         plugged, unregistered: run detach again later",
                        humantime::format_duration(a.timeout)
                    ))
                }
            },
            Ok(_) => {}
            // QEMU gone: only the device process is left to stop.
            Err(e) if t.libvirt.is_some() && e.contains("not running") => {}
            Err(e) => return Err(fail(format!("{name}: {e}"))),
        }
    }
    if left.is_none() {
        let running = a.dir.child_pid(&name).is_some() || a.dir.socket(&name).exists();
        a.dir.stop(&name);
        if running {
            done.push("device process stopped".into());
        }
    }
    if done.is_empty() && left.is_none() {
        println!("{name}: nothing attached; nothing changed");
    } else if !done.is_empty() {
        println!("{name}: {}", done.join(", "));
    }
    match left {
        Some(e) => Err(fail(e)),
        None => Ok(Exit::Ok),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_instances_are_escaped_as_systemd_does() {
        assert_eq!(unit_of("web1"), "pvsched-device@web1.service");
        assert_eq!(unit_of("web-1.a_b"), "pvsched-device@web\\x2d1.a_b.service");
    }

    #[test]
    fn owner_is_the_effective_ids() {
        let (u, g) = owner_of(std::process::id()).expect("own status");
        assert_eq!(u, nix::unistd::geteuid().as_raw());
        assert_eq!(g, nix::unistd::getegid().as_raw());
    }
}
