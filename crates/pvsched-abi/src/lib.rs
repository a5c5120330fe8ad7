//! pvsched guest/host ABI, version 1: the Rust mirror of `include/pvsched_abi.h`.
//!
//! The C header is the definition; this crate restates it for Rust and the
//! test `tests/c_layout.rs` compiles a C program against the header and
//! compares the size and offset of every field and the value of every
//! constant with what is declared here. `docs/abi.md` is the prose spec.
//!
//! All shared structs are `#[repr(C)]`, have no implicit padding (checked at
//! compile time below) and contain only integers, so every bit pattern is a
//! valid value: the guest may write anything and reading it is still sound.
//!
//! ```
//! use pvsched_abi::{region_size, slots_offset, SLOT_SIZE};
//! // Two vCPUs: 64-byte header + 8-byte APIC table, rounded to a cache line,
//! // then two 128-byte slots; the region is rounded up to a 4 KiB page.
//! assert_eq!(slots_offset(2), 128);
//! assert_eq!(region_size(2), 4096);
//! assert_eq!(SLOT_SIZE, 128);
//! ```

#![no_std]

use core::mem::{offset_of, size_of};

// ---------------------------------------------------------------------------
// Versioning
// ---------------------------------------------------------------------------

/// ABI major version. A major mismatch is refused at DRIVER_OK.
pub const ABI_MAJOR: u32 = 1;
/// ABI minor version. Minor additions are announced by feature bits.
pub const ABI_MINOR: u32 = 6;
/// `(major << 16) | minor`, as found in the VERSION register and region header.
pub const ABI_VERSION: u32 = (ABI_MAJOR << 16) | ABI_MINOR;

/// Major part of a packed version word.
pub const fn version_major(v: u32) -> u32 {
    (v >> 16) & 0xffff
}

/// Minor part of a packed version word.
pub const fn version_minor(v: u32) -> u32 {
    v & 0xffff
}

// ---------------------------------------------------------------------------
// PCI identity
// ---------------------------------------------------------------------------

/// Default PCI vendor ID (development default; override when shipping).
pub const PCI_VENDOR_ID: u16 = 0x5056;
/// Default PCI device ID.
pub const PCI_DEVICE_ID: u16 = 0x5c4e;
/// Default PCI subsystem vendor ID.
pub const PCI_SUBSYS_VENDOR_ID: u16 = 0x5056;
/// Default PCI subsystem ID.
pub const PCI_SUBSYS_ID: u16 = 0x0001;
/// PCI revision ID.
pub const PCI_REVISION: u8 = 0x01;
/// Class code: base 0x08 (system peripheral), subclass 0x80 (other), prog-if 0.
pub const PCI_CLASS: u32 = 0x08_80_00;

/// BAR index of the register file.
pub const REG_BAR: u8 = 0;
/// Size of the register BAR in bytes.
pub const REG_BAR_SIZE: u32 = 0x1000;
/// BAR index of the device region (only with [`F_DEVICE_REGION`]).
pub const REGION_BAR: u8 = 2;

// ---------------------------------------------------------------------------
// BAR0 registers
// ---------------------------------------------------------------------------

/// RO: [`MAGIC`].
pub const REG_MAGIC: u32 = 0x00;
/// RO: the device's [`ABI_VERSION`].
pub const REG_VERSION: u32 = 0x04;
/// RO: device features, bits 0..31.
pub const REG_DEV_FEATURES_LO: u32 = 0x08;
/// RO: device features, bits 32..63.
pub const REG_DEV_FEATURES_HI: u32 = 0x0c;
/// RW: driver features, bits 0..31.
pub const REG_DRV_FEATURES_LO: u32 = 0x10;
/// RW: driver features, bits 32..63.
pub const REG_DRV_FEATURES_HI: u32 = 0x14;
/// RO: number of slots in the region.
pub const REG_NR_VCPUS: u32 = 0x18;
/// RO: [`SLOT_SIZE`].
pub const REG_SLOT_SIZE: u32 = 0x1c;
/// RW: `STATUS_*` bits; writing 0 resets the device.
pub const REG_STATUS: u32 = 0x20;
/// RO: `ERR_*` code of the last refusal.
pub const REG_ERROR: u32 = 0x24;
/// RW: guest region GPA, bits 0..31.
pub const REG_SHM_GPA_LO: u32 = 0x28;
/// RW: guest region GPA, bits 32..63.
pub const REG_SHM_GPA_HI: u32 = 0x2c;
/// RW: guest region size in bytes.
pub const REG_SHM_SIZE: u32 = 0x30;
/// RO: bytes the layout needs ([`region_size`]).
pub const REG_REGION_SIZE: u32 = 0x34;
/// WO: doorbell; the value is a slot index.
pub const REG_KICK: u32 = 0x38;
/// RO: incremented at each successful DRIVER_OK.
pub const REG_GENERATION: u32 = 0x3c;
/// RW: the [`ABI_VERSION`] the driver speaks.
pub const REG_DRIVER_VERSION: u32 = 0x40;
/// First offset past the defined registers.
pub const REG_END: u32 = 0x44;

