//! Snapshot of a whole VM, and its restore in another process: what KVM
//! holds of each vCPU (registers, segments, FPU/SSE/AVX state, local APIC,
//! MSRs, pending events, run state), the in-kernel PICs and IOAPIC, the
//! KVM clock, guest RAM, BAR2's bytes and the device's own state
//! ([`DeviceSnapshot`]), with what the VMM's monitor learnt at boot.
//!
//! A snapshot is a directory: `vm.json` (everything but memory), `ram.bin`
//! (guest RAM) and, in device-region mode, `region.bin` (BAR2). `vm.json`
//! is written last, under a temporary name renamed into place, so a
//! directory with a `vm.json` holds a whole snapshot.
//!
//! Restore checks what it reads before KVM or the device sees it: the
//! format, sizes against the configuration, and the device state through
//! [`pvsched_device::PvschedDevice::restore`], which re-validates the
//! region as it would a guest's handshake. KVM validates the vCPU state.

use crate::guest::Workload;
use crate::monitor::BootReport;
use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_clock_data,
    kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pvsched_device::{DeviceSnapshot, RegionMode};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Version of the snapshot directory's format.
pub const FORMAT: u32 = 1;
/// Everything but memory, JSON.
pub const STATE_FILE: &str = "vm.json";
/// Guest RAM, byte for byte from guest address 0.
pub const RAM_FILE: &str = "ram.bin";
/// BAR2's bytes (device-region mode).
pub const REGION_FILE: &str = "region.bin";

/// The in-kernel interrupt controllers a snapshot holds, by KVM chip id.
const IRQCHIPS: [u32; 3] = [
    KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQCHIP_IOAPIC,
];

/// Errors taking, writing, reading or restoring a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A KVM ioctl failed.
    #[error("{what} failed: {source}")]
    Kvm {
        /// The operation (and vCPU).
        what: String,
        /// KVM error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A file of the snapshot could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `vm.json` is not a snapshot this version reads.
    #[error("{path}: not a pvsched VM snapshot: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The snapshot is of another format, or its parts do not fit together.
    #[error("snapshot {0}")]
    Invalid(String),
    /// The device runs in its own process, whose state this VMM cannot
    /// read yet.
    #[error(
        "a VM whose device runs sandboxed cannot be snapshotted yet (its state is the device \
         process's); run it with --device-mode in-process"
    )]
    Sandboxed,
    /// The VM is not running, or a vCPU ended by itself.
    #[error("the VM cannot be snapshotted: {0}")]
    NotRunning(String),
}

fn kvm_err(what: impl Into<String>) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    let what = what.into();
    move |source| Error::Kvm { what, source }
}

/// What KVM holds of one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    /// Run state (runnable, halted...).
    pub mp_state: kvm_mp_state,
    /// General registers.
    pub regs: kvm_regs,
    /// Segments, control registers, APIC base.
    pub sregs: kvm_sregs,
    /// FPU, SSE and AVX state (XSAVE layout).
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Local APIC registers (timer, pending interrupts).
    pub lapic: kvm_lapic_state,
    /// Every MSR KVM lists that this vCPU could read: (index, value).
    pub msrs: Vec<(u32, u64)>,
    /// Pending exceptions, interrupts, NMIs and their masks.
    pub events: kvm_vcpu_events,
}

/// Everything of a VM but its memory (`vm.json`).
#[derive(Serialize, Deserialize)]
pub struct VmState {
    /// [`FORMAT`].
    pub format: u32,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM bytes.
    pub ram_size: u64,
    /// Region mode the guest negotiated.
    pub region: RegionMode,
    /// What the test guest runs.
    pub workload: Workload,
    /// Features the device offered.
    pub device_features: u64,
    /// Slot updates of the guest's start-up burst.
    pub slot_burst: u32,
    /// The hostile workload's seed.
    pub seed: u32,
    /// The greedy workload's rt_prio.
    pub greedy_rt_prio: u32,
    /// x2APIC ID of each vCPU.
    pub apic_ids: Vec<u32>,
    /// The KVM clock.
    pub clock: kvm_clock_data,
    /// The PICs and the IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    /// Each vCPU's state, by index.
    pub vcpu: Vec<VcpuState>,
    /// The device's guest-visible state.
    pub device: DeviceSnapshot,
    /// What each vCPU reported at boot (the restored guest does not boot
    /// again).
    pub boot: Vec<BootReport>,
    /// Workload events the guest had reported.
    pub events: u64,
}

impl VmState {
    /// The configuration of the VM this state belongs to, with the device
    /// in process and no policy; the caller adds its policy's sink.
    pub fn config(&self) -> crate::VmConfig {
        let mut cfg = crate::VmConfig::new(self.vcpus, self.workload);
        cfg.ram_size = self.ram_size;
        cfg.region = self.region;
        cfg.device_features = self.device_features;
        cfg.slot_burst = self.slot_burst;
        cfg.seed = self.seed;
        cfg.greedy_rt_prio = self.greedy_rt_prio;
        cfg
    }
}

