//! The `pvsched-device` binary as a vfio-user server in its own process:
//! the crate's `Client` connects to `--socket`, runs the device-region
//! handshake, maps BAR2 through the fd it was sent and writes a slot; the
//! process's JSON slot dump shows what the guest wrote, with no socket
//! message per update.

use pvsched_abi as abi;
use std::path::Path;
use std::process::{Command, Stdio};
use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_user::Client;
use vm_memory::{FileOffset, MmapRegion};

const CONFIG: u32 = VFIO_PCI_CONFIG_REGION_INDEX;

fn reg(c: &mut Client, off: u32) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(u32::from(abi::REG_BAR), u64::from(off), &mut b)
        .expect("BAR0 read");
    u32::from_le_bytes(b)
}

fn set_reg(c: &mut Client, off: u32, v: u32) {
    c.region_write(u32::from(abi::REG_BAR), u64::from(off), &v.to_le_bytes())
        .expect("BAR0 write");
}

fn cfg_write(c: &mut Client, dword: u32, v: u32) {
    c.region_write(CONFIG, u64::from(dword) * 4, &v.to_le_bytes())
        .expect("config write");
}

/// Connect once the child has bound the socket (bounded wait, not a timing
/// assertion).
fn connect(path: &Path, child: &mut std::process::Child) -> Client {
    for _ in 0..500 {
        if path.exists() {
            return Client::new(path).expect("vfio-user client connects");
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("pvsched-device exited early with {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("pvsched-device never bound {}", path.display());
}

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

    // Firmware: place BAR0 and BAR2, enable memory decoding.
    cfg_write(&mut c, 4, 0xfebf_0000);
    cfg_write(&mut c, 4 + u32::from(abi::REGION_BAR), 0xc000_0000);
    cfg_write(&mut c, 1, 0x2);
    // Driver: device-region handshake.
    assert_eq!(reg(&mut c, abi::REG_MAGIC), abi::MAGIC);
    set_reg(&mut c, abi::REG_STATUS, abi::STATUS_ACKNOWLEDGE);
    set_reg(
        &mut c,
        abi::REG_STATUS,
        abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER,
    );
    set_reg(
        &mut c,
        abi::REG_DRV_FEATURES_LO,
        abi::F_DEVICE_REGION as u32,
    );
    let s = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER | abi::STATUS_FEATURES_OK;
    set_reg(&mut c, abi::REG_STATUS, s);
    set_reg(&mut c, abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
    set_reg(&mut c, abi::REG_STATUS, s | abi::STATUS_DRIVER_OK);
    assert_eq!(reg(&mut c, abi::REG_STATUS), s | abi::STATUS_DRIVER_OK);

    // The guest reports FIFO 8 in slot 1 (APIC ID 2) through the mapping.
    let bar2 = c.region(u32::from(abi::REGION_BAR)).expect("BAR2");
    let fo = bar2.file_offset.as_ref().expect("BAR2 fd");
    let map = MmapRegion::<()>::from_file(
        FileOffset::new(fo.file().try_clone().expect("dup"), fo.start()),
        bar2.size as usize,
    )
    .expect("mmap BAR2");
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
