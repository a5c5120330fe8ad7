//! Trace events, decisions and the constants shared with the BPF program
//! (`bpf-policy/intf.h`; the agent's layout test checks they are equal).

/// `PVS_EV_*`: a vCPU was switched out (`a` = preempted).
pub const EV_SWITCH_OUT: u32 = 1;
/// `PVS_EV_*`: a vCPU was switched in.
pub const EV_SWITCH_IN: u32 = 2;
/// `PVS_EV_*`: sched_wakeup of a vCPU thread.
pub const EV_WAKEUP: u32 = 3;
/// `PVS_EV_*`: kvm_vcpu_wakeup (halt ended).
pub const EV_VCPU_WAKEUP: u32 = 4;
/// `PVS_EV_*`: kvm_apic_ipi from the vCPU (`a` = dest_id, `b` = icr_low).
pub const EV_IPI: u32 = 5;
/// `PVS_EV_*`: kvm_userspace_exit (`a` = reason).
pub const EV_USER_EXIT: u32 = 6;
/// `PVS_EV_*`: agent timer re-evaluation.
pub const EV_TICK: u32 = 7;
/// `PVS_EV_*`: the registered thread exits (sched_process_exit).
pub const EV_EXIT: u32 = 8;
/// `PVS_EV_*`: the vCPU's thread woke a sibling vCPU's thread (`a` = its
/// slot index).
pub const EV_KICK: u32 = 9;
/// `PVS_EV_*`, re-evaluation only: the VM of the gid has just entered its
/// co-scheduled phase (`a` = the host's CPUs); its vCPUs leave the phase
/// for a host thread already waiting on their CPU.
pub const EV_PHASE_ON: u32 = 10;
/// Number of event kinds (array size in the statistics).
pub const EV_MAX: u32 = 11;

/// `PVS_R_*`: the guest no longer asks.
pub const R_NONE: u32 = 0;
/// `PVS_R_*`: guest kernel critical section.
pub const R_CS: u32 = 1;
/// `PVS_R_*`: guest RT task.
pub const R_RT_TASK: u32 = 2;
/// `PVS_R_*`: guest high-priority (negative nice) task.
pub const R_NICE_TASK: u32 = 3;
/// `PVS_R_*`: halted vCPU.
pub const R_HALT: u32 = 4;
/// `PVS_R_*`: directed-yield target.
pub const R_YIELD: u32 = 5;
/// `PVS_R_*`: throttled after max continuous boost.
pub const R_MAX_BOOST: u32 = 6;
/// `PVS_R_*`: throttled, window budget used up.
pub const R_BUDGET: u32 = 7;
/// `PVS_R_*`: still throttled.
pub const R_THROTTLED: u32 = 8;
/// `PVS_R_*`: the thread exited; its TID is forgotten (never acted on
/// again, even if the kernel gives it to a new thread).
pub const R_EXITED: u32 = 9;
/// `PVS_R_*`: throttled, the VM's budget of the window (`vm_budget_us`)
/// used up.
pub const R_VM_BUDGET: u32 = 10;
/// `PVS_R_*`: a host thread waits for the CPU a co-scheduled vCPU holds
/// (woken there while the vCPU runs, or before); the vCPU leaves its phase
/// for it (the record changes no boost).
pub const R_HOST_WAKE: u32 = 11;
/// `PVS_R_*`: a host thread left the CPU and no woken one waits there any
/// more; the vCPU's phase again.
pub const R_HOST_DONE: u32 = 12;
/// `PVS_R_*`: a host thread was woken on the CPU this vCPU held with an
/// RT boost that serves throughput (a critical section, a directed yield,
/// a waiting sender's): the boost ends, and none comes back for
/// [`HOST_HOLD_NS`] (a latency-sensitive vCPU's boosts are kept).
pub const R_HOST_YIELD: u32 = 13;
/// The reasons of a throttle at one of the caps' limits (the continuous
/// limit, the thread's budget, the VM's budget), as against a unit
/// throttle or an unboost.
pub const R_LIMITS: [u32; 3] = [R_MAX_BOOST, R_BUDGET, R_VM_BUDGET];

