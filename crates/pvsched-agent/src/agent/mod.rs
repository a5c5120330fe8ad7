//! The agent: loads and attaches the BPF policy, registers VMs (map
//! population, region mapping), and runs the consumer thread (SCHED_FIFO,
//! blocking in epoll on the ring buffer, never spinning) that applies
//! decisions to registered vCPU threads and drives the policy timer.
//!
//! Seam for the embedded mode and a later multi-VM daemon: [`Agent::load`]
//! once per host, [`Agent::register_vm`] per VM, the returned [`VmHandle`]
//! owns the registration (drop = unregister + restore baselines).
//!
//! By concern: this file holds the public types, the registry and
//! registration; `stats` the statistics a VM handle reports; `consumer`
//! the thread that applies decisions and reconciles every tick; `scan`
//! the thread that reads the host's threads for `cosched_us = "auto"`
//! (`fairshare`), off the applier.

mod consumer;
mod cosched;
mod fairshare;
mod gate;
mod scan;
mod stats;
mod trace_out;
mod width;

pub use stats::{
    APPLY_BUCKETS_NS, Counter, LatencyHistogram, ThreadCounters, ThreadStats, VmStats,
};

use crate::applier::ThreadState;
use crate::ident::ThreadIdent;
use crate::intf::{
    MAX_EMULATORS, MAX_VCPUS_PER_VM, MAX_VMS, MODE_DEVICE, MODE_GUEST, MODE_NONE, PvsVcpu, PvsVm,
    gid,
};
use crate::object::{ObjectError, PolicyObject, RegionMmap};
use crate::safety::{self, Restore};
use crate::sched::SchedAttr;
use consumer::consumer;
use pvsched_policy::Caps;
use pvsched_util::pi::PiMutex;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum AgentError {
    /// BPF could not be loaded or attached: the agent refuses to run.
    #[error("pvsched agent refuses to start: the BPF policy could not be set up: {0}")]
    Bpf(#[from] ObjectError),
    /// The VM description is invalid.
    #[error("register_vm: {0}")]
    Invalid(String),
    /// Every VM slot is taken.
    #[error("register_vm: the agent already serves {MAX_VMS} VMs")]
    Full,
    /// The guardian process could not be started: the agent refuses to
    /// boost anything it could not restore after a crash.
    #[error("pvsched agent refuses to start: {0}")]
    Guardian(#[from] crate::guardian::GuardianError),
    /// The decision trace file could not be created.
    #[error("pvsched agent: creating the decision trace {path}: {source}")]
    Trace {
        path: String,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// A system call failed.
    #[error("pvsched agent: {what} failed: {source}")]
    Sys {
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
}

/// Result alias.
pub type Result<T> = std::result::Result<T, AgentError>;

/// Agent configuration.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// SCHED_FIFO priority of the consumer thread (0 = leave it SCHED_OTHER).
    pub consumer_rt_prio: u32,
    /// Policy timer period (throttling and windows of vCPUs with no events)
    /// while any registered thread is boosted, throttled, held
    /// latency-sensitive or co-scheduled.
    pub tick: Duration,
    /// Policy timer period while none is (at least `tick`): the applier
    /// then wakes this seldom, since each of its wake-ups at its RT
    /// priority preempts a vCPU, and nothing needs ending on time. A
    /// decision, a registration or a caps change brings `tick` back at
    /// once; a running vCPU's new guest request that no host event shows
    /// is seen at its next switch or wake-up, or this late.
    pub quiet_tick: Duration,
    /// Install the SIGINT/SIGTERM restore thread.
    pub handle_signals: bool,
    /// Install the restore-on-panic hook.
    pub handle_panics: bool,
    /// Size of the decision ring buffer in bytes (power of two ≥ 4096). A
    /// full ring drops records; reconciliation on the next tick corrects
    /// every thread they concerned.
    pub ring_bytes: u32,
    /// Write every ring-buffer record to this file, one JSON object per
    /// line ([`crate::trace`]); created or truncated at load.
    pub trace: Option<std::path::PathBuf>,
    /// Fork the guardian process ([`crate::guardian`]) that restores every
    /// boosted thread if this process dies (SIGKILL, OOM). On by default;
    /// only a test that checks the VMM-side restore turns it off.
    pub guardian: bool,
    /// Keep the guardian's ledger in this file instead of anonymous
    /// memory ([`crate::guardian::Ledger::open`]): at load, the agent
    /// waits for the file's previous holder and restores every thread it
    /// left boosted, before it loads the policy (pvschedd:
    /// `/run/pvsched/ledger`).
    pub ledger: Option<std::path::PathBuf>,
    /// Largest share of the host's CPUs, percent, that all co-scheduling
    /// VMs together may hold in their co-scheduled phases (caps
    /// `cosched_us`): phases set as a number come first, each cut in the
    /// same proportion when together they do not fit; "auto" phases share
    /// the rest, cut the same way. pvschedd: `[cosched] host_pct`.
    pub cosched_host_pct: u32,
    /// Largest share of its period, percent, that one VM's phase may
    /// hold when its `cosched_us` is `"auto"` (a number is checked when
    /// it is set). pvschedd: `[max] max_cosched_pct`.
    pub cosched_max_pct: u32,
    /// Longest co-scheduled phase, µs, any VM holds: an `"auto"` phase
    /// never grows beyond it nor beyond its VM's `max_boost_us` (unless
    /// that is 0), and a number above either is cut to it (pvschedd
    /// refuses such a number when it is set). pvschedd: `[max]
    /// max_cosched_phase_us`.
    pub cosched_max_phase_us: u64,
    /// A co-scheduled phase yields to an ordinary host thread woken on a
    /// CPU it holds (the vCPU there leaves the phase until that thread
    /// leaves the CPU). False: the host thread waits for the phase's end,
    /// as before this existed; for measuring what the yield does.
    /// pvschedd: `[cosched] yield`.
    pub cosched_yield: bool,
    /// The fair-class slice of a vCPU thread outside its phase, ns (0: the
    /// kernel's default); see [`crate::applier::OFF_PHASE_SLICE_NS`]. It
    /// holds for the whole process: the last agent loaded sets it.
    /// pvschedd: `[cosched] off_slice_us`.
    pub cosched_off_slice_ns: u64,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            consumer_rt_prio: crate::guardian::RESTORER_RT_PRIO,
            tick: Duration::from_millis(5),
            quiet_tick: Duration::from_millis(50),
            handle_signals: true,
            handle_panics: true,
            ring_bytes: crate::object::DEFAULT_RING_BYTES,
            trace: None,
            guardian: true,
            ledger: None,
            cosched_host_pct: 80,
            cosched_max_pct: 75,
            cosched_max_phase_us: pvsched_policy::CapsLimit::default().max_cosched_phase_us,
            cosched_yield: true,
            cosched_off_slice_ns: crate::applier::OFF_PHASE_SLICE_NS,
        }
    }
}

/// Where the VM's region is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegionSpec {
    /// No region (only halt and directed-yield boosts).
    None,
    /// Device region: the agent provides it (see [`VmHandle::region`]).
    DeviceMap,
    /// Guest region: the VMM host address of each slot (index order).
    GuestAddrs(Vec<u64>),
}

