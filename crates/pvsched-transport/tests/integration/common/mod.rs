//! A scripted QEMU 7.2 `x-pci-proxy-dev`: the proxy side of the mpqemu
//! socket, replaying the message sequences QEMU sends (shared by the
//! integration tests).

#![allow(dead_code)]

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use pvsched_abi as abi;
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
use pvsched_transport::fault::{Fault, FaultyDevice};
use pvsched_transport::monitor::TransportMonitor;
use pvsched_transport::mpqemu::MpqemuPeer;
use pvsched_transport::mpqemu::message::*;
use std::fs::File;
use std::io::{IoSlice, Read};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;

pub const RAM: u64 = 16 << 20;
pub const BAR0: u64 = 0xfebf_0000;
pub const REGION_GPA: u64 = 0x20_0000;

/// Reads one RET message (header and its 8-byte value) from `s`.
pub fn read_ret(s: &mut impl Read) -> u64 {
    let mut b = [0u8; HEADER_LEN + 8];
    s.read_exact(&mut b).expect("a RET within the timeout");
    assert_eq!(
        Header::parse(&b),
        Ok(Header {
            cmd: CMD_RET,
            size: 8
        })
    );
    u64::from_le_bytes(b[HEADER_LEN..].try_into().expect("8 bytes"))
}

/// The QEMU side of the socket.
pub struct Qemu {
    pub sock: UnixStream,
    pub ram: File,
    pub peer: Option<JoinHandle<bool>>,
    pub monitor: Arc<TransportMonitor>,
}

impl Qemu {
    /// Connect to an external device process through `sock`.
    pub fn connect(sock: UnixStream) -> Qemu {
        Qemu {
            sock,
            ram: guest_ram(),
            peer: None,
            monitor: Arc::new(TransportMonitor::new()),
        }
    }

    /// Start an in-process device (thread) behind a socketpair.
    pub fn start(fault: Option<Fault>) -> Qemu {
        let (q, d) = UnixStream::pair().expect("socketpair");
        let mut cfg = DeviceConfig::new(2);
        cfg.features = abi::F_ALL & !abi::F_DEVICE_REGION;
        let dev = PvschedDevice::new(cfg, Arc::new(NullSink)).expect("device");
        let monitor = Arc::new(TransportMonitor::new());
        let m2 = monitor.clone();
        let peer = std::thread::spawn(move || {
            let mut p = MpqemuPeer::new(d, FaultyDevice::new(dev, fault), m2);
            p.serve().is_ok()
        });
        Qemu {
            sock: q,
            ram: guest_ram(),
            peer: Some(peer),
            monitor,
        }
    }

