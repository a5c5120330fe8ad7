//! The BPF ↔ userspace records of `bpf-policy/intf.h`, in Rust, defined
//! once: the agent reads and writes the BPF maps with them and the
//! reference model keeps its state in them ([`PvsVcpu`]; decisions are
//! [`crate::Decision`], the `pvs_decision` ring record). The C header is the
//! definition; `tests/integration/intf_layout.rs` compiles it and checks every size,
//! offset and constant against this file (and the event constants of
//! [`crate::event`]).

use crate::caps::Caps;
use crate::event::{CPU_WAITERS, CPU_YIELDS, Decision, EV_MAX, PROG_MAX};

/// `PVS_MODE_NONE`: no region.
pub const MODE_NONE: u32 = 0;
/// `PVS_MODE_DEVICE`: region in the `regions` map.
pub const MODE_DEVICE: u32 = 1;
/// `PVS_MODE_GUEST`: slots at VMM addresses.
pub const MODE_GUEST: u32 = 2;

/// `PVS_KICK_OFF`: kicks never confirm a pair.
pub const KICK_OFF: u32 = 0;
/// `PVS_KICK_ON`: every kick of an idle sibling may.
pub const KICK_ON: u32 = 1;
/// `PVS_KICK_AUTO`: only a boosted sender's, of a guest without `F_WAIT_ON`.
pub const KICK_AUTO: u32 = 2;

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
    /// When a sibling vCPU's wakeup confirms a pair as an IPI does:
    /// 0 never, 1 always, 2 auto ([`crate::KickPairs`]).
    pub kick_pairs: u32,
    /// Boosted on-CPU time of all the VM's threads per window, ns
    /// (`u64::MAX` = unlimited, so the policy needs no test for "is there
    /// one").
    pub vm_budget_ns: u64,
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
            kick_pairs: c.kick_pairs.abi(),
            vm_budget_ns: c.vm_budget_ns(),
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
    /// Honour `wait_on` = `WAIT_ANY` (a vCPU spinning on a lock).
    pub lock_wait_enabled: u32,
    /// Some vCPU is latency-sensitive until (written by BPF).
    pub ls_until: u64,
    /// Start of the VM's budget window (written by BPF).
    pub window_start: u64,
    /// Boosted on-CPU ns of all its threads in this window (written by BPF).
    pub budget_used: u64,
}

impl PvsVm {
    /// This VM configuration with `caps` in force (the caps proper and the
    /// `wait_on` and `lock_wait` switches, which the BPF side keeps beside
    /// them).
    pub fn with_caps(self, caps: &Caps) -> PvsVm {
        PvsVm {
            wait_on_enabled: u32::from(caps.wait_on != crate::WaitOn::Off),
            lock_wait_enabled: caps.lock_wait as u32,
            caps: caps.into(),
            ..self
        }
    }
}

