//! The agent: loads and attaches the BPF policy, registers VMs (map
//! population, region mapping), and runs the consumer thread (SCHED_FIFO,
//! blocking in epoll on the ring buffer, never spinning) that applies
//! decisions to registered vCPU threads and drives the policy timer.
//!
//! Seam for the embedded mode and a later multi-VM daemon: [`Agent::load`]
//! once per host, [`Agent::register_vm`] per VM, the returned [`VmHandle`]
//! owns the registration (drop = unregister + restore baselines).

use crate::applier::ThreadState;
use crate::intf::{
    MAX_EMULATORS, MAX_VCPUS_PER_VM, MAX_VMS, MODE_DEVICE, MODE_GUEST, MODE_NONE, PvsDecision,
    PvsVcpu, PvsVm, gid, gid_vm,
};
use crate::object::{ObjectError, PolicyObject, RegionMmap, reevaluate};
use crate::safety::{self, Restore};
use crate::sched::{self, SchedAttr};
use pvsched_policy::Caps;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
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
        /// The file.
        path: String,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// A system call failed.
    #[error("pvsched agent: {what} failed: {source}")]
    Sys {
        /// What.
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
    /// Policy timer period (throttling and windows of vCPUs with no events).
    pub tick: Duration,
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
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            consumer_rt_prio: 50,
            tick: Duration::from_millis(5),
            handle_signals: true,
            handle_panics: true,
            ring_bytes: crate::object::DEFAULT_RING_BYTES,
            trace: None,
            guardian: true,
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
}

#[derive(Default)]
struct VmEntry {
    caps: Caps,
    /// vCPUs plus emulator threads.
    threads: u32,
    latencies: Vec<u64>,
    lat_next: usize,
    decisions: u64,
    corrections: u64,
}

const LAT_SAMPLES: usize = 8192;

#[derive(Default)]
struct Registry {
    threads: HashMap<u32, ThreadState>,
    vms: HashMap<u32, VmEntry>,
    foreign: u64,
}

struct Inner {
    /// Restores boosted threads if this process dies; before any boost.
    guardian: Option<Arc<crate::guardian::Guardian>>,
    obj: Mutex<PolicyObject>,
    reg: Mutex<Registry>,
    stop: AtomicBool,
    /// Ring-buffer drops already reported (the BPF `dropped` counter).
    dropped_seen: AtomicU64,
}

