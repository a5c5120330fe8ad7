//! Registered threads whose TIDs share an element of the policy's
//! `tid_hint` prefilter (TID mod 4096, forced with `ns_last_pid`): each is
//! still found, boosted from its own slot and restored; after one is
//! unregistered the other is found alone in the element, and the
//! unregistered one, still running, is never boosted again. Real BPF, real
//! threads read back with sched_getattr.

use crate::common;

use common::{FakeVcpu, device_vm, need_bpf, vcpu_with_tid, wait_for};
use pvsched_abi::{POLICY_FIFO, POLICY_NORMAL, SlotGuest};
use pvsched_agent::VmHandle;
use pvsched_agent::intf::TID_HINTS;
use pvsched_policy::{BoostKind, Caps};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(10);

fn caps() -> Caps {
    Caps {
        halt_boost: BoostKind::None,
        yield_boost: BoostKind::None,
        max_boost_us: 0,
        budget_us: 0,
        max_rt_prio: 8,
        ..Caps::default()
    }
}

fn ask(vm: &VmHandle, rt_prio: u32) {
    vm.region().expect("device region").write_guest(
        1,
        0,
        &SlotGuest {
            policy: POLICY_FIFO,
            rt_prio,
            ..Default::default()
        },
    );
}

/// A stand-in vCPU whose TID falls in the same `tid_hint` element as `tid`:
/// a free number of that residue below `pid_max` (the kernel hands out no
/// number below 300 once it wrapped).
fn colliding(tid: u32) -> Option<FakeVcpu> {
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (0..pid_max / TID_HINTS)
        .map(|k| tid % TID_HINTS + k * TID_HINTS)
        .filter(|&t| t != tid && t >= 300 && t < pid_max)
        .find_map(vcpu_with_tid)
}

#[test]
fn colliding_tids_are_each_found_and_restored() {
    if !need_bpf("colliding_tids_are_each_found_and_restored") {
        return;
    }
    if std::fs::metadata("/proc/sys/kernel/ns_last_pid").is_err()
        && !pvsched_testkit::skip_or_fail(
            "colliding_tids_are_each_found_and_restored",
            "/proc/sys/kernel/ns_last_pid missing",
        )
    {
        return;
    }
    let agent = common::agent();
    let a = FakeVcpu::spawn(0, Duration::from_millis(1));
    let b = colliding(a.tid).expect("a thread with a TID in a's prefilter element");
    assert_eq!(a.tid % TID_HINTS, b.tid % TID_HINTS);
    let base_b = b.attr();
    assert_eq!(base_b.policy, POLICY_NORMAL);

    // Two registered threads in one element: both through the hash.
    let vm_a = device_vm(&agent, &[a.tid], &[], caps());
    let vm_b = device_vm(&agent, &[b.tid], &[], caps());
    ask(&vm_a, 2);
    ask(&vm_b, 3);
    let ra = wait_for("a boosted", LIMIT, || {
        Some(a.attr()).filter(|x| x.policy == POLICY_FIFO)
    });
    let rb = wait_for("b boosted", LIMIT, || {
        Some(b.attr()).filter(|x| x.policy == POLICY_FIFO)
    });
    assert_eq!((ra.priority, rb.priority), (2, 3), "each from its own slot");

    // b leaves: a is alone in the element (found there with no hash
    // lookup) and follows its slot; b, still running, is back at its
    // baseline and stays there.
    drop(vm_b);
    assert_eq!(b.attr(), base_b, "b restored at unregistration");
    ask(&vm_a, 4);
    wait_for("a follows its slot", LIMIT, || {
        Some(a.attr()).filter(|x| x.priority == 4)
    });
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        ask(
            &vm_a,
            if t0.elapsed().as_millis().is_multiple_of(2) {
                5
            } else {
                4
            },
        );
        assert_eq!(b.attr(), base_b, "an unregistered thread is never boosted");
        std::thread::sleep(Duration::from_millis(1));
    }

    // b comes back in a new VM: found again, boosted from its new slot.
    let vm_b = device_vm(&agent, &[b.tid], &[], caps());
    ask(&vm_b, 6);
    wait_for("b boosted again", LIMIT, || {
        Some(b.attr()).filter(|x| x.policy == POLICY_FIFO && x.priority == 6)
    });
    let base_a = {
        drop(vm_a);
        a.attr()
    };
    assert_eq!(base_a.policy, POLICY_NORMAL, "a restored");
    drop(vm_b);
    assert_eq!(b.attr(), base_b);
}
