//! A registered thread exits and the kernel gives its TID to a new thread
//! (forced by writing `/proc/sys/kernel/ns_last_pid`): the new thread is
//! never boosted, though the slot of the vCPU that had the TID keeps
//! asking for RT 99. Real BPF (`sched_process_exit`), real threads, read
//! back with sched_getattr.

use crate::common;

use common::{FakeVcpu, need_bpf, vcpu_with_tid, wait_for};
use pvsched_abi::{POLICY_FIFO, POLICY_IDLE, POLICY_NORMAL, SlotGuest};
use pvsched_agent::sched;
use pvsched_agent::{Agent, RegionMmap, RegionSpec, VmSpec};
use pvsched_policy::{BoostKind, Caps};
use std::io::{BufRead, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(10);

/// What both tests need: real BPF and `ns_last_pid` (to hand a freed
/// TID to a new thread), then a loaded agent and caps with no halt or
/// yield boost and no limit (only the guest's slot asks for a boost).
fn setup(test: &str) -> Option<(Agent, Caps)> {
    if !need_bpf(test) {
        return None;
    }
    // CONFIG_CHECKPOINT_RESTORE is in every distribution kernel.
    if std::fs::metadata("/proc/sys/kernel/ns_last_pid").is_err()
        && !pvsched_testkit::skip_or_fail(test, "/proc/sys/kernel/ns_last_pid missing")
    {
        return None;
    }
    let agent = common::agent();
    let caps = Caps {
        halt_boost: BoostKind::None,
        yield_boost: BoostKind::None,
        max_boost_us: 0,
        budget_us: 0,
        ..Caps::default()
    };
    Some((agent, caps))
}

/// What the registered thread's slot asks for throughout: SCHED_FIFO 99.
fn rt99() -> SlotGuest {
    SlotGuest {
        policy: POLICY_FIFO,
        rt_prio: 99,
        ..Default::default()
    }
}

/// For 500 ms, the one slot of `region` keeps asking for RT 99 (each
/// write is an event the policy sees) while `new`, the thread that got the
/// registered thread's `how` TID, is read back every millisecond: it must
/// stay at its own SCHED_OTHER nice 0 throughout. Returns the samples read.
fn never_touched(new: &FakeVcpu, region: &RegionMmap, how: &str) -> u32 {
    let rt99 = rt99();
    let t0 = Instant::now();
    let mut samples = 0;
    while t0.elapsed() < Duration::from_millis(500) {
        region.write_guest(1, 0, &rt99);
        let a = new.attr();
        assert_eq!(
            (a.policy, a.priority, a.nice),
            (POLICY_NORMAL, 0, 0),
            "the new thread with the {how} TID {} was touched",
            new.tid
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    samples
}

#[test]
fn a_reused_tid_is_never_boosted() {
    let Some((agent, caps)) = setup("a_reused_tid_is_never_boosted") else {
        return;
    };
    let old = FakeVcpu::spawn(0, Duration::from_millis(1));
    let tid = old.tid;
    let vm = common::one_vcpu_vm(&agent, tid, caps);
    let region = vm.region().unwrap();
    let rt99 = rt99();
    region.write_guest(1, 0, &rt99);
    wait_for("the registered thread boosted", LIMIT, || {
        Some(old.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    // The thread exits while boosted; its slot still asks for RT 99.
    drop(old);
    let new = vcpu_with_tid(tid).expect("a new thread with the old TID (ns_last_pid)");
    assert_eq!(new.tid, tid);
    let samples = never_touched(&new, &region, "reused");
    let st = vm.stats();
    println!(
        "TID {tid} reused by a new thread: never boosted over {samples} samples in 500 ms \
         (decisions {}, applied boosts {})",
        st.decisions, st.vcpus[0].counters.boosts_applied
    );
    drop(vm);
    assert_eq!(new.attr().policy, POLICY_NORMAL);
}

/// The child side of [`an_execd_thread_is_forgotten_and_its_tid_never_touched`]:
/// a "VMM" whose vCPU thread sets itself to SCHED_IDLE, prints its TID,
/// waits for a line on stdin and then calls execve from that thread (not
/// the leader). Does nothing in a normal test run.
#[test]
fn exec_child() {
    if std::env::var("PVSCHED_EXEC_CHILD").as_deref() != Ok("1") {
        return;
    }
    let t = std::thread::spawn(|| {
        let tid = pvsched_agent::sched::gettid();
        let idle = pvsched_agent::sched::SchedAttr {
            policy: pvsched_abi::POLICY_IDLE,
            ..Default::default()
        };
        pvsched_agent::sched::set(tid, &idle).unwrap();
        println!("EXEC-CHILD TID {tid}");
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        let err = std::process::Command::new("sleep").arg("60").exec();
        panic!("exec failed: {err}");
    });
    let _ = t.join();
}

/// A registered vCPU thread of an unprivileged-looking VMM calls execve
/// from a thread other than the leader: the kernel frees its TID without a
/// sched_process_exit, and the VMM process stays alive. The agent must
/// forget the TID (a new thread of another process that gets it is never
/// touched, may register it itself, and is left alone when the first VM
/// unregisters) and put the exec'd thread, now the VMM's leader, back to
/// its baseline (SCHED_IDLE) instead of leaving the new program at FIFO.
#[test]
fn an_execd_thread_is_forgotten_and_its_tid_never_touched() {
    let Some((agent, caps)) = setup("an_execd_thread_is_forgotten_and_its_tid_never_touched")
    else {
        return;
    };
    let mut child = pvsched_testkit::test_child(module_path!(), "exec_child")
        .env("PVSCHED_EXEC_CHILD", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let tid: u32 = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended");
        if let Some(at) = line.find("EXEC-CHILD TID ") {
            break line[at + 15..].trim().parse().unwrap();
        }
    };
    let vm = agent
        .register_vm(VmSpec {
            owner: Some(pid),
            vcpu_tids: vec![tid],
            emulator_tids: vec![],
            apic_ids: vec![0],
            caps: caps.clone(),
            region: RegionSpec::DeviceMap,
        })
        .expect("the VMM's thread registers");
    let region = vm.region().unwrap();
    let rt99 = rt99();
    region.write_guest(1, 0, &rt99);
    wait_for("the registered thread boosted", LIMIT, || {
        sched::get(tid).ok().filter(|a| a.policy == POLICY_FIFO)
    });
    // The thread execs; the process lives on as `sleep` (pid unchanged).
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "exec").unwrap();
    wait_for("the exec", LIMIT, || {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        (comm.trim() == "sleep" && !Path::new(&format!("/proc/{pid}/task/{tid}")).exists())
            .then_some(())
    });
    wait_for("the exec'd thread back at its baseline", LIMIT, || {
        sched::get(pid).ok().filter(|a| a.policy == POLICY_IDLE)
    });
    // Its TID, freed by the exec, goes to a thread of this (root) process.
    let new = vcpu_with_tid(tid).expect("a new thread with the freed TID (ns_last_pid)");
    let samples = never_touched(&new, &region, "freed");
    // Its real owner may register it, and the first VM's end leaves it be.
    let vm2 = common::one_vcpu_vm(&agent, tid, caps);
    drop(vm);
    let a = new.attr();
    assert_eq!((a.policy, a.nice), (POLICY_NORMAL, 0), "left alone");
    vm2.region().unwrap().write_guest(1, 0, &rt99);
    wait_for("the new owner's boost still applies", LIMIT, || {
        Some(new.attr()).filter(|a| a.policy == POLICY_FIFO)
    });
    drop(vm2);
    assert_eq!(new.attr().policy, POLICY_NORMAL);
    println!(
        "TID {tid} freed by an exec: exec'd thread restored to SCHED_IDLE, new thread \
         never touched over {samples} samples, registered again by its owner"
    );
    let _ = child.kill();
    let _ = child.wait();
}
