//! pvschedd's configuration: `/etc/pvsched/pvschedd.toml` (the daemon, the
//! operator's caps maximum and the default caps) and one optional file per
//! VM, `/etc/pvsched/vms/<name>.toml` (that VM's caps, in the format of
//! `bpf-policy/caps.example.toml`). Every key is optional.
//!
//! ```toml
//! socket = "/run/pvsched/pvschedd.sock"
//! runtime_dir = ""              # ledger and detached VMs: "" = the socket's directory
//! socket_group = "kvm"          # may connect and register its own VMs
//! vm_dir = "/etc/pvsched/vms"
//! require_vm_file = false       # true: clients other than root need a VM file
//! metrics_listen = "127.0.0.1:9848"
//! metrics_token_file = ""       # bearer token for scrapes; VM names need it
//! client_timeout_ms = 5000
//! max_clients = 1024
//! max_clients_per_uid = 32      # connections of one uid other than root
//! max_vms_per_uid = 16          # VMs of one uid other than root
//!
//! [cosched]                     # co-scheduling, host-wide
//! yield = true                  # a phase yields to host threads woken on its CPUs
//! host_pct = 80                 # all VMs' phases together <= 80 % of the CPUs
//! off_slice_us = 4000           # vCPUs outside their phase: host wake-ups preempt them
//!
//! [max]                         # no VM's caps may exceed these
//! max_rt_prio = 10
//!
//! [defaults]                    # caps of a VM with no file that sent none
//! max_rt_prio = 4
//! ```

use pvsched_policy::{Caps, CapsError, CapsLimit};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default configuration file.
pub const DEFAULT_CONFIG: &str = "/etc/pvsched/pvschedd.toml";
/// The default socket.
pub const DEFAULT_SOCKET: &str = "/run/pvsched/pvschedd.sock";

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        /// The error the system call returned (errno).
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML of this format.
    #[error("{path}: {source} (see docs/operating.md, \"Configure\")")]
    Toml {
        path: PathBuf,
        /// The TOML parser's error, with line and column.
        #[source]
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("{path}: {source}")]
    Caps {
        path: PathBuf,
        /// Which cap is wrong and why.
        #[source]
        source: CapsError,
    },
    /// Some other value is wrong.
    #[error("{path}: {what}")]
    Invalid {
        path: PathBuf,
        /// What and why.
        what: String,
    },
}

/// `pvschedd.toml`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The UNIX socket VMMs and `pvsched` connect to.
    pub socket: PathBuf,
    /// Where the ledger of boosted threads and the detached registrations
    /// live across restarts ([`crate::persist`]); empty: the socket's
    /// directory (`/run/pvsched`).
    pub runtime_dir: PathBuf,
    /// Group owning the socket (mode 0660); its members may register their
    /// own VMs and read status. Empty: root only (mode 0600).
    pub socket_group: String,
    /// Directory of per-VM caps files (`<name>.toml`).
    pub vm_dir: PathBuf,
    /// Serve clients other than root only for VMs that have a caps file
    /// (per-VM opt-in; root's registrations opt in by domain metadata or
    /// Nova flavor).
    pub require_vm_file: bool,
    /// `host:port` for Prometheus scrapes over HTTP (`""`: off).
    pub metrics_listen: String,
    /// A file holding the bearer token scrapers must present (Prometheus:
    /// `authorization: {credentials_file: ...}`); with it, series carry VM
    /// names. `""`: no token, and VMs are labelled by id, since anyone on
    /// the host can reach the port.
    pub metrics_token_file: PathBuf,
    /// A client must send a request this soon after connecting or after
    /// its last reply, unless it holds a registration.
    pub client_timeout_ms: u64,
    /// Connected clients at most; more are refused.
    pub max_clients: usize,
    /// Connections one uid other than root may hold at once.
    pub max_clients_per_uid: usize,
    /// VMs one uid other than root may have registered at once.
    pub max_vms_per_uid: usize,
    /// SCHED_FIFO priority of the thread that applies the policy's
    /// decisions (1..=99; above `[max] max_rt_prio`, so that no boost it
    /// must undo can keep it off a CPU). It preempts every host thread
    /// below it for the few µs a decision takes: a host whose own RT
    /// threads must not wait for it sets it below theirs.
    pub applier_rt_prio: u32,
    /// The host's co-scheduling settings (`[cosched]`).
    pub cosched: CoschedConfig,
    /// The operator's maximum for every VM's caps.
    pub max: CapsLimit,
    /// Caps of a VM that has no file and sent none.
    pub defaults: Caps,
    /// Old spellings the file used, each with its new one: pvschedd logs
    /// them at start and `--check` prints them.
    #[serde(skip)]
    pub deprecated: Vec<String>,
}

