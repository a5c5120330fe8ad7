//! `pvsched qemu-attach --qmp SOCKET --name NAME`: registers a running QEMU
//! with pvschedd. The vCPU threads come from QMP `query-cpus-fast`, their
//! APIC IDs from the CPU topology properties QEMU reports (x86 encoding:
//! each level takes the bits its count needs), the QEMU process from the
//! QMP socket's peer credentials, and QEMU's main-loop thread (its first
//! thread, tid = pid) is registered as the VM's emulator thread unless
//! `--no-emulator`. The registration is detached: it lasts until QEMU
//! exits (pvschedd watches its pidfd) or `pvsched vm unregister NAME`,
//! so a libvirt hook can run this and return. Root only (pvschedd lets
//! only root register another process's threads).
//!
//! Without a pvsched device in QEMU the VM is registered with no region:
//! it gets the halt and directed-yield boosts (kvm_vcpu_wakeup,
//! kvm_apic_ipi), not the guest's slot requests. With `--device-region`,
//! QEMU's pvsched device (`pvsched device --transport vfio-user
//! --daemon-region NAME`, started before QEMU) serves pvschedd's region
//! for NAME as BAR2, and the VM is registered with that region: the policy
//! reads what the guest driver writes there.

use crate::daemon_cli::SocketArg;
use crate::exit::Exit;
use clap::Args;
use pvsched_daemon::RegisterVm;
use pvsched_daemon::host::{HostError, PolicyHost, Registration};
use pvsched_daemon::proto::{Region, Vcpu};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// `pvsched qemu-attach`.
#[derive(Args, Debug)]
pub struct QemuAttachArgs {
    /// QEMU's QMP socket (`-qmp unix:PATH,server=on,wait=off`; libvirt:
    /// /var/lib/libvirt/qemu/domain-ID-NAME/monitor.sock).
    #[arg(long)]
    qmp: PathBuf,
    /// The VM's name with pvschedd (its caps file is
    /// /etc/pvsched/vms/NAME.toml).
    #[arg(long)]
    name: String,
    /// Caps to ask for when the VM has no caps file (TOML).
    #[arg(long)]
    policy_file: Option<PathBuf>,
    /// Do not register QEMU's main-loop thread as the emulator thread.
    #[arg(long)]
    no_emulator: bool,
    /// The QEMU process the VM runs as (libvirt writes it to
    /// /run/libvirt/qemu/NAME.pid): the QMP socket's peer must be it, so a
    /// socket another process put in a shared directory is refused.
    #[arg(long)]
    pid: Option<u32>,
    /// QEMU's pvsched device serves pvschedd's region for NAME as BAR2
    /// (`pvsched device --daemon-region NAME`): register the VM with it.
    #[arg(long)]
    device_region: bool,
    #[command(flatten)]
    socket: SocketArg,
}

/// Errors of this command.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum QemuAttachError {
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
struct Qmp {
    path: PathBuf,
    out: UnixStream,
    input: BufReader<UnixStream>,
}

