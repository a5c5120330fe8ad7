//! The metrics endpoint's HTTP side: `GET /metrics` (HTTP/1.0, one
//! request per connection) on `metrics_listen`, answered with
//! [`crate::metrics::render`] of a snapshot, on one thread of its own.
//!
//! Anyone on the host can reach the port, so nobody may keep it from
//! scrapers or from pvschedd:
//! - **A port taken first** (another process bound it): pvschedd runs on
//!   and the thread binds again with back-off ([`BIND_RETRY_MAX`]); the
//!   endpoint's state (`listening` or why not) is in `pvsched status`
//!   ([`EndpointState`]) and the log.
//! - **Idle or trickling connections**: every connection is non-blocking
//!   in one poll loop and must send its whole request head within
//!   [`REQUEST_DEADLINE`] of its accept; a local peer holds at most
//!   [`PER_PEER`] connections at once, counted by the uid that owns its
//!   socket ([`crate::sockdiag`]), a remote one by its address; at most
//!   [`MAX_CONNS`] in all. A uid that floods the port fills its own
//!   slots only: Prometheus (its own uid) is still answered.
//! - **The token** is compared in constant time.
//!
//! Written by hand rather than on an HTTP crate: the endpoint answers one
//! GET, and what matters here (per-uid slots, deadlines that hold against
//! trickling clients) is what a general server does not give; the
//! sockets are std's, the poll is nix's.

use crate::metrics::{VmLabel, render};
use crate::proto::{DaemonStatus, VmStatus};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// A peer's whole request head must arrive within this of its accept
/// (not per byte: a client trickling a byte at a time cannot hold a slot
/// longer), and its answer must be taken within this after.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// Connections one peer (a local uid, or a remote address) may hold.
pub const PER_PEER: usize = 4;
/// Connections at most, all peers together.
pub const MAX_CONNS: usize = 128;
/// Longest wait between two tries to bind a port that is taken.
pub const BIND_RETRY_MAX: Duration = Duration::from_secs(5);
/// Largest request head read (8 KiB, as common servers allow).
const MAX_HEAD: usize = 8192;

/// What `pvsched status` says of the endpoint: "off", "listening on
/// ADDR", or why it is not listening; shared with the registry.
#[derive(Clone, Debug, Default)]
pub struct EndpointState(Arc<Mutex<String>>);

impl EndpointState {
    /// The state now.
    pub fn get(&self) -> String {
        pvsched_util::lock(&self.0).clone()
    }

    fn set(&self, s: String) {
        *pvsched_util::lock(&self.0) = s;
    }
}

/// A snapshot of the daemon's figures and every VM's status.
pub type Snapshot = dyn Fn() -> (DaemonStatus, Vec<VmStatus>) + Send + Sync;

/// The bearer token scrapers must present (`metrics_token_file`), shared
/// with the endpoint's thread so that a reload (SIGHUP) changes it for the
/// next scrape. None: no token, VMs labelled by id.
#[derive(Clone, Debug, Default)]
pub struct MetricsToken(Arc<RwLock<Option<String>>>);

impl MetricsToken {
    /// A token cell holding `token`.
    pub fn new(token: Option<String>) -> MetricsToken {
        MetricsToken(Arc::new(RwLock::new(token)))
    }

    /// The token now.
    pub fn get(&self) -> Option<String> {
        pvsched_util::read(&self.0).clone()
    }

    /// Replaces it.
    pub fn set(&self, token: Option<String>) {
        *pvsched_util::write(&self.0) = token;
    }
}

/// Starts the endpoint's thread: binds `addr` (again and again while it
/// is taken), then serves scrapes of `snapshot` for the daemon's life.
/// With `token` (`metrics_token_file`) a request must carry
/// `Authorization: Bearer <token>` and gets VM names; without, VMs are
/// labelled by id.
pub fn spawn(
    addr: String,
    snapshot: Box<Snapshot>,
    token: MetricsToken,
    state: EndpointState,
) -> io::Result<()> {
    state.set(format!("binding {addr}"));
    std::thread::Builder::new()
        .name("pvschedd-metrics".into())
        .spawn(move || run(&addr, &*snapshot, &token, &state))
        .map(drop)
}