/// Value of the MAGIC register: "PVSC" as little-endian bytes.
pub const MAGIC: u32 = 0x4353_5650;

// ---------------------------------------------------------------------------
// Features
// ---------------------------------------------------------------------------

/// The region is BAR2 (device memory).
pub const F_DEVICE_REGION: u64 = 1 << 0;
/// The region is guest RAM at SHM_GPA.
pub const F_GUEST_REGION: u64 = 1 << 1;
/// The host honours `slot.wait_on`.
pub const F_WAIT_ON: u64 = 1 << 2;
/// The KICK register is wired to the policy.
pub const F_KICK: u64 = 1 << 3;
/// `slot.flags` describes the running task ([`TASK_F_KTHREAD`]); ABI 1.1.
pub const F_TASK_FLAGS: u64 = 1 << 4;
/// `slot.wait_on` may be [`WAIT_ANY`] (a vCPU spinning on a contended lock);
/// ABI 1.2.
pub const F_LOCK_WAIT: u64 = 1 << 5;
/// `slot.wakes` and `slot.waits` count how much the vCPUs hand work to and
/// wait for each other; ABI 1.5.
pub const F_SYNC_COUNTS: u64 = 1 << 6;
/// Every feature bit ABI v1 defines.
pub const F_ALL: u64 = F_DEVICE_REGION
    | F_GUEST_REGION
    | F_WAIT_ON
    | F_KICK
    | F_TASK_FLAGS
    | F_LOCK_WAIT
    | F_SYNC_COUNTS;

// ---------------------------------------------------------------------------
// STATUS: virtio's device status values, taken from virtio-bindings.
// ---------------------------------------------------------------------------

use virtio_bindings::virtio_config as vc;

/// Writing this value to STATUS resets the device.
pub const STATUS_RESET: u32 = 0;
/// The driver has seen the device.
pub const STATUS_ACKNOWLEDGE: u32 = vc::VIRTIO_CONFIG_S_ACKNOWLEDGE;
/// The driver knows how to drive the device.
pub const STATUS_DRIVER: u32 = vc::VIRTIO_CONFIG_S_DRIVER;
/// The region is attached and the device is live.
pub const STATUS_DRIVER_OK: u32 = vc::VIRTIO_CONFIG_S_DRIVER_OK;
/// Feature negotiation is complete.
pub const STATUS_FEATURES_OK: u32 = vc::VIRTIO_CONFIG_S_FEATURES_OK;
/// The device hit an error it cannot recover from without a reset.
pub const STATUS_DEVICE_NEEDS_RESET: u32 = vc::VIRTIO_CONFIG_S_NEEDS_RESET;
/// The device refused the driver's request; ERROR says why.
pub const STATUS_FAILED: u32 = vc::VIRTIO_CONFIG_S_FAILED;

// ---------------------------------------------------------------------------
// ERROR codes
// ---------------------------------------------------------------------------

