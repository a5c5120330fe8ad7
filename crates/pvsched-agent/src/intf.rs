//! Rust mirror of `bpf-policy/intf.h`, the BPF ↔ userspace records. The C
//! header is the definition; `tests/intf_layout.rs` compiles it and checks
//! every size, offset and constant against this file.

use pvsched_policy::Caps;

pub use pvsched_policy::event::{
    EV_MAX, GID_SHIFT, MAX_EMULATORS, MAX_VCPUS_PER_VM, MAX_VMS, R_BUDGET, R_MAX_BOOST,
    REGION_STRIDE, TID_HINTS, gid, gid_vm,
};

/// `PVS_MODE_NONE`: no region.
pub const MODE_NONE: u32 = 0;
/// `PVS_MODE_DEVICE`: region in the `regions` map.
pub const MODE_DEVICE: u32 = 1;
/// `PVS_MODE_GUEST`: slots at VMM addresses.
pub const MODE_GUEST: u32 = 2;

/// `struct pvs_caps`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvsCaps {
    /// RT allowed.
    pub allow_rt: u32,
    /// Highest RT priority.
    pub max_rt_prio: u32,
    /// Lowest nice.
    pub nice_floor: i32,
    /// RT priority of a critical section.
    pub cs_rt_prio: u32,
    /// Halt boost kind.
    pub halt_kind: u32,
    /// Halt boost priority.
    pub halt_prio: i32,
    /// Yield boost kind.
    pub yield_kind: u32,
    /// Yield boost priority.
    pub yield_prio: i32,
    /// Max continuous boost, ns.
    pub max_boost_ns: u64,
    /// Throttle time, ns.
    pub throttle_ns: u64,
    /// Budget per window, ns.
    pub budget_ns: u64,
    /// Window, ns.
    pub window_ns: u64,
    /// IPI recency window, ns.
    pub ipi_window_ns: u64,
    /// Latency-sensitive hold of the halt boost, ns.
    pub halt_hold_ns: u64,
    /// Every vCPU is latency-sensitive.
    pub halt_always: u32,
    /// Zero.
    pub pad0: u32,
}

impl From<&Caps> for PvsCaps {
    fn from(c: &Caps) -> Self {
        PvsCaps {
            allow_rt: c.allow_rt as u32,
            max_rt_prio: c.max_rt_prio,
            nice_floor: c.nice_floor,
            cs_rt_prio: c.cs_rt_prio,
            halt_kind: c.halt_boost.abi(),
            halt_prio: c.halt_prio,
            yield_kind: c.yield_boost.abi(),
            yield_prio: c.yield_prio,
            max_boost_ns: Caps::ns(c.max_boost_us),
            throttle_ns: Caps::ns(c.throttle_us),
            budget_ns: Caps::ns(c.budget_us),
            window_ns: Caps::ns(c.window_us),
            ipi_window_ns: Caps::ns(c.ipi_window_us),
            halt_hold_ns: Caps::ns(c.halt_hold_us),
            halt_always: c.halt_always as u32,
            pad0: 0,
        }
    }
}

/// `struct pvs_vm`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvsVm {
    /// 1 while registered.
    pub active: u32,
    /// Slots.
    pub nr_vcpus: u32,
    /// `MODE_*`.
    pub mode: u32,
    /// Honour wait_on.
    pub wait_on_enabled: u32,
    /// Caps.
    pub caps: PvsCaps,
    /// Emulator threads after the vCPUs.
    pub nr_emulators: u32,
    /// Zero.
    pub pad0: u32,
    /// Some vCPU is latency-sensitive until (written by BPF).
    pub ls_until: u64,
}

impl PvsVm {
    /// This VM configuration with `caps` in force (the caps proper and the
    /// `wait_on` switch, which the BPF side keeps beside them).
    pub fn with_caps(self, caps: &Caps) -> PvsVm {
        PvsVm {
            wait_on_enabled: caps.wait_on as u32,
            caps: caps.into(),
            ..self
        }
    }
}

