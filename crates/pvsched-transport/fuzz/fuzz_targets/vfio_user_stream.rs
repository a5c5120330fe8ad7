//! Fuzz target: the vfio-user stream, served by the real server
//! (`VfioUserServer::serve_connection` over a real `PvschedDevice`, on one
//! end of a socketpair). The first byte chooses the framing: bit 0 attaches
//! a sealed memfd (guest RAM) to the first write, bit 1 sends a valid
//! VERSION handshake first, bits 2..8 split the rest into writes of
//! 1..=64 bytes (0: one write). Whatever the bytes, the server must answer
//! or close and return when the client goes, without panicking (a panic in
//! the vendored `vfio_user` crate is caught and reported as
//! `ServerPanicked`, which fails here) and without any allocation larger
//! than libFuzzer's `-malloc_limit_mb`.
//!
//! Run with `cargo +nightly fuzz run vfio_user_stream` from
//! `crates/pvsched-transport` (see ../README.md).

#![no_main]

use libfuzzer_sys::fuzz_target;
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
use pvsched_transport::monitor::TransportMonitor;
use pvsched_transport::vfio_user::{VfioUserDevice, VfioUserError, VfioUserServer};
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const VERSION: &[u8] = br#"{"capabilities":{"max_msg_fds":1,"max_data_xfer_size":1048576}}"#;

fn version_message() -> Vec<u8> {
    let body_len = 4 + VERSION.len() + 1;
    let mut v = Vec::new();
    v.extend_from_slice(&1u16.to_le_bytes()); // id
    v.extend_from_slice(&1u16.to_le_bytes()); // VERSION
    v.extend_from_slice(&((16 + body_len) as u32).to_le_bytes());
    v.extend_from_slice(&[0; 8]); // flags, error
    v.extend_from_slice(&[0; 4]); // major 0, minor 0
    v.extend_from_slice(VERSION);
    v.push(0);
    v
}

fn sealed_memfd() -> std::fs::File {
    // SAFETY: memfd_create with a NUL-terminated name and valid flags.
    let fd = unsafe {
        libc::memfd_create(
            c"fuzz-ram".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(fd >= 0);
    // SAFETY: `fd` was just created and is owned by nobody else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(1 << 20).expect("size");
    // SAFETY: fcntl(F_ADD_SEALS) on an fd `f` owns; no pointers.
    let rc = unsafe {
        libc::fcntl(
            f.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    assert_eq!(rc, 0);
    f
}

fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: &std::fs::File) -> std::io::Result<usize> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let raw = [fd.as_raw_fd()];
    sendmsg::<()>(
        s.as_raw_fd(),
        &[IoSlice::new(bytes)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .map_err(std::io::Error::from)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    static N: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "pvsched-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let dev = PvschedDevice::new(DeviceConfig::new(2), Arc::new(NullSink)).expect("device");
    let backend = VfioUserDevice::new(dev, Arc::new(TransportMonitor::new())).expect("backend");
    let mut server = VfioUserServer::bind(&path, backend).expect("bind");
    let (mut client, theirs) = UnixStream::pair().expect("socketpair");
    let handle = std::thread::spawn(move || server.serve_connection(theirs));
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut stream = Vec::new();
    if mode & 2 != 0 {
        stream.extend_from_slice(&version_message());
    }
    stream.extend_from_slice(rest);
    let chunk = match usize::from(mode >> 2) {
        0 => stream.len().max(1),
        n => n,
    };
    // The reader drains replies so the server never blocks on a full socket.
    let mut reader = client.try_clone().expect("clone");
    let drain = std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
    });
    let ram = (mode & 1 != 0).then(sealed_memfd);
    for (i, part) in stream.chunks(chunk).enumerate() {
        let sent = match (&ram, i) {
            (Some(f), 0) => send_with_fd(&client, part, f).map(|_| ()),
            _ => client.write_all(part),
        };
        if sent.is_err() {
            break; // the server closed the connection
        }
    }
    let _ = client.shutdown(std::net::Shutdown::Write);
    let result = handle.join().expect("server thread panicked");
    assert!(
        !matches!(result, Err(VfioUserError::ServerPanicked(_))),
        "{result:?}"
    );
    drop(client);
    drain.join().expect("drain thread");
    let _ = std::fs::remove_file(&path);
});