/// No error.
pub const ERR_NONE: u32 = 0;
/// A status bit was set out of order.
pub const ERR_BAD_SEQUENCE: u32 = 1;
/// The driver asked for a feature bit the device does not offer.
pub const ERR_FEATURES_UNSUPPORTED: u32 = 2;
/// Not exactly one region mode was selected.
pub const ERR_NO_REGION_MODE: u32 = 3;
/// DRIVER_VERSION major differs from the device's major.
pub const ERR_VERSION_MISMATCH: u32 = 4;
/// SHM_SIZE is zero.
pub const ERR_REGION_ZERO_SIZE: u32 = 5;
/// GPA or size is not 4 KiB aligned.
pub const ERR_REGION_UNALIGNED: u32 = 6;
/// GPA + size overflows 64 bits.
pub const ERR_REGION_WRAPS: u32 = 7;
/// The range is not wholly inside one guest RAM range.
pub const ERR_REGION_OUTSIDE_RAM: u32 = 8;
/// Size is below REGION_SIZE.
pub const ERR_REGION_TOO_SMALL: u32 = 9;
/// SHM_* was written after DRIVER_OK.
pub const ERR_REGION_CHANGED: u32 = 10;
/// Device region: BAR2 is not decoded (memory space disabled or unassigned).
pub const ERR_REGION_UNMAPPED: u32 = 11;
/// Device region: the embedder supplied no backing memory.
pub const ERR_REGION_UNAVAILABLE: u32 = 12;
/// The device back end is gone; reset to retry.
pub const ERR_DEVICE_FAILED: u32 = 13;
/// Highest defined error code.
pub const ERR_MAX: u32 = 13;

// ---------------------------------------------------------------------------
// Region layout
// ---------------------------------------------------------------------------

/// Region header magic: "PVSR" as little-endian bytes.
pub const REGION_MAGIC: u32 = 0x5253_5650;
/// Largest number of vCPUs a region can describe.
pub const MAX_VCPUS: u32 = 1024;
/// Cache line size the layout aligns to.
pub const CACHELINE: u32 = 64;
/// Page size the region is rounded to and aligned on.
pub const PAGE_SIZE: u32 = 4096;
/// Bytes per vCPU slot.
pub const SLOT_SIZE: u32 = 128;
/// Bytes of the region header.
pub const HEADER_SIZE: u32 = 64;
/// Byte offset of the `u32 apic_id[nr_vcpus]` table.
pub const APIC_TABLE_OFFSET: u32 = HEADER_SIZE;

/// `host_flags` bit: a host policy reads the slots.
pub const HOST_F_POLICY_ACTIVE: u32 = 1 << 0;

/// `kern_cs` bit: the vCPU runs an NMI handler.
pub const CS_NMI: u32 = 1 << 0;
/// `kern_cs` bit: the vCPU runs a hard interrupt handler.
pub const CS_HARDIRQ: u32 = 1 << 1;
/// `kern_cs` bit: the vCPU runs softirq work.
pub const CS_SOFTIRQ: u32 = 1 << 2;
/// `kern_cs` bit: preemption is disabled (spinlock held).
pub const CS_PREEMPT_OFF: u32 = 1 << 3;
/// Every defined `kern_cs` bit; others are reserved and ignored.
pub const CS_ALL: u32 = CS_NMI | CS_HARDIRQ | CS_SOFTIRQ | CS_PREEMPT_OFF;

/// `flags` bit (with [`F_TASK_FLAGS`]): the running task is a kernel thread.
pub const TASK_F_KTHREAD: u32 = 1 << 0;
/// `flags` bit (with [`F_TASK_FLAGS`], ABI 1.2): the CPU runs its idle task
/// (it is about to halt, or halted).
pub const TASK_F_IDLE: u32 = 1 << 1;
/// `flags` bit (with [`F_TASK_FLAGS`] and [`TASK_F_IDLE`], ABI 1.4): the
/// CPU is idle and `policy`, `nice` and `rt_prio` are those of the user RT
/// task it ran last, asleep until it runs there again (a periodic RT task
/// between two runs: its vCPU stays latency-sensitive while it halts).
pub const TASK_F_RT_SLEEPER: u32 = 1 << 2;
/// Every defined `flags` bit; others are reserved and ignored.
pub const TASK_F_ALL: u32 = TASK_F_KTHREAD | TASK_F_IDLE | TASK_F_RT_SLEEPER;

/// `policy`: SCHED_NORMAL.
pub const POLICY_NORMAL: u32 = 0;
/// `policy`: SCHED_FIFO.
pub const POLICY_FIFO: u32 = 1;
/// `policy`: SCHED_RR.
pub const POLICY_RR: u32 = 2;
/// `policy`: SCHED_BATCH.
pub const POLICY_BATCH: u32 = 3;
/// `policy`: SCHED_IDLE.
pub const POLICY_IDLE: u32 = 5;
/// `policy`: SCHED_DEADLINE.
pub const POLICY_DEADLINE: u32 = 6;

/// Lowest nice value.
pub const NICE_MIN: i32 = -20;
/// Highest nice value.
pub const NICE_MAX: i32 = 19;
/// Highest RT priority.
pub const RT_PRIO_MAX: u32 = 99;

