//! What a registered VM reports: per-thread policy and applier figures,
//! decisions, corrections and decision-to-applied latency.

use super::VmHandle;
use crate::intf::gid;
use serde::{Deserialize, Serialize};

/// What pvsched counts for one registered thread, defined once: the agent
/// fills it, pvschedd's status carries it (flattened: one JSON field per
/// counter, under these names), its metrics expose every counter in
/// [`ThreadCounters::ALL`], and `pvsched status`, `pvsched run` and the
/// benchmarks read it. A new per-thread figure is a field here and a line
/// in `ALL`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ThreadCounters {
    /// Boosts the policy decided.
    pub boosts: u64,
    /// Throttles (continuous or budget limit) the policy decided.
    pub throttles: u64,
    /// sched_setattr calls that put the thread in a boosted state (a
    /// boost whose priority changes while it lasts counts again).
    pub boosts_applied: u64,
    /// Boosted on-CPU time, ns (charged at the vCPU's events).
    pub boosted_ns: u64,
    /// Times reconciliation corrected the thread (lost decision record,
    /// failed syscall, outside change while boosted).
    pub corrections: u64,
    /// Failed sched_setattr calls.
    pub errors: u64,
    /// Co-scheduling phase changes the agent applied (caps `cosched_us`).
    pub phase_changes: u64,
    /// Times the thread left its co-scheduled phase for a host thread
    /// woken on its CPU.
    pub phase_yields: u64,
    /// Times the thread's RT boost ended for a host thread woken on its
    /// CPU (a throughput boost; a latency-sensitive vCPU keeps its own).
    pub boost_yields: u64,
    /// Halts of this vCPU while a sibling vCPU was preempted (how much the
    /// guest's vCPUs wait for each other: what co-scheduling serves).
    pub sync_halts: u64,
    /// Wake-ups of this vCPU by a sibling vCPU (IPIs to a halted vCPU).
    pub sib_wakes: u64,
    /// How long those halts beside a preempted sibling lasted, ns.
    pub sync_wait_ns: u64,
}

/// One counter of [`ThreadCounters`] as a metric family.
#[derive(Clone, Copy, Debug)]
pub struct Counter {
    /// The metric family's name.
    pub metric: &'static str,
    /// Its help text.
    pub help: &'static str,
    /// The counter's value in the family's unit.
    pub value: fn(&ThreadCounters) -> f64,
}

impl ThreadCounters {
    /// Every counter as a Prometheus counter family (`vm` and `thread`
    /// labels), in exposition order.
    pub const ALL: [Counter; 12] = [
        Counter {
            metric: "pvsched_boosts_total",
            help: "Boosts the policy decided per thread.",
            value: |c| c.boosts as f64,
        },
        Counter {
            metric: "pvsched_boosts_applied_total",
            help: "sched_setattr calls that put the thread in a boosted state, per thread (a boost whose priority changes while it lasts counts again, so this can exceed pvsched_boosts_total).",
            value: |c| c.boosts_applied as f64,
        },
        Counter {
            metric: "pvsched_throttles_total",
            help: "Throttles (continuous or budget limit) per thread.",
            value: |c| c.throttles as f64,
        },
        Counter {
            metric: "pvsched_boosted_seconds_total",
            help: "Boosted on-CPU time per thread.",
            value: |c| c.boosted_ns as f64 / 1e9,
        },
        Counter {
            metric: "pvsched_cosched_phase_changes_total",
            help: "Co-scheduling phase changes applied per thread (caps cosched_us).",
            value: |c| c.phase_changes as f64,
        },
        Counter {
            metric: "pvsched_cosched_phase_yields_total",
            help: "Times a thread left its co-scheduled phase for a host thread woken on its CPU.",
            value: |c| c.phase_yields as f64,
        },
        Counter {
            metric: "pvsched_boost_yields_total",
            help: "Times a thread's RT boost ended for a host thread woken on its CPU.",
            value: |c| c.boost_yields as f64,
        },
        Counter {
            metric: "pvsched_vcpu_sync_halts_total",
            help: "Halts of a vCPU while a sibling vCPU was preempted (what co-scheduling serves).",
            value: |c| c.sync_halts as f64,
        },
        Counter {
            metric: "pvsched_vcpu_sibling_wakeups_total",
            help: "Wake-ups of a vCPU by a sibling vCPU (IPIs to a halted vCPU).",
            value: |c| c.sib_wakes as f64,
        },
        Counter {
            metric: "pvsched_vcpu_sync_wait_seconds_total",
            help: "Time a vCPU spent halted after halting beside a preempted sibling vCPU.",
            value: |c| c.sync_wait_ns as f64 / 1e9,
        },
        Counter {
            metric: "pvsched_corrections_total",
            help: "Reconciliation corrections per thread.",
            value: |c| c.corrections as f64,
        },
        Counter {
            metric: "pvsched_setattr_errors_total",
            help: "Failed sched_setattr calls per thread.",
            value: |c| c.errors as f64,
        },
    ];
}

