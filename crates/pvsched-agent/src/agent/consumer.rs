//! The consumer thread: drains the decision ring (blocking in epoll, never
//! spinning), applies each decision to its registered thread, queues it for
//! the trace, drives the policy timer and, every tick, reconciles every
//! thread with the policy's state; has the co-scheduler ([`super::cosched`])
//! move the vCPU threads of co-scheduling VMs at each phase's edge.

use super::cosched::Cosched;
use super::scan::ScanHandle;
use super::trace_out::TraceOut;
use super::{AgentConfig, Inner, owned_fd};
use crate::applier::Phase;
use crate::intf::{Decision, gid_vm};
use crate::object::{PolicyView, reevaluate};
use crate::sched::{self, SchedAttr};
use pvsched_policy::event::{R_HOST_DONE, R_HOST_WAKE};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Decision → applied latency samples kept per VM (a ring).
pub(super) const LAT_SAMPLES: usize = 8192;

use pvsched_util::mono_ns;

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
    if d.reason == R_HOST_WAKE || d.reason == R_HOST_DONE {
        // These records change no boost: the thread leaves its phase for
        // host threads waiting for its CPU, or none waits there any more
        // (for a thread whose boost gave way to them, too). One that
        // arrives after the phase's edge finds the thread in another phase
        // and changes nothing.
        let (from, to) = if d.reason == R_HOST_WAKE {
            (Phase::On, Phase::Yielded)
        } else {
            (Phase::Yielded, Phase::On)
        };
        if t.phase == from {
            t.set_phase(to, &vm.caps);
        } else if d.reason == R_HOST_DONE {
            t.host_threads_ran();
        }
        return;
    }
    vm.decisions += 1;
    if t.apply(d.kind, d.prio, d.reason, &vm.caps) {
        let lat = mono_ns().saturating_sub(d.ts);
        vm.apply_hist.observe(lat);
        if vm.latencies.len() < LAT_SAMPLES {
            vm.latencies.push(lat);
        } else {
            vm.latencies[vm.lat_next] = lat;
            vm.lat_next = (vm.lat_next + 1) % LAT_SAMPLES;
        }
    }
}

/// Handles every record waiting in the ring; returns how many there were.
fn drain(
    inner: &Inner,
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    trace: &mut TraceOut,
) -> usize {
    let mut n = 0;
    while let Some(item) = ring.next() {
        if let Some(d) = Decision::from_bytes(&item) {
            handle(inner, &d);
            trace.record(&d);
            n += 1;
        }
    }
    n
}

/// Whether anything a tick must end on time is under way: a registered
/// thread boosted (in the policy's state, or as last applied outside a
/// co-scheduled phase), throttled or held latency-sensitive. While nothing
/// is, the applier ticks at the quiet period. Co-scheduling alone needs no
/// tick: its edges come from the timer fd, the policy's records move a
/// thread out of its phase and back, and what a tick measures for it (the
/// sync gate's and the scan's windows) spans a second; it would otherwise
/// cost a tick every few milliseconds for as long as a VM co-schedules.
fn watched(inner: &Inner, view: &PolicyView, now: u64) -> bool {
    let reg = inner.reg.lock();
    reg.threads.iter().any(|(&gid, t)| {
        !t.exited
            && ((t.applied.is_some() && t.phase == Phase::Free)
                || t.decided.0 != pvsched_abi::BOOST_NONE
                || view
                    .vcpu_boost(gid)
                    .is_some_and(|(_, b, _)| b != pvsched_abi::BOOST_NONE)
                || view.vcpu_throttled(gid).unwrap_or(false)
                || view.vcpu_ls_until(gid).is_some_and(|u| u > now))
    })
}

/// What the applier thread reads from and writes to, its own.
pub(super) struct Ends {
    /// The policy's maps, read-only.
    pub view: PolicyView,
    /// The decision ring.
    pub ring: aya::maps::RingBuf<aya::maps::MapData>,
    /// The policy program run on each tick.
    pub reeval_fd: OwnedFd,
    /// Written to end the applier's wait ([`Inner::wake_applier`]).
    pub wake: OwnedFd,
    /// The decision trace.
    pub trace: TraceOut,
    /// The host-thread scan's windows ([`super::scan`]).
    pub scan: ScanHandle,
}

