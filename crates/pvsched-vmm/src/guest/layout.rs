//! Guest-physical memory map of the test guest and its boot parameter block.
//!
//! The VMM plays firmware: it writes the GDT, the IDT and the parameter
//! block below into guest RAM before the first vCPU runs, then starts every
//! vCPU in 32-bit protected mode at [`CODE_ADDR`] with flat segments.
//!
//! ```text
//! 0x0000_0500  GDT (null, code 0x08, data 0x10, TSS 0x18)
//! 0x0000_0800  IDT (256 interrupt gates)
//! 0x0000_1000  parameter block (PARAM_* offsets), shared by all vCPUs
//! 0x0000_2000  guest code
//! 0x0001_0000  vCPU stacks, STACK_SIZE each
//! 0x0010_0000  guest-region mode: the region the guest hands to the device
//! 0xC000_0000  32-bit MMIO hole: BARs assigned by the VMM
//! ```

/// GDT base (the VMM writes it).
pub const GDT_ADDR: u64 = 0x500;
/// IDT base (the VMM writes it).
pub const IDT_ADDR: u64 = 0x800;
/// Number of IDT entries.
pub const IDT_ENTRIES: u64 = 256;
/// Parameter block base.
pub const PARAMS_ADDR: u64 = 0x1000;
/// Code load address and entry point.
pub const CODE_ADDR: u64 = 0x2000;
/// Largest code size the layout leaves room for.
pub const CODE_MAX: u64 = 0x1_0000 - CODE_ADDR;
/// Base of the first vCPU stack.
pub const STACKS_ADDR: u64 = 0x1_0000;
/// Bytes of stack per vCPU.
pub const STACK_SIZE: u64 = 0x1000;
/// Most vCPUs the test guest supports (parameter tables are this long).
pub const MAX_GUEST_VCPUS: u32 = 64;
/// Default guest-physical address of the guest-region mode region.
pub const GUEST_REGION_GPA: u64 = 0x10_0000;
/// Default guest RAM size.
pub const DEFAULT_RAM_SIZE: u64 = 0x20_0000;
/// Start of the 32-bit MMIO hole where the VMM assigns BARs.
pub const MMIO_HOLE_BASE: u64 = 0xC000_0000;
/// End (exclusive) of the 32-bit MMIO hole.
pub const MMIO_HOLE_END: u64 = 0xFEC0_0000;

/// Code segment selector in the GDT.
pub const SEL_CODE: u16 = 0x08;
/// Data segment selector in the GDT.
pub const SEL_DATA: u16 = 0x10;
/// TSS selector in the GDT.
pub const SEL_TSS: u16 = 0x18;

// Parameter block: u32 fields at these offsets from PARAMS_ADDR.
/// Magic [`PARAMS_MAGIC`], written by the VMM.
pub const PARAM_MAGIC: u64 = 0x00;
/// Workload code ([`crate::Workload::code`]).
pub const PARAM_WORKLOAD: u64 = 0x04;
/// Number of vCPUs.
pub const PARAM_NR_VCPUS: u64 = 0x08;
/// Region mode: 0 device (BAR2), 1 guest RAM.
pub const PARAM_REGION_MODE: u64 = 0x0c;
/// `(device_id << 16) | vendor_id` of the function to look for.
pub const PARAM_PCI_ID: u64 = 0x10;
/// Number of slot updates in the start-up burst.
pub const PARAM_SLOT_BURST: u64 = 0x14;
/// Set to 1 by the VMM to stop the workload.
pub const PARAM_STOP: u64 = 0x18;
/// Set to 1 by vCPU 0 once the handshake is done (others wait for it).
pub const PARAM_GO: u64 = 0x1c;
/// Number of vCPUs that found their slot (barrier counter).
pub const PARAM_READY: u64 = 0x20;
/// BAR0 base the guest found.
pub const PARAM_REG_BASE: u64 = 0x24;
/// Region base (0 if the handshake failed).
pub const PARAM_REGION_BASE: u64 = 0x28;
/// STATUS | ERROR << 8 after the handshake.
pub const PARAM_HANDSHAKE: u64 = 0x2c;
/// Seed of the hostile workload's pseudo-random garbage.
pub const PARAM_SEED: u64 = 0x30;
/// If non-zero, vCPU 0 moves BAR2 to this address before the handshake.
pub const PARAM_BAR2_MOVE: u64 = 0x34;
/// GPA the guest uses for a guest-mode region.
pub const PARAM_GUEST_REGION_GPA: u64 = 0x38;
/// Greedy workload: the rt_prio its vCPUs ask for.
pub const PARAM_GREEDY_RT_PRIO: u64 = 0x3c;
/// Firmware table: x2APIC ID of vCPU i (like ACPI's MADT), u32 each.
pub const PARAM_APIC_IDS: u64 = 0x100;
/// Slot index each vCPU found (written by the guest), u32 each.
pub const PARAM_SLOT_OF: u64 = 0x200;
/// Spin workload: answer flags, u32 each.
pub const PARAM_ANSWERED: u64 = 0x300;
/// Where each vCPU's interrupt handlers resume (written by the guest), u32 each.
pub const PARAM_RESUME: u64 = 0x400;
/// Greedy workload: loop iterations of each vCPU (written by the guest),
/// u64 each (low dword first).
pub const PARAM_GREEDY_LOOPS: u64 = 0x500;

/// Value of [`PARAM_MAGIC`]: "PVTG".
pub const PARAMS_MAGIC: u32 = 0x4754_5650;

/// Stack top of vCPU `index`.
pub const fn stack_top(index: u32) -> u64 {
    STACKS_ADDR + (index as u64 + 1) * STACK_SIZE
}

/// Smallest RAM size that holds the layout for `nr_vcpus`.
pub fn min_ram_size(nr_vcpus: u32) -> u64 {
    let region = u64::from(pvsched_abi::region_size(nr_vcpus.max(1)));
    let end = GUEST_REGION_GPA + region;
    end.max(stack_top(MAX_GUEST_VCPUS))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: u64 = MAX_GUEST_VCPUS as u64 * 4;
    const _: () = assert!(PARAM_RESUME + TABLE <= PARAM_GREEDY_LOOPS);
    const _: () = assert!(PARAM_GREEDY_LOOPS + 2 * TABLE <= 0x1000);
    const _: () = assert!(PARAM_APIC_IDS + TABLE <= PARAM_SLOT_OF);
    const _: () = assert!(IDT_ADDR + IDT_ENTRIES * 8 <= PARAMS_ADDR);
    const _: () = assert!(stack_top(MAX_GUEST_VCPUS) <= GUEST_REGION_GPA);

    #[test]
    fn layout_fits_in_default_ram() {
        assert!(min_ram_size(MAX_GUEST_VCPUS) <= DEFAULT_RAM_SIZE);
        assert_eq!(stack_top(0), STACKS_ADDR + STACK_SIZE);
    }
}
