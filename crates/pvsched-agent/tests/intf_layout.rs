//! `bpf-policy/intf.h` ↔ `src/intf.rs`: compiles a C program against the
//! header that prints the size and offset of every field of every record
//! and the value of every shared constant, and compares each with Rust.

use pvsched_agent::intf::*;
use pvsched_policy::event as ev;
use std::mem::{offset_of, size_of};
use std::process::Command;

macro_rules! fields {
    ($out:ident, $c:literal, $t:ty, [$($f:ident),* $(,)?]) => {{
        $out.push((format!("sizeof(struct {})", $c), size_of::<$t>() as i64));
        $(
            $out.push((format!("offsetof(struct {}, {})", $c, stringify!($f)), offset_of!($t, $f) as i64));
        )*
    }};
}

macro_rules! consts {
    ($out:ident, [$($c:ident => $r:expr),* $(,)?]) => {{
        $( $out.push((stringify!($c).to_string(), ($r) as i64)); )*
    }};
}

#[test]
fn intf_h_matches_rust() {
    let mut e: Vec<(String, i64)> = Vec::new();
    fields!(
        e,
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
            pad0
        ]
    );
    fields!(
        e,
        "pvs_vm",
        PvsVm,
        [
            active,
            nr_vcpus,
            mode,
            wait_on_enabled,
            caps,
            nr_emulators,
            pad0,
            ls_until
        ]
    );
    fields!(
        e,
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
            slot_hits
        ]
    );
    fields!(
        e,
        "pvs_decision",
        PvsDecision,
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
    fields!(
        e,
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
            publish_busy
        ]
    );
    consts!(e, [
        PVS_MAX_VMS => MAX_VMS, PVS_MAX_VCPUS_PER_VM => MAX_VCPUS_PER_VM,
        PVS_MAX_EMULATORS => MAX_EMULATORS, PVS_TID_HINTS => TID_HINTS,
        PVS_REGION_STRIDE => REGION_STRIDE, PVS_GID_SHIFT => GID_SHIFT,
        PVS_MODE_NONE => MODE_NONE, PVS_MODE_DEVICE => MODE_DEVICE, PVS_MODE_GUEST => MODE_GUEST,
        PVS_ST_UNKNOWN => ev::ST_UNKNOWN, PVS_ST_RUNNING => ev::ST_RUNNING,
        PVS_ST_PREEMPTED => ev::ST_PREEMPTED, PVS_ST_HALTED => ev::ST_HALTED, PVS_ST_WOKEN => ev::ST_WOKEN,
        PVS_EV_SWITCH_OUT => ev::EV_SWITCH_OUT, PVS_EV_SWITCH_IN => ev::EV_SWITCH_IN,
        PVS_EV_WAKEUP => ev::EV_WAKEUP, PVS_EV_VCPU_WAKEUP => ev::EV_VCPU_WAKEUP,
        PVS_EV_IPI => ev::EV_IPI, PVS_EV_USER_EXIT => ev::EV_USER_EXIT,
        PVS_EV_TICK => ev::EV_TICK, PVS_EV_EXIT => ev::EV_EXIT, PVS_EV_MAX => ev::EV_MAX,
        PVS_R_NONE => ev::R_NONE, PVS_R_CS => ev::R_CS, PVS_R_RT_TASK => ev::R_RT_TASK,
        PVS_R_NICE_TASK => ev::R_NICE_TASK, PVS_R_HALT => ev::R_HALT, PVS_R_YIELD => ev::R_YIELD,
        PVS_R_MAX_BOOST => ev::R_MAX_BOOST, PVS_R_BUDGET => ev::R_BUDGET, PVS_R_THROTTLED => ev::R_THROTTLED, PVS_R_EXITED => ev::R_EXITED,
    ]);
    // The region element must hold the largest region of a VM we accept.
    assert!(pvsched_abi::region_size(MAX_VCPUS_PER_VM) <= REGION_STRIDE);

    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let dir = std::env::temp_dir().join(format!("pvsched-intf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"pvsched_abi.h\"\n#include \"intf.h\"\nint main(void){\n",
    );
    for (expr, _) in &e {
        c.push_str(&format!("printf(\"%lld\\n\", (long long)({expr}));\n"));
    }
    c.push_str("return 0;}\n");
    std::fs::write(dir.join("t.c"), c).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-o", "t", "t.c"])
        .arg(format!("-I{root}/include"))
        .arg(format!("-I{root}/bpf-policy"))
        .current_dir(&dir)
        .status()
        .expect("a C compiler (cc) is needed: scripts/setup installs build-essential");
    assert!(st.success(), "compiling the layout probe failed");
    let out = Command::new(dir.join("t")).output().unwrap();
    let vals: Vec<i64> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(vals.len(), e.len());
    for ((expr, rust), c) in e.iter().zip(vals) {
        assert_eq!(*rust, c, "{expr}: Rust {rust} vs C {c}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
