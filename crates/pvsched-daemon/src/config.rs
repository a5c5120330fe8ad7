//! pvschedd's configuration: `/etc/pvsched/pvschedd.toml` (the daemon, the
//! operator's caps maximum and the default caps) and one optional file per
//! VM, `/etc/pvsched/vms/<name>.toml` (that VM's caps, in the format of
//! `bpf-policy/caps.example.toml`). Every key is optional.
//!
//! ```toml
//! socket = "/run/pvsched/pvschedd.sock"
//! socket_group = "kvm"          # may connect and register its own VMs
//! vm_dir = "/etc/pvsched/vms"
//! require_vm_file = false       # true: only VMs with a file are served
//! metrics_listen = "127.0.0.1:9848"
//! metrics_token_file = ""       # bearer token for scrapes; VM names need it
//! client_timeout_ms = 5000
//! max_clients = 1024
//! max_clients_per_uid = 32      # connections of one uid other than root
//! max_vms_per_uid = 16          # VMs of one uid other than root
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
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error the system call returned (errno).
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML of this format.
    #[error("{path}: {source} (see docs/operating.md, \"Configuring pvschedd\")")]
    Toml {
        /// The file.
        path: PathBuf,
        /// The TOML parser's error, with line and column.
        #[source]
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("{path}: {source}")]
    Caps {
        /// The file.
        path: PathBuf,
        /// Which cap is wrong and why.
        #[source]
        source: CapsError,
    },
    /// Some other value is wrong.
    #[error("{path}: {what}")]
    Invalid {
        /// The file.
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
    /// Group owning the socket (mode 0660); its members may register their
    /// own VMs and read status. Empty: root only (mode 0600).
    pub socket_group: String,
    /// Directory of per-VM caps files (`<name>.toml`).
    pub vm_dir: PathBuf,
    /// Serve only VMs that have a caps file (per-VM opt-in).
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
    /// The operator's maximum for every VM's caps.
    pub max: CapsLimit,
    /// Caps of a VM that has no file and sent none.
    pub defaults: Caps,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            socket: DEFAULT_SOCKET.into(),
            socket_group: "kvm".into(),
            vm_dir: "/etc/pvsched/vms".into(),
            require_vm_file: false,
            metrics_listen: "127.0.0.1:9848".into(),
            metrics_token_file: PathBuf::new(),
            client_timeout_ms: 5000,
            max_clients: 1024,
            max_clients_per_uid: 32,
            max_vms_per_uid: 16,
            max: CapsLimit::default(),
            defaults: Caps::default(),
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
        let c: Config = toml::from_str(text).map_err(|source| ConfigError::Toml {
            path: path.into(),
            source,
        })?;
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
        Ok(c)
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

    /// The caps file of VM `name` (a valid name: no path separators).
    pub fn vm_file(&self, name: &str) -> PathBuf {
        self.vm_dir.join(format!("{name}.toml"))
    }

    /// VM `name`'s caps from its file: `Ok(None)` if it has none.
    pub fn vm_caps(&self, name: &str) -> Result<Option<Caps>, ConfigError> {
        let path = self.vm_file(name);
        match std::fs::read_to_string(&path) {
            Ok(text) => Caps::from_toml(&text)
                .map(Some)
                .map_err(|source| ConfigError::Caps { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(ConfigError::Read { path, source }),
        }
    }
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
    fn the_shipped_file_is_the_defaults() {
        let text = include_str!("../../../dist/pvschedd.toml");
        let c = Config::parse(text, Path::new("dist/pvschedd.toml")).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn defaults_above_the_maximum_are_refused() {
        let e = Config::parse("[max]\nmax_rt_prio = 2\n", Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("operator maximum"), "{e}");
        let e = Config::parse("sockett = \"x\"\n", Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
    }
}
