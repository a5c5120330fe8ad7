//! Helpers shared by the real-KVM integration tests.

#![allow(dead_code)]

use pvsched_vmm::{RunConfig, RunReport, VmConfig, Workload};
use std::time::Duration;

/// Whether the tests may run here: `/dev/kvm` opens. With
/// `PVSCHED_REQUIRE_REAL=1` a missing KVM is a failure, otherwise the test
/// prints `SKIP: <why>` and returns.
pub fn kvm_available() -> bool {
    match pvsched_vmm::open_kvm() {
        Ok(_) => true,
        Err(e) => pvsched_testkit::skip_or_fail("this test", &format!("KVM is unusable: {e}")),
    }
}

/// Run `workload` on `vcpus` vCPUs for `secs` seconds.
pub fn run(vm: VmConfig, secs: f64) -> RunReport {
    let cfg = RunConfig::new(vm, Duration::from_secs_f64(secs));
    pvsched_vmm::run(&cfg, |_| {}).expect("run failed")
}

/// A VM configuration.
pub fn config(vcpus: u32, workload: Workload) -> VmConfig {
    VmConfig::new(vcpus, workload)
}
