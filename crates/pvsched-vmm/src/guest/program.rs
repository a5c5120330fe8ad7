//! The test guest program, generated with `iced-x86`'s code assembler.
//!
//! A small 32-bit protected-mode program that does what the Linux driver
//! does: vCPU 0 enumerates PCI bus 0 through configuration mechanism #1
//! (0xCF8/0xCFC), finds pvsched by vendor/device ID, enables memory
//! decoding, reads BAR0 (registers) and BAR2 (device region), and runs the
//! STATUS handshake in the region mode the parameter block asks for. Every
//! vCPU then enables its x2APIC, finds its slot through the region's APIC-ID
//! table (x2APIC ID from MSR 0x802), writes it with the sequence protocol,
//! and runs the selected workload (see [`crate::Workload`]).
//!
//! Slot requests follow the work: the start-up burst ends with the slot at
//! "nothing special" (NORMAL, rt_prio 0, `kern_cs` 0, no `wait_on`); only
//! running RT work asks for more. The `wakeup` handler is the RT task (it
//! asks for FIFO 1 with `kern_cs = HARDIRQ` before it reports `WAKE_ACK`,
//! the exit at which the host policy reads the slot, and clears the slot
//! after its EOI); `spin` sets `PREEMPT_OFF` and `wait_on` around each wait;
//! `greedy` asks for FIFO (`PARAM_GREEDY_RT_PRIO`, 1 by default) once and
//! spins forever.
//!
//! Register conventions: ESI = vCPU index and EBP = stack top (both set by
//! the VMM), EDI = this vCPU's slot address (0 if none). Interrupt handlers
//! never return with IRET (KVM's instruction emulator cannot emulate a
//! protected-mode IRET on hosts where the guest is emulated): they reset ESP
//! from EBP and jump to this vCPU's resume address in the parameter block.
//! Workload loops therefore restart from their head after every interrupt.
//!
//! The code is assembled twice: the first pass finds the label addresses,
//! the second embeds them as immediates (`mov r/m32, imm32` has the same
//! length whatever the value, so the addresses do not move).

use super::events::{self, code};
use super::layout::*;
use super::workload::Workload;
use iced_x86::code_asm::*;
use iced_x86::{BlockEncoderOptions, IcedError};
use pvsched_abi as abi;
use std::mem::offset_of;

