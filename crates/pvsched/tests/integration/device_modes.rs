//! Real KVM: the reference VMM with the device in process and in its own
//! sandboxed process (`pvsched device` over vfio-user) passes the same
//! tests. Each test body takes a [`DeviceMode`]; `both_modes!` makes one
//! `#[test]` per mode from it.
//!
//! Sandboxed only: the guest's slot updates cross no socket (the VMM's
//! vfio-user message count stays flat through 10^5 updates), and the VM
//! survives the device process being killed.

use crate::common;

use common::{LIMIT, Recorder, SinkEvent, in_process, sandboxed, wait_for};
use pvsched_abi as abi;
use pvsched_device::{PvschedDevice, RegionMode};
use pvsched_vmm::guest::layout::GUEST_REGION_GPA;
use pvsched_vmm::vm::PVSCHED_DEVICE;
use pvsched_vmm::{DeviceMode, Run, RunConfig, Vm, VmConfig, Workload};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vm_memory::{GuestAddress, GuestMemoryBackend, MmapRegion};

/// One `#[test]` per device mode from a body `fn(DeviceMode, &str)`.
macro_rules! both_modes {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn in_process() {
                super::$body(
                    super::in_process(),
                    concat!(stringify!($name), "::in_process"),
                );
            }
            #[test]
            fn sandboxed() {
                super::$body(
                    super::sandboxed(),
                    concat!(stringify!($name), "::sandboxed"),
                );
            }
        }
    };
}

both_modes!(device_region_handshake, device_region_body);
both_modes!(guest_region_handshake, guest_region_body);
both_modes!(hostile_guest_is_refused, hostile_body);
both_modes!(ipi_pings_arrive, ipi_body);
both_modes!(guest_region_only_device, guest_only_body);

const BURST: u32 = 200;

fn config(mode: DeviceMode, vcpus: u32, workload: Workload) -> VmConfig {
    let mut c = VmConfig::new(vcpus, workload);
    c.device_mode = mode;
    c
}

/// Start `cfg` and wait until every vCPU is in its workload loop.
fn start(cfg: VmConfig) -> Run {
    let run = Run::start(&RunConfig::new(cfg, Duration::from_secs(1))).expect("VM starts");
    wait_for("the guest ready", LIMIT, || {
        run.progress().ready.then_some(())
    });
    run
}

/// BAR0's address (a configuration read: one message when sandboxed).
fn bar0(vm: &Vm) -> u64 {
    u64::from(vm.pci().config_read(PVSCHED_DEVICE, 4) & !0xf)
}

/// Host-side MMIO read of a register, as the guest's would be served.
fn reg(vm: &Vm, bar0: u64, off: u32) -> u32 {
    let mut b = [0u8; 4];
    assert!(vm.pci().mmio_read(bar0 + u64::from(off), &mut b));
    u32::from_le_bytes(b)
}

fn set_reg(vm: &Vm, bar0: u64, off: u32, v: u32) {
    assert!(vm.pci().mmio_write(bar0 + u64::from(off), &v.to_le_bytes()));
}

fn word(map: &MmapRegion, off: usize) -> u32 {
    assert!(off + 4 <= map.size());
    // SAFETY: in bounds of the live mapping (checked above); any bit
    // pattern is a valid u32 and the guest may write concurrently.
    unsafe { std::ptr::read_volatile(map.as_ptr().add(off).cast::<u32>()) }
}