fn run(addr: &str, snapshot: &Snapshot, token: &MetricsToken, state: &EndpointState) {
    let mut wait = Duration::from_millis(250);
    let mut logged: Option<io::ErrorKind> = None;
    loop {
        match TcpListener::bind(addr).and_then(|l| l.set_nonblocking(true).map(|()| l)) {
            Ok(l) => {
                tracing::info!("metrics on http://{addr}/metrics");
                state.set(format!("listening on {addr}"));
                wait = Duration::from_millis(250);
                logged = None;
                if let Err(e) = serve(&l, snapshot, token) {
                    tracing::warn!("metrics_listen {addr}: {e}; binding again");
                    state.set(format!("{addr}: {e}; binding again"));
                }
            }
            Err(e) => {
                // Said once per cause, not at every try.
                if logged != Some(e.kind()) {
                    tracing::warn!(
                        "metrics_listen {addr}: {e}; pvschedd runs on without metrics and \
                         binds again every {}s at most (free the port, or set another)",
                        BIND_RETRY_MAX.as_secs()
                    );
                    logged = Some(e.kind());
                }
                state.set(format!("{addr}: {e} (binding again)"));
                std::thread::sleep(wait);
                wait = (wait * 2).min(BIND_RETRY_MAX);
            }
        }
    }
}

/// Who a connection is counted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Peer {
    Uid(u32),
    Addr(IpAddr),
}

/// An open connection.
struct Conn {
    stream: TcpStream,
    peer: Peer,
    deadline: Instant,
    head: Vec<u8>,
    /// The answer and how much of it is written (None: still reading).
    out: Option<(Vec<u8>, usize)>,
}

/// Serves until the listener fails.
fn serve(l: &TcpListener, snapshot: &Snapshot, token: &MetricsToken) -> io::Result<()> {
    let mut conns: Vec<Conn> = Vec::new();
    loop {
        let now = Instant::now();
        conns.retain(|c| c.deadline > now);
        let next = conns
            .iter()
            .map(|c| c.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::from_secs(60));
        let mut fds = Vec::with_capacity(conns.len() + 1);
        fds.push(PollFd::new(l.as_fd(), PollFlags::POLLIN));
        for c in &conns {
            let ev = if c.out.is_some() {
                PollFlags::POLLOUT
            } else {
                PollFlags::POLLIN
            };
            fds.push(PollFd::new(c.stream.as_fd(), ev));
        }
        let timeout =
            PollTimeout::try_from(next.max(Duration::from_millis(1))).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, timeout) {
            Ok(_) => {}
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
        let ready: Vec<bool> = fds
            .iter()
            .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        drop(fds);
        // Connections first, the new ones after: a request that is already
        // here is answered before anything else can take its turn.
        let mut done = vec![false; conns.len()];
        for (i, c) in conns.iter_mut().enumerate() {
            if ready[i + 1] {
                done[i] = step(c, snapshot, token);
            }
        }
        let mut i = 0;
        conns.retain(|_| {
            i += 1;
            !done[i - 1]
        });
        if ready[0] {
            accept_all(l, &mut conns)?;
        }
    }
}

/// Takes every pending connection that the limits let in.
fn accept_all(l: &TcpListener, conns: &mut Vec<Conn>) -> io::Result<()> {
    loop {
        let (stream, from) = match l.accept() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // Out of fds, or the peer gave up before the accept: the rest
            // wait in the backlog.
            Err(e) => {
                tracing::debug!("metrics: accept failed: {e}");
                return Ok(());
            }
        };
        // This connection's own local address: a listener on 0.0.0.0 or
        // [::] has none of its own.
        let peer = stream
            .local_addr()
            .ok()
            .and_then(|ours| crate::sockdiag::local_peer_uid(from, ours))
            .map(Peer::Uid)
            .unwrap_or(Peer::Addr(from.ip()));
        let held = conns.iter().filter(|c| c.peer == peer).count();
        if held >= PER_PEER || conns.len() >= MAX_CONNS {
            tracing::debug!(?peer, held, "metrics: connection over the limits closed");
            continue;
        }
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        conns.push(Conn {
            stream,
            peer,
            deadline: Instant::now() + REQUEST_DEADLINE,
            head: Vec::new(),
            out: None,
        });
    }
}

/// Reads or writes what connection `c` is ready for; true when it is
/// done with (answered, closed by its peer, or failed).
fn step(c: &mut Conn, snapshot: &Snapshot, token: &MetricsToken) -> bool {
    if let Some((bytes, at)) = &mut c.out {
        return match c.stream.write(&bytes[*at..]) {
            Ok(n) => {
                *at += n;
                *at >= bytes.len()
            }
            Err(e) => e.kind() != io::ErrorKind::WouldBlock,
        };
    }
    let mut buf = [0u8; 2048];
    loop {
        match c.stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => c.head.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(_) => return true,
        }
        if c.head.len() > MAX_HEAD {
            break;
        }
    }
    let complete = c.head.windows(4).any(|w| w == b"\r\n\r\n")
        || c.head.windows(2).any(|w| w == b"\n\n")
        || c.head.len() > MAX_HEAD;
    if complete {
        c.out = Some((answer(&c.head, snapshot, token), 0));
        c.deadline = Instant::now() + REQUEST_DEADLINE;
        return step(c, snapshot, token);
    }
    false
}

