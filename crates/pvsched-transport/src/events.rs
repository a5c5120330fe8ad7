//! The device process's side of the event channel (`--event-fd N`): what
//! the device's policy sink hears becomes typed
//! [`DeviceEvent`]s for the VMM that started it.
//!
//! The device process owns the device. A VMM that wants to drive a policy
//! sink (the reference VMM's `RemoteDevice`) gives it one end of a
//! `SOCK_SEQPACKET` socketpair at spawn. The device's [`EventSink`] queues
//! every sink call (attach, detach, kick) while the device handles an
//! access; the transport then calls [`EventChannel::flush`] **before** it
//! sends the reply to that access, which writes one message per event,
//! with the register file as it stands after the access. Once the VMM has
//! the reply, every event the access caused is already in its socket
//! buffer: it drains the socket without blocking and needs no further
//! round trip.
//!
//! The channel is optional: QEMU (mpqemu, `vfio-user-pci`) passes none and
//! the device then behaves exactly as without it. Sending uses `sendto`
//! only (allowed by the sandbox for socket replies already); the send
//! timeout is set before the sandbox is entered.

use pvsched_device::event::{DetachReason, DeviceEvent, MAX_EVENT_SIZE, ReportedRegion};
use pvsched_device::registers::RegisterState;
use pvsched_device::{PolicySink, RegionInfo};
use pvsched_util::lock;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a send may block on a VMM that does not drain its end before
/// the channel counts as broken. The reference VMM drains after every
/// reply, so the buffer never holds more than one access's events.
pub const SEND_TIMEOUT: Duration = crate::MESSAGE_DEADLINE;

/// A sink call waiting to be sent.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Pending {
    Attached(ReportedRegion),
    Detached,
    Kick(u32),
}

/// The device process's policy sink when the VMM gave it an event channel:
/// it reports the constant host flags (`--host-flags`) and queues every
/// other call for [`EventChannel::flush`].
#[derive(Debug, Default)]
pub struct EventSink {
    host_flags: u32,
    queue: Mutex<Vec<Pending>>,
}

impl EventSink {
    /// A sink reporting `host_flags` in the region header.
    pub fn new(host_flags: u32) -> Self {
        Self {
            host_flags,
            queue: Mutex::new(Vec::new()),
        }
    }
}

impl PolicySink for EventSink {
    fn region_attached(&self, region: &RegionInfo) {
        lock(&self.queue).push(Pending::Attached(region.into()));
    }

    fn region_detached(&self) {
        lock(&self.queue).push(Pending::Detached);
    }

    fn kick(&self, slot: u32) {
        lock(&self.queue).push(Pending::Kick(slot));
    }

    fn host_flags(&self) -> u32 {
        self.host_flags
    }
}

/// The device's end of the event socket and the sink that feeds it.
#[derive(Debug)]
pub struct EventChannel {
    sock: OwnedFd,
    sink: Arc<EventSink>,
    sent: u64,
}

