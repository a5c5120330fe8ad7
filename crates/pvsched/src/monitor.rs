//! QEMU's monitor, the two ways pvsched reaches it: QEMU's own QMP socket
//! (whose peer is checked to be the QEMU process named) or, for a libvirt
//! domain, the monitor libvirt holds (`virsh qemu-monitor-command`). Both
//! are bounded: a QMP message longer than 1 MiB, a flood of events or an
//! answer that never comes is an error, not unbounded memory or a hang.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// Longest output of one virsh call kept.
const MAX_VIRSH_OUTPUT: u64 = 1 << 20;
/// Longest wait for one virsh call: libvirt waits up to 30 s for the
/// domain's job lock (held while the domain starts, so also while the
/// libvirt hook runs), then gives up by itself.
const VIRSH_DEADLINE: Duration = Duration::from_secs(60);

/// A QMP request line.
fn request(cmd: &str, arguments: Option<&Value>) -> String {
    match arguments {
        Some(a) => json!({ "execute": cmd, "arguments": a }),
        None => json!({ "execute": cmd }),
    }
    .to_string()
}

/// Errors of a QMP session.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum MonitorError {
    /// The QMP socket could not be used.
    #[error("QMP {path}: {what}: {source}")]
    Qmp {
        /// The socket.
        path: PathBuf,
        /// What failed.
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: std::io::Error,
    },
    /// QMP answered something unexpected.
    #[error("QMP {path}: {what}")]
    Answer {
        /// The socket.
        path: PathBuf,
        what: String,
    },
}

/// Longest QMP message read (QEMU's answers here are a few KiB).
const MAX_QMP_LINE: usize = 1 << 20;
/// Messages (events) skipped at most while waiting for a command's answer.
const MAX_QMP_SKIPPED: usize = 10_000;
/// Longest wait for a command's answer.
const QMP_DEADLINE: Duration = Duration::from_secs(10);

/// A QMP session (after the capabilities negotiation).
pub struct Qmp {
    path: PathBuf,
    out: UnixStream,
    input: BufReader<UnixStream>,
}

impl Qmp {
    pub fn open(path: &std::path::Path) -> Result<Qmp, MonitorError> {
        let io = |what| {
            move |source| MonitorError::Qmp {
                path: path.into(),
                what,
                source,
            }
        };
        let out = UnixStream::connect(path).map_err(io("connect"))?;
        out.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io("set timeout"))?;
        let input = BufReader::new(out.try_clone().map_err(io("dup"))?);
        let mut q = Qmp {
            path: path.into(),
            out,
            input,
        };
        let greeting = q.read()?;
        if greeting.get("QMP").is_none() {
            return Err(q.answer(format!("no QMP greeting: {greeting}")));
        }
        q.execute("qmp_capabilities")?;
        Ok(q)
    }

    fn answer(&self, what: String) -> MonitorError {
        MonitorError::Answer {
            path: self.path.clone(),
            what,
        }
    }

    fn read(&mut self) -> Result<Value, MonitorError> {
        let mut line = String::new();
        let n = (&mut self.input)
            .take(MAX_QMP_LINE as u64 + 1)
            .read_line(&mut line)
            .map_err(|source| MonitorError::Qmp {
                path: self.path.clone(),
                what: "read",
                source,
            })?;
        if n == 0 {
            return Err(self.answer("QEMU closed the connection".into()));
        }
        if n > MAX_QMP_LINE {
            return Err(self.answer(format!(
                "a QMP message longer than {MAX_QMP_LINE} bytes (not QEMU?)"
            )));
        }
        serde_json::from_str(&line).map_err(|e| self.answer(format!("not JSON ({e}): {line}")))
    }

    /// Runs a command without arguments; its `return` value.
    pub fn execute(&mut self, cmd: &str) -> Result<Value, MonitorError> {
        self.execute_with(cmd, None)
    }

    /// Runs a command; its `return` value (events in between are skipped).
    pub fn execute_with(
        &mut self,
        cmd: &str,
        arguments: Option<&Value>,
    ) -> Result<Value, MonitorError> {
        let req = request(cmd, arguments);
        writeln!(self.out, "{req}").map_err(|source| MonitorError::Qmp {
            path: self.path.clone(),
            what: "write",
            source,
        })?;
        let start = std::time::Instant::now();
        for _ in 0..MAX_QMP_SKIPPED {
            let v = self.read()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(self.answer(format!("{cmd}: {e}")));
            }
            if start.elapsed() > QMP_DEADLINE {
                break;
            }
        }
        Err(self.answer(format!(
            "{cmd}: no answer within {QMP_DEADLINE:?} or {MAX_QMP_SKIPPED} messages"
        )))
    }

    /// QEMU's pid: the peer of the QMP socket.
    pub fn peer_pid(&self) -> Result<u32, MonitorError> {
        nix::sys::socket::getsockopt(&self.out, nix::sys::socket::sockopt::PeerCredentials)
            .map(|c| c.pid() as u32)
            .map_err(|e| MonitorError::Qmp {
                path: self.path.clone(),
                what: "SO_PEERCRED",
                source: e.into(),
            })
    }
}

