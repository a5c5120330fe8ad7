//! `bpf-policy/intf.h` ↔ `src/intf.rs` and `src/event.rs`: compiles a C program against the
//! header that prints the size, and each field's offset and size, of every
//! record and the value of every shared constant, and compares each with
//! Rust; the listed fields must cover each record (the ABI's machinery,
//! `pvsched_testkit::layout`).

use pvsched_policy::Decision;
use pvsched_policy::event as ev;
use pvsched_policy::event::{
    GID_SHIFT, MAX_EMULATORS, MAX_VCPUS_PER_VM, MAX_VMS, REGION_STRIDE, THREADS_PER_VM, TID_HINTS,
};
use pvsched_policy::intf::*;
use pvsched_testkit::layout::{Coverage, Expect, check_coverage, compare_with_c};
use pvsched_testkit::{layout_consts, layout_struct};
use std::path::PathBuf;

fn expectations() -> (Vec<Expect>, Vec<Coverage>) {
    let mut e = Vec::new();
    let mut cov = Vec::new();
    layout_struct!(
        e,
        cov,
        "pvs_caps",
        PvsCaps,
        [
            allow_rt,
            max_rt_prio,
            nice_floor,
            cs_rt_prio,
            halt_kind,
            halt_prio,
            yield_kind,
            yield_prio,
            max_boost_ns,
            throttle_ns,
            budget_ns,
            window_ns,
            ipi_window_ns,
            halt_hold_ns,
            halt_always,
            kick_pairs,
            vm_budget_ns
        ]
    );
    layout_struct!(
        e,
        cov,
        "pvs_vm",
        PvsVm,
        [
            active,
            nr_vcpus,
            mode,
            wait_on_enabled,
            caps,
            nr_emulators,
            lock_wait_enabled,
            ls_until,
            window_start,
            budget_used
        ]
    );
    layout_struct!(
        e,
        cov,
        "pvs_vcpu",
        PvsVcpu,
        [
            tid,
            vm_id,
            index,
            state,
            slot_addr,
            req_kind,
            req_prio,
            req_reason,
            wait_on,
            boost,
            boost_prio,
            boost_reason,
            throttled,
            acct_ns,
            cont_ns,
            window_start,
            budget_used,
            throttled_until,
            ls_until,
            last_ipi_target,
            yield_slot,
            last_ipi_ns,
            yield_boosting,
            fence,
            yield_mask,
            boosts,
            throttles,
            boosted_ns,
            ipis,
            slot_hits,
            guest_idle,
            last_kick_target,
            last_kick_ns,
            ls_prio,
            phase,
            sync_halts,
            sib_wakes,
            sync_wait_ns,
            sync_since,
            host_hold_until,
            wait_on_off,
            pad1
        ]
    );
    layout_struct!(
        e,
        cov,
        "pvs_decision",
        Decision,
        [
            ts,
            tid,
            gid,
            kind,
            prio,
            reason,
            event,
            throttled_until,
            waits_on,
            pad0
        ]
    );
    layout_struct!(e, cov, "pvs_tid_hint", PvsTidHint, [count, tid, key, pad0]);
    layout_struct!(
        e,
        cov,
        "pvs_cpu",
        PvsCpu,
        [run_key, yield_keys, wait_tid, pad0, wait_at]
    );
    layout_struct!(
        e,
        cov,
        "pvs_stats",
        PvsStats,
        [
            events,
            decisions,
            dropped,
            boosts,
            unboosts,
            throttles,
            ipi_pairs,
            slot_hits,
            torn_reads,
            read_errors,
            publish_busy,
            full_runs,
            phase_yields
        ]
    );
    layout_consts!(e, [
        PVS_MAX_VMS => MAX_VMS, PVS_MAX_VCPUS_PER_VM => MAX_VCPUS_PER_VM,
        PVS_MAX_EMULATORS => MAX_EMULATORS, PVS_TID_HINTS => TID_HINTS,
        PVS_THREADS_PER_VM => THREADS_PER_VM, PVS_APIC_FAST => ev::APIC_FAST,
        PVS_PROG_SWITCH => ev::PROG_SWITCH, PVS_PROG_WAKEUP => ev::PROG_WAKEUP,
        PVS_PROG_VCPU_WAKEUP => ev::PROG_VCPU_WAKEUP, PVS_PROG_USER_EXIT => ev::PROG_USER_EXIT,
        PVS_PROG_IPI => ev::PROG_IPI, PVS_PROG_MAX => ev::PROG_MAX,
        PVS_REGION_STRIDE => REGION_STRIDE, PVS_GID_SHIFT => GID_SHIFT, PVS_GID_ALL => ev::GID_ALL,
        PVS_NOW_CLOCK => ev::NOW_CLOCK,
        PVS_MODE_NONE => MODE_NONE, PVS_MODE_DEVICE => MODE_DEVICE, PVS_MODE_GUEST => MODE_GUEST,
        PVS_KICK_OFF => KICK_OFF, PVS_KICK_ON => KICK_ON, PVS_KICK_AUTO => KICK_AUTO,
        PVS_ST_UNKNOWN => ev::ST_UNKNOWN, PVS_ST_RUNNING => ev::ST_RUNNING,
        PVS_ST_PREEMPTED => ev::ST_PREEMPTED, PVS_ST_HALTED => ev::ST_HALTED, PVS_ST_WOKEN => ev::ST_WOKEN,
        PVS_EV_SWITCH_OUT => ev::EV_SWITCH_OUT, PVS_EV_SWITCH_IN => ev::EV_SWITCH_IN,
        PVS_EV_WAKEUP => ev::EV_WAKEUP, PVS_EV_VCPU_WAKEUP => ev::EV_VCPU_WAKEUP,
        PVS_EV_IPI => ev::EV_IPI, PVS_EV_USER_EXIT => ev::EV_USER_EXIT,
        PVS_EV_TICK => ev::EV_TICK, PVS_EV_EXIT => ev::EV_EXIT, PVS_EV_KICK => ev::EV_KICK,
        PVS_EV_PHASE_ON => ev::EV_PHASE_ON,
        PVS_EV_MAX => ev::EV_MAX,
        PVS_R_NONE => ev::R_NONE, PVS_R_CS => ev::R_CS, PVS_R_RT_TASK => ev::R_RT_TASK,
        PVS_R_NICE_TASK => ev::R_NICE_TASK, PVS_R_HALT => ev::R_HALT, PVS_R_YIELD => ev::R_YIELD,
        PVS_R_MAX_BOOST => ev::R_MAX_BOOST, PVS_R_BUDGET => ev::R_BUDGET, PVS_R_THROTTLED => ev::R_THROTTLED, PVS_R_EXITED => ev::R_EXITED,
        PVS_R_VM_BUDGET => ev::R_VM_BUDGET, PVS_R_HOST_WAKE => ev::R_HOST_WAKE,
        PVS_R_HOST_DONE => ev::R_HOST_DONE, PVS_R_HOST_YIELD => ev::R_HOST_YIELD,
        PVS_PHASE_FREE => ev::PHASE_FREE, PVS_PHASE_ON => ev::PHASE_ON, PVS_PHASE_OFF => ev::PHASE_OFF,
        PVS_PHASE_YIELDED => ev::PHASE_YIELDED, PVS_COSCHED_RT_PRIO => ev::COSCHED_RT_PRIO,
        PVS_MAX_CPUS => ev::MAX_CPUS,
        PVS_CPU_WAITERS => ev::CPU_WAITERS, PVS_CPU_YIELDS => ev::CPU_YIELDS,
        PVS_HOST_HOLD_NS => ev::HOST_HOLD_NS,
    ]);
    (e, cov)
}