impl Inner {
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

use pvsched_util::lock;

impl Restore for Inner {
    /// The signal and panic path: the guardian's ledger names every boosted
    /// thread and its baseline, lock-free, so nothing is skipped whatever
    /// lock a panicking thread holds. Without a guardian (a test-only
    /// configuration) the registry is used if its lock is free.
    fn restore_all(&self) {
        if let Some(g) = &self.guardian {
            let n = g.ledger().restore_armed();
            log::warn!("pvsched agent: restored {n} boosted thread(s) to their baselines");
        } else if let Ok(mut r) = self.reg.try_lock() {
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
    wake: OwnedFd,
}

fn now_mono() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the valid timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Agent {
    /// Loads and attaches the policy and starts the consumer thread. Fails,
    /// saying why, if BPF cannot be used (never silently does nothing).
    pub fn load(cfg: AgentConfig) -> Result<Agent> {
        let trace = match &cfg.trace {
            Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).map_err(
                |source| AgentError::Trace {
                    path: p.display().to_string(),
                    source,
                },
            )?)),
            None => None,
        };
        let mut obj = PolicyObject::load_with(true, cfg.ring_bytes)?;
        let ring = obj
            .take_ring()
            .ok_or(AgentError::Bpf(ObjectError::NoMap("decisions")))?;
        let reeval_fd = obj.reeval_fd().map_err(|source| AgentError::Sys {
            what: "dup test fd",
            source,
        })?;
        let guardian = if cfg.guardian {
            Some(Arc::new(crate::guardian::Guardian::spawn()?))
        } else {
            None
        };
        let inner = Arc::new(Inner {
            guardian,
            obj: Mutex::new(obj),
            reg: Mutex::new(Registry::default()),
            stop: AtomicBool::new(false),
            dropped_seen: AtomicU64::new(0),
        });
        let wake = eventfd().map_err(|source| AgentError::Sys {
            what: "eventfd",
            source,
        })?;
        let wake2 = wake.try_clone().map_err(|source| AgentError::Sys {
            what: "dup eventfd",
            source,
        })?;
        let inner2 = inner.clone();
        let cfg2 = cfg.clone();
        let thread = std::thread::Builder::new()
            .name("pvsched-apply".into())
            .spawn(move || consumer(inner2, ring, reeval_fd, wake2, cfg2, trace))
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
            wake,
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
        for &tid in &all_tids {
            if !std::path::Path::new(&format!("/proc/{tid}")).exists() {
                return Err(AgentError::Invalid(format!("thread {tid} does not exist")));
            }
        }
        let mut obj = lock(&self.inner.obj);
        let mut reg = lock(&self.inner.reg);
        if let Some(t) = reg.threads.values().find(|t| all_tids.contains(&t.tid)) {
            return Err(AgentError::Invalid(format!(
                "thread {} is already registered",
                t.tid
            )));
        }
        let vm_id = (0..MAX_VMS)
            .find(|i| !reg.vms.contains_key(i))
            .ok_or(AgentError::Full)?;
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
        for (i, &tid) in all_tids.iter().enumerate() {
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
            reg.threads.insert(
                gid(vm_id, index),
                self.inner.thread_state(tid, vm_id, index),
            );
        }
        for (i, &tid) in all_tids.iter().enumerate() {
            obj.set_tid(tid, Some(gid(vm_id, i as u32)))?;
        }
        obj.set_vm(vm_id, &PvsVm { active: 1, ..vm })?;
        reg.vms.insert(
            vm_id,
            VmEntry {
                caps: spec.caps.clone(),
                threads: all_tids.len() as u32,
                ..Default::default()
            },
        );
        Ok(VmHandle {
            inner: self.inner.clone(),
            vm_id,
            spec,
            region,
        })
    }

    /// Run time statistics per program: (name, run_cnt, run_time_ns).
    pub fn prog_stats(&self) -> Vec<(String, u64, u64)> {
        lock(&self.inner.obj).prog_stats()
    }

    /// Summed BPF statistics.
    pub fn bpf_stats(&self) -> Result<crate::intf::PvsStats> {
        Ok(lock(&self.inner.obj).stats()?)
    }

    /// Restores every boosted thread now (all VMs).
    pub fn restore_all(&self) {
        let mut r = lock(&self.inner.reg);
        for t in r.threads.values_mut() {
            t.restore();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.restore_all();
    }
}

/// Statistics of one registered thread (a vCPU or an emulator thread).
#[derive(Clone, Debug, Default)]
pub struct ThreadStats {
    /// Thread.
    pub tid: u32,
    /// Boosts decided by BPF.
    pub boosts: u64,
    /// Throttles decided by BPF.
    pub throttles: u64,
    /// Boosted on-CPU nanoseconds (charged at the vCPU's events).
    pub boosted_ns: u64,
    /// Boosted on-CPU nanoseconds charged to the current budget window.
    pub budget_used_ns: u64,
    /// Boosted on-CPU nanoseconds since the vCPU last blocked or halted.
    pub cont_ns: u64,
    /// Unicast IPIs recorded from this vCPU.
    pub ipis: u64,
    /// Times this vCPU's directed-yield slot target was boosted.
    pub slot_hits: u64,
    /// Current directed-yield slot (+1, 0 = none).
    pub yield_slot: u32,
    /// Last confirmed IPI receiver (+1).
    pub last_ipi_target: u32,
    /// Currently decided boost.
    pub boost: u32,
    /// Its priority.
    pub boost_prio: i32,
    /// 1 while throttled.
    pub throttled: u32,
    /// sched_setattr boosts the agent applied.
    pub boosts_applied: u64,
    /// Times reconciliation corrected the thread (lost decision record,
    /// failed syscall, outside change while boosted).
    pub corrections: u64,
    /// Failed syscalls.
    pub errors: u64,
}

/// Per-VM statistics.
#[derive(Clone, Debug, Default)]
pub struct VmStats {
    /// By slot index.
    pub vcpus: Vec<ThreadStats>,
    /// The emulator threads, in [`VmSpec::emulator_tids`] order (no IPI
    /// or yield figures).
    pub emulators: Vec<ThreadStats>,
    /// Decisions the applier handled for this VM.
    pub decisions: u64,
    /// Decisions the ring buffer dropped (all VMs); reconciliation corrects
    /// the threads they concerned at the next tick.
    pub dropped: u64,
    /// Corrections made by reconciliation in this VM.
    pub corrections: u64,
    /// Decision → applied latency samples.
    pub apply_samples: usize,
    /// p50, ns.
    pub apply_p50_ns: u64,
    /// p99, ns.
    pub apply_p99_ns: u64,
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

