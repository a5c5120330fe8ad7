//! The device process's life cycle, seen from the VMM: spawn it with a
//! vfio-user socket in a private directory, wait (bounded) for the socket,
//! watch it, stop it.
//!
//! * The embedder names the program ([`DeviceProgram`]: path + leading
//!   arguments, e.g. the `pvsched` binary and `["device"]`); the library
//!   adds `--transport vfio-user --socket PATH --vcpus N --apic-ids ...`
//!   and, when they differ from the defaults, `--host-flags` / `--features`.
//! * The child gets `PR_SET_PDEATHSIG(SIGKILL)`, so it cannot outlive the
//!   VMM. The death signal is tied to the thread that forked, so the child
//!   is forked by a dedicated watcher thread that lives exactly as long as
//!   the child: it blocks in `waitpid`, and when the child ends (for any
//!   reason) reports how ([`ExitInfo`]) to a callback.
//! * Signals go through a pidfd (`pidfd_send_signal`), so a kill can never
//!   hit a recycled PID; [`DeviceProcess::stop`] closes nothing itself: the
//!   caller shuts the socket, then `stop` waits a grace period and kills.

use pvsched_util::{lock, pidfd_open};
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long [`DeviceProcess::wait_for_socket`] waits for the child to bind.
pub const SOCKET_WAIT: Duration = Duration::from_secs(10);
/// How long one request on the connected socket may take before the device
/// counts as hung (and is then killed and treated as lost).
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors starting or talking to the device process.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The private socket directory could not be created.
    #[error(
        "creating a private directory for the device socket under {dir} failed: {source}; set TMPDIR to a writable directory"
    )]
    TempDir {
        /// Parent directory tried.
        dir: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The program could not be started.
    #[error(
        "starting the device program {program} failed: {source}; check the path (the embedder passes it, e.g. the pvsched binary with [\"device\"])"
    )]
    Spawn {
        /// The program.
        program: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// The watcher thread could not be started.
    #[error("starting the device watcher thread failed: {0}")]
    Thread(#[source] std::io::Error),
    /// The child ended before it served the socket.
    #[error(
        "the device process {pid} ({program}) ended before serving its socket: {how}; run `{program} ...` by hand to see why"
    )]
    Exited {
        /// Its PID.
        pid: u32,
        /// The program.
        program: String,
        /// How it ended.
        how: String,
    },
    /// The child never bound the socket.
    #[error("the device process {pid} did not bind {socket} within {secs} s; it was killed")]
    SocketTimeout {
        /// Its PID.
        pid: u32,
        /// The socket path.
        socket: PathBuf,
        /// Seconds waited.
        secs: u64,
    },
    /// Connecting the vfio-user client failed.
    #[error("vfio-user client could not connect to the device process {pid}: {source}")]
    Connect {
        /// Its PID.
        pid: u32,
        /// The crate's error.
        #[source]
        source: vfio_user::Error,
    },
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, Error>;

/// The device program as the embedder names it.
///
/// ```
/// use pvsched_vmm::device_process::DeviceProgram;
/// let p = DeviceProgram::new("/usr/bin/pvsched", ["device"]);
/// assert_eq!(p.args, vec![std::ffi::OsString::from("device")]);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProgram {
    /// Executable.
    pub program: PathBuf,
    /// Leading arguments (e.g. `["device"]` for `pvsched device`).
    pub args: Vec<OsString>,
    /// Arguments appended after the ones the VMM adds (e.g. `--no-sandbox`).
    pub extra_args: Vec<OsString>,
}

impl DeviceProgram {
    /// `program` with leading `args`.
    pub fn new(
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        Self {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            extra_args: Vec::new(),
        }
    }
}

/// How the device process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitInfo {
    /// Its PID.
    pub pid: u32,
    /// Terminating signal, if killed by one.
    pub signal: Option<i32>,
    /// Exit code, if it exited.
    pub exit_code: Option<i32>,
    /// When the watcher reaped it.
    pub at: Instant,
}

