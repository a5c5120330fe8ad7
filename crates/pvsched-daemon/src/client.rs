//! A blocking client of pvschedd, for VMMs (`pvsched run --daemon`,
//! `pvsched qemu-attach`) and the `pvsched status | top | vm` commands.

use crate::proto::{DaemonStatus, ErrorKind, Region, RegisterVm, Reply, Request, VmStatus};
use crate::wire;
use pvsched_abi::seq::SharedRegion;
use pvsched_policy::Caps;
use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon's socket could not be reached.
    #[error(
        "connecting to pvschedd at {path}: {source} (is it running? `systemctl status pvschedd`; \
         non-root users must be in the socket's group)"
    )]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// Sending or receiving failed.
    #[error("talking to pvschedd: {0}")]
    Io(#[from] io::Error),
    /// The daemon refused the request; nothing changed.
    #[error("pvschedd refused the request ({kind}): {message}")]
    Refused {
        /// Why, for programs to match on.
        kind: ErrorKind,
        /// What failed and what to do.
        message: String,
    },
    /// The daemon answered something this client does not understand.
    #[error("pvschedd answered unexpectedly: {0}")]
    Protocol(String),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, ClientError>;

/// A device region received from the daemon: the VM's own region map,
/// mapped shared as a [`SharedRegion`] (which it derefs to: `as_ptr`, `len`,
/// `words`, `write_guest`, `read_host`); register it as BAR2's memslot.
pub struct RegionMap {
    region: SharedRegion,
}

impl RegionMap {
    /// Maps a region fd from pvschedd (a [`Reply::Registered`] or
    /// [`Client::reserve`] reply), `len` bytes shared at offset 0.
    pub fn new(fd: OwnedFd, len: u64) -> Result<RegionMap> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0 && l <= 1 << 20)
            .ok_or_else(|| ClientError::Protocol(format!("region of {len} bytes")))?;
        let region = SharedRegion::map(std::fs::File::from(fd), len).map_err(|e| {
            ClientError::Io(io::Error::other(format!("mmap of the region map: {e}")))
        })?;
        Ok(RegionMap { region })
    }
}

impl std::ops::Deref for RegionMap {
    type Target = SharedRegion;

    fn deref(&self) -> &SharedRegion {
        &self.region
    }
}

/// A successful registration.
pub struct Registered {
    /// The daemon's VM id.
    pub vm_id: u32,
    /// Caps in force.
    pub caps: Caps,
    /// Where they came from (`file`, `client`, `default`).
    pub caps_source: String,
    /// The device region ([`Region::Device`]).
    pub region: Option<RegionMap>,
}

/// A connection to pvschedd. A VM registered without `detach` stays
/// registered while this connection is open.
pub struct Client {
    fd: OwnedFd,
    buf: Vec<u8>,
    daemon_version: Option<String>,
}

impl Client {
    /// Connects to the daemon at `path` and says this client's protocol
    /// ([`Request::Hello`]): a pvschedd of another protocol refuses it
    /// here ([`ClientError::Refused`], its message naming both releases),
    /// before any request it could misread. A pvschedd older than the
    /// hello (1.1.0) answers it as an unknown request; it speaks protocol
    /// 1, and the connection goes on.
    pub fn connect(path: &Path) -> Result<Client> {
        let fd = wire::connect_to(path).map_err(|source| ClientError::Connect {
            path: path.into(),
            source,
        })?;
        let mut c = Client {
            fd,
            buf: vec![0; 8 << 20],
            daemon_version: None,
        };
        let hello = Request::Hello {
            proto: crate::proto::PROTOCOL,
            version: crate::proto::VERSION.into(),
        };
        match c.request(&hello) {
            Ok((Reply::Hello { version, .. }, _)) => c.daemon_version = Some(version),
            Ok((r, _)) => return Err(ClientError::Protocol(format!("{r:?}"))),
            Err(ClientError::Refused {
                kind: ErrorKind::Malformed,
                ..
            }) => {}
            Err(e) => return Err(e),
        }
        Ok(c)
    }

