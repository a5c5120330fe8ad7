//! `pvsched doctor`: whether this host can run pvsched, one line per
//! check, each failed or doubtful one with what to do (docs/operating.md,
//! "What a node needs"). The checks read the host as it is (files under
//! /proc and /sys, QEMU's `--version`, pvschedd's socket) and load the
//! BPF policy without attaching it; they change nothing.

use crate::daemon_cli::SocketArg;
use crate::exit::Exit;
use clap::Args;
use serde::Serialize;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `pvsched doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[command(flatten)]
    socket: SocketArg,
    /// One JSON object per check instead of the table.
    #[arg(long)]
    json: bool,
    /// Do not load the BPF policy (the check that needs root).
    #[arg(long)]
    no_bpf: bool,
    /// The QEMU binary to check (default: the first of
    /// qemu-system-x86_64 in PATH, /usr/libexec/qemu-kvm).
    #[arg(long)]
    qemu: Option<PathBuf>,
}

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// As pvsched needs it.
    Ok,
    /// Not checked, or nothing to judge (what is there is said).
    Info,
    /// pvsched runs, with less (the line says what is lost).
    Warn,
    /// pvsched cannot run as configured.
    Fail,
}

impl Level {
    fn word(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        }
    }
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// How it came out.
    pub level: Level,
    /// What was found.
    pub found: String,
    /// What to do (for a warning or a failure).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub todo: Option<String>,
}

fn check(name: &str, level: Level, found: impl Into<String>, todo: Option<&str>) -> Check {
    Check {
        name: name.into(),
        level,
        found: found.into(),
        todo: todo.map(String::from),
    }
}

/// `major.minor` of a version string that starts with them ("6.18.0-1-amd64",
/// "11.1.3").
fn major_minor(v: &str) -> Option<(u32, u32)> {
    let mut it = v.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// The host kernel, from its release string.
pub fn kernel(release: &str) -> Check {
    let release = release.trim();
    match major_minor(release) {
        None => check(
            "kernel",
            Level::Warn,
            format!("cannot read the version of '{release}'"),
            Some("pvsched needs Linux >= 5.17 (bpf_loop); check `uname -r`"),
        ),
        Some(v) if v < (5, 17) => check(
            "kernel",
            Level::Fail,
            format!("Linux {release}: no bpf_loop"),
            Some("the policy needs Linux >= 5.17; run pvschedd on a newer kernel"),
        ),
        Some(v) if v < (6, 9) => check(
            "kernel",
            Level::Warn,
            format!("Linux {release}: no thread pidfds"),
            Some(
                "a reused TID is told apart by the thread's start time only; Linux >= 6.9 \
                 makes it airtight",
            ),
        ),
        Some(_) => check(
            "kernel",
            Level::Ok,
            format!("Linux {release}: bpf_loop, thread pidfds"),
            None,
        ),
    }
}

/// The kernel's BTF, which the policy's programs are relocated against.
pub fn btf(path: &Path) -> Check {
    if path.exists() {
        check("btf", Level::Ok, path.display().to_string(), None)
    } else {
        check(
            "btf",
            Level::Fail,
            format!("{} does not exist", path.display()),
            Some("the policy needs a kernel built with CONFIG_DEBUG_INFO_BTF=y"),
        )
    }
}

/// The kernel's RT bandwidth, `sched_rt_runtime_us` of `sched_rt_period_us`.
pub fn rt_bandwidth(runtime: Option<&str>, period: Option<&str>) -> Check {
    let parse = |s: Option<&str>| s.and_then(|s| s.trim().parse::<i64>().ok());
    match (parse(runtime), parse(period)) {
        (Some(-1), _) => check(
            "rt-bandwidth",
            Level::Warn,
            "sched_rt_runtime_us = -1: RT throttling is off",
            Some(
                "pvsched's own budgets still bound every boost and phase, but any other RT \
                 thread can hold a CPU for ever; the kernel's default is 950000",
            ),
        ),
        (Some(r), Some(p)) if p > 0 && r * 100 < p * 95 => check(
            "rt-bandwidth",
            Level::Warn,
            format!("sched_rt_runtime_us {r} of {p}: below the kernel's 95 %"),
            Some(
                "boosts and co-scheduled phases are cut when the CPU's RT time runs out; \
                 pvsched is measured with the default (950000 of 1000000)",
            ),
        ),
        (Some(r), Some(p)) => check(
            "rt-bandwidth",
            Level::Ok,
            format!("sched_rt_runtime_us {r} of {p}"),
            None,
        ),
        _ => check(
            "rt-bandwidth",
            Level::Info,
            "cannot read /proc/sys/kernel/sched_rt_{runtime,period}_us",
            None,
        ),
    }
}

/// The cgroup hierarchy: pvsched needs none, the line says which.
pub fn cgroup(unified: bool) -> Check {
    if unified {
        check("cgroup", Level::Ok, "v2 (unified)", None)
    } else {
        check(
            "cgroup",
            Level::Info,
            "v1 or hybrid (pvsched sets no cgroup; fine either way)",
            None,
        )
    }
}

/// The QEMU that will run the VMs, from its `--version` output.
pub fn qemu(path: Option<&Path>, version_output: Option<&str>) -> Check {
    let Some(path) = path else {
        return check(
            "qemu",
            Level::Info,
            "no qemu-system-x86_64 in PATH (give --qemu PATH to check another)",
            None,
        );
    };
    let v = version_output
        .and_then(|o| o.split("version ").nth(1))
        .map(|s| s.split_whitespace().next().unwrap_or("").to_string());
    match v.as_deref().and_then(major_minor) {
        None => check(
            "qemu",
            Level::Warn,
            format!("{}: no version from --version", path.display()),
            Some("run it with --version by hand"),
        ),
        Some(mm) if mm < (10, 1) => check(
            "qemu",
            Level::Warn,
            format!(
                "{} {}: no vfio-user-pci client",
                path.display(),
                v.unwrap_or_default()
            ),
            Some(
                "its VMs get caps and boosts but no guest hints; the pvsched device needs \
                 QEMU >= 10.1",
            ),
        ),
        Some(_) => check(
            "qemu",
            Level::Ok,
            format!(
                "{} {}: vfio-user-pci (the pvsched device can attach)",
                path.display(),
                v.unwrap_or_default()
            ),
            None,
        ),
    }
}

/// The libvirt hook: installed, executable, and read by the running
/// libvirt daemon (which finds hooks only when it starts). `hook_mtime`
/// and `daemon_start` are seconds since the epoch.
pub fn libvirt_hook(
    libvirt: bool,
    hook: &Path,
    executable: Option<bool>,
    hook_mtime: Option<u64>,
    daemon: Option<(&str, u64)>,
) -> Check {
    if !libvirt {
        return check(
            "libvirt-hook",
            Level::Info,
            "no /etc/libvirt: libvirt is not installed",
            None,
        );
    }
    match executable {
        None => {
            return check(
                "libvirt-hook",
                Level::Warn,
                format!("{} is not installed", hook.display()),
                Some(
                    "libvirt domains are not registered with pvschedd: install the host \
                     package, or dist/libvirt/qemu.d/pvsched there (mode 0755), then restart \
                     libvirtd (or virtqemud)",
                ),
            );
        }
        Some(false) => {
            return check(
                "libvirt-hook",
                Level::Warn,
                format!("{} is not executable", hook.display()),
                Some("chmod 0755 it, then restart libvirtd (or virtqemud)"),
            );
        }
        Some(true) => {}
    }
    match (daemon, hook_mtime) {
        (None, _) => check(
            "libvirt-hook",
            Level::Info,
            format!(
                "{} installed; no libvirtd or virtqemud runs",
                hook.display()
            ),
            None,
        ),
        (Some((name, started)), Some(m)) if m > started => check(
            "libvirt-hook",
            Level::Warn,
            format!(
                "{} changed after {name} started: {name} does not run it yet",
                hook.display()
            ),
            Some("systemctl restart libvirtd (or virtqemud); running domains are not touched"),
        ),
        (Some((name, _)), _) => check(
            "libvirt-hook",
            Level::Ok,
            format!("{} installed, read by {name}", hook.display()),
            None,
        ),
    }
}

/// pvschedd's answer on its socket, and each VM it serves.
fn daemon(socket: &Path) -> Vec<Check> {
    let (d, vms) = match pvsched_daemon::Client::connect(socket).and_then(|mut c| c.status()) {
        Ok(s) => s,
        Err(e) => {
            return vec![check(
                "pvschedd",
                Level::Fail,
                format!("{e}"),
                Some(
                    "no VM is boosted without it: `systemctl status pvschedd`, `journalctl -u \
                     pvschedd`; as another user, join the socket's group",
                ),
            )];
        }
    };
    let answers = format!(
        "pvschedd {} (ABI {}) pid {} answers on {}: {} VM(s), metrics {}",
        d.version,
        d.abi,
        d.pid,
        socket.display(),
        vms.len(),
        if d.metrics.is_empty() {
            "-"
        } else {
            &d.metrics
        }
    );
    // A package upgrade whose restart did not happen (or failed) leaves
    // the old daemon serving: worth saying, not blocking.
    let mut out = vec![if d.version == pvsched_daemon::proto::VERSION {
        check("pvschedd", Level::Ok, answers, None)
    } else {
        check(
            "pvschedd",
            Level::Warn,
            format!(
                "{answers}; this pvsched is {}",
                pvsched_daemon::proto::VERSION
            ),
            Some(
                "the running daemon is not the installed one: `systemctl restart pvschedd` \
                 (detached VMs, those of libvirt and qemu-attach, are registered again)",
            ),
        )
    }];
    for vm in &vms {
        out.push(vm_check(
            &vm.name,
            &vm.region,
            vm.guest_features,
            vm.guest_abi.as_deref(),
        ));
    }
    out
}

/// One VM's guest side: whether its guest driver reports.
pub fn vm_check(
    name: &str,
    region: &str,
    guest_features: Option<u64>,
    guest_abi: Option<&str>,
) -> Check {
    let what = format!("vm {name}");
    match (region, guest_features) {
        ("none", _) => check(
            &what,
            Level::Info,
            "no device region: caps and host-side boosts only",
            None,
        ),
        (_, Some(f)) => check(
            &what,
            Level::Ok,
            format!(
                "region {region}, guest driver ABI {}, features {f:#x}",
                guest_abi.unwrap_or("unknown (device before 1.6)")
            ),
            None,
        ),
        (_, None) => check(
            &what,
            Level::Warn,
            format!("region {region}, no guest driver attached"),
            Some(
                "the guest gets no hints until its pvsched driver binds: install the DKMS \
                 package in the image (docs/guest-driver.md), `modprobe pvsched`",
            ),
        ),
    }
}

/// Loads every program of the policy without attaching any.
fn bpf(skip: bool) -> Check {
    if skip {
        return check("bpf-policy", Level::Info, "not loaded (--no-bpf)", None);
    }
    // SAFETY: geteuid takes no argument and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return check(
            "bpf-policy",
            Level::Info,
            "not loaded: loading BPF needs root (pvschedd's unit grants CAP_BPF CAP_PERFMON \
             CAP_SYS_NICE CAP_SYS_RESOURCE CAP_CHOWN)",
            None,
        );
    }
    match pvsched_agent::object::PolicyObject::verify() {
        Ok(()) => check(
            "bpf-policy",
            Level::Ok,
            "every program loads (the kernel's verifier accepts it); none attached",
            None,
        ),
        Err(e) => check(
            "bpf-policy",
            Level::Fail,
            format!("{e}"),
            Some("pvschedd cannot start here (exit 6): the message names the program and why"),
        ),
    }
}

/// The first `name` in PATH.
fn in_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The running libvirt daemon that runs QEMU hooks and when it started.
fn libvirt_daemon() -> Option<(String, u64)> {
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        let comm = comm.trim();
        if comm == "libvirtd" || comm == "virtqemud" {
            return pvsched_agent::guardian::start_unix_s(pid)
                .map(|s| (comm.to_string(), s as u64));
        }
    }
    None
}

/// Every check, in order.
pub fn run_checks(a: &DoctorArgs) -> Vec<Check> {
    let read = |p: &str| fs::read_to_string(p).ok();
    let mut out = vec![
        kernel(&read("/proc/sys/kernel/osrelease").unwrap_or_default()),
        btf(Path::new("/sys/kernel/btf/vmlinux")),
        bpf(a.no_bpf),
        rt_bandwidth(
            read("/proc/sys/kernel/sched_rt_runtime_us").as_deref(),
            read("/proc/sys/kernel/sched_rt_period_us").as_deref(),
        ),
        cgroup(Path::new("/sys/fs/cgroup/cgroup.controllers").exists()),
    ];
    let qemu_bin = a.qemu.clone().or_else(|| {
        in_path("qemu-system-x86_64").or_else(|| {
            let p = PathBuf::from("/usr/libexec/qemu-kvm");
            p.is_file().then_some(p)
        })
    });
    let version = qemu_bin.as_ref().and_then(|q| {
        Command::new(q)
            .arg("--version")
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    });
    out.push(qemu(qemu_bin.as_deref(), version.as_deref()));
    let hook = Path::new("/etc/libvirt/hooks/qemu.d/pvsched");
    let meta = fs::metadata(hook).ok();
    let daemon_proc = libvirt_daemon();
    out.push(libvirt_hook(
        Path::new("/etc/libvirt").is_dir(),
        hook,
        meta.as_ref().map(|m| m.permissions().mode() & 0o111 != 0),
        meta.as_ref()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs()),
        daemon_proc.as_ref().map(|(n, s)| (n.as_str(), *s)),
    ));
    out.extend(daemon(&a.socket.socket));
    out
}

/// The table: one line per check, the advice indented below it.
pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut s = String::new();
    for c in checks {
        s.push_str(&format!(
            "{:<4}  {:<width$}  {}\n",
            c.level.word(),
            c.name,
            c.found
        ));
        if let Some(t) = &c.todo {
            s.push_str(&format!("{:<4}  {:<width$}  -> {t}\n", "", ""));
        }
    }
    s
}

/// `pvsched doctor`: 0 when nothing blocks pvsched, 1 when a check failed.
pub fn main(a: &DoctorArgs) -> Exit {
    let checks = run_checks(a);
    if a.json {
        for c in &checks {
            match serde_json::to_string(c) {
                Ok(l) => println!("{l}"),
                Err(e) => {
                    eprintln!("pvsched doctor: {e}");
                    return Exit::Failure;
                }
            }
        }
    } else {
        print!("{}", render(&checks));
    }
    if checks.iter().any(|c| c.level == Level::Fail) {
        Exit::Failure
    } else {
        Exit::Ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_below_bpf_loop_fail_and_below_thread_pidfds_warn() {
        assert_eq!(kernel("5.15.0-91-generic").level, Level::Fail);
        assert_eq!(kernel("6.1.0-26-amd64").level, Level::Warn);
        assert_eq!(kernel("6.18.0").level, Level::Ok);
        assert_eq!(kernel("6.9").level, Level::Ok);
        assert_eq!(kernel("garbage").level, Level::Warn);
    }

    #[test]
    fn rt_bandwidth_off_or_lowered_warns() {
        assert_eq!(
            rt_bandwidth(Some("950000\n"), Some("1000000\n")).level,
            Level::Ok
        );
        assert_eq!(rt_bandwidth(Some("-1"), Some("1000000")).level, Level::Warn);
        assert_eq!(
            rt_bandwidth(Some("500000"), Some("1000000")).level,
            Level::Warn
        );
        assert_eq!(rt_bandwidth(None, None).level, Level::Info);
    }

    #[test]
    fn qemu_before_10_1_has_no_device() {
        let p = Path::new("/usr/bin/qemu-system-x86_64");
        let out = |v: &str| format!("QEMU emulator version {v} (Debian 1:7.2+dfsg-7)\nCopyright");
        assert_eq!(qemu(Some(p), Some(&out("7.2.15"))).level, Level::Warn);
        assert_eq!(qemu(Some(p), Some(&out("10.0.2"))).level, Level::Warn);
        let ok = qemu(Some(p), Some(&out("11.1.3")));
        assert_eq!(ok.level, Level::Ok);
        assert!(ok.found.contains("11.1.3"), "{}", ok.found);
        assert_eq!(qemu(Some(p), Some("nonsense")).level, Level::Warn);
        assert_eq!(qemu(None, None).level, Level::Info);
    }

    #[test]
    fn a_hook_newer_than_the_libvirt_daemon_is_not_read_yet() {
        let h = Path::new("/etc/libvirt/hooks/qemu.d/pvsched");
        assert_eq!(libvirt_hook(false, h, None, None, None).level, Level::Info);
        assert_eq!(libvirt_hook(true, h, None, None, None).level, Level::Warn);
        assert_eq!(
            libvirt_hook(true, h, Some(false), Some(1), None).level,
            Level::Warn
        );
        let stale = libvirt_hook(true, h, Some(true), Some(200), Some(("virtqemud", 100)));
        assert_eq!(stale.level, Level::Warn);
        assert!(stale.todo.unwrap().contains("restart"));
        let read = libvirt_hook(true, h, Some(true), Some(50), Some(("libvirtd", 100)));
        assert_eq!(read.level, Level::Ok);
        assert_eq!(
            libvirt_hook(true, h, Some(true), Some(50), None).level,
            Level::Info
        );
    }

    #[test]
    fn a_vm_without_its_guest_driver_warns() {
        assert_eq!(vm_check("a", "device", None, None).level, Level::Warn);
        let ok = vm_check("a", "device", Some(0x7), Some("1.6"));
        assert_eq!(ok.level, Level::Ok);
        assert!(ok.found.contains("ABI 1.6"), "{}", ok.found);
        assert_eq!(vm_check("a", "none", None, None).level, Level::Info);
    }

    #[test]
    fn the_table_puts_advice_under_its_check() {
        let t = render(&[
            check("kernel", Level::Ok, "Linux 6.18", None),
            check("btf", Level::Fail, "missing", Some("rebuild")),
        ]);
        assert_eq!(
            t,
            "ok    kernel  Linux 6.18\nFAIL  btf     missing\n              -> rebuild\n"
        );
    }
}
