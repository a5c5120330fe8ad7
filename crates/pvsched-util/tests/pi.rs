//! The PI mutex on the real kernel: while a SCHED_FIFO thread waits for a
//! lock a SCHED_OTHER thread holds, the holder runs at the waiter's
//! priority (its effective priority read back from /proc), and drops back
//! as it unlocks.

use pvsched_testkit::{root, wait_for};
use pvsched_util::pi::PiMutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(10);

/// Field 18 of /proc/self/task/<tid>/stat: the effective priority as the
/// kernel reports it (nice + 20 for SCHED_OTHER, -1 - rt_priority for a
/// real-time or PI-boosted thread).
fn effective_prio(tid: i32) -> i64 {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
    // The command may hold spaces: fields count from after its ')'.
    let rest = &s[s.rfind(')').expect("comm") + 2..];
    rest.split(' ')
        .nth(15)
        .expect("field 18")
        .parse()
        .expect("a number")
}

fn set_fifo(prio: i32) {
    let p = libc::sched_param {
        sched_priority: prio,
    };
    // SAFETY: sets this thread's policy from a valid sched_param.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) };
    assert_eq!(rc, 0, "SCHED_FIFO: {}", std::io::Error::last_os_error());
}

#[test]
fn a_fifo_waiter_lends_its_priority_to_the_holder() {
    if !root(
        "a_fifo_waiter_lends_its_priority_to_the_holder",
        "SCHED_FIFO",
    ) {
        return;
    }
    let m = Arc::new(PiMutex::new(0u32));
    // SAFETY: gettid has no arguments and cannot fail.
    let holder = unsafe { libc::gettid() };
    let before = effective_prio(holder);
    assert!(before >= 0, "the holder starts as SCHED_OTHER ({before})");
    let g = m.lock();
    let waiting = Arc::new(AtomicBool::new(false));
    let (m2, w2) = (m.clone(), waiting.clone());
    let waiter = std::thread::spawn(move || {
        set_fifo(10);
        w2.store(true, Ordering::SeqCst);
        *m2.lock() += 1;
    });
    wait_for("the waiter to block on the lock", LIMIT, || {
        waiting.load(Ordering::SeqCst).then_some(())
    });
    let lent = wait_for("the holder to inherit FIFO 10", LIMIT, || {
        Some(effective_prio(holder)).filter(|&p| p < 0)
    });
    assert_eq!(lent, -11, "FIFO 10 is reported as -1 - 10");
    drop(g);
    waiter.join().expect("the waiter got the lock");
    assert_eq!(*m.lock(), 1);
    assert_eq!(effective_prio(holder), before, "back to its own priority");
}
