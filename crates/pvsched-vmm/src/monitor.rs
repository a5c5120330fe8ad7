//! What the VMM observes of the guest: events, exits, latency samples.
//!
//! vCPU threads feed [`GuestMonitor::on_event`] with each value the guest writes
//! to the event port, timestamped with the host monotonic clock on arrival,
//! and count their MMIO and port exits. Host-side injectors record when
//! they injected ([`GuestMonitor::note_injection`]), so a latency is host clock
//! on both ends.

use crate::guest::GuestEvent;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Per-vCPU record of what the guest reported.
#[derive(Clone, Debug, Default)]
pub struct GuestVcpuReport {
    /// x2APIC ID the vCPU reported at boot.
    pub apic_id: Option<u32>,
    /// Slot the vCPU found in the region's APIC table.
    pub slot: Option<u32>,
    /// STATUS/ERROR after the handshake (vCPU 0 only).
    pub handshake: Option<(u32, u32)>,
    /// vCPU 0 found pvsched at this `dev << 3 | fn`.
    pub pci_found: Option<u32>,
    /// vCPU 0 moved BAR2 here.
    pub bar_moved: Option<u64>,
    /// The vCPU reached its workload loop.
    pub ready: bool,
    /// The vCPU saw the stop flag.
    pub done: bool,
    /// First unexpected exception vector.
    pub fault: Option<u32>,
    /// Workload events (wakeups acknowledged, round trips, IPIs received, spins).
    pub events: u64,
    /// Latency samples in nanoseconds (meaning depends on the workload).
    pub samples_ns: Vec<u64>,
    /// `ipi`: pings sent.
    pub ipi_sent: u64,
    /// `ipi`: pings received.
    pub ipi_received: u64,
    /// `ipi`: pongs received (completed round trips).
    pub pongs: u64,
    /// `spin`: completed spins.
    pub spins: u64,
    /// `spin`: PAUSE iterations over all spins.
    pub pause_iterations: u64,
    /// `spin`: requests answered.
    pub spin_answers: u64,
    /// MMIO exits counted at the start of the slot-update burst.
    pub burst_mmio_begin: Option<u64>,
    /// MMIO exits during the slot-update burst.
    pub burst_mmio_exits: Option<u64>,
    /// Slot updates in the burst.
    pub burst_updates: Option<u32>,
    /// vfio-user messages counted at the start of the burst (sandboxed device).
    pub burst_messages_begin: Option<u64>,
    /// vfio-user messages the VMM sent during the burst (sandboxed device).
    pub burst_device_messages: Option<u64>,
    /// `hostile`: (step, ERROR) pairs.
    pub hostile: Vec<(u32, u32)>,
    /// Event values the VMM did not understand.
    pub unknown_events: u64,
    /// `wakeup`: samples above [`STALL_NS`] ...
    pub stalls: u64,
    /// ... of which the injector had not finished injecting for more than
    /// half of the sample (it was delayed between its timestamp and the
    /// end of the injection ioctl, i.e. the interrupt left the VMM late).
    pub stalls_injector: u64,
    /// `wakeup`: longest time from the injector's timestamp to the end of
    /// its injection ioctl, ns.
    pub inject_max_ns: u64,
    /// Each sample over [`STALL_NS`] this vCPU recorded: its start (the
    /// injection, the partner's IPI, the spin's start; ns since the monitor
    /// was created, [`GuestMonitor::mono_ns`] turns it into
    /// CLOCK_MONOTONIC, a trace's clock) and length, ns; the first
    /// [`STALL_WINDOWS_MAX`].
    pub stall_windows: Vec<(u64, u64)>,
}

impl GuestVcpuReport {
    /// Keeps the window of a sample that started at `at` and took `len`
    /// ns if it is a stall.
    fn keep_window(&mut self, at: u64, len: u64) {
        if len > STALL_NS && self.stall_windows.len() < STALL_WINDOWS_MAX {
            self.stall_windows.push((at, len));
        }
    }
}

/// What a vCPU reported while it booted, which a restored guest does not
/// report again ([`GuestMonitor::boot`], [`GuestMonitor::restore_boot`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BootReport {
    /// x2APIC ID the vCPU reported.
    pub apic_id: Option<u32>,
    /// Slot it found.
    pub slot: Option<u32>,
    /// STATUS/ERROR after the handshake (vCPU 0).
    pub handshake: Option<(u32, u32)>,
    /// Where vCPU 0 found pvsched.
    pub pci_found: Option<u32>,
    /// Where vCPU 0 moved BAR2.
    pub bar_moved: Option<u64>,
    /// The vCPU reached its workload loop.
    pub ready: bool,
}