/// Device region: DRIVER_OK, the header the device wrote (with the host
/// flags the sink publishes), each slot's burst read back by the host both
/// through the region view and straight from BAR2's mapping, zero exits,
/// and a host KICK reaching the policy sink.
fn device_region_body(mode: DeviceMode, test: &str) {
    if !common::kvm(test) {
        return;
    }
    let sandboxed = matches!(mode, DeviceMode::Sandboxed(_));
    let sink = Arc::new(Recorder {
        flags: abi::HOST_F_POLICY_ACTIVE,
        ..Recorder::default()
    });
    let mut cfg = config(mode, 2, Workload::Idle);
    cfg.slot_burst = BURST;
    cfg.policy_sink = Some(sink.clone());
    let run = start(cfg);
    let vm = run.vm();
    let view = vm.region_view().expect("region attached");
    let info = view.info().clone();
    assert_eq!(info.mode, RegionMode::Device);
    assert_eq!(
        vm.bar2_memslot(),
        Some(info.guest_addr),
        "BAR2 is a memslot"
    );
    let bar2 = vm.bar2_backing().expect("BAR2 mapped in the VMM");
    assert_eq!(
        info.host_addr,
        bar2.as_ptr() as usize,
        "view is the VMM's mapping"
    );
    assert_eq!(bar2.size() as u64, PvschedDevice::region_bar_size(2));
    let header = view.read_header();
    assert_eq!(header.magic, abi::REGION_MAGIC);
    assert_eq!(header.nr_vcpus, 2);
    assert_eq!(header.generation, 1);
    assert_eq!(header.host_flags, abi::HOST_F_POLICY_ACTIVE);
    for slot in 0..2 {
        let g = view.read_guest_slot(slot).expect("slot readable");
        assert_eq!(g.updates, u64::from(BURST) + 1);
        assert_eq!(g.seq, 2 * (BURST + 1));
        // The burst ends with the slot at "nothing special".
        assert_eq!((g.policy, g.rt_prio), (abi::POLICY_NORMAL, 0));
        let off = abi::slot_offset(2, slot) as usize;
        assert_eq!(word(&bar2, off), 2 * (BURST + 1), "seq in BAR2's mapping");
    }
    assert_eq!(
        sink.events(),
        vec![SinkEvent::Attached(RegionMode::Device, 1, info.guest_addr)]
    );
    let (status, error) = vm.device_status();
    assert_ne!(status & abi::STATUS_DRIVER_OK, 0);
    assert_eq!(error, abi::ERR_NONE);
    // KICK: forwarded to the device, given to the local policy sink.
    let base = bar0(vm);
    let before = vm.device_messages();
    set_reg(vm, base, abi::REG_KICK, 1);
    set_reg(vm, base, abi::REG_KICK, 7); // out of range: ignored
    assert_eq!(sink.events().last(), Some(&SinkEvent::Kick(1)));
    assert_eq!(sink.events().len(), 2);
    if sandboxed {
        assert_eq!(
            vm.device_messages(),
            before.map(|n| n + 2),
            "one message per KICK"
        );
        assert!(vm.device_pid().is_some());
    } else {
        assert_eq!(vm.device_messages(), None);
    }
    let r = run.finish();
    assert!(r.driver_ok(), "{}", r.handshake);
    assert!(r.clean_shutdown);
    for v in &r.per_vcpu {
        assert_eq!(v.burst_updates, Some(BURST));
        assert_eq!(v.burst_mmio_exits, Some(0));
        assert_eq!(v.burst_device_messages, sandboxed.then_some(0));
    }
    assert_eq!(
        r.device_mode,
        if sandboxed { "sandboxed" } else { "in-process" }
    );
    assert!(r.device_lost.is_none());
}

/// Guest region: DRIVER_OK, the region at the GPA the guest chose, the
/// view pointing into this process's RAM mapping, slots readable.
fn guest_region_body(mode: DeviceMode, test: &str) {
    if !common::kvm(test) {
        return;
    }
    let sink = Arc::new(Recorder::default());
    let mut cfg = config(mode, 2, Workload::Idle);
    cfg.region = RegionMode::Guest;
    cfg.slot_burst = BURST;
    cfg.policy_sink = Some(sink.clone());
    let run = start(cfg);
    let vm = run.vm();
    let view = vm.region_view().expect("region attached");
    let info = view.info().clone();
    assert_eq!(info.mode, RegionMode::Guest);
    assert_eq!(info.guest_addr, GUEST_REGION_GPA);
    let host = vm
        .memory()
        .get_host_address(GuestAddress(GUEST_REGION_GPA))
        .expect("in RAM");
    assert_eq!(
        info.host_addr, host as usize,
        "view is the VMM's RAM mapping"
    );
    assert_eq!(view.read_header().magic, abi::REGION_MAGIC);
    for slot in 0..2 {
        let g = view.read_guest_slot(slot).expect("slot readable");
        assert_eq!(g.updates, u64::from(BURST) + 1);
        assert_eq!((g.policy, g.rt_prio), (abi::POLICY_NORMAL, 0));
    }
    assert_eq!(
        sink.events(),
        vec![SinkEvent::Attached(RegionMode::Guest, 1, GUEST_REGION_GPA)]
    );
    let r = run.finish();
    assert!(r.driver_ok(), "{}", r.handshake);
    assert!(r.clean_shutdown);
    assert_eq!(r.region, "guest");
}