/// A VM to register.
#[derive(Clone, Debug)]
pub struct VmSpec {
    /// vCPU thread ids, by slot index.
    pub vcpu_tids: Vec<u32>,
    /// The VM's emulator threads (libvirt's `emulatorsched`: QEMU's main
    /// loop, which raises a TCG guest's timers, or an I/O thread), at most
    /// [`MAX_EMULATORS`]. Each holds the VM's halt boost while any vCPU is
    /// latency-sensitive, within the same caps (its own budget and
    /// continuous limit), and is restored like a vCPU thread.
    pub emulator_tids: Vec<u32>,
    /// APIC ID of each slot.
    pub apic_ids: Vec<u32>,
    /// Admin caps.
    pub caps: Caps,
    /// Region mode.
    pub region: RegionSpec,
    /// The process every thread must belong to (pvschedd: the registering
    /// VMM), checked once each thread is held (see [`crate::ident`]); None:
    /// any thread the caller names.
    pub owner: Option<u32>,
}

#[derive(Default)]
struct VmEntry {
    caps: Caps,
    /// vCPUs plus emulator threads.
    threads: u32,
    /// vCPU threads (indexes below this; the emulator threads follow).
    vcpus: u32,
    latencies: Vec<u64>,
    lat_next: usize,
    apply_hist: stats::LatencyHistogram,
    decisions: u64,
    corrections: u64,
    /// The co-scheduled phase the VM holds now, µs of its period (0: not
    /// co-scheduled): `cosched_us`, or what "auto" measured.
    cosched_now_us: u64,
    /// The device region (device-region VMs): where "auto" reads what the
    /// guest counts of its vCPUs' waits for each other ([`gate`]).
    region: Option<Arc<RegionMmap>>,
    /// That count per vCPU and second over the last window, as "auto"
    /// last measured it (None: not "auto", or its guest reports none).
    sync_rate: Option<f64>,
}

