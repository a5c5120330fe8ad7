//! The vfio-user stream, property-tested against the real server
//! (`VfioUserServer` over a real `PvschedDevice`, one end of a socketpair):
//! random sequences of well-framed messages — every command with random
//! fields, unknown commands, reply-flagged messages, bytes of the body or
//! header flipped, DMA_MAP with a sealed memfd, an unsealed one or none, and
//! stray fds on any message — then a random tail of raw bytes.
//!
//! For every sequence: each framed message gets at most one reply, with its
//! id, a success or an error carrying an errno, and the stream stays in sync
//! (a DEVICE_GET_INFO ping after each message is answered); after the raw
//! tail and the client's shutdown the server returns without panicking; no
//! single allocation of the process is larger than [`ALLOC_CAP`] (a counting
//! global allocator), and every fd the client passed has been closed.
//!
//! Cases: `PVSCHED_STREAM_CASES` (default 256; CI's `PROPTEST_CASES` does not
//! apply, each case serves a connection). The cargo-fuzz target
//! `crates/pvsched-transport/fuzz` (`vfio_user_stream`) drives the same
//! server with unstructured bytes.
//!
//! A test binary of its own: the allocation and fd checks are process-wide,
//! so no other test may run beside these.

#[path = "integration/support/vfio_raw.rs"]
mod vfio_raw;

use proptest::prelude::*;
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
use pvsched_transport::monitor::TransportMonitor;
use pvsched_transport::vfio_user::{VfioUserDevice, VfioUserError, VfioUserServer};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use vfio_raw::*;

/// Largest single allocation allowed while a connection is served: a
/// message body is at most `max_data_xfer_size` (4096) plus a command's
/// fixed part; a client-chosen count of up to 4 GiB must never reach the
/// allocator.
const ALLOC_CAP: usize = 256 << 10;

/// Counts the largest single allocation since the last reset.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to the system allocator with the caller's
// own layout and pointer; the counter has no effect on the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded; `ptr`/`layout` are the caller's own.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bound on every wait for the server (liveness, not timing).
const WAIT: Duration = Duration::from_secs(20);
/// The ping's message ids (never generated for other messages).
const PING_BASE: u16 = 0xf000;

/// Which fd travels with a message.
#[derive(Clone, Copy, Debug)]
enum FdKind {
    None,
    /// A memfd sealed against shrinking (as QEMU's memory-backend-memfd).
    Sealed,
    /// A memfd without seals.
    Unsealed,
}

/// One well-framed message.
#[derive(Clone, Debug)]
struct Msg {
    command: u16,
    flags: u32,
    body: Vec<u8>,
    fd: FdKind,
}

const RAM: u64 = 1 << 20;

fn version_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(version(
            r#"{"capabilities":{"max_msg_fds":1,"max_data_xfer_size":1048576}}"#
        )),
        Just(version("{}")),
        Just(version(
            r#"{"capabilities":{"max_data_xfer_size":4294967295}}"#
        )),
        Just(version("not json")),
        proptest::collection::vec(any::<u8>(), 0..64),
    ]
}

fn region_index() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..10, any::<u32>()]
}

fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..0x4100, any::<u64>(), Just(u64::MAX - 3)]
}

fn count() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(1u32),
        Just(2),
        Just(4),
        Just(8),
        0u32..8200,
        Just(u32::MAX)
    ]
}