impl EventChannel {
    /// Wrap the device's end `sock` (a `SOCK_SEQPACKET` socket) fed by
    /// `sink`, and give it a send timeout of [`SEND_TIMEOUT`] (done here,
    /// before the sandbox: `setsockopt` is not allowed in it).
    pub fn new(sock: OwnedFd, sink: Arc<EventSink>) -> io::Result<Self> {
        use nix::sys::socket::{SockType, getsockopt, setsockopt, sockopt};
        let ty = getsockopt(&sock, sockopt::SockType).map_err(io::Error::from)?;
        if ty != SockType::SeqPacket {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("the event socket must be SOCK_SEQPACKET, not {ty:?}"),
            ));
        }
        let t = nix::sys::time::TimeVal::new(
            SEND_TIMEOUT.as_secs() as libc::time_t,
            libc::suseconds_t::from(SEND_TIMEOUT.subsec_micros()),
        );
        setsockopt(&sock, sockopt::SendTimeout, &t).map_err(io::Error::from)?;
        Ok(Self {
            sock,
            sink,
            sent: 0,
        })
    }

    /// The socket's fd, for the sandbox's keep list.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Events sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Send every queued event, in order; `registers` is the device's
    /// register file now (after the access that caused them). Call before
    /// replying to the access. An error means the VMM can no longer be
    /// kept in step.
    pub fn flush(&mut self, registers: impl FnOnce() -> RegisterState) -> io::Result<()> {
        let pending = std::mem::take(&mut *lock(&self.sink.queue));
        if pending.is_empty() {
            return Ok(());
        }
        let registers = registers();
        for p in pending {
            let ev = match p {
                Pending::Attached(region) => DeviceEvent::RegionAttached {
                    region,
                    registers: registers.clone(),
                },
                Pending::Detached => DeviceEvent::RegionDetached {
                    why: DetachReason::from_registers(&registers),
                    registers: registers.clone(),
                },
                Pending::Kick(slot) => DeviceEvent::Kick { slot },
            };
            self.send(&ev.encode())?;
        }
        Ok(())
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        use nix::sys::socket::{MsgFlags, send};
        debug_assert!(bytes.len() <= MAX_EVENT_SIZE);
        loop {
            match send(self.sock.as_raw_fd(), bytes, MsgFlags::MSG_NOSIGNAL) {
                Ok(n) if n == bytes.len() => {
                    self.sent += 1;
                    return Ok(());
                }
                Ok(n) => {
                    return Err(io::Error::other(format!(
                        "event socket took {n} of {} bytes",
                        bytes.len()
                    )));
                }
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use pvsched_abi as abi;
    use pvsched_device::testing::guest_handshake;
    use pvsched_device::{DeviceConfig, PvschedDevice};
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    fn recv_all(fd: &OwnedFd) -> Vec<DeviceEvent> {
        use pvsched_device::event::{MAX_EVENTS_PER_DRAIN, read_ready};
        use std::os::fd::AsFd;
        read_ready(fd.as_fd(), MAX_EVENTS_PER_DRAIN).expect("valid events")
    }

    #[test]
    fn sink_calls_become_events_with_the_registers_after_the_access() {
        let (dev_end, vmm_end) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let sink = Arc::new(EventSink::new(abi::HOST_F_POLICY_ACTIVE));
        let mut ch = EventChannel::new(dev_end, sink.clone()).unwrap();
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut dev = PvschedDevice::new(DeviceConfig::new(2), sink).unwrap();
        dev.set_guest_memory(mem);
        ch.flush(|| dev.snapshot().registers).unwrap();
        assert!(recv_all(&vmm_end).is_empty(), "nothing happened yet");
        guest_handshake(&mut dev, 0x10000, 4096);
        assert_eq!(
            dev.region_view().unwrap().read_header().host_flags,
            abi::HOST_F_POLICY_ACTIVE
        );
        pvsched_device::testing::reg_write(&mut dev, abi::REG_KICK, 1);
        pvsched_device::testing::reg_write(&mut dev, abi::REG_STATUS, 0);
        ch.flush(|| dev.snapshot().registers).unwrap();
        let ev = recv_all(&vmm_end);
        assert_eq!(ev.len(), 3, "{ev:?}");
        match &ev[0] {
            DeviceEvent::RegionAttached { region, .. } => {
                assert_eq!((region.guest_addr, region.size), (0x10000, 4096));
                assert_eq!((region.generation, region.nr_vcpus), (1, 2));
            }
            e => panic!("{e:?}"),
        }
        assert_eq!(ev[1], DeviceEvent::Kick { slot: 1 });
        assert!(matches!(
            &ev[2],
            DeviceEvent::RegionDetached { why: DetachReason::Reset, registers } if registers.status == 0
        ));
        assert_eq!(ch.sent(), 3);
    }

    #[test]
    fn only_a_seqpacket_socket_is_accepted() {
        let (a, _b) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        assert!(EventChannel::new(a, Arc::new(EventSink::new(0))).is_err());
    }
}
