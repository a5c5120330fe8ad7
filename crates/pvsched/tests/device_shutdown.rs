//! Real KVM, sandboxed device: shutting the VM down joins every thread the
//! VMM started (vCPUs, device watcher) and leaves no device process behind.
//! (Alone in its test binary so no other test's threads are counted.)

mod common;

use common::{children_with, sandboxed};
use pvsched_vmm::{Run, RunConfig, VmConfig, Workload};
use std::time::Duration;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .count()
}

#[test]
fn shutdown_leaves_no_thread_and_no_device_process() {
    if !common::kvm("shutdown_leaves_no_thread_and_no_device_process") {
        return;
    }
    let me = std::process::id();
    let before = threads();
    for workload in [Workload::Wakeup, Workload::Ipi] {
        let mut cfg = VmConfig::new(2, workload);
        cfg.device_mode = sandboxed();
        let run = Run::start(&RunConfig::new(cfg, Duration::from_millis(300))).expect("start");
        let pid = run.vm().device_pid().expect("device process");
        assert_eq!(children_with(me, "device"), vec![pid]);
        std::thread::sleep(Duration::from_millis(300));
        let r = run.finish();
        assert!(r.clean_shutdown);
        assert!(
            r.device_lost.is_none(),
            "a VMM-initiated stop is not a loss"
        );
        assert_eq!(threads(), before, "threads left after {workload}");
        assert!(
            children_with(me, "device").is_empty(),
            "device process left"
        );
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "device process {pid} not reaped"
        );
    }
}