fn body_u32s(words: Vec<u32>) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// A command with random (often wrong) fields.
fn command() -> impl Strategy<Value = Msg> {
    let plain = |command: u16, body: Vec<u8>| Msg {
        command,
        flags: 0,
        body,
        fd: FdKind::None,
    };
    prop_oneof![
        version_body().prop_map(move |b| plain(VERSION, b)),
        Just(plain(DEVICE_GET_INFO, body_u32s(vec![32, 0, 0, 0]))),
        (any::<u32>(), region_index()).prop_map(move |(argsz, i)| plain(
            DEVICE_GET_REGION_INFO,
            body_u32s(vec![argsz, 0, i, 0, 0, 0, 0, 0])
        )),
        region_index().prop_map(move |i| plain(DEVICE_GET_IRQ_INFO, body_u32s(vec![16, 0, i, 0]))),
        (region_index(), offset(), count())
            .prop_map(move |(r, o, c)| plain(REGION_READ, region_access(r, o, c, &[]))),
        (region_index(), offset(), count(), 0usize..64).prop_map(move |(r, o, c, n)| plain(
            REGION_WRITE,
            region_access(r, o, c, &vec![0x5a; n])
        )),
        (
            prop_oneof![
                Just(FdKind::None),
                Just(FdKind::Sealed),
                Just(FdKind::Unsealed)
            ],
            prop_oneof![Just(0u64), 0u64..RAM, any::<u64>()],
            prop_oneof![Just(0u64), Just(0xc0000u64), any::<u64>()],
            prop_oneof![Just(0x1000u64), Just(RAM), 0u64..(2 * RAM), any::<u64>()],
            prop_oneof![Just(3u32), any::<u32>()],
        )
            .prop_map(move |(fd, off, addr, size, flags)| Msg {
                command: DMA_MAP,
                flags: 0,
                body: dma_map(flags, off, addr, size),
                fd,
            }),
        (
            any::<u64>(),
            any::<u64>(),
            prop_oneof![Just(0u32), any::<u32>()]
        )
            .prop_map(move |(addr, size, flags)| {
                let mut b = body_u32s(vec![32, flags]);
                b.extend_from_slice(&addr.to_le_bytes());
                b.extend_from_slice(&size.to_le_bytes());
                plain(DMA_UNMAP, b)
            }),
        Just(plain(DEVICE_RESET, vec![])),
        Just(plain(DEVICE_SET_IRQS, body_u32s(vec![20, 0, 0, 0, 0]))),
        (any::<u16>(), proptest::collection::vec(any::<u8>(), 0..48))
            .prop_map(move |(c, b)| plain(c, b)),
    ]
}

/// A command, sometimes reply-flagged, with its bytes flipped, or with a
/// stray fd.
fn message_strategy() -> impl Strategy<Value = Msg> {
    (
        command(),
        prop_oneof![Just(0u32), Just(F_REPLY), Just(F_ERROR), any::<u32>()],
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        prop_oneof![
            4 => Just(None),
            1 => Just(Some(FdKind::Sealed)),
            1 => Just(Some(FdKind::Unsealed)),
        ],
    )
        .prop_map(|(mut m, flags, flips, stray)| {
            m.flags = flags;
            for (at, x) in flips {
                if !m.body.is_empty() {
                    let i = at % m.body.len();
                    m.body[i] ^= x;
                }
            }
            if let (FdKind::None, Some(k)) = (m.fd, stray) {
                m.fd = k;
            }
            m
        })
}

fn memfd(sealed: bool) -> std::fs::File {
    if sealed {
        return pvsched_testkit::sealed_memfd(c"prop-ram", RAM);
    }
    // SAFETY: memfd_create with a NUL-terminated name and valid flags.
    let fd = unsafe { libc::memfd_create(c"prop-unsealed".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(RAM).expect("size the memfd");
    f
}

/// Whether `fd` is open in this process.
fn is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD on any number only reads the fd table.
    unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
}

/// Serves one connection on a thread; returns the client end and the join
/// handle of the server's result.
fn serve() -> (
    UnixStream,
    std::thread::JoinHandle<Result<(), VfioUserError>>,
    std::path::PathBuf,
) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "pvsched-stream-prop-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let dev = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).expect("device");
    let backend = VfioUserDevice::new(dev, Arc::new(TransportMonitor::new())).expect("backend");
    let mut server = VfioUserServer::bind(&dir.join("sock"), backend).expect("bind");
    let (client, theirs) = UnixStream::pair().expect("socketpair");
    let handle = std::thread::spawn(move || server.serve_connection(theirs));
    client.set_read_timeout(Some(WAIT)).expect("timeout");
    (client, handle, dir)
}

