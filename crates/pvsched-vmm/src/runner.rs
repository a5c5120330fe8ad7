//! Running a workload for a while and summarising it (`pvsched run`).
//!
//! [`Run::start`] builds and starts the VM and, for `wakeup`, an injector
//! thread that sends one MSI at a time to each vCPU and timestamps it.
//! [`Run::finish`] stops in an order that loses nothing in flight: the
//! injector first, then the stop flag, then the vCPUs that poll the flag
//! (those driving an `ipi`/`spin` pair, every `greedy` vCPU), then the
//! passive ones (woken by the stop vector), and finally every vCPU thread
//! is kicked out of KVM_RUN and joined.

use crate::guest::Workload;
use crate::guest::events::{VEC_STOP, VEC_WAKE};
use crate::monitor::GuestMonitor;
use crate::snapshot::Snapshot;
use crate::stats::{self, Summary};
use crate::vcpu::VcpuEnd;
use crate::vm::{self, Vm, VmConfig};
use pvsched_abi as abi;
use pvsched_device::{RegionMode, RegionView};
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long to wait for the guest to notice the stop flag.
const STOP_WAIT: Duration = Duration::from_secs(2);
/// How long [`Run::start`] waits for the guest to reach its workload loops.
const BOOT_WAIT: Duration = Duration::from_secs(10);
/// An injection not acknowledged after this long counts as lost.
const WAKE_TIMEOUT: Duration = Duration::from_millis(200);

/// What to run.
#[derive(Clone)]
pub struct RunConfig {
    /// The VM.
    pub vm: VmConfig,
    /// How long the workload runs.
    pub duration: Duration,
    /// `wakeup`: time between two injections into the same vCPU.
    pub wakeup_interval: Duration,
}

impl RunConfig {
    /// Defaults: 2 ms between wakeups.
    pub fn new(vm: VmConfig, duration: Duration) -> Self {
        Self {
            vm,
            duration,
            wakeup_interval: Duration::from_millis(2),
        }
    }
}

/// A snapshot for live progress.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Time since start.
    pub elapsed: Duration,
    /// Workload events so far (all vCPUs).
    pub events: u64,
    /// Whether every vCPU reached its workload loop.
    pub ready: bool,
    /// Whether the (sandboxed) device process has been lost.
    pub device_lost: bool,
}

/// The guest half of a slot as the host read it through the region view.
#[derive(Clone, Debug, Serialize)]
pub struct SlotReading {
    /// Sequence counter (even).
    pub seq: u32,
    /// `kern_cs` bits.
    pub kern_cs: u32,
    /// Policy.
    pub policy: u32,
    /// RT priority.
    pub rt_prio: u32,
    /// Slot index waited on.
    pub wait_on: Option<u32>,
    /// Completed updates.
    pub updates: u64,
}

/// Per-vCPU results.
#[derive(Clone, Debug, Serialize)]
pub struct VcpuReport {
    /// vCPU index.
    pub index: u32,
    /// Host thread ID.
    pub tid: i32,
    /// x2APIC ID the guest read.
    pub apic_id: Option<u32>,
    /// Region slot the guest found.
    pub slot: Option<u32>,
    /// Workload events.
    pub events: u64,
    /// Latency samples.
    pub samples: usize,
    /// `wakeup`: samples above 1 ms ...
    pub stalls: u64,
    /// ... of which the interrupt was still in the injector (the VMM's
    /// injecting thread was delayed between its timestamp and the end of
    /// the injection) for more than half of the sample.
    pub stalls_injector: u64,
    /// `wakeup`: the longest injection (timestamp to the end of the
    /// injection ioctl), µs.
    pub inject_max_us: Option<f64>,
    /// Median latency, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile, µs.
    pub p99_us: Option<f64>,
    /// Maximum, µs.
    pub max_us: Option<f64>,
    /// MMIO exits of this vCPU.
    pub mmio_exits: u64,
    /// Port exits of this vCPU.
    pub pio_exits: u64,
    /// Slot updates in the start-up burst.
    pub burst_updates: Option<u32>,
    /// MMIO exits during the burst (0 in device-region mode: no exits).
    pub burst_mmio_exits: Option<u64>,
    /// Sandboxed device: vfio-user messages the VMM sent during the burst
    /// (0 in device-region mode: slot updates never cross the socket).
    pub burst_device_messages: Option<u64>,
    /// `ipi`: pings sent.
    pub ipi_sent: u64,
    /// `ipi`: pings received.
    pub ipi_received: u64,
    /// `spin`: completed spins.
    pub spins: u64,
    /// `spin`: PAUSE iterations.
    pub pause_iterations: u64,
    /// `hostile`: (step, ERROR) the guest saw.
    pub hostile: Vec<(u32, u32)>,
    /// `greedy`: PAUSE-loop iterations (0 for other workloads).
    pub greedy_loops: u64,
    /// Unexpected exception vector, if any.
    pub fault: Option<u32>,
    /// The guest half of its slot as read by the host at the end.
    pub guest_slot: Option<SlotReading>,
    /// Why the vCPU thread ended.
    pub end: Option<VcpuEnd>,
}