/// The hostile guest gets the same refusals from either device.
fn hostile_body(mode: DeviceMode, test: &str) {
    if !common::kvm(test) {
        return;
    }
    let run = Run::start(&RunConfig::new(
        config(mode, 2, Workload::Hostile),
        Duration::from_secs(1),
    ))
    .expect("VM starts");
    wait_for("the hostile steps", LIMIT, || {
        (run.vm().monitor().stats(0).hostile.len() >= 7).then_some(())
    });
    let id = run.vm().pci().config_read(PVSCHED_DEVICE, 0);
    assert_eq!(
        id,
        u32::from(abi::PCI_DEVICE_ID) << 16 | u32::from(abi::PCI_VENDOR_ID)
    );
    let r = run.finish();
    assert!(r.clean_shutdown);
    assert_eq!(r.per_vcpu[0].fault, None);
    let steps = &r.per_vcpu[0].hostile;
    assert_eq!(
        &steps[..5],
        &[
            (1, abi::ERR_BAD_SEQUENCE),
            (2, abi::ERR_FEATURES_UNSUPPORTED),
            (3, abi::ERR_REGION_UNALIGNED),
            (4, abi::ERR_REGION_OUTSIDE_RAM),
            (5, abi::ERR_VERSION_MISMATCH),
        ]
    );
    assert_eq!((steps[5].0, steps[6].0), (6, 7));
    assert!(r.driver_ok());
}

/// x2APIC IPI ping-pong works the same (the device is not involved).
fn ipi_body(mode: DeviceMode, test: &str) {
    if !common::kvm(test) {
        return;
    }
    let cfg = RunConfig::new(config(mode, 2, Workload::Ipi), Duration::from_millis(700));
    let r = pvsched_vmm::run(&cfg, |_| {}).expect("run");
    assert!(r.driver_ok());
    assert!(r.clean_shutdown);
    let (a, b) = (&r.per_vcpu[0], &r.per_vcpu[1]);
    assert!(a.ipi_sent > 0, "no IPI sent");
    assert_eq!(b.ipi_received, a.ipi_sent);
}

/// Device-region mode, sandboxed: 10^5 slot updates by the guest, read back
/// from BAR2's mapping, while the VMM sends not one vfio-user message.
#[test]
fn slot_updates_cross_no_socket() {
    if !common::kvm("slot_updates_cross_no_socket") {
        return;
    }
    const UPDATES: u32 = 100_000;
    let mut cfg = config(sandboxed(), 1, Workload::Idle);
    cfg.slot_burst = UPDATES;
    let run = start(cfg);
    let vm = run.vm();
    let bar2 = vm.bar2_backing().expect("BAR2");
    let seq = word(&bar2, abi::slot_offset(1, 0) as usize);
    assert_eq!(seq, 2 * (UPDATES + 1), "the guest's slot seq in BAR2");
    let messages = vm.device_messages().expect("sandboxed");
    let r = run.finish();
    let v = &r.per_vcpu[0];
    assert_eq!(v.burst_updates, Some(UPDATES));
    assert_eq!(
        v.burst_device_messages,
        Some(0),
        "messages during the burst"
    );
    assert_eq!(v.burst_mmio_exits, Some(0));
    assert!(
        messages > 0 && messages < 100,
        "{messages} messages in the whole run"
    );
    println!(
        "{UPDATES} slot updates (seq {seq}): 0 vfio-user messages during them, {messages} in the whole run (setup + handshake)"
    );
}

