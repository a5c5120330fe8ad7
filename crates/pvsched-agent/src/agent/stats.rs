//! What a registered VM reports: per-thread policy and applier figures,
//! decisions, corrections and decision-to-applied latency.

use super::VmHandle;
use crate::intf::gid;
use pvsched_util::lock;

/// Statistics of one registered thread (a vCPU or an emulator thread).
#[derive(Clone, Debug, Default)]
pub struct ThreadStats {
    /// Thread.
    pub tid: u32,
    /// Boosts decided by BPF.
    pub boosts: u64,
    /// Throttles decided by BPF.
    pub throttles: u64,
    /// Boosted on-CPU nanoseconds (charged at the vCPU's events).
    pub boosted_ns: u64,
    /// Boosted on-CPU nanoseconds charged to the current budget window.
    pub budget_used_ns: u64,
    /// Boosted on-CPU nanoseconds since the vCPU last blocked or halted.
    pub cont_ns: u64,
    /// Unicast IPIs recorded from this vCPU.
    pub ipis: u64,
    /// Times this vCPU's directed-yield slot target was boosted.
    pub slot_hits: u64,
    /// Current directed-yield slot (+1, 0 = none).
    pub yield_slot: u32,
    /// Last confirmed IPI receiver (+1).
    pub last_ipi_target: u32,
    /// Currently decided boost.
    pub boost: u32,
    /// Its priority.
    pub boost_prio: i32,
    /// 1 while throttled.
    pub throttled: u32,
    /// sched_setattr boosts the agent applied.
    pub boosts_applied: u64,
    /// Times reconciliation corrected the thread (lost decision record,
    /// failed syscall, outside change while boosted).
    pub corrections: u64,
    /// Failed syscalls.
    pub errors: u64,
}

/// Per-VM statistics.
#[derive(Clone, Debug, Default)]
pub struct VmStats {
    /// By slot index.
    pub vcpus: Vec<ThreadStats>,
    /// The emulator threads, in [`VmSpec::emulator_tids`] order (no IPI
    /// or yield figures).
    pub emulators: Vec<ThreadStats>,
    /// Decisions the applier handled for this VM.
    pub decisions: u64,
    /// Decisions the ring buffer dropped (all VMs); reconciliation corrects
    /// the threads they concerned at the next tick.
    pub dropped: u64,
    /// Corrections made by reconciliation in this VM.
    pub corrections: u64,
    /// Decision → applied latency samples.
    pub apply_samples: usize,
    /// p50, ns.
    pub apply_p50_ns: u64,
    /// p99, ns.
    pub apply_p99_ns: u64,
}

impl VmHandle {
    /// Statistics.
    pub fn stats(&self) -> VmStats {
        let obj = lock(&self.inner.obj);
        let reg = lock(&self.inner.reg);
        let mut out = VmStats::default();
        if let Ok(s) = obj.stats() {
            out.dropped = s.dropped;
        }
        let nr = self.spec.vcpu_tids.len();
        for (i, &tid) in self.threads().enumerate() {
            let gid = gid(self.vm_id, i as u32);
            let mut vs = ThreadStats {
                tid,
                ..Default::default()
            };
            if let Ok(v) = obj.vcpu(gid) {
                vs.boosts = v.boosts;
                vs.throttles = v.throttles;
                vs.boosted_ns = v.boosted_ns;
                vs.budget_used_ns = v.budget_used;
                vs.cont_ns = v.cont_ns;
                vs.ipis = v.ipis;
                vs.slot_hits = v.slot_hits;
                vs.yield_slot = v.yield_slot;
                vs.last_ipi_target = v.last_ipi_target;
                vs.boost = v.boost;
                vs.boost_prio = v.boost_prio;
                vs.throttled = v.throttled;
            }
            if let Some(t) = reg.threads.get(&gid) {
                vs.boosts_applied = t.boosts_applied;
                vs.corrections = t.corrections;
                vs.errors = t.errors;
            }
            if i < nr {
                out.vcpus.push(vs);
            } else {
                out.emulators.push(vs);
            }
        }
        if let Some(vm) = reg.vms.get(&self.vm_id) {
            out.decisions = vm.decisions;
            out.corrections = vm.corrections;
            let mut l = vm.latencies.clone();
            l.sort_unstable();
            out.apply_samples = l.len();
            out.apply_p50_ns = pvsched_util::percentile(&l, 50.0).unwrap_or(0);
            out.apply_p99_ns = pvsched_util::percentile(&l, 99.0).unwrap_or(0);
        }
        out
    }
}
