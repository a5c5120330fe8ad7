//! Raw vfio-user messages (the wire format of QEMU's
//! `docs/interop/vfio-user.rst`), for tests that must send what a
//! well-behaved client never would: wrong sizes, unknown commands, stray
//! fds. Only the framing is here; each test builds its own bodies.

#![allow(dead_code)]

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use std::io::{IoSlice, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

pub const HEADER: usize = 16;
pub const VERSION: u16 = 1;
pub const DMA_MAP: u16 = 2;
pub const DMA_UNMAP: u16 = 3;
pub const DEVICE_GET_INFO: u16 = 4;
pub const DEVICE_GET_REGION_INFO: u16 = 5;
pub const DEVICE_GET_IRQ_INFO: u16 = 7;
pub const DEVICE_SET_IRQS: u16 = 8;
pub const REGION_READ: u16 = 9;
pub const REGION_WRITE: u16 = 10;
pub const DEVICE_RESET: u16 = 13;
/// Header flag: the message is a reply.
pub const F_REPLY: u32 = 1;
/// Header flag: the reply reports an error (errno in the `error` field).
pub const F_ERROR: u32 = 1 << 5;

/// A message: header with `size` = 16 + body length, then `body`.
pub fn message(id: u16, command: u16, body: &[u8]) -> Vec<u8> {
    message_sized(id, command, (HEADER + body.len()) as u32, body)
}

/// A message whose header claims `size` bytes whatever `body` holds.
pub fn message_sized(id: u16, command: u16, size: u32, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + body.len());
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&command.to_le_bytes());
    v.extend_from_slice(&size.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// Body of REGION_READ / REGION_WRITE (`data` empty for a read).
pub fn region_access(region: u32, offset: u64, count: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&region.to_le_bytes());
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(data);
    v
}

/// Body of DMA_MAP.
pub fn dma_map(flags: u32, offset: u64, address: u64, size: u64) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&32u32.to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&address.to_le_bytes());
    v.extend_from_slice(&size.to_le_bytes());
    v
}

/// Body of a VERSION message: major 0, minor 0 and `json` NUL-terminated.
pub fn version(json: &str) -> Vec<u8> {
    let mut v = vec![0, 0, 0, 0];
    v.extend_from_slice(json.as_bytes());
    v.push(0);
    v
}

/// Send `bytes` with `fds` attached (SCM_RIGHTS).
pub fn send(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    let iov = [IoSlice::new(bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    let n = sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).expect("sendmsg");
    assert_eq!(n, bytes.len(), "short send");
}

/// One reply: (message id, command, flags, error, body).
#[derive(Debug)]
pub struct Reply {
    pub id: u16,
    pub command: u16,
    pub flags: u32,
    pub error: u32,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn is_error(&self) -> bool {
        self.flags & F_ERROR != 0
    }
}

/// Read one reply, or `None` when the server closed the connection.
pub fn recv(s: &mut UnixStream) -> Option<Reply> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h).ok()?;
    let size = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
    assert!(
        (HEADER..=HEADER + (1 << 20)).contains(&size),
        "reply size {size}"
    );
    let mut body = vec![0u8; size - HEADER];
    s.read_exact(&mut body).ok()?;
    Some(Reply {
        id: u16::from_le_bytes([h[0], h[1]]),
        command: u16::from_le_bytes([h[2], h[3]]),
        flags: u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")),
        error: u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")),
        body,
    })
}

/// REGION_READ of 4 bytes at `offset` of `region`; the value read.
pub fn read_u32(s: &mut UnixStream, id: u16, region: u32, offset: u64) -> u32 {
    send(
        s,
        &message(id, REGION_READ, &region_access(region, offset, 4, &[])),
        &[],
    );
    let r = recv(s).expect("REGION_READ reply");
    assert_eq!(r.id, id, "reply to message {id}");
    assert!(
        !r.is_error(),
        "REGION_READ {region}@{offset:#x} failed: {r:?}"
    );
    u32::from_le_bytes(r.body[16..20].try_into().expect("4 bytes"))
}

/// REGION_WRITE of `v` at `offset` of `region`, reply checked.
pub fn write_u32(s: &mut UnixStream, id: u16, region: u32, offset: u64, v: u32) {
    send(
        s,
        &message(
            id,
            REGION_WRITE,
            &region_access(region, offset, 4, &v.to_le_bytes()),
        ),
        &[],
    );
    let r = recv(s).expect("REGION_WRITE reply");
    assert_eq!(r.id, id, "reply to message {id}");
    assert!(
        !r.is_error(),
        "REGION_WRITE {region}@{offset:#x} failed: {r:?}"
    );
}