    /// Baselines captured so far (tid, attributes).
    pub fn baselines(&self) -> Vec<(u32, Option<SchedAttr>)> {
        let r = lock(&self.inner.reg);
        let mut v: Vec<_> = r
            .threads
            .values()
            .filter(|t| t.vm_id == self.vm_id)
            .map(|t| (t.index, t.tid, t.baseline))
            .collect();
        v.sort_by_key(|x| x.0);
        v.into_iter().map(|(_, t, b)| (t, b)).collect()
    }

    /// Statistics.
    pub fn stats(&self) -> VmStats {
        let obj = lock(&self.inner.obj);
        let reg = lock(&self.inner.reg);
        let mut out = VmStats::default();
        if let Ok(s) = obj.stats() {
            out.dropped = s.dropped;
        }
        let nr = self.spec.vcpu_tids.len();
        for (i, &tid) in self.threads().enumerate() {
            let gid = gid(self.vm_id, i as u32);
            let mut vs = ThreadStats {
                tid,
                ..Default::default()
            };
            if let Ok(v) = obj.vcpu(gid) {
                vs.boosts = v.boosts;
                vs.throttles = v.throttles;
                vs.boosted_ns = v.boosted_ns;
                vs.budget_used_ns = v.budget_used;
                vs.cont_ns = v.cont_ns;
                vs.ipis = v.ipis;
                vs.slot_hits = v.slot_hits;
                vs.yield_slot = v.yield_slot;
                vs.last_ipi_target = v.last_ipi_target;
                vs.boost = v.boost;
                vs.boost_prio = v.boost_prio;
                vs.throttled = v.throttled;
            }
            if let Some(t) = reg.threads.get(&gid) {
                vs.boosts_applied = t.boosts_applied;
                vs.corrections = t.corrections;
                vs.errors = t.errors;
            }
            if i < nr {
                out.vcpus.push(vs);
            } else {
                out.emulators.push(vs);
            }
        }
        if let Some(vm) = reg.vms.get(&self.vm_id) {
            out.decisions = vm.decisions;
            out.corrections = vm.corrections;
            let mut l = vm.latencies.clone();
            l.sort_unstable();
            out.apply_samples = l.len();
            out.apply_p50_ns = pvsched_util::percentile(&l, 50.0).unwrap_or(0);
            out.apply_p99_ns = pvsched_util::percentile(&l, 99.0).unwrap_or(0);
        }
        out
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
        let obj = lock(&self.inner.obj);
        if let Err(e) = obj.reevaluate(pvsched_policy::event::EV_TICK, gid, now_mono(), 0, 0) {
            log::warn!("pvsched: kick of slot {index}: {e}");
        }
    }

