//! `--policy embedded`: the pvsched BPF policy agent loaded in the VMM's own
//! process and wired to the reference VMM.
//!
//! * Device-region mode: once the vCPU threads exist and before the guest
//!   runs ([`pvsched_vmm::Run::start_with`]), the VM is registered with
//!   [`RegionSpec::DeviceMap`] and the start of the agent's mmapped BPF
//!   array map becomes BAR2's backing (its KVM memslot): guest slot writes
//!   land directly in the map the BPF programs read.
//! * Guest-region mode: after the handshake the host address of each slot
//!   (the device's region view + `slot_offset`) is registered with
//!   [`RegionSpec::GuestAddrs`].
//! * The device's KICK doorbell goes to [`VmHandle::kick`] ([`KickSink`]).
//!
//! Restoring: dropping [`Embedded`] unregisters the VM (restoring every
//! boosted vCPU thread's baseline) before the agent goes; SIGINT/SIGTERM and
//! panics are handled by the agent itself (`pvsched_agent::safety`).

use pvsched_agent::{Agent, AgentConfig, AgentError, RegionMmap, RegionSpec, VmHandle, VmSpec};
use pvsched_device::{PolicySink, PvschedDevice};
use pvsched_policy::Caps;
use pvsched_vmm::Vm;
use std::sync::{Arc, Mutex, Weak};
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
}

/// The device's [`PolicySink`] for the embedded policy: KICK re-evaluates
/// the slot now; the region header says a policy is active.
#[derive(Default)]
pub struct KickSink {
    vm: Mutex<Option<Weak<VmHandle>>>,
}

impl KickSink {
    fn set(&self, vm: Option<Weak<VmHandle>>) {
        *self.vm.lock().unwrap_or_else(|e| e.into_inner()) = vm;
    }

    fn handle(&self) -> Option<Arc<VmHandle>> {
        self.vm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
    }
}

impl PolicySink for KickSink {
    fn kick(&self, slot: u32) {
        // VmHandle::kick ignores out-of-range slots (guest input).
        if let Some(h) = self.handle() {
            h.kick(slot);
        }
    }

    fn host_flags(&self) -> u32 {
        pvsched_abi::HOST_F_POLICY_ACTIVE
    }
}

/// The agent, its registration of the VM and the BAR2 backing.
pub struct Embedded {
    // Field order is drop order: the registration goes before the agent.
    vm: Option<Arc<VmHandle>>,
    region: Option<Arc<RegionMmap>>,
    sink: Arc<KickSink>,
    caps: Caps,
    agent: Agent,
}

impl Embedded {
    /// Loads and attaches the BPF policy (fails saying why, never silently).
    pub fn load(caps: Caps, cfg: AgentConfig) -> Result<Self, EmbeddedError> {
        let agent = Agent::load(cfg)?;
        Ok(Self {
            vm: None,
            region: None,
            sink: Arc::new(KickSink::default()),
            caps,
            agent,
        })
    }

    /// The sink to put in `VmConfig::policy_sink`.
    pub fn sink(&self) -> Arc<dyn PolicySink> {
        self.sink.clone()
    }

    /// The agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The registration, once attached.
    pub fn handle(&self) -> Option<&VmHandle> {
        self.vm.as_deref()
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

    fn register(&mut self, vm: &Vm, region: RegionSpec) -> Result<(), EmbeddedError> {
        if self.vm.is_some() {
            return Err(EmbeddedError::Setup("the VM is already registered".into()));
        }
        let handle = Arc::new(self.agent.register_vm(VmSpec {
            vcpu_tids: Self::tids(vm)?,
            apic_ids: vm.apic_ids().to_vec(),
            caps: self.caps.clone(),
            region,
        })?);
        self.sink.set(Some(Arc::downgrade(&handle)));
        self.vm = Some(handle);
        Ok(())
    }

    /// Device-region mode, between `Vm::start_held` and `Vm::release`
    /// (the `attach` of [`pvsched_vmm::Run::start_with`]): registers the
    /// vCPU threads and makes the agent's map BAR2's backing.
    pub fn attach_device(&mut self, vm: &mut Vm) -> Result<(), EmbeddedError> {
        let nr = vm.config().vcpus;
        let size = usize::try_from(PvschedDevice::region_bar_size(nr)).unwrap_or(usize::MAX);
        self.register(vm, RegionSpec::DeviceMap)?;
        let Some(map) = self.vm.as_ref().and_then(|h| h.region()) else {
            return Err(EmbeddedError::Setup(
                "the agent gave no region for a device-map VM".into(),
            ));
        };
        if size > map.len() {
            return Err(EmbeddedError::Setup(format!(
                "{nr} vCPUs need a {size}-byte BAR2 but the agent's region is {} bytes",
                map.len()
            )));
        }
        // SAFETY: `map` is a live MAP_SHARED, PROT_READ|PROT_WRITE, page
        // aligned mapping of `map.len()` >= `size` bytes. `self.region` keeps
        // it mapped, and `Embedded` is dropped only after the VM (whose
        // memslot and device use this MmapRegion) is shut down: `main` and
        // the tests finish the run first. build_raw does not take ownership
        // (no munmap on drop).
        let backing = unsafe {
            MmapRegion::build_raw(
                map.as_ptr(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
            )
        }
        .map_err(|e| EmbeddedError::Setup(format!("wrapping the agent's region: {e}")))?;
        vm.set_device_region(Arc::new(backing))?;
        self.region = Some(map);
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
        self.register(vm, RegionSpec::GuestAddrs(addrs))
    }

    /// Unregisters the VM now (restores its threads); stats are gone after.
    pub fn detach(&mut self) {
        self.sink.set(None);
        self.vm = None;
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        self.detach();
        self.region = None;
    }
}
