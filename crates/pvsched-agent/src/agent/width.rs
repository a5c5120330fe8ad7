//! How many CPUs each VM's vCPU threads may run on (the union of their
//! affinity masks, [`crate::sched::cpus_of`]), and what follows for a VM
//! with more vCPUs than that: "auto" co-scheduling gives it no phase
//! ([`too_wide`]), and the yield its guest's `wait_on` asks for is not
//! lent while its `wait_on` is "auto" ([`pvsched_policy::WaitOn::Auto`]):
//! on such a VM the boosted target takes a CPU that a sibling doing the
//! guest's work holds (docs/benchmarks.md, "One 4-vCPU VM").
//!
//! The applier thread runs it every tick; a VM's threads are read when it
//! is first seen and then once a second, since libvirt may pin them at any
//! time (`virsh vcpupin`). A VM that needs neither is not read.

use super::Inner;
use crate::object::PolicyView;
use pvsched_policy::{CoschedUs, WaitOn};
use std::collections::HashMap;

/// How long a VM's reading stands, ns.
const READ_EVERY_NS: u64 = 1_000_000_000;

/// Whether a VM of `vcpus` vCPUs whose threads may run on `cpus` CPUs is
/// wider than its CPUs. A co-scheduled phase puts all its vCPUs at FIFO
/// together; those that find no CPU wait until one of the others halts
/// (FIFO has no time slice), so a task woken on one of them, or a lock it
/// holds, waits the phase out while its siblings spin or sleep for it.
/// Measured with one 4-vCPU 7.3 guest on this 2-CPU host, such phases
/// cost hackbench half its work per CPU-second
/// (docs/bench/s6-default-1x4.json).
pub(super) fn too_wide(vcpus: u32, cpus: u32) -> bool {
    vcpus > cpus.max(1)
}

/// One VM's reading.
#[derive(Clone, Copy, Debug)]
struct Reading {
    /// CPUs its vCPU threads may run on.
    cpus: u32,
    /// When it was read (`CLOCK_MONOTONIC` ns).
    at: u64,
    /// Its vCPUs when read.
    vcpus: u32,
}

/// Every VM's width, as last read.
#[derive(Default)]
pub(super) struct Widths {
    read: HashMap<u32, Reading>,
}

impl Widths {
    /// Whether VM `id` of `vcpus` vCPUs was wider than its CPUs when last
    /// read (false if it was not read).
    pub(super) fn too_wide(&self, id: u32, vcpus: u32) -> bool {
        self.read.get(&id).is_some_and(|r| too_wide(vcpus, r.cpus))
    }

    /// Every tick: reads the VMs that need it (co-scheduling or `wait_on`
    /// "auto") whose reading is older than a second, forgets the others,
    /// and stores in each vCPU's record of every VM whether the policy
    /// ignores its `wait_on` ([`crate::intf::PvsVcpu::wait_on_off`]; new
    /// caps change it here too). `cpu_ids`: what a thread that cannot be
    /// read counts as (every CPU).
    pub(super) fn update(&mut self, inner: &Inner, view: &PolicyView, now: u64, cpu_ids: u32) {
        // (VM id, its vCPUs' (gid, tid), its wait_on, whether it is read).
        type Vm = (u32, Vec<(u32, u32)>, WaitOn, bool);
        let vms: Vec<Vm> = {
            let reg = inner.reg.lock();
            reg.vms
                .iter()
                .map(|(id, v)| {
                    let threads = reg.live_vcpus(*id, v.vcpus);
                    let read =
                        v.caps.cosched_us == CoschedUs::Auto || v.caps.wait_on == WaitOn::Auto;
                    (*id, threads, v.caps.wait_on, read)
                })
                .collect()
        };
        self.read
            .retain(|id, _| vms.iter().any(|v| v.0 == *id && v.3));
        for (id, threads, wait_on, read) in &vms {
            let vcpus = u32::try_from(threads.len()).unwrap_or(u32::MAX);
            let due = *read
                && self
                    .read
                    .get(id)
                    .is_none_or(|r| r.vcpus != vcpus || now.saturating_sub(r.at) >= READ_EVERY_NS);
            if due {
                let tids: Vec<u32> = threads.iter().map(|t| t.1).collect();
                let cpus = crate::sched::cpus_of(&tids).unwrap_or(cpu_ids);
                let was = self.read.insert(
                    *id,
                    Reading {
                        cpus,
                        at: now,
                        vcpus,
                    },
                );
                let wide = too_wide(vcpus, cpus);
                if was.map(|r| too_wide(r.vcpus, r.cpus)) != Some(wide) && wide {
                    log::info!(
                        "pvsched: VM {id}: its {vcpus} vCPUs may run on {cpus} CPU(s) \
                         only: not co-scheduled (\"auto\"), and its wait_on hints are \
                         not honoured (\"auto\")"
                    );
                }
            }
            let off = !wait_on.honoured(!self.too_wide(*id, vcpus));
            for (g, _) in threads {
                if view.vcpu_wait_on_off(*g) != Some(off) {
                    view.set_vcpu_wait_on_off(*g, off);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_is_too_wide_only_with_more_vcpus_than_cpus() {
        assert!(!too_wide(2, 2));
        assert!(too_wide(4, 2));
        assert!(!too_wide(1, 0), "no CPU read counts as one");
        assert!(too_wide(2, 0));
    }
}
