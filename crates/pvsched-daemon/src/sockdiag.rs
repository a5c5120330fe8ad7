//! Who is on the other end of a local TCP connection: the uid that owns
//! the peer's socket, asked of the kernel with one `NETLINK_SOCK_DIAG`
//! request (`SOCK_DIAG_BY_FAMILY`, an exact 4-tuple lookup, as `ss -e`
//! does) for the socket whose local end is the peer's address and whose
//! remote end is ours. Only a peer on this host has such a socket; a
//! remote peer (or a lookup the kernel refuses) gives `None`.
//!
//! The layouts are the kernel's uapi (`linux/inet_diag.h`,
//! `linux/netlink.h`), written out as bytes: no struct of ours crosses
//! the boundary.

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, sendto,
    setsockopt, socket, sockopt,
};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLM_F_REQUEST`.
const NLM_F_REQUEST: u16 = 1;
/// `NLMSG_ERROR`: the kernel found no such socket (or refused).
const NLMSG_ERROR: u16 = 2;
/// `struct nlmsghdr`.
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad (4), states (4),
/// `struct inet_diag_sockid` (48).
const REQ_LEN: usize = 56;
/// Offset of `idiag_uid` in `struct inet_diag_msg`: family, state, timer,
/// retrans (4), the sockid (48), expires, rqueue, wqueue (12).
const MSG_UID: usize = 64;

/// The uid owning the local socket connected from `peer` to `ours`.
pub fn local_peer_uid(peer: SocketAddr, ours: SocketAddr) -> Option<u32> {
    // A v4 client of a listener on [::] shows as ::ffff:a.b.c.d, but its
    // own socket is an AF_INET one.
    let v4 = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (family, src, dst) = match (v4(peer.ip()), v4(ours.ip())) {
        (IpAddr::V4(p), IpAddr::V4(o)) => {
            (libc::AF_INET as u8, pad16(&p.octets()), pad16(&o.octets()))
        }
        (IpAddr::V6(p), IpAddr::V6(o)) => (libc::AF_INET6 as u8, p.octets(), o.octets()),
        _ => return None,
    };
    let mut req = Vec::with_capacity(NLMSG_HDR + REQ_LEN);
    req.extend_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    req.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // every TCP state
    // The sockid: the peer's socket has the peer's address as its source.
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&ours.port().to_be_bytes());
    req.extend_from_slice(&src);
    req.extend_from_slice(&dst);
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // INET_DIAG_NOCOOKIE
    req.extend_from_slice(&u32::MAX.to_ne_bytes());

    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )
    .ok()?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).ok()?;
    // The kernel answers at once; never wait long for it.
    let tv = nix::sys::time::TimeVal::from(libc::timeval {
        tv_sec: 0,
        tv_usec: Duration::from_millis(100).as_micros() as libc::suseconds_t,
    });
    setsockopt(&fd, sockopt::ReceiveTimeout, &tv).ok()?;
    sendto(
        fd.as_raw_fd(),
        &req,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )
    .ok()?;
    let mut buf = [0u8; 8192];
    let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).ok()?;
    parse_uid(&buf[..n])
}

/// An IPv4 address in the sockid's 16 bytes (the rest zero).
fn pad16(v4: &[u8; 4]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(v4);
    a
}

/// The uid of the first answer in a netlink reply, if it is one.
fn parse_uid(reply: &[u8]) -> Option<u32> {
    let ty = u16::from_ne_bytes(reply.get(4..6)?.try_into().ok()?);
    if ty == NLMSG_ERROR || ty != SOCK_DIAG_BY_FAMILY {
        return None;
    }
    let at = NLMSG_HDR.checked_add(MSG_UID)?;
    Some(u32::from_ne_bytes(reply.get(at..at + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The uid of this process's own connection to a local listener is
    /// ours; a short or error reply gives none.
    #[test]
    fn a_local_peer_is_known_by_its_uid() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, peer) = l.accept().unwrap();
        assert_eq!(peer, c.local_addr().unwrap());
        let uid = local_peer_uid(peer, l.local_addr().unwrap());
        assert_eq!(uid, Some(nix::unistd::getuid().as_raw()));
        // The same through a listener on [::] (where the host has IPv6).
        if let Ok(l6) = std::net::TcpListener::bind("[::]:0") {
            let port = l6.local_addr().unwrap().port();
            let c6 = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            let (_s6, peer6) = l6.accept().unwrap();
            let ours6 = SocketAddr::new("::ffff:127.0.0.1".parse().unwrap(), port);
            assert!(matches!(peer6.ip(), IpAddr::V6(_)), "{peer6}");
            assert_eq!(local_peer_uid(peer6, ours6), uid, "{peer6} from {c6:?}");
        }
        // Nobody connects from this port.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(local_peer_uid(nobody, l.local_addr().unwrap()), None);
        assert_eq!(parse_uid(&[0u8; 8]), None);
        let mut err = [0u8; 100];
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert_eq!(parse_uid(&err), None);
    }
}
