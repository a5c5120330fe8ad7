//! The consumer thread: drains the decision ring (blocking in epoll, never
//! spinning), applies each decision to its registered thread, queues it for
//! the trace, drives the policy timer and, every tick, reconciles every
//! thread with the policy's state.

use super::trace_out::TraceOut;
use super::{AgentConfig, Inner};
use crate::intf::{Decision, gid_vm};
use crate::object::{PolicyView, reevaluate};
use crate::sched::{self, SchedAttr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Decision → applied latency samples kept per VM (a ring).
pub(super) const LAT_SAMPLES: usize = 8192;

pub(super) fn now_mono() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the valid timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn handle(inner: &Inner, d: &Decision) {
    let mut guard = inner.reg.lock();
    let reg = &mut *guard;
    let vm_id = gid_vm(d.gid);
    let Some(vm) = reg.vms.get_mut(&vm_id) else {
        reg.foreign += 1;
        return;
    };
    if d.reason == pvsched_policy::event::R_EXITED {
        if let Some(t) = reg.threads.get_mut(&d.gid).filter(|t| t.tid == d.tid) {
            log::debug!("pvsched: registered thread {} exited or exec'd", d.tid);
            t.forget();
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

/// Handles every record waiting in the ring.
fn drain(inner: &Inner, ring: &mut aya::maps::RingBuf<aya::maps::MapData>, trace: &mut TraceOut) {
    while let Some(item) = ring.next() {
        if let Some(d) = Decision::from_bytes(&item) {
            handle(inner, &d);
            trace.record(&d);
        }
    }
}

pub(super) fn consumer(
    inner: Arc<Inner>,
    view: PolicyView,
    mut ring: aya::maps::RingBuf<aya::maps::MapData>,
    reeval_fd: OwnedFd,
    wake: OwnedFd,
    cfg: AgentConfig,
    mut trace: TraceOut,
) {
    if cfg.consumer_rt_prio > 0 {
        let attr = SchedAttr {
            policy: pvsched_abi::POLICY_FIFO,
            priority: cfg.consumer_rt_prio.min(crate::guardian::RESTORER_RT_PRIO),
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
    let mut ticks: u64 = 0;
    let mut last_tick = now_mono();
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
            // Between two ticks nothing ends a boost that ran past a cap
            // on a vCPU that produces no events: the longest gap is how
            // late the agent may have been.
            inner
                .tick_gap_max_ns
                .fetch_max(now.saturating_sub(last_tick), Ordering::Relaxed);
            last_tick = now;
            // Every thread of every active VM in one run of the policy,
            // which scans the VM ids up to the highest one in use.
            let scan = inner.reg.lock().vms.keys().max().map(|m| u64::from(*m) + 1);
            if let Some(scan) = scan
                && let Err(e) = reevaluate(
                    &reeval_fd,
                    pvsched_policy::event::EV_TICK,
                    pvsched_policy::event::GID_ALL,
                    pvsched_policy::event::NOW_CLOCK,
                    scan,
                    0,
                )
            {
                log::warn!("pvsched timer: BPF_PROG_TEST_RUN failed: {e}");
            }
            drain(&inner, &mut ring, &mut trace);
            ticks = ticks.wrapping_add(1);
            reconcile(&inner, &view, ticks.is_multiple_of(STATS_EVERY));
        }
    }
    // What is left of the trace (unregistration sends no records).
    drain(&inner, &mut ring, &mut trace);
}

/// A thread's gid, its boost and priority in the policy, and the tid the
/// policy holds for it (0 once it exited).
type PolicyBoost = (u32, u32, i32, u32);

/// Ticks between two reads of the policy's drop counter (a per-CPU map:
/// its read also reads the kernel's list of possible CPUs from sysfs).
/// Reconciliation itself runs every tick.
const STATS_EVERY: u64 = 20;

/// Level-triggered application: every tick, after the ring is drained,
/// brings each registered thread to the policy's current boost in the
/// `vcpus` map, so a decision record lost to a full ring (or a failed
/// syscall) can never leave a thread boosted past what the policy decided.
/// With `drops`, also reports records the ring dropped since the last
/// report.
fn reconcile(inner: &Inner, view: &PolicyView, drops: bool) {
    let gids: Vec<u32> = inner.reg.lock().threads.keys().copied().collect();
    // (gid, boost, boost_prio, the tid the policy holds) per thread.
    let states: Vec<PolicyBoost> = gids
        .iter()
        .filter_map(|&g| view.vcpu_boost(g).map(|(tid, b, p)| (g, b, p, tid)))
        .collect();
    let dropped = drops
        .then(|| view.stats().map(|s| s.dropped).ok())
        .flatten();
    if let Some(dropped) = dropped {
        let seen = inner.dropped_seen.swap(dropped, Ordering::Relaxed);
        if dropped > seen {
            log::warn!(
                "pvsched agent: the decision ring overflowed ({} records dropped, {dropped} in all); \
                 reconciling every thread with the policy's state",
                dropped - seen
            );
        }
    }
    let mut guard = inner.reg.lock();
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
                t.forget();
            }
            continue;
        }
        if t.reconcile(kind, prio, &vm.caps) {
            vm.corrections += 1;
        }
    }
}
