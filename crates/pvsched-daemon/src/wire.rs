//! `SOCK_SEQPACKET` UNIX sockets: one message per request or reply, with
//! message boundaries kept by the kernel, fds passed with `SCM_RIGHTS`, and
//! the peer known by `SO_PEERCRED` and `SO_PEERPIDFD`.

use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, accept4, bind, connect, getsockopt, listen, recvmsg, sendmsg, socket, sockopt,
};
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

/// A new listening socket at `path` (non-blocking, close-on-exec). A stale
/// socket file is replaced; a live one (another daemon) is an error.
pub fn listen_at(path: &Path) -> io::Result<OwnedFd> {
    if path.exists() {
        match connect_to(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by a running pvschedd", path.display()),
                ));
            }
            Err(_) => std::fs::remove_file(path)?,
        }
    }
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    bind(fd.as_raw_fd(), &addr)?;
    listen(&fd, Backlog::new(1024)?)?;
    Ok(fd)
}

/// Accepts one client (non-blocking, close-on-exec); `None` if none waits.
pub fn accept(listener: &OwnedFd) -> io::Result<Option<OwnedFd>> {
    match accept4(
        listener.as_raw_fd(),
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
    ) {
        // SAFETY: accept4 returned a new fd that nothing else owns.
        Ok(fd) => Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) })),
        Err(nix::Error::EAGAIN) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A blocking connection to the daemon at `path`.
pub fn connect_to(path: &Path) -> io::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    connect(fd.as_raw_fd(), &addr)?;
    Ok(fd)
}

/// Sends one message, with `pass` as `SCM_RIGHTS` if given.
pub fn send(fd: BorrowedFd<'_>, bytes: &[u8], pass: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let iov = [IoSlice::new(bytes)];
    let raw: [RawFd; 1] = [pass.map(|p| p.as_raw_fd()).unwrap_or(-1)];
    let cmsgs: &[ControlMessage<'_>] = if pass.is_some() {
        &[ControlMessage::ScmRights(&raw)]
    } else {
        &[]
    };
    let n = sendmsg::<()>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if n != bytes.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("sent {n} of {} bytes", bytes.len()),
        ));
    }
    Ok(())
}

/// One received message.
pub struct Received {
    /// Its length (0: the peer closed the connection).
    pub len: usize,
    /// It was longer than the buffer (the rest is lost).
    pub truncated: bool,
    /// Fds that came with it.
    pub fds: Vec<OwnedFd>,
}

/// Receives one message into `buf` (`EAGAIN` as an error on a
/// non-blocking socket with nothing to read).
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let msg = recvmsg::<()>(
        fd.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for r in raw {
                // SAFETY: the kernel installed these fds for us just now;
                // nothing else owns them.
                fds.push(unsafe { OwnedFd::from_raw_fd(r) });
            }
        }
    }
    Ok(Received {
        len: msg.bytes,
        truncated: msg.flags.contains(MsgFlags::MSG_TRUNC)
            || msg.flags.contains(MsgFlags::MSG_CTRUNC),
        fds,
    })
}

/// The peer's (pid, uid, gid) as of `connect`.
pub fn peer_cred(fd: &OwnedFd) -> io::Result<(u32, u32, u32)> {
    let c = getsockopt(fd, sockopt::PeerCredentials)?;
    Ok((c.pid() as u32, c.uid(), c.gid()))
}

/// `SO_PEERPIDFD` (Linux ≥ 6.5; include/uapi/asm-generic/socket.h).
const SO_PEERPIDFD: libc::c_int = 77;

/// A pidfd of the process that connected (`SO_PEERPIDFD`), so a reused pid
/// can never be mistaken for it; `None` on kernels without it.
pub fn peer_pidfd(fd: &OwnedFd) -> Option<OwnedFd> {
    let mut pidfd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into the c_int we pass
    // and updates len; fd is a valid socket.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 || pidfd < 0 {
        return None;
    }
    // SAFETY: the kernel created this pidfd for us; we own it.
    Some(unsafe { OwnedFd::from_raw_fd(pidfd) })
}

/// Whether the process behind `pidfd` has exited (its pidfd is readable).
pub fn exited(pidfd: &OwnedFd) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut p = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    matches!(poll(&mut p, PollTimeout::ZERO), Ok(n) if n > 0)
}

/// Raises the socket's send buffer so one status reply fits in a message
/// (best effort; the kernel caps it at `net.core.wmem_max`).
pub fn grow_send_buffer(fd: &OwnedFd, bytes: usize) {
    let _ = nix::sys::socket::setsockopt(fd, sockopt::SndBuf, &bytes);
}
