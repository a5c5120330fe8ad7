//! vCPU setup (CPUID with x2APIC, flat 32-bit protected mode) and the
//! vCPU thread's run loop.

use crate::guest::layout::{
    CODE_ADDR, GDT_ADDR, IDT_ADDR, IDT_ENTRIES, SEL_CODE, SEL_DATA, SEL_TSS, stack_top,
};
use crate::io::IoHub;
use crate::kick;
use kvm_bindings::{CpuId, KVM_MP_STATE_RUNNABLE, kvm_dtable, kvm_mp_state, kvm_regs, kvm_segment};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// CPUID.1:ECX bit advertising x2APIC.
const CPUID_1_ECX_X2APIC: u32 = 1 << 21;
const CR0_PE: u64 = 1;
const CR0_ET: u64 = 1 << 4;

/// Errors setting up a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A KVM vCPU ioctl failed.
    #[error("vCPU {index}: {what} failed: {source}")]
    Kvm {
        /// vCPU index.
        index: u32,
        /// The operation.
        what: &'static str,
        /// KVM error.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// Why a vCPU thread ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "reason", content = "detail")]
pub enum VcpuEnd {
    /// The VMM stopped it.
    Stopped,
    /// The guest triple-faulted (KVM_EXIT_SHUTDOWN).
    Shutdown,
    /// KVM could not handle something (emulation failure).
    InternalError(u32),
    /// Entry failed.
    FailEntry(u64),
    /// Another exit the VMM does not handle.
    UnhandledExit(String),
    /// `KVM_RUN` failed.
    RunError(String),
}

fn kvm_err(index: u32, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm {
        index,
        what,
        source,
    }
}

fn flat(selector: u16, type_: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Configure vCPU `index` (x2APIC ID `apic_id`) to start the test guest.
pub fn setup(vcpu: &VcpuFd, index: u32, apic_id: u32, supported: &CpuId) -> Result<(), Error> {
    set_cpuid(vcpu, index, apic_id, supported)?;
    boot_state(vcpu, index)
}

/// Gives vCPU `index` KVM's supported CPUID with x2APIC and its APIC ID
/// `apic_id`: what a new vCPU needs before any other state, its boot state
/// or a snapshot's.
pub fn set_cpuid(vcpu: &VcpuFd, index: u32, apic_id: u32, supported: &CpuId) -> Result<(), Error> {
    let mut cpuid = supported.clone();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ecx |= CPUID_1_ECX_X2APIC;
                e.ebx = (e.ebx & 0x00ff_ffff) | ((apic_id & 0xff) << 24);
            }
            0xb | 0x1f => e.edx = apic_id,
            _ => {}
        }
    }
    vcpu.set_cpuid2(&cpuid)
        .map_err(kvm_err(index, "KVM_SET_CPUID2"))
}

/// The test guest's entry state: flat 32-bit protected mode at its code,
/// vCPU `index`'s stack, runnable.
fn boot_state(vcpu: &VcpuFd, index: u32) -> Result<(), Error> {
    let mut sregs = vcpu.get_sregs().map_err(kvm_err(index, "KVM_GET_SREGS"))?;
    sregs.cs = flat(SEL_CODE, 0xb);
    let data = flat(SEL_DATA, 0x3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment {
        limit: 0x67,
        selector: SEL_TSS,
        type_: 0xb,
        db: 0,
        s: 0,
        g: 0,
        ..flat(SEL_TSS, 0xb)
    };
    sregs.gdt = kvm_dtable {
        base: GDT_ADDR,
        limit: 4 * 8 - 1,
        padding: [0; 3],
    };
    sregs.idt = kvm_dtable {
        base: IDT_ADDR,
        limit: (IDT_ENTRIES * 8 - 1) as u16,
        padding: [0; 3],
    };
    sregs.cr0 = CR0_PE | CR0_ET;
    vcpu.set_sregs(&sregs)
        .map_err(kvm_err(index, "KVM_SET_SREGS"))?;

    let top = stack_top(index);
    let regs = kvm_regs {
        rip: CODE_ADDR,
        rflags: 0x2,
        rsp: top,
        rbp: top,
        rsi: u64::from(index),
        ..Default::default()
    };
    vcpu.set_regs(&regs)
        .map_err(kvm_err(index, "KVM_SET_REGS"))?;
    // With the in-kernel irqchip, application processors wait for INIT/SIPI;
    // the VMM starts every vCPU directly, like firmware that already did it.
    vcpu.set_mp_state(kvm_mp_state {
        mp_state: KVM_MP_STATE_RUNNABLE,
    })
    .map_err(kvm_err(index, "KVM_SET_MP_STATE"))?;
    Ok(())
}

/// The vCPU thread body: run until `running` is cleared or the guest dies.
/// Hands the vCPU back, so that a snapshot can read its state once the
/// thread has ended.
pub fn run_loop(
    mut vcpu: VcpuFd,
    index: u32,
    io: Arc<IoHub>,
    running: Arc<AtomicBool>,
) -> (VcpuEnd, VcpuFd) {
    let run_ptr: *mut kvm_bindings::kvm_run = vcpu.get_kvm_run();
    // SAFETY: the kvm_run mapping belongs to `vcpu`, which lives until the
    // end of this function; `unregister` runs before it is dropped.
    unsafe { kick::register(run_ptr) };
    let end = loop {
        if !running.load(Ordering::Acquire) {
            break VcpuEnd::Stopped;
        }
        match vcpu.run() {
            Ok(exit) => match exit {
                VcpuExit::IoOut(port, data) => io.pio_write(index, port, data),
                VcpuExit::IoIn(port, data) => io.pio_read(index, port, data),
                VcpuExit::MmioRead(addr, data) => io.mmio_read(index, addr, data),
                VcpuExit::MmioWrite(addr, data) => io.mmio_write(index, addr, data),
                VcpuExit::Intr => {}
                VcpuExit::Hlt => {
                    // Only without an in-kernel irqchip; wait for a kick.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                VcpuExit::Shutdown => break VcpuEnd::Shutdown,
                VcpuExit::InternalError => {
                    // SAFETY: KVM filled the `internal` member for this exit reason.
                    let sub = unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal.suberror };
                    break VcpuEnd::InternalError(sub);
                }
                VcpuExit::FailEntry(reason, _) => break VcpuEnd::FailEntry(reason),
                other => break VcpuEnd::UnhandledExit(format!("{other:?}")),
            },
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.set_kvm_immediate_exit(0);
            }
            Err(e) => break VcpuEnd::RunError(e.to_string()),
        }
    };
    kick::unregister();
    if end == VcpuEnd::Stopped {
        // The last exit (a port or MMIO read the VMM answered) completes
        // only in the next KVM_RUN; with immediate_exit KVM completes it
        // and returns at once without entering the guest, so that the
        // vCPU's registers are whole for a snapshot.
        vcpu.set_kvm_immediate_exit(1);
        match vcpu.run() {
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) => log::warn!("vcpu {index}: completing its last exit failed: {e}"),
            Ok(exit) => log::warn!("vcpu {index}: unexpected exit {exit:?} with immediate_exit"),
        }
        vcpu.set_kvm_immediate_exit(0);
    } else {
        log::warn!("vcpu {index} ended: {end:?}");
    }
    (end, vcpu)
}
