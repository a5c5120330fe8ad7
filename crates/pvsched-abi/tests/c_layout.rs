//! C ↔ Rust ABI equality: compiles a C program against `include/pvsched_abi.h`
//! that prints the size and offset of every field of every shared struct and
//! the value of every constant, and compares each line with the Rust side.
//!
//! The list below is the one place that names the items; both the C program
//! and the Rust expectations are generated from it, so an item cannot be
//! checked on one side only. A field missing from the list is caught by the
//! per-struct "fields cover the struct" check (sum of listed field sizes ==
//! struct size, and the struct has no padding).

use pvsched_abi as abi;
use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::process::Command;

/// One line of expected output: `name value`.
struct Expect {
    name: String,
    c_expr: String,
    rust: i128,
}

/// Size of a field given a value-less pointer projection.
macro_rules! field_size {
    ($t:ty, $f:ident) => {{
        let u = std::mem::MaybeUninit::<$t>::uninit();
        let p = u.as_ptr();
        // SAFETY: addr_of! on a field of a MaybeUninit pointer creates no
        // reference and reads nothing; only the pointee type's size is used.
        let fp = unsafe { std::ptr::addr_of!((*p).$f) };
        size_of_pointee(fp)
    }};
}

fn size_of_pointee<T>(_: *const T) -> usize {
    size_of::<T>()
}

/// Fields of a struct: emits sizeof/offsetof lines and records coverage.
macro_rules! strukt {
    ($out:ident, $cov:ident, $cname:literal, $t:ty, [$($f:ident),* $(,)?]) => {{
        $out.push(Expect {
            name: format!("sizeof:{}", $cname),
            c_expr: format!("sizeof(struct {})", $cname),
            rust: size_of::<$t>() as i128,
        });
        let mut covered = 0usize;
        $(
            $out.push(Expect {
                name: format!("offsetof:{}.{}", $cname, stringify!($f)),
                c_expr: format!("offsetof(struct {}, {})", $cname, stringify!($f)),
                rust: offset_of!($t, $f) as i128,
            });
            $out.push(Expect {
                name: format!("sizeof:{}.{}", $cname, stringify!($f)),
                c_expr: format!("sizeof(((struct {} *)0)->{})", $cname, stringify!($f)),
                rust: field_size!($t, $f) as i128,
            });
            covered += field_size!($t, $f);
        )*
        $cov.push(($cname, covered, size_of::<$t>()));
    }};
}

/// Constants: `C_NAME => rust value`.
macro_rules! consts {
    ($out:ident, [$($c:ident => $r:expr),* $(,)?]) => {{
        $(
            $out.push(Expect {
                name: format!("const:{}", stringify!($c)),
                c_expr: format!("(long long)({})", stringify!($c)),
                rust: ($r) as i128,
            });
        )*
    }};
}

fn expectations() -> (Vec<Expect>, Vec<(&'static str, usize, usize)>) {
    let mut out = Vec::new();
    let mut cov = Vec::new();
    strukt!(
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
            reserved
        ]
    );
    strukt!(
        out,
        cov,
        "pvsched_slot_guest",
        abi::SlotGuest,
        [
            seq, kern_cs, policy, nice, rt_prio, wait_on, flags, reserved0, updates, reserved
        ]
    );
    strukt!(
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
    strukt!(out, cov, "pvsched_slot", abi::Slot, [guest, host]);
    consts!(out, [
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

fn c_program(items: &[Expect]) -> String {
    let mut s = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"pvsched_abi.h\"\nint main(void)\n{\n",
    );
    for e in items {
        s.push_str(&format!(
            "\tprintf(\"%s %lld\\n\", \"{}\", (long long)({}));\n",
            e.name, e.c_expr
        ));
    }
    s.push_str("\treturn 0;\n}\n");
    s
}

#[test]
fn listed_fields_cover_every_struct() {
    let (_, cov) = expectations();
    for (name, covered, size) in cov {
        assert_eq!(
            covered, size,
            "struct {name}: listed fields cover {covered} of {size} bytes; a field is missing from the layout list or the struct has padding"
        );
    }
}

#[test]
fn c_header_matches_rust_mirror() {
    let (items, _) = expectations();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pvsched-abi-c-layout");
    std::fs::create_dir_all(&dir).expect("create temp dir");
    let src = dir.join("layout.c");
    let bin = dir.join("layout");
    std::fs::write(&src, c_program(&items)).expect("write C program");

    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(repo_root().join("include"))
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run the C compiler `{cc}`: {e}; install build-essential")
        });
    assert!(status.success(), "the C layout program failed to compile");

    let out = Command::new(&bin)
        .output()
        .expect("run the C layout program");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf8");
    let c: BTreeMap<&str, i128> = text
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').expect("`name value` line");
            (k, v.parse().expect("integer"))
        })
        .collect();

    let mut mismatches = Vec::new();
    for e in &items {
        match c.get(e.name.as_str()) {
            Some(&v) if v == e.rust => {}
            Some(&v) => mismatches.push(format!("{}: C {} != Rust {}", e.name, v, e.rust)),
            None => mismatches.push(format!("{}: missing from C output", e.name)),
        }
    }
    assert!(
        mismatches.is_empty(),
        "ABI mismatches:\n{}",
        mismatches.join("\n")
    );
    assert_eq!(c.len(), items.len(), "duplicate names in the layout list");
}