    /// The daemon's release, as its hello said (None: a pvschedd older
    /// than 1.1.0).
    pub fn daemon_version(&self) -> Option<&str> {
        self.daemon_version.as_deref()
    }

    /// Sends one request and returns the reply (and an fd that came with
    /// it); an error reply is [`ClientError::Refused`].
    pub fn request(&mut self, req: &Request) -> Result<(Reply, Option<OwnedFd>)> {
        let bytes = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        wire::send(self.fd.as_fd(), &bytes, None)?;
        let got = wire::recv(self.fd.as_fd(), &mut self.buf)?;
        if got.len == 0 {
            return Err(ClientError::Protocol(
                "the daemon closed the connection".into(),
            ));
        }
        if got.truncated {
            return Err(ClientError::Protocol("reply larger than 8 MiB".into()));
        }
        let mut reply: Reply = serde_json::from_slice(&self.buf[..got.len])
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        if let Reply::Chunked { parts, bytes } = reply {
            reply = self.chunked(parts, bytes)?;
        }
        if let Reply::Error { kind, message } = reply {
            return Err(ClientError::Refused { kind, message });
        }
        Ok((reply, got.fds.into_iter().next()))
    }

    /// The reply sent in `parts` messages of `bytes` bytes in all.
    fn chunked(&mut self, parts: u32, bytes: u64) -> Result<Reply> {
        if bytes > crate::proto::MAX_REPLY {
            return Err(ClientError::Protocol(format!(
                "chunked reply of {bytes} bytes refused (at most {})",
                crate::proto::MAX_REPLY
            )));
        }
        let mut all = Vec::with_capacity(bytes as usize);
        for _ in 0..parts {
            let got = wire::recv(self.fd.as_fd(), &mut self.buf)?;
            if got.len == 0 || got.truncated || (all.len() + got.len) as u64 > bytes {
                return Err(ClientError::Protocol(
                    "a chunked reply ended early or ran long".into(),
                ));
            }
            all.extend_from_slice(&self.buf[..got.len]);
        }
        serde_json::from_slice(&all).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Registers a VM.
    pub fn register(&mut self, vm: RegisterVm) -> Result<Registered> {
        let want_region = vm.region == Region::Device;
        let (reply, fd) = self.request(&Request::Register(vm))?;
        let Reply::Registered {
            vm_id,
            caps,
            caps_source,
            region_len,
        } = reply
        else {
            return Err(ClientError::Protocol(format!("{reply:?}")));
        };
        let region = match (want_region, fd) {
            (true, Some(fd)) => Some(RegionMap::new(fd, region_len)?),
            (true, None) => {
                return Err(ClientError::Protocol("no region fd with the reply".into()));
            }
            (false, _) => None,
        };
        Ok(Registered {
            vm_id,
            caps: *caps,
            caps_source,
            region,
        })
    }

    /// Reserves VM `name`'s device region before its VMM registers (root
    /// only, [`Request::Reserve`]): the region map's fd and its length,
    /// for the device process that serves it as BAR2.
    pub fn reserve(&mut self, name: &str) -> Result<(OwnedFd, u64)> {
        match self.request(&Request::Reserve { name: name.into() })? {
            (Reply::Reserved { region_len }, Some(fd)) => Ok((fd, region_len)),
            (Reply::Reserved { .. }, None) => {
                Err(ClientError::Protocol("no region fd with the reply".into()))
            }
            (r, _) => Err(ClientError::Protocol(format!("{r:?}"))),
        }
    }

    /// Unregisters VM `name` (restoring its threads).
    pub fn unregister(&mut self, name: &str) -> Result<()> {
        self.request(&Request::Unregister { name: name.into() })
            .map(|_| ())
    }

    /// Changes VM `name`'s caps live; returns the caps now in force.
    pub fn set(&mut self, name: &str, settings: BTreeMap<String, String>) -> Result<Caps> {
        match self.request(&Request::Set {
            name: name.into(),
            settings,
        })? {
            (Reply::Ok { caps: Some(c) }, _) => Ok(*c),
            (r, _) => Err(ClientError::Protocol(format!("{r:?}"))),
        }
    }

    /// The daemon's and every VM's status.
    pub fn status(&mut self) -> Result<(DaemonStatus, Vec<VmStatus>)> {
        match self.request(&Request::Status)? {
            (Reply::Status { daemon, vms }, _) => Ok((*daemon, vms)),
            (r, _) => Err(ClientError::Protocol(format!("{r:?}"))),
        }
    }

    /// The Prometheus exposition.
    pub fn metrics(&mut self) -> Result<String> {
        match self.request(&Request::Metrics)? {
            (Reply::Metrics { text }, _) => Ok(text),
            (r, _) => Err(ClientError::Protocol(format!("{r:?}"))),
        }
    }
}

impl AsFd for Client {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A connection-owned registration that outlives pvschedd restarts: it
/// registers `req`, and when the daemon closes the connection (pvschedd
/// stopped, restarted, killed: its VM was unregistered and every thread
/// restored), [`Session::reconnect`] connects again and registers the same
/// request again.
///
/// A registration's device region ([`Region::Device`]) is the daemon's: a
/// new daemon gives a new region, so after a reconnect the VMM must back
/// its BAR2 with [`Session::registered`]'s region (what the guest wrote
/// into the old one is not carried over). Guest-region and no-region
/// registrations need nothing more.
pub struct Session {
    socket: PathBuf,
    req: RegisterVm,
    client: Client,
    registered: Registered,
}

impl Session {
    /// Connects to the daemon at `socket` and registers `req`.
    pub fn register(socket: &Path, req: RegisterVm) -> Result<Session> {
        let mut client = Client::connect(socket)?;
        let registered = client.register(req.clone())?;
        Ok(Session {
            socket: socket.into(),
            req,
            client,
            registered,
        })
    }