impl ExitInfo {
    fn from_status(pid: u32, s: ExitStatus) -> Self {
        Self {
            pid,
            signal: s.signal(),
            exit_code: s.code(),
            at: Instant::now(),
        }
    }
}

impl std::fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.signal, self.exit_code) {
            (Some(sig), _) => write!(f, "killed by signal {sig} ({})", signal_name(sig)),
            (None, Some(code)) => write!(f, "exited with code {code}"),
            (None, None) => write!(f, "ended"),
        }
    }
}

/// Conventional name of a signal number.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGSYS => "SIGSYS",
        libc::SIGABRT => "SIGABRT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        _ => "signal",
    }
}

/// Called once, from the watcher thread, when the child has been reaped.
pub type OnExit = Box<dyn FnOnce(ExitInfo) + Send>;

#[derive(Default)]
struct ExitSlot {
    info: Mutex<Option<ExitInfo>>,
    cv: Condvar,
}

impl ExitSlot {
    fn get(&self) -> Option<ExitInfo> {
        *lock(&self.info)
    }

    fn wait(&self, limit: Duration) -> Option<ExitInfo> {
        let deadline = Instant::now() + limit;
        let mut g = lock(&self.info);
        while g.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *g
    }
}

/// A running device process.
pub struct DeviceProcess {
    pid: u32,
    program: String,
    pidfd: OwnedFd,
    dir: PathBuf,
    socket: PathBuf,
    exit: Arc<ExitSlot>,
    watcher: Mutex<Option<JoinHandle<()>>>,
}

/// A private (0700), fresh directory for the socket.
fn private_dir() -> Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    let mut last = None;
    for _ in 0..16 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("pvsched-device-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(source) => return Err(Error::TempDir { dir: base, source }),
        }
    }
    Err(Error::TempDir {
        dir: base,
        source: last.unwrap_or_else(|| std::io::Error::other("no free name")),
    })
}

