//! The sandboxed `pvsched-device` process against a hostile vfio-user
//! client: each way a client could kill, desynchronise, bloat or
//! stall the device, sent as raw messages to the real binary. The device must
//! answer (or close cleanly), keep serving, never die by a signal, and keep
//! its memory bounded.
//!
//! stderr goes to a pipe, not a file, so the sandbox applies
//! `RLIMIT_FSIZE = 0` exactly as it does under a VMM or systemd.

use crate::vfio_raw;

use nix::sys::memfd::{MemFdCreateFlag, memfd_create};
use pvsched_abi as abi;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use vfio_raw::*;

const NR_VCPUS: u32 = 2;
const BAR0: u32 = abi::REG_BAR as u32;
const BAR2: u32 = abi::REGION_BAR as u32;
const RAM: u64 = 16 << 20;
const REGION_GPA: u64 = 0x20_0000;

struct Device {
    child: Child,
    stderr: Option<JoinHandle<String>>,
    sock: Option<UnixStream>,
    dir: PathBuf,
}

impl Device {
    /// Spawn the sandboxed device (stderr a pipe) with `extra` arguments
    /// and connect to it raw.
    fn spawn(tag: &str, extra: &[&str]) -> Option<Device> {
        if !pvsched_testkit::root("hostile vfio-user client test", "the device sandbox") {
            return None;
        }
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pvsched-hostile-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
            .args(["--transport", "vfio-user", "--vcpus", &NR_VCPUS.to_string()])
            .arg("--socket")
            .arg(&path)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pvsched-device");
        let mut pipe = child.stderr.take().expect("stderr pipe");
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        });
        let sock = pvsched_testkit::wait_for(
            "the device socket",
            std::time::Duration::from_secs(10),
            || UnixStream::connect(&path).ok(),
        );
        Some(Device {
            child,
            stderr: Some(stderr),
            sock: Some(sock),
            dir,
        })
    }

    fn s(&mut self) -> &mut UnixStream {
        self.sock.as_mut().expect("connected")
    }

    fn status_field(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("device status");
        s.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} in /proc/pid/status"))
    }

    /// Close the connection; the device must exit by itself, not by a
    /// signal. Returns its exit status and stderr.
    fn finish(mut self) -> (ExitStatus, String) {
        self.sock = None;
        let status = self.child.wait().expect("wait");
        let log = self
            .stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        let _ = std::fs::remove_dir_all(&self.dir);
        (status, log)
    }
}

impl Drop for Device {
    /// A test that failed before `finish` must not leave its device behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn assert_no_signal(status: ExitStatus, log: &str) {
    assert_eq!(
        status.signal(),
        None,
        "the device died by signal {:?}; log:\n{log}",
        status.signal()
    );
}

fn assert_clean_exit(status: ExitStatus, log: &str) {
    assert_no_signal(status, log);
    assert!(status.success(), "device exit {status}; log:\n{log}");
}

/// A guest RAM memfd of `RAM` bytes; sealed against shrinking when `seal`
/// (as QEMU's memory-backend-memfd does by default).
fn guest_ram(seal: bool) -> File {
    if seal {
        return pvsched_testkit::sealed_memfd(c"hostile-ram", RAM);
    }
    let flags = MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING;
    let f: File = memfd_create(c"hostile-ram", flags).expect("memfd").into();
    f.set_len(RAM).expect("ftruncate");
    f
}

