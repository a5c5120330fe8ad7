//! The guest's and firmware's side of the pvsched device, driven through
//! the `vfio_user` crate's own `Client`: shared by the vfio-user tests and
//! the `vfio_user_rtt` example (`#[path]`-included, so not every user calls
//! every function).

#![allow(dead_code)]

use pvsched_abi as abi;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};
use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_user::Client;
use vm_memory::{FileOffset, MmapRegion};

/// Where firmware places BAR0 and BAR2.
pub const BAR0_ADDR: u32 = 0xfebf_0000;
/// Where firmware places BAR2.
pub const BAR2_ADDR: u32 = 0xc000_0000;

/// Write slot `index`'s guest half (of a region for `nr_vcpus` vCPUs at
/// `base`) with the sequence protocol ([`abi::seq`]), as the guest driver
/// does.
///
/// # Safety
/// `base` must point to a mapped, writable, 4-byte aligned region of at
/// least `region_size(nr_vcpus)` bytes that stays mapped during the call.
pub unsafe fn write_guest_slot(base: *mut u8, nr_vcpus: u32, index: u32, nice: i32, updates: u64) {
    let len = abi::region_size(nr_vcpus) as usize;
    // SAFETY: the caller guarantees the mapping for `len` bytes.
    let words = unsafe { abi::seq::RawWords::new(base, len) };
    let g = abi::SlotGuest {
        nice,
        policy: abi::POLICY_NORMAL,
        updates,
        ..Default::default()
    };
    assert!(abi::seq::write_guest(&words, nr_vcpus, index, &g));
}

/// Round-trip times of `n` (> 0) BAR0 reads of MAGIC, in µs.
pub struct Rtt {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Slowest read.
    pub max_us: f64,
}

/// Time `n` (> 0) BAR0 reads of MAGIC over the socket (each checked).
pub fn bar0_read_rtt(c: &mut Client, n: usize) -> Rtt {
    let mut ns = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let v = reg(c, abi::REG_MAGIC);
        ns.push(t.elapsed().as_nanos() as u64);
        assert_eq!(v, abi::MAGIC);
    }
    ns.sort_unstable();
    let us = |q: f64| ns[((n as f64 * q) as usize).min(n - 1)] as f64 / 1000.0;
    Rtt {
        p50_us: us(0.50),
        p99_us: us(0.99),
        max_us: us(1.0),
    }
}

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