/// Stall windows kept per vCPU ([`GuestVcpuReport::stall_windows`]): a
/// loaded vanilla run has a few hundred.
pub const STALL_WINDOWS_MAX: usize = 4096;

/// A `wakeup` sample above this is a stall, and is attributed
/// ([`GuestVcpuReport::stalls`]).
pub const STALL_NS: u64 = 1_000_000;

/// Whether a `sample` (ns) injected at `at` spent more than half of its
/// time in the injector, whose injection ioctl returned at `done` (0, or
/// a time before `at`: it had not returned when the guest acknowledged,
/// so the interrupt was already out and the time is the vCPU's).
fn injector_held(sample: u64, at: u64, done: u64) -> bool {
    let injecting = done.saturating_sub(at);
    injecting.min(sample).saturating_mul(2) > sample
}

struct VcpuRecord {
    stats: Mutex<GuestVcpuReport>,
    mmio_exits: AtomicU64,
    pio_exits: AtomicU64,
    injected_at: AtomicU64,
    /// When the injection ioctl of the pending injection returned (0: not
    /// yet).
    injected_done: AtomicU64,
    /// The longest injection so far, ns (atomic: the injector must not
    /// take the vCPU's stats lock on the measured path).
    inject_max_ns: AtomicU64,
    sent_at: AtomicU64,
}

/// Shared observation state of one VM.
pub struct GuestMonitor {
    start: Instant,
    /// CLOCK_MONOTONIC at `start`, ns.
    start_mono_ns: u64,
    vcpus: Vec<VcpuRecord>,
    console: Mutex<Vec<u8>>,
    device_messages: OnceLock<Arc<AtomicU64>>,
    mmio_service_ns: [Mutex<Vec<u64>>; 2],
}

const CONSOLE_MAX: usize = 64 * 1024;
/// MMIO service-time samples kept (the first ones: handshake, hostile steps).
const MMIO_SAMPLES_MAX: usize = 1 << 16;

use pvsched_util::lock;

impl GuestMonitor {
    /// A monitor for `nr_vcpus` vCPUs.
    pub fn new(nr_vcpus: u32) -> Self {
        Self {
            start: Instant::now(),
            start_mono_ns: pvsched_util::mono_ns(),
            vcpus: (0..nr_vcpus)
                .map(|_| VcpuRecord {
                    stats: Mutex::new(GuestVcpuReport::default()),
                    mmio_exits: AtomicU64::new(0),
                    pio_exits: AtomicU64::new(0),
                    injected_at: AtomicU64::new(0),
                    injected_done: AtomicU64::new(0),
                    inject_max_ns: AtomicU64::new(0),
                    sent_at: AtomicU64::new(0),
                })
                .collect(),
            console: Mutex::new(Vec::new()),
            device_messages: OnceLock::new(),
            mmio_service_ns: [Mutex::new(Vec::new()), Mutex::new(Vec::new())],
        }
    }

    /// Count vfio-user messages from `counter` around each slot burst
    /// (set once, by a VM with a sandboxed device).
    pub fn set_device_messages(&self, counter: Arc<AtomicU64>) {
        let _ = self.device_messages.set(counter);
    }

    fn device_messages(&self) -> Option<u64> {
        self.device_messages
            .get()
            .map(|c| c.load(Ordering::Relaxed))
    }

    /// Record how long the VMM took to serve one MMIO exit a BAR decoded
    /// (device access included: a socket round trip per BAR0 access when
    /// sandboxed, and the non-blocking read of the events it caused; see
    /// [`crate::remote`]).
    pub fn mmio_service(&self, write: bool, ns: u64) {
        let mut v = lock(&self.mmio_service_ns[usize::from(write)]);
        if v.len() < MMIO_SAMPLES_MAX {
            v.push(ns);
        }
    }

    /// The MMIO service-time samples so far (reads or writes), nanoseconds.
    pub fn mmio_service_samples(&self, write: bool) -> Vec<u64> {
        lock(&self.mmio_service_ns[usize::from(write)]).clone()
    }