    /// The caps in force.
    pub fn caps(&self) -> Caps {
        lock(&self.inner.reg)
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
        {
            let mut obj = lock(&self.inner.obj);
            let mut reg = lock(&self.inner.reg);
            let vm = obj.vm(self.vm_id)?;
            obj.set_vm(self.vm_id, &vm.with_caps(&caps))?;
            if let Some(v) = reg.vms.get_mut(&self.vm_id) {
                v.caps = caps;
            }
        }
        let now = now_mono();
        let obj = lock(&self.inner.obj);
        for i in 0..self.threads().count() as u32 {
            if let Err(e) = obj.reevaluate(
                pvsched_policy::event::EV_TICK,
                gid(self.vm_id, i),
                now,
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
        let mut r = lock(&self.inner.reg);
        for t in r.threads.values_mut().filter(|t| t.vm_id == self.vm_id) {
            t.restore();
        }
    }
}

impl Drop for VmHandle {
    fn drop(&mut self) {
        let mut obj = lock(&self.inner.obj);
        // Stop the policy first so no new decision arrives, then restore.
        let _ = obj.set_vm(self.vm_id, &PvsVm::default());
        if self.region.is_some()
            && let Err(e) = obj.unmap_region(self.vm_id)
        {
            log::warn!("pvsched: unregistering VM {}: {e}", self.vm_id);
        }
        for (i, &tid) in self.threads().enumerate() {
            let _ = obj.set_tid(tid, None);
            let _ = obj.remove_vcpu(gid(self.vm_id, i as u32));
        }
        for &apic in &self.spec.apic_ids {
            let _ = obj.set_apic(self.vm_id, apic, None);
        }
        drop(obj);
        let mut reg = lock(&self.inner.reg);
        let vm_id = self.vm_id;
        for t in reg.threads.values_mut().filter(|t| t.vm_id == vm_id) {
            t.restore();
        }
        reg.threads.retain(|_, t| t.vm_id != vm_id);
        reg.vms.remove(&vm_id);
    }
}

fn handle(inner: &Inner, d: &PvsDecision) {
    let mut guard = lock(&inner.reg);
    let reg = &mut *guard;
    let vm_id = gid_vm(d.gid);
    let Some(vm) = reg.vms.get_mut(&vm_id) else {
        reg.foreign += 1;
        return;
    };
    if d.reason == pvsched_policy::event::R_EXITED {
        if let Some(t) = reg.threads.get_mut(&d.gid).filter(|t| t.tid == d.tid) {
            log::debug!("pvsched: registered thread {} exited", d.tid);
            t.exit();
        }
        return;
    }
    // Registered TIDs only: the thread must be the one registered at gid.
    let Some(t) = reg
        .threads
        .get_mut(&d.gid)
        .filter(|t| t.tid == d.tid && t.index < vm.threads)
    else {
        reg.foreign += 1;
        return;
    };
    vm.decisions += 1;
    if t.apply(d.kind, d.prio, d.reason, &vm.caps) {
        let lat = now_mono().saturating_sub(d.ts);
        if vm.latencies.len() < LAT_SAMPLES {
            vm.latencies.push(lat);
        } else {
            vm.latencies[vm.lat_next] = lat;
            vm.lat_next = (vm.lat_next + 1) % LAT_SAMPLES;
        }
    }
}

/// The decision trace being written, if any; a write error ends it (logged
/// once), never the agent.
struct TraceOut(Option<std::io::BufWriter<std::fs::File>>);

impl TraceOut {
    fn record(&mut self, d: &PvsDecision) {
        if let Some(w) = &mut self.0
            && let Err(e) = crate::trace::write_record(w, d)
        {
            log::warn!("pvsched agent: writing the decision trace failed, tracing stops: {e}");
            self.0 = None;
        }
    }

    fn flush(&mut self) {
        if let Some(w) = &mut self.0
            && let Err(e) = std::io::Write::flush(w)
        {
            log::warn!("pvsched agent: writing the decision trace failed, tracing stops: {e}");
            self.0 = None;
        }
    }
}

/// Handles every record waiting in the ring.
fn drain(inner: &Inner, ring: &mut aya::maps::RingBuf<aya::maps::MapData>, trace: &mut TraceOut) {
    while let Some(item) = ring.next() {
        if let Some(d) = PvsDecision::from_bytes(&item) {
            handle(inner, &d);
            trace.record(&d);
        }
    }
}

fn consumer(
    inner: Arc<Inner>,
    mut ring: aya::maps::RingBuf<aya::maps::MapData>,
    reeval_fd: OwnedFd,
    wake: OwnedFd,
    cfg: AgentConfig,
    trace: Option<std::io::BufWriter<std::fs::File>>,
) {
    let mut trace = TraceOut(trace);
    if cfg.consumer_rt_prio > 0 {
        let attr = SchedAttr {
            policy: pvsched_abi::POLICY_FIFO,
            priority: cfg.consumer_rt_prio.min(99),
            nice: 0,
            flags: 0,
        };
        if let Err(e) = sched::set(sched::gettid(), &attr) {
            log::warn!("pvsched consumer stays SCHED_OTHER: {e}");
        }
    }
    // SAFETY: epoll_create1 returns a new fd or -1.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        log::error!(
            "pvsched consumer: epoll_create1 failed: {}",
            io::Error::last_os_error()
        );
        return;
    }
    // SAFETY: fresh fd we own.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    for (fd, tag) in [
        (std::os::fd::AsRawFd::as_raw_fd(&ring), 1u64),
        (wake.as_raw_fd(), 2u64),
    ] {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: tag,
        };
        // SAFETY: valid epoll fd, valid target fd, valid event struct.
        if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
            log::error!(
                "pvsched consumer: epoll_ctl failed: {}",
                io::Error::last_os_error()
            );
            return;
        }
    }
    let tick_ns = cfg.tick.as_nanos().max(1_000_000) as u64;
    let mut next_tick = now_mono() + tick_ns;
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
    while !inner.stop.load(Ordering::SeqCst) {
        let wait_ms = (next_tick.saturating_sub(now_mono()) / 1_000_000).max(1) as i32;
        // SAFETY: evs is a valid buffer of 4 events.
        unsafe { libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, wait_ms) };
        if inner.stop.load(Ordering::SeqCst) {
            break;
        }
        drain(&inner, &mut ring, &mut trace);
        let now = now_mono();
        if now >= next_tick {
            next_tick = now + tick_ns;
            let gids: Vec<u32> = lock(&inner.reg).threads.keys().copied().collect();
            for gid in gids {
                if let Err(e) = reevaluate(
                    &reeval_fd,
                    pvsched_policy::event::EV_TICK,
                    gid,
                    now_mono(),
                    0,
                    0,
                ) {
                    log::warn!("pvsched timer: BPF_PROG_TEST_RUN failed: {e}");
                    break;
                }
            }
            drain(&inner, &mut ring, &mut trace);
            reconcile(&inner);
            trace.flush();
        }
    }
    // What is left of the trace (unregistration sends no records).
    drain(&inner, &mut ring, &mut trace);
    trace.flush();
}