/// The device process died during the run (`"device_lost"` in the JSON).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceLostReport {
    /// Its PID.
    pub pid: u32,
    /// Signal that killed it, if any.
    pub signal: Option<i32>,
    /// Its exit code, if it exited.
    pub exit_code: Option<i32>,
    /// Seconds after the workload started (negative: before).
    pub at_s: f64,
    /// `"socket"` (an access failed first) or `"process"` (reaped first).
    pub noticed_by: &'static str,
    /// Workload events counted when it was lost (`events` is the total).
    pub events_at_loss: u64,
}

/// The result of a run (also the `--json` output).
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Workload name.
    pub workload: Workload,
    /// "device" or "guest".
    pub region: &'static str,
    /// Where the device ran: "in-process" or "sandboxed".
    pub device_mode: &'static str,
    /// PID of the device process (sandboxed).
    pub device_pid: Option<u32>,
    /// vfio-user requests the VMM sent in the whole run (sandboxed).
    pub device_messages: Option<u64>,
    /// The device process died during the run.
    pub device_lost: Option<DeviceLostReport>,
    /// How long the VMM took to serve the guest's MMIO reads that hit a
    /// BAR (BAR0 registers: one socket round trip each when sandboxed).
    pub mmio_read_service: Summary,
    /// The same for MMIO writes (sandboxed: the write's round trip and
    /// draining the events it caused, see `remote`).
    pub mmio_write_service: Summary,
    /// Wall time the workload ran, seconds.
    pub duration_s: f64,
    /// Workload events, all vCPUs.
    pub events: u64,
    /// Latency samples, all vCPUs.
    pub samples: usize,
    /// Median latency over all vCPUs, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile, µs.
    pub p99_us: Option<f64>,
    /// Maximum, µs.
    pub max_us: Option<f64>,
    /// `DRIVER_OK`, `FAILED: <ERROR name>` or `NOT_REACHED`.
    pub handshake: String,
    /// STATUS the guest read after DRIVER_OK.
    pub handshake_status: Option<u32>,
    /// ERROR the guest read after DRIVER_OK.
    pub handshake_error: Option<u32>,
    /// Device STATUS at the end.
    pub device_status: u32,
    /// Device ERROR at the end.
    pub device_error: u32,
    /// `wakeup`: injections never acknowledged.
    pub lost_wakeups: u64,
    /// Every vCPU thread was stopped by the VMM and joined.
    pub clean_shutdown: bool,
    /// Per vCPU.
    pub per_vcpu: Vec<VcpuReport>,
    /// What the guest wrote to its serial port.
    pub console: String,
}

impl RunReport {
    /// Whether the handshake reached DRIVER_OK.
    pub fn driver_ok(&self) -> bool {
        self.handshake_status
            .is_some_and(|s| s & abi::STATUS_DRIVER_OK != 0)
    }
}

/// Name of an ERROR code.
pub fn error_name(code: u32) -> &'static str {
    match code {
        abi::ERR_NONE => "NONE",
        abi::ERR_BAD_SEQUENCE => "BAD_SEQUENCE",
        abi::ERR_FEATURES_UNSUPPORTED => "FEATURES_UNSUPPORTED",
        abi::ERR_NO_REGION_MODE => "NO_REGION_MODE",
        abi::ERR_VERSION_MISMATCH => "VERSION_MISMATCH",
        abi::ERR_REGION_ZERO_SIZE => "REGION_ZERO_SIZE",
        abi::ERR_REGION_UNALIGNED => "REGION_UNALIGNED",
        abi::ERR_REGION_WRAPS => "REGION_WRAPS",
        abi::ERR_REGION_OUTSIDE_RAM => "REGION_OUTSIDE_RAM",
        abi::ERR_REGION_TOO_SMALL => "REGION_TOO_SMALL",
        abi::ERR_REGION_CHANGED => "REGION_CHANGED",
        abi::ERR_REGION_UNMAPPED => "REGION_UNMAPPED",
        abi::ERR_REGION_UNAVAILABLE => "REGION_UNAVAILABLE",
        abi::ERR_DEVICE_FAILED => "DEVICE_FAILED",
        0xffff => "DEVICE_NOT_FOUND",
        _ => "UNKNOWN",
    }
}