/// What pvschedd's command line sets over the file (`--socket`,
/// `--metrics-listen`, `--socket-group`), at start and at every reload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--socket`.
    pub socket: Option<PathBuf>,
    /// `--metrics-listen`.
    pub metrics_listen: Option<String>,
    /// `--socket-group`.
    pub socket_group: Option<String>,
}

impl Overrides {
    /// `c` with these set over it.
    pub fn apply(&self, c: &mut Config) {
        if let Some(s) = &self.socket {
            c.socket = s.clone();
        }
        if let Some(m) = &self.metrics_listen {
            c.metrics_listen = m.clone();
        }
        if let Some(g) = &self.socket_group {
            c.socket_group = g.clone();
        }
    }
}

/// `[cosched]`: how co-scheduling treats the host as a whole. What one VM
/// may ask (`cosched_us`, `cosched_period_us`) is a cap, bounded per VM
/// by `[max] max_cosched_pct`, `max_cosched_period_us` and
/// `max_cosched_phase_us`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoschedConfig {
    /// A co-scheduled phase yields to an ordinary host thread woken on a
    /// CPU it holds, so host services are not kept waiting for the
    /// phase's end. `false` only to measure what that costs or gains.
    #[serde(rename = "yield")]
    pub yield_to_host: bool,
    /// Largest share of the host's CPUs all co-scheduling VMs together
    /// may hold in their phases, percent (0..=100): when they do not fit,
    /// every phase is cut in the same proportion, so many VMs, each
    /// within `[max] max_cosched_pct`, cannot starve the host.
    pub host_pct: u32,
    /// The fair-class time slice, µs, of a vCPU thread outside its phase
    /// (at nice 19: the rest of the period, a yield): longer than the
    /// kernel's default, so an ordinary host thread's wake-up preempts it
    /// at once instead of waiting for its slice (on a host without
    /// high-resolution ticks, for the next tick). 0: the kernel's default;
    /// else 100..=100000. Needs Linux 6.12 (custom slices); ignored before.
    pub off_slice_us: u64,
}

impl Default for CoschedConfig {
    fn default() -> Self {
        CoschedConfig {
            yield_to_host: true,
            host_pct: 80,
            off_slice_us: pvsched_agent::applier::OFF_PHASE_SLICE_NS / 1000,
        }
    }
}

/// Keys of earlier releases, still read: (table or "" for the top level,
/// old key, `[cosched]` key).
const COSCHED_ALIASES: [(&str, &str, &str); 2] = [
    ("", "cosched_yield", "yield"),
    ("max", "max_cosched_host_pct", "host_pct"),
];

