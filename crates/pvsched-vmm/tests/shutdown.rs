//! Real KVM: shutdown joins every thread the VMM started. (Alone in its
//! test binary so no other test's threads are counted.)

mod common;

use pvsched_vmm::{Run, RunConfig, Workload};
use std::time::Duration;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("procfs")
        .count()
}

#[test]
fn shutdown_leaves_no_thread_behind() {
    if !common::kvm_available() {
        return;
    }
    let before = threads();
    for workload in [Workload::Wakeup, Workload::Ipi] {
        let run = Run::start(&RunConfig::new(
            common::config(3, workload),
            Duration::from_millis(300),
        ))
        .expect("start");
        let tids = run.vm().vcpu_tids();
        assert_eq!(tids.len(), 3);
        // vCPU threads are named and running while the VM runs.
        for (i, tid) in tids.iter().enumerate() {
            let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap();
            assert_eq!(comm.trim(), format!("vcpu {i}"));
        }
        assert!(threads() >= before + 3);
        std::thread::sleep(Duration::from_millis(300));
        let r = run.finish();
        assert!(r.clean_shutdown);
        assert_eq!(threads(), before, "threads left after {workload}");
    }
}