#[test]
fn listed_fields_cover_every_record() {
    check_coverage(&expectations().1);
}

#[test]
fn intf_h_matches_rust() {
    // The region element must hold the largest region of a VM we accept.
    assert!(pvsched_abi::region_size(MAX_VCPUS_PER_VM) <= REGION_STRIDE);
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    compare_with_c(
        &expectations().0,
        &["pvsched_abi.h", "intf.h"],
        &[&root.join("include"), &root.join("bpf-policy")],
        &["-Wall", "-Werror"],
        &PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pvsched-intf-layout"),
    );
}

/// The Linux-guest tests read the agent's decision trace (reasons, kinds)
/// through `python/pvsched_guest/policy.py`, generated from the same list.
#[test]
fn python_policy_is_generated_from_this_list() {
    let text = pvsched_testkit::layout::python_module(
        &expectations().0,
        &pvsched_testkit::layout::PythonHeader {
            title: "The BPF policy's records and constants (bpf-policy/intf.h) for Python harnesses.",
            prefix: "PVS_",
            generated_by: "crates/pvsched-policy/tests/integration/intf_layout.rs (python_policy_is_generated_from_this_list)",
        },
    );
    let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    pvsched_testkit::layout::check_generated(&root.join("python/pvsched_guest/policy.py"), &text);
}