/// Sends `m` then a ping; returns the replies that came before the ping's
/// (None: the server closed the connection).
fn exchange(c: &mut UnixStream, id: u16, ping: u16, m: &Msg) -> Option<Vec<Reply>> {
    let fd = match m.fd {
        FdKind::None => None,
        FdKind::Sealed => Some(memfd(true)),
        FdKind::Unsealed => Some(memfd(false)),
    };
    let mut bytes = message(id, m.command, &m.body);
    bytes[8..12].copy_from_slice(&m.flags.to_le_bytes());
    let fds: Vec<RawFd> = fd.iter().map(|f| f.as_raw_fd()).collect();
    send(c, &bytes, &fds);
    drop(fd);
    send(
        c,
        &message(
            ping,
            DEVICE_GET_INFO,
            &[32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ),
        &[],
    );
    let mut before = Vec::new();
    loop {
        let r = recv(c)?;
        if r.id == ping {
            assert!(!r.is_error(), "ping after {m:?} failed: {r:?}");
            return Some(before);
        }
        before.push(r);
    }
}

/// One sequence at a time: the allocation and fd checks are process-wide.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn check_sequence(msgs: &[Msg], tail: &[u8]) {
    let _one = pvsched_util::lock(&SERIAL);
    let fds_before = (3..256).filter(|&fd| is_open(fd)).count();
    let (mut c, handle, dir) = serve();
    LARGEST.store(0, Ordering::SeqCst);
    for (i, m) in msgs.iter().enumerate() {
        let id = i as u16;
        let ping = PING_BASE + i as u16;
        let replies = exchange(&mut c, id, ping, m)
            .unwrap_or_else(|| panic!("server closed the stream after well-framed {m:?}"));
        assert!(
            replies.len() <= 1,
            "{} replies to {m:?}: {replies:?}",
            replies.len()
        );
        for r in &replies {
            assert_eq!(r.id, id, "reply out of sync after {m:?}: {r:?}");
            assert_eq!(r.command, m.command, "reply to another command: {r:?}");
            assert_ne!(r.flags & F_REPLY, 0, "not flagged a reply: {r:?}");
            if r.is_error() {
                assert_ne!(r.error, 0, "error reply without an errno to {m:?}");
            }
        }
        if m.flags & 0x10 == 0 {
            assert_eq!(replies.len(), 1, "no reply to {m:?}");
        }
    }
    // A raw tail, then the client goes: the server must return, not panic.
    let _ = c.write_all(tail);
    let _ = c.shutdown(std::net::Shutdown::Write);
    while recv(&mut c).is_some() {}
    let result = handle.join().expect("server thread panicked");
    assert!(
        !matches!(result, Err(VfioUserError::ServerPanicked(_))),
        "{result:?}"
    );
    let largest = LARGEST.load(Ordering::SeqCst);
    assert!(
        largest <= ALLOC_CAP,
        "an allocation of {largest} bytes while serving"
    );
    drop(c);
    let fds_after = (3..256).filter(|&fd| is_open(fd)).count();
    assert_eq!(fds_before, fds_after, "fds leaked by the server");
    let _ = std::fs::remove_dir_all(dir);
}

fn cases() -> u32 {
    std::env::var("PVSCHED_STREAM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Random message sequences keep the stream in sync and the server alive.
    #[test]
    fn random_streams_are_answered_in_sync(
        msgs in proptest::collection::vec(message_strategy(), 0..24),
        tail in proptest::collection::vec(any::<u8>(), 0..96),
    ) {
        check_sequence(&msgs, &tail);
    }
}

/// A handshake, then the worst counts and sizes: no reply is out of sync
/// and nothing the size of a client-chosen count is allocated.
#[test]
fn huge_counts_and_sizes_allocate_nothing_large() {
    let mut msgs = vec![Msg {
        command: VERSION,
        flags: 0,
        body: version(r#"{"capabilities":{"max_msg_fds":1}}"#),
        fd: FdKind::None,
    }];
    for region in [0u32, 2, 7, 9] {
        for count in [u32::MAX, 1 << 30, 4097] {
            msgs.push(Msg {
                command: REGION_READ,
                flags: 0,
                body: region_access(region, 0, count, &[]),
                fd: FdKind::None,
            });
            msgs.push(Msg {
                command: REGION_WRITE,
                flags: 0,
                body: region_access(region, 0, count, &[1, 2, 3, 4]),
                fd: FdKind::None,
            });
        }
    }
    msgs.push(Msg {
        command: DMA_MAP,
        flags: 0,
        body: dma_map(3, 0, 0, u64::MAX),
        fd: FdKind::Sealed,
    });
    check_sequence(&msgs, &[]);
}