/// The whole HTTP answer to request head `head`.
fn answer(head: &[u8], snapshot: &Snapshot, token: &MetricsToken) -> Vec<u8> {
    let token = token.get();
    let token = token.as_deref();
    let text = String::from_utf8_lossy(head);
    let mut lines = text.lines();
    let line = lines.next().unwrap_or_default();
    let authorized = token.is_some_and(|t| {
        lines.any(|h| {
            h.split_once(':').is_some_and(|(k, v)| {
                k.trim().eq_ignore_ascii_case("authorization")
                    && v.trim()
                        .strip_prefix("Bearer ")
                        .is_some_and(|got| same_secret(got.trim().as_bytes(), t.as_bytes()))
            })
        })
    });
    let (status, body) = if !(line.starts_with("GET /metrics ") || line.starts_with("GET / ")) {
        ("404 Not Found", "try GET /metrics\n".to_string())
    } else if token.is_some() && !authorized {
        (
            "401 Unauthorized",
            "send Authorization: Bearer <the token in metrics_token_file>\n".to_string(),
        )
    } else {
        let label = if token.is_some() {
            VmLabel::Name
        } else {
            VmLabel::Id
        };
        let (daemon, vms) = snapshot();
        ("200 OK", render(daemon, vms, label))
    };
    format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Whether `got` is the secret `want`, in a time that does not depend on
/// where they differ (only on their lengths).
fn same_secret(got: &[u8], want: &[u8]) -> bool {
    if got.len() != want.len() {
        return false;
    }
    let diff = got.iter().zip(want).fold(0u8, |d, (a, b)| d | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// Connections per peer now (for the tests of this module).
#[cfg(test)]
fn per_peer(conns: &[Conn]) -> std::collections::HashMap<Peer, usize> {
    let mut m = std::collections::HashMap::new();
    for c in conns {
        *m.entry(c.peer).or_insert(0) += 1;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> (DaemonStatus, Vec<VmStatus>) {
        (DaemonStatus::default(), Vec::new())
    }

    #[test]
    fn the_secret_is_compared_whole() {
        assert!(same_secret(b"s3cret", b"s3cret"));
        assert!(!same_secret(b"s3cres", b"s3cret"));
        assert!(!same_secret(b"s3cre", b"s3cret"));
        assert!(!same_secret(b"", b"s3cret"));
    }

    #[test]
    fn answers_say_what_to_do() {
        let none = MetricsToken::default();
        let ok = answer(b"GET /metrics HTTP/1.0\r\n\r\n", &snapshot, &none);
        assert!(ok.starts_with(b"HTTP/1.0 200 OK"));
        let t = MetricsToken::new(Some("t".into()));
        let no = answer(b"GET /metrics HTTP/1.0\r\n\r\n", &snapshot, &t);
        assert!(no.starts_with(b"HTTP/1.0 401"));
        let with_t = b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer t\r\n\r\n";
        let yes = answer(with_t, &snapshot, &t);
        assert!(yes.starts_with(b"HTTP/1.0 200 OK"));
        // A reload's new token holds from the next scrape on.
        t.set(Some("u".into()));
        assert!(answer(with_t, &snapshot, &t).starts_with(b"HTTP/1.0 401"));
        let other = answer(b"GET /x HTTP/1.0\r\n\r\n", &snapshot, &none);
        assert!(other.starts_with(b"HTTP/1.0 404"));
    }

    /// One local uid gets [`PER_PEER`] connections and more are closed
    /// at once, counted by its uid also through a listener on 0.0.0.0
    /// (whose own address names no connection's local end).
    #[test]
    fn a_local_uid_holds_at_most_its_slots() {
        let l = TcpListener::bind("0.0.0.0:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let port = l.local_addr().unwrap().port();
        let held: Vec<TcpStream> = (0..PER_PEER + 3)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        let mut conns = Vec::new();
        // The connections reach the backlog at once on loopback.
        accept_all(&l, &mut conns).unwrap();
        let counts = per_peer(&conns);
        let me = Peer::Uid(nix::unistd::getuid().as_raw());
        assert_eq!(counts.get(&me), Some(&PER_PEER), "{counts:?}");
        drop(held);
    }
}
