//! The device end of QEMU's multi-process proxy (`-device
//! x-pci-proxy-dev,fd=N`, QEMU 7.2–10.0).
//!
//! QEMU sends configuration and BAR accesses, guest RAM layout
//! (SYNC_SYSMEM, with one memory fd per range), interrupt eventfds and
//! resets over a UNIX stream socket ([`message`] has the format). Every
//! request QEMU waits for is answered, malformed ones included (reads answer
//! all-ones), because a peer that stays silent blocks a vCPU forever.
//!
//! Guest RAM is remapped from scratch on every SYNC_SYSMEM (QEMU sends ~55
//! per boot). BAR accesses carry absolute guest addresses; they are routed
//! through the device's decoded BAR addresses ([`pvsched_device::PciDevice::bars`]). The
//! proxy cannot map device memory into the guest, so over this transport
//! the device offers guest region mode only.
//!
//! Once the first byte of a message has arrived, the rest must arrive
//! within [`crate::MESSAGE_DEADLINE`]; a peer that stops halfway is
//! dropped ([`MpqemuError::Stalled`]) instead of holding the device in its
//! read for good. Waiting for the next message is not bounded.

pub mod message;

use crate::backend::TransportDevice;
use crate::monitor::TransportMonitor;
use crate::slot_dump::SlotDumper;
use message::{HEADER_LEN, Header, MAX_FDS, MessageError, Request, encode_ret};
use nix::poll::{PollFd, PollFlags, ppoll};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use nix::sys::time::TimeSpec;
use pvsched_device::BarIndex;
use std::fs::File;
use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;
use thiserror::Error;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