    /// The registration in force.
    pub fn registered(&self) -> &Registered {
        &self.registered
    }

    /// The connection, e.g. for status requests.
    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    /// Waits up to `timeout` (None: for ever) for the daemon to close the
    /// connection; true if it did. The daemon never speaks unasked, so a
    /// readable connection is a closed one.
    pub fn wait_closed(&self, timeout: Option<std::time::Duration>) -> Result<bool> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let t = match timeout {
            None => PollTimeout::NONE,
            Some(d) => PollTimeout::try_from(d).unwrap_or(PollTimeout::MAX),
        };
        let mut fds = [PollFd::new(self.client.as_fd(), PollFlags::POLLIN)];
        loop {
            match poll(&mut fds, t) {
                Ok(0) => return Ok(false),
                Ok(_) => return Ok(true),
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(ClientError::Io(e.into())),
            }
        }
    }

    /// Connects and registers again after the daemon went away, trying
    /// every `retry` until `give_up` has passed (a restarted pvschedd
    /// needs a moment to load its policy). A refusal is final (the
    /// daemon's answer would not change).
    pub fn reconnect(
        &mut self,
        retry: std::time::Duration,
        give_up: std::time::Duration,
    ) -> Result<&Registered> {
        let t0 = std::time::Instant::now();
        loop {
            let attempt = Client::connect(&self.socket).and_then(|mut c| {
                let r = c.register(self.req.clone())?;
                Ok((c, r))
            });
            match attempt {
                Ok((c, r)) => {
                    self.client = c;
                    self.registered = r;
                    return Ok(&self.registered);
                }
                Err(e @ ClientError::Refused { .. }) => return Err(e),
                Err(e) if t0.elapsed() >= give_up => return Err(e),
                Err(_) => std::thread::sleep(retry),
            }
        }
    }
}