/// Statistics of one registered thread (a vCPU or an emulator thread):
/// its counters and the policy's state of it now.
#[derive(Clone, Debug, Default)]
pub struct ThreadStats {
    /// Thread.
    pub tid: u32,
    /// What pvsched counted for it.
    pub counters: ThreadCounters,
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
    /// The policy ignores the guest's `wait_on` for this vCPU: its VM's
    /// `wait_on` is "auto" and the VM is wider than its CPUs.
    pub wait_on_off: bool,
}

/// Upper bounds of the decision → applied latency buckets, ns (the
/// histogram's `le`; one more bucket holds the rest).
pub const APPLY_BUCKETS_NS: [u64; 10] = [
    10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// Every decision → applied latency of a VM since it registered, in the
/// buckets of [`APPLY_BUCKETS_NS`] (not cumulative: `counts[i]` are those
/// above bucket i-1's bound and at most bucket i's; the last, above all).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencyHistogram {
    /// Per bucket, then the overflow.
    pub counts: Vec<u64>,
    /// Sum of every latency, ns.
    pub sum_ns: u64,
}

impl LatencyHistogram {
    /// Counts one latency of `ns`.
    pub fn observe(&mut self, ns: u64) {
        if self.counts.len() != APPLY_BUCKETS_NS.len() + 1 {
            self.counts = vec![0; APPLY_BUCKETS_NS.len() + 1];
        }
        let i = APPLY_BUCKETS_NS.partition_point(|&b| b < ns);
        self.counts[i] = self.counts[i].saturating_add(1);
        self.sum_ns = self.sum_ns.saturating_add(ns);
    }

    /// How many latencies it counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// `(bound ns, cumulative count)` per bucket, the last with no bound
    /// (`+Inf`): what a Prometheus histogram exposes.
    pub fn cumulative(&self) -> Vec<(Option<u64>, u64)> {
        let mut acc = 0;
        (0..=APPLY_BUCKETS_NS.len())
            .map(|i| {
                acc += self.counts.get(i).copied().unwrap_or(0);
                (APPLY_BUCKETS_NS.get(i).copied(), acc)
            })
            .collect()
    }
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
    /// Every decision → applied latency since the VM registered.
    pub apply_hist: LatencyHistogram,
    /// The longest time between two of the agent's ticks since it started
    /// (all VMs), ns: how late it may have been to end a boost that ran
    /// past a cap (a tick every 5 ms by default; longer when the host
    /// kept the applier from running).
    pub tick_gap_max_ns: u64,
    /// The co-scheduled phase the VM holds now, µs of `cosched_period_us`
    /// (0: not co-scheduled): `cosched_us`, or what `"auto"` measured.
    pub cosched_now_us: u64,
    /// With `"auto"`: how much its vCPUs waited for each other over the
    /// last second, as its guest counts it (wake-ups of a task that last
    /// ran on another vCPU plus 8 × waits, per vCPU and second), what
    /// decides whether it gets phases. None: not "auto", or its guest
    /// reports no counts (then it gets none).
    pub cosched_sync_rate: Option<f64>,
}

impl VmStats {
    /// One counter summed over the VM's vCPU threads.
    pub fn vcpu_sum(&self, counter: impl Fn(&ThreadCounters) -> u64) -> u64 {
        self.vcpus
            .iter()
            .map(|t| counter(&t.counters))
            .fold(0, u64::saturating_add)
    }
}

