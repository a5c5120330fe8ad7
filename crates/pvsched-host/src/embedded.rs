//! The host policy wired to the reference VMM: the BPF policy agent loaded
//! in the VMM's own process (`--policy embedded`) or pvschedd (`--policy
//! daemon`), both through [`crate::host::PolicyHost`]; this module
//! is the VMM's side of it (the device's sink, BAR2's backing, the slots'
//! addresses).
//!
//! * Device-region mode, in-process device: once the vCPU threads exist
//!   and before the guest runs ([`pvsched_vmm::Run::start_with`]), the VM
//!   is registered with a device region ([`Region::Device`]) and the start of the
//!   agent's mmapped BPF array map becomes BAR2's backing (its KVM
//!   memslot): guest slot writes land directly in the map the BPF programs
//!   read.
//! * Device-region mode, sandboxed device: BAR2's memory is the device
//!   process's memfd, which the VMM maps and registers as the memslot. At
//!   the same point the VM is registered with [`Region::Guest`]:
//!   the address of each slot inside the VMM's own mapping of BAR2 (the BPF
//!   programs read them with `bpf_probe_read_user` in the vCPU thread's
//!   context, where that mapping is the current mm). Handing the BPF map fd
//!   to the device process as BAR2's backing instead would put a BPF object
//!   inside the sandbox and need a device-side option; the addresses need
//!   neither, and the slot data still never crosses the socket. The cost:
//!   the BPF programs take their guest-region path (a slot is read only in
//!   its vCPU thread's own context, and the host half is not published), as
//!   with `--region guest`.
//! * Guest-region mode: after the handshake the host address of each slot
//!   (the device's region view + `slot_offset`) is registered with
//!   [`Region::Guest`].
//! * The device's KICK doorbell goes to [`Registration::kick`] ([`KickSink`]).
//!
//! * `--policy daemon`: the same wiring against a running pvschedd
//!   ([`Embedded::daemon`]): the VM is registered over its socket; in
//!   device-region mode with the in-process device, BAR2's backing is the
//!   VM's own region map, received as an fd from the daemon. KICK is not
//!   forwarded (the daemon's 5 ms tick and the guest's own scheduler events
//!   re-evaluate the slot).
//!
//! Restoring: dropping [`Embedded`] unregisters the VM (restoring every
//! boosted vCPU thread's baseline) before the agent goes; SIGINT/SIGTERM and
//! panics are handled by the agent itself (`pvsched_agent::safety`). If a
//! sandboxed device process dies, [`Embedded::device_lost_hook`] (the VM's
//! `on_device_lost`) unregisters the VM at once, keeping its last stats.

use crate::host::{HostError, PolicyHost, Registration};
use pvsched_agent::{Agent, AgentConfig, AgentError, RegionMmap, VmStats};
use pvsched_daemon::ClientError;
use pvsched_daemon::proto::{Region, RegisterVm, Vcpu};
use pvsched_device::{PolicySink, PvschedDevice};
use pvsched_policy::Caps;
use pvsched_vmm::{DeviceLoss, DeviceMode, Vm};
use std::sync::{Arc, Mutex, RwLock};
use vm_memory::MmapRegion;