/// Errors building the guest program.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The assembler refused an instruction (a bug in this file).
    #[error("assembling the test guest failed: {0}")]
    Assemble(#[from] IcedError),
    /// The program outgrew its place in the memory map.
    #[error("test guest code is {0} bytes, more than the {CODE_MAX} bytes the layout allows")]
    TooLarge(usize),
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, Error>;

/// The assembled program: code bytes and the handler address of each vector.
#[derive(Clone, Debug)]
pub struct GuestProgram {
    /// Machine code, loaded at [`CODE_ADDR`].
    pub code: Vec<u8>,
    /// Guest address of the handler of each of the 256 vectors.
    pub handlers: Vec<u32>,
}

// x2APIC MSRs.
const MSR_APIC_BASE: u32 = 0x1b;
const MSR_X2APIC_ID: u32 = 0x802;
const MSR_X2APIC_EOI: u32 = 0x80b;
const MSR_X2APIC_SVR: u32 = 0x80f;
const MSR_X2APIC_ICR: u32 = 0x830;
const APIC_BASE_ENABLE: u32 = 1 << 11;
const APIC_BASE_X2APIC: u32 = 1 << 10;
const SVR_ENABLE: u32 = 1 << 8;

// PCI configuration mechanism #1.
const PCI_CONFIG_ADDRESS: u16 = 0xcf8;
const PCI_CONFIG_DATA: u16 = 0xcfc;
const PCI_ENABLE: u32 = 0x8000_0000;
const PCI_COMMAND: u32 = 0x04;
const PCI_COMMAND_MEMORY: u32 = 0x2;
const PCI_BAR0: u32 = 0x10;
const PCI_BAR2: u32 = 0x18;
const PCI_BAR_MEM_MASK: u32 = !0xf;

// Region header and slot field offsets, from the ABI structs (which the
// layout test checks against include/pvsched_abi.h).
const HDR_NR_VCPUS: i32 = offset_of!(abi::RegionHeader, nr_vcpus) as i32;
const HDR_APIC_TABLE: i32 = offset_of!(abi::RegionHeader, apic_table_offset) as i32;
const HDR_SLOTS: i32 = offset_of!(abi::RegionHeader, slots_offset) as i32;
const SLOT_SEQ: i32 = offset_of!(abi::Slot, guest.seq) as i32;
const SLOT_KERN_CS: i32 = offset_of!(abi::Slot, guest.kern_cs) as i32;
const SLOT_POLICY: i32 = offset_of!(abi::Slot, guest.policy) as i32;
const SLOT_NICE: i32 = offset_of!(abi::Slot, guest.nice) as i32;
const SLOT_RT_PRIO: i32 = offset_of!(abi::Slot, guest.rt_prio) as i32;
const SLOT_WAIT_ON: i32 = offset_of!(abi::Slot, guest.wait_on) as i32;
const SLOT_UPDATES: i32 = offset_of!(abi::Slot, guest.updates) as i32;
const SLOT_SHIFT: u32 = 7;
const _: () = assert!(abi::SLOT_SIZE == 1 << SLOT_SHIFT);

/// What vCPU 0 prints on the serial port at boot.
pub const BANNER: &str = "pvsched test guest\n";

/// Address of parameter `off`.
fn param(off: u64) -> AsmMemoryOperand {
    dword_ptr(PARAMS_ADDR + off)
}

/// Address of entry ESI of the per-vCPU parameter table at `off`.
fn param_mine(off: u64) -> AsmMemoryOperand {
    dword_ptr(esi * 4 + (PARAMS_ADDR + off))
}

/// Label addresses embedded as immediates (second pass).
#[derive(Clone, Copy, Default)]
struct Targets {
    idle: u32,
    passive: u32,
    ping: u32,
    spin: u32,
    greedy: u32,
}

struct Labels {
    idle: CodeLabel,
    passive: CodeLabel,
    slot_write: CodeLabel,
    ping: CodeLabel,
    spin: CodeLabel,
    greedy: CodeLabel,
    handlers: Vec<CodeLabel>,
}

/// Assemble the test guest.
pub fn build() -> Result<GuestProgram> {
    let (first, labels) = assemble(Targets::default())?;
    let ip = |l: &CodeLabel| -> Result<u32> { Ok(first.label_ip(l)? as u32) };
    let targets = Targets {
        idle: ip(&labels.idle)?,
        passive: ip(&labels.passive)?,
        ping: ip(&labels.ping)?,
        spin: ip(&labels.spin)?,
        greedy: ip(&labels.greedy)?,
    };
    let (second, labels) = assemble(targets)?;
    let code = second.inner.code_buffer.clone();
    if code.len() as u64 > CODE_MAX {
        return Err(Error::TooLarge(code.len()));
    }
    let handlers = labels
        .handlers
        .iter()
        .map(|l| Ok(second.label_ip(l)? as u32))
        .collect::<Result<Vec<_>>>()?;
    debug_assert_eq!(first.inner.code_buffer.len(), code.len());
    Ok(GuestProgram { code, handlers })
}

/// Emitter with the program's small "macros".
struct Asm {
    a: CodeAssembler,
}

impl Asm {
    /// `out EVENT_PORT, (code << 24) | arg` with a constant arg. Clobbers EAX, EDX.
    fn event(&mut self, c: u32, arg: u32) -> std::result::Result<(), IcedError> {
        self.a.mov(eax, (c << 24) | (arg & 0xff_ffff))?;
        self.a.mov(dx, u32::from(events::EVENT_PORT))?;
        self.a.out(dx, eax)
    }

    /// Event whose arg is in EAX (low 24 bits kept). Clobbers EAX, EDX.
    fn event_eax(&mut self, c: u32) -> std::result::Result<(), IcedError> {
        self.a.and(eax, 0xff_ffffu32)?;
        self.a.or(eax, c << 24)?;
        self.a.mov(dx, u32::from(events::EVENT_PORT))?;
        self.a.out(dx, eax)
    }

    /// EAX = config dword `reg` of the function whose address is in EBX. Clobbers EDX.
    fn cfg_read(&mut self, reg: u32) -> std::result::Result<(), IcedError> {
        self.a.mov(eax, ebx)?;
        self.a.or(eax, reg)?;
        self.a.mov(dx, u32::from(PCI_CONFIG_ADDRESS))?;
        self.a.out(dx, eax)?;
        self.a.mov(dx, u32::from(PCI_CONFIG_DATA))?;
        self.a.in_(eax, dx)
    }

    /// Config dword `reg` of the function at EBX = ECX. Clobbers EAX, EDX.
    fn cfg_write_ecx(&mut self, reg: u32) -> std::result::Result<(), IcedError> {
        self.a.mov(eax, ebx)?;
        self.a.or(eax, reg)?;
        self.a.mov(dx, u32::from(PCI_CONFIG_ADDRESS))?;
        self.a.out(dx, eax)?;
        self.a.mov(eax, ecx)?;
        self.a.mov(dx, u32::from(PCI_CONFIG_DATA))?;
        self.a.out(dx, eax)
    }

    /// Write `text` to the COM1 transmit register, a byte at a time. Clobbers EAX, EDX.
    fn print(&mut self, text: &str) -> std::result::Result<(), IcedError> {
        self.a.mov(dx, u32::from(events::SERIAL_PORT))?;
        for b in text.bytes() {
            self.a.mov(al, u32::from(b))?;
            self.a.out(dx, al)?;
        }
        Ok(())
    }

    /// Signal end of interrupt to the x2APIC. Clobbers EAX, ECX, EDX.
    fn eoi(&mut self) -> std::result::Result<(), IcedError> {
        self.a.mov(ecx, MSR_X2APIC_EOI)?;
        self.a.xor(eax, eax)?;
        self.a.xor(edx, edx)?;
        self.a.wrmsr()
    }

    /// Fixed IPI with `vector` to the vCPU whose index is in EBX. Clobbers EAX, ECX, EDX.
    fn ipi_to_ebx(&mut self, vector: u8) -> std::result::Result<(), IcedError> {
        self.a
            .mov(edx, dword_ptr(ebx * 4 + (PARAMS_ADDR + PARAM_APIC_IDS)))?;
        self.a.mov(eax, u32::from(vector))?;
        self.a.mov(ecx, MSR_X2APIC_ICR)?;
        self.a.wrmsr()
    }

    /// Leave an interrupt handler: reset the stack, jump to this vCPU's resume address.
    fn resume(&mut self) -> std::result::Result<(), IcedError> {
        self.a.mov(esp, ebp)?;
        self.a.jmp(param_mine(PARAM_RESUME))
    }

    /// EBX = partner vCPU index (ESI ^ 1).
    fn partner_ebx(&mut self) -> std::result::Result<(), IcedError> {
        self.a.mov(ebx, esi)?;
        self.a.xor(ebx, 1u32)
    }

    /// One xorshift32 step on EAX. Clobbers EDX.
    fn xorshift(&mut self) -> std::result::Result<(), IcedError> {
        self.a.mov(edx, eax)?;
        self.a.shl(edx, 13u32)?;
        self.a.xor(eax, edx)?;
        self.a.mov(edx, eax)?;
        self.a.shr(edx, 17u32)?;
        self.a.xor(eax, edx)?;
        self.a.mov(edx, eax)?;
        self.a.shl(edx, 5u32)?;
        self.a.xor(eax, edx)
    }
}

/// Subroutine and jump-target labels shared between the emitters.
struct Subroutines {
    pci_find: CodeLabel,
    handshake: CodeLabel,
    find_slot: CodeLabel,
    burst: CodeLabel,
    hostile: CodeLabel,
    hostile_ap: CodeLabel,
    done: CodeLabel,
}

/// The whole program, in emission order; `t` holds the addresses of the
/// resume targets (zero on the first pass).
fn assemble(t: Targets) -> Result<(CodeAssemblerResult, Labels)> {
    let mut m = Asm {
        a: CodeAssembler::new(32)?,
    };
    let mut l = Labels {
        idle: m.a.create_label(),
        passive: m.a.create_label(),
        slot_write: m.a.create_label(),
        ping: m.a.create_label(),
        spin: m.a.create_label(),
        greedy: m.a.create_label(),
        handlers: Vec::new(),
    };
    let mut s = Subroutines {
        pci_find: m.a.create_label(),
        handshake: m.a.create_label(),
        find_slot: m.a.create_label(),
        burst: m.a.create_label(),
        hostile: m.a.create_label(),
        hostile_ap: m.a.create_label(),
        done: m.a.create_label(),
    };
    emit_entry(&mut m, &l, &s, t)?;
    emit_workloads(&mut m, &mut l, &mut s.done)?;
    emit_pci_find(&mut m, &mut s.pci_find)?;
    emit_handshake(&mut m, &mut s.handshake)?;
    emit_find_slot(&mut m, &mut s.find_slot)?;
    emit_slot_write(&mut m, &mut l.slot_write)?;
    emit_burst(&mut m, &mut s.burst, l.slot_write)?;
    emit_hostile(&mut m, &mut s.hostile, t)?;
    emit_hostile_ap(&mut m, &mut s.hostile_ap, l.passive)?;
    emit_handlers(&mut m, &mut l, &s.done)?;

    let result = m.a.assemble_options(
        CODE_ADDR,
        BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )?;
    Ok((result, l))
}

/// Entry of every vCPU: x2APIC on; vCPU 0 finds the device and shakes
/// hands while the others wait; then every vCPU finds its slot, meets the
/// others at a barrier, runs the slot burst and jumps to its workload.
fn emit_entry(
    m: &mut Asm,
    l: &Labels,
    s: &Subroutines,
    t: Targets,
) -> std::result::Result<(), IcedError> {
    let mut ap_wait = m.a.create_label();
    let mut common = m.a.create_label();
    let mut barrier = m.a.create_label();
    let mut fail_handshake = m.a.create_label();
    // ---- entry: every vCPU ----
    m.a.mov(ecx, MSR_APIC_BASE)?;
    m.a.rdmsr()?;
    m.a.or(eax, APIC_BASE_ENABLE | APIC_BASE_X2APIC)?;
    m.a.wrmsr()?;
    m.a.mov(ecx, MSR_X2APIC_SVR)?;
    m.a.mov(eax, SVR_ENABLE | u32::from(events::VEC_SPURIOUS))?;
    m.a.xor(edx, edx)?;
    m.a.wrmsr()?;
    m.a.mov(param_mine(PARAM_RESUME), t.idle)?;
    m.a.xor(edi, edi)?;
    m.a.mov(ecx, MSR_X2APIC_ID)?;
    m.a.rdmsr()?;
    m.event_eax(code::BOOT)?;
    m.a.test(esi, esi)?;
    m.a.jnz(ap_wait)?;

    // ---- vCPU 0: find the device and shake hands ----
    m.print(BANNER)?;
    m.a.call(s.pci_find)?;
    m.a.test(ebx, ebx)?;
    m.a.jz(fail_handshake)?;
    m.a.call(s.handshake)?;
    m.a.mov(param(PARAM_GO), 1u32)?;
    m.a.jmp(common)?;
    m.a.set_label(&mut fail_handshake)?;
    m.a.mov(param(PARAM_REGION_BASE), 0u32)?;
    m.event(code::HANDSHAKE, 0xffff << 8)?;
    m.a.mov(param(PARAM_GO), 1u32)?;
    m.a.jmp(common)?;

    // ---- other vCPUs wait for vCPU 0 ----
    m.a.set_label(&mut ap_wait)?;
    m.a.pause()?;
    m.a.cmp(param(PARAM_STOP), 0u32)?;
    m.a.jne(s.done)?;
    m.a.cmp(param(PARAM_GO), 0u32)?;
    m.a.je(ap_wait)?;

    // ---- every vCPU: slot, barrier, burst, workload ----
    m.a.set_label(&mut common)?;
    m.a.call(s.find_slot)?;
    m.a.lock().inc(param(PARAM_READY))?;
    m.a.set_label(&mut barrier)?;
    m.a.pause()?;
    m.a.cmp(param(PARAM_STOP), 0u32)?;
    m.a.jne(s.done)?;
    m.a.mov(eax, param(PARAM_READY))?;
    m.a.cmp(eax, param(PARAM_NR_VCPUS))?;
    m.a.jb(barrier)?;
    m.a.call(s.burst)?;
    m.event(code::READY, 0)?;
    let mut not_wakeup = m.a.create_label();
    let mut not_ipi = m.a.create_label();
    let mut not_spin = m.a.create_label();
    let mut pair_ok = m.a.create_label();
    m.a.mov(eax, param(PARAM_WORKLOAD))?;
    m.a.cmp(eax, Workload::Wakeup.code())?;
    m.a.jne(not_wakeup)?;
    m.a.mov(param_mine(PARAM_RESUME), t.passive)?;
    m.a.jmp(l.passive)?;
    m.a.set_label(&mut not_wakeup)?;
    let mut not_greedy = m.a.create_label();
    m.a.cmp(eax, Workload::Greedy.code())?;
    m.a.jne(not_greedy)?;
    // greedy: ask for RT (FIFO at PARAM_GREEDY_RT_PRIO, no critical
    // section) for good, then spin.
    m.a.xor(eax, eax)?;
    m.a.xor(ebx, ebx)?;
    m.a.mov(ecx, param(PARAM_GREEDY_RT_PRIO))?;
    m.a.call(l.slot_write)?;
    m.a.mov(param_mine(PARAM_RESUME), t.greedy)?;
    m.a.jmp(l.greedy)?;
    m.a.set_label(&mut not_greedy)?;
    m.a.cmp(eax, Workload::Hostile.code())?;
    m.a.jne(not_ipi)?;
    m.a.mov(param_mine(PARAM_RESUME), t.passive)?;
    m.a.test(esi, esi)?;
    m.a.jz(s.hostile)?;
    m.a.jmp(s.hostile_ap)?;
    m.a.set_label(&mut not_ipi)?;
    // ipi and spin: pairs (0,1), (2,3)...; the even vCPU drives, an unpaired one idles.
    m.a.mov(param_mine(PARAM_RESUME), t.passive)?;
    m.partner_ebx()?;
    m.a.cmp(ebx, param(PARAM_NR_VCPUS))?;
    m.a.jb(pair_ok)?;
    m.a.jmp(l.passive)?;
    m.a.set_label(&mut pair_ok)?;
    m.a.test(esi, 1u32)?;
    m.a.jnz(l.passive)?;
    m.a.cmp(eax, Workload::Ipi.code())?;
    m.a.jne(not_spin)?;
    m.a.mov(param_mine(PARAM_RESUME), t.ping)?;
    m.a.jmp(l.ping)?;
    m.a.set_label(&mut not_spin)?;
    m.a.cmp(eax, Workload::Spin.code())?;
    m.a.jne(l.passive)?;
    m.a.mov(param_mine(PARAM_RESUME), t.spin)?;
    m.a.jmp(l.spin)?;
    Ok(())
}

/// The workload loops (idle, passive, ping, spin, greedy) and `done`.
fn emit_workloads(
    m: &mut Asm,
    l: &mut Labels,
    done: &mut CodeLabel,
) -> std::result::Result<(), IcedError> {
    let mut halt_forever = m.a.create_label();
    // ---- idle: halt with interrupts off until kicked out ----
    m.a.set_label(&mut l.idle)?;
    m.a.cli()?;
    m.a.hlt()?;
    m.a.jmp(l.idle)?;

    // ---- passive / wakeup loop: halt until an interrupt ----
    // It does not poll the stop flag: a passive vCPU stops only on the stop
    // vector, which the VMM sends once the driving vCPUs are done, so a
    // ping sent just before the flag was set is still answered.
    m.a.set_label(&mut l.passive)?;
    m.a.sti()?;
    m.a.hlt()?;
    m.a.jmp(l.passive)?;

    // ---- ipi: ping the partner, wait for the pong ----
    m.a.set_label(&mut l.ping)?;
    m.a.cli()?;
    m.a.cmp(param(PARAM_STOP), 0u32)?;
    m.a.jne(*done)?;
    m.partner_ebx()?;
    m.a.mov(eax, ebx)?;
    m.event_eax(code::IPI_SENT)?;
    m.ipi_to_ebx(events::VEC_PING)?;
    m.a.sti()?;
    m.a.hlt()?;
    m.a.jmp(l.ping)?;

    // ---- spin: set wait_on, IPI the partner, PAUSE until it answers ----
    let mut spin_wait = m.a.create_label();
    m.a.set_label(&mut l.spin)?;
    m.a.cli()?;
    m.a.cmp(param(PARAM_STOP), 0u32)?;
    m.a.jne(*done)?;
    m.a.mov(param_mine(PARAM_ANSWERED), 0u32)?;
    m.partner_ebx()?;
    m.a.mov(eax, ebx)?;
    m.event_eax(code::SPIN_BEGIN)?;
    m.partner_ebx()?;
    m.a.mov(ebx, dword_ptr(ebx * 4 + (PARAMS_ADDR + PARAM_SLOT_OF)))?;
    m.a.inc(ebx)?; // slot + 1; a missing slot (0xffff_ffff) becomes WAIT_NONE
    m.a.mov(eax, abi::CS_PREEMPT_OFF)?;
    m.a.xor(ecx, ecx)?;
    m.a.call(l.slot_write)?;
    m.partner_ebx()?;
    m.ipi_to_ebx(events::VEC_SPIN)?;
    m.a.push(0u32)?;
    m.a.sti()?;
    m.a.set_label(&mut spin_wait)?;
    m.a.pause()?;
    m.a.inc(dword_ptr(esp))?;
    m.a.cmp(param_mine(PARAM_ANSWERED), 0u32)?;
    m.a.je(spin_wait)?;
    m.a.cli()?;
    m.a.pop(eax)?;
    m.event_eax(code::SPIN_END)?;
    m.a.xor(eax, eax)?;
    m.a.xor(ebx, ebx)?;
    m.a.xor(ecx, ecx)?;
    m.a.call(l.slot_write)?;
    m.a.jmp(l.spin)?;

    // ---- greedy: PAUSE with interrupts on until the stop flag is set ----
    // Interrupts (the stop vector) resume here; the slot keeps asking for
    // RT. Iterations are counted in this vCPU's PARAM_GREEDY_LOOPS (u64).
    let mut greedy_loop = m.a.create_label();
    m.a.set_label(&mut l.greedy)?;
    m.a.sti()?;
    m.a.set_label(&mut greedy_loop)?;
    m.a.pause()?;
    m.a.add(
        dword_ptr(esi * 8 + (PARAMS_ADDR + PARAM_GREEDY_LOOPS)),
        1u32,
    )?;
    m.a.adc(
        dword_ptr(esi * 8 + (PARAMS_ADDR + PARAM_GREEDY_LOOPS + 4)),
        0u32,
    )?;
    m.a.cmp(param(PARAM_STOP), 0u32)?;
    m.a.je(greedy_loop)?;
    m.a.jmp(*done)?;

    // ---- done: report and halt for good ----
    m.a.set_label(done)?;
    m.a.cli()?;
    m.event(code::DONE, 0)?;
    m.a.set_label(&mut halt_forever)?;
    m.a.hlt()?;
    m.a.jmp(halt_forever)?;
    Ok(())
}

/// `pci_find`: EBX = config address of the pvsched function, or 0.
fn emit_pci_find(m: &mut Asm, entry: &mut CodeLabel) -> std::result::Result<(), IcedError> {
    // ---- pci_find: EBX = config address of the function, or 0 ----
    let mut pci_loop = m.a.create_label();
    let mut pci_found = m.a.create_label();
    m.a.set_label(entry)?;
    m.a.mov(ebx, PCI_ENABLE)?;
    m.a.set_label(&mut pci_loop)?;
    m.cfg_read(0)?;
    m.a.cmp(eax, param(PARAM_PCI_ID))?;
    m.a.je(pci_found)?;
    m.a.add(ebx, 1u32 << 11)?; // next device, function 0
    m.a.cmp(ebx, PCI_ENABLE | (32 << 11))?;
    m.a.jb(pci_loop)?;
    m.a.xor(ebx, ebx)?;
    m.a.ret()?;
    m.a.set_label(&mut pci_found)?;
    m.a.mov(eax, ebx)?;
    m.a.shr(eax, 8u32)?;
    m.a.and(eax, 0xffu32)?;
    m.event_eax(code::PCI_FOUND)?;
    m.a.ret()?;
    Ok(())
}

/// `handshake` (EBX = config address): the ABI handshake in the chosen
/// region mode; reports STATUS and ERROR as a HANDSHAKE event.
fn emit_handshake(m: &mut Asm, entry: &mut CodeLabel) -> std::result::Result<(), IcedError> {
    // ---- handshake (EBX = config address); EDI = BAR0 base meanwhile ----
    let mut no_move = m.a.create_label();
    let mut bad_magic = m.a.create_label();
    let mut guest_mode = m.a.create_label();
    let mut mode_done = m.a.create_label();
    let mut hs_report = m.a.create_label();
    m.a.set_label(entry)?;
    m.cfg_read(PCI_COMMAND)?;
    m.a.or(eax, PCI_COMMAND_MEMORY)?;
    m.a.and(eax, 0xffffu32)?;
    m.a.mov(ecx, eax)?;
    m.cfg_write_ecx(PCI_COMMAND)?;
    m.a.mov(ecx, param(PARAM_BAR2_MOVE))?;
    m.a.test(ecx, ecx)?;
    m.a.jz(no_move)?;
    m.cfg_write_ecx(PCI_BAR2)?;
    m.a.mov(eax, param(PARAM_BAR2_MOVE))?;
    m.a.shr(eax, 12u32)?;
    m.event_eax(code::BAR_MOVED)?;
    m.a.set_label(&mut no_move)?;
    m.cfg_read(PCI_BAR0)?;
    m.a.and(eax, PCI_BAR_MEM_MASK)?;
    m.a.mov(param(PARAM_REG_BASE), eax)?;
    m.a.mov(edi, eax)?;
    m.a.cmp(dword_ptr(edi + abi::REG_MAGIC as i32), abi::MAGIC)?;
    m.a.jne(bad_magic)?;
    let reg = |r: u32| dword_ptr(edi + r as i32);
    m.a.mov(reg(abi::REG_STATUS), abi::STATUS_RESET)?;
    m.a.mov(reg(abi::REG_STATUS), abi::STATUS_ACKNOWLEDGE)?;
    m.a.mov(
        reg(abi::REG_STATUS),
        abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER,
    )?;
    m.a.mov(eax, reg(abi::REG_DEV_FEATURES_LO))?;
    m.a.and(eax, (abi::F_WAIT_ON | abi::F_KICK) as u32)?;
    m.a.mov(ecx, abi::F_DEVICE_REGION as u32)?;
    m.a.cmp(param(PARAM_REGION_MODE), 0u32)?;
    m.a.je(mode_done)?;
    m.a.mov(ecx, abi::F_GUEST_REGION as u32)?;
    m.a.set_label(&mut mode_done)?;
    m.a.or(eax, ecx)?;
    m.a.mov(reg(abi::REG_DRV_FEATURES_LO), eax)?;
    m.a.mov(reg(abi::REG_DRV_FEATURES_HI), 0u32)?;
    let hs = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER;
    m.a.mov(reg(abi::REG_STATUS), hs | abi::STATUS_FEATURES_OK)?;
    m.a.mov(reg(abi::REG_DRIVER_VERSION), abi::ABI_VERSION)?;
    m.a.cmp(param(PARAM_REGION_MODE), 0u32)?;
    m.a.jne(guest_mode)?;
    m.cfg_read(PCI_BAR2)?;
    m.a.and(eax, PCI_BAR_MEM_MASK)?;
    m.a.mov(param(PARAM_REGION_BASE), eax)?;
    let mut go_ok = m.a.create_label();
    m.a.jmp(go_ok)?;
    m.a.set_label(&mut guest_mode)?;
    m.a.mov(ecx, param(PARAM_GUEST_REGION_GPA))?;
    m.a.mov(param(PARAM_REGION_BASE), ecx)?;
    m.a.mov(reg(abi::REG_SHM_GPA_LO), ecx)?;
    m.a.mov(reg(abi::REG_SHM_GPA_HI), 0u32)?;
    m.a.mov(eax, reg(abi::REG_REGION_SIZE))?;
    m.a.mov(reg(abi::REG_SHM_SIZE), eax)?;
    m.a.set_label(&mut go_ok)?;
    m.a.mov(
        reg(abi::REG_STATUS),
        hs | abi::STATUS_FEATURES_OK | abi::STATUS_DRIVER_OK,
    )?;
    m.a.mov(eax, reg(abi::REG_ERROR))?;
    m.a.shl(eax, 8u32)?;
    m.a.mov(ecx, reg(abi::REG_STATUS))?;
    m.a.and(ecx, 0xffu32)?;
    m.a.or(eax, ecx)?;
    m.a.test(ecx, abi::STATUS_DRIVER_OK)?;
    m.a.jnz(hs_report)?;
    m.a.mov(param(PARAM_REGION_BASE), 0u32)?;
    m.a.jmp(hs_report)?;
    m.a.set_label(&mut bad_magic)?;
    m.a.mov(param(PARAM_REGION_BASE), 0u32)?;
    m.a.mov(eax, 0xffff_u32 << 8)?;
    m.a.set_label(&mut hs_report)?;
    m.a.mov(param(PARAM_HANDSHAKE), eax)?;
    m.event_eax(code::HANDSHAKE)?;
    m.a.xor(edi, edi)?;
    m.a.ret()?;
    Ok(())
}

/// `find_slot`: EDI = this vCPU's slot address (0 if none).
fn emit_find_slot(m: &mut Asm, entry: &mut CodeLabel) -> std::result::Result<(), IcedError> {
    // ---- find_slot: EDI = slot address of this vCPU (0 if none) ----
    let mut fs_loop = m.a.create_label();
    let mut fs_found = m.a.create_label();
    let mut fs_none = m.a.create_label();
    m.a.set_label(entry)?;
    m.a.xor(edi, edi)?;
    m.a.mov(ebx, param(PARAM_REGION_BASE))?;
    m.a.test(ebx, ebx)?;
    m.a.jz(fs_none)?;
    m.a.mov(ecx, MSR_X2APIC_ID)?;
    m.a.rdmsr()?;
    m.a.mov(edx, dword_ptr(ebx + HDR_APIC_TABLE))?;
    m.a.add(edx, ebx)?;
    m.a.xor(ecx, ecx)?;
    m.a.set_label(&mut fs_loop)?;
    m.a.cmp(ecx, dword_ptr(ebx + HDR_NR_VCPUS))?;
    m.a.jae(fs_none)?;
    m.a.cmp(ecx, MAX_GUEST_VCPUS)?;
    m.a.jae(fs_none)?;
    m.a.cmp(eax, dword_ptr(edx + ecx * 4))?;
    m.a.je(fs_found)?;
    m.a.inc(ecx)?;
    m.a.jmp(fs_loop)?;
    m.a.set_label(&mut fs_found)?;
    m.a.mov(param_mine(PARAM_SLOT_OF), ecx)?;
    m.a.mov(eax, ecx)?;
    m.a.shl(eax, SLOT_SHIFT)?;
    m.a.add(eax, dword_ptr(ebx + HDR_SLOTS))?;
    m.a.add(eax, ebx)?;
    m.a.mov(edi, eax)?;
    m.a.mov(eax, ecx)?;
    m.event_eax(code::SLOT)?;
    m.a.ret()?;
    m.a.set_label(&mut fs_none)?;
    m.a.mov(param_mine(PARAM_SLOT_OF), u32::MAX)?;
    m.event(code::SLOT, events::ARG_NONE)?;
    m.a.ret()?;
    Ok(())
}

/// `slot_write(EAX = kern_cs, EBX = wait_on, ECX = rt_prio)`: one slot
/// update with the sequence protocol. Clobbers EDX.
fn emit_slot_write(m: &mut Asm, entry: &mut CodeLabel) -> std::result::Result<(), IcedError> {
    // ---- slot_write(EAX = kern_cs, EBX = wait_on, ECX = rt_prio); clobbers EDX ----
    let mut sw_out = m.a.create_label();
    m.a.set_label(entry)?;
    m.a.test(edi, edi)?;
    m.a.jz(sw_out)?;
    m.a.inc(dword_ptr(edi + SLOT_SEQ))?; // odd: writing
    m.a.mov(dword_ptr(edi + SLOT_KERN_CS), eax)?;
    m.a.xor(edx, edx)?;
    m.a.test(ecx, ecx)?;
    m.a.setnz(dl)?; // rt_prio > 0: SCHED_FIFO (1), else SCHED_NORMAL (0)
    m.a.mov(dword_ptr(edi + SLOT_POLICY), edx)?;
    m.a.mov(dword_ptr(edi + SLOT_NICE), 0u32)?;
    m.a.mov(dword_ptr(edi + SLOT_RT_PRIO), ecx)?;
    m.a.mov(dword_ptr(edi + SLOT_WAIT_ON), ebx)?;
    m.a.add(dword_ptr(edi + SLOT_UPDATES), 1u32)?;
    m.a.adc(dword_ptr(edi + (SLOT_UPDATES + 4)), 0u32)?;
    m.a.inc(dword_ptr(edi + SLOT_SEQ))?; // even: published
    m.a.set_label(&mut sw_out)?;
    m.a.ret()?;
    Ok(())
}

/// `burst`: PARAM_SLOT_BURST slot updates, bracketed by events.
fn emit_burst(
    m: &mut Asm,
    entry: &mut CodeLabel,
    slot_write: CodeLabel,
) -> std::result::Result<(), IcedError> {
    // ---- burst: PARAM_SLOT_BURST slot updates, bracketed by events ----
    let mut b_loop = m.a.create_label();
    let mut b_end = m.a.create_label();
    m.a.set_label(entry)?;
    m.a.mov(eax, param(PARAM_SLOT_BURST))?;
    m.event_eax(code::BURST_BEGIN)?;
    m.a.push(param(PARAM_SLOT_BURST))?;
    m.a.set_label(&mut b_loop)?;
    m.a.cmp(dword_ptr(esp), 0u32)?;
    m.a.je(b_end)?;
    m.a.mov(ecx, dword_ptr(esp))?;
    m.a.and(ecx, 63u32)?; // rt_prio 0..63: alternates NORMAL and FIFO
    m.a.mov(eax, abi::CS_PREEMPT_OFF)?;
    m.a.mov(ebx, abi::WAIT_NONE)?;
    m.a.call(slot_write)?;
    m.a.dec(dword_ptr(esp))?;
    m.a.jmp(b_loop)?;
    m.a.set_label(&mut b_end)?;
    m.a.pop(eax)?;
    m.a.mov(eax, param(PARAM_SLOT_BURST))?;
    m.event_eax(code::BURST_END)?;
    // Leave the slot in a defined state: nothing special (NORMAL, rt_prio 0,
    // kern_cs 0, no wait_on). Workloads ask for more only while their work runs.
    m.a.xor(eax, eax)?;
    m.a.xor(ebx, ebx)?;
    m.a.xor(ecx, ecx)?;
    m.a.call(slot_write)?;
    m.a.ret()?;
    Ok(())
}

/// Hostile workload, vCPUs other than 0: garbage over their own slot.
fn emit_hostile_ap(
    m: &mut Asm,
    entry: &mut CodeLabel,
    passive: CodeLabel,
) -> std::result::Result<(), IcedError> {
    // ---- hostile (other vCPUs): garbage over their own slot ----
    let mut ha_loop = m.a.create_label();
    m.a.set_label(entry)?;
    m.a.test(edi, edi)?;
    m.a.jz(passive)?;
    m.a.mov(eax, param(PARAM_SEED))?;
    m.a.add(eax, esi)?;
    m.a.or(eax, 1u32)?;
    m.a.xor(ecx, ecx)?;
    m.a.set_label(&mut ha_loop)?;
    m.xorshift()?;
    m.a.mov(dword_ptr(edi + ecx * 4), eax)?;
    m.a.inc(ecx)?;
    m.a.cmp(ecx, abi::SLOT_SIZE / 8)?; // the guest half only
    m.a.jb(ha_loop)?;
    m.a.jmp(passive)?;
    Ok(())
}

/// Hostile steps, each reported as `HostileError { step, error }`:
/// 1 DRIVER_OK with nothing before it, 2 unsupported features, 3 unaligned
/// guest region, 4 guest region outside RAM, 5 major version mismatch,
/// 6 garbage to every register offset, 7 garbage to configuration space.
/// Before step 1 the whole region is overwritten with garbage.
fn emit_hostile(
    m: &mut Asm,
    entry: &mut CodeLabel,
    t: Targets,
) -> std::result::Result<(), IcedError> {
    m.a.set_label(entry)?;
    m.a.mov(ebx, param(PARAM_REG_BASE))?;
    let reg = |r: u32| dword_ptr(ebx + r as i32);
    let hs = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER;

    // Region garbage.
    let mut rg_loop = m.a.create_label();
    let mut rg_done = m.a.create_label();
    m.a.mov(edi, param(PARAM_REGION_BASE))?;
    m.a.test(edi, edi)?;
    m.a.jz(rg_done)?;
    m.a.mov(ecx, reg(abi::REG_REGION_SIZE))?;
    m.a.and(ecx, 0xffffu32)?; // the layout for 64 vCPUs is 12 KiB
    m.a.shr(ecx, 2u32)?;
    m.a.mov(eax, param(PARAM_SEED))?;
    m.a.or(eax, 1u32)?;
    m.a.set_label(&mut rg_loop)?;
    m.a.test(ecx, ecx)?;
    m.a.jz(rg_done)?;
    m.a.dec(ecx)?;
    m.xorshift()?;
    m.a.mov(dword_ptr(edi + ecx * 4), eax)?;
    m.a.jmp(rg_loop)?;
    m.a.set_label(&mut rg_done)?;
    m.a.xor(edi, edi)?; // our slot is garbage now

    let report = |m: &mut Asm, step: u32| -> std::result::Result<(), IcedError> {
        m.a.mov(eax, dword_ptr(ebx + abi::REG_ERROR as i32))?;
        m.a.and(eax, 0xffffu32)?;
        m.a.or(eax, step << 16)?;
        m.event_eax(code::HOSTILE_ERROR)
    };

    // 1: DRIVER_OK out of sequence.
    m.a.mov(reg(abi::REG_STATUS), abi::STATUS_RESET)?;
    m.a.mov(reg(abi::REG_STATUS), abi::STATUS_DRIVER_OK)?;
    report(m, 1)?;
    // 2: every feature bit, supported or not.
    m.a.mov(reg(abi::REG_STATUS), abi::STATUS_RESET)?;
    m.a.mov(reg(abi::REG_STATUS), abi::STATUS_ACKNOWLEDGE)?;
    m.a.mov(reg(abi::REG_STATUS), hs)?;
    m.a.mov(reg(abi::REG_DRV_FEATURES_LO), u32::MAX)?;
    m.a.mov(reg(abi::REG_DRV_FEATURES_HI), u32::MAX)?;
    m.a.mov(reg(abi::REG_STATUS), hs | abi::STATUS_FEATURES_OK)?;
    report(m, 2)?;
    // 3..5: guest regions the device must refuse.
    let bad_regions: [(u32, u32, u32); 3] = [
        (0x1234, abi::ABI_VERSION, 3),
        (0xf000_0000, abi::ABI_VERSION, 4),
        (GUEST_REGION_GPA as u32, 2 << 16, 5),
    ];
    for (gpa, version, step) in bad_regions {
        m.a.mov(reg(abi::REG_STATUS), abi::STATUS_RESET)?;
        m.a.mov(reg(abi::REG_STATUS), abi::STATUS_ACKNOWLEDGE)?;
        m.a.mov(reg(abi::REG_STATUS), hs)?;
        m.a.mov(reg(abi::REG_DRV_FEATURES_LO), abi::F_GUEST_REGION as u32)?;
        m.a.mov(reg(abi::REG_DRV_FEATURES_HI), 0u32)?;
        m.a.mov(reg(abi::REG_STATUS), hs | abi::STATUS_FEATURES_OK)?;
        m.a.mov(reg(abi::REG_DRIVER_VERSION), version)?;
        m.a.mov(reg(abi::REG_SHM_GPA_LO), gpa)?;
        m.a.mov(reg(abi::REG_SHM_GPA_HI), 0u32)?;
        m.a.mov(eax, reg(abi::REG_REGION_SIZE))?;
        m.a.mov(reg(abi::REG_SHM_SIZE), eax)?;
        m.a.mov(
            reg(abi::REG_STATUS),
            hs | abi::STATUS_FEATURES_OK | abi::STATUS_DRIVER_OK,
        )?;
        report(m, step)?;
    }
    // 6: garbage to every offset of BAR0 (aligned dwords), then read each back.
    let mut r_loop = m.a.create_label();
    m.a.mov(eax, param(PARAM_SEED))?;
    m.a.or(eax, 1u32)?;
    m.a.xor(ecx, ecx)?;
    m.a.set_label(&mut r_loop)?;
    m.xorshift()?;
    m.a.mov(dword_ptr(ebx + ecx), eax)?;
    m.a.mov(edx, dword_ptr(ebx + ecx))?;
    m.a.add(ecx, 4u32)?;
    m.a.cmp(ecx, abi::REG_BAR_SIZE)?;
    m.a.jb(r_loop)?;
    report(m, 6)?;
    // 7: garbage to configuration space dwords 1..=15 (command, BARs, ...).
    let mut c_loop = m.a.create_label();
    m.a.push(ebx)?;
    m.a.mov(ebx, PCI_ENABLE | (1 << 11))?; // 00:01.0, where the VMM puts pvsched
    m.a.mov(eax, param(PARAM_SEED))?;
    m.a.or(eax, 1u32)?;
    m.a.mov(ecx, 4u32)?;
    m.a.set_label(&mut c_loop)?;
    m.xorshift()?;
    m.a.push(eax)?;
    m.a.push(ecx)?;
    m.a.or(ecx, ebx)?;
    m.a.push(eax)?;
    m.a.mov(eax, ecx)?;
    m.a.mov(dx, u32::from(PCI_CONFIG_ADDRESS))?;
    m.a.out(dx, eax)?;
    m.a.pop(eax)?;
    m.a.mov(dx, u32::from(PCI_CONFIG_DATA))?;
    m.a.out(dx, eax)?;
    m.a.pop(ecx)?;
    m.a.pop(eax)?;
    m.a.add(ecx, 4u32)?;
    m.a.cmp(ecx, 0x40u32)?;
    m.a.jb(c_loop)?;
    m.a.pop(ebx)?;
    m.event(code::HOSTILE_ERROR, 7 << 16)?;
    m.a.mov(eax, t.passive)?;
    m.a.jmp(eax)
}

fn emit_handlers(
    m: &mut Asm,
    l: &mut Labels,
    done: &CodeLabel,
) -> std::result::Result<(), IcedError> {
    let mut fault_common = m.a.create_label();
    let mut fault_halt = m.a.create_label();
    let mut unexpected = m.a.create_label();
    let mut wake = m.a.create_label();
    let mut ping = m.a.create_label();
    let mut pong = m.a.create_label();
    let mut spin = m.a.create_label();
    let mut stop = m.a.create_label();
    let mut spurious = m.a.create_label();

    // Exceptions 0..31: one stub each, reporting its vector.
    let mut stubs = Vec::new();
    for vector in 0..32u32 {
        let mut stub = m.a.create_label();
        m.a.set_label(&mut stub)?;
        m.a.mov(eax, vector)?;
        m.a.jmp(fault_common)?;
        stubs.push(stub);
    }
    m.a.set_label(&mut fault_common)?;
    m.event_eax(code::FAULT)?;
    m.a.set_label(&mut fault_halt)?;
    m.a.cli()?;
    m.a.hlt()?;
    m.a.jmp(fault_halt)?;

    m.a.set_label(&mut unexpected)?;
    m.eoi()?;
    m.resume()?;

    // Wake (the `wakeup` workload's RT task): ask for RT first (FIFO 1,
    // HARDIRQ), so the slot says so when WAKE_ACK's port write exits to the
    // VMM (the host policy reads the slot at that exit); EOI; then clear the
    // slot (NORMAL, rt_prio 0, kern_cs 0, no wait_on) and halt again.
    m.a.set_label(&mut wake)?;
    m.a.mov(eax, abi::CS_HARDIRQ)?;
    m.a.xor(ebx, ebx)?;
    m.a.mov(ecx, 1u32)?;
    m.a.call(l.slot_write)?;
    m.event(code::WAKE_ACK, u32::from(events::VEC_WAKE))?;
    m.eoi()?;
    m.a.xor(eax, eax)?;
    m.a.xor(ebx, ebx)?;
    m.a.xor(ecx, ecx)?;
    m.a.call(l.slot_write)?;
    m.resume()?;

    m.a.set_label(&mut ping)?;
    m.partner_ebx()?;
    m.a.mov(eax, ebx)?;
    m.event_eax(code::IPI_RECV)?;
    m.partner_ebx()?;
    m.ipi_to_ebx(events::VEC_PONG)?;
    m.eoi()?;
    m.resume()?;

    m.a.set_label(&mut pong)?;
    m.partner_ebx()?;
    m.a.mov(eax, ebx)?;
    m.event_eax(code::PONG_RECV)?;
    m.eoi()?;
    m.resume()?;

    m.a.set_label(&mut spin)?;
    m.partner_ebx()?;
    m.a.mov(dword_ptr(ebx * 4 + (PARAMS_ADDR + PARAM_ANSWERED)), 1u32)?;
    m.a.mov(eax, ebx)?;
    m.event_eax(code::SPIN_ANSWERED)?;
    m.eoi()?;
    m.resume()?;

    // Stop: halt for good if the VMM set the stop flag, else carry on.
    m.a.set_label(&mut stop)?;
    m.eoi()?;
    m.a.cmp(param(PARAM_STOP), 0u32)?;
    m.a.jne(*done)?;
    m.resume()?;

    m.a.set_label(&mut spurious)?;
    m.resume()?;

    let mut handlers = Vec::with_capacity(IDT_ENTRIES as usize);
    for vector in 0..IDT_ENTRIES as usize {
        let label = match vector {
            v if v < 32 => stubs[v],
            v if v == usize::from(events::VEC_WAKE) => wake,
            v if v == usize::from(events::VEC_PING) => ping,
            v if v == usize::from(events::VEC_PONG) => pong,
            v if v == usize::from(events::VEC_SPIN) => spin,
            v if v == usize::from(events::VEC_STOP) => stop,
            v if v == usize::from(events::VEC_SPURIOUS) => spurious,
            _ => unexpected,
        };
        handlers.push(label);
    }
    l.handlers = handlers;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind, Register};

    /// What an interrupt handler does that the host can see, in order.
    #[derive(Debug, PartialEq, Eq)]
    enum Step {
        /// `call slot_write` with these register values (call target).
        SlotWrite {
            kern_cs: Option<u32>,
            wait_on: Option<u32>,
            rt_prio: Option<u32>,
            target: u64,
        },
        /// `out dx, eax` with this EAX.
        Out(Option<u32>),
        /// `wrmsr` to this MSR.
        Wrmsr(Option<u32>),
        /// The indirect jump to the resume address.
        Resume,
    }

    /// Decode the handler of `vector` up to its resume jump, following the
    /// constants loaded into EAX, EBX, ECX.
    fn handler_steps(p: &GuestProgram, vector: u8) -> Vec<Step> {
        let start = u64::from(p.handlers[usize::from(vector)]);
        let off = usize::try_from(start - CODE_ADDR).unwrap();
        let mut d = Decoder::with_ip(32, &p.code[off..], start, DecoderOptions::NONE);
        let mut regs = [None::<u32>; 3]; // EAX, EBX, ECX
        let idx = |r: Register| match r {
            Register::EAX => Some(0),
            Register::EBX => Some(1),
            Register::ECX => Some(2),
            _ => None,
        };
        let mut steps = Vec::new();
        for ins in &mut d {
            assert!(!ins.is_invalid());
            let op0_reg = (ins.op_count() > 0 && ins.op0_kind() == OpKind::Register)
                .then(|| ins.op0_register());
            match ins.mnemonic() {
                Mnemonic::Call => {
                    steps.push(Step::SlotWrite {
                        kern_cs: regs[0],
                        wait_on: regs[1],
                        rt_prio: regs[2],
                        target: ins.near_branch_target(),
                    });
                    regs = [None; 3];
                }
                Mnemonic::Out => steps.push(Step::Out(regs[0])),
                Mnemonic::Wrmsr => steps.push(Step::Wrmsr(regs[2])),
                Mnemonic::Jmp if ins.op0_kind() == OpKind::Memory => {
                    steps.push(Step::Resume);
                    break;
                }
                Mnemonic::Mov if matches!(ins.op1_kind(), OpKind::Immediate32) => {
                    if let Some(i) = op0_reg.and_then(idx) {
                        regs[i] = Some(ins.immediate32());
                    }
                }
                Mnemonic::Xor
                    if ins.op1_kind() == OpKind::Register
                        && op0_reg == Some(ins.op1_register()) =>
                {
                    if let Some(i) = op0_reg.and_then(idx) {
                        regs[i] = Some(0);
                    }
                }
                _ => {
                    if let Some(i) = op0_reg.and_then(idx) {
                        regs[i] = None;
                    }
                }
            }
        }
        steps
    }

    /// The wake handler asks for RT before the WAKE_ACK exit (where the
    /// host policy reads the slot) and clears the slot after its EOI.
    #[test]
    fn wake_handler_asks_for_rt_before_its_ack_and_clears_after_eoi() {
        let p = build().unwrap();
        let steps = handler_steps(&p, events::VEC_WAKE);
        let Some(Step::SlotWrite { target, .. }) = steps.first() else {
            panic!("{steps:?}");
        };
        let target = *target;
        assert_eq!(
            steps,
            [
                Step::SlotWrite {
                    kern_cs: Some(abi::CS_HARDIRQ),
                    wait_on: Some(abi::WAIT_NONE),
                    rt_prio: Some(1),
                    target,
                },
                Step::Out(Some(code::WAKE_ACK << 24 | u32::from(events::VEC_WAKE))),
                Step::Wrmsr(Some(MSR_X2APIC_EOI)),
                Step::SlotWrite {
                    kern_cs: Some(0),
                    wait_on: Some(abi::WAIT_NONE),
                    rt_prio: Some(0),
                    target,
                },
                Step::Resume,
            ]
        );
    }

    /// The stop handler leaves the slot alone (greedy keeps asking).
    #[test]
    fn stop_handler_does_not_write_the_slot() {
        let p = build().unwrap();
        let steps = handler_steps(&p, events::VEC_STOP);
        assert!(
            !steps.iter().any(|s| matches!(s, Step::SlotWrite { .. })),
            "{steps:?}"
        );
    }
}
