//! The guest's and firmware's side of the pvsched device, driven through
//! the `vfio_user` crate's own `Client`: shared by the vfio-user tests and
//! the `vfio_user_rtt` example (`#[path]`-included, so not every user calls
//! every function).

#![allow(dead_code)]

use pvsched_abi as abi;
use std::path::Path;
use std::process::Child;
use std::time::Duration;
use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_user::Client;
use vm_memory::{FileOffset, MmapRegion};

/// Where firmware places BAR0 and BAR2.
pub const BAR0_ADDR: u32 = 0xfebf_0000;
/// Where firmware places BAR2.
pub const BAR2_ADDR: u32 = 0xc000_0000;

/// Read config dword `dword`.
pub fn cfg_read(c: &mut Client, dword: u32) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(VFIO_PCI_CONFIG_REGION_INDEX, u64::from(dword) * 4, &mut b)
        .expect("config read");
    u32::from_le_bytes(b)
}

/// Write config dword `dword`.
pub fn cfg_write(c: &mut Client, dword: u32, v: u32) {
    c.region_write(
        VFIO_PCI_CONFIG_REGION_INDEX,
        u64::from(dword) * 4,
        &v.to_le_bytes(),
    )
    .expect("config write");
}

/// Read BAR0 register `off`.
pub fn reg(c: &mut Client, off: u32) -> u32 {
    let mut b = [0u8; 4];
    c.region_read(u32::from(abi::REG_BAR), u64::from(off), &mut b)
        .expect("BAR0 read");
    u32::from_le_bytes(b)
}

/// Write BAR0 register `off`.
pub fn set_reg(c: &mut Client, off: u32, v: u32) {
    c.region_write(u32::from(abi::REG_BAR), u64::from(off), &v.to_le_bytes())
        .expect("BAR0 write");
}

/// Program BAR0 and BAR2 and enable memory decoding, as firmware does.
pub fn map_bars(c: &mut Client) {
    cfg_write(c, 4, BAR0_ADDR);
    cfg_write(c, 4 + u32::from(abi::REGION_BAR), BAR2_ADDR);
    let cmd = cfg_read(c, 1) & 0xffff;
    cfg_write(c, 1, cmd | 0x2);
}

/// The driver's negotiation up to FEATURES_OK.
pub fn negotiate(c: &mut Client, features: u64) {
    set_reg(c, abi::REG_STATUS, 0);
    assert_eq!(reg(c, abi::REG_MAGIC), abi::MAGIC);
    set_reg(c, abi::REG_STATUS, abi::STATUS_ACKNOWLEDGE);
    set_reg(
        c,
        abi::REG_STATUS,
        abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER,
    );
    set_reg(c, abi::REG_DRV_FEATURES_LO, features as u32);
    set_reg(c, abi::REG_DRV_FEATURES_HI, (features >> 32) as u32);
    set_reg(
        c,
        abi::REG_STATUS,
        abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER | abi::STATUS_FEATURES_OK,
    );
    set_reg(c, abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
}

/// Set DRIVER_OK; returns STATUS as read back.
pub fn driver_ok(c: &mut Client) -> u32 {
    let s = reg(c, abi::REG_STATUS);
    set_reg(c, abi::REG_STATUS, s | abi::STATUS_DRIVER_OK);
    reg(c, abi::REG_STATUS)
}

/// Map BAR2 through the fd the client received with its region info.
pub fn map_bar2(c: &Client) -> MmapRegion<()> {
    let bar2 = c.region(u32::from(abi::REGION_BAR)).expect("BAR2");
    let fo = bar2.file_offset.as_ref().expect("BAR2 fd");
    MmapRegion::<()>::from_file(
        FileOffset::new(fo.file().try_clone().expect("dup"), fo.start()),
        bar2.size as usize,
    )
    .expect("mmap BAR2")
}

/// Connect once the device process has bound `path` (bounded wait, not a
/// timing assertion); panics if it exits first.
pub fn connect(path: &Path, child: &mut Child) -> Client {
    for _ in 0..500 {
        if path.exists() {
            return Client::new(path).expect("vfio-user client connects");
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("the device process exited early with {status}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the device process never bound {}", path.display());
}