/// `wait_on` value meaning "not waiting"; otherwise slot index + 1.
pub const WAIT_NONE: u32 = 0;
/// `wait_on` with [`F_LOCK_WAIT`]: the vCPU spins on a contended lock whose
/// holder is some other vCPU of the VM, which one is not known.
pub const WAIT_ANY: u32 = 0xffff_ffff;

/// `vcpu_state`: not known yet.
pub const VCPU_UNKNOWN: u32 = 0;
/// `vcpu_state`: running on a host CPU.
pub const VCPU_RUNNING: u32 = 1;
/// `vcpu_state`: runnable but preempted by the host.
pub const VCPU_PREEMPTED: u32 = 2;
/// `vcpu_state`: halted, waiting for an interrupt.
pub const VCPU_HALTED: u32 = 3;

/// `boost`: none applied.
pub const BOOST_NONE: u32 = 0;
/// `boost`: a nice boost is applied.
pub const BOOST_NICE: u32 = 1;
/// `boost`: an RT boost is applied.
pub const BOOST_RT: u32 = 2;

/// Region header, written by the device at DRIVER_OK; read-only for the guest.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionHeader {
    /// [`REGION_MAGIC`].
    pub magic: u32,
    /// [`ABI_VERSION`].
    pub version: u32,
    /// Slots in this region.
    pub nr_vcpus: u32,
    /// [`SLOT_SIZE`].
    pub slot_size: u32,
    /// [`HEADER_SIZE`].
    pub header_size: u32,
    /// Byte offset of the APIC-ID table.
    pub apic_table_offset: u32,
    /// Byte offset of slot 0.
    pub slots_offset: u32,
    /// GENERATION register value at attach.
    pub generation: u32,
    /// `HOST_F_*` bits.
    pub host_flags: u32,
    /// Low 32 bits of the features the driver set at FEATURES_OK (1.3; 0
    /// from an older device). For the host policy: the guest can
    /// overwrite it, so it only selects behaviour within the VM's caps.
    pub driver_features_lo: u32,
    /// High 32 bits of the same.
    pub driver_features_hi: u32,
    /// The DRIVER_VERSION register as the driver wrote it, the ABI it
    /// speaks (1.6; 0 from an older device). As informative as the
    /// features: the guest can overwrite it.
    pub driver_version: u32,
    /// Zero.
    pub reserved: [u32; 4],
}

/// Guest-written half of a slot: one cache line only the guest writes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotGuest {
    /// Sequence counter, odd while the guest writes.
    pub seq: u32,
    /// `CS_*` bits.
    pub kern_cs: u32,
    /// `POLICY_*` of the running task.
    pub policy: u32,
    /// Nice value, -20..19.
    pub nice: i32,
    /// RT priority, 1..99 for FIFO/RR, else 0.
    pub rt_prio: u32,
    /// Slot index + 1 of the vCPU waited for, [`WAIT_NONE`] or [`WAIT_ANY`].
    pub wait_on: u32,
    /// `TASK_F_*` bits of the running task with [`F_TASK_FLAGS`], else 0.
    pub flags: u32,
    /// Reserved, zero.
    pub reserved0: u32,
    /// Completed updates (informational).
    pub updates: u64,
    /// With [`F_SYNC_COUNTS`]: wake-ups of a task that last ran on another
    /// vCPU, since the driver attached (written outside the seq protocol).
    pub wakes: u64,
    /// With [`F_SYNC_COUNTS`]: waits for another vCPU (`wait_on` set).
    pub waits: u64,
    /// Reserved, zero.
    pub reserved: [u32; 2],
}

/// Host-written half of a slot: one cache line only the host writes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotHost {
    /// Sequence counter, odd while the host writes.
    pub seq: u32,
    /// `VCPU_*` state.
    pub vcpu_state: u32,
    /// `BOOST_*` currently applied.
    pub boost: u32,
    /// RT priority or nice value of the boost.
    pub boost_prio: i32,
    /// 1 while throttled.
    pub throttled: u32,
    /// Directed-yield slot: slot index + 1, or 0.
    pub yield_target: u32,
    /// Boosts applied since attach.
    pub boosts: u64,
    /// Throttles since attach.
    pub throttles: u64,
    /// Total nanoseconds spent boosted.
    pub boosted_ns: u64,
    /// Reserved, zero.
    pub reserved: [u32; 4],
}