/// `PVS_PHASE_*` (`pvs_vcpu.phase`): not co-scheduled.
pub const PHASE_FREE: u32 = 0;
/// In its VM's co-scheduled phase (SCHED_FIFO [`COSCHED_RT_PRIO`]).
pub const PHASE_ON: u32 = 1;
/// Outside it (the rest of the period).
pub const PHASE_OFF: u32 = 2;
/// In the phase's time but out of it for a host thread woken on its CPU
/// (set by the policy, from [`PHASE_ON`] only).
pub const PHASE_YIELDED: u32 = 3;
/// The SCHED_FIFO priority of a co-scheduled phase: the lowest, so every
/// boost the policy decides still outranks it.
pub const COSCHED_RT_PRIO: u32 = 1;
/// CPUs the policy's `cpus` array covers.
pub const MAX_CPUS: u32 = 1024;
/// `PVS_CPU_WAITERS`: woken host threads a CPU's record holds at once.
pub const CPU_WAITERS: u32 = 4;
/// `PVS_CPU_YIELDS`: vCPUs a CPU's record holds as out of their phase for
/// its waiters.
pub const CPU_YIELDS: u32 = 4;
/// `PVS_HOST_HOLD_NS`: how long a vCPU whose boost ended for a woken host
/// thread ([`R_HOST_YIELD`]) gets no new boost.
pub const HOST_HOLD_NS: u64 = 6_000_000;

/// `PVS_ST_*` run states.
pub const ST_UNKNOWN: u32 = 0;
/// Running on a CPU.
pub const ST_RUNNING: u32 = 1;
/// Runnable, preempted.
pub const ST_PREEMPTED: u32 = 2;
/// Blocked (halted).
pub const ST_HALTED: u32 = 3;
/// Woken from a halt, not yet on a CPU.
pub const ST_WOKEN: u32 = 4;

/// `gid = vm_id << GID_SHIFT | index`: vCPU slot indices first, then the
/// VM's emulator threads.
pub const GID_SHIFT: u32 = 10;

/// The re-evaluation entry's gid for "every thread of every active VM".
pub const GID_ALL: u32 = u32::MAX;

/// The re-evaluation entry's `now` for "the policy's own clock when it
/// runs" (`bpf_ktime_get_ns()`): a time read before the system call can be
/// older than a budget window another CPU has just started. The agent
/// passes it for every tick and kick; explicit times are for tests that
/// drive the policy through synthetic events.
pub const NOW_CLOCK: u64 = 0;

/// The gid of thread `index` of VM `vm_id` (`gid_of` in the BPF policy).
pub const fn gid(vm_id: u32, index: u32) -> u32 {
    (vm_id << GID_SHIFT) | index
}

/// The VM id of `gid` (the inverse of [`gid`]'s first argument).
pub const fn gid_vm(gid: u32) -> u32 {
    gid >> GID_SHIFT
}
/// Most vCPUs per VM the BPF maps and the 16 KiB region element hold.
pub const MAX_VCPUS_PER_VM: u32 = 64;
/// Most emulator threads (QEMU's main loop, I/O threads) per VM.
pub const MAX_EMULATORS: u32 = 4;
/// Threads (vCPUs, then emulator threads) of one VM in the BPF `vcpus` array.
pub const THREADS_PER_VM: u32 = MAX_VCPUS_PER_VM + MAX_EMULATORS;

/// The BPF `vcpus` array's key of `gid` (`vm_id * THREADS_PER_VM + index`),
/// or `None` when the gid is outside the array.
pub const fn vcpu_key(gid: u32) -> Option<u32> {
    let (vm_id, index) = (gid >> GID_SHIFT, gid & ((1 << GID_SHIFT) - 1));
    if vm_id >= MAX_VMS || index >= THREADS_PER_VM {
        None
    } else {
        Some(vm_id * THREADS_PER_VM + index)
    }
}

/// `full_runs` index of the sched_switch program.
pub const PROG_SWITCH: u32 = 0;
/// ... of sched_wakeup.
pub const PROG_WAKEUP: u32 = 1;
/// ... of kvm_vcpu_wakeup.
pub const PROG_VCPU_WAKEUP: u32 = 2;
/// ... of kvm_userspace_exit.
pub const PROG_USER_EXIT: u32 = 3;
/// ... of kvm_apic_ipi.
pub const PROG_IPI: u32 = 4;
/// Programs counted in `full_runs`.
pub const PROG_MAX: u32 = 5;
/// The BPF program of each `PROG_*` index, by name.
pub const PROG_NAMES: [&str; PROG_MAX as usize] = [
    "pvs_sched_switch",
    "pvs_sched_wakeup",
    "pvs_kvm_vcpu_wakeup",
    "pvs_kvm_userspace_exit",
    "pvs_kvm_apic_ipi",
];
/// APIC IDs below this are found through the BPF `apic_fast` array.
pub const APIC_FAST: u32 = 256;

/// Entries of the BPF `tid_hint` prefilter (a power of two).
pub const TID_HINTS: u32 = 4096;
/// Most VMs one agent serves.
pub const MAX_VMS: u32 = 64;
/// Bytes of one VM's region element in the `regions` map.
pub const REGION_STRIDE: u32 = 16384;