/// Moves each old spelling of a `[cosched]` key in `table` to `[cosched]`;
/// returns a line per key moved. A key set both ways is an error: which
/// one the operator meant cannot be told.
fn move_cosched_aliases(table: &mut toml::Table) -> Result<Vec<String>, String> {
    let mut moved = Vec::new();
    for (section, old, new) in COSCHED_ALIASES {
        let from = if section.is_empty() {
            Some(&mut *table)
        } else {
            table.get_mut(section).and_then(|v| v.as_table_mut())
        };
        let Some(value) = from.and_then(|t| t.remove(old)) else {
            continue;
        };
        let old_name = if section.is_empty() {
            old.to_string()
        } else {
            format!("[{section}] {old}")
        };
        let cosched = table
            .entry("cosched")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let Some(cosched) = cosched.as_table_mut() else {
            return Err("cosched must be a table ([cosched])".into());
        };
        if cosched.contains_key(new) {
            return Err(format!(
                "{old_name} and [cosched] {new} are the same setting; keep [cosched] {new} only"
            ));
        }
        cosched.insert(new.to_string(), value);
        moved.push(format!("{old_name} is now spelled [cosched] {new}"));
    }
    Ok(moved)
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: DEFAULT_SOCKET.into(),
            runtime_dir: PathBuf::new(),
            socket_group: "kvm".into(),
            vm_dir: "/etc/pvsched/vms".into(),
            require_vm_file: false,
            metrics_listen: "127.0.0.1:9848".into(),
            metrics_token_file: PathBuf::new(),
            client_timeout_ms: 5000,
            max_clients: 1024,
            max_clients_per_uid: 32,
            max_vms_per_uid: 16,
            applier_rt_prio: pvsched_agent::guardian::RESTORER_RT_PRIO,
            cosched: CoschedConfig::default(),
            max: CapsLimit::default(),
            defaults: Caps::default(),
            deprecated: Vec::new(),
        }
    }
}