    pub fn send(&self, cmd: i32, payload: &[u8], fds: &[&dyn AsFd]) {
        let frame = encode_request(cmd, payload);
        let raw: Vec<i32> = fds.iter().map(|f| f.as_fd().as_raw_fd()).collect();
        let cmsg = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &cmsg };
        let n = sendmsg::<()>(
            self.sock.as_raw_fd(),
            &[IoSlice::new(&frame)],
            cmsgs,
            MsgFlags::empty(),
            None,
        )
        .expect("sendmsg");
        assert_eq!(n, frame.len());
    }

    pub fn ret(&mut self) -> u64 {
        read_ret(&mut self.sock)
    }

    pub fn cfg_read(&mut self, addr: u32, len: i32) -> u32 {
        self.send(CMD_PCI_CFGREAD, &config_payload(addr, 0, len), &[]);
        self.ret() as u32
    }

    pub fn cfg_write(&mut self, addr: u32, val: u32, len: i32) {
        self.send(CMD_PCI_CFGWRITE, &config_payload(addr, val, len), &[]);
        assert_eq!(self.ret(), 0);
    }

    pub fn bar_read(&mut self, addr: u64) -> u32 {
        self.send(CMD_BAR_READ, &bar_payload(addr, 0, 4, true), &[]);
        self.ret() as u32
    }

    pub fn bar_write(&mut self, addr: u64, val: u32) {
        self.send(
            CMD_BAR_WRITE,
            &bar_payload(addr, u64::from(val), 4, true),
            &[],
        );
        assert_eq!(self.ret(), 0);
    }

    pub fn reg(&mut self, reg: u32) -> u32 {
        self.bar_read(BAR0 + u64::from(reg))
    }

    pub fn set_reg(&mut self, reg: u32, val: u32) {
        self.bar_write(BAR0 + u64::from(reg), val);
    }

    /// QEMU's pc layout: low RAM below the VGA hole, the rest above 1 MiB,
    /// both from the one memfd, one dup'd fd per range.
    pub fn sync_sysmem(&self) {
        self.sync_ranges(&[(0, 0xa_0000), (0x10_0000, RAM - 0x10_0000)]);
    }

    /// Guest RAM is `ranges` of (GPA, size), each at file offset = GPA of
    /// the one memfd, one dup'd fd per range.
    pub fn sync_ranges(&self, ranges: &[(u64, u64)]) {
        let fds: Vec<OwnedFd> = ranges
            .iter()
            .map(|_| self.ram.try_clone().expect("dup").into())
            .collect();
        let fds: Vec<&dyn AsFd> = fds.iter().map(|f| f as &dyn AsFd).collect();
        let r: Vec<(u64, u64, i64)> = ranges
            .iter()
            .map(|&(gpa, size)| (gpa, size, gpa as i64))
            .collect();
        self.send(CMD_SYNC_SYSMEM, &sysmem_payload(&r), &fds);
    }

    /// Realize: identity reads and BAR sizing of 0x10..=0x28, as
    /// `probe_pci_info` in QEMU's hw/remote/proxy.c does it.
    pub fn realize(&mut self) -> Vec<u32> {
        assert_eq!(self.cfg_read(0x00, 2), u32::from(abi::PCI_VENDOR_ID));
        assert_eq!(self.cfg_read(0x02, 2), u32::from(abi::PCI_DEVICE_ID));
        assert_eq!(self.cfg_read(0x0a, 2), abi::PCI_CLASS >> 8);
        let mut sizes = Vec::new();
        for bar in 0..7u32 {
            let addr = 0x10 + 4 * bar;
            let orig = self.cfg_read(addr, 4);
            self.cfg_write(addr, 0xffff_ffff, 4);
            let mask = self.cfg_read(addr, 4);
            self.cfg_write(addr, orig, 4);
            sizes.push(mask);
        }
        sizes
    }

    /// The guest kernel assigns BAR0 and enables memory decoding.
    pub fn program_bar0(&mut self) {
        self.cfg_write(0x10, BAR0 as u32, 4);
        let cmd = self.cfg_read(0x04, 2);
        self.cfg_write(0x04, cmd | 0x2, 2);
    }

    /// The guest driver's handshake, guest region at `gpa`.
    pub fn handshake(&mut self, gpa: u64) -> u32 {
        self.set_reg(abi::REG_STATUS, 0);
        assert_eq!(self.reg(abi::REG_MAGIC), abi::MAGIC);
        self.set_reg(abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
        self.set_reg(abi::REG_STATUS, abi::STATUS_ACKNOWLEDGE);
        self.set_reg(
            abi::REG_STATUS,
            abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER,
        );
        let offered = self.reg(abi::REG_DEV_FEATURES_LO);
        assert_eq!(
            u64::from(offered) & abi::F_DEVICE_REGION,
            0,
            "no BAR2 over mpqemu"
        );
        self.set_reg(abi::REG_DRV_FEATURES_LO, abi::F_GUEST_REGION as u32);
        let s = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER | abi::STATUS_FEATURES_OK;
        self.set_reg(abi::REG_STATUS, s);
        let size = self.reg(abi::REG_REGION_SIZE);
        self.set_reg(abi::REG_SHM_GPA_LO, gpa as u32);
        self.set_reg(abi::REG_SHM_GPA_HI, (gpa >> 32) as u32);
        self.set_reg(abi::REG_SHM_SIZE, size);
        self.set_reg(abi::REG_STATUS, s | abi::STATUS_DRIVER_OK);
        self.reg(abi::REG_STATUS)
    }

    pub fn ram_u32(&self, gpa: u64) -> u32 {
        let mut b = [0u8; 4];
        self.ram.read_exact_at(&mut b, gpa).expect("pread");
        u32::from_le_bytes(b)
    }

    pub fn close(mut self) -> Arc<TransportMonitor> {
        drop(self.sock);
        if let Some(p) = self.peer.take() {
            assert!(p.join().expect("peer thread"), "serve() failed");
        }
        self.monitor
    }
}

/// Guest RAM: a memfd of `RAM` bytes, as `memory-backend-memfd`.
pub fn guest_ram() -> File {
    pvsched_testkit::sealed_memfd(c"guest-ram", RAM)
}