/// A workload in progress.
pub struct Run {
    vm: Vm,
    workload: Workload,
    started: Instant,
    injector: Option<JoinHandle<()>>,
    stop_injector: Arc<AtomicBool>,
    lost: Arc<AtomicU64>,
}

impl Run {
    /// Build and start the VM and the workload's host side. Returns once
    /// every vCPU reached its workload loop (or after 10 s if the guest
    /// never gets there; the report then shows how far it got).
    pub fn start(cfg: &RunConfig) -> vm::Result<Self> {
        Self::start_with(cfg, |_| Ok(()))
    }

    /// Like [`Run::start`], with `attach` called once the vCPU threads
    /// exist ([`Vm::vcpu_tids`]) but before the guest runs: a host policy
    /// registers the threads and may replace the device region
    /// ([`Vm::set_device_region`]). An error from `attach` stops the VM.
    pub fn start_with<E: From<vm::Error>>(
        cfg: &RunConfig,
        attach: impl FnOnce(&mut Vm) -> Result<(), E>,
    ) -> Result<Self, E> {
        Self::launch(Vm::new(cfg.vm.clone())?, cfg, attach)
    }

    /// Like [`Run::start_with`], for the VM of snapshot `snap`
    /// ([`Vm::restore`]): the guest runs on from where it was, its device
    /// state loaded after `attach`. `cfg.vm` is the snapshot's
    /// ([`crate::snapshot::VmState::config`]) with the caller's sink.
    pub fn restore_with<E: From<vm::Error>>(
        cfg: &RunConfig,
        snap: Snapshot,
        attach: impl FnOnce(&mut Vm) -> Result<(), E>,
    ) -> Result<Self, E> {
        Self::launch(Vm::restore(cfg.vm.clone(), snap)?, cfg, attach)
    }