impl Config {
    /// Reads `path`; a missing file at the default path means the defaults.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e)
                if e.kind() == std::io::ErrorKind::NotFound
                    && path == Path::new(DEFAULT_CONFIG) =>
            {
                String::new()
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.into(),
                    source,
                });
            }
        };
        Self::parse(&text, path)
    }

    /// Parses the text of `path` and checks it.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let toml_err = |source| ConfigError::Toml {
            path: path.into(),
            source,
        };
        let mut table: toml::Table = toml::from_str(text).map_err(toml_err)?;
        let deprecated = move_cosched_aliases(&mut table).map_err(|what| ConfigError::Invalid {
            path: path.into(),
            what,
        })?;
        let mut c: Config = table.try_into().map_err(toml_err)?;
        c.deprecated = deprecated;
        c.validate(path)?;
        Ok(c)
    }

    /// Checks the values against each other (`path` names the file in a
    /// message): what [`Config::parse`] refuses.
    pub fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let c = self;
        if c.cosched.host_pct > 100 {
            return Err(ConfigError::Invalid {
                path: path.into(),
                what: format!("[cosched] host_pct {} must be 0..=100", c.cosched.host_pct),
            });
        }
        let slice = c.cosched.off_slice_us;
        if slice != 0 && !(100..=100_000).contains(&slice) {
            return Err(ConfigError::Invalid {
                path: path.into(),
                what: format!(
                    "[cosched] off_slice_us {slice} must be 0 (the kernel's default) or \
                     100..=100000, the kernel's bounds for a slice"
                ),
            });
        }
        let caps_err = |source| ConfigError::Caps {
            path: path.into(),
            source,
        };
        c.max.validate().map_err(caps_err)?;
        c.defaults.validate().map_err(caps_err)?;
        c.defaults.check_within(&c.max).map_err(caps_err)?;
        if c.max_clients == 0
            || c.client_timeout_ms == 0
            || c.max_clients_per_uid == 0
            || c.max_vms_per_uid == 0
        {
            return Err(ConfigError::Invalid {
                path: path.into(),
                what: "max_clients, max_clients_per_uid, max_vms_per_uid and \
                       client_timeout_ms must be > 0"
                    .into(),
            });
        }
        if !(1..=99).contains(&c.applier_rt_prio) || c.applier_rt_prio <= c.max.max_rt_prio {
            return Err(ConfigError::Invalid {
                path: path.into(),
                what: format!(
                    "applier_rt_prio {} must be in 1..=99 and above [max] max_rt_prio ({}): \
                     the applier must outrank every boost it undoes",
                    c.applier_rt_prio, c.max.max_rt_prio
                ),
            });
        }
        Ok(())
    }

    /// The runtime directory: `runtime_dir`, or the socket's directory.
    pub fn runtime_dir(&self) -> PathBuf {
        if !self.runtime_dir.as_os_str().is_empty() {
            return self.runtime_dir.clone();
        }
        self.socket
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf()
    }

    /// The metrics token, if a file is configured: its first line.
    pub fn metrics_token(&self) -> Result<Option<String>, ConfigError> {
        if self.metrics_token_file.as_os_str().is_empty() {
            return Ok(None);
        }
        let path = &self.metrics_token_file;
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        let token = text.lines().next().unwrap_or_default().trim().to_string();
        if token.len() < 16 {
            return Err(ConfigError::Invalid {
                path: path.clone(),
                what: "the metrics token must be at least 16 characters on the first line".into(),
            });
        }
        Ok(Some(token))
    }

    /// The client timeout.
    pub fn client_timeout(&self) -> Duration {
        Duration::from_millis(self.client_timeout_ms)
    }

    /// Checks every `*.toml` of the VM directory (a VM file: caps and
    /// owners) and of `flavor_dir` (caps only, which `pvsched qemu-attach`
    /// sends) against this file's `[max]`: a file pvschedd or the hook
    /// would refuse at a VM's registration is named now. Returns how many
    /// files of each it read; a directory that does not exist holds none.
    pub fn check_dirs(&self, flavor_dir: &Path) -> Result<(usize, usize), ConfigError> {
        let files = |dir: &Path| -> Result<Vec<PathBuf>, ConfigError> {
            let entries = match std::fs::read_dir(dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
                Err(source) => {
                    return Err(ConfigError::Read {
                        path: dir.into(),
                        source,
                    });
                }
            };
            let mut out: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .collect();
            out.sort();
            Ok(out)
        };
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.into(),
                source,
            })
        };
        let within = |caps: &Caps, path: &Path| {
            caps.check_within(&self.max)
                .map_err(|source| ConfigError::Caps {
                    path: path.into(),
                    source,
                })
        };
        let vms = files(&self.vm_dir)?;
        for path in &vms {
            let f = VmFile::parse(&read(path)?, path)?;
            within(&f.caps, path)?;
        }
        let flavors = files(flavor_dir)?;
        for path in &flavors {
            let caps = Caps::from_toml(&read(path)?).map_err(|source| ConfigError::Caps {
                path: path.clone(),
                source,
            })?;
            within(&caps, path)?;
        }
        Ok((vms.len(), flavors.len()))
    }

    /// The settings a running pvschedd cannot take from a reloaded file
    /// ([`RESTART_ONLY`]) where `new` differs from this configuration.
    pub fn restart_only_changes(&self, new: &Config) -> Vec<&'static str> {
        RESTART_ONLY
            .iter()
            .filter(|k| (k.differs)(self, new))
            .map(|k| k.key)
            .collect()
    }

    /// `new` with what a running pvschedd cannot change ([`RESTART_ONLY`])
    /// kept at this configuration's values.
    pub fn keep_restart_only(&self, mut new: Config) -> Config {
        for k in &RESTART_ONLY {
            (k.keep)(&mut new, self);
        }
        new
    }

    /// The caps file of VM `name` (a valid name: no path separators).
    pub fn vm_file(&self, name: &str) -> PathBuf {
        self.vm_dir.join(format!("{name}.toml"))
    }

    /// VM `name`'s file: its caps and who may register it; `Ok(None)` if
    /// it has none.
    pub fn vm_file_of(&self, name: &str) -> Result<Option<VmFile>, ConfigError> {
        let path = self.vm_file(name);
        match std::fs::read_to_string(&path) {
            Ok(text) => VmFile::parse(&text, &path).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }
}