/// The guest-written fields the policy reads from a slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuestFields {
    /// `CS_*` bits.
    pub kern_cs: u32,
    /// `POLICY_*` of the running guest task.
    pub policy: u32,
    /// Its nice.
    pub nice: i32,
    /// Its RT priority.
    pub rt_prio: u32,
    /// Slot index + 1 of the vCPU waited for, or 0.
    pub wait_on: u32,
    /// `TASK_F_*` bits of the running guest task (0 from a driver that did
    /// not negotiate `F_TASK_FLAGS`: a user task).
    pub flags: u32,
}

/// One trace event for one vCPU (slot index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// sched_switch, vCPU is prev.
    SwitchOut {
        /// Slot index.
        vcpu: u32,
        /// Still runnable (preempted) rather than blocked.
        preempted: bool,
    },
    /// sched_switch, vCPU is next.
    SwitchIn {
        /// Slot index.
        vcpu: u32,
    },
    /// sched_wakeup.
    Wakeup {
        /// Slot index.
        vcpu: u32,
    },
    /// kvm_vcpu_wakeup.
    VcpuWakeup {
        /// Slot index.
        vcpu: u32,
    },
    /// kvm_apic_ipi sent by the vCPU.
    Ipi {
        /// Slot index of the sender.
        vcpu: u32,
        /// Destination APIC ID.
        dest_id: u32,
        /// ICR low word.
        icr_low: u32,
    },
    /// kvm_userspace_exit.
    UserExit {
        /// Slot index.
        vcpu: u32,
        /// KVM exit reason.
        reason: u32,
    },
    /// sched_wakeup of vCPU `target`'s thread, in vCPU `vcpu`'s thread
    /// (the BPF program runs it just before the target's [`Event::Wakeup`]).
    Kick {
        /// Slot index of the waking vCPU.
        vcpu: u32,
        /// Slot index of the woken vCPU.
        target: u32,
    },
    /// Agent timer.
    Tick {
        /// Slot index.
        vcpu: u32,
    },
    /// The guest rewrites its slot (no decision by itself).
    GuestWrite {
        /// Slot index.
        vcpu: u32,
        /// New contents.
        guest: GuestFields,
    },
}

impl Event {
    /// `(PVS_EV_*, vcpu, a, b)` for the BPF test-run entry, `None` for
    /// [`Event::GuestWrite`] (applied to the region directly).
    pub fn encode(&self) -> Option<(u32, u32, u64, u64)> {
        Some(match *self {
            Event::SwitchOut { vcpu, preempted } => (EV_SWITCH_OUT, vcpu, preempted as u64, 0),
            Event::SwitchIn { vcpu } => (EV_SWITCH_IN, vcpu, 0, 0),
            Event::Wakeup { vcpu } => (EV_WAKEUP, vcpu, 0, 0),
            Event::VcpuWakeup { vcpu } => (EV_VCPU_WAKEUP, vcpu, 0, 0),
            Event::Ipi {
                vcpu,
                dest_id,
                icr_low,
            } => (EV_IPI, vcpu, dest_id as u64, icr_low as u64),
            Event::UserExit { vcpu, reason } => (EV_USER_EXIT, vcpu, reason as u64, 0),
            Event::Kick { vcpu, target } => (EV_KICK, vcpu, target as u64, 0),
            Event::Tick { vcpu } => (EV_TICK, vcpu, 0, 0),
            Event::GuestWrite { .. } => return None,
        })
    }
}

/// A decision: the boost a registered thread must have from now on, with
/// its throttle and waiting target (a record whose boost did not change is
/// trace-only: a throttle was extended or the waiting target changed).
/// The same record as BPF's `struct pvs_decision` (the agent's ring buffer).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Event time (ns).
    pub ts: u64,
    /// Thread id.
    pub tid: u32,
    /// `vm_id << GID_SHIFT | index`.
    pub gid: u32,
    /// `BOOST_*` (NONE = back to baseline).
    pub kind: u32,
    /// RT priority or nice.
    pub prio: i32,
    /// `R_*`.
    pub reason: u32,
    /// `EV_*` that caused it.
    pub event: u32,
    /// No boost before this time (ns).
    pub throttled_until: u64,
    /// Slot + 1 of the target this vCPU waits on (boosted on its behalf),
    /// 0 = none.
    pub waits_on: u32,
    /// Zero (the C record's padding).
    pub pad0: u32,
}

impl Decision {
    /// Parses a `pvs_decision` ring-buffer record (None if it is too short).
    pub fn from_bytes(b: &[u8]) -> Option<Decision> {
        if b.len() < size_of::<Decision>() {
            return None;
        }
        // SAFETY: the slice holds at least size_of::<Decision>() bytes,
        // read_unaligned copes with any alignment, and every bit pattern is
        // a valid Decision (#[repr(C)], integers only, no implicit padding).
        Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<Decision>()) })
    }
}