/// Errors of the embedded policy.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// The agent could not load (BPF unusable, not root...).
    #[error("{0}")]
    Agent(#[from] AgentError),
    /// The VM cannot be served as asked.
    #[error("embedded policy: {0}")]
    Setup(String),
    /// The VMM refused (e.g. the device region).
    #[error("embedded policy: the VMM refused: {0}")]
    Vm(#[from] pvsched_vmm::Error),
    /// pvschedd could not be reached or refused the VM.
    #[error("pvschedd: {0}")]
    Daemon(#[from] ClientError),
}

impl From<HostError> for EmbeddedError {
    fn from(e: HostError) -> Self {
        match e {
            HostError::Agent(e) => EmbeddedError::Agent(e),
            HostError::Daemon(e) => EmbeddedError::Daemon(e),
            e @ HostError::Unsupported(_) => EmbeddedError::Setup(e.to_string()),
        }
    }
}

/// The device's [`PolicySink`] for the embedded policy: KICK re-evaluates
/// the slot now; the region header says a policy is active. It owns the
/// VM's registration, so whoever holds the sink can end it
/// ([`KickSink::unregister`]). Kicks run under the read lock, so ending
/// the registration waits for a kick in flight and no kick starts after it.
#[derive(Default)]
pub struct KickSink {
    vm: RwLock<Option<Arc<Registration>>>,
    last_stats: Mutex<Option<VmStats>>,
}

use pvsched_util::lock;

use pvsched_util::{read, write};

impl KickSink {
    fn set(&self, vm: Option<Arc<Registration>>) {
        let mut g = write(&self.vm);
        // The old registration (if any) ends here, before a kick can see
        // the new one.
        drop(std::mem::replace(&mut *g, vm));
    }

    fn stats(&self) -> Option<VmStats> {
        read(&self.vm).as_ref().and_then(|h| h.stats())
    }

    /// Ends the VM's registration now (every boosted vCPU thread gets its
    /// baseline back); its stats at that moment stay readable. Returns
    /// once the registration is gone.
    pub fn unregister(&self) {
        let mut g = write(&self.vm);
        if let Some(h) = g.take() {
            *lock(&self.last_stats) = h.stats();
            drop(h);
        }
    }
}

impl PolicySink for KickSink {
    fn kick(&self, slot: u32) {
        // VmHandle::kick ignores out-of-range slots (guest input).
        if let Some(r) = read(&self.vm).as_deref() {
            r.kick(slot);
        }
    }

    fn host_flags(&self) -> u32 {
        pvsched_abi::HOST_F_POLICY_ACTIVE
    }
}

/// The policy host, its registration of the VM and the BAR2 backing.
pub struct Embedded {
    // Field order is drop order: the registration (held by the sink,
    // ended in Drop) goes before the agent.
    region: Option<Arc<RegionMmap>>,
    sink: Arc<KickSink>,
    caps: Caps,
    /// The VM's name with pvschedd.
    name: String,
    host: PolicyHost,
}

impl Embedded {
    /// Loads and attaches the BPF policy (fails saying why, never silently).
    pub fn load(caps: Caps, cfg: AgentConfig) -> Result<Self, EmbeddedError> {
        Ok(Self {
            region: None,
            sink: Arc::new(KickSink::default()),
            caps,
            name: String::new(),
            host: PolicyHost::local(cfg)?,
        })
    }

    /// Uses the running pvschedd at `socket` instead (the VM is registered
    /// as `name`, asking for `caps`; a caps file for `name` on the host
    /// wins). Checks now that the daemon answers.
    pub fn daemon(caps: Caps, socket: &std::path::Path, name: &str) -> Result<Self, EmbeddedError> {
        Ok(Self {
            region: None,
            sink: Arc::new(KickSink::default()),
            caps,
            name: name.into(),
            host: PolicyHost::daemon(socket)?,
        })
    }

    /// The sink to put in `VmConfig::policy_sink`.
    pub fn sink(&self) -> Arc<dyn PolicySink> {
        self.sink.clone()
    }

    /// The agent, if it runs in this process.
    pub fn agent(&self) -> Option<&Agent> {
        self.host.agent()
    }

    /// The VM's policy stats: live while registered, else those taken when
    /// it was unregistered after a device loss.
    pub fn stats(&self) -> Option<VmStats> {
        self.sink
            .stats()
            .or_else(|| lock(&self.sink.last_stats).clone())
    }

    /// For `VmConfig::on_device_lost`: when the sandboxed device process
    /// dies, unregister the VM (its vCPU threads back at their baselines).
    pub fn device_lost_hook(&self) -> Arc<dyn Fn(&DeviceLoss) + Send + Sync> {
        let sink = self.sink.clone();
        Arc::new(move |loss: &DeviceLoss| {
            sink.unregister();
            // Logged once the registration has ended: from here on nothing
            // boosts this VM's vCPU threads.
            log::warn!(
                "embedded policy: device process {} lost; VM unregistered, every vCPU thread back at its baseline",
                loss.exit.pid
            );
        })
    }

    /// The agent's region mapping (device-region mode).
    pub fn region(&self) -> Option<&Arc<RegionMmap>> {
        self.region.as_ref()
    }

    fn tids(vm: &Vm) -> Result<Vec<u32>, EmbeddedError> {
        vm.vcpu_tids()
            .into_iter()
            .map(|t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| t != 0)
                    .ok_or_else(|| EmbeddedError::Setup("vCPU threads are not running".into()))
            })
            .collect()
    }

    fn register(&mut self, vm: &Vm, region: Region) -> Result<(), EmbeddedError> {
        if read(&self.sink.vm).is_some() {
            return Err(EmbeddedError::Setup("the VM is already registered".into()));
        }
        let vcpus = Self::tids(vm)?
            .into_iter()
            .zip(vm.apic_ids())
            .map(|(tid, &apic_id)| Vcpu { tid, apic_id })
            .collect();
        let reg = self.host.register(RegisterVm {
            name: self.name.clone(),
            vcpus,
            emulator_tids: vec![],
            region,
            caps: Some(self.caps.clone()),
            pid: None,
            detach: false,
        })?;
        self.sink.set(Some(Arc::new(reg)));
        Ok(())
    }

    /// The region the policy provides (device-map registration): start
    /// and length of this process's mapping of it.
    fn policy_region(&self) -> Option<(*mut u8, usize)> {
        read(&self.sink.vm).as_deref()?.region()
    }

    /// Device-region mode, between `Vm::start_held` and `Vm::release`
    /// (the `attach` of [`pvsched_vmm::Run::start_with`]): registers the
    /// vCPU threads and makes the agent's map BAR2's backing (in-process
    /// device), or registers the slots' addresses in the VMM's mapping of
    /// the device process's BAR2 (sandboxed device).
    pub fn attach_device(&mut self, vm: &mut Vm) -> Result<(), EmbeddedError> {
        let nr = vm.config().vcpus;
        if matches!(vm.config().device_mode, DeviceMode::Sandboxed(_)) {
            let Some(bar2) = vm.bar2_backing() else {
                return Err(EmbeddedError::Setup(
                    "the sandboxed device offers no BAR2 (device-region mode off)".into(),
                ));
            };
            let base = bar2.as_ptr() as u64;
            let addrs = (0..nr)
                .map(|i| base + u64::from(pvsched_abi::slot_offset(nr, i)))
                .collect();
            // `bar2` (the VMM's mapping) lives as long as the VM, which is
            // shut down before the registration ends (Embedded drops last).
            return self.register(vm, Region::Guest(addrs));
        }
        let size = usize::try_from(PvschedDevice::region_bar_size(nr)).unwrap_or(usize::MAX);
        self.register(vm, Region::Device)?;
        let Some((ptr, len)) = self.policy_region() else {
            return Err(EmbeddedError::Setup(
                "the policy gave no region for a device-map VM".into(),
            ));
        };
        if size > len {
            return Err(EmbeddedError::Setup(format!(
                "{nr} vCPUs need a {size}-byte BAR2 but the policy's region is {len} bytes"
            )));
        }
        // SAFETY: `ptr` is a live MAP_SHARED, PROT_READ|PROT_WRITE, page
        // aligned mapping of `len` >= `size` bytes, owned by the
        // registration (the agent's RegionMmap, or the RegionMap received
        // from pvschedd), which the sink keeps until `Embedded` is dropped
        // or the VM is unregistered after a device loss. `Embedded` is
        // dropped only after the VM (whose memslot and device use this
        // MmapRegion) is shut down: `main` and the tests finish the run
        // first; after a device loss the in-process device does not exist
        // (only a sandboxed device can be lost, and it never uses this
        // path). build_raw does not take ownership (no munmap on drop).
        let backing = unsafe {
            MmapRegion::build_raw(
                ptr,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
            )
        }
        .map_err(|e| EmbeddedError::Setup(format!("wrapping the policy's region: {e}")))?;
        vm.set_device_region(Arc::new(backing))?;
        self.region = read(&self.sink.vm)
            .as_deref()
            .and_then(Registration::local)
            .and_then(|h| h.region());
        Ok(())
    }

    /// Guest-region mode, after the handshake: registers each slot's host
    /// address in the guest's RAM mapping.
    pub fn attach_guest(&mut self, vm: &Vm) -> Result<(), EmbeddedError> {
        let Some(view) = vm.region_view() else {
            return Err(EmbeddedError::Setup(
                "the guest attached no region (handshake not done)".into(),
            ));
        };
        let info = view.info();
        let addrs = (0..info.nr_vcpus)
            .map(|i| info.host_addr as u64 + u64::from(pvsched_abi::slot_offset(info.nr_vcpus, i)))
            .collect();
        self.register(vm, Region::Guest(addrs))
    }

    /// Unregisters the VM now (restores its threads); stats are gone after.
    pub fn detach(&mut self) {
        self.sink.set(None);
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        self.detach();
        self.region = None;
    }
}