/// kill -9 of the device process: the VM keeps running, the guest-visible
/// device is DEVICE_NEEDS_RESET/DEVICE_FAILED and ignores writes (even a
/// reset), configuration space keeps its last values, the sink hears
/// `region_detached`, the embedder's `on_device_lost` runs once.
#[test]
fn device_death_is_isolated() {
    if !common::kvm("device_death_is_isolated") {
        return;
    }
    let sink = Arc::new(Recorder::default());
    let lost_calls = Arc::new(AtomicU32::new(0));
    let lost_signal = Arc::new(Mutex::new(None));
    let (calls, signal) = (lost_calls.clone(), lost_signal.clone());
    let mut cfg = config(sandboxed(), 2, Workload::Wakeup);
    cfg.policy_sink = Some(sink.clone());
    cfg.on_device_lost = Some(Arc::new(move |l: &pvsched_vmm::DeviceLoss| {
        calls.fetch_add(1, Ordering::SeqCst);
        *signal.lock().unwrap() = l.exit.signal;
    }));
    let run = Run::start(&RunConfig::new(cfg, Duration::from_secs(3))).expect("VM starts");
    wait_for("the guest ready", LIMIT, || {
        run.progress().ready.then_some(())
    });
    let vm = run.vm();
    let pid = vm.device_pid().expect("device process");
    let id = vm.pci().config_read(PVSCHED_DEVICE, 0);
    assert!(vm.region_view().is_some());
    // SAFETY: kill(2) on the device process this VM started (still ours:
    // the VM reaps it only after it ends).
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let loss = wait_for("the loss noticed", LIMIT, || vm.device_lost());
    assert_eq!(loss.exit.pid, pid);
    assert_eq!(loss.exit.signal, Some(libc::SIGKILL));
    assert_eq!(lost_calls.load(Ordering::SeqCst), 1);
    assert_eq!(*lost_signal.lock().unwrap(), Some(libc::SIGKILL));
    assert_eq!(sink.events().last(), Some(&SinkEvent::Detached));
    assert!(vm.region_view().is_none(), "no region view after the loss");
    // What the guest reads now.
    let base = bar0(vm);
    let status = reg(vm, base, abi::REG_STATUS);
    assert_ne!(status & abi::STATUS_DEVICE_NEEDS_RESET, 0, "{status:#x}");
    assert_eq!(status & abi::STATUS_DRIVER_OK, 0);
    assert_eq!(reg(vm, base, abi::REG_ERROR), abi::ERR_DEVICE_FAILED);
    assert_eq!(reg(vm, base, abi::REG_MAGIC), abi::MAGIC);
    set_reg(vm, base, abi::REG_STATUS, 0); // a reset is dropped too
    assert_eq!(reg(vm, base, abi::REG_STATUS), status);
    assert_eq!(vm.device_status(), (status, abi::ERR_DEVICE_FAILED));
    assert_eq!(
        vm.pci().config_read(PVSCHED_DEVICE, 0),
        id,
        "last known config"
    );
    // The vCPUs keep running: wakeups keep being acknowledged.
    let at_loss = loss.events_at_loss;
    wait_for("events after the loss", LIMIT, || {
        (run.progress().events > at_loss + 50).then_some(())
    });
    let r = run.finish();
    assert!(r.clean_shutdown);
    let lost = r.device_lost.expect("reported");
    assert_eq!((lost.pid, lost.signal), (pid, Some(libc::SIGKILL)));
    assert!(r.events > lost.events_at_loss);
    assert_eq!(
        lost_calls.load(Ordering::SeqCst),
        1,
        "once, not again at shutdown"
    );
}

/// Sandboxed: the device process tells the VMM what a register write did
/// on its event socket before it replies, so a STATUS write (reset, every
/// step of a new handshake) costs exactly its own vfio-user message, and
/// the sink still hears the detach and the attach.
#[test]
fn a_status_write_costs_one_message() {
    if !common::kvm("a_status_write_costs_one_message") {
        return;
    }
    let sink = Arc::new(Recorder::default());
    let mut cfg = config(sandboxed(), 2, Workload::Idle);
    cfg.policy_sink = Some(sink.clone());
    let run = start(cfg);
    let vm = run.vm();
    let first = vm.region_view().expect("region attached").info().clone();
    let base = bar0(vm);
    let count = || vm.device_messages().expect("sandboxed");
    let before = count();
    set_reg(vm, base, abi::REG_STATUS, 0);
    let reset = count() - before;
    assert_eq!(reset, 1, "a reset is one message");
    assert_eq!(sink.events().last(), Some(&SinkEvent::Detached));
    assert!(vm.region_view().is_none());
    // The driver's handshake again, from the host: each write one message.
    let before = count();
    let s = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER;
    let writes = [
        (abi::REG_STATUS, abi::STATUS_ACKNOWLEDGE),
        (abi::REG_STATUS, s),
        (
            abi::REG_DRV_FEATURES_LO,
            (abi::F_DEVICE_REGION | abi::F_KICK) as u32,
        ),
        (abi::REG_DRV_FEATURES_HI, 0),
        (abi::REG_STATUS, s | abi::STATUS_FEATURES_OK),
        (abi::REG_DRIVER_VERSION, abi::ABI_VERSION),
        (
            abi::REG_STATUS,
            s | abi::STATUS_FEATURES_OK | abi::STATUS_DRIVER_OK,
        ),
    ];
    for (off, v) in writes {
        set_reg(vm, base, off, v);
    }
    let handshake = count() - before;
    assert_eq!(handshake, writes.len() as u64, "no extra reads");
    let view = vm.region_view().expect("attached again");
    assert_eq!(view.info().generation, first.generation + 1);
    assert_eq!(view.info().host_addr, first.host_addr, "BAR2's mapping");
    assert_eq!(
        sink.events().last(),
        Some(&SinkEvent::Attached(
            RegionMode::Device,
            first.generation + 1,
            first.guest_addr
        ))
    );
    let r = run.finish();
    assert!(r.clean_shutdown);
    assert!(r.device_lost.is_none());
    println!(
        "reset: {reset} message(s); handshake of {} register writes: {handshake} messages",
        writes.len()
    );
}

