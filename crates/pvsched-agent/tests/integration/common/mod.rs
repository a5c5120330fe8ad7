//! Shared helpers of the agent's integration tests: the real-capability
//! check and a stand-in vCPU thread.
#![allow(dead_code)]

use pvsched_agent::sched::{self, SchedAttr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// An agent with the default configuration, no signal handler (the test
/// harness owns the signals).
pub fn agent() -> pvsched_agent::Agent {
    pvsched_agent::Agent::load(pvsched_agent::AgentConfig {
        handle_signals: false,
        ..pvsched_agent::AgentConfig::default()
    })
    .expect("agent loads")
}

/// Caps under which a guest's critical section alone boosts a vCPU (RT
/// priority 2, at most 7), with no halt or yield boost and no boost
/// length or budget limit: what a test of one boost needs.
pub fn cs_boost_caps() -> pvsched_policy::Caps {
    pvsched_policy::Caps {
        halt_boost: pvsched_policy::BoostKind::None,
        yield_boost: pvsched_policy::BoostKind::None,
        max_rt_prio: 7,
        cs_rt_prio: 2,
        max_boost_us: 0,
        budget_us: 0,
        ..pvsched_policy::Caps::default()
    }
}

/// Whether real BPF works here. Missing: panic under PVSCHED_REQUIRE_REAL=1,
/// else print SKIP and return false.
pub fn need_bpf(test: &str) -> bool {
    match pvsched_agent::PolicyObject::load(false) {
        Ok(_) => true,
        Err(e) => pvsched_testkit::skip_or_fail(test, &format!("BPF unavailable: {}", report(&e))),
    }
}

/// A thread standing in for a vCPU thread: sets its nice, then sleeps
/// `period` in a loop (every sleep is a sched_switch out and a wakeup).
pub struct FakeVcpu {
    pub tid: u32,
    stop: Arc<AtomicBool>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl FakeVcpu {
    /// A thread that sleeps `period` in a loop (a vCPU that halts often).
    pub fn spawn(nice: i32, period: Duration) -> FakeVcpu {
        Self::start(nice, Some(period))
    }

    /// A thread that never blocks (a spinning, CPU-bound vCPU).
    pub fn spawn_busy(nice: i32) -> FakeVcpu {
        Self::start(nice, None)
    }

    /// A thread that blocks from its start until it is dropped: no
    /// scheduler event of its own ever changes its run state in the
    /// policy, so a test decides alone what the policy sees.
    pub fn spawn_blocked(nice: i32) -> FakeVcpu {
        Self::start(nice, Some(Duration::MAX))
    }

    fn start(nice: i32, period: Option<Duration>) -> FakeVcpu {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let join = std::thread::spawn(move || {
            let tid = sched::gettid();
            let mut a = sched::get(tid).unwrap();
            a.nice = nice;
            sched::set(tid, &a).unwrap();
            tx.send(tid).unwrap();
            while !s2.load(Ordering::Relaxed) {
                match period {
                    Some(Duration::MAX) => std::thread::park(),
                    Some(p) => std::thread::sleep(p),
                    None => std::hint::spin_loop(),
                }
            }
        });
        let tid = rx.recv().unwrap();
        FakeVcpu {
            tid,
            stop,
            join: Some(join),
        }
    }

    pub fn attr(&self) -> SchedAttr {
        sched::get(self.tid).unwrap()
    }
}

impl Drop for FakeVcpu {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            j.thread().unpark();
            let _ = j.join();
        }
    }
}

