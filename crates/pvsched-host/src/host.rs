//! Where a VM's host policy runs, behind one interface: the BPF policy
//! agent in the caller's own process ([`PolicyHost::local`]: `pvsched run
//! --policy embedded`, `pvsched-bench`) or pvschedd ([`PolicyHost::daemon`]:
//! `pvsched run --policy daemon`, `pvsched qemu-attach`). Both take the
//! same [`RegisterVm`] and give a [`Registration`] whose drop restores
//! every vCPU thread (unless it was registered detached with pvschedd,
//! which then ends it when the VMM exits).

use pvsched_agent::agent::ThreadStats;
use pvsched_agent::{Agent, AgentConfig, AgentError, RegionSpec, VmHandle, VmSpec, VmStats};
use pvsched_daemon::client::{Client, ClientError, Registered};
use pvsched_daemon::proto::{Region, RegisterVm, ThreadStatus};
use pvsched_util::lock;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Why a policy host could not start or register a VM.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The agent could not load (BPF unusable, not root...) or refused the
    /// VM.
    #[error("{0}")]
    Agent(#[from] AgentError),
    /// pvschedd could not be reached or refused the VM.
    #[error("pvschedd: {0}")]
    Daemon(#[from] ClientError),
    /// The VM asks for something only pvschedd provides.
    #[error("the embedded policy cannot serve {0}; register with pvschedd instead")]
    Unsupported(&'static str),
}

/// Where the policy runs.
pub enum PolicyHost {
    /// The agent, loaded in this process.
    Local(Agent),
    /// pvschedd, at this socket.
    Daemon(PathBuf),
}

impl PolicyHost {
    /// Loads and attaches the BPF policy in this process (fails saying
    /// why, never silently).
    pub fn local(cfg: AgentConfig) -> Result<Self, HostError> {
        Ok(PolicyHost::Local(Agent::load(cfg)?))
    }

    /// pvschedd at `socket`; checks now that it answers.
    pub fn daemon(socket: &Path) -> Result<Self, HostError> {
        Client::connect(socket)?.status()?;
        Ok(PolicyHost::Daemon(socket.into()))
    }

    /// The agent, if it runs in this process.
    pub fn agent(&self) -> Option<&Agent> {
        match self {
            PolicyHost::Local(a) => Some(a),
            PolicyHost::Daemon(_) => None,
        }
    }

    /// Registers `vm`. In this process the VM's owner is `vm.pid` (default:
    /// this process), its caps `vm.caps` (default caps if `None`) and its
    /// name is only a label; a reserved region or a detached registration
    /// exist only with pvschedd.
    pub fn register(&self, vm: RegisterVm) -> Result<Registration, HostError> {
        match self {
            PolicyHost::Local(agent) => {
                let region = match vm.region {
                    Region::None => RegionSpec::None,
                    Region::Device => RegionSpec::DeviceMap,
                    Region::Guest(addrs) => RegionSpec::GuestAddrs(addrs),
                    Region::Reserved => return Err(HostError::Unsupported("a reserved region")),
                };
                if vm.detach {
                    return Err(HostError::Unsupported("a detached registration"));
                }
                let handle = agent.register_vm(VmSpec {
                    owner: Some(vm.pid.unwrap_or_else(std::process::id)),
                    emulator_tids: vm.emulator_tids,
                    vcpu_tids: vm.vcpus.iter().map(|v| v.tid).collect(),
                    apic_ids: vm.vcpus.iter().map(|v| v.apic_id).collect(),
                    caps: vm.caps.unwrap_or_default(),
                    region,
                })?;
                Ok(Registration::Local(handle))
            }
            PolicyHost::Daemon(socket) => {
                let mut client = Client::connect(socket)?;
                let name = vm.name.clone();
                let detach = vm.detach;
                let registered = client.register(vm)?;
                Ok(Registration::Remote(RemoteVm {
                    client: Mutex::new(client),
                    name,
                    detach,
                    registered,
                }))
            }
        }
    }
}

/// A VM registered with pvschedd: the connection (which keeps an attached
/// registration), its name and what the daemon answered.
pub struct RemoteVm {
    client: Mutex<Client>,
    name: String,
    detach: bool,
    registered: Registered,
}

impl Drop for RemoteVm {
    fn drop(&mut self) {
        if self.detach {
            return;
        }
        // Synchronous: the daemon replies once every thread is restored.
        // (Closing the connection would do it too, a moment later.)
        if let Err(e) = lock(&self.client).unregister(&self.name) {
            log::warn!("pvschedd: unregistering VM {}: {e}", self.name);
        }
    }
}

/// A registered VM; dropping it ends the registration (every vCPU thread
/// back at its baseline), except a detached one with pvschedd.
pub enum Registration {
    /// With the agent in this process.
    Local(VmHandle),
    /// With pvschedd.
    Remote(RemoteVm),
}

impl Registration {
    /// The agent's handle, when the policy runs in this process.
    pub fn local(&self) -> Option<&VmHandle> {
        match self {
            Registration::Local(h) => Some(h),
            Registration::Remote(_) => None,
        }
    }

    /// What pvschedd answered (VM id, caps in force and their source).
    pub fn registered(&self) -> Option<&Registered> {
        match self {
            Registration::Local(_) => None,
            Registration::Remote(r) => Some(&r.registered),
        }
    }

    /// Re-evaluates slot `slot` now (the device's KICK doorbell); pvschedd
    /// is not asked (its tick and the guest's scheduler events re-evaluate
    /// the slot).
    pub fn kick(&self, slot: u32) {
        if let Registration::Local(h) = self {
            h.kick(slot);
        }
    }

    /// The region the policy provides for a device-region VM: start and
    /// length of this process's mapping of it.
    pub fn region(&self) -> Option<(*mut u8, usize)> {
        match self {
            Registration::Local(h) => h.region().map(|m| (m.as_ptr(), m.len())),
            Registration::Remote(r) => r.registered.region.as_ref().map(|m| (m.as_ptr(), m.len())),
        }
    }

    /// The VM's policy statistics now (`None` if pvschedd cannot say).
    pub fn stats(&self) -> Option<VmStats> {
        match self {
            Registration::Local(h) => Some(h.stats()),
            Registration::Remote(r) => r.stats(),
        }
    }
}

impl RemoteVm {
    fn stats(&self) -> Option<VmStats> {
        let (_, vms) = lock(&self.client).status().ok()?;
        let vm = vms.into_iter().find(|v| v.name == self.name)?;
        let conv = |t: &ThreadStatus| ThreadStats {
            tid: t.tid,
            counters: t.counters,
            boost_prio: t.boost_prio,
            throttled: t.throttled as u32,
            wait_on_off: t.wait_on_off,
            ..Default::default()
        };
        Some(VmStats {
            vcpus: vm.vcpus.iter().map(conv).collect(),
            emulators: vm.emulators.iter().map(conv).collect(),
            decisions: vm.decisions,
            corrections: vm.corrections,
            apply_samples: vm.apply_samples as usize,
            apply_p50_ns: vm.apply_p50_ns,
            apply_p99_ns: vm.apply_p99_ns,
            cosched_now_us: vm.cosched_now_us,
            cosched_sync_rate: vm.cosched_sync.map(|r| r as f64),
            ..Default::default()
        })
    }
}