/// A setting a running pvschedd keeps until it restarts: what it bound
/// (the sockets), loaded or started with (the applier, the co-scheduling
/// planner).
pub struct RestartOnly {
    /// The key as the file names it.
    pub key: &'static str,
    /// Whether two configurations differ in it.
    differs: fn(&Config, &Config) -> bool,
    /// Sets it in the first configuration to the second's value.
    keep: fn(&mut Config, &Config),
}

/// One [`RestartOnly`] per field path, each named once.
macro_rules! restart_only {
    ($($key:literal => $($field:ident).+;)*) => {
        [$(RestartOnly {
            key: $key,
            differs: |a, b| a.$($field).+ != b.$($field).+,
            keep: |new, old| new.$($field).+ = Clone::clone(&old.$($field).+),
        }),*]
    };
}

/// Every setting a reload (SIGHUP) does not change: it warns, naming the
/// key, and keeps the running value; `pvsched man` lists them in
/// pvschedd.toml(5).
pub const RESTART_ONLY: [RestartOnly; 8] = restart_only! {
    "socket" => socket;
    "runtime_dir" => runtime_dir;
    "socket_group" => socket_group;
    "metrics_listen" => metrics_listen;
    "applier_rt_prio" => applier_rt_prio;
    "[cosched]" => cosched;
    "[max] max_cosched_pct" => max.max_cosched_pct;
    "[max] max_cosched_phase_us" => max.max_cosched_phase_us;
};

/// A per-VM file: the VM's caps (the format of
/// `bpf-policy/caps.example.toml`) and the processes that may be its VMM.
///
/// ```toml
/// owner_uids = [64055]        # the VMM runs as one of these uids, and/or
/// owner_cgroups = ["/machine.slice/machine-qemu\\x2d1\\x2dweb\\x2d1.scope"]
/// max_rt_prio = 2
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VmFile {
    /// The caps.
    pub caps: Caps,
    /// Who may register the VM under this name.
    pub owners: Owners,
}

/// The processes allowed to be a VM's VMM: any whose real uid is listed,
/// or whose cgroup (v2) is a listed one or below it. Empty: nobody is
/// named, and only root may register the VM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owners {
    /// Real uids.
    pub uids: Vec<u32>,
    /// cgroup v2 paths (as in `/proc/PID/cgroup`, `0::PATH`).
    pub cgroups: Vec<String>,
}

impl Owners {
    /// Nobody is named.
    pub fn is_empty(&self) -> bool {
        self.uids.is_empty() && self.cgroups.is_empty()
    }

    /// Whether a process with real uid `uid` in cgroup `cgroup` is one.
    pub fn admit(&self, uid: u32, cgroup: &str) -> bool {
        self.uids.contains(&uid)
            || self.cgroups.iter().any(|c| {
                let c = c.trim_end_matches('/');
                cgroup == c
                    || cgroup
                        .strip_prefix(c)
                        .is_some_and(|rest| rest.starts_with('/'))
            })
    }
}

impl VmFile {
    /// Parses the text of VM file `path`.
    pub fn parse(text: &str, path: &Path) -> Result<VmFile, ConfigError> {
        let caps_err = |source| ConfigError::Caps {
            path: path.into(),
            source,
        };
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| caps_err(pvsched_policy::CapsError::Toml(e)))?;
        let invalid = |what: String| ConfigError::Invalid {
            path: path.into(),
            what,
        };
        let mut owners = Owners::default();
        if let Some(v) = table.remove("owner_uids") {
            owners.uids = v
                .try_into()
                .map_err(|e| invalid(format!("owner_uids must be a list of uids: {e}")))?;
        }
        if let Some(v) = table.remove("owner_cgroups") {
            owners.cgroups = v
                .try_into()
                .map_err(|e| invalid(format!("owner_cgroups must be a list of paths: {e}")))?;
            if let Some(bad) = owners.cgroups.iter().find(|c| !c.starts_with('/')) {
                return Err(invalid(format!(
                    "owner_cgroups: {bad:?} is not an absolute cgroup path (as in /proc/PID/cgroup)"
                )));
            }
        }
        let caps = Caps::from_table(table).map_err(caps_err)?;
        Ok(VmFile { caps, owners })
    }
}