/// Starts a FakeVcpu whose TID is `tid` (a number a thread just freed):
/// sets ns_last_pid to tid - 1 right before each try, since another
/// process may take the number first. The kernel frees a thread's TID
/// only once it has released the thread, which on a busy host (RT
/// spinners of other tests) can come well after its join returned: until
/// then each clone gets another number. So it waits for the TID to leave
/// /proc and keeps trying for a few seconds, not a fixed count. Root only.
pub fn vcpu_with_tid(tid: u32) -> Option<FakeVcpu> {
    let t0 = std::time::Instant::now();
    let limit = Duration::from_secs(5);
    let taken = || std::path::Path::new(&format!("/proc/{tid}")).exists();
    while taken() && t0.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(1));
    }
    while t0.elapsed() < limit {
        {
            // ns_last_pid is one for the whole host: two tests of this
            // binary running side by side (one searching many TIDs in a
            // tight loop) would otherwise spend each other's write before
            // their clone.
            let _one_at_a_time = NS_LAST_PID.lock().unwrap_or_else(|e| e.into_inner());
            std::fs::write("/proc/sys/kernel/ns_last_pid", (tid - 1).to_string()).ok()?;
            let v = FakeVcpu::spawn(0, Duration::from_millis(1));
            if v.tid == tid {
                return Some(v);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// Held from a write of `ns_last_pid` to the clone it is for.
static NS_LAST_PID: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Held by each test that keeps CPUs busy at an RT priority (spinning
/// threads in co-scheduled phases, SCHED_FIFO spinners) or measures how
/// long a thread waits for a CPU: they run one at a time, so that a wait
/// one of them measures is the one it causes, not another test's spinner.
pub fn cpu_bound() -> std::sync::MutexGuard<'static, ()> {
    static CPU_BOUND: std::sync::Mutex<()> = std::sync::Mutex::new(());
    CPU_BOUND.lock().unwrap_or_else(|e| e.into_inner())
}

#[allow(unused_imports)] // not every test binary polls
pub use pvsched_testkit::wait_for;

/// An error with its whole source chain.
pub fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Registers a VM in device-region mode with `caps`: vCPU threads
/// `vcpu_tids` (APIC IDs 0, 1, ...) and emulator threads `emulator_tids`.
pub fn device_vm(
    agent: &pvsched_agent::Agent,
    vcpu_tids: &[u32],
    emulator_tids: &[u32],
    caps: pvsched_policy::Caps,
) -> pvsched_agent::VmHandle {
    agent
        .register_vm(pvsched_agent::VmSpec {
            owner: None,
            emulator_tids: emulator_tids.to_vec(),
            vcpu_tids: vcpu_tids.to_vec(),
            apic_ids: (0..vcpu_tids.len() as u32).collect(),
            caps,
            region: pvsched_agent::RegionSpec::DeviceMap,
        })
        .expect("the VM registers")
}

/// Registers a one-vCPU VM (thread `tid`, APIC ID 0) in device-region
/// mode with `caps`.
pub fn one_vcpu_vm(
    agent: &pvsched_agent::Agent,
    tid: u32,
    caps: pvsched_policy::Caps,
) -> pvsched_agent::VmHandle {
    device_vm(agent, &[tid], &[], caps)
}

/// Plays the part of a guest driver that negotiated `F_SYNC_COUNTS` (ABI
/// 1.5) in a device-region VM's real region, as the guest would write it:
/// the header's magic and driver features, then every 50 ms each slot's
/// guest half (`slot`, with `wakes` advanced so that each vCPU reports
/// `per_vcpu_s` wake-ups of a task that last ran on another vCPU a
/// second). What "auto" reads to tell a guest whose vCPUs hand work to
/// each other from a batch guest. Stops when dropped.
pub struct SyncCounts {
    stop: Arc<AtomicBool>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl SyncCounts {
    pub fn start(
        vm: &pvsched_agent::VmHandle,
        vcpus: u32,
        per_vcpu_s: u64,
        slot: pvsched_abi::SlotGuest,
    ) -> SyncCounts {
        use pvsched_abi::seq::SharedWords;
        let region = vm.region().expect("a device-region VM");
        let w = region.words();
        w.store(0, pvsched_abi::REGION_MAGIC, Ordering::Release);
        w.store(
            std::mem::offset_of!(pvsched_abi::RegionHeader, driver_features_lo),
            (pvsched_abi::F_DEVICE_REGION | pvsched_abi::F_SYNC_COUNTS) as u32,
            Ordering::Release,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let join = std::thread::spawn(move || {
            let mut wakes = 0u64;
            while !s2.load(Ordering::Relaxed) {
                for i in 0..vcpus {
                    let g = pvsched_abi::SlotGuest { wakes, ..slot };
                    assert!(region.write_guest(vcpus, i, &g));
                }
                wakes += per_vcpu_s / 20;
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        SyncCounts {
            stop,
            join: Some(join),
        }
    }
}

impl Drop for SyncCounts {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            j.thread().unpark();
            let _ = j.join();
        }
    }
}

/// Pins thread `tid` (0: the caller) to `cpu`.
pub fn pin(tid: u32, cpu: usize) {
    pin_to(tid, &[cpu]);
}

/// Lets thread `tid` (0: the caller) run on `cpus` only.
pub fn pin_to(tid: u32, cpus: &[usize]) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and
    // sched_setaffinity read and write only that set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        assert_eq!(
            libc::sched_setaffinity(tid as libc::pid_t, size_of::<libc::cpu_set_t>(), &set),
            0,
            "pin thread {tid} to CPUs {cpus:?}: {}",
            std::io::Error::last_os_error()
        );
    }
}
