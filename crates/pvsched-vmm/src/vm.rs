//! One VM: KVM VM with in-kernel irqchip, memfd guest RAM, the PCI bus with
//! the pvsched device, the test guest, and N vCPU threads.
//!
//! The device runs in this process ([`DeviceMode::InProcess`], the
//! default of [`VmConfig::new`]) or in its own sandboxed process reached
//! over vfio-user ([`DeviceMode::Sandboxed`], see [`crate::remote`]); the
//! VM behaves the same either way.
//!
//! ```no_run
//! use pvsched_vmm::{Vm, VmConfig, Workload};
//! let mut vm = Vm::new(VmConfig::new(2, Workload::Idle)).unwrap();
//! vm.start().unwrap();
//! println!("vCPU TIDs: {:?}", vm.vcpu_tids());
//! let report = vm.shutdown();
//! assert!(report.clean());
//! ```

use crate::device_process::{self, DeviceProcess, DeviceProgram};
use crate::guest::layout::{self, MMIO_HOLE_BASE, MMIO_HOLE_END, PARAM_STOP, PARAMS_ADDR};
use crate::guest::{self, GuestParams, Workload};
use crate::host_bridge::HostBridge;
use crate::io::IoHub;
use crate::kick;
use crate::memory;
use crate::memslot::BarMemslot;
use crate::monitor::GuestMonitor;
use crate::pci_root::{PciRoot, SharedDevice};
use crate::remote::{self, DeviceLoss, HostView, Link, OnLoss, RemoteDevice};
use crate::snapshot::{self, Snapshot, VmState};
use crate::vcpu::{self, VcpuEnd};
use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, kvm_msi, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use pvsched_abi as abi;
use pvsched_device::{
    BarIndex, DeviceConfig, NullSink, PolicySink, PvschedDevice, RegionMode, RegionView,
};
use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::thread::JoinHandle;
use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, MmapRegion, VolatileMemory,
};

/// PCI device number of the host bridge.
pub const HOST_BRIDGE_DEVICE: u8 = 0;
/// PCI device number of pvsched (`00:01.0`).
pub const PVSCHED_DEVICE: u8 = 1;
/// KVM memslot of guest RAM.
const RAM_SLOT: u32 = 0;
/// KVM memslot of BAR2 (device region).
const BAR2_SLOT: u32 = 1;
/// Identity-map/TSS pages KVM needs on Intel hosts, below the IOAPIC.
const TSS_ADDRESS: usize = 0xfffb_d000;
/// x2APIC/xAPIC MSI address base.
const MSI_ADDRESS: u32 = 0xfee0_0000;