    fn launch<E: From<vm::Error>>(
        mut vm: Vm,
        cfg: &RunConfig,
        attach: impl FnOnce(&mut Vm) -> Result<(), E>,
    ) -> Result<Self, E> {
        vm.start_held()?;
        attach(&mut vm)?;
        vm.restore_device()?;
        vm.release();
        // The workload's time starts once the guest is in its loops
        // (handshake and slot burst done); a broken guest gets BOOT_WAIT.
        let deadline = Instant::now() + BOOT_WAIT;
        while !vm.monitor().all_ready() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let stop_injector = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicU64::new(0));
        let injector = if cfg.vm.workload == Workload::Wakeup {
            let inj = vm.injector();
            let monitor = vm.monitor().clone();
            let stop = stop_injector.clone();
            let lost = lost.clone();
            let interval = cfg.wakeup_interval;
            Some(
                std::thread::Builder::new()
                    .name("pvsched-inject".into())
                    .spawn(move || inject_loop(&inj, &monitor, &stop, &lost, interval))
                    .map_err(|e| E::from(vm::Error::Spawn(e)))?,
            )
        } else {
            None
        };
        Ok(Self {
            workload: cfg.vm.workload,
            vm,
            started: Instant::now(),
            injector,
            stop_injector,
            lost,
        })
    }

    /// The VM (TIDs, device, region view...).
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// Live progress.
    pub fn progress(&self) -> Progress {
        let m = self.vm.monitor();
        Progress {
            elapsed: self.started.elapsed(),
            events: m.total_events(),
            ready: m.all_ready(),
            device_lost: self.vm.device_lost().is_some(),
        }
    }

    /// Stop everything, join every thread, and summarise.
    pub fn finish(mut self) -> RunReport {
        let duration = self.started.elapsed();
        self.stop_injector();
        let n = self.vm.monitor().nr_vcpus();
        if let Err(e) = self.vm.request_stop() {
            log::warn!("{e}");
        }
        let active: Vec<u32> = (0..n).filter(|v| self.workload.is_active(*v, n)).collect();
        let passive: Vec<u32> = (0..n).filter(|v| !self.workload.is_active(*v, n)).collect();
        self.stop_group(&active, STOP_WAIT / 4);
        self.stop_group(&passive, Duration::ZERO);
        self.report(duration)
    }

    /// Stops the vCPUs where they are, writes the VM's snapshot into `dir`
    /// ([`Vm::snapshot`], [`Snapshot::write`]) and summarises the run so
    /// far. The guest is not told: restored, it runs on.
    pub fn snapshot_to(mut self, dir: &std::path::Path) -> vm::Result<RunReport> {
        let duration = self.started.elapsed();
        self.stop_injector();
        let snap = self.vm.snapshot()?;
        snap.write(dir)?;
        Ok(self.report(duration))
    }

    fn stop_injector(&mut self) {
        self.stop_injector.store(true, Ordering::Release);
        if let Some(h) = self.injector.take()
            && h.join().is_err()
        {
            log::warn!("injector thread panicked");
        }
    }

    /// The report of a run that lasted `duration`, once the guest stopped
    /// (or was snapshotted); shuts the VM down.
    fn report(self, duration: Duration) -> RunReport {
        let monitor = self.vm.monitor().clone();
        let n = monitor.nr_vcpus();
        let view = self.vm.region_view();
        let (device_status, device_error) = self.vm.device_status();
        let tids = self.vm.vcpu_tids();
        let mut per_vcpu = Vec::new();
        let mut all_samples = Vec::new();
        for v in 0..n {
            let (report, samples) = self.vcpu_report(v, &monitor, view.as_ref(), &tids);
            all_samples.extend_from_slice(&samples);
            per_vcpu.push(report);
        }
        let hs = monitor.stats(0).handshake;
        let workload = self.workload;
        let region = match self.vm.config().region {
            RegionMode::Device => "device",
            RegionMode::Guest => "guest",
        };
        let device_mode = self.vm.config().device_mode.name();
        let device_pid = self.vm.device_pid();
        let started = self.started;
        let mmio_read_service = stats::summarize(&monitor.mmio_service_samples(false));
        let mmio_write_service = stats::summarize(&monitor.mmio_service_samples(true));
        let shutdown_vm = self.vm;
        let device_messages = shutdown_vm.device_messages();
        let device_lost = shutdown_vm.device_lost().map(|l| DeviceLostReport {
            pid: l.exit.pid,
            signal: l.exit.signal,
            exit_code: l.exit.exit_code,
            at_s: secs_between(started, l.exit.at),
            noticed_by: l.noticed_by,
            events_at_loss: l.events_at_loss,
        });
        let shutdown = shutdown_vm.shutdown();
        for (r, end) in per_vcpu.iter_mut().zip(shutdown.vcpu_ends.iter()) {
            r.end = Some(end.clone());
        }
        let Summary {
            samples,
            p50_us,
            p99_us,
            max_us,
        } = stats::summarize(&all_samples);
        let handshake = handshake_text(hs);
        RunReport {
            vcpus: n,
            workload,
            region,
            device_mode,
            device_pid,
            device_messages,
            device_lost,
            mmio_read_service,
            mmio_write_service,
            duration_s: (duration.as_secs_f64() * 1000.0).round() / 1000.0,
            events: per_vcpu.iter().map(|r| r.events).sum(),
            samples,
            p50_us,
            p99_us,
            max_us,
            handshake,
            handshake_status: hs.map(|h| h.0),
            handshake_error: hs.map(|h| h.1),
            device_status,
            device_error,
            lost_wakeups: self.lost.load(Ordering::Relaxed),
            clean_shutdown: shutdown.clean(),
            per_vcpu,
            console: monitor.console(),
        }
    }

    /// vCPU `v`'s row of the report (without its end state, known only
    /// after shutdown) and its latency samples.
    fn vcpu_report(
        &self,
        v: u32,
        monitor: &GuestMonitor,
        view: Option<&RegionView>,
        tids: &[i32],
    ) -> (VcpuReport, Vec<u64>) {
        let s = monitor.stats(v);
        let sum = stats::summarize(&s.samples_ns);
        let guest_slot = match (view, s.slot) {
            (Some(view), Some(slot)) => view.read_guest_slot(slot).ok().map(|g| SlotReading {
                seq: g.seq,
                kern_cs: g.kern_cs,
                policy: g.policy,
                rt_prio: g.rt_prio,
                wait_on: g.wait_on,
                updates: g.updates,
            }),
            _ => None,
        };
        let report = VcpuReport {
            index: v,
            tid: tids.get(v as usize).copied().unwrap_or(0),
            apic_id: s.apic_id,
            slot: s.slot,
            events: s.events,
            samples: sum.samples,
            stalls: s.stalls,
            stalls_injector: s.stalls_injector,
            inject_max_us: (s.inject_max_ns > 0).then(|| s.inject_max_ns as f64 / 1e3),
            p50_us: sum.p50_us,
            p99_us: sum.p99_us,
            max_us: sum.max_us,
            mmio_exits: monitor.mmio_exits(v),
            pio_exits: monitor.pio_exits(v),
            burst_updates: s.burst_updates,
            burst_mmio_exits: s.burst_mmio_exits,
            burst_device_messages: s.burst_device_messages,
            ipi_sent: s.ipi_sent,
            ipi_received: s.ipi_received,
            spins: s.spins,
            pause_iterations: s.pause_iterations,
            hostile: s.hostile.clone(),
            greedy_loops: if self.workload == Workload::Greedy {
                self.vm.greedy_loops(v)
            } else {
                0
            },
            fault: s.fault,
            guest_slot,
            end: None,
        };
        (report, s.samples_ns)
    }

    /// Wait up to `grace` for `group` to report done by itself, then wake
    /// the rest with the stop vector and wait again.
    fn stop_group(&self, group: &[u32], grace: Duration) {
        let monitor = self.vm.monitor();
        let deadline = Instant::now() + grace;
        while !monitor.all_done(group.iter().copied()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let deadline = Instant::now() + STOP_WAIT;
        let mut last_kick = None::<Instant>;
        while !monitor.all_done(group.iter().copied()) && Instant::now() < deadline {
            if last_kick.is_none_or(|t| t.elapsed() > Duration::from_millis(50)) {
                for v in group {
                    if !monitor.stats(*v).done
                        && let Err(e) = self.vm.inject(*v, VEC_STOP)
                    {
                        log::warn!("{e}");
                    }
                }
                last_kick = Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Run `cfg` for its duration, calling `progress` about once a second.
pub fn run(cfg: &RunConfig, mut progress: impl FnMut(&Progress)) -> vm::Result<RunReport> {
    let run = Run::start(cfg)?;
    let end = Instant::now() + cfg.duration;
    let mut next = Instant::now() + Duration::from_secs(1);
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        std::thread::sleep((end.min(next)).saturating_duration_since(now));
        if Instant::now() >= next {
            progress(&run.progress());
            next += Duration::from_secs(1);
        }
    }
    Ok(run.finish())
}

/// `to - from` in seconds, rounded to ms; negative if `to` is earlier.
fn secs_between(from: Instant, to: Instant) -> f64 {
    let s = match to.checked_duration_since(from) {
        Some(d) => d.as_secs_f64(),
        None => -from.duration_since(to).as_secs_f64(),
    };
    (s * 1000.0).round() / 1000.0
}

fn inject_loop(
    inj: &vm::Injector,
    monitor: &GuestMonitor,
    stop: &AtomicBool,
    lost: &AtomicU64,
    interval: Duration,
) {
    let n = monitor.nr_vcpus();
    let mut since: Vec<Option<Instant>> = vec![None; n as usize];
    while !stop.load(Ordering::Acquire) {
        for v in 0..n {
            if !monitor.stats(v).ready {
                continue;
            }
            let slot = &mut since[v as usize];
            if monitor.note_injection(v) {
                *slot = Some(Instant::now());
                if let Err(e) = inj.inject(v, VEC_WAKE) {
                    log::warn!("{e}");
                    monitor.clear_injection(v);
                } else {
                    monitor.note_injected(v);
                }
            } else if slot.is_some_and(|t| t.elapsed() > WAKE_TIMEOUT) {
                monitor.clear_injection(v);
                lost.fetch_add(1, Ordering::Relaxed);
                *slot = None;
            }
        }
        std::thread::sleep(interval);
    }
}

/// The handshake as the report shows it: `DRIVER_OK`, `FAILED: <error>` or
/// `NOT_REACHED`.
fn handshake_text(hs: Option<(u32, u32)>) -> String {
    match hs {
        Some((st, _)) if st & abi::STATUS_DRIVER_OK != 0 => "DRIVER_OK".to_owned(),
        Some((_, err)) => format!("FAILED: {}", error_name(err)),
        None => "NOT_REACHED".to_owned(),
    }
}
