//! The BPF ↔ userspace records and constants of `bpf-policy/intf.h`, as the
//! agent uses them for the maps. They are defined once, in
//! [`pvsched_policy::intf`] and [`pvsched_policy::event`] (where the
//! reference model uses the same types), and re-exported here.

pub use pvsched_policy::Decision;
pub use pvsched_policy::event::{
    APIC_FAST, EV_MAX, GID_SHIFT, MAX_EMULATORS, MAX_VCPUS_PER_VM, MAX_VMS, PROG_MAX, PROG_NAMES,
    R_BUDGET, R_MAX_BOOST, REGION_STRIDE, THREADS_PER_VM, TID_HINTS, gid, gid_vm, vcpu_key,
};
pub use pvsched_policy::intf::*;
