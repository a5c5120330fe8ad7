//! S3's measurements that need no VM: BPF run-time statistics switched on
//! for the bench (`BPF_ENABLE_STATS`, the fd form of
//! `sysctl kernel.bpf_stats_enabled=1`: on while the fd is open, back off
//! when it is closed, also if the bench is killed), the device's handshake
//! as host code (in-process device, no guest), and bytes per vCPU from
//! the ABI layout and the agent's map definitions.

use pvsched_abi as abi;
use pvsched_agent::intf::{
    APIC_FAST, MAX_VCPUS_PER_VM, MAX_VMS, PvsTidHint, PvsVcpu, REGION_STRIDE, THREADS_PER_VM,
    TID_HINTS,
};
use pvsched_device::testing::{device_handshake, reg_write};
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
use serde_json::{Value, json};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;
use vm_memory::MmapRegion;

/// Errors of the cost measurements.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    /// BPF_ENABLE_STATS failed (needs root / CAP_SYS_ADMIN).
    #[error("enabling BPF run-time statistics (BPF_ENABLE_STATS) failed: {0}; run as root")]
    Stats(#[source] std::io::Error),
    /// The in-process device could not be built.
    #[error("building an in-process pvsched device for the handshake timing failed: {0}")]
    Device(String),
}

/// `BPF_ENABLE_STATS` and `BPF_STATS_RUN_TIME` of the kernel's uapi.
const BPF_ENABLE_STATS: libc::c_long = 32;
const BPF_STATS_RUN_TIME: u32 = 0;

/// BPF run-time statistics on while this lives.
pub struct BpfStats {
    _fd: OwnedFd,
}

impl BpfStats {
    /// Switches run-time statistics on (system-wide, while held).
    pub fn enable() -> Result<BpfStats, CostError> {
        // union bpf_attr's enable_stats member: { __u32 type; }, padded.
        let attr: [u32; 2] = [BPF_STATS_RUN_TIME, 0];
        // SAFETY: bpf(BPF_ENABLE_STATS) reads `size_of_val(&attr)` bytes
        // from a live, initialised buffer; no memory is written.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_ENABLE_STATS,
                attr.as_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        if fd < 0 {
            return Err(CostError::Stats(std::io::Error::last_os_error()));
        }
        let fd = i32::try_from(fd)
            .map_err(|_| CostError::Stats(std::io::Error::other("fd out of range")))?;
        // SAFETY: `fd` was just returned by the kernel and is owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(BpfStats { _fd: fd })
    }
}

/// Host time of a full device-region handshake (BAR2 programming,
/// features, DRIVER_OK) against an in-process device, `iters` times; ns.
pub fn device_handshake_ns(iters: usize) -> Result<Vec<u64>, CostError> {
    let nr = 2;
    let mut dev = PvschedDevice::new(DeviceConfig::new(nr), Arc::new(NullSink))
        .map_err(|e| CostError::Device(e.to_string()))?;
    let size = usize::try_from(PvschedDevice::region_bar_size(nr))
        .map_err(|e| CostError::Device(e.to_string()))?;
    let backing = MmapRegion::new(size).map_err(|e| CostError::Device(e.to_string()))?;
    dev.set_device_region(Arc::new(backing))
        .map_err(|e| CostError::Device(e.to_string()))?;
    let mut out = Vec::with_capacity(iters);
    for _ in 0..iters {
        reg_write(&mut dev, abi::REG_STATUS, 0);
        let t = Instant::now();
        let st = device_handshake(&mut dev, 0xc000_0000);
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if st & abi::STATUS_DRIVER_OK == 0 {
            return Err(CostError::Device(format!(
                "the handshake ended in status {st:#x}, error {}",
                dev.error()
            )));
        }
        out.push(ns);
    }
    Ok(out)
}

/// Bytes per vCPU: the shared region (ABI layout) and the BPF maps (key +
/// value of each per-vCPU entry, from the agent's definitions), and what
/// the arrays reserve whatever the number of VMs.
pub fn bytes_per_vcpu() -> Value {
    let vcpu_value = std::mem::size_of::<PvsVcpu>();
    let tids_entry = 4 + 4; // hash: u32 tid -> u32 gid
    let apic_entry = 4; // array: slot index + 1 per (VM, APIC ID < APIC_FAST)
    let region: Vec<Value> = [1u32, 2, 4, 64]
        .into_iter()
        .map(|n| json!({ "vcpus": n, "region_bytes": abi::region_size(n) }))
        .collect();
    let threads = (MAX_VMS * THREADS_PER_VM) as usize;
    json!({
        "region_slot": abi::SLOT_SIZE,
        "region_apic_table_entry": 4,
        "region_header_per_vm": abi::HEADER_SIZE,
        "region_size": region,
        "map_vcpus_entry": vcpu_value,
        "map_tids_entry": tids_entry,
        "map_apic_entry": apic_entry,
        "maps_total": vcpu_value + tids_entry + apic_entry,
        "vcpus_array_reserved": threads * vcpu_value,
        "apic_fast_array_reserved": (MAX_VMS * APIC_FAST) as usize * 4,
        "tid_hint_array_reserved": TID_HINTS as usize * std::mem::size_of::<PvsTidHint>(),
        "regions_map_per_vm": REGION_STRIDE,
        "regions_map_per_vcpu_at_max": REGION_STRIDE / MAX_VCPUS_PER_VM,
        "note": "maps_total = bytes of one vCPU's element in the vcpus array, its tids hash entry (kernel hash element overhead extra) and its apic_fast entry; the vcpus, apic_fast and tid_hint arrays are allocated whole at load (*_reserved), and the regions array map reserves regions_map_per_vm bytes per VM whatever its vCPU count",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_reaches_driver_ok_every_time() {
        let ns = device_handshake_ns(5).unwrap();
        assert_eq!(ns.len(), 5);
        assert!(ns.iter().all(|&n| n > 0));
    }

    #[test]
    fn bytes_follow_the_abi() {
        let b = bytes_per_vcpu();
        assert_eq!(b["region_slot"], 128);
        assert_eq!(b["map_vcpus_entry"], 248);
        assert_eq!(b["maps_total"], 248 + 8 + 4);
        assert_eq!(b["vcpus_array_reserved"], 64 * 68 * 248);
        assert_eq!(b["region_size"][1]["region_bytes"], abi::region_size(2));
    }
}
