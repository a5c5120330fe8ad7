//! The daemon's socket side: a single-threaded epoll loop over the
//! listening socket, the clients (their requests and reply queues), every
//! VMM's pidfd and a signalfd. What a request does to the VMs is the
//! registry's (`crate::registry`, which holds the [`Agent`]); this module
//! decides who may ask for it, calls the registry under its mutex and
//! sends the reply. Each request is handled to the end before the next
//! (registration is a few map updates), so no lock is held across I/O;
//! the Prometheus HTTP endpoint runs on its own thread and takes
//! snapshots of the registry under the same mutex
//! ([`Server::snapshots`]).
//!
//! Trust: a client is known by `SO_PEERCRED` and `SO_PEERPIDFD`. Root may
//! register any process (`pvsched qemu-attach`) and change caps; anyone
//! else who can open the socket may register only threads of its own
//! process and unregister only its own VMs. A VM lives while its VMM lives
//! (pidfd) and, unless registered `detach`ed by root, while the connection
//! that registered it is open.

use crate::config::Config;
use crate::proto::{
    self, DaemonStatus, ErrorKind, Region, RegisterVm, Reply, Request, UnregisterReason, VmStatus,
};
use crate::registry::{Registry, unknown_vm};
use crate::wire;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use pvsched_agent::{Agent, AgentConfig};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Errors that stop the daemon (request errors are replies, never these).
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum ServerError {
    /// The policy could not be loaded.
    #[error("{0}")]
    Agent(#[from] pvsched_agent::AgentError),
    /// The socket could not be set up.
    #[error("pvschedd: setting up the socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// The socket group does not exist.
    #[error("pvschedd: socket_group {0:?} does not exist (create it or set socket_group = \"\")")]
    Group(String),
    /// Some other system call failed.
    #[error("pvschedd: {what}: {source}")]
    Sys {
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
}

fn sys(what: &'static str) -> impl FnOnce(nix::Error) -> ServerError {
    move |e| ServerError::Sys {
        what,
        source: e.into(),
    }
}

fn lock(r: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    pvsched_util::lock(r)
}

/// A connected client.
struct Client {
    fd: OwnedFd,
    pid: u32,
    uid: u32,
    pidfd: Option<Arc<OwnedFd>>,
    /// Close it if it sends nothing before this (None: it holds a VM).
    deadline: Option<Instant>,
    /// Reply messages not sent yet (the client reads slower than it asks),
    /// each with the fd it carries; sent when the socket is writable.
    out: VecDeque<(Vec<u8>, Option<OwnedFd>)>,
    /// What epoll waits for on this client now.
    interest: EpollFlags,
}

impl Client {
    fn queue(&mut self, bytes: Vec<u8>, pass: Option<OwnedFd>) {
        self.out.push_back((bytes, pass));
    }
}

/// What an epoll event is about.
#[derive(Clone, Copy)]
enum Token {
    Listener,
    Signal,
    Client(u64),
    VmExit(u64),
}

const T_LISTENER: u64 = 0;
const T_SIGNAL: u64 = 1;
const T_CLIENT: u64 = 1 << 62;
const T_PIDFD: u64 = 1 << 61;

impl Token {
    fn encode(self) -> u64 {
        match self {
            Token::Listener => T_LISTENER,
            Token::Signal => T_SIGNAL,
            Token::Client(id) => T_CLIENT | id,
            Token::VmExit(id) => T_PIDFD | id,
        }
    }

    fn decode(v: u64) -> Token {
        match v {
            T_LISTENER => Token::Listener,
            T_SIGNAL => Token::Signal,
            v if v & T_CLIENT != 0 => Token::Client(v & !T_CLIENT),
            v => Token::VmExit(v & !T_PIDFD),
        }
    }
}

/// The running daemon.
pub struct Server {
    registry: Arc<Mutex<Registry>>,
    /// The configuration, for the limits on clients (the registry has its
    /// own copy for caps and quotas: reading these takes no lock).
    cfg: Config,
    listener: OwnedFd,
    socket: PathBuf,
    epoll: Epoll,
    signals: SignalFd,
    clients: HashMap<u64, Client>,
    /// pidfd watch id → VM name.
    watches: HashMap<u64, String>,
    next_id: u64,
    buf: Vec<u8>,
    /// Detached registrations, recorded for the next pvschedd.
    detached: crate::persist::Detached,
    /// Where SIGHUP reads the configuration again (None: it only logs).
    reload: Option<Reload>,
}

/// What a SIGHUP reads again, and where its results go.
pub struct Reload {
    /// The configuration file.
    pub path: PathBuf,
    /// The command line's settings over it.
    pub overrides: crate::config::Overrides,
    /// The flavor caps files `pvsched qemu-attach` sends, checked too.
    pub flavor_dir: PathBuf,
    /// The metrics endpoint's token, replaced by the file's.
    pub token: crate::http::MetricsToken,
}

impl Server {
    /// Loads the policy, opens the socket (mode 0660, group
    /// `socket_group`) and prepares the loop. SIGINT/SIGTERM end
    /// [`Server::run`] cleanly.
    pub fn new(cfg: Config) -> Result<Server, ServerError> {
        // Signals first, so none arrives between load and the loop.
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGINT);
        mask.add(Signal::SIGTERM);
        mask.add(Signal::SIGHUP);
        mask.thread_block()
            .map_err(sys("blocking SIGINT/SIGTERM/SIGHUP"))?;
        let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
            .map_err(sys("signalfd"))?;
        raise_fd_limit();
        let gid = socket_gid(&cfg.socket_group)?;
        let socket = cfg.socket.clone();
        let sock_err = |source| ServerError::Socket {
            path: socket.clone(),
            source,
        };
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).map_err(sock_err)?;
        }
        let runtime_dir = cfg.runtime_dir();
        std::fs::create_dir_all(&runtime_dir).map_err(|source| ServerError::Socket {
            path: runtime_dir.clone(),
            source,
        })?;
        // The ledger file: what a previous pvschedd left boosted is
        // restored inside Agent::load, before the policy loads.
        let agent = Agent::load(AgentConfig {
            consumer_rt_prio: cfg.applier_rt_prio,
            cosched_host_pct: cfg.cosched.host_pct,
            cosched_max_pct: cfg.max.max_cosched_pct,
            cosched_max_phase_us: cfg.max.max_cosched_phase_us,
            cosched_yield: cfg.cosched.yield_to_host,
            cosched_off_slice_ns: cfg.cosched.off_slice_us * 1000,
            handle_signals: false,
            ledger: Some(crate::persist::ledger_path(&runtime_dir)),
            ..AgentConfig::default()
        })?;
        let listener = wire::listen_at(&socket).map_err(sock_err)?;
        set_socket_mode(&socket, gid).map_err(sock_err)?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(sys("epoll_create"))?;
        epoll
            .add(
                &listener,
                EpollEvent::new(EpollFlags::EPOLLIN, Token::Listener.encode()),
            )
            .map_err(sys("epoll_ctl"))?;
        epoll
            .add(
                &signals,
                EpollEvent::new(EpollFlags::EPOLLIN, Token::Signal.encode()),
            )
            .map_err(sys("epoll_ctl"))?;
        let registry = Arc::new(Mutex::new(Registry::new(cfg.clone(), agent)));
        let mut server = Server {
            registry,
            cfg,
            listener,
            socket,
            epoll,
            signals,
            clients: HashMap::new(),
            watches: HashMap::new(),
            next_id: 1,
            buf: vec![0; proto::MAX_REQUEST + 1],
            detached: crate::persist::Detached::new(&runtime_dir),
            reload: None,
        };
        server.readopt_detached();
        Ok(server)
    }

    /// Has SIGHUP read the configuration again as `r` says.
    pub fn reload_with(&mut self, r: Reload) {
        self.reload = Some(r);
    }

    /// The metrics endpoint's state, shown in status: its thread
    /// ([`crate::http::spawn`]) keeps it up to date.
    pub fn metrics_endpoint(&self) -> crate::http::EndpointState {
        lock(&self.registry).endpoint()
    }

    /// What the metrics endpoint renders, for its thread
    /// ([`crate::http::spawn`]): each call takes the registry's
    /// lock only to copy out the daemon's figures and every VM's status.
    pub fn snapshots(&self) -> impl Fn() -> (DaemonStatus, Vec<VmStatus>) + Send + Sync + 'static {
        let registry = self.registry.clone();
        move || lock(&registry).snapshot(None)
    }

    /// Serves until SIGINT/SIGTERM; then unregisters every VM (restoring
    /// its threads) and removes the socket.
    ///
    /// Under a systemd unit with `WatchdogSec=`, this loop pings the
    /// watchdog at half that period: a loop stuck (a lock never released,
    /// a request that never ends) is killed and restarted by systemd, and
    /// the guardian restores every boosted thread.
    pub fn run(mut self) -> Result<(), ServerError> {
        let mut events = vec![EpollEvent::empty(); 64];
        let ping = sd_notify::watchdog_enabled().map(|period| period / 2);
        let mut next_ping = Instant::now();
        loop {
            if let Some(every) = ping
                && Instant::now() >= next_ping
            {
                notify(sd_notify::NotifyState::Watchdog);
                next_ping = Instant::now() + every;
            }
            let timeout = self.next_timeout(ping.map(|_| next_ping));
            let n = match self.epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(sys("epoll_wait")(e)),
            };
            for ev in &events[..n] {
                match Token::decode(ev.data()) {
                    Token::Listener => self.accept_all(),
                    Token::Signal => {
                        while let Ok(Some(s)) = self.signals.read_signal() {
                            if s.ssi_signo == Signal::SIGHUP as u32 {
                                self.reload();
                                continue;
                            }
                            tracing::info!(
                                signal = s.ssi_signo,
                                "stopping: unregistering every VM"
                            );
                            self.shutdown();
                            return Ok(());
                        }
                    }
                    Token::Client(id) => {
                        let ev_flags = ev.events();
                        if ev_flags.contains(EpollFlags::EPOLLOUT) {
                            self.flush(id);
                        }
                        if ev_flags.intersects(EpollFlags::EPOLLIN | EpollFlags::EPOLLHUP) {
                            self.serve(id);
                        }
                    }
                    Token::VmExit(id) => self.vm_exited(id),
                }
            }
            self.expire_clients();
        }
    }

    /// Until the next client deadline or `also` (the watchdog's next ping).
    fn next_timeout(&self, also: Option<Instant>) -> EpollTimeout {
        let now = Instant::now();
        let next = self
            .clients
            .values()
            .filter_map(|c| c.deadline)
            .chain(also)
            .min()
            .map(|d| d.saturating_duration_since(now))
            .unwrap_or(Duration::from_secs(60));
        EpollTimeout::try_from(next.max(Duration::from_millis(1))).unwrap_or(EpollTimeout::NONE)
    }

    fn accept_all(&mut self) {
        loop {
            let fd = match wire::accept(&self.listener) {
                Ok(Some(fd)) => fd,
                Ok(None) => return,
                Err(e) => {
                    // EMFILE and the like: leave the rest in the backlog.
                    tracing::warn!("accept failed: {e}");
                    return;
                }
            };
            let (max, timeout) = (self.cfg.max_clients, self.cfg.client_timeout());
            if self.clients.len() >= max {
                let _ = reply(
                    &fd,
                    &Reply::error(
                        ErrorKind::Busy,
                        format!("pvschedd serves {max} clients already; retry later"),
                    ),
                    None,
                );
                lock(&self.registry).count_refused();
                continue;
            }
            let Ok((pid, uid, _gid)) = wire::peer_cred(&fd) else {
                continue;
            };
            let per_uid = self.cfg.max_clients_per_uid;
            if uid != 0 && self.clients.values().filter(|c| c.uid == uid).count() >= per_uid {
                let _ = reply(
                    &fd,
                    &Reply::error(
                        ErrorKind::Busy,
                        format!(
                            "uid {uid} has {per_uid} connections to pvschedd already \
                             (max_clients_per_uid); close one and retry"
                        ),
                    ),
                    None,
                );
                lock(&self.registry).count_refused();
                continue;
            }
            let pidfd = wire::peer_pidfd(&fd)
                .or_else(|| pvsched_agent::watch::pidfd_open(pid).ok())
                .map(Arc::new);
            wire::grow_send_buffer(&fd, 4 << 20);
            let id = self.next_id;
            self.next_id += 1;
            if let Err(e) = self.epoll.add(
                &fd,
                EpollEvent::new(EpollFlags::EPOLLIN, Token::Client(id).encode()),
            ) {
                tracing::warn!("epoll_ctl on a client failed: {e}");
                continue;
            }
            self.clients.insert(
                id,
                Client {
                    fd,
                    pid,
                    uid,
                    pidfd,
                    deadline: Some(Instant::now() + timeout),
                    out: VecDeque::new(),
                    interest: EpollFlags::EPOLLIN,
                },
            );
            lock(&self.registry).set_clients(self.clients.len() as u32);
        }
    }

    fn expire_clients(&mut self) {
        let now = Instant::now();
        let late: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(c) = self.clients.get(&id) {
                tracing::debug!(pid = c.pid, "closing a client that sent nothing in time");
                let _ = reply(
                    &c.fd,
                    &Reply::error(ErrorKind::Timeout, "no request in time; connection closed"),
                    None,
                );
            }
            self.close_client(id);
        }
    }

    fn close_client(&mut self, id: u64) {
        let Some(c) = self.clients.remove(&id) else {
            return;
        };
        let _ = self.epoll.delete(&c.fd);
        let registry = self.registry.clone();
        let mut reg = lock(&registry);
        reg.set_clients(self.clients.len() as u32);
        for name in reg.owned_by(id) {
            tracing::info!(vm = %name, "its VMM closed the connection: unregistering");
            self.unregister(&mut reg, &name, UnregisterReason::ConnectionClosed);
        }
    }

    /// Ends VM `name`'s registration for `why`: stops watching its VMM,
    /// forgets its detached record, then drops the VM (which restores
    /// every thread of the VM).
    fn unregister(&mut self, reg: &mut Registry, name: &str, why: UnregisterReason) {
        if let Some(vm) = reg.unregister(name, why) {
            let _ = self.epoll.delete(vm.pidfd());
            if vm.detached() {
                self.detached.forget(name);
            }
        }
        self.watches.retain(|_, n| n != name);
    }

    /// Root asks for name `name` (a registration, a device region): an
    /// unprivileged VMM that holds it without a VM file binding it loses
    /// it. Names are the operator's; without this, any local VMM could
    /// register a predictable name (a Nova instance's) first and lock its
    /// real VM out, or be handed the real guest's device region.
    fn take_over(&mut self, reg: &mut Registry, name: &str) {
        if let Some((pid, uid)) = reg.squatter(name) {
            tracing::warn!(
                vm = %name, pid, uid,
                "root takes over the name from an unprivileged VMM that no VM file binds to it: \
                 its registration ends"
            );
            self.unregister(reg, name, UnregisterReason::Superseded);
        }
    }

    /// Watches the VMM of VM `name` (its `pidfd`) for its exit.
    fn watch(&mut self, pidfd: &OwnedFd, name: &str) -> nix::Result<()> {
        let watch = self.next_id;
        self.next_id += 1;
        self.epoll.add(
            pidfd.as_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN, Token::VmExit(watch).encode()),
        )?;
        self.watches.insert(watch, name.to_owned());
        Ok(())
    }

    fn vm_exited(&mut self, watch: u64) {
        let Some(name) = self.watches.get(&watch).cloned() else {
            return;
        };
        let registry = self.registry.clone();
        let mut reg = lock(&registry);
        if let Some(pid) = reg.pid_of(&name) {
            tracing::info!(vm = %name, pid, "its VMM exited: unregistering");
        }
        self.unregister(&mut reg, &name, UnregisterReason::VmmExited);
    }

    fn serve(&mut self, id: u64) {
        let Some(c) = self.clients.get(&id) else {
            return;
        };
        let got = match wire::recv(c.fd.as_fd(), &mut self.buf) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(_) => {
                self.close_client(id);
                return;
            }
        };
        if got.len == 0 {
            self.close_client(id);
            return;
        }
        drop(got.fds); // clients have no reason to send fds
        let (answer, pass) = if got.truncated {
            (
                Reply::error(
                    ErrorKind::Malformed,
                    format!("request larger than {} bytes refused", proto::MAX_REQUEST),
                ),
                None,
            )
        } else {
            match proto::parse_request(&self.buf[..got.len]) {
                Ok(req) => self.handle(id, req),
                Err(e @ proto::ProtoError::Invalid(_)) => {
                    (Reply::error(ErrorKind::Invalid, e.to_string()), None)
                }
                Err(e) => (Reply::error(ErrorKind::Malformed, e.to_string()), None),
            }
        };
        let holds_vm = {
            let mut reg = lock(&self.registry);
            if matches!(answer, Reply::Error { .. }) {
                reg.count_refused();
            }
            reg.holds_vm(id)
        };
        let timeout = self.cfg.client_timeout();
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        c.deadline = (!holds_vm).then(|| Instant::now() + timeout);
        let bytes = serde_json::to_vec(&answer).unwrap_or_default();
        if bytes.len() <= proto::MAX_PART {
            c.queue(bytes, pass);
        } else {
            // Too large for one message (a status of many threads): a
            // header, then the JSON in parts.
            let parts = bytes.chunks(proto::MAX_PART);
            let head = Reply::Chunked {
                parts: parts.len() as u32,
                bytes: bytes.len() as u64,
            };
            c.queue(serde_json::to_vec(&head).unwrap_or_default(), pass);
            for part in parts {
                c.queue(part.to_vec(), None);
            }
        }
        self.flush(id);
    }

    /// Sends what client `id` has queued, as far as its socket takes it;
    /// waits for writability if something is left, and stops reading its
    /// requests while too much is left. A client that is gone is closed.
    fn flush(&mut self, id: u64) {
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        while let Some((bytes, pass)) = c.out.front() {
            match reply_bytes(&c.fd, bytes, pass.as_ref()) {
                Ok(()) => {
                    c.out.pop_front();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!(pid = c.pid, "reply failed ({e}); closing the client");
                    self.close_client(id);
                    return;
                }
            }
        }
        // One reply in flight per client: its next request is not read
        // until it has taken the whole of the last reply. What a client
        // that never reads can make pvschedd hold is then one reply (its
        // own VMs' status), not a queue it grows by asking on; a VMM that
        // reads slowly keeps its VM.
        let mut want = EpollFlags::empty();
        if c.out.is_empty() {
            want |= EpollFlags::EPOLLIN;
        }
        if !c.out.is_empty() {
            want |= EpollFlags::EPOLLOUT;
        }
        if want != c.interest {
            let mut ev = EpollEvent::new(want, Token::Client(id).encode());
            if let Err(e) = self.epoll.modify(&c.fd, &mut ev) {
                tracing::warn!("epoll_ctl on a client failed: {e}");
            }
            c.interest = want;
        }
    }

    fn handle(&mut self, id: u64, req: Request) -> (Reply, Option<OwnedFd>) {
        let Some(c) = self.clients.get(&id) else {
            return (Reply::error(ErrorKind::Internal, "client gone"), None);
        };
        let (peer_pid, peer_uid, peer_pidfd) = (c.pid, c.uid, c.pidfd.clone());
        let root = peer_uid == 0;
        match req {
            Request::Register(req) => {
                let target = req.pid.unwrap_or(peer_pid);
                if (target != peer_pid || req.detach || req.region == Region::Reserved) && !root {
                    return (
                        Reply::error(
                            ErrorKind::Denied,
                            "only root may register another process's VM, detach it or give it a reserved region",
                        ),
                        None,
                    );
                }
                // Each VM watches its VMM through a pidfd of its own: epoll
                // knows an fd once, so two VMs of one connection sharing the
                // connection's pidfd could not both be watched, and ending
                // one watch would end the other's.
                let pidfd = if target == peer_pid {
                    peer_pidfd.and_then(|p| p.try_clone().ok()).map(Arc::new)
                } else {
                    pvsched_agent::watch::pidfd_open(target).ok().map(Arc::new)
                };
                let Some(pidfd) = pidfd else {
                    return (
                        Reply::error(
                            ErrorKind::Invalid,
                            format!("process {target} does not exist"),
                        ),
                        None,
                    );
                };
                let conn = (!req.detach).then_some(id);
                let record = req.detach.then(|| req.clone());
                let registry = self.registry.clone();
                let mut reg = lock(&registry);
                if !root && let Err(r) = reg.within_quota(peer_uid) {
                    return (r, None);
                }
                if root {
                    self.take_over(&mut reg, &req.name);
                }
                let watched = pidfd.clone();
                match reg.register(req, target, peer_uid, pidfd, conn) {
                    Ok((reply, fd, name)) => {
                        self.record_detached(target, record.as_ref());
                        reg.count_registration();
                        if let Err(e) = self.watch(&watched, &name) {
                            tracing::warn!(vm = %name, "cannot watch its VMM ({e}); unregistering");
                            self.unregister(&mut reg, &name, UnregisterReason::Failed);
                            return (
                                Reply::error(ErrorKind::Internal, format!("epoll_ctl: {e}")),
                                None,
                            );
                        }
                        (reply, fd)
                    }
                    Err(r) => (r, None),
                }
            }
            Request::Unregister { name } => {
                let registry = self.registry.clone();
                let mut reg = lock(&registry);
                let Some(pid) = reg.pid_of(&name) else {
                    if root && reg.drop_reservation(&name) {
                        tracing::info!(vm = %name, "reserved region dropped on request");
                        return (Reply::Ok { caps: None }, None);
                    }
                    return (unknown_vm(&name), None);
                };
                if !root && pid != peer_pid {
                    return (
                        Reply::error(
                            ErrorKind::Denied,
                            format!("VM {name} belongs to another process"),
                        ),
                        None,
                    );
                }
                self.unregister(&mut reg, &name, UnregisterReason::Request);
                tracing::info!(vm = %name, "unregistered on request");
                (Reply::Ok { caps: None }, None)
            }
            Request::Set { name, settings } => {
                if !root {
                    return (
                        Reply::error(ErrorKind::Denied, "only root may change a VM's caps"),
                        None,
                    );
                }
                let mut reg = lock(&self.registry);
                (reg.set_caps(&name, &settings), None)
            }
            Request::Reserve { name } => {
                if !root {
                    return (
                        Reply::error(ErrorKind::Denied, "only root may reserve a VM's region"),
                        None,
                    );
                }
                let registry = self.registry.clone();
                let mut reg = lock(&registry);
                self.take_over(&mut reg, &name);
                match reg.reserve(&name) {
                    Ok((reply, fd)) => (reply, Some(fd)),
                    Err(r) => (r, None),
                }
            }
            // Anyone but root sees only the VMs it registered.
            Request::Status => {
                let (daemon, vms) = lock(&self.registry).snapshot(viewer(root, peer_uid));
                (
                    Reply::Status {
                        daemon: Box::new(daemon),
                        vms,
                    },
                    None,
                )
            }
            Request::Metrics => {
                let (daemon, vms) = lock(&self.registry).snapshot(viewer(root, peer_uid));
                let text = crate::metrics::render(daemon, vms, crate::metrics::VmLabel::Name);
                (Reply::Metrics { text }, None)
            }
            Request::Hello { proto, version } => (hello(proto, &version), None),
        }
    }

    /// SIGHUP: the configuration file, the VM files and the flavor files
    /// read and checked again; all of it taken, or none (a bad file keeps
    /// the running configuration, and the log says why). What pvschedd
    /// bound or loaded at start keeps its running value until a restart.
    fn reload(&mut self) {
        let Some(r) = &self.reload else {
            tracing::warn!("SIGHUP: no configuration file to read again; ignored");
            return;
        };
        let read = crate::config::Config::load(&r.path).and_then(|mut c| {
            r.overrides.apply(&mut c);
            let files = c.check_dirs(&r.flavor_dir)?;
            let token = c.metrics_token()?;
            let kept = self.cfg.keep_restart_only(c.clone());
            kept.validate(&r.path)?;
            Ok((c, kept, files, token))
        });
        let (file, cfg, (vm_files, flavor_files), token) = match read {
            Ok(x) => x,
            Err(e) => {
                tracing::error!("SIGHUP: configuration not reloaded, the running one stays: {e}");
                lock(&self.registry).count_reload_error();
                return;
            }
        };
        for what in self.cfg.restart_only_changes(&file) {
            tracing::warn!(
                "SIGHUP: {what} changed in {}: it takes effect when pvschedd restarts",
                r.path.display()
            );
        }
        for d in &file.deprecated {
            tracing::warn!("{}: {d}; the old spelling still works", r.path.display());
        }
        r.token.set(token);
        let above = lock(&self.registry).set_config(cfg.clone());
        for (name, why) in above {
            tracing::warn!(
                vm = %name,
                "its caps are above the reloaded [max] ({why}); they stay until it registers \
                 again or `pvsched vm set` lowers them"
            );
        }
        tracing::info!(
            "configuration reloaded from {} ({vm_files} VM file(s), {flavor_files} flavor \
             file(s) checked)",
            r.path.display()
        );
        self.cfg = cfg;
    }

    fn shutdown(&mut self) {
        notify(sd_notify::NotifyState::Stopping);
        // Detached VMs are unregistered (restored) like every VM, and kept
        // on record: the next pvschedd registers them again.
        self.detached.keep_all();
        let registry = self.registry.clone();
        let mut reg = lock(&registry);
        for name in reg.names() {
            self.unregister(&mut reg, &name, UnregisterReason::Shutdown);
        }
        drop(reg);
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Server {
    /// Records a detached registration (`req`, of process `pid`) for the
    /// next pvschedd; a failure is logged (the VM stays registered now).
    fn record_detached(&self, pid: u32, req: Option<&RegisterVm>) {
        if let Some(req) = req
            && let Err(e) = self.detached.save(pid, req)
        {
            tracing::warn!(vm = %req.name, "recording the detached registration failed ({e}); a restarted pvschedd will not register it again");
        }
    }

    /// At start: registers again every detached VM recorded by a previous
    /// pvschedd whose VMM process is still the same one (pid and start
    /// time), exactly as it was asked; forgets the others.
    fn readopt_detached(&mut self) {
        for rec in self.detached.load() {
            let name = rec.request.name.clone();
            // The pidfd first: a start time that matches after it is open
            // proves the pidfd names the recorded process.
            let pidfd = pvsched_agent::watch::pidfd_open(rec.pid)
                .ok()
                .map(Arc::new)
                .filter(|_| rec.alive());
            let Some(pidfd) = pidfd else {
                tracing::info!(vm = %name, pid = rec.pid, "its VMM is gone: not registered again");
                self.detached.forget(&name);
                continue;
            };
            let registry = self.registry.clone();
            let mut reg = lock(&registry);
            // A device region reserved for it died with the previous
            // daemon: it gets a new one, which its device process gets by
            // asking again (`pvsched device --daemon-region`).
            if rec.request.region == Region::Reserved && !reg.is_reserved(&name) {
                let _ = reg.reserve(&name);
            }
            // Only root registers detached: uid 0, as it was asked.
            let watched = pidfd.clone();
            let registered = reg.register(rec.request.clone(), rec.pid, 0, pidfd, None);
            let result = registered.and_then(|(_, _, name)| {
                self.watch(&watched, &name)
                    .map_err(|e| Reply::error(ErrorKind::Internal, format!("epoll_ctl: {e}")))
            });
            match result {
                Ok(()) => {
                    reg.count_registration();
                    tracing::info!(vm = %name, pid = rec.pid, "detached VM registered again after a restart");
                }
                Err(r) => {
                    tracing::warn!(vm = %name, pid = rec.pid, "registering the detached VM again failed: {r:?}");
                    self.unregister(&mut reg, &name, UnregisterReason::Failed);
                    self.detached.forget(&name);
                }
            }
        }
    }
}

/// Whose VMs a client may see: every VM (root: None) or its own uid's.
fn viewer(root: bool, uid: u32) -> Option<u32> {
    (!root).then_some(uid)
}

fn reply(fd: &OwnedFd, r: &Reply, pass: Option<&OwnedFd>) -> io::Result<()> {
    reply_bytes(fd, &serde_json::to_vec(r).unwrap_or_default(), pass)
}

fn reply_bytes(fd: &OwnedFd, bytes: &[u8], pass: Option<&OwnedFd>) -> io::Result<()> {
    wire::send(fd.as_fd(), bytes, pass.map(|p| p.as_fd()))
}

/// Raises RLIMIT_NOFILE to its hard limit (one fd per client and VM).
fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn socket_gid(group: &str) -> Result<Option<u32>, ServerError> {
    if group.is_empty() {
        return Ok(None);
    }
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(Some(g.gid.as_raw())),
        _ => Err(ServerError::Group(group.into())),
    }
}