/// The driver's guest-region handshake over raw messages; (STATUS, ERROR).
fn guest_handshake(s: &mut UnixStream, gpa: u64) -> (u32, u32) {
    let mut id = 100u16;
    let mut w = |s: &mut UnixStream, off: u32, v: u32| {
        id += 1;
        write_u32(s, id, BAR0, u64::from(off), v);
    };
    let base = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER;
    w(s, abi::REG_STATUS, 0);
    w(s, abi::REG_STATUS, abi::STATUS_ACKNOWLEDGE);
    w(s, abi::REG_STATUS, base);
    let f = abi::F_GUEST_REGION;
    w(s, abi::REG_DRV_FEATURES_LO, f as u32);
    w(s, abi::REG_DRV_FEATURES_HI, (f >> 32) as u32);
    w(s, abi::REG_STATUS, base | abi::STATUS_FEATURES_OK);
    w(s, abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
    w(s, abi::REG_SHM_GPA_LO, gpa as u32);
    w(s, abi::REG_SHM_GPA_HI, (gpa >> 32) as u32);
    w(s, abi::REG_SHM_SIZE, abi::region_size(NR_VCPUS));
    w(
        s,
        abi::REG_STATUS,
        base | abi::STATUS_FEATURES_OK | abi::STATUS_DRIVER_OK,
    );
    (
        read_u32(s, 90, BAR0, u64::from(abi::REG_STATUS)),
        read_u32(s, 91, BAR0, u64::from(abi::REG_ERROR)),
    )
}

fn dma_map_ram(s: &mut UnixStream, ram: &File) -> Reply {
    send(
        s,
        &message(5, DMA_MAP, &dma_map(3, 0, 0, RAM)),
        &[ram.as_raw_fd()],
    );
    recv(s).expect("DMA_MAP reply")
}

/// Finding 1: a BAR2 write arriving over the socket used to be a pwrite
/// to the BAR2 memfd, which RLIMIT_FSIZE = 0 turns into SIGXFSZ.
#[test]
fn bar2_access_over_the_socket_survives_rlimit_fsize() {
    let Some(mut d) = Device::spawn("fsize", &[]) else {
        return;
    };
    let s = d.s();
    write_u32(s, 1, BAR2, 0, 0x1234_5678);
    assert_eq!(read_u32(s, 2, BAR2, 0), 0x1234_5678, "BAR2 write landed");
    assert_eq!(read_u32(s, 3, BAR0, u64::from(abi::REG_MAGIC)), abi::MAGIC);
    let (status, log) = d.finish();
    assert_clean_exit(status, &log);
}

/// Finding 2: a client that truncates guest RAM it shared made the device
/// fault with SIGBUS on its next read of the guest region. The device now
/// maps guest RAM only from fds sealed against shrinking.
#[test]
fn truncating_shared_guest_ram_cannot_kill_the_device() {
    // Unsealed: the map is accepted but not used, so the handshake is
    // refused with ERR_REGION_OUTSIDE_RAM and the truncation harms nobody.
    // The dump samples the guest region every millisecond.
    let dump =
        std::env::temp_dir().join(format!("pvsched-hostile-{}-dump.json", std::process::id()));
    let dump_arg = dump.to_string_lossy().into_owned();
    let Some(mut d) = Device::spawn("sigbus", &["--dump-slots", &dump_arg, "--dump-ms", "1"])
    else {
        return;
    };
    let ram = guest_ram(false);
    let r = dma_map_ram(d.s(), &ram);
    assert!(!r.is_error(), "DMA_MAP answered: {r:?}");
    let (status, error) = guest_handshake(d.s(), REGION_GPA);
    ram.set_len(0).expect("truncate");
    // Each message makes the device sample the region; a device that had
    // mapped the truncated file would fault here.
    for i in 0..50 {
        send(
            d.s(),
            &message(200 + i, REGION_READ, &region_access(BAR0, 0, 4, &[])),
            &[],
        );
        if recv(d.s()).is_none() {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (st, log) = d.finish();
    let _ = std::fs::remove_file(&dump);
    assert_clean_exit(st, &log);
    assert_eq!(error, abi::ERR_REGION_OUTSIDE_RAM, "status {status:#x}");
    assert!(log.contains("F_SEAL_SHRINK"), "the refusal says why: {log}");

    // Sealed: the handshake works and the kernel refuses the truncation.
    let Some(mut d) = Device::spawn("sealed", &[]) else {
        return;
    };
    let ram = guest_ram(true);
    assert!(!dma_map_ram(d.s(), &ram).is_error());
    let ok = abi::STATUS_ACKNOWLEDGE
        | abi::STATUS_DRIVER
        | abi::STATUS_FEATURES_OK
        | abi::STATUS_DRIVER_OK;
    assert_eq!(guest_handshake(d.s(), REGION_GPA), (ok, abi::ERR_NONE));
    assert!(ram.set_len(0).is_err(), "a sealed memfd cannot shrink");
    let (st, log) = d.finish();
    assert_clean_exit(st, &log);
}

/// Finding 2 for the device's own memfd: the BAR2 fd travels to the client
/// with the region info; the client must not be able to shrink it under the
/// device's mapping.
#[test]
fn the_bar2_fd_handed_to_the_client_cannot_be_shrunk() {
    let Some(mut d) = Device::spawn("bar2-seal", &[]) else {
        return;
    };
    // Ask for region 2's info with room for its sparse-mmap capability.
    let mut body = Vec::new();
    for v in [256u32, 0, BAR2, 0, 0, 0, 0, 0] {
        body.extend_from_slice(&v.to_le_bytes());
    }
    send(d.s(), &message(1, DEVICE_GET_REGION_INFO, &body), &[]);
    let fd = recv_fd(d.s());
    // SAFETY: `recv_fd` returned a fresh descriptor this test owns.
    let bar2 = unsafe { File::from_raw_fd(fd) };
    assert!(bar2.set_len(0).is_err(), "BAR2 memfd is sealed");
    write_u32(d.s(), 2, BAR2, 8, 7);
    assert_eq!(read_u32(d.s(), 3, BAR2, 8), 7);
    let (st, log) = d.finish();
    assert_clean_exit(st, &log);
}

/// Receive one reply with its fd (the region info of an mmapable region).
fn recv_fd(s: &UnixStream) -> i32 {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    let mut buf = vec![0u8; 4096];
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let mut cmsg = nix::cmsg_space!([i32; 4]);
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
        .expect("recvmsg");
    let fds: Vec<i32> = msg
        .cmsgs()
        .expect("cmsgs")
        .filter_map(|c| match c {
            ControlMessageOwned::ScmRights(f) => Some(f),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(fds.len(), 1, "one fd with the BAR2 region info");
    fds[0]
}

/// Finding 3: REGION_READ/WRITE allocated the client's `count` (up to
/// 4 GiB) before anything checked it.
#[test]
fn client_chosen_counts_allocate_nothing() {
    let Some(mut d) = Device::spawn("count", &[]) else {
        return;
    };
    let peak = d.status_field("VmPeak:");
    for (id, count) in [(1u16, u32::MAX), (2, 1 << 30), (3, 64 << 20)] {
        send(
            d.s(),
            &message(id, REGION_READ, &region_access(BAR0, 0, count, &[])),
            &[],
        );
        let r = recv(d.s()).expect("reply");
        assert!(r.is_error() && r.id == id, "{r:?}");
    }
    let grown = d.status_field("VmPeak:").saturating_sub(peak);
    assert!(grown < 16 << 10, "VmPeak grew by {grown} kB");
    // A write claiming 1 GiB of payload: refused from its header alone, and
    // the connection closed (its body cannot be skipped without reading it).
    send(
        d.s(),
        &message_sized(
            4,
            REGION_WRITE,
            16 + 16 + (1 << 30),
            &region_access(BAR0, 0, 1 << 30, &[0; 64]),
        ),
        &[],
    );
    let r = recv(d.s()).expect("reply before closing");
    assert!(r.is_error() && r.id == 4, "{r:?}");
    assert_eq!(r.error, libc::E2BIG as u32);
    // The device closed the connection and exits with its error code.
    let (st, log) = d.finish();
    assert_no_signal(st, &log);
    assert_eq!(st.code(), Some(1), "{log}");
    assert!(log.contains("exceeds the largest message"), "{log}");
}

/// Finding 4: a message the server did not understand left its body in the
/// stream, to be parsed as the next header.
#[test]
fn unknown_and_malformed_messages_keep_the_stream_in_sync() {
    let Some(mut d) = Device::spawn("sync", &[]) else {
        return;
    };
    let junk = [0xa5u8; 40];
    let mut reply_flagged = message(6, REGION_READ, &region_access(BAR0, 0, 4, &[]));
    reply_flagged[8] = F_REPLY as u8;
    let cases: Vec<(u16, Vec<u8>)> = vec![
        (1, message(1, 99, &junk)),
        (
            2,
            message(2, REGION_WRITE, &region_access(50, 0, 8, &[1; 8])),
        ),
        (3, message(3, VERSION, &[1, 2])),
        (4, message(4, VERSION, b"\0\0\0\0{not json")),
        (5, message(5, DMA_UNMAP, &junk[..8])),
        (6, reply_flagged),
        (
            7,
            message(7, REGION_WRITE, &region_access(BAR0, 0, 8, &[1; 4])),
        ),
        (8, message(8, 6, &junk)),
        (9, message(9, DEVICE_SET_IRQS, &junk[..20])),
    ];
    for (id, m) in cases {
        send(d.s(), &m, &[]);
        let r = recv(d.s()).unwrap_or_else(|| panic!("message {id}: connection closed"));
        assert_eq!(r.id, id, "replies stay in order");
        assert!(r.is_error(), "message {id} refused: {r:?}");
        assert_ne!(r.error, 0, "message {id}: errno set");
        assert_eq!(
            read_u32(d.s(), 1000 + id, BAR0, u64::from(abi::REG_MAGIC)),
            abi::MAGIC,
            "in sync after message {id}"
        );
    }
    let (st, log) = d.finish();
    assert_clean_exit(st, &log);
}

/// The memory cap: the device runs with an RLIMIT_DATA (guest RAM and BAR2
/// are shared mappings, which it does not count).
#[test]
fn the_device_runs_under_a_data_limit() {
    let Some(mut d) = Device::spawn("cap", &[]) else {
        return;
    };
    read_u32(d.s(), 1, BAR0, u64::from(abi::REG_MAGIC));
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.child.id())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max data size"))
        .expect("Max data size");
    let soft: u64 = line
        .split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("finite data limit: {line}"));
    let data_kb = d.status_field("VmData:");
    assert!(
        data_kb * 1024 < soft,
        "VmData {data_kb} kB under the cap {soft}"
    );
    let (st, log) = d.finish();
    assert_clean_exit(st, &log);
}

/// Finding 5: a client that sent part of a message (half a header, or a
/// header whose body never comes) and then nothing blocked the device in
/// its read for good: no more replies, and the idle hook that samples the
/// region stopped too. The connection is now dropped once the rest is
/// overdue; the device, serving one client, exits with its error code.
#[test]
fn a_client_that_stops_mid_message_is_dropped() {
    use std::io::Read;
    let read = message(1, REGION_READ, &region_access(BAR0, 0, 4, &[]));
    let mut stalled = Vec::new();
    for (what, cut) in [
        ("half a header", HEADER / 2),
        ("a header without its body", HEADER),
    ] {
        let Some(mut d) = Device::spawn("stall", &[]) else {
            return;
        };
        let magic = read_u32(d.s(), 2, BAR0, u64::from(abi::REG_MAGIC));
        assert_eq!(magic, abi::MAGIC, "{what}: serving first");
        send(d.s(), &read[..cut], &[]);
        stalled.push((what, d));
    }
    for (what, mut d) in stalled {
        // A bound on a hang, not a timing assertion: the device's deadline
        // is a few seconds.
        d.s()
            .set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .expect("read timeout");
        match d.s().read(&mut [0u8; 1]) {
            Ok(0) => {}
            Ok(_) => panic!("{what}: a reply to half a message"),
            Err(e) => panic!("{what}: the device never dropped the stalled connection ({e})"),
        }
        let (st, log) = d.finish();
        assert_no_signal(st, &log);
        assert_eq!(st.code(), Some(1), "{what}: {log}");
    }
}
