//! What the daemon's integration tests share: a real pvschedd process with
//! its own socket, configuration and VM directory.
#![allow(dead_code)]

use pvsched_daemon::Client;
use pvsched_testkit::wait_for;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

/// Liveness bound of the waits below (not a timing assertion).
pub const LIMIT: Duration = Duration::from_secs(20);

/// A pvschedd process with its own socket, config and VM directory.
pub struct Daemon {
    pub child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub metrics: String,
}

impl Daemon {
    /// A daemon whose socket only root may use.
    pub fn start(tag: &str, config: &str) -> Daemon {
        Self::start_for(tag, "", config)
    }

    /// A daemon whose socket members of `group` may use (`""`: root only).
    pub fn start_for(tag: &str, group: &str, config: &str) -> Daemon {
        let dir = std::env::temp_dir().join(format!("pvschedd-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("vms")).unwrap();
        let socket = dir.join("pvschedd.sock");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let metrics = format!("127.0.0.1:{port}");
        let cfg = dir.join("pvschedd.toml");
        std::fs::write(
            &cfg,
            format!(
                "socket = {:?}\nsocket_group = {group:?}\nvm_dir = {:?}\nmetrics_listen = {metrics:?}\n{config}",
                socket,
                dir.join("vms")
            ),
        )
        .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_pvschedd"))
            .arg("--config")
            .arg(&cfg)
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap();
        let d = Daemon {
            child,
            dir,
            socket,
            metrics,
        };
        wait_for("pvschedd's socket", LIMIT, || {
            Client::connect(&d.socket).ok()
        });
        d
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).unwrap()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn vm_file(&self, name: &str, caps: &str) {
        std::fs::write(self.dir.join("vms").join(format!("{name}.toml")), caps).unwrap();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `GET path` on the metrics endpoint `addr` (with `Authorization: Bearer
/// token` if given): the body of a 200 reply, else None.
pub fn http_get(addr: &str, path: &str, token: Option<&str>) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    // A server that never answers must not hang the caller's wait.
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n{auth}\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let body = out.split_once("\r\n\r\n")?.1.to_string();
    out.starts_with("HTTP/1.0 200").then_some(body)
}