/// A VM's snapshot in memory.
pub struct Snapshot {
    /// `vm.json`.
    pub state: VmState,
    /// Guest RAM.
    pub ram: Vec<u8>,
    /// BAR2's bytes, in device-region mode.
    pub region: Option<Vec<u8>>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_owned(),
        source,
    }
}

/// Removes `path` if it exists.
fn remove_if_there(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}

impl Snapshot {
    /// Writes the snapshot into directory `dir` (created if missing; the
    /// files of an earlier snapshot there are replaced).
    pub fn write(&self, dir: &Path) -> Result<(), Error> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let state = dir.join(STATE_FILE);
        // A half-written snapshot must not look whole: vm.json goes first.
        remove_if_there(&state)?;
        let ram = dir.join(RAM_FILE);
        std::fs::write(&ram, &self.ram).map_err(io_err(&ram))?;
        let region = dir.join(REGION_FILE);
        match &self.region {
            Some(bytes) => std::fs::write(&region, bytes).map_err(io_err(&region))?,
            None => remove_if_there(&region)?,
        }
        let json = serde_json::to_vec(&self.state).map_err(|source| Error::Json {
            path: state.clone(),
            source,
        })?;
        let tmp = dir.join(format!("{STATE_FILE}.tmp"));
        std::fs::write(&tmp, json).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &state).map_err(io_err(&state))
    }

    /// Reads the snapshot in directory `dir` and checks that its parts fit
    /// together.
    pub fn read(dir: &Path) -> Result<Self, Error> {
        let path = dir.join(STATE_FILE);
        let json = std::fs::read(&path).map_err(io_err(&path))?;
        let state: VmState =
            serde_json::from_slice(&json).map_err(|source| Error::Json { path, source })?;
        if state.format != FORMAT {
            return Err(Error::Invalid(format!(
                "format {} (this pvsched reads {FORMAT})",
                state.format
            )));
        }
        let n = state.vcpus as usize;
        if state.vcpu.len() != n || state.apic_ids.len() != n || state.boot.len() != n {
            return Err(Error::Invalid(format!(
                "of {n} vCPUs holds {} vCPU states, {} APIC IDs and {} boot reports",
                state.vcpu.len(),
                state.apic_ids.len(),
                state.boot.len()
            )));
        }
        if state.irqchips.len() != IRQCHIPS.len() {
            return Err(Error::Invalid(format!(
                "holds {} interrupt controllers, not {}",
                state.irqchips.len(),
                IRQCHIPS.len()
            )));
        }
        let ram_path = dir.join(RAM_FILE);
        let ram = std::fs::read(&ram_path).map_err(io_err(&ram_path))?;
        if ram.len() as u64 != state.ram_size {
            return Err(Error::Invalid(format!(
                "{} holds {} bytes, the VM has {}",
                ram_path.display(),
                ram.len(),
                state.ram_size
            )));
        }
        let region_path = dir.join(REGION_FILE);
        let region = match std::fs::read(&region_path) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_err(&region_path)(e)),
        };
        Ok(Snapshot { state, ram, region })
    }
}

/// The MSRs KVM can save and restore (`KVM_GET_MSR_INDEX_LIST`).
pub(crate) fn msr_list(kvm: &Kvm) -> Result<Vec<u32>, Error> {
    kvm.get_msr_index_list()
        .map(|l| l.as_slice().to_vec())
        .map_err(kvm_err("KVM_GET_MSR_INDEX_LIST"))
}

/// Reads vCPU `index`'s state; `msrs` are the MSRs to try (those this vCPU
/// cannot read are left out).
pub(crate) fn save_vcpu(vcpu: &VcpuFd, index: usize, msrs: &[u32]) -> Result<VcpuState, Error> {
    let at = |what: &str| format!("vCPU {index}: {what}");
    let mut saved = Vec::with_capacity(msrs.len());
    for &msr in msrs {
        let mut one = Msrs::from_entries(&[kvm_msr_entry {
            index: msr,
            ..Default::default()
        }])
        .map_err(|e| Error::Invalid(format!("MSR list: {e:?}")))?;
        // KVM reads entries until the first it cannot: 1 means read.
        if vcpu
            .get_msrs(&mut one)
            .map_err(kvm_err(at("KVM_GET_MSRS")))?
            == 1
        {
            saved.push((msr, one.as_slice()[0].data));
        }
    }
    Ok(VcpuState {
        mp_state: vcpu
            .get_mp_state()
            .map_err(kvm_err(at("KVM_GET_MP_STATE")))?,
        regs: vcpu.get_regs().map_err(kvm_err(at("KVM_GET_REGS")))?,
        sregs: vcpu.get_sregs().map_err(kvm_err(at("KVM_GET_SREGS")))?,
        xsave: vcpu.get_xsave().map_err(kvm_err(at("KVM_GET_XSAVE")))?,
        xcrs: vcpu.get_xcrs().map_err(kvm_err(at("KVM_GET_XCRS")))?,
        debugregs: vcpu
            .get_debug_regs()
            .map_err(kvm_err(at("KVM_GET_DEBUGREGS")))?,
        lapic: vcpu.get_lapic().map_err(kvm_err(at("KVM_GET_LAPIC")))?,
        msrs: saved,
        events: vcpu
            .get_vcpu_events()
            .map_err(kvm_err(at("KVM_GET_VCPU_EVENTS")))?,
    })
}