/// `struct pvs_vcpu`: one vCPU's policy state, the BPF `vcpus` map value
/// and the reference model's per-vCPU state alike ([`crate::VmModel`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvsVcpu {
    /// Thread id.
    pub tid: u32,
    /// VM id (the model keeps it in [`crate::VmModel`]).
    pub vm_id: u32,
    /// Slot index.
    pub index: u32,
    /// `ST_*`.
    pub state: u32,
    /// Guest-mode slot address in the VMM (BPF only; unused by the model).
    pub slot_addr: u64,
    /// Capped guest request: kind.
    pub req_kind: u32,
    /// Capped guest request: priority.
    pub req_prio: i32,
    /// Capped guest request: reason.
    pub req_reason: u32,
    /// Valid wait_on.
    pub wait_on: u32,
    /// Applied boost.
    pub boost: u32,
    /// Its priority.
    pub boost_prio: i32,
    /// Its reason.
    pub boost_reason: u32,
    /// 1 while throttled.
    pub throttled: u32,
    /// On-CPU boosted time is charged up to this time.
    pub acct_ns: u64,
    /// Boosted on-CPU ns since the vCPU last blocked or halted.
    pub cont_ns: u64,
    /// Budget window start.
    pub window_start: u64,
    /// Boosted on-CPU ns in this window.
    pub budget_used: u64,
    /// No boost before this.
    pub throttled_until: u64,
    /// Latency-sensitive (holds the halt boost) until this time.
    pub ls_until: u64,
    /// Last unicast IPI receiver + 1.
    pub last_ipi_target: u32,
    /// Directed-yield slot (+1).
    pub yield_slot: u32,
    /// Time of the last IPI.
    pub last_ipi_ns: u64,
    /// Target boosted on our behalf (+1): we are a waiting sender.
    pub yield_boosting: u32,
    /// The word of BPF's `full_fence()` no-op compare-and-swap (BPF only;
    /// unused by the model).
    pub fence: u32,
    /// Senders waiting on us.
    pub yield_mask: u64,
    /// Boosts started.
    pub boosts: u64,
    /// Throttles.
    pub throttles: u64,
    /// Total boosted on-CPU ns.
    pub boosted_ns: u64,
    /// IPIs recorded.
    pub ipis: u64,
    /// Times this vCPU's slot target was boosted.
    pub slot_hits: u64,
    /// The guest ran its idle task at the last slot read (`TASK_F_IDLE`).
    pub guest_idle: u32,
    /// Slot index + 1 of the vCPU this one last kicked, or 0.
    pub last_kick_target: u32,
    /// When.
    pub last_kick_ns: u64,
    /// RT priority of the guest request that last set `ls_until` (0: it
    /// was no RT request): the halt boost holds it, so a latency-sensitive
    /// vCPU keeps one priority across its halts.
    pub ls_prio: i32,
    /// `PHASE_*` ([`crate::event::PHASE_ON`]): written by the agent, changed
    /// from ON to YIELDED by the policy.
    pub phase: u32,
    /// Halts of this vCPU while a sibling vCPU was preempted.
    pub sync_halts: u64,
    /// Wake-ups of this vCPU's thread by a sibling vCPU's thread (counted
    /// by the sched_wakeup program, not by the event handler).
    pub sib_wakes: u64,
    /// How long those halts lasted, ns (halt to wake-up).
    pub sync_wait_ns: u64,
    /// When the current such halt began, 0 = none.
    pub sync_since: u64,
    /// No throughput RT boost before this time (CLOCK_MONOTONIC ns): a
    /// host thread was woken where the vCPU ran. Latency boosts (the halt
    /// boost, a guest RT task's) ignore it.
    pub host_hold_until: u64,
    /// Written by the agent: the guest's `wait_on` is not honoured for this
    /// vCPU (its VM's [`crate::WaitOn`] is `Auto` and the VM is wider than
    /// the CPUs its vCPU threads may run on).
    pub wait_on_off: u32,
    /// Padding.
    pub pad1: u32,
}

/// `struct pvs_cpu`: element `cpu` of the BPF `cpus` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvsCpu {
    /// `vcpus` key + 1 of the registered thread on the CPU, 0 for none.
    pub run_key: u32,
    /// `vcpus` keys + 1 of the threads out of their phase for this CPU's
    /// waiters, 0 for a free entry.
    pub yield_keys: [u32; CPU_YIELDS as usize],
    /// Host threads woken onto the CPU that have not run there since (0:
    /// a free entry).
    pub wait_tid: [u32; CPU_WAITERS as usize],
    /// Explicit padding (keeps `wait_at` 8-byte aligned).
    pub pad0: u32,
    /// When each was woken (CLOCK_MONOTONIC ns).
    pub wait_at: [u64; CPU_WAITERS as usize],
}

/// `struct pvs_tid_hint`: element `tid & (TID_HINTS - 1)` of the BPF
/// `tid_hint` prefilter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PvsTidHint {
    /// Registered threads whose tid falls in this element.
    pub count: u32,
    /// The one registered thread here while `count == 1`, else 0.
    pub tid: u32,
    /// Its `vcpus` key ([`crate::event::vcpu_key`]).
    pub key: u32,
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
    /// Runs of each `PROG_*` program past its prefilter.
    pub full_runs: [u64; PROG_MAX as usize],
    /// Phased vCPUs moved out of their phase for a host thread's wake-up.
    pub phase_yields: u64,
}

const _: () = {
    assert!(size_of::<PvsCaps>() == 8 * 4 + 6 * 8 + 2 * 4 + 8);
    assert!(size_of::<PvsVm>() == 16 + size_of::<PvsCaps>() + 32);
    assert!(size_of::<PvsVcpu>() == 248);
    assert!(size_of::<Decision>() == 48);
    assert!(size_of::<PvsTidHint>() == 16);
    assert!(size_of::<PvsStats>() == (EV_MAX as usize + 11 + PROG_MAX as usize) * 8);
    assert!(
        size_of::<PvsCpu>()
            == (4 + 4 * (CPU_YIELDS + CPU_WAITERS) as usize).next_multiple_of(8)
                + 8 * CPU_WAITERS as usize
    );
};

#[cfg(feature = "aya")]
mod pod {
    use super::*;

    // SAFETY: each type is #[repr(C)], made only of integers (and arrays and
    // structs of them) with natural alignment and no implicit padding (the
    // sizes are checked above and against the C compiler in
    // tests/integration/intf_layout.rs), so every bit pattern is a valid value.
    unsafe impl aya::Pod for PvsCaps {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PvsVm {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PvsVcpu {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Decision {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PvsTidHint {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PvsStats {}
}