/// A device program that exits at once fails `Vm::new` clearly.
#[test]
fn a_device_program_that_dies_at_start_fails_clearly() {
    if !common::kvm("a_device_program_that_dies_at_start_fails_clearly") {
        return;
    }
    let mut prog = pvsched_vmm::DeviceProgram::new(env!("CARGO_BIN_EXE_pvsched"), ["device"]);
    prog.extra_args.push("--no-such-flag".into());
    let e = Vm::new(config(DeviceMode::Sandboxed(prog), 1, Workload::Idle))
        .map(|_| ())
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("ended before serving its socket"), "{msg}");
    assert!(msg.contains("exited with code 2"), "{msg}");
}

/// The embedder cannot hand a sandboxed device a BAR2 backing.
#[test]
fn sandboxed_device_refuses_an_embedder_bar2_backing() {
    if !common::kvm("sandboxed_device_refuses_an_embedder_bar2_backing") {
        return;
    }
    let mut cfg = config(sandboxed(), 1, Workload::Idle);
    let size = PvschedDevice::region_bar_size(1) as usize;
    cfg.device_region = Some(Arc::new(MmapRegion::new(size).unwrap()));
    assert!(matches!(Vm::new(cfg), Err(pvsched_vmm::Error::Config(_))));
    let mut vm = Vm::new(config(sandboxed(), 1, Workload::Idle)).expect("VM");
    let other = Arc::new(MmapRegion::new(size).unwrap());
    assert!(matches!(
        vm.set_device_region(other),
        Err(pvsched_vmm::Error::Config(_))
    ));
    assert!(vm.shutdown().clean());
}

/// A device process that stops answering (SIGSTOP) does not block the VM
/// forever: the access times out, the VMM kills the device and carries on
/// as after a crash.
#[test]
fn a_hung_device_is_treated_as_lost() {
    if !common::kvm("a_hung_device_is_treated_as_lost") {
        return;
    }
    let run = start(config(sandboxed(), 1, Workload::Wakeup));
    let vm = run.vm();
    let pid = vm.device_pid().expect("device process");
    let base = bar0(vm);
    assert_eq!(reg(vm, base, abi::REG_MAGIC), abi::MAGIC);
    // SAFETY: kill(2) of the device process this VM started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    let status = reg(vm, base, abi::REG_STATUS); // times out, then the VMM answers for the lost device
    assert_ne!(status & abi::STATUS_DEVICE_NEEDS_RESET, 0, "{status:#x}");
    let loss = wait_for("the loss recorded", LIMIT, || vm.device_lost());
    assert_eq!(loss.noticed_by, "socket");
    assert_eq!(loss.exit.signal, Some(libc::SIGKILL), "killed by the VMM");
    let r = run.finish();
    assert!(r.clean_shutdown);
    assert!(r.device_lost.is_some());
}

/// A device offering only the guest region (sandboxed: `--features 2`)
/// has no BAR2; the guest still attaches its region.
fn guest_only_body(mode: DeviceMode, test: &str) {
    if !common::kvm(test) {
        return;
    }
    let mut cfg = config(mode, 1, Workload::Idle);
    cfg.region = RegionMode::Guest;
    cfg.device_features = abi::F_ALL & !abi::F_DEVICE_REGION;
    let run = start(cfg);
    let vm = run.vm();
    assert!(vm.bar2_backing().is_none() && vm.bar2_memslot().is_none());
    assert_eq!(vm.pci().config_read(PVSCHED_DEVICE, 6), 0, "no BAR2");
    let view = vm.region_view().expect("guest region attached");
    assert_eq!(view.info().guest_addr, GUEST_REGION_GPA);
    let r = run.finish();
    assert!(r.driver_ok(), "{}", r.handshake);
}