pub(super) fn consumer(inner: Arc<Inner>, ends: Ends, cfg: AgentConfig) {
    let Ends {
        view,
        mut ring,
        reeval_fd,
        wake,
        mut trace,
        scan,
    } = ends;
    inner.applier_tid.store(sched::gettid(), Ordering::Relaxed);
    if cfg.consumer_rt_prio > 0 {
        let attr = SchedAttr {
            policy: pvsched_abi::POLICY_FIFO,
            priority: cfg.consumer_rt_prio.min(crate::guardian::RESTORER_RT_PRIO),
            nice: 0,
            flags: 0,
            slice_ns: 0,
        };
        if let Err(e) = sched::set(sched::gettid(), &attr) {
            log::warn!("pvsched consumer stays SCHED_OTHER: {e}");
        }
    }
    // SAFETY: epoll_create1 takes no pointer; it returns a new fd or -1.
    let ep = match owned_fd(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }) {
        Ok(fd) => fd,
        Err(e) => {
            log::error!("pvsched consumer: epoll_create1 failed: {e}");
            return;
        }
    };
    // The co-scheduling edges: µs-exact, where epoll's own timeout is ms.
    let flags = libc::TFD_CLOEXEC | libc::TFD_NONBLOCK;
    // SAFETY: timerfd_create takes no pointer; it returns a new fd or -1.
    let tfd = match owned_fd(unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, flags) }) {
        Ok(fd) => fd,
        Err(e) => {
            log::error!("pvsched consumer: timerfd_create failed: {e}");
            return;
        }
    };
    for (fd, tag) in [
        (std::os::fd::AsRawFd::as_raw_fd(&ring), 1u64),
        (wake.as_raw_fd(), 2u64),
        (tfd.as_raw_fd(), 3u64),
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
    let quiet_ns = (cfg.quiet_tick.as_nanos() as u64).max(tick_ns);
    // The last tick found nothing to watch (`watched`): the next is
    // `quiet_ns` after it, unless something starts before then.
    let mut quiet = false;
    let mut next_tick = mono_ns() + tick_ns;
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 4];
    let mut ticks: u64 = 0;
    let mut last_tick = mono_ns();
    let mut cosched = Cosched::new(&cfg, scan);
    // Whether the last tick found a VM to tick; while none was there and
    // none is registered now, nothing is due until one registers (which
    // writes `wake`): a daemon that serves no VM takes no CPU.
    let mut ticked_vms = false;
    while !inner.stop.load(Ordering::SeqCst) {
        let idle = !ticked_vms && cosched.next_edge.is_none() && inner.reg.lock().vms.is_empty();
        // Rounded up, so the wait ends at or after the tick: rounded down
        // it ended once just before each tick and again just after it,
        // two wake-ups per tick.
        let wait_ms = if idle {
            -1
        } else {
            next_tick
                .saturating_sub(mono_ns())
                .div_ceil(1_000_000)
                .min(i32::MAX as u64) as i32
        };
        // SAFETY: evs is a valid buffer of 4 events.
        let n = unsafe {
            libc::epoll_wait(ep.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, wait_ms)
        };
        if inner.stop.load(Ordering::SeqCst) {
            break;
        }
        let decided = drain(&inner, &mut ring, &mut trace);
        let mut woken = false;
        for (tag, fd) in [(2, &wake), (3, &tfd)] {
            if evs[..n.max(0) as usize].iter().any(|e| e.u64 == tag) {
                woken |= tag == 2;
                let mut count = [0u8; 8];
                // SAFETY: reads at most 8 bytes into the buffer; both fds
                // are non-blocking, so one already read returns EAGAIN.
                unsafe { libc::read(fd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
            }
        }
        if cosched.next_edge.is_some_and(|e| mono_ns() >= e) {
            cosched.run(&inner, &tfd, &reeval_fd, false);
        }
        let now = mono_ns();
        if idle {
            // Woken from a wait with no end: the time spent there is not
            // lateness, and the first tick is due now.
            last_tick = now;
            next_tick = now;
        }
        if quiet && (decided > 0 || woken) {
            // Something started (a decision, a registration, new caps):
            // ticks come at `tick_ns` again from now, the first one now
            // for a registration or new caps (which a tick picks up), and
            // the quiet wait is not lateness.
            quiet = false;
            last_tick = now;
            next_tick = if woken {
                now
            } else {
                next_tick.min(now + tick_ns)
            };
        }
        if now >= next_tick {
            // Between two ticks nothing ends a boost that ran past a cap
            // on a vCPU that produces no events: the longest gap is how
            // late the agent may have been. After a quiet tick nothing
            // was boosted to end, so its wait is not lateness.
            if !quiet {
                inner
                    .tick_gap_max_ns
                    .fetch_max(now.saturating_sub(last_tick), Ordering::Relaxed);
            }
            last_tick = now;
            // Every thread of every active VM in one run of the policy,
            // which scans the VM ids up to the highest one in use.
            let scan = inner.reg.lock().vms.keys().max().map(|m| u64::from(*m) + 1);
            ticked_vms = scan.is_some();
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
            cosched.measure(&inner, &view, now);
            // A VM registered, unregistered or given new caps since the
            // last edge: its phases follow within a tick.
            cosched.run(&inner, &tfd, &reeval_fd, true);
            quiet = ticked_vms && !watched(&inner, &view, now);
            next_tick = now + if quiet { quiet_ns } else { tick_ns };
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
    let now = mono_ns();
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
        t.gave_way_expired(now);
        if t.reconcile(kind, prio, &vm.caps) {
            vm.corrections += 1;
        }
    }
}
