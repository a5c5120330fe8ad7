//! C ↔ Rust ABI equality: compiles a C program against `include/pvsched_abi.h`
//! that prints the size and offset of every field of every shared struct and
//! the value of every constant, and compares each line with the Rust side.
//!
//! The list below is the one place that names the items; both the C program
//! and the Rust expectations are generated from it (`pvsched_testkit::layout`,
//! shared with the BPF records' check), so an item cannot be checked on one
//! side only. A field missing from the list is caught by the per-struct
//! "fields cover the struct" check (sum of listed field sizes == struct
//! size, and the struct has no padding).

use pvsched_abi as abi;
use pvsched_testkit::layout::{Coverage, Expect, check_coverage, compare_with_c};
use pvsched_testkit::{layout_consts, layout_struct};
use std::path::PathBuf;

fn expectations() -> (Vec<Expect>, Vec<Coverage>) {
    let mut out = Vec::new();
    let mut cov = Vec::new();
    layout_struct!(
        out,
        cov,
        "pvsched_region_header",
        abi::RegionHeader,
        [
            magic,
            version,
            nr_vcpus,
            slot_size,
            header_size,
            apic_table_offset,
            slots_offset,
            generation,
            host_flags,
            driver_features_lo,
            driver_features_hi,
            driver_version,
            reserved
        ]
    );
    layout_struct!(
        out,
        cov,
        "pvsched_slot_guest",
        abi::SlotGuest,
        [
            seq, kern_cs, policy, nice, rt_prio, wait_on, flags, reserved0, updates, wakes, waits,
            reserved
        ]
    );
    layout_struct!(
        out,
        cov,
        "pvsched_slot_host",
        abi::SlotHost,
        [
            seq,
            vcpu_state,
            boost,
            boost_prio,
            throttled,
            yield_target,
            boosts,
            throttles,
            boosted_ns,
            reserved
        ]
    );
    layout_struct!(out, cov, "pvsched_slot", abi::Slot, [guest, host]);
    layout_consts!(out, [
        PVSCHED_ABI_MAJOR => abi::ABI_MAJOR,
        PVSCHED_ABI_MINOR => abi::ABI_MINOR,
        PVSCHED_ABI_VERSION => abi::ABI_VERSION,
        PVSCHED_PCI_VENDOR_ID => abi::PCI_VENDOR_ID,
        PVSCHED_PCI_DEVICE_ID => abi::PCI_DEVICE_ID,
        PVSCHED_PCI_SUBSYS_VENDOR_ID => abi::PCI_SUBSYS_VENDOR_ID,
        PVSCHED_PCI_SUBSYS_ID => abi::PCI_SUBSYS_ID,
        PVSCHED_PCI_REVISION => abi::PCI_REVISION,
        PVSCHED_PCI_CLASS => abi::PCI_CLASS,
        PVSCHED_REG_BAR => abi::REG_BAR,
        PVSCHED_REG_BAR_SIZE => abi::REG_BAR_SIZE,
        PVSCHED_REGION_BAR => abi::REGION_BAR,
        PVSCHED_REG_MAGIC => abi::REG_MAGIC,
        PVSCHED_REG_VERSION => abi::REG_VERSION,
        PVSCHED_REG_DEV_FEATURES_LO => abi::REG_DEV_FEATURES_LO,
        PVSCHED_REG_DEV_FEATURES_HI => abi::REG_DEV_FEATURES_HI,
        PVSCHED_REG_DRV_FEATURES_LO => abi::REG_DRV_FEATURES_LO,
        PVSCHED_REG_DRV_FEATURES_HI => abi::REG_DRV_FEATURES_HI,
        PVSCHED_REG_NR_VCPUS => abi::REG_NR_VCPUS,
        PVSCHED_REG_SLOT_SIZE => abi::REG_SLOT_SIZE,
        PVSCHED_REG_STATUS => abi::REG_STATUS,
        PVSCHED_REG_ERROR => abi::REG_ERROR,
        PVSCHED_REG_SHM_GPA_LO => abi::REG_SHM_GPA_LO,
        PVSCHED_REG_SHM_GPA_HI => abi::REG_SHM_GPA_HI,
        PVSCHED_REG_SHM_SIZE => abi::REG_SHM_SIZE,
        PVSCHED_REG_REGION_SIZE => abi::REG_REGION_SIZE,
        PVSCHED_REG_KICK => abi::REG_KICK,
        PVSCHED_REG_GENERATION => abi::REG_GENERATION,
        PVSCHED_REG_DRIVER_VERSION => abi::REG_DRIVER_VERSION,
        PVSCHED_REG_END => abi::REG_END,
        PVSCHED_MAGIC => abi::MAGIC,
        PVSCHED_F_DEVICE_REGION => abi::F_DEVICE_REGION,
        PVSCHED_F_GUEST_REGION => abi::F_GUEST_REGION,
        PVSCHED_F_WAIT_ON => abi::F_WAIT_ON,
        PVSCHED_F_KICK => abi::F_KICK,
        PVSCHED_F_TASK_FLAGS => abi::F_TASK_FLAGS,
        PVSCHED_F_LOCK_WAIT => abi::F_LOCK_WAIT,
        PVSCHED_F_SYNC_COUNTS => abi::F_SYNC_COUNTS,
        PVSCHED_F_ALL => abi::F_ALL,
        PVSCHED_STATUS_RESET => abi::STATUS_RESET,
        PVSCHED_STATUS_ACKNOWLEDGE => abi::STATUS_ACKNOWLEDGE,
        PVSCHED_STATUS_DRIVER => abi::STATUS_DRIVER,
        PVSCHED_STATUS_DRIVER_OK => abi::STATUS_DRIVER_OK,
        PVSCHED_STATUS_FEATURES_OK => abi::STATUS_FEATURES_OK,
        PVSCHED_STATUS_DEVICE_NEEDS_RESET => abi::STATUS_DEVICE_NEEDS_RESET,
        PVSCHED_STATUS_FAILED => abi::STATUS_FAILED,
        PVSCHED_ERR_NONE => abi::ERR_NONE,
        PVSCHED_ERR_BAD_SEQUENCE => abi::ERR_BAD_SEQUENCE,
        PVSCHED_ERR_FEATURES_UNSUPPORTED => abi::ERR_FEATURES_UNSUPPORTED,
        PVSCHED_ERR_NO_REGION_MODE => abi::ERR_NO_REGION_MODE,
        PVSCHED_ERR_VERSION_MISMATCH => abi::ERR_VERSION_MISMATCH,
        PVSCHED_ERR_REGION_ZERO_SIZE => abi::ERR_REGION_ZERO_SIZE,
        PVSCHED_ERR_REGION_UNALIGNED => abi::ERR_REGION_UNALIGNED,
        PVSCHED_ERR_REGION_WRAPS => abi::ERR_REGION_WRAPS,
        PVSCHED_ERR_REGION_OUTSIDE_RAM => abi::ERR_REGION_OUTSIDE_RAM,
        PVSCHED_ERR_REGION_TOO_SMALL => abi::ERR_REGION_TOO_SMALL,
        PVSCHED_ERR_REGION_CHANGED => abi::ERR_REGION_CHANGED,
        PVSCHED_ERR_REGION_UNMAPPED => abi::ERR_REGION_UNMAPPED,
        PVSCHED_ERR_REGION_UNAVAILABLE => abi::ERR_REGION_UNAVAILABLE,
        PVSCHED_ERR_DEVICE_FAILED => abi::ERR_DEVICE_FAILED,
        PVSCHED_ERR_MAX => abi::ERR_MAX,
        PVSCHED_REGION_MAGIC => abi::REGION_MAGIC,
        PVSCHED_MAX_VCPUS => abi::MAX_VCPUS,
        PVSCHED_CACHELINE => abi::CACHELINE,
        PVSCHED_PAGE_SIZE => abi::PAGE_SIZE,
        PVSCHED_SLOT_SIZE => abi::SLOT_SIZE,
        PVSCHED_HEADER_SIZE => abi::HEADER_SIZE,
        PVSCHED_APIC_TABLE_OFFSET => abi::APIC_TABLE_OFFSET,
        PVSCHED_HOST_F_POLICY_ACTIVE => abi::HOST_F_POLICY_ACTIVE,
        PVSCHED_CS_NMI => abi::CS_NMI,
        PVSCHED_CS_HARDIRQ => abi::CS_HARDIRQ,
        PVSCHED_CS_SOFTIRQ => abi::CS_SOFTIRQ,
        PVSCHED_CS_PREEMPT_OFF => abi::CS_PREEMPT_OFF,
        PVSCHED_CS_ALL => abi::CS_ALL,
        PVSCHED_TASK_F_KTHREAD => abi::TASK_F_KTHREAD,
        PVSCHED_TASK_F_IDLE => abi::TASK_F_IDLE,
        PVSCHED_TASK_F_RT_SLEEPER => abi::TASK_F_RT_SLEEPER,
        PVSCHED_TASK_F_ALL => abi::TASK_F_ALL,
        PVSCHED_POLICY_NORMAL => abi::POLICY_NORMAL,
        PVSCHED_POLICY_FIFO => abi::POLICY_FIFO,
        PVSCHED_POLICY_RR => abi::POLICY_RR,
        PVSCHED_POLICY_BATCH => abi::POLICY_BATCH,
        PVSCHED_POLICY_IDLE => abi::POLICY_IDLE,
        PVSCHED_POLICY_DEADLINE => abi::POLICY_DEADLINE,
        PVSCHED_NICE_MIN => abi::NICE_MIN,
        PVSCHED_NICE_MAX => abi::NICE_MAX,
        PVSCHED_RT_PRIO_MAX => abi::RT_PRIO_MAX,
        PVSCHED_WAIT_NONE => abi::WAIT_NONE,
        PVSCHED_WAIT_ANY => abi::WAIT_ANY,
        PVSCHED_VCPU_UNKNOWN => abi::VCPU_UNKNOWN,
        PVSCHED_VCPU_RUNNING => abi::VCPU_RUNNING,
        PVSCHED_VCPU_PREEMPTED => abi::VCPU_PREEMPTED,
        PVSCHED_VCPU_HALTED => abi::VCPU_HALTED,
        PVSCHED_BOOST_NONE => abi::BOOST_NONE,
        PVSCHED_BOOST_NICE => abi::BOOST_NICE,
        PVSCHED_BOOST_RT => abi::BOOST_RT,
    ]);
    // The layout helpers are static inline functions in C: compare them
    // for a spread of vCPU counts.
    for n in [1u32, 2, 3, 4, 15, 16, 17, 64, 255, 256, 1000, 1024] {
        out.push(Expect {
            name: format!("fn:pvsched_slots_offset({n})"),
            c_expr: format!("(long long)pvsched_slots_offset({n})"),
            rust: abi::slots_offset(n) as i128,
        });
        out.push(Expect {
            name: format!("fn:pvsched_region_size({n})"),
            c_expr: format!("(long long)pvsched_region_size({n})"),
            rust: abi::region_size(n) as i128,
        });
    }
    (out, cov)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn listed_fields_cover_every_struct() {
    check_coverage(&expectations().1);
}

#[test]
fn c_header_matches_rust_mirror() {
    let (items, _) = expectations();
    let include = repo_root().join("include");
    compare_with_c(
        &items,
        &["pvsched_abi.h"],
        &[&include],
        &["-std=c11", "-Wall", "-Wextra", "-Werror"],
        &PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pvsched-abi-c-layout"),
    );
}

/// The Python harnesses read the region through `python/pvsched_guest/abi.py`,
/// generated from the same list.
#[test]
fn python_abi_is_generated_from_this_list() {
    let (items, _) = expectations();
    let text = pvsched_testkit::layout::python_module(
        &items,
        &pvsched_testkit::layout::PythonHeader {
            title: "The pvsched ABI (include/pvsched_abi.h) for Python harnesses.",
            prefix: "PVSCHED_",
            generated_by: "crates/pvsched-abi/tests/c_layout.rs (python_abi_is_generated_from_this_list)",
        },
    );
    pvsched_testkit::layout::check_generated(
        &repo_root().join("python/pvsched_guest/abi.py"),
        &text,
    );
}