/// `struct pvs_vcpu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct PvsVcpu {
    pub tid: u32,
    pub vm_id: u32,
    pub index: u32,
    pub state: u32,
    pub slot_addr: u64,
    pub req_kind: u32,
    pub req_prio: i32,
    pub req_reason: u32,
    pub wait_on: u32,
    pub boost: u32,
    pub boost_prio: i32,
    pub boost_reason: u32,
    pub throttled: u32,
    pub acct_ns: u64,
    pub cont_ns: u64,
    pub window_start: u64,
    pub budget_used: u64,
    pub throttled_until: u64,
    pub ls_until: u64,
    pub last_ipi_target: u32,
    pub yield_slot: u32,
    pub last_ipi_ns: u64,
    pub yield_boosting: u32,
    pub fence: u32,
    pub yield_mask: u64,
    pub boosts: u64,
    pub throttles: u64,
    pub boosted_ns: u64,
    pub ipis: u64,
    pub slot_hits: u64,
}

/// `struct pvs_decision`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvsDecision {
    /// CLOCK_MONOTONIC ns.
    pub ts: u64,
    /// Thread.
    pub tid: u32,
    /// vm_id << 10 | index.
    pub gid: u32,
    /// `BOOST_*`.
    pub kind: u32,
    /// RT prio or nice.
    pub prio: i32,
    /// `R_*`.
    pub reason: u32,
    /// `EV_*`.
    pub event: u32,
    /// No boost before this time.
    pub throttled_until: u64,
    /// Slot + 1 of the target it waits on, 0 = none.
    pub waits_on: u32,
    /// Zero.
    pub pad0: u32,
}

/// `struct pvs_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct PvsStats {
    pub events: [u64; EV_MAX as usize],
    pub decisions: u64,
    pub dropped: u64,
    pub boosts: u64,
    pub unboosts: u64,
    pub throttles: u64,
    pub ipi_pairs: u64,
    pub slot_hits: u64,
    pub torn_reads: u64,
    pub read_errors: u64,
    pub publish_busy: u64,
}

// SAFETY: each type is #[repr(C)], made only of integers (and arrays and
// structs of them) with natural alignment and no implicit padding (the sizes
// are checked below and against the C compiler in tests/intf_layout.rs), so
// every bit pattern is a valid value.
unsafe impl aya::Pod for PvsCaps {}
// SAFETY: as above.
unsafe impl aya::Pod for PvsVm {}
// SAFETY: as above.
unsafe impl aya::Pod for PvsVcpu {}
// SAFETY: as above.
unsafe impl aya::Pod for PvsDecision {}
// SAFETY: as above.
unsafe impl aya::Pod for PvsStats {}

const _: () = {
    assert!(size_of::<PvsCaps>() == 8 * 4 + 6 * 8 + 2 * 4);
    assert!(size_of::<PvsVm>() == 16 + size_of::<PvsCaps>() + 16);
    assert!(size_of::<PvsVcpu>() == 176);
    assert!(size_of::<PvsDecision>() == 48);
    assert!(size_of::<PvsStats>() == (EV_MAX as usize + 10) * 8);
};

impl PvsDecision {
    /// Parses a ring-buffer record (None if it is too short).
    pub fn from_bytes(b: &[u8]) -> Option<PvsDecision> {
        if b.len() < size_of::<PvsDecision>() {
            return None;
        }
        // SAFETY: the slice holds at least size_of::<PvsDecision>() bytes,
        // read_unaligned copes with any alignment, and every bit pattern is
        // a valid PvsDecision (integers only).
        Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<PvsDecision>()) })
    }

    /// As the model's decision type.
    pub fn to_model(&self) -> pvsched_policy::Decision {
        pvsched_policy::Decision {
            ts: self.ts,
            tid: self.tid,
            gid: self.gid,
            kind: self.kind,
            prio: self.prio,
            reason: self.reason,
            event: self.event,
            throttled_until: self.throttled_until,
            waits_on: self.waits_on,
        }
    }
}
