//! The test guest: a small 32-bit program built from source at run time,
//! and the firmware work that loads it (GDT, IDT, parameter block).

pub mod events;
pub mod layout;
pub mod program;
pub mod workload;

use layout::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

pub use events::GuestEvent;
pub use program::GuestProgram;
pub use workload::Workload;

/// Errors loading the test guest.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Building the program failed.
    #[error(transparent)]
    Program(#[from] program::Error),
    /// Guest RAM is too small for the layout.
    #[error("writing the test guest at {addr:#x} failed (guest RAM too small?): {source}")]
    Write {
        /// Guest address of the failed write.
        addr: u64,
        /// The memory error.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// More vCPUs than the guest's tables hold.
    #[error("the test guest supports at most {MAX_GUEST_VCPUS} vCPUs, {0} requested")]
    TooManyVcpus(u32),
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, Error>;

/// What the VMM tells the guest at boot (the parameter block).
#[derive(Clone, Debug)]
pub struct GuestParams {
    /// Workload to run.
    pub workload: Workload,
    /// x2APIC ID of each vCPU (the firmware table).
    pub apic_ids: Vec<u32>,
    /// `true`: guest-RAM region; `false`: BAR2 device region.
    pub guest_region: bool,
    /// `(device_id << 16) | vendor_id` to look for.
    pub pci_id: u32,
    /// Slot updates in the start-up burst.
    pub slot_burst: u32,
    /// Seed of the hostile workload.
    pub seed: u32,
    /// If set, vCPU 0 moves BAR2 here before the handshake.
    pub bar2_move: Option<u32>,
    /// GPA the guest hands to the device in guest-region mode.
    pub guest_region_gpa: u32,
    /// rt_prio the greedy workload asks for.
    pub greedy_rt_prio: u32,
}

/// Load the GDT, the IDT, the program and the parameter block into `mem`.
pub fn load(mem: &GuestMemoryMmap, program: &GuestProgram, p: &GuestParams) -> Result<()> {
    let nr = u32::try_from(p.apic_ids.len()).unwrap_or(u32::MAX);
    if nr > MAX_GUEST_VCPUS {
        return Err(Error::TooManyVcpus(nr));
    }
    let write = |addr: u64, bytes: &[u8]| {
        mem.write_slice(bytes, GuestAddress(addr))
            .map_err(|source| Error::Write { addr, source })
    };
    let w32 = |off: u64, v: u32| write(PARAMS_ADDR + off, &v.to_le_bytes());

    // GDT: null, flat 4 GiB code, flat 4 GiB data, 32-bit TSS (unused but valid).
    let gdt: [u64; 4] = [
        0,
        0x00cf_9b00_0000_ffff,
        0x00cf_9300_0000_ffff,
        0x0000_8b00_0000_0067,
    ];
    let gdt_bytes: Vec<u8> = gdt.iter().flat_map(|d| d.to_le_bytes()).collect();
    write(GDT_ADDR, &gdt_bytes)?;

    // IDT: 32-bit interrupt gates (IF cleared on entry) to the program's handlers.
    let idt: Vec<u8> = program
        .handlers
        .iter()
        .flat_map(|&h| interrupt_gate(h).to_le_bytes())
        .collect();
    write(IDT_ADDR, &idt)?;
    write(CODE_ADDR, &program.code)?;

    write(PARAMS_ADDR, &[0u8; 0x1000])?;
    w32(PARAM_MAGIC, PARAMS_MAGIC)?;
    w32(PARAM_WORKLOAD, p.workload.code())?;
    w32(PARAM_NR_VCPUS, nr)?;
    w32(PARAM_REGION_MODE, u32::from(p.guest_region))?;
    w32(PARAM_PCI_ID, p.pci_id)?;
    w32(PARAM_SLOT_BURST, p.slot_burst)?;
    w32(PARAM_SEED, p.seed)?;
    w32(PARAM_BAR2_MOVE, p.bar2_move.unwrap_or(0))?;
    w32(PARAM_GUEST_REGION_GPA, p.guest_region_gpa)?;
    w32(PARAM_GREEDY_RT_PRIO, p.greedy_rt_prio)?;
    for (i, id) in p.apic_ids.iter().enumerate() {
        w32(PARAM_APIC_IDS + 4 * i as u64, *id)?;
        w32(PARAM_SLOT_OF + 4 * i as u64, u32::MAX)?;
    }
    Ok(())
}

/// A present, DPL 0, 32-bit interrupt gate to `handler` in the code segment.
fn interrupt_gate(handler: u32) -> u64 {
    let h = u64::from(handler);
    (h & 0xffff) | (u64::from(SEL_CODE) << 16) | (0x8e << 40) | ((h >> 16) << 48)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic};

    #[test]
    fn program_assembles_and_every_vector_has_a_handler() {
        let p = program::build().unwrap();
        assert_eq!(p.handlers.len(), IDT_ENTRIES as usize);
        let end = CODE_ADDR + p.code.len() as u64;
        for h in &p.handlers {
            assert!((CODE_ADDR..end).contains(&u64::from(*h)));
        }
        // The program is reproducible.
        assert_eq!(program::build().unwrap().code, p.code);
    }

    #[test]
    fn program_has_no_iret() {
        let p = program::build().unwrap();
        let mut d = Decoder::with_ip(32, &p.code, CODE_ADDR, DecoderOptions::NONE);
        for ins in &mut d {
            assert!(!ins.is_invalid());
            assert_ne!(ins.mnemonic(), Mnemonic::Iretd);
        }
    }

    #[test]
    fn gate_encoding() {
        assert_eq!(interrupt_gate(0x1234_5678), 0x1234_8e00_0008_5678);
    }
}
