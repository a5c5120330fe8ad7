//! The `pvsched-device` binary end to end: a socket fd inherited the way
//! QEMU's peer gets it, a scripted proxy session, and the JSON slot dump the
//! Linux-guest harness asserts on.

use crate::common;
use crate::slot_dump_check;

use common::{Qemu, REGION_GPA};
use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use pvsched_abi as abi;
use slot_dump_check::{FIFO8_WRITES, assert_fifo8_seen_in_slot1};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};

fn tmp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pvsched-bin-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("tmp dir");
    d
}

#[test]
fn serves_qemu_and_dumps_slots() {
    let dir = tmp_dir("serve");
    let dump = dir.join("slots.json");
    let (q, d) = UnixStream::pair().expect("socketpair");
    // The child inherits `d` (close-on-exec cleared), as QEMU's peer would.
    fcntl(d.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::empty())).expect("clear cloexec");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
        .args([
            "--transport",
            "mpqemu",
            "--fd",
            &d.as_raw_fd().to_string(),
            "--vcpus",
            "2",
        ])
        .args(["--apic-ids", "0,2", "--dump-ms", "10", "--dump-slots"])
        .arg(&dump)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn pvsched-device");
    drop(d);

    let mut qemu = Qemu::connect(q);
    qemu.sync_sysmem();
    qemu.realize();
    qemu.program_bar0();
    assert_eq!(
        qemu.handshake(REGION_GPA) & abi::STATUS_DRIVER_OK,
        abi::STATUS_DRIVER_OK
    );
    // The guest reports FIFO 8 in slot 1 (APIC ID 2).
    let slot1 = REGION_GPA + u64::from(abi::slots_offset(2)) + u64::from(abi::SLOT_SIZE);
    for (off, v) in FIFO8_WRITES {
        qemu.ram
            .write_all_at(&v.to_le_bytes(), slot1 + off)
            .expect("pwrite");
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    drop(qemu);
    assert_fifo8_seen_in_slot1(&mut child, &dump, &dir);
}

#[test]
fn rejects_an_fd_that_is_not_a_socket() {
    let out = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
        .args(["--transport", "mpqemu", "--fd", "0", "--vcpus", "1"])
        .stdin(Stdio::null())
        .output()
        .expect("run pvsched-device");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a socket"), "{err}");
}