#[derive(Default)]
struct Registry {
    threads: HashMap<u32, ThreadState>,
    vms: HashMap<u32, VmEntry>,
    foreign: u64,
}

impl Registry {
    /// The (gid, tid) of VM `vm_id`'s first `vcpus` threads (its vCPUs)
    /// that have not exited.
    fn live_vcpus(&self, vm_id: u32, vcpus: u32) -> Vec<(u32, u32)> {
        (0..vcpus)
            .filter_map(|i| {
                let g = gid(vm_id, i);
                self.threads
                    .get(&g)
                    .filter(|t| !t.exited)
                    .map(|t| (g, t.tid))
            })
            .collect()
    }
}

struct Inner {
    /// Restores boosted threads if this process dies; before any boost.
    guardian: Option<Arc<crate::guardian::Guardian>>,
    /// The policy's maps; never taken by the applier (it reads the
    /// policy through its own [`crate::object::PolicyView`]). Held across
    /// map updates and test runs.
    obj: PiMutex<PolicyObject>,
    /// What the applier works on. Taken by the applier for every decision,
    /// so every other holder keeps to copying and inserting: no system
    /// call, no sorting. Priority-inheriting because the applier runs at
    /// SCHED_FIFO and the others (status requests, registration) do not:
    /// a holder preempted by a busy host would otherwise stall it for
    /// milliseconds.
    reg: PiMutex<Registry>,
    stop: AtomicBool,
    /// Ring-buffer drops already reported (the BPF `dropped` counter).
    dropped_seen: AtomicU64,
    /// Threads whose baseline could not be put back when their VM was
    /// unregistered: the VM's own statistics go with it, this stays.
    restore_errors: AtomicU64,
    /// The longest time between two of the applier's ticks, ns.
    tick_gap_max_ns: AtomicU64,
    /// The applier thread's TID, 0 until it runs.
    applier_tid: AtomicU32,
    /// Written to end the applier's wait now (an eventfd it polls).
    wake: OwnedFd,
    /// [`AgentConfig::cosched_yield`]: the policy learns each thread's
    /// phase (without it the policy sees no phase and never yields one).
    cosched_yield: bool,
}