/// A per-vCPU slot: two cache lines, one per writer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    /// Written by the guest only.
    pub guest: SlotGuest,
    /// Written by the host only.
    pub host: SlotHost,
}

/// Byte offset of slot 0 in a region of `nr_vcpus` slots.
pub const fn slots_offset(nr_vcpus: u32) -> u32 {
    let end = APIC_TABLE_OFFSET + 4 * nr_vcpus;
    (end + CACHELINE - 1) & !(CACHELINE - 1)
}

/// Bytes a region of `nr_vcpus` slots needs (the REGION_SIZE register).
pub const fn region_size(nr_vcpus: u32) -> u32 {
    let end = slots_offset(nr_vcpus) + SLOT_SIZE * nr_vcpus;
    (end + PAGE_SIZE - 1) & !(PAGE_SIZE - 1)
}

/// Byte offset of slot `index` in a region of `nr_vcpus` slots.
pub const fn slot_offset(nr_vcpus: u32, index: u32) -> u32 {
    slots_offset(nr_vcpus) + SLOT_SIZE * index
}

// Compile-time layout checks: sizes and the absence of implicit padding
// (the sum of field sizes equals the struct size).
const _: () = {
    assert!(size_of::<RegionHeader>() == HEADER_SIZE as usize);
    assert!(size_of::<RegionHeader>() == 9 * 4 + 7 * 4);
    assert!(size_of::<SlotGuest>() == CACHELINE as usize);
    assert!(size_of::<SlotGuest>() == 8 * 4 + 3 * 8 + 2 * 4);
    assert!(size_of::<SlotHost>() == CACHELINE as usize);
    assert!(size_of::<SlotHost>() == 6 * 4 + 3 * 8 + 4 * 4);
    assert!(size_of::<Slot>() == SLOT_SIZE as usize);
    assert!(offset_of!(Slot, host) == CACHELINE as usize);
    assert!(offset_of!(SlotGuest, updates) % 8 == 0);
    assert!(offset_of!(SlotGuest, wakes) % 8 == 0);
    assert!(offset_of!(SlotHost, boosts) % 8 == 0);
    // The largest region still fits the 32-bit REGION_SIZE register.
    assert!(region_size(MAX_VCPUS) as u64 <= u32::MAX as u64);
    // virtio-bindings carries virtio's status values.
    assert!(STATUS_ACKNOWLEDGE == 0x01);
    assert!(STATUS_DRIVER == 0x02);
    assert!(STATUS_DRIVER_OK == 0x04);
    assert!(STATUS_FEATURES_OK == 0x08);
    assert!(STATUS_DEVICE_NEEDS_RESET == 0x40);
    assert!(STATUS_FAILED == 0x80);
};

pub mod seq;

#[cfg(feature = "vm-memory")]
mod byte_valued {
    use super::{RegionHeader, Slot, SlotGuest, SlotHost};
    use vm_memory::ByteValued;

    // SAFETY: RegionHeader is #[repr(C)], made only of u32 fields and a u32
    // array, has no implicit padding (size checked at compile time above),
    // and every bit pattern is a valid value.
    unsafe impl ByteValued for RegionHeader {}
    // SAFETY: SlotGuest is #[repr(C)], made only of integer fields with
    // natural alignment, has no implicit padding (checked above), and every
    // bit pattern is a valid value.
    unsafe impl ByteValued for SlotGuest {}
    // SAFETY: SlotHost is #[repr(C)], made only of integer fields with
    // natural alignment, has no implicit padding (checked above), and every
    // bit pattern is a valid value.
    unsafe impl ByteValued for SlotHost {}
    // SAFETY: Slot is #[repr(C)] of two ByteValued 64-byte halves with no
    // padding between or after them (checked above).
    unsafe impl ByteValued for Slot {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_helpers_match_formula() {
        for n in 1..=MAX_VCPUS {
            let so = slots_offset(n);
            assert_eq!(so % CACHELINE, 0);
            assert!(so >= APIC_TABLE_OFFSET + 4 * n);
            assert!(so < APIC_TABLE_OFFSET + 4 * n + CACHELINE);
            let rs = region_size(n);
            assert_eq!(rs % PAGE_SIZE, 0);
            assert!(rs >= slot_offset(n, n));
        }
    }

    #[test]
    fn version_split() {
        assert_eq!(version_major(ABI_VERSION), ABI_MAJOR);
        assert_eq!(version_minor(ABI_VERSION), ABI_MINOR);
    }
}