    /// Nanoseconds since the monitor was created (never 0).
    pub fn now_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// A time of [`Self::now_ns`] as CLOCK_MONOTONIC, ns (the clock of a
    /// tracefs trace with `trace_clock` mono).
    pub fn mono_ns(&self, at: u64) -> u64 {
        self.start_mono_ns.saturating_add(at)
    }

    /// Number of vCPUs.
    pub fn nr_vcpus(&self) -> u32 {
        self.vcpus.len() as u32
    }

    /// Count an MMIO exit of `vcpu`.
    pub fn count_mmio(&self, vcpu: u32) {
        if let Some(r) = self.vcpus.get(vcpu as usize) {
            r.mmio_exits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Count a port exit of `vcpu`.
    pub fn count_pio(&self, vcpu: u32) {
        if let Some(r) = self.vcpus.get(vcpu as usize) {
            r.pio_exits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// MMIO exits of `vcpu` so far.
    pub fn mmio_exits(&self, vcpu: u32) -> u64 {
        self.vcpus
            .get(vcpu as usize)
            .map_or(0, |r| r.mmio_exits.load(Ordering::Relaxed))
    }

    /// Port exits of `vcpu` so far.
    pub fn pio_exits(&self, vcpu: u32) -> u64 {
        self.vcpus
            .get(vcpu as usize)
            .map_or(0, |r| r.pio_exits.load(Ordering::Relaxed))
    }

    /// Record that an interrupt was injected into `vcpu` now. Returns false
    /// (and records nothing) while a previous injection is unacknowledged.
    pub fn note_injection(&self, vcpu: u32) -> bool {
        let Some(r) = self.vcpus.get(vcpu as usize) else {
            return false;
        };
        r.injected_at
            .compare_exchange(0, self.now_ns(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The injection ioctl of `vcpu`'s pending injection has returned: the
    /// interrupt has left the VMM (a sample's time before this is the
    /// injector's, after it the vCPU's).
    pub fn note_injected(&self, vcpu: u32) {
        if let Some(r) = self.vcpus.get(vcpu as usize) {
            let now = self.now_ns();
            let at = r.injected_at.load(Ordering::Acquire);
            // Only for the injection still pending (the guest may have
            // acknowledged it already).
            if at != 0 {
                r.injected_done.store(now, Ordering::Release);
                r.inject_max_ns
                    .fetch_max(now.saturating_sub(at), Ordering::Relaxed);
            }
        }
    }

    /// Forget an unacknowledged injection into `vcpu` (lost or timed out);
    /// returns when it was made.
    pub fn clear_injection(&self, vcpu: u32) -> Option<u64> {
        let r = self.vcpus.get(vcpu as usize)?;
        r.injected_done.store(0, Ordering::Release);
        let t = r.injected_at.swap(0, Ordering::AcqRel);
        (t != 0).then_some(t)
    }

    /// Console bytes from the guest.
    pub fn console_byte(&self, b: u8) {
        let mut c = lock(&self.console);
        if c.len() < CONSOLE_MAX {
            c.push(b);
        }
    }

    /// Console text so far.
    pub fn console(&self) -> String {
        String::from_utf8_lossy(&lock(&self.console)).into_owned()
    }

    /// A copy of `vcpu`'s record.
    pub fn stats(&self, vcpu: u32) -> GuestVcpuReport {
        self.vcpus
            .get(vcpu as usize)
            .map(|r| {
                let mut s = lock(&r.stats).clone();
                s.inject_max_ns = r.inject_max_ns.load(Ordering::Relaxed);
                s
            })
            .unwrap_or_default()
    }

    /// What `vcpu` reported while it booted.
    pub fn boot(&self, vcpu: u32) -> BootReport {
        let s = self.stats(vcpu);
        BootReport {
            apic_id: s.apic_id,
            slot: s.slot,
            handshake: s.handshake,
            pci_found: s.pci_found,
            bar_moved: s.bar_moved,
            ready: s.ready,
        }
    }

    /// Takes `boot` as what `vcpu` reported while it booted: a guest
    /// restored from a snapshot runs on from where it was.
    pub fn restore_boot(&self, vcpu: u32, boot: &BootReport) {
        if let Some(r) = self.vcpus.get(vcpu as usize) {
            let mut s = lock(&r.stats);
            s.apic_id = boot.apic_id;
            s.slot = boot.slot;
            s.handshake = boot.handshake;
            s.pci_found = boot.pci_found;
            s.bar_moved = boot.bar_moved;
            s.ready = boot.ready;
        }
    }

    /// Sum of workload events over all vCPUs.
    pub fn total_events(&self) -> u64 {
        self.vcpus.iter().map(|r| lock(&r.stats).events).sum()
    }

    /// Whether every vCPU in `which` has reported `done`.
    pub fn all_done(&self, which: impl Iterator<Item = u32>) -> bool {
        let mut all = true;
        for v in which {
            all &= self.stats(v).done;
        }
        all
    }

    /// Whether every vCPU reached its workload loop (or stopped).
    pub fn all_ready(&self) -> bool {
        self.vcpus.iter().all(|r| {
            let s = lock(&r.stats);
            s.ready || s.done || s.fault.is_some()
        })
    }

    /// Handle one event-port value from `vcpu`.
    pub fn on_event(&self, vcpu: u32, value: u32) {
        let now = self.now_ns();
        let Some(rec) = self.vcpus.get(vcpu as usize) else {
            return;
        };
        let event = GuestEvent::decode(value);
        let peer_sent = |peer: u32| {
            self.vcpus
                .get(peer as usize)
                .map(|p| p.sent_at.load(Ordering::Acquire))
                .filter(|t| *t != 0)
        };
        let mut s = lock(&rec.stats);
        match event {
            GuestEvent::Boot(id) => s.apic_id = Some(id),
            GuestEvent::PciFound(bdf) => s.pci_found = Some(bdf),
            GuestEvent::Handshake { status, error } => s.handshake = Some((status, error)),
            GuestEvent::Slot(slot) => s.slot = slot,
            GuestEvent::BurstBegin(_) => {
                s.burst_mmio_begin = Some(rec.mmio_exits.load(Ordering::Relaxed));
                s.burst_messages_begin = self.device_messages();
            }
            GuestEvent::BurstEnd(n) => {
                let now_exits = rec.mmio_exits.load(Ordering::Relaxed);
                s.burst_mmio_exits = s.burst_mmio_begin.map(|b| now_exits.saturating_sub(b));
                s.burst_updates = Some(n);
                s.burst_device_messages = s
                    .burst_messages_begin
                    .zip(self.device_messages())
                    .map(|(b, e)| e.saturating_sub(b));
            }
            GuestEvent::Ready => s.ready = true,
            GuestEvent::WakeAck => {
                let done = rec.injected_done.swap(0, Ordering::AcqRel);
                let t = rec.injected_at.swap(0, Ordering::AcqRel);
                if t != 0 {
                    let sample = now.saturating_sub(t);
                    s.samples_ns.push(sample);
                    if sample > STALL_NS {
                        s.stalls += 1;
                        s.keep_window(t, sample);
                        if injector_held(sample, t, done) {
                            s.stalls_injector += 1;
                        }
                    }
                }
                s.events += 1;
            }
            GuestEvent::IpiSent(_) => {
                rec.sent_at.store(now, Ordering::Release);
                s.ipi_sent += 1;
            }
            GuestEvent::IpiReceived(from) => {
                if let Some(t) = peer_sent(from) {
                    s.samples_ns.push(now.saturating_sub(t));
                    s.keep_window(t, now.saturating_sub(t));
                }
                s.ipi_received += 1;
                s.events += 1;
            }
            GuestEvent::PongReceived(_) => {
                let t = rec.sent_at.load(Ordering::Acquire);
                if t != 0 {
                    s.samples_ns.push(now.saturating_sub(t));
                    s.keep_window(t, now.saturating_sub(t));
                }
                s.pongs += 1;
                s.events += 1;
            }
            GuestEvent::SpinBegin(_) => rec.sent_at.store(now, Ordering::Release),
            GuestEvent::SpinEnd(n) => {
                let t = rec.sent_at.load(Ordering::Acquire);
                if t != 0 {
                    s.samples_ns.push(now.saturating_sub(t));
                    s.keep_window(t, now.saturating_sub(t));
                }
                s.spins += 1;
                s.pause_iterations += u64::from(n);
                s.events += 1;
            }
            GuestEvent::SpinAnswered(_) => {
                s.spin_answers += 1;
                s.events += 1;
            }
            GuestEvent::HostileError { step, error } => s.hostile.push((step, error)),
            GuestEvent::BarMoved(base) => s.bar_moved = Some(base),
            GuestEvent::Done => s.done = true,
            GuestEvent::Fault(v) => {
                if s.fault.is_none() {
                    s.fault = Some(v);
                }
            }
            GuestEvent::Unknown(_) => s.unknown_events += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stall is the injector's when the interrupt was still in it for
    /// more than half of the sample; an ioctl that had not returned by
    /// the acknowledgement (0, or a stale earlier time) gives none.
    #[test]
    fn stalls_are_attributed_to_the_injector_or_the_vcpu() {
        let ms = 1_000_000;
        assert!(injector_held(5 * ms, 100, 100 + 4 * ms));
        assert!(!injector_held(5 * ms, 100, 100 + 2 * ms));
        assert!(!injector_held(5 * ms, 100, 0));
        assert!(!injector_held(5 * ms, 100, 50));
        // A return after the acknowledgement counts only up to the sample.
        assert!(injector_held(5 * ms, 100, 100 + 9 * ms));
        assert!(!injector_held(0, 100, 200));
    }
    use crate::guest::events::code;

    #[test]
    fn wake_latency_is_ack_minus_injection() {
        let m = GuestMonitor::new(2);
        assert!(m.note_injection(1));
        assert!(!m.note_injection(1), "one outstanding injection per vCPU");
        m.on_event(1, code::WAKE_ACK << 24);
        let s = m.stats(1);
        assert_eq!(s.events, 1);
        assert_eq!(s.samples_ns.len(), 1);
        assert!(m.note_injection(1));
        // An ack without an injection counts but gives no sample.
        m.on_event(0, code::WAKE_ACK << 24);
        assert_eq!(m.stats(0).samples_ns.len(), 0);
        assert_eq!(m.total_events(), 2);
    }

    /// A sample over 1 ms is a stall and keeps its window: its injection
    /// time, which `mono_ns` puts on CLOCK_MONOTONIC, and its length.
    #[test]
    fn a_stall_keeps_its_window_on_the_monotonic_clock() {
        let m = GuestMonitor::new(1);
        let before = pvsched_util::mono_ns();
        assert!(m.note_injection(0));
        std::thread::sleep(std::time::Duration::from_millis(2));
        m.on_event(0, code::WAKE_ACK << 24);
        let s = m.stats(0);
        assert_eq!(s.stalls, 1);
        let [(at, len)] = s.stall_windows[..] else {
            panic!("one window: {:?}", s.stall_windows);
        };
        assert_eq!(len, s.samples_ns[0]);
        assert!(len >= 2_000_000, "{len}");
        let mono = m.mono_ns(at);
        assert!(
            mono >= before && mono + len <= pvsched_util::mono_ns(),
            "{before} {mono} {len}"
        );
    }

    /// An IPI that reaches its receiver 2 ms after it was sent keeps a
    /// window at the receiver, as its round trip does at the sender; a
    /// quick one keeps none. None of them is a `wakeup` stall.
    #[test]
    fn a_slow_ipi_keeps_its_window_at_the_vcpu_that_measured_it() {
        let m = GuestMonitor::new(2);
        m.on_event(0, code::IPI_SENT << 24 | 1);
        m.on_event(1, code::IPI_RECV << 24);
        assert!(m.stats(1).stall_windows.is_empty());
        m.on_event(0, code::IPI_SENT << 24 | 1);
        std::thread::sleep(std::time::Duration::from_millis(2));
        m.on_event(1, code::IPI_RECV << 24);
        m.on_event(0, code::PONG_RECV << 24 | 1);
        for v in [0, 1] {
            let s = m.stats(v);
            assert_eq!(s.stall_windows.len(), 1, "vCPU {v}");
            assert!(s.stall_windows[0].1 >= 2_000_000, "vCPU {v}");
            assert_eq!(s.stalls, 0, "vCPU {v}");
        }
    }

    #[test]
    fn ipi_counts_and_bad_indices_are_ignored() {
        let m = GuestMonitor::new(2);
        m.on_event(0, code::IPI_SENT << 24 | 1);
        m.on_event(1, code::IPI_RECV << 24);
        m.on_event(0, code::PONG_RECV << 24 | 1);
        m.on_event(7, code::IPI_SENT << 24);
        m.on_event(1, code::IPI_RECV << 24 | 0xff_ffff);
        assert_eq!(m.stats(0).ipi_sent, 1);
        assert_eq!(m.stats(0).pongs, 1);
        assert_eq!(m.stats(1).ipi_received, 2);
        m.on_event(0, 0xee00_0000);
        assert_eq!(m.stats(0).unknown_events, 1);
    }
}
