//! The `pvsched-device` binary as a vfio-user server in its own process:
//! the crate's `Client` connects to `--socket`, runs the device-region
//! handshake, maps BAR2 through the fd it was sent and writes a slot; the
//! process's JSON slot dump shows what the guest wrote, with no socket
//! message per update.

use crate::slot_dump_check;
use crate::vfio_client;

use pvsched_abi as abi;
use slot_dump_check::{FIFO8_WRITES, assert_fifo8_seen_in_slot1};
use std::process::{Child, Command, Stdio};
use vfio_client::{connect, driver_ok, map_bar2, map_bars, negotiate, set_reg};

#[test]
fn serves_vfio_user_client_in_device_region_mode() {
    let dir = std::env::temp_dir().join(format!("pvsched-vfio-user-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let sock = dir.join("sock");
    let dump = dir.join("slots.json");
    let mut child = serve(
        &sock,
        &["--apic-ids", "0,2", "--dump-ms", "10", "--dump-slots"],
        Some(&dump),
    );
    let mut c = connect(&sock, &mut child);

    // Firmware: place BAR0 and BAR2, enable memory decoding; then the
    // driver's device-region handshake.
    map_bars(&mut c);
    negotiate(&mut c, abi::F_DEVICE_REGION);
    let s = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER | abi::STATUS_FEATURES_OK;
    assert_eq!(driver_ok(&mut c), s | abi::STATUS_DRIVER_OK);

    // The guest reports FIFO 8 in slot 1 (APIC ID 2) through the mapping.
    let map = map_bar2(&c);
    let slot1 = u64::from(abi::slot_offset(2, 1));
    for (off, v) in FIFO8_WRITES {
        let at = usize::try_from(slot1 + off).expect("offset");
        assert!(at + 4 <= map.size());
        // SAFETY: `at + 4` lies inside the live mapping `map`; a 4-byte
        // volatile store to shared memory the device only reads.
        unsafe { std::ptr::write_volatile(map.as_ptr().add(at) as *mut u32, v) };
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    c.shutdown().expect("shutdown");
    drop(c);
    assert_fifo8_seen_in_slot1(&mut child, &dump, &dir);
}

#[test]
fn vfio_user_requires_a_socket_path() {
    let out = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
        .args(["--transport", "vfio-user", "--vcpus", "1"])
        .stdin(Stdio::null())
        .output()
        .expect("run pvsched-device");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--socket"), "{err}");
}

/// `pvsched-device` serving 2 vCPUs over vfio-user on `sock`, with `args`
/// and then `last` (a path argument) if any.
fn serve(sock: &std::path::Path, args: &[&str], last: Option<&std::path::Path>) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pvsched-device"));
    cmd.args(["--transport", "vfio-user", "--vcpus", "2", "--socket"])
        .arg(sock)
        .args(args);
    if let Some(p) = last {
        cmd.arg(p);
    }
    cmd.stdin(Stdio::null())
        .spawn()
        .expect("spawn pvsched-device")
}

/// `file` without FD_CLOEXEC, so a child inherits it at the same number.
fn inheritable(file: &std::fs::File) -> i32 {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl(F_SETFD) on an fd `file` owns; no pointers.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    assert_eq!(rc, 0, "F_SETFD: {}", std::io::Error::last_os_error());
    fd
}

/// `--bar2-fd`: the given fd (pvschedd's region map in production; a
/// sealed memfd here) is BAR2: the header the device writes at DRIVER_OK
/// and the slot the client writes through the BAR2 fd it was sent are the
/// bytes of the caller's own file.
#[test]
fn bar2_is_the_given_fd() {
    let dir = std::env::temp_dir().join(format!("pvsched-bar2-fd-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let sock = dir.join("sock");
    let size = pvsched_device::PvschedDevice::region_bar_size(2);
    let file = pvsched_testkit::sealed_memfd(c"bar2-given", size);
    let fd = inheritable(&file);
    let mut child = serve(&sock, &["--bar2-fd", &fd.to_string()], None);
    let mut c = connect(&sock, &mut child);
    map_bars(&mut c);
    negotiate(&mut c, abi::F_DEVICE_REGION);
    driver_ok(&mut c);
    let map = map_bar2(&c);
    let at = abi::slot_offset(2, 1) as usize + 16;
    // SAFETY: `at + 4` lies inside the live BAR2 mapping (two slots).
    unsafe { std::ptr::write_volatile(map.as_ptr().add(at) as *mut u32, 0x5eed) };
    let mut bytes = vec![0u8; size as usize];
    use std::os::unix::fs::FileExt;
    file.read_exact_at(&mut bytes, 0).expect("read our memfd");
    let word = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
    assert_eq!(
        word(0),
        abi::REGION_MAGIC,
        "the device's header is not in our file"
    );
    assert_eq!(word(at), 0x5eed, "the client's write is not in our file");
    c.shutdown().expect("shutdown");
    drop(c);
    assert!(child.wait().expect("wait").success());
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// A BAR2 backing the device cannot keep (a memfd that could shrink, an fd
/// that is not open, a transport without BAR2) is refused before serving,
/// saying why, with exit code 1.
#[test]
fn a_bar2_fd_it_cannot_keep_is_refused() {
    let size = pvsched_device::PvschedDevice::region_bar_size(1);
    let unsealed = {
        // SAFETY: memfd_create with a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"bar2-unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        use std::os::fd::FromRawFd;
        // SAFETY: `fd` was just created and is owned by nobody else.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.set_len(size).expect("size");
        f
    };
    let fd = inheritable(&unsealed);
    let dir = std::env::temp_dir().join(format!("pvsched-bar2-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    for (args, want) in [
        (
            vec!["--transport", "vfio-user", "--bar2-fd", &*fd.to_string()],
            "F_SEAL_SHRINK",
        ),
        (
            vec!["--transport", "vfio-user", "--bar2-fd", "987"],
            "not an open fd",
        ),
        (
            vec!["--transport", "mpqemu", "--fd", "0", "--bar2-fd", "987"],
            "cannot map BAR2",
        ),
    ] {
        let sock = dir.join("sock");
        let _ = std::fs::remove_file(&sock);
        let out = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
            .args(&args)
            .args(["--vcpus", "1", "--socket"])
            .arg(&sock)
            .stdin(Stdio::null())
            .output()
            .expect("run pvsched-device");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!sock.exists(), "{args:?}: listened anyway");
    }
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// Every event the device has sent, read without blocking.
fn events_waiting(fd: &std::os::fd::OwnedFd) -> Vec<pvsched_device::event::DeviceEvent> {
    use std::os::fd::AsFd;
    pvsched_device::event::read_ready(fd.as_fd(), pvsched_device::event::MAX_EVENTS_PER_DRAIN)
        .expect("valid events")
}

/// `--event-fd`: the sandboxed device reports attach, kick and detach on
/// the SOCK_SEQPACKET socket it was given, each before its reply to the
/// access that caused it: once the client has the reply, the event is
/// there to read without waiting.
#[test]
fn events_arrive_before_the_reply() {
    use pvsched_device::RegionMode;
    use pvsched_device::event::{DetachReason, DeviceEvent};
    use std::os::fd::AsRawFd;
    let dir = std::env::temp_dir().join(format!("pvsched-events-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let sock = dir.join("sock");
    let (ours, theirs) = pvsched_util::seqpacket_pair().unwrap();
    // SAFETY: fcntl(F_SETFD) on an fd we own: the child inherits it.
    let rc = unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_SETFD, 0) };
    assert_eq!(rc, 0);
    let mut child = serve(
        &sock,
        &["--event-fd", &theirs.as_raw_fd().to_string()],
        None,
    );
    drop(theirs);
    let mut c = connect(&sock, &mut child);
    map_bars(&mut c);
    negotiate(&mut c, abi::F_DEVICE_REGION | abi::F_KICK);
    assert!(
        events_waiting(&ours).is_empty(),
        "no event before DRIVER_OK"
    );
    driver_ok(&mut c);
    let ev = events_waiting(&ours);
    assert_eq!(ev.len(), 1, "{ev:?}");
    let DeviceEvent::RegionAttached { region, registers } = &ev[0] else {
        panic!("{ev:?}");
    };
    assert_eq!(
        (region.mode, region.nr_vcpus, region.generation),
        (RegionMode::Device, 2, 1)
    );
    assert_eq!(
        region.size,
        pvsched_device::PvschedDevice::region_bar_size(2)
    );
    assert_ne!(registers.status & abi::STATUS_DRIVER_OK, 0);
    set_reg(&mut c, abi::REG_KICK, 1);
    assert_eq!(events_waiting(&ours), [DeviceEvent::Kick { slot: 1 }]);
    set_reg(&mut c, abi::REG_KICK, 9); // out of range: no event
    assert!(events_waiting(&ours).is_empty());
    set_reg(&mut c, abi::REG_STATUS, 0);
    let ev = events_waiting(&ours);
    assert!(
        matches!(
            ev.as_slice(),
            [DeviceEvent::RegionDetached {
                why: DetachReason::Reset,
                ..
            }]
        ),
        "{ev:?}"
    );
    c.shutdown().expect("shutdown");
    drop(c);
    assert!(child.wait().expect("wait").success(), "no SIGSYS");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// QEMU's proxy gets no event channel: `--event-fd` with mpqemu is refused.
#[test]
fn mpqemu_refuses_an_event_fd() {
    let out = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
        .args([
            "--transport",
            "mpqemu",
            "--fd",
            "0",
            "--vcpus",
            "1",
            "--event-fd",
            "5",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run pvsched-device");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--event-fd"), "{err}");
}