fn set_socket_mode(path: &std::path::Path, gid: Option<u32>) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = if gid.is_some() { 0o660 } else { 0o600 };
    if let Some(g) = gid {
        std::os::unix::fs::chown(path, None, Some(g))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// The reply to a client's [`Request::Hello`]: this daemon's versions, or
/// a refusal of a client of another protocol, naming both releases.
fn hello(proto: u32, version: &str) -> Reply {
    if proto != crate::proto::PROTOCOL {
        return Reply::error(
            ErrorKind::Invalid,
            format!(
                "this client speaks pvschedd protocol {proto} (pvsched {}), pvschedd {} \
                 speaks {}: use the pvsched of the package pvschedd came with",
                if version.is_empty() { "?" } else { version },
                crate::proto::VERSION,
                crate::proto::PROTOCOL
            ),
        );
    }
    Reply::Hello {
        proto: crate::proto::PROTOCOL,
        version: crate::proto::VERSION.into(),
        abi: crate::proto::abi(),
    }
}

/// A state change for systemd (`Type=notify`); nothing without
/// `NOTIFY_SOCKET`. A failure to tell systemd is logged, never fatal.
pub fn notify(state: sd_notify::NotifyState) {
    if let Err(e) = sd_notify::notify(&[state]) {
        tracing::warn!("sd_notify to $NOTIFY_SOCKET failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_of_another_protocol_is_refused_naming_both_releases() {
        match hello(crate::proto::PROTOCOL + 1, "9.9.9") {
            Reply::Error { kind, message } => {
                assert_eq!(kind, ErrorKind::Invalid);
                assert!(message.contains("pvsched 9.9.9"), "{message}");
                assert!(message.contains(crate::proto::VERSION), "{message}");
            }
            r => panic!("{r:?}"),
        }
        match hello(crate::proto::PROTOCOL, "") {
            Reply::Hello {
                proto,
                version,
                abi,
            } => {
                assert_eq!(proto, crate::proto::PROTOCOL);
                assert_eq!(version, crate::proto::VERSION);
                assert_eq!(abi, crate::proto::abi());
            }
            r => panic!("{r:?}"),
        }
    }
}
