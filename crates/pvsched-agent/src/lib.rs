//! pvsched host agent (docs/architecture.md): loads the CO-RE BPF policy from
//! `bpf-policy/` (compiled by build.rs, embedded) with aya, attaches it to
//! `sched_switch`, `sched_wakeup`, `kvm_vcpu_wakeup`, `kvm_apic_ipi` and
//! `kvm_userspace_exit` (tp_btf), fills its maps when a VM registers, and
//! applies its decisions with `sched_setattr` on registered vCPU threads
//! only, within the VM's caps, always restoring each thread's baseline.
//!
//! - [`agent`]: [`Agent`], [`VmSpec`], [`VmHandle`] (the embedding seam).
//! - [`object`]: the BPF object, maps, region mmap, `BPF_PROG_TEST_RUN`.
//! - [`intf`]: Rust mirror of `bpf-policy/intf.h`.
//! - [`applier`]: decision → thread attributes, baseline capture/restore.
//! - [`ident`]: which thread a registered TID names (checked before every
//!   `sched_setattr`, so a freed and reused TID is never touched).
//! - [`sched`]: `sched_getattr`/`sched_setattr`, [`sched::restore_baselines`]
//!   for a VMM whose agent died.
//! - [`trace`]: the decision trace (JSON lines) and the split-pair check.
//! - [`watch`]: pidfd watcher.
//! - [`guardian`]: the process that restores every boosted thread when the
//!   agent process dies (SIGKILL, OOM).
//! - [`safety`]: restore on SIGINT/SIGTERM and panic.
//!
//! Embedding (what `pvsched run --policy embedded` does with its VMM):
//!
//! ```no_run
//! use pvsched_agent::{Agent, AgentConfig, Caps, RegionSpec, VmSpec};
//! # fn vcpu_tids() -> Vec<u32> { vec![] }
//! let agent = Agent::load(AgentConfig::default())?; // Err says why BPF is unusable
//! let vm = agent.register_vm(VmSpec {
//!     vcpu_tids: vcpu_tids(),           // after the vCPU threads exist
//!     emulator_tids: vec![],            // e.g. QEMU's main-loop thread
//!     apic_ids: vec![0, 1],
//!     caps: Caps::from_toml(&std::fs::read_to_string("caps.toml")?)?,
//!     region: RegionSpec::DeviceMap,    // or GuestAddrs(host address of each slot)
//!     owner: Some(std::process::id()),  // the threads must be this process's
//! })?;
//! let region = vm.region().unwrap();    // BAR2 backing: KVM memslot at the BAR address
//! let (host_addr, size) = (region.as_ptr() as u64, region.len() as u64);
//! # let _ = (host_addr, size);
//! // ... run the VM; vm.stats() for the summary ...
//! drop(vm);    // unregister + restore baselines (before dropping the agent)
//! drop(agent); // stop the consumer, restore anything left
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A VMM whose agent is another process captures its vCPU threads'
//! baselines with [`sched::capture_baselines`] before registering and runs
//! [`sched::restore_baselines`] from a [`watch::PidfdWatcher`] on the agent.

pub mod agent;
pub mod applier;
pub mod guardian;
pub mod ident;
pub mod intf;
pub mod object;
pub mod safety;
pub mod sched;
pub mod trace;
pub mod watch;

pub use agent::{Agent, AgentConfig, AgentError, RegionSpec, VmHandle, VmSpec, VmStats};
pub use object::{PolicyObject, RegionMmap};
pub use pvsched_policy::Caps;