/// The fd of this process's UNIX socket whose peer is process `pid`.
fn peer_socket(pid: u32) -> Option<i32> {
    for e in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let is_socket =
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cred`; on a
        // non-UNIX socket or a closed fd it fails and we skip it.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast(),
                &mut len,
            )
        };
        if rc == 0 && cred.pid == pid as libc::pid_t {
            return Some(fd);
        }
    }
    None
}

impl DeviceProcess {
    /// Start `program` with the vfio-user arguments for `vcpus` slots plus
    /// `device_args` (already formatted: `--apic-ids`, `--host-flags`...).
    /// `on_exit` runs in the watcher thread once the child has ended.
    pub fn spawn(
        program: &DeviceProgram,
        device_args: Vec<OsString>,
        on_exit: OnExit,
    ) -> Result<Self> {
        Self::spawn_inheriting(program, device_args, None, on_exit)
    }

    /// [`DeviceProcess::spawn`], and the child inherits `inherit` under
    /// its number (the caller names it in `device_args`, e.g. `--event-fd
    /// N`). The fd is close-on-exec in this process, so no other child
    /// started meanwhile gets it; it is closed here once the child exists.
    pub fn spawn_inheriting(
        program: &DeviceProgram,
        device_args: Vec<OsString>,
        inherit: Option<OwnedFd>,
        on_exit: OnExit,
    ) -> Result<Self> {
        let dir = private_dir()?;
        let socket = dir.join("device.sock");
        let mut cmd = Command::new(&program.program);
        cmd.args(&program.args)
            .arg("--transport")
            .arg("vfio-user")
            .arg("--socket")
            .arg(&socket)
            .args(device_args)
            .args(&program.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if std::env::var_os("RUST_LOG").is_none() {
            // The device's info lines would interleave with the VMM's output.
            cmd.env("RUST_LOG", "warn");
        }
        let parent = std::process::id() as libc::pid_t;
        let inherit_fd = inherit.as_ref().map(AsRawFd::as_raw_fd);
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe calls (prctl, getppid, fcntl, _exit).
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The VMM died between fork and prctl: nobody will signal us.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                // The one fd the child keeps across exec: clear its
                // close-on-exec flag in the child only.
                if let Some(fd) = inherit_fd
                    && libc::fcntl(fd, libc::F_SETFD, 0) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let exit = Arc::new(ExitSlot::default());
        let exit2 = exit.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let prog_path = program.program.clone();
        let watcher = std::thread::Builder::new()
            .name("pvsched-devwatch".into())
            .spawn(move || {
                let mut child = match cmd.spawn() {
                    Ok(c) => c,
                    Err(source) => {
                        let _ = tx.send(Err(Error::Spawn {
                            program: prog_path,
                            source,
                        }));
                        return;
                    }
                };
                let pid = child.id();
                match pidfd_open(pid) {
                    Ok(fd) => {
                        let _ = tx.send(Ok((pid, fd)));
                    }
                    Err(source) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        let _ = tx.send(Err(Error::Spawn {
                            program: prog_path,
                            source,
                        }));
                        return;
                    }
                }
                let info = match child.wait() {
                    Ok(s) => ExitInfo::from_status(pid, s),
                    Err(e) => {
                        log::warn!("waiting for device process {pid}: {e}");
                        ExitInfo {
                            pid,
                            signal: None,
                            exit_code: None,
                            at: Instant::now(),
                        }
                    }
                };
                {
                    let mut g = lock(&exit2.info);
                    *g = Some(info);
                    exit2.cv.notify_all();
                }
                on_exit(info);
            })
            .map_err(Error::Thread)?;
        let spawned = rx.recv();
        // The child has its copy (or was never started): close ours.
        drop(inherit);
        let (pid, pidfd) = match spawned {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                let _ = watcher.join();
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
            Err(_) => {
                let _ = watcher.join();
                let _ = std::fs::remove_dir(&dir);
                return Err(Error::Thread(std::io::Error::other("watcher ended early")));
            }
        };
        Ok(Self {
            pid,
            program: program.program.display().to_string(),
            pidfd,
            dir,
            socket,
            exit,
            watcher: Mutex::new(Some(watcher)),
        })
    }

    /// The child's PID.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The socket path the child binds.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// How the child ended, if it has.
    pub fn exited(&self) -> Option<ExitInfo> {
        self.exit.get()
    }

    /// Wait (at most `limit`) for the child to bind its socket, then connect
    /// the vfio-user client and give its socket send/receive timeouts of
    /// [`REPLY_TIMEOUT`] (a hung device then fails the access instead of
    /// blocking a vCPU forever). The socket file and directory are removed
    /// once connected (the connection lives on). On failure the child is
    /// killed.
    pub fn wait_for_socket(&self, limit: Duration) -> Result<vfio_user::Client> {
        let deadline = Instant::now() + limit;
        let res = loop {
            if let Some(info) = self.exited() {
                break Err(Error::Exited {
                    pid: self.pid,
                    program: self.program.clone(),
                    how: info.to_string(),
                });
            }
            if self.socket.exists() {
                match vfio_user::Client::new(&self.socket) {
                    Ok(c) => break Ok(c),
                    Err(vfio_user::Error::Connect(e))
                        if e.kind() == std::io::ErrorKind::ConnectionRefused
                            && Instant::now() < deadline => {}
                    Err(source) => {
                        break Err(Error::Connect {
                            pid: self.pid,
                            source,
                        });
                    }
                }
            }
            if Instant::now() >= deadline {
                break Err(Error::SocketTimeout {
                    pid: self.pid,
                    socket: self.socket.clone(),
                    secs: limit.as_secs(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        self.remove_socket();
        if res.is_err() {
            self.kill();
        } else {
            self.set_reply_timeout(REPLY_TIMEOUT);
        }
        res
    }

    /// `vfio_user::Client` 0.1.7 neither exposes its stream nor has
    /// timeouts: find its socket among this process's fds as the one whose
    /// peer (SO_PEERCRED) is the child, and set SO_RCVTIMEO/SO_SNDTIMEO.
    fn set_reply_timeout(&self, t: Duration) {
        let Some(fd) = peer_socket(self.pid) else {
            log::warn!(
                "no socket to device process {} found; its accesses have no timeout",
                self.pid
            );
            return;
        };
        let tv = libc::timeval {
            tv_sec: t.as_secs() as libc::time_t,
            tv_usec: libc::suseconds_t::from(t.subsec_micros()),
        };
        for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
            // SAFETY: setsockopt on an open socket fd of this process with
            // a valid timeval of the size passed.
            let rc = unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    (&raw const tv).cast(),
                    size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                log::warn!(
                    "setting a timeout on the socket to device process {}: {}",
                    self.pid,
                    std::io::Error::last_os_error()
                );
            }
        }
    }

    fn remove_socket(&self) {
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_dir(&self.dir);
    }

    /// Send SIGKILL (through the pidfd: never another process).
    pub fn kill(&self) {
        // SAFETY: pidfd_send_signal on our own open pidfd, no siginfo.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                log::warn!("killing device process {}: {e}", self.pid);
            }
        }
    }

    /// Wait up to `grace` for the child to end (the caller closed its
    /// socket), kill it if it has not, and reap it (join the watcher).
    pub fn stop(&self, grace: Duration) -> Option<ExitInfo> {
        if self.exit.wait(grace).is_none() {
            log::warn!(
                "device process {} did not exit within {grace:?} of the VMM closing its socket; killing it",
                self.pid
            );
            self.kill();
        }
        let handle = lock(&self.watcher).take();
        if let Some(h) = handle
            && h.join().is_err()
        {
            log::warn!("device watcher thread panicked");
        }
        self.remove_socket();
        self.exited()
    }
}

impl Drop for DeviceProcess {
    fn drop(&mut self) {
        self.stop(Duration::ZERO);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn args(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_program_that_exits_is_reported_with_its_code() {
        let (tx, rx) = mpsc::channel();
        let prog = DeviceProgram::new("/bin/sh", ["-c", "exit 3", "sh"]);
        let p = DeviceProcess::spawn(&prog, args(&[]), Box::new(move |i| tx.send(i).unwrap()))
            .expect("spawn /bin/sh");
        let e = p
            .wait_for_socket(Duration::from_secs(5))
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, Error::Exited { .. }), "{e}");
        assert!(e.to_string().contains("exited with code 3"), "{e}");
        let info = rx.recv().unwrap();
        assert_eq!((info.exit_code, info.signal), (Some(3), None));
        assert!(
            !p.socket().parent().unwrap().exists(),
            "private dir removed"
        );
    }

    #[test]
    fn kill_reports_sigkill_and_stop_reaps() {
        let prog = DeviceProgram::new("/bin/sh", ["-c", "exec sleep 30", "sh"]);
        let p = DeviceProcess::spawn(&prog, args(&[]), Box::new(|_| {})).expect("spawn");
        assert!(p.exited().is_none());
        p.kill();
        let info = p.stop(Duration::from_secs(5)).expect("reaped");
        assert_eq!(info.signal, Some(libc::SIGKILL));
        assert!(info.to_string().contains("SIGKILL"));
        // Reaped: the PID no longer names our child.
        assert!(
            !Path::new(&format!("/proc/{}/status", info.pid)).exists() || {
                let s = std::fs::read_to_string(format!("/proc/{}/status", info.pid))
                    .unwrap_or_default();
                !s.contains(&format!("PPid:\t{}", std::process::id()))
            }
        );
    }

    #[test]
    fn a_missing_program_fails_clearly() {
        let prog = DeviceProgram::new("/nonexistent/pvsched", ["device"]);
        let e = DeviceProcess::spawn(&prog, args(&[]), Box::new(|_| {}))
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, Error::Spawn { .. }), "{e}");
    }
}