/// Sets vCPU `index`'s state from `s`, in the order KVM needs: the APIC
/// base (in the segments) before the local APIC's registers, the MSRs
/// after it, pending events last.
pub(crate) fn load_vcpu(vcpu: &VcpuFd, index: usize, s: &VcpuState) -> Result<(), Error> {
    let at = |what: &str| format!("vCPU {index}: {what}");
    vcpu.set_mp_state(s.mp_state)
        .map_err(kvm_err(at("KVM_SET_MP_STATE")))?;
    vcpu.set_regs(&s.regs)
        .map_err(kvm_err(at("KVM_SET_REGS")))?;
    vcpu.set_sregs(&s.sregs)
        .map_err(kvm_err(at("KVM_SET_SREGS")))?;
    // SAFETY: KVM reads at most its XSAVE buffer size from the struct,
    // which is more than 4096 bytes only for a VM granted dynamic XSAVE
    // features (AMX, arch_prctl ARCH_REQ_XCOMP_GUEST_PERM); this VMM
    // never asks for them, so the whole read is within `s.xsave`.
    unsafe { vcpu.set_xsave(&s.xsave) }.map_err(kvm_err(at("KVM_SET_XSAVE")))?;
    vcpu.set_xcrs(&s.xcrs)
        .map_err(kvm_err(at("KVM_SET_XCRS")))?;
    vcpu.set_debug_regs(&s.debugregs)
        .map_err(kvm_err(at("KVM_SET_DEBUGREGS")))?;
    vcpu.set_lapic(&s.lapic)
        .map_err(kvm_err(at("KVM_SET_LAPIC")))?;
    let entries: Vec<kvm_msr_entry> = s
        .msrs
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    for chunk in entries.chunks(64) {
        let msrs = Msrs::from_entries(chunk)
            .map_err(|e| Error::Invalid(format!("vCPU {index}: MSRs: {e:?}")))?;
        let set = vcpu.set_msrs(&msrs).map_err(kvm_err(at("KVM_SET_MSRS")))?;
        if set != chunk.len() {
            // KVM stops at the first MSR it refuses.
            return Err(Error::Invalid(format!(
                "vCPU {index}: KVM refused MSR {:#x} = {:#x}",
                chunk[set].index, chunk[set].data
            )));
        }
    }
    vcpu.set_vcpu_events(&s.events)
        .map_err(kvm_err(at("KVM_SET_VCPU_EVENTS")))
}

/// The PICs and the IOAPIC.
pub(crate) fn save_irqchips(vm: &VmFd) -> Result<Vec<kvm_irqchip>, Error> {
    IRQCHIPS
        .iter()
        .map(|&chip_id| {
            let mut chip = kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            vm.get_irqchip(&mut chip)
                .map_err(kvm_err(format!("KVM_GET_IRQCHIP {chip_id}")))?;
            Ok(chip)
        })
        .collect()
}

/// Sets the PICs and the IOAPIC from `chips` (one each, by chip id).
pub(crate) fn load_irqchips(vm: &VmFd, chips: &[kvm_irqchip]) -> Result<(), Error> {
    for (chip, id) in chips.iter().zip(IRQCHIPS) {
        if chip.chip_id != id {
            return Err(Error::Invalid(format!(
                "interrupt controller {} where {id} belongs",
                chip.chip_id
            )));
        }
        vm.set_irqchip(chip)
            .map_err(kvm_err(format!("KVM_SET_IRQCHIP {id}")))?;
    }
    Ok(())
}

/// The KVM clock.
pub(crate) fn save_clock(vm: &VmFd) -> Result<kvm_clock_data, Error> {
    vm.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))
}

/// Sets the KVM clock to `clock`'s value: the guest's time resumes where
/// it stopped (flags cleared: KVM takes no other on set).
pub(crate) fn load_clock(vm: &VmFd, clock: &kvm_clock_data) -> Result<(), Error> {
    let c = kvm_clock_data {
        clock: clock.clock,
        ..Default::default()
    };
    vm.set_clock(&c).map_err(kvm_err("KVM_SET_CLOCK"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pvsched-snap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_missing_or_foreign_snapshot_is_refused_with_its_path() {
        let d = dir("missing");
        let e = Snapshot::read(&d).err().unwrap();
        assert!(matches!(e, Error::Io { .. }), "{e}");
        assert!(e.to_string().contains(STATE_FILE), "{e}");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(STATE_FILE), b"{\"format\": 1}").unwrap();
        let e = Snapshot::read(&d).err().unwrap();
        assert!(matches!(e, Error::Json { .. }), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
