//! The end of the device-binary tests: a guest wrote FIFO 8 into slot 1
//! (APIC ID 2) and the client went away; the device process must exit 0
//! and its JSON dump must show it (shared by `device_binary.rs` and
//! `vfio_user_binary.rs`).

use pvsched_abi as abi;
use std::path::Path;
use std::process::Child;

/// The guest-half words a guest writes to say "FIFO 8": `(byte offset in
/// the slot, value)`, `seq` last (even: published).
pub const FIFO8_WRITES: [(u64, u32); 3] = [(8, abi::POLICY_FIFO), (16, 8), (0, 2)];

/// Wait for `child` to exit 0, then check `dump`: one DRIVER_OK, the
/// client disconnected, the header's magic, slot 1 at APIC ID 2 seen at
/// FIFO 8. Removes `dir`.
pub fn assert_fifo8_seen_in_slot1(child: &mut Child, dump: &Path, dir: &Path) {
    let status = child.wait().expect("wait");
    assert!(status.success(), "pvsched-device exited with {status}");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dump).expect("dump written")).expect("json");
    assert_eq!(v["device"]["generation"], 1);
    assert_eq!(v["device"]["disconnected"], true);
    assert_eq!(v["header"][0], abi::REGION_MAGIC);
    assert_eq!(v["slots"][1]["apic_id"], 2);
    assert!(
        v["slots"][1]["seen"]["1/8/0"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
    std::fs::remove_dir_all(dir).expect("cleanup");
}
