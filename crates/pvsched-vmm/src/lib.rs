//! pvsched reference VMM: a small crosvm-style VMM on KVM that hosts the
//! pvsched PCI device and a test guest.
//!
//! * [`memory`]: guest RAM and device memory as memfd-backed `vm-memory` regions;
//! * [`vm`]: the VM (in-kernel irqchip, x2APIC CPUID, vCPU threads named
//!   `vcpu N` whose TIDs [`Vm::vcpu_tids`] exposes, clean shutdown);
//! * [`pci_root`] and [`host_bridge`]: PCI bus 0 with configuration
//!   mechanism #1, BAR decoding and MMIO dispatch to a
//!   [`pvsched_device::PciDevice`];
//! * [`memslot`]: BAR2 (device region) as a KVM memslot that follows the BAR;
//! * [`remote`] and [`device_process`]: the device in its own sandboxed
//!   process, reached over vfio-user ([`DeviceMode::Sandboxed`]), and what
//!   happens when that process dies;
//! * [`guest`]: the test guest, assembled from source with `iced-x86`;
//! * [`monitor`], [`runner`], [`stats`]: what `pvsched run` measures and prints;
//! * [`snapshot`]: the whole VM saved to a directory and restored in another process.
//!
//! Seams for other components: the BAR2 backing comes from the embedder
//! ([`VmConfig::device_region`], e.g. the agent's mmapable BPF array map),
//! the device reports to an optional [`pvsched_device::PolicySink`]
//! ([`VmConfig::policy_sink`]), and [`Vm::vcpu_tids`] / [`Vm::apic_ids`]
//! tell the agent which threads run which slot.

pub mod device_process;
pub mod guest;
pub mod host_bridge;
pub mod io;
pub mod kick;
pub mod memory;
pub mod memslot;
pub mod monitor;
pub mod pci_root;
pub mod remote;
pub mod runner;
pub mod snapshot;
pub mod stats;
pub mod vcpu;
pub mod vm;

pub use device_process::DeviceProgram;
pub use guest::Workload;
pub use remote::DeviceLoss;
pub use runner::{Progress, Run, RunConfig, RunReport, VcpuReport, run};
pub use snapshot::Snapshot;
pub use vcpu::VcpuEnd;
pub use vm::{DeviceMode, Error, Injector, ShutdownReport, Vm, VmConfig, open_kvm};