impl VmHandle {
    /// Statistics. The policy's maps are read first, under the object's
    /// lock alone; the applier's figures are then copied under the
    /// registry's lock, which the applier takes for every decision, so
    /// nothing slow (a system call, the sort of the latency samples) runs
    /// while it is held.
    pub fn stats(&self) -> VmStats {
        let mut out = VmStats::default();
        let gids: Vec<(u32, u32)> = self
            .threads()
            .enumerate()
            .map(|(i, &tid)| (tid, gid(self.vm_id, i as u32)))
            .collect();
        let mut threads: Vec<ThreadStats> = {
            let obj = self.inner.obj.lock();
            if let Ok(s) = obj.stats() {
                out.dropped = s.dropped;
            }
            gids.iter()
                .map(|&(tid, gid)| {
                    let mut vs = ThreadStats {
                        tid,
                        ..Default::default()
                    };
                    if let Ok(v) = obj.vcpu(gid) {
                        vs.counters.boosts = v.boosts;
                        vs.counters.throttles = v.throttles;
                        vs.counters.boosted_ns = v.boosted_ns;
                        vs.budget_used_ns = v.budget_used;
                        vs.cont_ns = v.cont_ns;
                        vs.ipis = v.ipis;
                        vs.slot_hits = v.slot_hits;
                        vs.yield_slot = v.yield_slot;
                        vs.last_ipi_target = v.last_ipi_target;
                        vs.boost = v.boost;
                        vs.boost_prio = v.boost_prio;
                        vs.throttled = v.throttled;
                        vs.wait_on_off = v.wait_on_off != 0;
                        vs.counters.sync_halts = v.sync_halts;
                        vs.counters.sib_wakes = v.sib_wakes;
                        vs.counters.sync_wait_ns = v.sync_wait_ns;
                    }
                    vs
                })
                .collect()
        };
        let mut latencies = {
            let reg = self.inner.reg.lock();
            for (vs, (_, gid)) in threads.iter_mut().zip(&gids) {
                if let Some(t) = reg.threads.get(gid) {
                    vs.counters.boosts_applied = t.boosts_applied;
                    vs.counters.corrections = t.corrections;
                    vs.counters.errors = t.errors;
                    vs.counters.phase_changes = t.phase_changes;
                    vs.counters.phase_yields = t.phase_yields;
                    vs.counters.boost_yields = t.boost_yields;
                }
            }
            match reg.vms.get(&self.vm_id) {
                Some(vm) => {
                    out.decisions = vm.decisions;
                    out.corrections = vm.corrections;
                    out.cosched_now_us = vm.cosched_now_us;
                    out.cosched_sync_rate = vm.sync_rate;
                    out.apply_hist = vm.apply_hist.clone();
                    vm.latencies.clone()
                }
                None => Vec::new(),
            }
        };
        latencies.sort_unstable();
        out.apply_samples = latencies.len();
        out.apply_p50_ns = pvsched_util::percentile(&latencies, 50.0).unwrap_or(0);
        out.apply_p99_ns = pvsched_util::percentile(&latencies, 99.0).unwrap_or(0);
        out.tick_gap_max_ns = self
            .inner
            .tick_gap_max_ns
            .load(std::sync::atomic::Ordering::Relaxed);
        out.emulators = threads.split_off(self.spec.vcpu_tids.len().min(threads.len()));
        out.vcpus = threads;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_fall_in_the_bucket_of_their_bound_and_add_up() {
        let mut h = LatencyHistogram::default();
        for ns in [1, 10_000, 10_001, 60_000, 20_000_000] {
            h.observe(ns);
        }
        assert_eq!(h.count(), 5);
        assert_eq!(h.sum_ns, 1 + 10_000 + 10_001 + 60_000 + 20_000_000);
        let c = h.cumulative();
        assert_eq!(c.len(), APPLY_BUCKETS_NS.len() + 1);
        // le 10 µs holds 1 and 10 000 ns; le 25 µs adds 10 001; le 100 µs
        // adds 60 µs; only +Inf holds 20 ms.
        assert_eq!(c[0], (Some(10_000), 2));
        assert_eq!(c[1], (Some(25_000), 3));
        assert_eq!(c[3], (Some(100_000), 4));
        assert_eq!(c[APPLY_BUCKETS_NS.len() - 1], (Some(10_000_000), 4));
        assert_eq!(c[APPLY_BUCKETS_NS.len()], (None, 5));
    }
}