/// The virsh program and the libvirt URI it connects to.
#[derive(Debug, Clone)]
pub struct Virsh {
    /// The program.
    pub program: PathBuf,
    /// libvirt's URI (`qemu:///system`).
    pub connect: String,
}

impl Virsh {
    /// Runs `virsh -c URI ARGS...`; its standard output, or why not.
    pub fn run(&self, args: &[&str]) -> Result<Vec<u8>, String> {
        use std::process::{Command, Stdio};
        let shown = || {
            format!(
                "{} -c {} {}",
                self.program.display(),
                self.connect,
                args.join(" ")
            )
        };
        let mut child = Command::new(&self.program)
            // Its messages in English whatever the operator's locale:
            // `pvsched detach` tells a domain that is not running by them.
            .env("LC_ALL", "C")
            .arg("-c")
            .arg(&self.connect)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e} (libvirt-clients installs virsh)", shown()))?;
        // Read both pipes while virsh runs (bounded), so a large answer cannot
        // block it on a full pipe.
        let reader = |r: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(r) = r {
                    let _ = r.take(MAX_VIRSH_OUTPUT + 1).read_to_end(&mut buf);
                }
                buf
            })
        };
        let out = reader(
            child
                .stdout
                .take()
                .map(|r| Box::new(r) as Box<dyn Read + Send>),
        );
        let err = reader(
            child
                .stderr
                .take()
                .map(|r| Box::new(r) as Box<dyn Read + Send>),
        );
        let start = std::time::Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if start.elapsed() < VIRSH_DEADLINE => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("{}: no answer within {VIRSH_DEADLINE:?}", shown()));
                }
                Err(e) => return Err(format!("{}: {e}", shown())),
            }
        };
        let out = out.join().unwrap_or_default();
        let err = err.join().unwrap_or_default();
        if !status.success() {
            let msg = String::from_utf8_lossy(&err[..err.len().min(4096)]);
            return Err(format!("{} failed ({status}): {}", shown(), msg.trim()));
        }
        if out.len() as u64 > MAX_VIRSH_OUTPUT {
            return Err(format!(
                "{}: more than {MAX_VIRSH_OUTPUT} bytes of output",
                shown()
            ));
        }
        Ok(out)
    }

    /// A QMP command through libvirt's own monitor of `domain`; its
    /// `return`.
    pub fn qmp(&self, domain: &str, cmd: &str, arguments: Option<&Value>) -> Result<Value, String> {
        let req = request(cmd, arguments);
        let out = self.run(&["qemu-monitor-command", domain, &req])?;
        let v: Value = serde_json::from_slice(&out).map_err(|e| {
            format!(
                "libvirt domain {domain}: {cmd}: not JSON ({e}): {}",
                String::from_utf8_lossy(&out[..out.len().min(256)])
            )
        })?;
        if let Some(r) = v.get("return") {
            return Ok(r.clone());
        }
        Err(format!(
            "libvirt domain {domain}: {cmd}: {}",
            v.get("error").unwrap_or(&v)
        ))
    }
}

/// A running QEMU's monitor.
pub enum Monitor {
    /// QEMU's own QMP socket.
    Qmp(Qmp),
    /// The monitor libvirt holds for a domain.
    Libvirt {
        /// How to reach libvirt.
        virsh: Virsh,
        /// The domain.
        domain: String,
    },
}

impl Monitor {
    /// Runs `cmd` with `arguments`; its `return` value, or why not.
    pub fn execute(&mut self, cmd: &str, arguments: Option<&Value>) -> Result<Value, String> {
        match self {
            Monitor::Qmp(q) => q.execute_with(cmd, arguments).map_err(|e| e.to_string()),
            Monitor::Libvirt { virsh, domain } => virsh.qmp(domain, cmd, arguments),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A QMP peer that sends an endless message or endless events gets
    /// an error, not unbounded memory or an endless wait.
    #[test]
    fn a_hostile_qmp_peer_is_bounded() {
        let dir = std::env::temp_dir().join(format!("pvsched-qmp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, flood) in [
            // A greeting that never ends.
            Box::new(|s: &mut UnixStream| {
                let chunk = vec![b'x'; 64 << 10];
                while s.write_all(&chunk).is_ok() {}
            }) as Box<dyn Fn(&mut UnixStream) + Send>,
            // Events for ever instead of the answer.
            Box::new(|s: &mut UnixStream| {
                let _ = s.write_all(b"{\"QMP\":{}}\n");
                let ev = b"{\"event\":\"X\"}\n".repeat(1000);
                while s.write_all(&ev).is_ok() {}
            }),
        ]
        .into_iter()
        .enumerate()
        {
            let path = dir.join(format!("qmp-{i}.sock"));
            let _ = std::fs::remove_file(&path);
            let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
            let t = std::thread::spawn(move || {
                if let Ok((mut s, _)) = l.accept() {
                    flood(&mut s);
                }
            });
            let e = Qmp::open(&path).err().expect("refused");
            let msg = e.to_string();
            assert!(
                msg.contains("longer than") || msg.contains("no answer within"),
                "{msg}"
            );
            t.join().unwrap();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