impl Qmp {
    fn open(path: &std::path::Path) -> Result<Qmp, QemuAttachError> {
        let io = |what| {
            move |source| QemuAttachError::Qmp {
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

    fn answer(&self, what: String) -> QemuAttachError {
        QemuAttachError::Answer {
            path: self.path.clone(),
            what,
        }
    }

    fn read(&mut self) -> Result<Value, QemuAttachError> {
        let mut line = String::new();
        let n = (&mut self.input)
            .take(MAX_QMP_LINE as u64 + 1)
            .read_line(&mut line)
            .map_err(|source| QemuAttachError::Qmp {
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

    /// Runs a command; its `return` value (events in between are skipped).
    fn execute(&mut self, cmd: &str) -> Result<Value, QemuAttachError> {
        let req = json!({ "execute": cmd }).to_string();
        writeln!(self.out, "{req}").map_err(|source| QemuAttachError::Qmp {
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
    fn peer_pid(&self) -> Result<u32, QemuAttachError> {
        nix::sys::socket::getsockopt(&self.out, nix::sys::socket::sockopt::PeerCredentials)
            .map(|c| c.pid() as u32)
            .map_err(|e| QemuAttachError::Qmp {
                path: self.path.clone(),
                what: "SO_PEERCRED",
                source: e.into(),
            })
    }
}

/// Topology levels of an x86 APIC ID, outermost first.
const LEVELS: [&str; 5] = ["socket-id", "die-id", "module-id", "core-id", "thread-id"];

/// APIC ID of each CPU from its topology properties: each level gets the
/// bits its count (largest id + 1 over all possible CPUs) needs, as QEMU's
/// x86 APIC ID encoding does; without properties, the CPU index.
fn apic_ids(cpus: &[Value], possible: &[Value]) -> Vec<u32> {
    let prop = |c: &Value, k: &str| c["props"][k].as_u64();
    let bits: Vec<u32> = LEVELS
        .iter()
        .map(|k| {
            let n = possible
                .iter()
                .filter_map(|c| prop(c, k))
                .max()
                .map_or(1, |m| m + 1);
            u64::BITS - (n.max(1) - 1).leading_zeros()
        })
        .collect();
    cpus.iter()
        .map(|c| {
            if LEVELS.iter().all(|k| prop(c, k).is_none()) {
                return c["cpu-index"].as_u64().unwrap_or(0) as u32;
            }
            let mut id = 0u64;
            for (k, b) in LEVELS.iter().zip(&bits) {
                id = (id << b) | prop(c, k).unwrap_or(0);
            }
            id as u32
        })
        .collect()
}

fn registration(a: &QemuAttachArgs) -> Result<RegisterVm, String> {
    let mut qmp = Qmp::open(&a.qmp).map_err(|e| e.to_string())?;
    let pid = qmp.peer_pid().map_err(|e| e.to_string())?;
    if let Some(want) = a.pid
        && want != pid
    {
        return Err(format!(
            "QMP {}: the socket is served by process {pid}, not QEMU {want} (--pid): \
             refusing to register another process as {}",
            a.qmp.display(),
            a.name
        ));
    }
    let cpus = qmp.execute("query-cpus-fast").map_err(|e| e.to_string())?;
    let cpus = cpus.as_array().cloned().unwrap_or_default();
    if cpus.is_empty() {
        return Err(format!(
            "QMP {}: query-cpus-fast listed no CPU",
            a.qmp.display()
        ));
    }
    let possible = qmp
        .execute("query-hotpluggable-cpus")
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_else(|| cpus.clone());
    let apics = apic_ids(&cpus, &possible);
    let mut vcpus = Vec::new();
    for (c, apic_id) in cpus.iter().zip(apics) {
        let tid = c["thread-id"]
            .as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| format!("query-cpus-fast: CPU without a thread-id: {c}"))?;
        vcpus.push(Vcpu { tid, apic_id });
    }
    let caps = match &a.policy_file {
        Some(p) => Some(crate::run::read_policy_file(p)?),
        None => None,
    };
    Ok(RegisterVm {
        name: a.name.clone(),
        vcpus,
        emulator_tids: if a.no_emulator { vec![] } else { vec![pid] },
        region: if a.device_region {
            Region::Reserved
        } else {
            Region::None
        },
        caps,
        pid: Some(pid),
        detach: true,
    })
}

/// Runs `pvsched qemu-attach`.
pub fn main(a: &QemuAttachArgs) -> Exit {
    let reg = match registration(a) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pvsched qemu-attach: {e}");
            return Exit::Failure;
        }
    };
    let (pid, n) = (reg.pid.unwrap_or(0), reg.vcpus.len());
    let tids: Vec<String> = reg.vcpus.iter().map(|v| v.tid.to_string()).collect();
    // Detached: the registration outlives this process (dropping it here
    // does not end it); pvschedd ends it when QEMU exits. The registration
    // itself says whether pvschedd answers: no separate status round trip.
    let result = PolicyHost::Daemon(a.socket.socket.clone()).register(reg);
    match result.as_ref().map(Registration::registered) {
        Ok(Some(r)) => {
            println!(
                "{}: QEMU pid {pid}, {n} vCPU thread(s) {} registered with pvschedd as VM {} \
                 (caps from {}); it stays registered until QEMU exits",
                a.name,
                tids.join(","),
                r.vm_id,
                r.caps_source
            );
            Exit::Ok
        }
        Ok(None) => Exit::Failure,
        Err(e) => {
            eprintln!("pvsched qemu-attach: {e}");
            match e {
                HostError::Daemon(e) => crate::daemon_cli::exit_for(e),
                _ => Exit::Failure,
            }
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

    #[test]
    fn apic_ids_follow_the_x86_topology_encoding() {
        // 2 sockets x 3 cores x 2 threads: cores take 2 bits, threads 1.
        let cpu = |s: u64, c: u64, t: u64| json!({"props": {"socket-id": s, "core-id": c, "thread-id": t}});
        let all: Vec<Value> = (0..2)
            .flat_map(|s| (0..3).flat_map(move |c| (0..2).map(move |t| cpu(s, c, t))))
            .collect();
        let ids = apic_ids(&all, &all);
        assert_eq!(&ids[..6], &[0, 1, 2, 3, 4, 5]);
        assert_eq!(&ids[6..], &[8, 9, 10, 11, 12, 13]);
        // No properties: the CPU index.
        let bare = vec![json!({"cpu-index": 0}), json!({"cpu-index": 1})];
        assert_eq!(apic_ids(&bare, &bare), vec![0, 1]);
    }
}