/// Errors that end an mpqemu session.
#[derive(Debug, Error)]
pub enum MpqemuError {
    /// Receiving from the socket failed.
    #[error("receiving an mpqemu message failed: {0}")]
    Recv(#[source] std::io::Error),
    /// Waiting for the socket failed.
    #[error("waiting for the mpqemu socket failed: {0}")]
    Poll(#[source] std::io::Error),
    /// Sending a reply failed (QEMU gone?).
    #[error("sending an mpqemu reply failed: {0}")]
    Send(#[source] std::io::Error),
    /// The peer sent part of a message and not the rest in time.
    #[error(
        "the peer sent {received} of the {expected} bytes of a message and not the rest within {:?} of the first; closing the connection",
        crate::MESSAGE_DEADLINE
    )]
    Stalled {
        /// Bytes of the message received.
        received: usize,
        /// Bytes of the whole message (a header until the header is read).
        expected: usize,
    },
    /// The stream cannot be resynchronised (payload size absurd).
    #[error("mpqemu stream out of sync: {0}; closing the connection")]
    Desync(#[source] MessageError),
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, MpqemuError>;

/// Largest announced payload skipped before giving up on the stream.
const MAX_SKIP: u64 = 1 << 20;

/// A message whose first bytes have arrived: the rest is due by
/// `deadline`.
struct Arrival {
    deadline: Instant,
    /// Bytes of the message received so far.
    received: usize,
    /// Bytes of the whole message (a header until the header is read).
    expected: usize,
}

/// A received message: header, payload and descriptors.
struct Frame {
    header: Header,
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

/// Serves one device to one QEMU over one socket.
pub struct MpqemuPeer<D> {
    sock: UnixStream,
    dev: D,
    monitor: Arc<TransportMonitor>,
    irqfds: Vec<OwnedFd>,
    dumper: Option<SlotDumper>,
}

impl<D: TransportDevice> MpqemuPeer<D> {
    /// Serve `dev` on `sock`, reporting to `monitor`.
    pub fn new(sock: UnixStream, dev: D, monitor: Arc<TransportMonitor>) -> Self {
        MpqemuPeer {
            sock,
            dev,
            monitor,
            irqfds: Vec::new(),
            dumper: None,
        }
    }

    /// Sample the region into `dumper` while serving: the socket is waited
    /// for with a timeout so samples keep coming while QEMU is silent (the
    /// guest updates its slots without a message).
    pub fn set_dumper(&mut self, dumper: SlotDumper) {
        self.dumper = Some(dumper);
    }

    /// The served device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The interrupt eventfds QEMU gave (irqfd, resamplefd), if any.
    pub fn irqfds(&self) -> &[OwnedFd] {
        &self.irqfds
    }

    /// Handle messages until QEMU closes the socket.
    pub fn serve(&mut self) -> Result<()> {
        let r = loop {
            if let Err(e) = self.wait_readable() {
                break Err(e);
            }
            match self.handle_one() {
                Ok(true) => {}
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.monitor.disconnected();
        if let Some(d) = self.dumper.as_mut() {
            d.finish(&self.monitor);
        }
        r
    }

    /// With a dumper: sample until the socket is readable. Without: return
    /// at once (the next receive blocks).
    fn wait_readable(&mut self) -> Result<()> {
        let Some(dumper) = self.dumper.as_mut() else {
            return Ok(());
        };
        loop {
            dumper.tick(&self.monitor);
            let left = dumper.until_next_sample();
            let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
            match ppoll(&mut fds, Some(TimeSpec::from_duration(left)), None) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => {}
                Ok(_) => return Ok(()),
                Err(e) => return Err(MpqemuError::Poll(e.into())),
            }
        }
    }

    /// Receive and handle one message. `Ok(false)` at end of stream.
    pub fn handle_one(&mut self) -> Result<bool> {
        let Some(frame) = self.recv_frame()? else {
            return Ok(false);
        };
        let cmd = frame.header.cmd;
        match Request::parse(cmd, &frame.payload, frame.fds.len()) {
            Ok(req) => {
                let name = request_name(&req);
                let reply = self.handle(req, frame.fds);
                if let Some(v) = reply {
                    self.send_ret(v)?;
                }
                self.monitor.after_message(name, &self.dev);
            }
            Err(e) => {
                log::warn!("mpqemu: malformed message ignored: {e}");
                self.monitor.malformed();
                if Request::cmd_wants_reply(cmd) {
                    self.send_ret(u64::MAX)?;
                }
            }
        }
        Ok(true)
    }

    fn send_ret(&mut self, v: u64) -> Result<()> {
        self.sock
            .write_all(&encode_ret(v))
            .map_err(MpqemuError::Send)
    }

    fn recv_frame(&mut self) -> Result<Option<Frame>> {
        let mut hdr = [0u8; HEADER_LEN];
        let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; MAX_FDS]);
        let mut fds = Vec::new();
        let got = {
            let mut iov = [IoSliceMut::new(&mut hdr)];
            let msg = loop {
                match recvmsg::<()>(
                    self.sock.as_raw_fd(),
                    &mut iov,
                    Some(&mut cmsg),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                ) {
                    Err(nix::errno::Errno::EINTR) => continue,
                    r => break r.map_err(|e| MpqemuError::Recv(e.into()))?,
                }
            };
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        for fd in raw {
                            // SAFETY: the kernel just installed `fd` in this
                            // process for us (SCM_RIGHTS); nothing else owns it.
                            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                }
            }
            msg.bytes
        };
        if got == 0 {
            return Ok(None);
        }
        let mut msg = Arrival {
            deadline: Instant::now() + crate::MESSAGE_DEADLINE,
            received: got,
            expected: HEADER_LEN,
        };
        if got < HEADER_LEN {
            self.read_rest(&mut hdr[got..], &mut msg)?;
        }
        let header = Header::parse(&hdr).map_err(MpqemuError::Desync)?;
        let payload = match header.payload_len() {
            Ok(n) => {
                let mut p = vec![0u8; n];
                msg.expected = HEADER_LEN + n;
                self.read_rest(&mut p, &mut msg)?;
                p
            }
            Err(e) => {
                if header.size > MAX_SKIP {
                    return Err(MpqemuError::Desync(e));
                }
                log::warn!("mpqemu: {e}; payload skipped");
                // At most MAX_SKIP bytes (checked above).
                let mut left = header.size as usize;
                msg.expected = HEADER_LEN + left;
                let mut scratch = [0u8; 4096];
                while left > 0 {
                    let n = left.min(scratch.len());
                    self.read_rest(&mut scratch[..n], &mut msg)?;
                    left -= n;
                }
                Vec::new()
            }
        };
        Ok(Some(Frame {
            header,
            payload,
            fds,
        }))
    }

    /// Fill `buf` from the socket before `msg`'s deadline; the dumper keeps
    /// sampling while the rest of the message is awaited.
    fn read_rest(&mut self, buf: &mut [u8], msg: &mut Arrival) -> Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = msg
                .deadline
                .checked_duration_since(Instant::now())
                .filter(|l| !l.is_zero());
            let Some(left) = left else {
                let e = MpqemuError::Stalled {
                    received: msg.received + filled,
                    expected: msg.expected,
                };
                log::error!("mpqemu: {e}");
                return Err(e);
            };
            let wait = self
                .dumper
                .as_ref()
                .map_or(left, |d| d.until_next_sample().min(left));
            let mut fds = [PollFd::new(self.sock.as_fd(), PollFlags::POLLIN)];
            match ppoll(&mut fds, Some(TimeSpec::from_duration(wait)), None) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => {
                    if let Some(d) = self.dumper.as_mut() {
                        d.tick(&self.monitor);
                    }
                    continue;
                }
                Ok(_) => {}
                Err(e) => return Err(MpqemuError::Poll(e.into())),
            }
            match self.sock.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(MpqemuError::Recv(std::io::ErrorKind::UnexpectedEof.into()));
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(MpqemuError::Recv(e)),
            }
        }
        msg.received += filled;
        Ok(())
    }

    /// Handle a parsed request; `Some(v)` is the RET value to send.
    fn handle(&mut self, req: Request, fds: Vec<OwnedFd>) -> Option<u64> {
        match req {
            Request::SyncSysmem(regions) => {
                self.sync_sysmem(&regions, fds);
                None
            }
            Request::ConfigWrite { addr, val, len } => {
                let off = (addr % 4) as usize;
                let len = usize::from(len);
                if off + len > 4 || addr >= 256 {
                    log::warn!("mpqemu: config write {len}@{addr:#x} ignored");
                } else {
                    let data = val.to_le_bytes();
                    let _changes = self.dev.write_config_register(
                        (addr / 4) as usize,
                        off as u64,
                        &data[..len],
                    );
                }
                Some(0)
            }
            Request::ConfigRead { addr, len } => {
                let off = addr % 4;
                let v = u64::from(self.dev.read_config_register((addr / 4) as usize) >> (8 * off));
                let mask = (1u64 << (8 * u32::from(len))) - 1;
                Some(v & mask)
            }
            Request::BarWrite {
                addr,
                val,
                size,
                memory,
            } => {
                match self.route(addr, size, memory) {
                    Some((bar, off)) => {
                        let b = val.to_le_bytes();
                        self.dev.write_bar(bar, off, &b[..usize::from(size)]);
                    }
                    None => self.monitor.stray_bar_access(),
                }
                Some(0)
            }
            Request::BarRead { addr, size, memory } => match self.route(addr, size, memory) {
                Some((bar, off)) => {
                    let mut b = [0u8; 8];
                    self.dev.read_bar(bar, off, &mut b[..usize::from(size)]);
                    Some(u64::from_le_bytes(b))
                }
                None => {
                    self.monitor.stray_bar_access();
                    Some(u64::MAX)
                }
            },
            Request::SetIrqfd => {
                // Kept open for the device's lifetime. Under TCG QEMU cannot
                // inject INTx from them; the driver never needs interrupts.
                self.irqfds = fds;
                None
            }
            Request::DeviceReset => {
                self.dev.reset();
                Some(0)
            }
        }
    }

    /// Map an absolute guest address to (BAR, offset) through the device's
    /// decoded BARs.
    fn route(&self, addr: u64, size: u8, memory: bool) -> Option<(BarIndex, u64)> {
        if !memory {
            log::warn!("mpqemu: I/O port access at {addr:#x} ignored (no I/O BARs)");
            return None;
        }
        let end = addr.checked_add(u64::from(size))?;
        let hit = self.dev.bars().into_iter().find_map(|b| {
            let base = b.address?;
            let bar_end = base.checked_add(b.size)?;
            (addr >= base && end <= bar_end).then(|| (b.index, addr - base))
        });
        if hit.is_none() {
            log::warn!("mpqemu: BAR access {size}@{addr:#x} hits no decoded BAR; ignored");
        }
        hit
    }

    fn sync_sysmem(&mut self, regions: &[message::SysmemRegion], fds: Vec<OwnedFd>) {
        let mut files: Vec<Option<File>> = fds.into_iter().map(|f| Some(File::from(f))).collect();
        let mut ranges = Vec::new();
        for r in regions {
            let Some(file) = files.get_mut(r.fd_index).and_then(Option::take) else {
                continue;
            };
            let (Ok(size), Ok(offset)) = (usize::try_from(r.size), u64::try_from(r.offset)) else {
                log::warn!(
                    "mpqemu: SYNC_SYSMEM range {:#x}+{:#x} @{} unusable; skipped",
                    r.gpa,
                    r.size,
                    r.offset
                );
                continue;
            };
            if size == 0 || r.gpa.checked_add(r.size).is_none() {
                continue;
            }
            if let Err(why) = crate::guest_ram::check(&file, offset, r.size) {
                log::warn!(
                    "mpqemu: SYNC_SYSMEM range {:#x}+{:#x} not mapped: {why}",
                    r.gpa,
                    r.size
                );
                continue;
            }
            ranges.push((
                GuestAddress(r.gpa),
                size,
                Some(FileOffset::new(file, offset)),
            ));
        }
        ranges.sort_by_key(|r| r.0);
        match GuestMemoryMmap::from_ranges_with_files(ranges) {
            Ok(mem) => self.dev.set_guest_memory(mem),
            Err(e) => log::warn!(
                "mpqemu: SYNC_SYSMEM cannot map guest RAM ({e}); keeping the previous map"
            ),
        }
    }
}

fn request_name(r: &Request) -> &'static str {
    match r {
        Request::SyncSysmem(_) => "sync_sysmem",
        Request::ConfigWrite { .. } => "config_write",
        Request::ConfigRead { .. } => "config_read",
        Request::BarWrite { .. } => "bar_write",
        Request::BarRead { .. } => "bar_read",
        Request::SetIrqfd => "set_irqfd",
        Request::DeviceReset => "device_reset",
    }
}