/// Process `pid`'s real uid and cgroup v2 path, read from /proc (the
/// caller checks afterwards, through its pidfd, that the process did not
/// exit meanwhile, so a reused pid cannot answer for it).
pub fn process_identity(pid: u32) -> Option<(u32, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let cgroup = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default()
        .to_string();
    Some((uid, cgroup))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_the_defaults() {
        let c = Config::parse("", Path::new("x.toml")).unwrap();
        assert_eq!(c.socket, PathBuf::from(DEFAULT_SOCKET));
        assert_eq!(c.defaults, Caps::default());
    }

    #[test]
    fn every_restart_only_key_is_seen_and_kept_and_nothing_else() {
        let p = Path::new("x.toml");
        let old = Config::default();
        let new = Config::parse(
            "socket = \"/x/s.sock\"\nruntime_dir = \"/x\"\nsocket_group = \"\"\n\
             metrics_listen = \"\"\napplier_rt_prio = 98\nmax_clients = 7\n\
             [cosched]\nhost_pct = 50\n\
             [max]\nmax_cosched_pct = 50\nmax_cosched_phase_us = 10000\nmax_rt_prio = 8\n",
            p,
        )
        .unwrap();
        let keys: Vec<_> = RESTART_ONLY.iter().map(|k| k.key).collect();
        assert_eq!(old.restart_only_changes(&new), keys);
        let kept = old.keep_restart_only(new.clone());
        assert!(old.restart_only_changes(&kept).is_empty());
        // What a reload may change, it changes.
        assert_eq!((kept.max_clients, kept.max.max_rt_prio), (7, 8));
        assert_eq!(old.keep_restart_only(old.clone()), old);
    }

    #[test]
    fn the_shipped_file_is_the_defaults() {
        let text = include_str!("../../../dist/pvschedd.toml");
        let c = Config::parse(text, Path::new("dist/pvschedd.toml")).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn cosched_settings_are_one_section_and_the_old_spellings_still_work() {
        let p = Path::new("x.toml");
        let c = Config::parse("[cosched]\nyield = false\nhost_pct = 50\n", p).unwrap();
        assert_eq!((c.cosched.yield_to_host, c.cosched.host_pct), (false, 50));
        assert_eq!(c.cosched.off_slice_us, 4000, "the default");
        let c = Config::parse("[cosched]\noff_slice_us = 0\n", p).unwrap();
        assert_eq!(c.cosched.off_slice_us, 0);
        assert!(c.deprecated.is_empty());
        // Written as earlier releases documented them: read, and named.
        let c = Config::parse(
            "cosched_yield = false\n[max]\nmax_rt_prio = 10\nmax_cosched_host_pct = 40\n",
            p,
        )
        .unwrap();
        assert_eq!((c.cosched.yield_to_host, c.cosched.host_pct), (false, 40));
        assert_eq!(c.max.max_rt_prio, 10);
        assert_eq!(c.deprecated.len(), 2, "{:?}", c.deprecated);
        assert!(c.deprecated[1].contains("[max] max_cosched_host_pct"));
        // One setting spelled both ways, or out of range: refused, named.
        for (text, what) in [
            (
                "cosched_yield = true\n[cosched]\nyield = false\n",
                "cosched_yield",
            ),
            (
                "[max]\nmax_cosched_host_pct = 50\n[cosched]\nhost_pct = 60\n",
                "host_pct",
            ),
            ("[cosched]\nhost_pct = 101\n", "host_pct 101"),
            ("[cosched]\noff_slice_us = 50\n", "off_slice_us 50"),
            ("cosched = 1\ncosched_yield = true\n", "[cosched]"),
            ("[cosched]\nperiod_us = 5\n", "period_us"),
        ] {
            let e = Config::parse(text, p).unwrap_err().to_string();
            assert!(e.contains(what), "{text:?}: {e}");
        }
    }

    #[test]
    fn vm_files_name_their_owners() {
        let f = VmFile::parse(
            "owner_uids = [1000]\nowner_cgroups = [\"/machine.slice/vm-a.scope\"]\nmax_rt_prio = 2\n",
            Path::new("vm-a.toml"),
        )
        .unwrap();
        assert_eq!(f.caps.max_rt_prio, 2);
        assert!(f.owners.admit(1000, "/user.slice"));
        assert!(f.owners.admit(0, "/machine.slice/vm-a.scope"));
        assert!(f.owners.admit(0, "/machine.slice/vm-a.scope/emulator"));
        assert!(!f.owners.admit(0, "/machine.slice/vm-a.scope2"));
        assert!(!f.owners.admit(1001, "/machine.slice"));
        let plain = VmFile::parse("max_rt_prio = 2\n", Path::new("x.toml")).unwrap();
        assert!(plain.owners.is_empty());
        for bad in [
            "owner_uids = \"root\"\n",
            "owner_cgroups = [\"machine.slice\"]\n",
            "bogus = 1\n",
            "halt_prio = 200\n",
        ] {
            assert!(VmFile::parse(bad, Path::new("x.toml")).is_err(), "{bad}");
        }
        let (uid, cgroup) = process_identity(std::process::id()).unwrap();
        assert_eq!(uid, nix::unistd::getuid().as_raw());
        assert!(cgroup.starts_with('/'), "{cgroup}");
    }

    #[test]
    fn defaults_above_the_maximum_are_refused() {
        let e = Config::parse("[max]\nmax_rt_prio = 2\n", Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("operator maximum"), "{e}");
        let e = Config::parse("sockett = \"x\"\n", Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
    }

    /// The co-scheduling time limits of `[max]` are read, range-checked
    /// naming the key, and bound the default caps like every other key.
    #[test]
    fn the_cosched_time_limits_bound_the_defaults() {
        let p = Path::new("x.toml");
        let c = Config::parse(
            "[max]\nmax_cosched_period_us = 50000\nmax_cosched_phase_us = 10000\n",
            p,
        )
        .unwrap();
        assert_eq!(
            (c.max.max_cosched_period_us, c.max.max_cosched_phase_us),
            (50_000, 10_000)
        );
        for (bad, key) in [
            (
                "[max]\nmax_cosched_period_us = 999\n",
                "max_cosched_period_us",
            ),
            (
                "[max]\nmax_cosched_period_us = 10000\nmax_cosched_phase_us = 20000\n",
                "max_cosched_phase_us",
            ),
            // Default caps above the limits.
            (
                "[defaults]\ncosched_period_us = 1000000\n",
                "cosched_period_us",
            ),
            (
                "[max]\nmax_cosched_phase_us = 5000\n[defaults]\ncosched_us = 10000\n",
                "cosched_us",
            ),
            // A phase is bounded by the defaults' own max_boost_us too.
            (
                "[defaults]\nmax_boost_us = 5000\ncosched_us = 10000\n",
                "cosched_us",
            ),
        ] {
            let e = Config::parse(bad, p).unwrap_err().to_string();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn the_applier_outranks_every_boost_it_undoes() {
        let p = Path::new("x.toml");
        assert_eq!(Config::parse("", p).unwrap().applier_rt_prio, 99);
        // Below a host's own RT threads (FIFO 8, say): every cap lower still.
        let low = "applier_rt_prio = 5\n[max]\nmax_rt_prio = 4\n";
        assert_eq!(Config::parse(low, p).unwrap().applier_rt_prio, 5);
        for bad in [
            "applier_rt_prio = 0\n",
            "applier_rt_prio = 100\n",
            // [max] max_rt_prio is 10 by default.
            "applier_rt_prio = 10\n",
            "applier_rt_prio = 4\n[max]\nmax_rt_prio = 4\n",
        ] {
            let e = Config::parse(bad, p).unwrap_err().to_string();
            assert!(e.contains("applier_rt_prio"), "{bad}: {e}");
        }
    }
}