/// Level-triggered application: every tick, after the ring is drained,
/// brings each registered thread to the policy's current boost in the
/// `vcpus` map, so a decision record lost to a full ring (or a failed
/// syscall) can never leave a thread boosted past what the policy decided.
fn reconcile(inner: &Inner) {
    let gids: Vec<u32> = lock(&inner.reg).threads.keys().copied().collect();
    let (states, dropped): (Vec<(u32, u32, i32, u32)>, u64) = {
        let obj = lock(&inner.obj);
        let states = gids
            .iter()
            .filter_map(|&g| obj.vcpu(g).ok().map(|v| (g, v.boost, v.boost_prio, v.tid)))
            .collect();
        (states, obj.stats().map(|s| s.dropped).unwrap_or(0))
    };
    let seen = inner.dropped_seen.swap(dropped, Ordering::Relaxed);
    if dropped > seen {
        log::warn!(
            "pvsched agent: the decision ring overflowed ({} records dropped, {dropped} in all); \
             reconciling every thread with the policy's state",
            dropped - seen
        );
    }
    let mut guard = lock(&inner.reg);
    let reg = &mut *guard;
    for (gid, kind, prio, policy_tid) in states {
        let Some(vm) = reg.vms.get_mut(&gid_vm(gid)) else {
            continue;
        };
        let Some(t) = reg.threads.get_mut(&gid) else {
            continue;
        };
        if policy_tid != t.tid {
            // The policy forgot the thread (it exited; its record may
            // have been dropped): never touch its TID again.
            if !t.exited {
                t.exit();
            }
            continue;
        }
        if t.reconcile(kind, prio, &vm.caps) {
            vm.corrections += 1;
        }
    }
}
