//! What outlives one pvschedd process in its runtime directory
//! (`/run/pvsched` under the shipped unit, kept across restarts with
//! `RuntimeDirectoryPreserve=yes`):
//!
//! - `ledger`: the guardian's ledger of boosted threads and their
//!   baselines ([`pvsched_agent::guardian::Ledger`]); a starting pvschedd
//!   restores what it lists before it loads the policy, and `pvschedd
//!   --restore` (the unit's `ExecStopPost=`) does the same after every
//!   stop, however the daemon and its guardian ended;
//! - `detached/<name>.json`: each detached registration (root's `pvsched
//!   qemu-attach`, [`RegisterVm::detach`]): the request, the VMM's pid and
//!   its start time. A restarted pvschedd registers each again if its
//!   process is still the same one (pid and start time), so a VM attached
//!   once stays served until its QEMU exits or `pvsched vm unregister`.
//!   A record is removed when its VM is unregistered for any reason but
//!   the daemon's own stop.
//!
//! Connection-owned registrations are not recorded: they belong to their
//! client, which registers again when it reconnects.

use crate::proto::RegisterVm;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

/// The ledger file in runtime directory `dir`.
pub fn ledger_path(dir: &Path) -> PathBuf {
    dir.join("ledger")
}

/// One detached registration as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The VMM process.
    pub pid: u32,
    /// Its start time (field 22 of `/proc/PID/stat`): a pid reused by
    /// another process never gets the VM.
    pub start_time: u64,
    /// The request as the daemon accepted it.
    pub request: RegisterVm,
}

impl Record {
    /// Whether the recorded VMM process is still running (same pid, same
    /// start time).
    pub fn alive(&self) -> bool {
        pvsched_agent::guardian::start_time(self.pid) == Some(self.start_time)
    }
}

/// The `detached/` directory of a runtime directory.
pub struct Detached {
    dir: PathBuf,
    /// The daemon is stopping: its VMs are unregistered, their records
    /// stay for the next pvschedd.
    keep: bool,
}

impl Detached {
    /// The records under runtime directory `runtime_dir`.
    pub fn new(runtime_dir: &Path) -> Detached {
        Detached {
            dir: runtime_dir.join("detached"),
            keep: false,
        }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    /// Records VM `name`, registered detached for process `pid`.
    pub fn save(&self, pid: u32, request: &RegisterVm) -> io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let start_time = pvsched_agent::guardian::start_time(pid)
            .ok_or_else(|| io::Error::other(format!("process {pid} has no start time")))?;
        let rec = Record {
            pid,
            start_time,
            request: request.clone(),
        };
        std::fs::create_dir_all(&self.dir)?;
        // Written whole, then renamed: a crash leaves the old record or the
        // new one, never half of one.
        let tmp = self.dir.join(format!(".{}.tmp", request.name));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec(&rec).map_err(io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.file(&request.name))
    }

    /// VM `name` is unregistered: forget its record, unless the daemon is
    /// stopping.
    pub fn forget(&self, name: &str) {
        if self.keep {
            return;
        }
        match std::fs::remove_file(self.file(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(vm = %name, "removing its detached record: {e}"),
        }
    }

    /// The daemon stops: the records stay for the next pvschedd.
    pub fn keep_all(&mut self) {
        self.keep = true;
    }

    /// Every readable record, by name. A record that cannot be read or
    /// names another VM than its file is removed (and logged).
    pub fn load(&self) -> Vec<Record> {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in dir.flatten() {
            let path = entry.path();
            let Some(stem) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            let rec = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()))
                .and_then(|r| {
                    (r.request.name == stem && crate::proto::valid_name(stem) && r.request.detach)
                        .then_some(r)
                        .ok_or_else(|| "not a detached registration of this name".into())
                });
            match rec {
                Ok(r) => out.push(r),
                Err(e) => {
                    tracing::warn!(file = %path.display(), "dropping an unreadable detached record: {e}");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        out.sort_by(|a, b| a.request.name.cmp(&b.request.name));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Region, Vcpu};

    fn req(name: &str) -> RegisterVm {
        RegisterVm {
            name: name.into(),
            vcpus: vec![Vcpu {
                tid: std::process::id(),
                apic_id: 0,
            }],
            emulator_tids: vec![],
            region: Region::None,
            caps: None,
            pid: Some(std::process::id()),
            detach: true,
        }
    }

    #[test]
    fn records_round_trip_and_outlive_a_stop() {
        let dir = std::env::temp_dir().join(format!("pvsched-persist-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut d = Detached::new(&dir);
        assert!(d.load().is_empty(), "no directory yet");
        d.save(std::process::id(), &req("vm-a")).unwrap();
        d.save(std::process::id(), &req("vm-b")).unwrap();
        std::fs::write(dir.join("detached/junk.json"), b"{").unwrap();
        let got = d.load();
        assert_eq!(got.len(), 2, "the junk record is dropped");
        assert_eq!(got[0].request, req("vm-a"));
        assert!(got[0].alive(), "this process is alive");
        assert!(!dir.join("detached/junk.json").exists());
        d.forget("vm-a");
        assert_eq!(d.load().len(), 1);
        d.keep_all();
        d.forget("vm-b"); // unregistered by the daemon's stop: kept
        assert_eq!(d.load().len(), 1);
        let dead = Record {
            start_time: got[1].start_time + 1,
            ..got[1].clone()
        };
        assert!(!dead.alive(), "another start time is another process");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