/// Errors building or running a VM.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// /dev/kvm does not exist.
    #[error(
        "/dev/kvm does not exist: load the kvm module (modprobe kvm_intel or kvm_amd) or run on a host with virtualization enabled"
    )]
    KvmMissing,
    /// /dev/kvm is not accessible.
    #[error(
        "permission denied opening /dev/kvm: add your user to the 'kvm' group (usermod -aG kvm $USER) or run as root"
    )]
    KvmPermission,
    /// Another KVM error.
    #[error("{what} failed: {source}")]
    Kvm {
        /// The operation.
        what: &'static str,
        /// KVM error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The configuration is invalid.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] memory::Error),
    /// The test guest.
    #[error(transparent)]
    Guest(#[from] guest::Error),
    /// The device model.
    #[error("pvsched device: {0}")]
    Device(#[from] pvsched_device::Error),
    /// vCPU setup.
    #[error(transparent)]
    Vcpu(#[from] vcpu::Error),
    /// The kick signal.
    #[error(transparent)]
    Kick(#[from] kick::Error),
    /// Spawning a thread.
    #[error("spawning a vCPU thread failed: {0}")]
    Spawn(#[source] std::io::Error),
    /// Memslot.
    #[error(transparent)]
    Memslot(#[from] crate::memslot::Error),
    /// Taking or restoring a snapshot.
    #[error(transparent)]
    Snapshot(#[from] snapshot::Error),
    /// Writing guest memory from the host.
    #[error("writing guest memory at {0:#x} failed")]
    GuestWrite(u64),
    /// Starting the device process.
    #[error("sandboxed device: {0}")]
    DeviceProcess(#[from] device_process::Error),
    /// Connecting to the device process.
    #[error("sandboxed device: {0}")]
    Remote(#[from] remote::Error),
    /// The event socket to the device process could not be created.
    #[error("creating the device process's event socket failed: {0}; check the fd limit")]
    EventSocket(#[source] std::io::Error),
    /// Injecting an interrupt.
    #[error("injecting vector {vector:#x} into vCPU {vcpu} failed: {source}")]
    Inject {
        /// vCPU index.
        vcpu: u32,
        /// Vector.
        vector: u8,
        /// KVM error.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, Error>;

/// Where the pvsched device runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceMode {
    /// In the VMM's process, behind `Arc<Mutex<PvschedDevice>>`.
    InProcess,
    /// In its own (sandboxed) process started from this program, reached
    /// over vfio-user; see [`crate::remote`].
    Sandboxed(DeviceProgram),
}

impl DeviceMode {
    /// `"in-process"` or `"sandboxed"`.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceMode::InProcess => "in-process",
            DeviceMode::Sandboxed(_) => "sandboxed",
        }
    }
}

/// How to build a VM.
#[derive(Clone)]
pub struct VmConfig {
    /// Number of vCPUs (1..=64).
    pub vcpus: u32,
    /// Guest RAM bytes (multiple of 4096).
    pub ram_size: u64,
    /// Which region mode the guest negotiates.
    pub region: RegionMode,
    /// What the test guest does.
    pub workload: Workload,
    /// Slot updates in the guest's start-up burst.
    pub slot_burst: u32,
    /// Seed for the hostile workload.
    pub seed: u32,
    /// rt_prio the greedy workload's vCPUs ask for (FIFO, for good).
    pub greedy_rt_prio: u32,
    /// Ask vCPU 0 to move BAR2 to this address before the handshake.
    pub bar2_move: Option<u32>,
    /// BAR2 backing from the embedder (e.g. an mmapped BPF array map);
    /// `None`: a memfd of `PvschedDevice::region_bar_size(vcpus)` bytes.
    pub device_region: Option<Arc<MmapRegion>>,
    /// Where the device reports attach/detach/kick; `None`: [`NullSink`].
    pub policy_sink: Option<Arc<dyn PolicySink>>,
    /// Features the device offers (default: all of ABI v1).
    pub device_features: u64,
    /// Where the device runs (default: in process).
    pub device_mode: DeviceMode,
    /// Called once, from the device watcher thread, if a sandboxed device
    /// process dies while the VM runs (after the guest-visible device went
    /// DEVICE_NEEDS_RESET and the sink heard `region_detached`): the place
    /// for a host policy to drop this VM's boosts.
    pub on_device_lost: Option<OnLoss>,
}

impl VmConfig {
    /// Defaults: device region, 2 MiB RAM, 16 slot updates in the burst.
    pub fn new(vcpus: u32, workload: Workload) -> Self {
        Self {
            vcpus,
            ram_size: layout::DEFAULT_RAM_SIZE,
            region: RegionMode::Device,
            workload,
            slot_burst: 16,
            seed: 0x5eed_1234,
            greedy_rt_prio: 1,
            bar2_move: None,
            device_region: None,
            policy_sink: None,
            device_features: abi::F_ALL,
            device_mode: DeviceMode::InProcess,
            on_device_lost: None,
        }
    }
}

/// What [`Vm::shutdown`] found.
#[derive(Clone, Debug)]
pub struct ShutdownReport {
    /// Why each vCPU thread ended, by index.
    pub vcpu_ends: Vec<VcpuEnd>,
}

impl ShutdownReport {
    /// Whether every vCPU was stopped by the VMM (no crash).
    pub fn clean(&self) -> bool {
        self.vcpu_ends.iter().all(|e| *e == VcpuEnd::Stopped)
    }
}

struct VcpuThread {
    handle: JoinHandle<(VcpuEnd, VcpuFd)>,
}

/// A running (or ready to run) VM.
pub struct Vm {
    cfg: VmConfig,
    kvm: Kvm,
    vm: Arc<VmFd>,
    ram: GuestMemoryMmap,
    device: Option<Arc<Mutex<PvschedDevice>>>,
    host_view: Option<Arc<Mutex<HostView>>>,
    remote: Option<Arc<Mutex<RemoteDevice>>>,
    link: Option<Arc<Link>>,
    pci: Arc<PciRoot>,
    bar2: Option<Arc<BarMemslot>>,
    monitor: Arc<GuestMonitor>,
    apic_ids: Vec<u32>,
    pending: Vec<VcpuFd>,
    threads: Vec<VcpuThread>,
    /// The vCPUs of joined threads, by index: what a snapshot reads.
    stopped: Vec<VcpuFd>,
    /// Why each joined vCPU thread ended, by index.
    ends: Vec<VcpuEnd>,
    /// A restored VM's device state and BAR2 bytes, until
    /// [`Vm::restore_device`] loads them.
    restoring: Option<(pvsched_device::DeviceSnapshot, Option<Vec<u8>>)>,
    tids: Arc<Mutex<Vec<i32>>>,
    running: Arc<AtomicBool>,
    gate: Arc<Gate>,
}

/// Holds spawned vCPU threads before their first KVM_RUN until opened.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    fn wait(&self) {
        let mut open = lock(&self.open);
        while !*open {
            open = self.cv.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn open(&self) {
        *lock(&self.open) = true;
        self.cv.notify_all();
    }

    fn is_open(&self) -> bool {
        *lock(&self.open)
    }
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { what, source }
}

/// Open /dev/kvm, turning the errors a user can fix into clear ones.
pub fn open_kvm() -> Result<Kvm> {
    check_device("/dev/kvm")?;
    Kvm::new().map_err(kvm_err("opening /dev/kvm"))
}

/// Whether the KVM device at `path` can be opened read-write.
fn check_device(path: &str) -> Result<()> {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::KvmMissing),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(Error::KvmPermission),
        _ => Ok(()),
    }
}

impl Vm {
    /// Build the VM: memory, irqchip, PCI bus, device, test guest, vCPUs.
    pub fn new(cfg: VmConfig) -> Result<Self> {
        let (mut vm, bars) = Self::build(cfg)?;
        assign_bars(&vm.pci, bars)?;
        let pci_id = vm.pci.config_read(PVSCHED_DEVICE, 0);
        let program = guest::program::build().map_err(guest::Error::from)?;
        let cfg = &vm.cfg;
        guest::load(
            &vm.ram,
            &program,
            &GuestParams {
                workload: cfg.workload,
                apic_ids: vm.apic_ids.clone(),
                guest_region: cfg.region == RegionMode::Guest,
                pci_id,
                slot_burst: cfg.slot_burst,
                seed: cfg.seed,
                greedy_rt_prio: cfg.greedy_rt_prio,
                bar2_move: cfg.bar2_move,
                guest_region_gpa: layout::GUEST_REGION_GPA as u32,
            },
        )?;
        vm.pending = create_vcpus(&vm.kvm, &vm.vm, &vm.apic_ids, None)?;
        Ok(vm)
    }

    /// The VM of snapshot `snap`, in this process: RAM, vCPUs, interrupt
    /// controllers and clock as they were; the device's state and BAR2's
    /// bytes are loaded by [`Vm::restore_device`], after
    /// [`Vm::start_held`] and the policy's attach (which may replace
    /// BAR2's backing). `cfg` gives what a snapshot does not hold (where
    /// the device runs, the policy's sink); [`VmState::config`] the rest.
    pub fn restore(cfg: VmConfig, snap: Snapshot) -> Result<Self> {
        let Snapshot { state, ram, region } = snap;
        if cfg.vcpus != state.vcpus
            || cfg.ram_size != state.ram_size
            || cfg.region != state.region
            || cfg.workload != state.workload
            || cfg.device_features != state.device_features
        {
            return Err(Error::Config(
                "the configuration differs from the snapshot's (build it with VmState::config)"
                    .into(),
            ));
        }
        if !matches!(cfg.device_mode, DeviceMode::InProcess) {
            return Err(snapshot::Error::Sandboxed.into());
        }
        let (mut vm, _) = Self::build(cfg)?;
        if state.apic_ids != vm.apic_ids {
            return Err(snapshot::Error::Invalid(format!(
                "APIC IDs {:?}, this VM's are {:?}",
                state.apic_ids, vm.apic_ids
            ))
            .into());
        }
        vm.ram
            .write_slice(&ram, GuestAddress(0))
            .map_err(|_| Error::GuestWrite(0))?;
        vm.pending = create_vcpus(&vm.kvm, &vm.vm, &vm.apic_ids, Some(&state.vcpu))?;
        snapshot::load_irqchips(&vm.vm, &state.irqchips)?;
        snapshot::load_clock(&vm.vm, &state.clock)?;
        for (v, boot) in state.boot.iter().enumerate() {
            vm.monitor.restore_boot(v as u32, boot);
        }
        vm.restoring = Some((state.device, region));
        Ok(vm)
    }

    /// Loads a restored VM's device state and BAR2's bytes (into BAR2's
    /// backing as it is now), and registers BAR2's memslot where the
    /// restored BAR decodes. Between [`Vm::start_held`] and
    /// [`Vm::release`]; nothing to do for a VM that was not restored.
    pub fn restore_device(&mut self) -> Result<()> {
        let Some((state, region)) = self.restoring.take() else {
            return Ok(());
        };
        let Some(device) = &self.device else {
            return Err(snapshot::Error::Sandboxed.into());
        };
        match (&self.bar2, region) {
            (Some(bar2), Some(bytes)) => {
                let backing = bar2.backing();
                if bytes.len() != backing.size() {
                    return Err(snapshot::Error::Invalid(format!(
                        "BAR2 holds {} bytes, this VM's {}",
                        bytes.len(),
                        backing.size()
                    ))
                    .into());
                }
                backing
                    .get_slice(0, bytes.len())
                    .map_err(|e| Error::Config(format!("BAR2's backing: {e}")))?
                    .copy_from(&bytes);
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(
                    snapshot::Error::Invalid("holds no BAR2 for a device region".into()).into(),
                );
            }
            (None, Some(_)) => {
                return Err(snapshot::Error::Invalid(
                    "holds a BAR2 the device does not offer".into(),
                )
                .into());
            }
        }
        lock(device).restore(state)?;
        self.pci.sync_memslots(PVSCHED_DEVICE)?;
        Ok(())
    }

    /// Everything but the guest and the vCPUs: KVM's VM with its irqchip,
    /// RAM, the device and the PCI bus; the device's BARs to place.
    fn build(cfg: VmConfig) -> Result<(Self, Vec<pvsched_device::BarInfo>)> {
        check_config(&cfg)?;
        kick::install()?;
        let kvm = open_kvm()?;
        let vm = Arc::new(kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?);
        vm.set_tss_address(TSS_ADDRESS)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
        vm.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        let ram = map_ram(&vm, cfg.ram_size)?;

        let apic_ids: Vec<u32> = (0..cfg.vcpus).collect();
        let mut dcfg = DeviceConfig::new(cfg.vcpus);
        dcfg.apic_ids = apic_ids.clone();
        dcfg.features = cfg.device_features;
        let monitor = Arc::new(GuestMonitor::new(cfg.vcpus));
        let parts = device_parts(&cfg, dcfg, &ram, &monitor)?;
        let bar2 = parts
            .bar2_backing
            .map(|b| Arc::new(BarMemslot::new(vm.clone(), BAR2_SLOT, b)));

        let mut pci = PciRoot::new();
        pci.add(
            HOST_BRIDGE_DEVICE,
            Arc::new(Mutex::new(HostBridge)) as SharedDevice,
            Vec::new(),
        );
        let slots = bar2
            .iter()
            .map(|s| (BarIndex(abi::REGION_BAR), s.clone()))
            .collect();
        let bars = lock(&parts.shared).bars();
        pci.add(PVSCHED_DEVICE, parts.shared, slots);
        let pci = Arc::new(pci);
        let vm = Self {
            monitor,
            cfg,
            kvm,
            vm,
            ram,
            device: parts.device,
            host_view: parts.host_view,
            remote: parts.remote,
            link: parts.link,
            pci,
            bar2,
            apic_ids,
            pending: Vec::new(),
            threads: Vec::new(),
            stopped: Vec::new(),
            ends: Vec::new(),
            restoring: None,
            tids: Arc::new(Mutex::new(Vec::new())),
            running: Arc::new(AtomicBool::new(true)),
            gate: Arc::new(Gate::default()),
        };
        Ok((vm, bars))
    }
}

/// The VM's vCPU count and RAM size are in range.
fn check_config(cfg: &VmConfig) -> Result<()> {
    if cfg.vcpus == 0 || cfg.vcpus > layout::MAX_GUEST_VCPUS {
        return Err(Error::Config(format!(
            "vcpus must be 1..={}, got {}",
            layout::MAX_GUEST_VCPUS,
            cfg.vcpus
        )));
    }
    if cfg.ram_size < layout::min_ram_size(cfg.vcpus) || cfg.ram_size > MMIO_HOLE_BASE {
        return Err(Error::Config(format!(
            "ram_size {:#x} must be between {:#x} and {:#x}",
            cfg.ram_size,
            layout::min_ram_size(cfg.vcpus),
            MMIO_HOLE_BASE
        )));
    }
    Ok(())
}

/// Guest RAM, registered with KVM as slot RAM_SLOT at GPA 0.
fn map_ram(vm: &VmFd, ram_size: u64) -> Result<GuestMemoryMmap> {
    let ram = memory::guest_ram(ram_size)?;
    for region in ram.iter() {
        let mr = kvm_userspace_memory_region {
            slot: RAM_SLOT,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: ram_size,
            userspace_addr: region.as_ptr() as u64,
        };
        // SAFETY: the range is `ram`'s own mapping, which the Vm owns.
        // Every vCPU thread is joined (Drop) before `ram` is unmapped, so
        // no guest code runs on the slot afterwards; KVM itself only
        // reports EFAULT for a slot whose memory is gone.
        unsafe { vm.set_user_memory_region(mr) }
            .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION (RAM)"))?;
    }
    Ok(ram)
}

/// The device and what the VM keeps of it.
struct DeviceParts {
    /// The device model, in process only (a sandboxed device's state is
    /// its process's alone).
    device: Option<Arc<Mutex<PvschedDevice>>>,
    /// What the VMM knows of a sandboxed device from its events.
    host_view: Option<Arc<Mutex<HostView>>>,
    /// What the PCI bus dispatches to.
    shared: SharedDevice,
    /// BAR2's memory, if the device offers a device region.
    bar2_backing: Option<Arc<MmapRegion>>,
    /// The sandboxed device process.
    remote: Option<Arc<Mutex<RemoteDevice>>>,
    /// Its link.
    link: Option<Arc<Link>>,
}

/// The device, in process or as a sandboxed device process
/// (`cfg.device_mode`).
fn device_parts(
    cfg: &VmConfig,
    dcfg: DeviceConfig,
    ram: &GuestMemoryMmap,
    monitor: &Arc<GuestMonitor>,
) -> Result<DeviceParts> {
    let sink = cfg
        .policy_sink
        .clone()
        .unwrap_or_else(|| Arc::new(NullSink));
    match &cfg.device_mode {
        DeviceMode::InProcess => {
            let mut dev = PvschedDevice::new(dcfg, sink)?;
            dev.set_guest_memory(ram.clone());
            let mut bar2_backing = None;
            if cfg.device_features & abi::F_DEVICE_REGION != 0 {
                let b = match &cfg.device_region {
                    Some(r) => r.clone(),
                    None => memory::memfd_region(
                        c"pvsched-region",
                        PvschedDevice::region_bar_size(cfg.vcpus),
                    )?,
                };
                dev.set_device_region(b.clone())?;
                bar2_backing = Some(b);
            }
            let device = Arc::new(Mutex::new(dev));
            Ok(DeviceParts {
                shared: device.clone(),
                device: Some(device),
                host_view: None,
                bar2_backing,
                remote: None,
                link: None,
            })
        }
        DeviceMode::Sandboxed(program) => {
            if cfg.device_region.is_some() {
                return Err(Error::Config(
                    "a sandboxed device owns BAR2's memory; device_region needs DeviceMode::InProcess (register the slot addresses of Vm::bar2_backing with the policy instead)".into(),
                ));
            }
            let args = device_args(&dcfg, sink.host_flags());
            let host = Arc::new(Mutex::new(HostView::new(&dcfg, sink, ram.clone())));
            let r = spawn_remote(program, args, &dcfg, &host, monitor, cfg, ram)?;
            let bar2_backing = r.bar2();
            let link = r.shared_link().clone();
            monitor.set_device_messages(link.message_counter());
            let remote = Arc::new(Mutex::new(r));
            Ok(DeviceParts {
                device: None,
                host_view: Some(host),
                shared: remote.clone(),
                bar2_backing,
                remote: Some(remote),
                link: Some(link),
            })
        }
    }
}

/// One vCPU per APIC ID, set up with KVM's supported CPUID, at the test
/// guest's entry or, restoring, in the state `restore` gives it.
fn create_vcpus(
    kvm: &Kvm,
    vm: &VmFd,
    apic_ids: &[u32],
    restore: Option<&[snapshot::VcpuState]>,
) -> Result<Vec<VcpuFd>> {
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    let mut pending = Vec::new();
    for (i, id) in apic_ids.iter().enumerate() {
        let v = vm
            .create_vcpu(i as u64)
            .map_err(kvm_err("KVM_CREATE_VCPU"))?;
        match restore.and_then(|r| r.get(i)) {
            Some(state) => {
                vcpu::set_cpuid(&v, i as u32, *id, &supported)?;
                snapshot::load_vcpu(&v, i, state)?;
            }
            None => vcpu::setup(&v, i as u32, *id, &supported)?,
        }
        pending.push(v);
    }
    Ok(pending)
}

impl Vm {
    /// Start one thread per vCPU, named `vcpu N`. Returns once every thread
    /// has recorded its TID.
    pub fn start(&mut self) -> Result<()> {
        self.start_held()?;
        self.release();
        Ok(())
    }

    /// Like [`Vm::start`], but the vCPU threads wait before their first
    /// KVM_RUN until [`Vm::release`]: their TIDs ([`Vm::vcpu_tids`]) exist,
    /// the guest has not run. An embedder registers the threads with a host
    /// policy here and may still replace the device region
    /// ([`Vm::set_device_region`]).
    pub fn start_held(&mut self) -> Result<()> {
        let n = self.pending.len();
        let barrier = Arc::new(Barrier::new(n + 1));
        let io = Arc::new(IoHub {
            pci: self.pci.clone(),
            monitor: self.monitor.clone(),
        });
        *lock(&self.tids) = vec![0; n];
        for (i, v) in self.pending.drain(..).enumerate() {
            let io = io.clone();
            let running = self.running.clone();
            let tids = self.tids.clone();
            let barrier = barrier.clone();
            let gate = self.gate.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vcpu {i}"))
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    lock(&tids)[i] = tid;
                    barrier.wait();
                    gate.wait();
                    vcpu::run_loop(v, i as u32, io, running)
                })
                .map_err(Error::Spawn)?;
            self.threads.push(VcpuThread { handle });
        }
        barrier.wait();
        Ok(())
    }

    /// Lets vCPU threads held by [`Vm::start_held`] run the guest.
    pub fn release(&self) {
        self.gate.open();
    }

    /// Replaces BAR2's backing (device-region mode), e.g. with the policy
    /// agent's mmapable BPF array map once it knows the vCPU TIDs. Only
    /// before the guest runs (before [`Vm::start`], or between
    /// [`Vm::start_held`] and [`Vm::release`]); the mapping must be
    /// `PvschedDevice::region_bar_size(vcpus)` bytes and outlive the VM.
    pub fn set_device_region(&mut self, backing: Arc<MmapRegion>) -> Result<()> {
        if self.gate.is_open() {
            return Err(Error::Config(
                "the device region can only be replaced before the guest runs".into(),
            ));
        }
        if self.remote.is_some() {
            return Err(Error::Config(
                "a sandboxed device owns BAR2's memory; its backing cannot be replaced (register the slot addresses of Vm::bar2_backing with the policy instead)".into(),
            ));
        }
        let Some(bar2) = &self.bar2 else {
            return Err(Error::Config(
                "device-region mode is not offered (F_DEVICE_REGION off)".into(),
            ));
        };
        let Some(device) = &self.device else {
            return Err(Error::Config("no device in this process".into()));
        };
        lock(device).set_device_region(backing.clone())?;
        bar2.set_backing(backing.clone())?;
        self.cfg.device_region = Some(backing);
        Ok(())
    }

    /// Host thread IDs of the vCPU threads, by vCPU index (empty before start).
    pub fn vcpu_tids(&self) -> Vec<i32> {
        lock(&self.tids).clone()
    }

    /// x2APIC ID of each vCPU, by index (slot i of the region maps to `apic_ids()[i]`).
    pub fn apic_ids(&self) -> &[u32] {
        &self.apic_ids
    }

    /// The configuration the VM was built with.
    pub fn config(&self) -> &VmConfig {
        &self.cfg
    }

    /// The pvsched device model, if it runs in this process
    /// ([`DeviceMode::InProcess`]). A sandboxed device's state belongs to
    /// its process alone: use [`Vm::region_view`] and [`Vm::device_status`].
    pub fn device(&self) -> Option<&Arc<Mutex<PvschedDevice>>> {
        self.device.as_ref()
    }

    /// A view of the attached region, if the guest reached DRIVER_OK. Its
    /// host addresses are in this process (guest RAM or BAR2's mapping) in
    /// both device modes (sandboxed: built from the device's attach event
    /// and checked against this process's memory; see [`crate::remote`]).
    pub fn region_view(&self) -> Option<RegionView> {
        match (&self.device, &self.host_view) {
            (Some(d), _) => lock(d).region_view(),
            (None, Some(h)) => lock(h).region_view(),
            (None, None) => None,
        }
    }

    /// STATUS and ERROR of the device (sandboxed: read from the device
    /// process while it lives, DEVICE_NEEDS_RESET/DEVICE_FAILED after).
    pub fn device_status(&self) -> (u32, u32) {
        if let Some(r) = &self.remote {
            return lock(r).status();
        }
        match &self.device {
            Some(d) => {
                let d = lock(d);
                (d.status(), d.error())
            }
            None => (0, 0),
        }
    }

    /// PID of the device process (sandboxed mode).
    pub fn device_pid(&self) -> Option<u32> {
        self.link.as_ref().map(|l| l.pid())
    }

    /// Requests the VMM sent on the vfio-user socket so far (sandboxed mode).
    pub fn device_messages(&self) -> Option<u64> {
        self.link.as_ref().map(|l| l.messages())
    }

    /// How the device process was lost, if it died while the VM ran.
    pub fn device_lost(&self) -> Option<DeviceLoss> {
        self.link.as_ref().and_then(|l| l.loss())
    }

    /// PCI bus 0 (host-side configuration accesses, for tests and tools).
    pub fn pci(&self) -> &Arc<PciRoot> {
        &self.pci
    }

    /// Guest address where BAR2's memslot is registered, if any.
    pub fn bar2_memslot(&self) -> Option<u64> {
        self.bar2.as_ref().and_then(|s| s.mapped_at())
    }

    /// BAR2's backing mapping (device-region mode).
    pub fn bar2_backing(&self) -> Option<Arc<MmapRegion>> {
        self.bar2.as_ref().map(|s| s.backing())
    }

    /// Guest RAM.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.ram
    }

    /// Events, exits and samples seen so far.
    pub fn monitor(&self) -> &Arc<GuestMonitor> {
        &self.monitor
    }

    /// Inject fixed interrupt `vector` into vCPU `index` with KVM_SIGNAL_MSI.
    pub fn inject(&self, index: u32, vector: u8) -> Result<()> {
        self.injector().inject(index, vector)
    }

    /// A handle other threads can inject interrupts with.
    pub fn injector(&self) -> Injector {
        Injector {
            vm: self.vm.clone(),
            apic_ids: self.apic_ids.clone().into(),
        }
    }

    /// Ask the guest to stop its workload (sets the stop flag it polls).
    pub fn request_stop(&self) -> Result<()> {
        let addr = PARAMS_ADDR + PARAM_STOP;
        self.ram
            .write_obj(1u32, GuestAddress(addr))
            .map_err(|_| Error::GuestWrite(addr))
    }

    /// `greedy`: loop iterations vCPU `index` counted so far (0 for other
    /// workloads or an index out of range). Exact once the vCPU reported done.
    pub fn greedy_loops(&self, index: u32) -> u64 {
        if index >= layout::MAX_GUEST_VCPUS {
            return 0;
        }
        let addr = PARAMS_ADDR + layout::PARAM_GREEDY_LOOPS + 8 * u64::from(index);
        self.ram.read_obj::<u64>(GuestAddress(addr)).unwrap_or(0)
    }

    /// Kick every vCPU out of KVM_RUN and join every thread.
    pub fn shutdown(mut self) -> ShutdownReport {
        self.stop_threads()
    }

    fn stop_threads(&mut self) -> ShutdownReport {
        let report = self.join_vcpus();
        // No vCPU can reach the device any more: stop its process.
        if let Some(r) = &self.remote {
            lock(r).shutdown();
        }
        report
    }

    fn join_vcpus(&mut self) -> ShutdownReport {
        self.running.store(false, Ordering::Release);
        // Held threads must reach run_loop to see `running` and end.
        self.gate.open();
        for t in self.threads.drain(..) {
            let pthread = t.handle.as_pthread_t();
            while !t.handle.is_finished() {
                if let Err(e) = kick::kick(pthread) {
                    log::debug!("kick: {e}");
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            match t.handle.join() {
                Ok((end, fd)) => {
                    self.ends.push(end);
                    self.stopped.push(fd);
                }
                Err(_) => {
                    self.ends
                        .push(VcpuEnd::RunError("vCPU thread panicked".into()));
                }
            }
        }
        ShutdownReport {
            vcpu_ends: self.ends.clone(),
        }
    }

    /// Stops the vCPUs and takes the VM's snapshot: the VM does not run
    /// again in this process (restore it with [`Vm::restore`], here or in
    /// another process). Needs the in-process device, and a VM whose
    /// vCPUs all ran until now.
    pub fn snapshot(&mut self) -> Result<Snapshot> {
        let Some(device) = self.device.clone() else {
            return Err(snapshot::Error::Sandboxed.into());
        };
        if self.threads.is_empty() {
            return Err(snapshot::Error::NotRunning("its vCPUs are not running".into()).into());
        }
        let report = self.join_vcpus();
        if !report.clean() || self.stopped.len() != self.apic_ids.len() {
            return Err(snapshot::Error::NotRunning(format!(
                "a vCPU ended by itself: {:?}",
                report.vcpu_ends
            ))
            .into());
        }
        let msrs = snapshot::msr_list(&self.kvm)?;
        let vcpu = self
            .stopped
            .iter()
            .enumerate()
            .map(|(i, v)| snapshot::save_vcpu(v, i, &msrs))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let irqchips = snapshot::save_irqchips(&self.vm)?;
        let clock = snapshot::save_clock(&self.vm)?;
        let mut ram = vec![0u8; usize::try_from(self.cfg.ram_size).unwrap_or(usize::MAX)];
        self.ram
            .read_slice(&mut ram, GuestAddress(0))
            .map_err(|e| Error::Config(format!("reading guest RAM: {e}")))?;
        let region = match &self.bar2 {
            Some(bar2) => {
                let backing = bar2.backing();
                let mut bytes = vec![0u8; backing.size()];
                backing
                    .get_slice(0, bytes.len())
                    .map_err(|e| Error::Config(format!("BAR2's backing: {e}")))?
                    .copy_to(&mut bytes[..]);
                Some(bytes)
            }
            None => None,
        };
        let n = self.cfg.vcpus;
        let state = VmState {
            format: snapshot::FORMAT,
            vcpus: n,
            ram_size: self.cfg.ram_size,
            region: self.cfg.region,
            workload: self.cfg.workload,
            device_features: self.cfg.device_features,
            slot_burst: self.cfg.slot_burst,
            seed: self.cfg.seed,
            greedy_rt_prio: self.cfg.greedy_rt_prio,
            apic_ids: self.apic_ids.clone(),
            clock,
            irqchips,
            vcpu,
            device: lock(&device).snapshot(),
            boot: (0..n).map(|v| self.monitor.boot(v)).collect(),
            events: self.monitor.total_events(),
        };
        Ok(Snapshot { state, ram, region })
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// The device process's arguments after `--socket PATH`.
fn device_args(dcfg: &DeviceConfig, host_flags: u32) -> Vec<OsString> {
    let ids: Vec<String> = dcfg.apic_ids.iter().map(u32::to_string).collect();
    let mut args: Vec<OsString> = vec![
        "--vcpus".into(),
        dcfg.nr_vcpus.to_string().into(),
        "--apic-ids".into(),
        ids.join(",").into(),
    ];
    if host_flags != 0 {
        args.push("--host-flags".into());
        args.push(host_flags.to_string().into());
    }
    if dcfg.features != abi::F_ALL {
        args.push("--features".into());
        args.push(dcfg.features.to_string().into());
    }
    args
}

/// Start the device process with an event socket, connect, map BAR2,
/// DMA-map RAM.
fn spawn_remote(
    program: &DeviceProgram,
    mut args: Vec<OsString>,
    dcfg: &DeviceConfig,
    host: &Arc<Mutex<HostView>>,
    monitor: &Arc<GuestMonitor>,
    cfg: &VmConfig,
    ram: &GuestMemoryMmap,
) -> Result<RemoteDevice> {
    // The link needs the PID, the watcher callback needs the link: hand
    // the link over once the child exists.
    let slot: Arc<Mutex<Option<Arc<Link>>>> = Arc::new(Mutex::new(None));
    let (slot2, host2, monitor2) = (slot.clone(), host.clone(), monitor.clone());
    let on_loss = cfg.on_device_lost.clone();
    let on_exit = Box::new(move |exit: device_process::ExitInfo| {
        let link = lock(&slot2).clone();
        if let Some(link) = link {
            let events = move || monitor2.total_events();
            remote::on_exit(&link, &host2, &events, on_loss.as_ref(), exit);
        }
    });
    let (ours, theirs) = pvsched_util::seqpacket_pair().map_err(Error::EventSocket)?;
    args.push("--event-fd".into());
    args.push(theirs.as_raw_fd().to_string().into());
    let process = Arc::new(DeviceProcess::spawn_inheriting(
        program,
        args,
        Some(theirs),
        on_exit,
    )?);
    let link = RemoteDevice::link(process.pid());
    *lock(&slot) = Some(link.clone());
    let client = process.wait_for_socket(device_process::SOCKET_WAIT)?;
    Ok(RemoteDevice::new(
        client,
        dcfg,
        Some(ours),
        process,
        link,
        host.clone(),
        ram,
    )?)
}

/// Injects interrupts into a VM's vCPUs from any thread.
#[derive(Clone)]
pub struct Injector {
    vm: Arc<VmFd>,
    apic_ids: Arc<[u32]>,
}

impl Injector {
    /// Inject fixed interrupt `vector` into vCPU `index` with KVM_SIGNAL_MSI
    /// (physical destination = the vCPU's APIC ID, edge triggered).
    pub fn inject(&self, index: u32, vector: u8) -> Result<()> {
        let apic = self
            .apic_ids
            .get(index as usize)
            .copied()
            .ok_or_else(|| Error::Config(format!("no vCPU {index}")))?;
        let msi = kvm_msi {
            address_lo: MSI_ADDRESS | ((apic & 0xff) << 12),
            address_hi: 0,
            data: u32::from(vector),
            ..Default::default()
        };
        self.vm
            .signal_msi(msi)
            .map(|_| ())
            .map_err(|source| Error::Inject {
                vcpu: index,
                vector,
                source,
            })
    }
}

use pvsched_util::lock;

/// Firmware: place every BAR of pvsched in the 32-bit MMIO hole (naturally
/// aligned) and enable memory decoding.
fn assign_bars(pci: &PciRoot, bars: Vec<pvsched_device::BarInfo>) -> Result<()> {
    let mut next = MMIO_HOLE_BASE;
    for bar in bars {
        let size = bar.size.max(4096);
        let base = next.checked_next_multiple_of(size).unwrap_or(u64::MAX);
        let end = base.saturating_add(size);
        if end > MMIO_HOLE_END {
            return Err(Error::Config(format!(
                "{} does not fit in the MMIO hole",
                bar.index
            )));
        }
        let Some(reg) = bar.index.config_dword() else {
            continue;
        };
        pci.config_write(PVSCHED_DEVICE, reg, 0, &(base as u32).to_le_bytes());
        next = end;
    }
    let command = pci.config_read(PVSCHED_DEVICE, 1) as u16 | 0x2;
    pci.config_write(PVSCHED_DEVICE, 1, 0, &command.to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_args_add_only_non_default_flags() {
        let mut d = DeviceConfig::new(2);
        d.apic_ids = vec![0, 2];
        let a = device_args(&d, 0);
        assert_eq!(a, ["--vcpus", "2", "--apic-ids", "0,2"].map(OsString::from));
        d.features = abi::F_GUEST_REGION;
        let a = device_args(&d, abi::HOST_F_POLICY_ACTIVE);
        let a: Vec<_> = a.iter().map(|s| s.to_str().unwrap()).collect();
        assert_eq!(&a[4..], ["--host-flags", "1", "--features", "2"]);
    }

    #[test]
    fn user_fixable_errors_say_how() {
        let e = check_device("/nonexistent/kvm").unwrap_err();
        assert!(matches!(e, Error::KvmMissing));
        assert!(e.to_string().contains("modprobe"));
        assert!(Error::KvmPermission.to_string().contains("kvm' group"));
    }

    #[test]
    fn bad_configurations_are_refused_before_touching_kvm() {
        for (vcpus, ram) in [
            (0, layout::DEFAULT_RAM_SIZE),
            (65, layout::DEFAULT_RAM_SIZE),
            (2, 0x1000),
        ] {
            let mut cfg = VmConfig::new(vcpus, Workload::Idle);
            cfg.ram_size = ram;
            assert!(matches!(Vm::new(cfg), Err(Error::Config(_))));
        }
    }
}
