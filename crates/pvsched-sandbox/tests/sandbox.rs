//! Real sandbox tests: spawn `pvsched-sandbox-probe`, which enters the
//! sandbox as the device does, and read its state back from `/proc`.
//!
//! The child gets a socketpair end at fd 10 and a memfd at fd 11 (both kept)
//! and `/dev/null` at fd 12 (not kept: must be closed).

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};

use pvsched_sandbox::{attempt_forbidden_open, open_fds, read_proc_status};

const SOCK_FD: i32 = 10;
const MEMFD_FD: i32 = 11;
const EXTRA_FD: i32 = 12;

/// Whether we run as root; under `PVSCHED_REQUIRE_REAL=1` not being root
/// fails the test.
fn is_root(why: &str) -> bool {
    pvsched_testkit::root("sandbox test", why)
}

fn memfd() -> std::fs::File {
    // SAFETY: memfd_create with a NUL-terminated name literal.
    let fd = unsafe { libc::memfd_create(c"probe-ram".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh fd owned by nobody else.
    let f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    f.set_len(4096).expect("size memfd");
    f
}

struct Probe {
    child: Child,
    sock: UnixStream,
    ram: std::fs::File,
}

fn spawn(extra_args: &[&str]) -> Probe {
    spawn_as(extra_args, None)
}

/// Spawns the probe, as user/group `uid` (set in the child before exec)
/// when given.
fn spawn_as(extra_args: &[&str], uid: Option<u32>) -> Probe {
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let ram = memfd();
    ram.write_all_at(b"GUESTRAM", 0).expect("seed memfd");
    let extra = std::fs::File::open("/dev/null").expect("open /dev/null");
    let fds = [theirs.as_raw_fd(), ram.as_raw_fd(), extra.as_raw_fd()];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pvsched-sandbox-probe"));
    cmd.args(["--sock", "10", "--memfd", "11"])
        .args(extra_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure only calls fcntl and dup2 (async-signal-safe) on
    // fds that are open in the parent and therefore in the forked child.
    unsafe {
        cmd.pre_exec(move || {
            // Tests run in parallel threads, so a source fd may already have
            // a target's number (dup2 would then keep FD_CLOEXEC set, or a
            // later dup2 would overwrite it): move every source above the
            // targets first, then put each in place.
            let mut high = [0; 3];
            for (h, src) in high.iter_mut().zip(fds) {
                *h = libc::fcntl(src, libc::F_DUPFD_CLOEXEC, 100);
                if *h < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (src, dst) in high.iter().zip([SOCK_FD, MEMFD_FD, EXTRA_FD]) {
                if libc::dup2(*src, dst) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(id) = uid
                && (libc::setgroups(0, std::ptr::null()) < 0
                    || libc::setgid(id) < 0
                    || libc::setuid(id) < 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().expect("spawn probe");
    drop(theirs);
    Probe {
        child,
        sock: ours,
        ram,
    }
}

impl Probe {
    /// Waits for the child's `R` (sandbox entered).
    fn ready(&mut self) {
        let mut b = [0u8; 1];
        self.sock.read_exact(&mut b).expect("probe ready byte");
        assert_eq!(&b, b"R");
    }

    fn finish(self) -> (std::process::ExitStatus, String, String) {
        drop(self.sock);
        let out = self.child.wait_with_output().expect("wait probe");
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

fn assert_sandboxed(pid: u32) {
    let st = read_proc_status(pid).expect("child status");
    assert_eq!(st.cap_eff, 0, "CapEff");
    assert_eq!(st.cap_prm, 0, "CapPrm");
    assert_eq!(st.cap_bnd, 0, "CapBnd");
    assert!(st.no_new_privs, "NoNewPrivs");
    assert_eq!(st.seccomp_mode, 2, "Seccomp");
    let fds = open_fds(pid).expect("child fds");
    assert_eq!(
        fds,
        vec![0, 1, 2, SOCK_FD, MEMFD_FD],
        "only allowlisted fds"
    );
}

/// Soft limit of `name` in `/proc/<pid>/limits` ("unlimited" → u64::MAX).
fn proc_limit(pid: u32, name: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("child limits");
    let line = text
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in {text}"));
    let soft = line[name.len()..]
        .split_whitespace()
        .next()
        .expect("soft limit");
    if soft == "unlimited" {
        u64::MAX
    } else {
        soft.parse().expect("numeric limit")
    }
}

fn assert_limits(pid: u32) {
    // Highest kept fd 11, + 1, + default margin 64.
    assert_eq!(proc_limit(pid, "Max open files"), 76);
    assert_eq!(proc_limit(pid, "Max processes"), 0);
    assert_eq!(proc_limit(pid, "Max core file size"), 0);
    // stdout/stderr are pipes here, so RLIMIT_FSIZE is applied.
    assert_eq!(proc_limit(pid, "Max file size"), 0);
}

fn echo_and_memfd_work(p: &mut Probe) {
    p.sock.write_all(b"ping").expect("send");
    let mut reply = [0u8; 12];
    p.sock.read_exact(&mut reply).expect("reply");
    assert_eq!(&reply, b"gnipGUESTRAM");
    let mut ram = [0u8; 4];
    p.ram.read_exact_at(&mut ram, 8).expect("read memfd");
    assert_eq!(&ram, b"ping", "child's write through its mapping");
}

/// Asks the sandboxed probe to open a file and checks the seccomp filter
/// killed it with SIGSYS; returns its stdout (the isolation it reported).
fn open_kills_with_sigsys(mut p: Probe) -> String {
    p.sock.write_all(b"open").expect("send");
    let (status, stdout, stderr) = p.finish();
    assert_eq!(
        status.signal(),
        Some(libc::SIGSYS),
        "status {status:?}, stderr: {stderr}"
    );
    stdout
}

#[test]
fn sandboxed_child_has_no_caps_nnp_seccomp_and_only_kept_fds() {
    let mut p = spawn(&["--profile", "vfio-user"]);
    p.ready();
    assert_sandboxed(p.child.id());
    assert_limits(p.child.id());
    echo_and_memfd_work(&mut p);
    // Still sandboxed after serving.
    assert_sandboxed(p.child.id());
    let (status, stdout, stderr) = p.finish();
    assert_eq!(status.code(), Some(0), "stderr: {stderr}");
    assert!(
        stdout.contains("seccomp_profile: \"device-vfio-user\""),
        "{stdout}"
    );
    assert!(stdout.contains("fsize_limit: Some(0)"), "{stdout}");
    if is_root("namespace isolation without a user namespace") {
        assert!(stdout.contains("Namespaces { user: false }"), "{stdout}");
    }
}

#[test]
fn forbidden_open_kills_with_sigsys() {
    let mut p = spawn(&["--profile", "mpqemu"]);
    p.ready();
    assert_sandboxed(p.child.id());
    open_kills_with_sigsys(p);
}

#[test]
fn landlock_fallback_still_sandboxes_and_kills_on_open() {
    let mut p = spawn(&["--no-namespaces"]);
    p.ready();
    assert_sandboxed(p.child.id());
    echo_and_memfd_work(&mut p);
    let stdout = open_kills_with_sigsys(p);
    assert!(
        stdout.contains("Landlock") || stdout.contains("None"),
        "isolation reported: {stdout}"
    );
}

#[test]
fn namespaces_are_new_for_the_child() {
    if !is_root("comparing namespace ids") {
        return;
    }
    let mut p = spawn(&[]);
    p.ready();
    let pid = p.child.id();
    for ns in ["mnt", "net", "ipc"] {
        let mine = std::fs::read_link(format!("/proc/self/ns/{ns}")).expect("own ns");
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).expect("child ns");
        assert_ne!(mine, theirs, "{ns} namespace shared with the parent");
    }
    let (status, _, stderr) = p.finish();
    assert_eq!(status.code(), Some(0), "stderr: {stderr}");
}

#[test]
fn keeping_a_closed_fd_is_refused_before_anything_irreversible() {
    let p = spawn(&["--keep", "50"]);
    let (status, _, stderr) = p.finish();
    assert_eq!(status.code(), Some(3), "stderr: {stderr}");
    assert!(stderr.contains("fd 50"), "{stderr}");
}

#[test]
fn trigger_opens_outside_the_sandbox() {
    // The trigger is a real open: without the sandbox it succeeds, so the
    // SIGSYS above comes from seccomp and not from a missing file.
    assert!(attempt_forbidden_open());
}

#[test]
fn socket_thread_and_exec_kill_with_sigsys_under_both_profiles() {
    for profile in ["mpqemu", "vfio-user"] {
        for req in ["socket", "thread", "exec"] {
            let mut p = spawn(&["--profile", profile]);
            p.ready();
            p.sock.write_all(req.as_bytes()).expect("send");
            let (status, _, stderr) = p.finish();
            assert_eq!(
                status.signal(),
                Some(libc::SIGSYS),
                "{profile}/{req}: status {status:?}, stderr: {stderr}"
            );
        }
    }
}

#[test]
fn unprivileged_child_uses_a_user_namespace_or_landlock() {
    if !is_root("switching the child to uid 65534") {
        return;
    }
    let mut p = spawn_as(&[], Some(65534));
    p.ready();
    assert_sandboxed(p.child.id());
    echo_and_memfd_work(&mut p);
    let stdout = open_kills_with_sigsys(p);
    assert!(
        stdout.contains("Namespaces { user: true }") || stdout.contains("Landlock"),
        "isolation reported: {stdout}"
    );
}