impl Inner {
    /// Ends the applier thread's wait now (a registration, a caps change,
    /// or the stop).
    fn wake_applier(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd (which
        // only fails when its counter is near overflow: it is still
        // readable then, so the applier wakes either way).
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// The applier's state of a newly registered thread, guarded by the
    /// guardian's ledger entry of its (vm_id, index) if there is a guardian.
    fn thread_state(&self, tid: u32, vm_id: u32, index: u32) -> ThreadState {
        match &self.guardian {
            Some(g) => ThreadState::guarded(
                tid,
                vm_id,
                index,
                g.clone(),
                crate::guardian::ledger_slot(vm_id, index),
            ),
            None => ThreadState::new(tid, vm_id, index),
        }
    }
}

impl Restore for Inner {
    /// The signal and panic path: the guardian's ledger names every boosted
    /// thread and its baseline, lock-free, so nothing is skipped whatever
    /// lock a panicking thread holds. Without a guardian (a test-only
    /// configuration) the registry is used if its lock is free.
    fn restore_all(&self) {
        if let Some(g) = &self.guardian {
            let n = g.ledger().restore_armed();
            log::warn!("pvsched agent: restored {n} boosted thread(s) to their baselines");
        } else if let Some(mut r) = self.reg.try_lock() {
            for t in r.threads.values_mut() {
                t.restore();
            }
        }
    }
}

/// The loaded, attached policy and its consumer thread.
pub struct Agent {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
    /// The host-thread scan of "auto" co-scheduling; stopped and joined
    /// after the consumer.
    scanner: Option<scan::Scanner>,
    /// Joined after the consumer: the trace is whole once it returns.
    trace_writer: Option<trace_out::TraceWriter>,
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd or -1.
    owned_fd(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
}

/// The fd a system call that creates one returned (or -1 with errno set),
/// owned; call it right after that call, before anything can change errno.
fn owned_fd(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd just returned to us, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Agent {
    /// Loads and attaches the policy and starts the consumer thread. Fails,
    /// saying why, if BPF cannot be used (never silently does nothing).
    pub fn load(cfg: AgentConfig) -> Result<Agent> {
        let (trace, trace_writer) = match &cfg.trace {
            Some(p) => {
                let path = p.display().to_string();
                let file = std::fs::File::create(p).map_err(|source| AgentError::Trace {
                    path: path.clone(),
                    source,
                })?;
                let (out, w) =
                    trace_out::spawn(std::io::BufWriter::new(file), path).map_err(|source| {
                        AgentError::Sys {
                            what: "spawn trace writer thread",
                            source,
                        }
                    })?;
                (out, Some(w))
            }
            None => (trace_out::TraceOut::none(), None),
        };
        // What a previous agent on the same ledger file left boosted is
        // restored before anything else: no baseline can be captured from
        // a thread it boosted.
        let ledger = match (cfg.guardian, &cfg.ledger) {
            (true, Some(path)) => Some(crate::guardian::Ledger::open(
                path,
                crate::guardian::LEDGER_WAIT,
            )?),
            (true, None) => Some(crate::guardian::Ledger::anonymous().map_err(|source| {
                crate::guardian::GuardianError::Setup {
                    what: "mmap of the ledger",
                    source,
                }
            })?),
            (false, _) => None,
        };
        if let Some(l) = &ledger
            && let Some(path) = l.path()
        {
            let left = l.armed();
            let n = l.restore_armed();
            if left > 0 {
                log::warn!(
                    "pvsched agent: {} listed {left} boosted thread(s) of a previous agent; \
                     {n} restored to their baselines, the others are gone or failed",
                    path.display()
                );
            }
        }
        let mut obj = PolicyObject::load_with(true, cfg.ring_bytes)?;
        let ring = obj
            .take_ring()
            .ok_or(AgentError::Bpf(ObjectError::NoMap("decisions")))?;
        let reeval_fd = obj.reeval_fd().map_err(|source| AgentError::Sys {
            what: "dup test fd",
            source,
        })?;
        let view = obj.view()?;
        let guardian = match ledger {
            Some(l) => Some(Arc::new(crate::guardian::Guardian::spawn(l)?)),
            None => None,
        };
        let wake = eventfd().map_err(|source| AgentError::Sys {
            what: "eventfd",
            source,
        })?;
        let wake2 = wake.try_clone().map_err(|source| AgentError::Sys {
            what: "dup eventfd",
            source,
        })?;
        crate::applier::set_off_phase_slice(cfg.cosched_off_slice_ns);
        // Read here, on the loading thread, before the applier's thread
        // (SCHED_FIFO) would be the first to ask.
        let _ = crate::sched::default_slice_ns();
        let inner = Arc::new(Inner {
            guardian,
            obj: PiMutex::new(obj),
            reg: PiMutex::new(Registry::default()),
            stop: AtomicBool::new(false),
            dropped_seen: AtomicU64::new(0),
            restore_errors: AtomicU64::new(0),
            tick_gap_max_ns: AtomicU64::new(0),
            applier_tid: AtomicU32::new(0),
            wake,
            cosched_yield: cfg.cosched_yield,
        });
        // Spawned from the caller's thread, not the applier's (whose
        // FIFO 99 it would inherit); it lowers itself to nice 10 anyway.
        let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (scanner, scan) = scan::Scanner::spawn(host_cpus as f64, scan::SCAN_CPU_BUDGET_NS)
            .map_err(|source| AgentError::Sys {
                what: "spawn host-thread scan thread",
                source,
            })?;
        let inner2 = inner.clone();
        let cfg2 = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("pvsched-apply".into())
            .spawn(move || {
                let ends = consumer::Ends {
                    view,
                    ring,
                    reeval_fd,
                    wake: wake2,
                    trace,
                    scan,
                };
                consumer(inner2, ends, cfg2)
            })
            .map_err(|source| AgentError::Sys {
                what: "spawn consumer thread",
                source,
            })?;
        let weak: std::sync::Weak<dyn Restore> =
            Arc::downgrade(&(inner.clone() as Arc<dyn Restore>));
        safety::register(weak);
        if cfg.handle_panics {
            safety::install_panic_hook();
        }
        if cfg.handle_signals {
            safety::install_signal_thread().map_err(|source| AgentError::Sys {
                what: "signal thread",
                source,
            })?;
        }
        Ok(Agent {
            inner,
            thread: Some(thread),
            scanner: Some(scanner),
            trace_writer,
        })
    }

    /// Registers a VM: validates it, fills the maps, maps its region.
    pub fn register_vm(&self, spec: VmSpec) -> Result<VmHandle> {
        self.register(spec, None)
    }

    /// Creates a device region no VM uses yet (zero-filled). A device
    /// process serves it as BAR2 (its [`RegionMmap::fd`]) from before the
    /// VMM starts; [`Agent::register_vm_with_region`] then gives it to the
    /// VM once its vCPU threads exist (QEMU: `pvsched device
    /// --daemon-region`, then `pvsched qemu-attach --device-region`).
    pub fn create_region(&self) -> Result<Arc<RegionMmap>> {
        Ok(Arc::new(PolicyObject::create_region()?))
    }

    /// [`Agent::register_vm`] with [`RegionSpec::DeviceMap`], using `region`
    /// (from [`Agent::create_region`]) as the VM's region as it is: the
    /// guest may already have written its slots, so nothing is cleared.
    pub fn register_vm_with_region(
        &self,
        spec: VmSpec,
        region: Arc<RegionMmap>,
    ) -> Result<VmHandle> {
        if spec.region != RegionSpec::DeviceMap {
            return Err(AgentError::Invalid(
                "a region is given only with RegionSpec::DeviceMap".into(),
            ));
        }
        self.register(spec, Some(region))
    }

    fn register(&self, spec: VmSpec, given: Option<Arc<RegionMmap>>) -> Result<VmHandle> {
        let nr = spec.vcpu_tids.len();
        if nr == 0 || nr > MAX_VCPUS_PER_VM as usize {
            return Err(AgentError::Invalid(format!(
                "{nr} vCPUs (1..={MAX_VCPUS_PER_VM} supported)"
            )));
        }
        if spec.apic_ids.len() != nr {
            return Err(AgentError::Invalid(
                "apic_ids and vcpu_tids differ in length".into(),
            ));
        }
        if spec.emulator_tids.len() > MAX_EMULATORS as usize {
            return Err(AgentError::Invalid(format!(
                "{} emulator threads (at most {MAX_EMULATORS} supported)",
                spec.emulator_tids.len()
            )));
        }
        let all_tids: Vec<u32> = spec
            .vcpu_tids
            .iter()
            .chain(&spec.emulator_tids)
            .copied()
            .collect();
        for (i, tid) in all_tids.iter().enumerate() {
            if all_tids[..i].contains(tid) {
                return Err(AgentError::Invalid(format!(
                    "thread {tid} is listed twice (vCPU and emulator threads must differ)"
                )));
            }
        }
        spec.caps
            .validate()
            .map_err(|e| AgentError::Invalid(e.to_string()))?;
        let (mode, addrs) = match &spec.region {
            RegionSpec::None => (MODE_NONE, vec![0; nr]),
            RegionSpec::DeviceMap => (MODE_DEVICE, vec![0; nr]),
            RegionSpec::GuestAddrs(a) if a.len() == nr => (MODE_GUEST, a.clone()),
            RegionSpec::GuestAddrs(_) => {
                return Err(AgentError::Invalid(
                    "GuestAddrs needs one address per vCPU".into(),
                ));
            }
        };
        let mut idents = Vec::with_capacity(all_tids.len());
        for &tid in &all_tids {
            idents.push(
                ThreadIdent::open(tid, spec.owner)
                    .map_err(|e| AgentError::Invalid(e.to_string()))?,
            );
        }
        // The map updates run under `obj` alone, which also serializes
        // registrations; `reg` is taken only to check and, at the end, to
        // insert, so the applier never waits for this thread's system
        // calls.
        let mut obj = self.inner.obj.lock();
        let vm_id = {
            let mut reg = self.inner.reg.lock();
            // A registered thread that is gone (its exit or exec record
            // may still be queued) no longer holds its TID.
            for t in reg.threads.values_mut() {
                if all_tids.contains(&t.tid) && t.is_registered() {
                    return Err(AgentError::Invalid(format!(
                        "thread {} is already registered",
                        t.tid
                    )));
                }
            }
            (0..MAX_VMS)
                .find(|i| !reg.vms.contains_key(i))
                .ok_or(AgentError::Full)?
        };
        let region = match (mode == MODE_DEVICE, given) {
            (true, Some(r)) => {
                obj.attach_region(vm_id, &r)?;
                Some(r)
            }
            (true, None) => {
                let r = obj.map_region(vm_id)?;
                r.clear();
                Some(Arc::new(r))
            }
            (false, _) => None,
        };
        let vm = PvsVm {
            active: 0,
            nr_vcpus: nr as u32,
            mode,
            nr_emulators: spec.emulator_tids.len() as u32,
            ..Default::default()
        }
        .with_caps(&spec.caps);
        obj.set_vm(vm_id, &vm)?;
        // vCPUs, then the emulator threads (no slot address, no APIC ID).
        let mut states = Vec::with_capacity(all_tids.len());
        for ((i, &tid), ident) in all_tids.iter().enumerate().zip(idents) {
            let index = i as u32;
            let v = PvsVcpu {
                tid,
                vm_id,
                index,
                slot_addr: addrs.get(i).copied().unwrap_or(0),
                ..Default::default()
            };
            obj.set_vcpu(gid(vm_id, index), &v)?;
            if let Some(&apic) = spec.apic_ids.get(i) {
                obj.set_apic(vm_id, apic, Some(index))?;
            }
            let mut state = self.inner.thread_state(tid, vm_id, index).with_ident(ident);
            if let Some(w) = obj
                .phase_word(gid(vm_id, index))
                .filter(|_| self.inner.cosched_yield)
            {
                state = state.with_phase_word(w);
            }
            states.push((gid(vm_id, index), state));
        }
        for (i, &tid) in all_tids.iter().enumerate() {
            obj.set_tid(tid, Some(gid(vm_id, i as u32)))?;
        }
        // Into the registry before the policy is switched on for the VM,
        // so its first decisions find their threads.
        {
            let mut reg = self.inner.reg.lock();
            reg.threads.extend(states);
            reg.vms.insert(
                vm_id,
                VmEntry {
                    caps: spec.caps.clone(),
                    threads: all_tids.len() as u32,
                    vcpus: nr as u32,
                    region: region.clone(),
                    ..Default::default()
                },
            );
        }
        if let Err(e) = obj.set_vm(vm_id, &PvsVm { active: 1, ..vm }) {
            let mut reg = self.inner.reg.lock();
            reg.threads.retain(|_, t| t.vm_id != vm_id);
            reg.vms.remove(&vm_id);
            return Err(e.into());
        }
        // The applier sleeps while no VM is registered: its ticks (budgets,
        // throttles, reconciliation) start now.
        self.inner.wake_applier();
        Ok(VmHandle {
            inner: self.inner.clone(),
            vm_id,
            spec,
            region,
        })
    }

    /// Run time statistics per program: (name, run_cnt, run_time_ns).
    pub fn prog_stats(&self) -> Vec<(String, u64, u64)> {
        self.inner.obj.lock().prog_stats()
    }

    /// Threads whose baseline could not be put back as their VM was
    /// unregistered, since the agent started (each is also logged).
    pub fn restore_errors(&self) -> u64 {
        self.inner.restore_errors.load(Ordering::Relaxed)
    }

    /// Summed BPF statistics.
    pub fn bpf_stats(&self) -> Result<crate::intf::PvsStats> {
        Ok(self.inner.obj.lock().stats()?)
    }

    /// The TID of the applier thread ("pvsched-apply", the one that applies
    /// every decision): what to watch to see what the agent costs the host.
    /// 0 if it has not started yet.
    pub fn applier_tid(&self) -> u32 {
        self.inner.applier_tid.load(Ordering::Relaxed)
    }

    /// The TID of the host-thread scan ("pvsched-scan", SCHED_OTHER nice
    /// 10), which reads every host thread's figures for `cosched_us =
    /// "auto"` off the applier. 0 until it runs.
    pub fn scan_tid(&self) -> u32 {
        self.scanner.as_ref().map_or(0, |s| s.tid())
    }

    /// Restores every boosted thread now (all VMs).
    pub fn restore_all(&self) {
        let mut r = self.inner.reg.lock();
        for t in r.threads.values_mut() {
            t.restore();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.wake_applier();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        drop(self.scanner.take());
        self.restore_all();
        if let Some(w) = self.trace_writer.take() {
            w.join();
        }
    }
}

/// A registered VM; drop unregisters it and restores its threads.
pub struct VmHandle {
    inner: Arc<Inner>,
    vm_id: u32,
    spec: VmSpec,
    region: Option<Arc<RegionMmap>>,
}

impl VmHandle {
    /// The agent's id for this VM.
    pub fn vm_id(&self) -> u32 {
        self.vm_id
    }

    /// Every registered thread by index: the vCPUs, then the emulator
    /// threads.
    fn threads(&self) -> impl Iterator<Item = &u32> {
        self.spec.vcpu_tids.iter().chain(&self.spec.emulator_tids)
    }

    /// The device region (RegionSpec::DeviceMap): register
    /// `as_ptr()`/`len()` as BAR2's memslot.
    pub fn region(&self) -> Option<Arc<RegionMmap>> {
        self.region.clone()
    }

    /// The features the guest's driver negotiated, as its device region's
    /// header records them (ABI 1.3), what the policy reads for
    /// `kick_pairs = "auto"`. None without a device region, before the
    /// device has written a header, or from a device older than 1.3 (0).
    /// The guest can overwrite the header: this is what the policy sees,
    /// not a verified fact.
    pub fn guest_features(&self) -> Option<u64> {
        use pvsched_abi::RegionHeader as H;
        let lo = self.header_word(std::mem::offset_of!(H, driver_features_lo))?;
        let hi = self.header_word(std::mem::offset_of!(H, driver_features_hi))?;
        let f = u64::from(hi) << 32 | u64::from(lo);
        (f != 0).then_some(f)
    }

    /// The ABI version the guest's driver says it speaks (its
    /// DRIVER_VERSION register, which the device copies into the header
    /// since ABI 1.6): for operators, never for a decision. None as for
    /// [`Self::guest_features`], or from a device older than 1.6.
    pub fn guest_abi(&self) -> Option<u32> {
        let v = self.header_word(std::mem::offset_of!(
            pvsched_abi::RegionHeader,
            driver_version
        ))?;
        (v != 0).then_some(v)
    }

    /// Word `off` of the device region's header, if the device has
    /// written one (its magic is there).
    fn header_word(&self, off: usize) -> Option<u32> {
        use pvsched_abi::seq::SharedWords;
        let w = self.region.as_ref()?.words();
        if w.load(0, Ordering::Acquire) != pvsched_abi::REGION_MAGIC {
            return None;
        }
        Some(w.load(off, Ordering::Acquire))
    }

    /// Baselines captured so far (tid, attributes).
    pub fn baselines(&self) -> Vec<(u32, Option<SchedAttr>)> {
        let r = self.inner.reg.lock();
        let mut v: Vec<_> = r
            .threads
            .values()
            .filter(|t| t.vm_id == self.vm_id)
            .map(|t| (t.index, t.tid, t.baseline))
            .collect();
        v.sort_by_key(|x| x.0);
        v.into_iter().map(|(_, t, b)| (t, b)).collect()
    }

    /// Re-evaluates vCPU `index` now (the device's KICK doorbell: the guest
    /// changed its slot and wants the host to look before the next event).
    /// Out-of-range indices are ignored (guest input).
    pub fn kick(&self, index: u32) {
        if index as usize >= self.spec.vcpu_tids.len() {
            log::debug!("pvsched: kick of slot {index} ignored (out of range)");
            return;
        }
        let gid = gid(self.vm_id, index);
        let obj = self.inner.obj.lock();
        if let Err(e) = obj.reevaluate(
            pvsched_policy::event::EV_TICK,
            gid,
            pvsched_policy::event::NOW_CLOCK,
            0,
            0,
        ) {
            log::warn!("pvsched: kick of slot {index}: {e}");
        }
    }

    /// The caps in force.
    pub fn caps(&self) -> Caps {
        self.inner
            .reg
            .lock()
            .vms
            .get(&self.vm_id)
            .map(|v| v.caps.clone())
            .unwrap_or_else(|| self.spec.caps.clone())
    }

    /// Changes the VM's caps while it runs: the policy decides with the new
    /// caps from its next event, the applier clamps with them at once, and
    /// every thread of the VM is re-evaluated now, so a lowered cap takes
    /// effect within one decision (a thread above it is brought down at the
    /// latest by the next reconciliation tick). Invalid caps change nothing.
    pub fn set_caps(&self, caps: Caps) -> Result<()> {
        caps.validate()
            .map_err(|e| AgentError::Invalid(e.to_string()))?;
        let mut obj = self.inner.obj.lock();
        let vm = obj.vm(self.vm_id)?;
        obj.set_vm(self.vm_id, &vm.with_caps(&caps))?;
        if let Some(v) = self.inner.reg.lock().vms.get_mut(&self.vm_id) {
            v.caps = caps;
        }
        // A quiet applier ticks seldom: new caps (co-scheduling, say) are
        // picked up at a tick, so one is due now.
        self.inner.wake_applier();
        for i in 0..self.threads().count() as u32 {
            if let Err(e) = obj.reevaluate(
                pvsched_policy::event::EV_TICK,
                gid(self.vm_id, i),
                pvsched_policy::event::NOW_CLOCK,
                0,
                0,
            ) {
                log::warn!("pvsched: re-evaluating after a caps change: {e}");
            }
        }
        Ok(())
    }

    /// Restores this VM's boosted threads now.
    pub fn restore(&self) {
        let mut r = self.inner.reg.lock();
        for t in r.threads.values_mut().filter(|t| t.vm_id == self.vm_id) {
            t.restore();
        }
    }
}

impl Drop for VmHandle {
    fn drop(&mut self) {
        let vm_id = self.vm_id;
        // Take the VM's threads out of the registry first: from here on no
        // decision and no reconciliation reaches them (a cleared `vcpus`
        // element would look like an exited thread), so the restore below
        // is the last word on each.
        let mut threads: Vec<ThreadState> = {
            let mut reg = self.inner.reg.lock();
            let gids: Vec<u32> = reg
                .threads
                .iter()
                .filter(|(_, t)| t.vm_id == vm_id)
                .map(|(g, _)| *g)
                .collect();
            gids.iter().filter_map(|g| reg.threads.remove(g)).collect()
        };
        let mut obj = self.inner.obj.lock();
        // Stop the policy so no new decision arrives.
        let _ = obj.set_vm(vm_id, &PvsVm::default());
        if self.region.is_some()
            && let Err(e) = obj.unmap_region(vm_id)
        {
            log::warn!("pvsched: unregistering VM {vm_id}: {e}");
        }
        for (i, &tid) in self.threads().enumerate() {
            // The TID may belong to another VM's thread by now (this one
            // exited or exec'd and the number was reused): leave that one.
            let _ = obj.unset_tid(tid, gid(vm_id, i as u32));
            let _ = obj.remove_vcpu(gid(vm_id, i as u32));
        }
        for &apic in &self.spec.apic_ids {
            let _ = obj.set_apic(vm_id, apic, None);
        }
        drop(obj);
        for t in &mut threads {
            let before = t.errors;
            t.restore();
            if t.errors > before {
                self.inner.restore_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Last: the VM id is free for the next registration.
        self.inner.reg.lock().vms.remove(&vm_id);
    }
}
