//! The `pvsched-device` binary as a vfio-user server in its own process:
//! the crate's `Client` connects to `--socket`, runs the device-region
//! handshake, maps BAR2 through the fd it was sent and writes a slot; the
//! process's JSON slot dump shows what the guest wrote, with no socket
//! message per update.

#[path = "support/vfio_client.rs"]
mod vfio_client;

use pvsched_abi as abi;
use std::process::{Command, Stdio};
use vfio_client::{connect, driver_ok, map_bar2, map_bars, negotiate};

#[test]
fn serves_vfio_user_client_in_device_region_mode() {
    let dir = std::env::temp_dir().join(format!("pvsched-vfio-user-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let sock = dir.join("sock");
    let dump = dir.join("slots.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pvsched-device"))
        .args(["--transport", "vfio-user", "--vcpus", "2", "--socket"])
        .arg(&sock)
        .args(["--apic-ids", "0,2", "--dump-ms", "10", "--dump-slots"])
        .arg(&dump)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn pvsched-device");
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
    for (off, v) in [(8u64, abi::POLICY_FIFO), (16, 8), (0, 2)] {
        let at = usize::try_from(slot1 + off).expect("offset");
        assert!(at + 4 <= map.size());
        // SAFETY: `at + 4` lies inside the live mapping `map`; a 4-byte
        // volatile store to shared memory the device only reads.
        unsafe { std::ptr::write_volatile(map.as_ptr().add(at) as *mut u32, v) };
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    c.shutdown().expect("shutdown");
    drop(c);
    let status = child.wait().expect("wait");
    assert!(status.success(), "pvsched-device exited with {status}");

    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&dump).expect("dump written")).expect("json");
    assert_eq!(v["device"]["generation"], 1);
    assert_eq!(v["device"]["disconnected"], true);
    assert_eq!(v["header"][0], abi::REGION_MAGIC);
    assert_eq!(v["slots"][1]["apic_id"], 2);
    assert!(
        v["slots"][1]["seen"]["1/8/0"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
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
