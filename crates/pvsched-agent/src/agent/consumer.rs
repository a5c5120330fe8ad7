//! The consumer thread: drains the decision ring (blocking in epoll, never
//! spinning), applies each decision to its registered thread, queues it for
//! the trace, drives the policy timer and, every tick, reconciles every
//! thread with the policy's state; moves the vCPU threads of co-scheduling
//! VMs between their phases at each phase's edge.

use super::fairshare::{self, AutoPhase, Window};
use super::gate::{self, SyncGate};
use super::scan::ScanHandle;
use super::trace_out::TraceOut;
use super::{AgentConfig, Inner, owned_fd};
use crate::applier::Phase;
use crate::intf::{Decision, gid_vm};
use crate::object::{PolicyView, RegionMmap, reevaluate};
use crate::sched::{self, SchedAttr};
use pvsched_policy::event::{R_HOST_DONE, R_HOST_WAKE};
use pvsched_policy::{Caps, CoschedUs};
use std::collections::HashMap;
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
        // host threads waiting for its CPU, or none waits there any more.
        // One that arrives after the phase's edge finds the thread in
        // another phase and changes nothing.
        let (from, to) = if d.reason == R_HOST_WAKE {
            (Phase::On, Phase::Yielded)
        } else {
            (Phase::Yielded, Phase::On)
        };
        if t.phase == from {
            t.set_phase(to, &vm.caps);
        }
        return;
    }
    vm.decisions += 1;
    if t.apply(d.kind, d.prio, d.reason, &vm.caps) {
        let lat = mono_ns().saturating_sub(d.ts);
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
    let mut cosched = Cosched {
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        // SAFETY: sysconf reads a system constant; no memory is passed.
        cpu_ids: u64::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) })
            .unwrap_or(0)
            .max(1),
        host_permille: u64::from(cfg.cosched_host_pct.min(100)) * 10,
        max_share: f64::from(cfg.cosched_max_pct.min(100)) / 100.0,
        max_phase_us: cfg.cosched_max_phase_us,
        scan: Some(scan),
        ..Cosched::default()
    };
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

/// The co-scheduling timer: when the next phase edge of any co-scheduling
/// VM is.
#[derive(Default)]
struct Cosched {
    /// Absolute `CLOCK_MONOTONIC` ns of the next edge, None when no VM
    /// co-schedules.
    next_edge: Option<u64>,
    /// The VMs that co-scheduled at the last run, with their phase then:
    /// a VM that stops (new caps) has its threads freed at the next run,
    /// and an edge visits only the threads of VMs whose phase changed.
    on_vms: Vec<(u32, Phase)>,
    /// The VMs left out for the host-wide limit, as last logged.
    left_out: Vec<u32>,
    /// CPUs the host gives this process.
    host_cpus: u64,
    /// CPU numbers the host may use (0 up to this): the CPUs whose records
    /// a phase's start checks for a host thread waiting there.
    cpu_ids: u64,
    /// The host-wide limit, per mille of the host's CPUs.
    host_permille: u64,
    /// The largest share of its period an "auto" VM's phase may hold.
    max_share: f64,
    /// The longest phase any VM holds, µs (`[max] max_cosched_phase_us`;
    /// each VM's `max_boost_us` bounds its own too).
    max_phase_us: u64,
    /// The "auto" VMs' phases: only of those whose gate is open.
    auto: HashMap<u32, AutoPhase>,
    /// Every "auto" VM's gate ([`gate`]): whether its guest's vCPUs wait
    /// for each other enough for a phase to serve them.
    gates: HashMap<u32, SyncGate>,
    /// The host-thread scan's windows ([`super::scan`]): taken, never
    /// waited for.
    scan: Option<ScanHandle>,
    /// VMs whose phase set as a number is cut to fit the host-wide limit,
    /// as last logged.
    cut: Vec<u32>,
}

impl Cosched {
    /// Moves every vCPU thread of every co-scheduling VM to its phase now
    /// and arms the timer fd for the next edge. The VMs that co-schedule
    /// take their phases one after another in VM-id order, each followed by
    /// an equal part of the time the phases leave free ([`Spread`]), so VMs
    /// with the same period and shares adding up to at most 100 % never
    /// hold the host's CPUs at the same time, nor for longer than one phase
    /// in a row. Only the co-scheduling VMs' threads are visited: with
    /// `all` (every tick: new threads, changed caps, a failed system call)
    /// every one of them, else those of the VMs whose phase changed.
    ///
    /// A VM whose phase starts is then checked by the policy
    /// ([`EV_PHASE_ON`](pvsched_policy::event::EV_PHASE_ON)): a vCPU that was
    /// already running on its CPU took no context switch, so a host thread
    /// woken there before the phase and still waiting is found only so.
    fn run(&mut self, inner: &Inner, tfd: &OwnedFd, reeval_fd: &OwnedFd, all: bool) {
        let now = mono_ns();
        let mut guard = inner.reg.lock();
        let reg = &mut *guard;
        let mut ids: Vec<u32> = reg
            .vms
            .iter()
            .filter(|(id, v)| v.caps.cosched_us.is_on() || self.on_vms.iter().any(|o| o.0 == **id))
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            self.next_edge = None;
            return;
        }
        ids.sort_unstable();
        let now_us = now / 1000;
        // Each VM's phase as asked, then what fits in the host-wide limit
        // (fit_phases), before any phase is placed: the gaps between the
        // phases need their sum.
        let mut asks: Vec<Ask> = Vec::with_capacity(ids.len());
        for id in ids {
            let Some(vm) = reg.vms.get(&id) else {
                continue;
            };
            let period = vm.caps.cosched_period_us;
            // A phase is one continuous FIFO run: never longer than the
            // operator's limit and the VM's max_boost_us. pvschedd refuses
            // a number above them; "auto" is held to them here, and so is a
            // number from a caller that did not check it.
            let longest = self.phase_max_us(&vm.caps);
            let (on_us, auto) = match vm.caps.cosched_us {
                CoschedUs::Us(us) => (us.min(longest), false),
                CoschedUs::Auto => (
                    self.auto.get(&id).map_or(0, |a| {
                        ((a.share * period as f64).round().clamp(0.0, period as f64) as u64)
                            .min(longest)
                    }),
                    true,
                ),
            };
            // What the VM's phase holds of the host: its vCPUs (at most one
            // per CPU run at once) for on / period of the time, rounded up
            // so that phases fitted by these figures never hold more.
            let cpus = u64::from(vm.vcpus).min(self.host_cpus).max(1);
            let permille = on_us
                .saturating_mul(1000)
                .saturating_mul(cpus)
                .div_ceil(period.max(1).saturating_mul(self.host_cpus.max(1)));
            asks.push(Ask {
                id,
                on_us,
                permille,
                auto,
            });
        }
        let fitted = fit_phases(&asks, self.host_permille);
        let left_out: Vec<u32> = asks
            .iter()
            .zip(&fitted)
            .filter(|(a, on)| a.on_us > 0 && **on == 0)
            .map(|(a, _)| a.id)
            .collect();
        let cut: Vec<u32> = asks
            .iter()
            .zip(&fitted)
            .filter(|(a, on)| !a.auto && **on > 0 && **on < a.on_us)
            .map(|(a, _)| a.id)
            .collect();
        // (VM id, its phase as placed: 0 for none.)
        let plan: Vec<(u32, u64)> = asks.iter().map(|a| a.id).zip(fitted).collect();
        let placed: Vec<u64> = plan.iter().map(|p| p.1).filter(|on| *on > 0).collect();
        let spread = Spread::new(&placed);
        let mut offset_us: u64 = 0;
        let mut next: Option<u64> = None;
        let mut on_vms = Vec::with_capacity(plan.len());
        let mut entered = Vec::new();
        for (id, on) in plan {
            let placed = on > 0;
            let Some(vm) = reg.vms.get_mut(&id) else {
                continue;
            };
            let period = vm.caps.cosched_period_us;
            vm.cosched_now_us = on;
            let phase = if !placed {
                Phase::Free
            } else {
                let (phase, edge_in_us) = phase_at(now_us, offset_us, on, period);
                offset_us = offset_us
                    .saturating_add(on)
                    .saturating_add(spread.gap_us(period));
                let edge = now.saturating_add(edge_in_us.saturating_mul(1000));
                next = Some(next.map_or(edge, |n| n.min(edge)));
                on_vms.push((id, phase));
                phase
            };
            let was = self.on_vms.iter().find(|o| o.0 == id).map(|o| o.1);
            if !all && was == Some(phase) {
                continue;
            }
            if phase == Phase::On && was != Some(Phase::On) {
                entered.push(id);
            }
            // A VM with more vCPUs than the host has CPUs: the first vCPUs
            // put at FIFO take the CPUs and keep them until they halt (FIFO
            // has no time slice), so each period starts with the next one.
            let first = if vm.vcpus > 0 && u64::from(vm.vcpus) > self.host_cpus {
                ((now_us / period.max(1)) % u64::from(vm.vcpus)) as u32
            } else {
                0
            };
            for n in 0..vm.threads {
                let index = if n < vm.vcpus {
                    (n + first) % vm.vcpus
                } else {
                    n
                };
                if let Some(t) = reg.threads.get_mut(&crate::intf::gid(id, index)) {
                    let p = if index < vm.vcpus { phase } else { Phase::Free };
                    // A thread out of the phase for a host thread comes
                    // back when that thread leaves its CPU or at the edge,
                    // not at a tick within the phase.
                    if !(was == Some(phase) && p == Phase::On && t.phase == Phase::Yielded) {
                        t.set_phase(p, &vm.caps);
                    }
                }
            }
        }
        drop(guard);
        for id in entered {
            if let Err(e) = reevaluate(
                reeval_fd,
                pvsched_policy::event::EV_PHASE_ON,
                crate::intf::gid(id, 0),
                pvsched_policy::event::NOW_CLOCK,
                self.cpu_ids,
                0,
            ) {
                log::warn!("pvsched: phase start of VM {id}: BPF_PROG_TEST_RUN failed: {e}");
            }
        }
        if left_out != self.left_out {
            if !left_out.is_empty() {
                log::warn!(
                    "pvsched: VM id(s) {left_out:?} not co-scheduled: their phases, cut to \
                     fit {} % of the host's CPUs ([max] max_cosched_host_pct), would be \
                     shorter than {MIN_FITTED_US} µs",
                    self.host_permille / 10
                );
            }
            self.left_out = left_out;
        }
        if cut != self.cut {
            if !cut.is_empty() {
                log::warn!(
                    "pvsched: VM id(s) {cut:?}: co-scheduled phases cut, each in the same \
                     proportion, to fit {} % of the host's CPUs ([max] max_cosched_host_pct)",
                    self.host_permille / 10
                );
            }
            self.cut = cut;
        }
        self.on_vms = on_vms;
        self.next_edge = next;
        let at = next.unwrap_or(0);
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (at / 1_000_000_000) as libc::time_t,
                tv_nsec: (at % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: a valid timer fd and itimerspec; no old value wanted. An
        // all-zero value disarms the timer.
        let rc = unsafe {
            libc::timerfd_settime(
                tfd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if rc != 0 {
            log::warn!(
                "pvsched consumer: timerfd_settime failed: {}; co-scheduling edges \
                 follow the 5 ms tick",
                io::Error::last_os_error()
            );
        }
    }
}

impl Cosched {
    /// The longest phase a VM with `caps` holds, µs ([`Caps::cosched_phase_max_us`]).
    fn phase_max_us(&self, caps: &Caps) -> u64 {
        pvsched_policy::caps::cosched_phase_max_us(self.max_phase_us, caps.max_boost_us)
    }

    /// Every tick: opens or closes each "auto" VM's gate from what its
    /// guest counts ([`gate`]), ends the phase of an "auto" VM that has
    /// become latency-sensitive and, once the scan thread has a measuring
    /// window ([`super::scan`]), sets the share of every "auto" VM whose
    /// gate is open from it ([`fairshare`]). Reads no file and never waits
    /// for the scan: its work is a binary search per "auto" vCPU thread
    /// and a read of each "auto" VM's slots.
    fn measure(&mut self, inner: &Inner, view: &PolicyView, now: u64) {
        // (VM id, its live vCPU threads' (gid, tid), halt_always, the
        // largest share of its period its phase may hold, its device
        // region, its vCPUs).
        type AutoSpec = (
            u32,
            Vec<(u32, u32)>,
            bool,
            f64,
            Option<Arc<RegionMmap>>,
            u32,
        );
        let autos: Vec<AutoSpec> = {
            let reg = inner.reg.lock();
            reg.vms
                .iter()
                .filter(|(_, v)| v.caps.cosched_us == CoschedUs::Auto)
                .map(|(id, v)| {
                    let threads = (0..v.vcpus)
                        .filter_map(|i| {
                            let g = crate::intf::gid(*id, i);
                            reg.threads
                                .get(&g)
                                .filter(|t| !t.exited)
                                .map(|t| (g, t.tid))
                        })
                        .collect();
                    let period = v.caps.cosched_period_us.max(1) as f64;
                    let max_share = self
                        .max_share
                        .min(self.phase_max_us(&v.caps) as f64 / period);
                    (
                        *id,
                        threads,
                        v.caps.halt_always,
                        max_share,
                        v.region.clone(),
                        v.vcpus,
                    )
                })
                .collect()
        };
        self.gates.retain(|id, _| autos.iter().any(|a| a.0 == *id));
        let mut rates = Vec::with_capacity(autos.len());
        for (id, .., region, vcpus) in &autos {
            let counts = region
                .as_ref()
                .and_then(|r| gate::guest_counts(&r.words(), *vcpus));
            let g = self.gates.entry(*id).or_default();
            let (was, windows) = (g.on(), g.windows());
            let on = g.update(counts, now, *vcpus);
            if g.windows() != windows {
                // Every window's score, for a benchmark that explains which
                // VM got phases when (RUST_LOG=pvsched_agent=debug).
                log::debug!(
                    "pvsched cosched gate: VM {id}: {:.1} per vCPU and second, {}",
                    g.rate(),
                    if on { "on" } else { "off" }
                );
            }
            if on != was {
                log::info!(
                    "pvsched cosched auto: VM {id}: {} ({:.1} waits and cross-vCPU \
                     wake-ups per vCPU and second)",
                    if on {
                        "co-scheduled"
                    } else {
                        "no longer co-scheduled"
                    },
                    g.rate()
                );
            }
            rates.push((*id, g.reported_rate()));
        }
        {
            let mut reg = inner.reg.lock();
            for (id, v) in reg.vms.iter_mut() {
                v.sync_rate = rates.iter().find(|r| r.0 == *id).and_then(|r| r.1);
            }
        }
        // A VM whose gate is closed holds no phase, and starts afresh when
        // it opens.
        let autos: Vec<AutoSpec> = autos
            .into_iter()
            .filter(|a| self.gates.get(&a.0).is_some_and(SyncGate::on))
            .collect();
        self.auto.retain(|id, _| autos.iter().any(|a| a.0 == *id));
        let Some(scan) = &self.scan else {
            return;
        };
        scan.want(!autos.is_empty());
        if autos.is_empty() {
            return;
        }
        // Each "auto" VM: some vCPU latency-sensitive now.
        let ls: Vec<bool> = autos
            .iter()
            .map(|(_, threads, always, ..)| {
                *always
                    || threads
                        .iter()
                        .any(|(g, _)| view.vcpu_ls_until(*g).is_some_and(|until| until > now))
            })
            .collect();
        // A guest that starts an RT task leaves its phase at once, not at
        // the end of the window (the off part would hold its wake-ups),
        // and an RT task seen at any tick starts the cool-down.
        for ((id, ..), _) in autos.iter().zip(&ls).filter(|(_, ls)| **ls) {
            self.auto.entry(*id).or_default().latency_sensitive();
        }
        let Some(host) = scan.take() else {
            return;
        };
        for ((id, threads, _, max_share, ..), ls) in autos.iter().zip(ls) {
            let phase = self.auto.entry(*id).or_default();
            if !host.complete {
                // Figures of part of the host: the share stays as it was.
                let share = phase.incomplete();
                log::debug!("pvsched cosched auto: VM {id}: incomplete window: share {share:.3}");
                continue;
            }
            // Only threads read at both ends of the window count.
            let (mut owed, mut got, mut contended) = (0.0f64, 0.0f64, false);
            for (_, tid) in threads {
                if let Ok(i) = host.threads.binary_search_by_key(tid, |t| t.0) {
                    let (_, ran, runnable) = host.threads[i];
                    owed += fairshare::demand(ran, runnable, host.heavy_ran).min(host.level);
                    got += ran;
                    contended |= fairshare::is_heavy(ran, runnable, host.heavy_ran);
                }
            }
            let w = Window {
                host_demand: host.host_demand,
                host_cpus: u32::try_from(self.host_cpus).unwrap_or(u32::MAX),
                owed,
                got,
                vcpus: u32::try_from(threads.len()).unwrap_or(u32::MAX),
                latency_sensitive: ls,
                contended,
            };
            let share = phase.update(&w, *max_share);
            log::debug!(
                "pvsched cosched auto: VM {id}: level {:.3}, {w:?}: share {share:.3}",
                host.level
            );
        }
    }
}

/// One co-scheduling VM's phase as its caps ask for it.
#[derive(Clone, Debug)]
struct Ask {
    id: u32,
    /// The phase, µs of its period (0: none now).
    on_us: u64,
    /// What the phase holds of the host's CPUs, per mille, rounded up
    /// (at least 1 for a phase): a part of the phase holds that part of it.
    permille: u64,
    /// Set by "auto" (the measured fair share), not by a number.
    auto: bool,
}

/// The shortest phase worth its two changes a period, µs: a phase cut
/// below it (or below what it asked, if that is less) is not placed.
const MIN_FITTED_US: u64 = 1000;

/// The phase each VM gets (µs; 0: not co-scheduled), in the asks' order,
/// so that together they hold at most `limit_permille` of the host. The
/// phases set as numbers (the operator's) come first: when together they
/// do not fit, each is cut in the same proportion; the "auto" phases
/// share what those leave, cut the same way. What a VM gets depends on
/// what all the VMs ask, never on its id or on when it registered: fitted
/// whole in VM-id order, the first VMs to register took the host-wide
/// room and left the later ones none. Cutting keeps every VM running its
/// vCPUs together for part of its phase and leaves the rest to the host:
/// two 2-vCPU "auto" VMs on 2 CPUs with nothing else to run are owed half
/// the host each, 100 % together against the default 80 % limit, and get
/// 8 ms of every 20 each.
fn fit_phases(asks: &[Ask], limit_permille: u64) -> Vec<u64> {
    let mut out = vec![0u64; asks.len()];
    let fixed = cut_to_fit(asks, false, limit_permille, &mut out);
    cut_to_fit(asks, true, limit_permille.saturating_sub(fixed), &mut out);
    out
}

/// Fits the phases of the asks whose `auto` is `auto` in `room` per mille
/// (into `out`): whole if they all fit, else each cut in proportion,
/// rounded down. Returns what the placed ones hold, per mille, rounded up.
fn cut_to_fit(asks: &[Ask], auto: bool, room: u64, out: &mut [u64]) -> u64 {
    let mine = |a: &&Ask| a.auto == auto && a.on_us > 0;
    let want = asks
        .iter()
        .filter(mine)
        .fold(0u64, |n, a| n.saturating_add(a.permille));
    let mut held = 0u64;
    for (i, a) in asks.iter().enumerate() {
        if !mine(&a) {
            continue;
        }
        let on = if want <= room {
            a.on_us
        } else {
            (u128::from(a.on_us) * u128::from(room) / u128::from(want.max(1))) as u64
        };
        if on > 0 && on >= MIN_FITTED_US.min(a.on_us) {
            out[i] = on;
            let part = (u128::from(a.permille) * u128::from(on)).div_ceil(u128::from(a.on_us));
            held = held.saturating_add(u64::try_from(part).unwrap_or(u64::MAX));
        }
    }
    held
}

/// How the co-scheduled phases of several VMs are laid out in their
/// period: one after another, each followed by an equal part of what the
/// phases leave free. Back to back, two VMs' phases would hold the host's
/// CPUs for both their lengths in a row, and an ordinary host thread that
/// wakes at the start of the first would wait for the end of the second;
/// spread out, it waits at most one phase, for the same phase changes.
struct Spread {
    /// The placed VMs' phases, µs, summed.
    total_us: u64,
    /// How many VMs have a phase.
    count: u64,
}

impl Spread {
    fn new(on_us: &[u64]) -> Self {
        Spread {
            total_us: on_us.iter().fold(0u64, |a, b| a.saturating_add(*b)),
            count: on_us.len() as u64,
        }
    }

    /// The free time after each phase of a VM with this period: an equal
    /// part of what the phases leave of it (VMs with the same period fill
    /// it exactly; with mixed periods the layout is each VM's own).
    fn gap_us(&self, period_us: u64) -> u64 {
        period_us.saturating_sub(self.total_us) / self.count.max(1)
    }
}

/// The phase at `now_us` of a VM whose co-scheduled phase is `on_us` of
/// every `period_us`, starting `offset_us` into the period, and how many µs
/// until its next edge (at least 1).
fn phase_at(now_us: u64, offset_us: u64, on_us: u64, period_us: u64) -> (Phase, u64) {
    let period = period_us.max(1);
    let pos = (now_us % period + period - offset_us % period) % period;
    if on_us >= period {
        (Phase::On, period)
    } else if pos < on_us {
        (Phase::On, (on_us - pos).max(1))
    } else {
        (Phase::Off, (period - pos).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_follow_the_period_and_their_offset() {
        // 10 ms of every 20, starting at 0: on at 0..10 ms, off at 10..20.
        assert_eq!(phase_at(0, 0, 10_000, 20_000), (Phase::On, 10_000));
        assert_eq!(phase_at(9_999, 0, 10_000, 20_000), (Phase::On, 1));
        assert_eq!(phase_at(10_000, 0, 10_000, 20_000), (Phase::Off, 10_000));
        assert_eq!(phase_at(39_999, 0, 10_000, 20_000), (Phase::Off, 1));
        // The second VM's phase starts where the first one's ended.
        assert_eq!(phase_at(10_000, 10_000, 5_000, 20_000), (Phase::On, 5_000));
        assert_eq!(phase_at(5_000, 10_000, 5_000, 20_000), (Phase::Off, 5_000));
        // An offset past the period wraps.
        assert_eq!(
            phase_at(10_000, 30_000, 5_000, 20_000),
            phase_at(10_000, 10_000, 5_000, 20_000)
        );
        // The whole period: always on.
        assert_eq!(phase_at(123, 0, 20_000, 20_000).0, Phase::On);
    }

    fn ask(id: u32, on_us: u64, permille: u64, auto: bool) -> Ask {
        Ask {
            id,
            on_us,
            permille,
            auto,
        }
    }

    #[test]
    fn phases_are_cut_in_proportion_to_fit_the_host_limit() {
        // Two 2-vCPU "auto" VMs owed half the host each (10 ms of 20 on 2
        // CPUs: 500 per mille each) under the 80 % limit: both cut to 8 ms,
        // where the second used to be left out.
        let two = [ask(0, 10_000, 500, true), ask(1, 10_000, 500, true)];
        assert_eq!(fit_phases(&two, 800), vec![8_000, 8_000]);
        // Within the limit: as asked.
        assert_eq!(fit_phases(&two, 1000), vec![10_000, 10_000]);
        // The same with numbers: the second VM is no longer left out
        // because the first registered first.
        let fixed = [ask(0, 10_000, 500, false), ask(1, 10_000, 500, false)];
        assert_eq!(fit_phases(&fixed, 800), vec![8_000, 8_000]);
        // Numbers come first, cut in proportion; "auto" ones share the
        // rest in proportion to what they ask.
        let mixed = [
            ask(0, 8_000, 400, false),
            ask(1, 2_000, 100, false),
            ask(2, 6_000, 300, true),
            ask(3, 2_000, 100, true),
        ];
        assert_eq!(fit_phases(&mixed, 900), vec![8_000, 2_000, 6_000, 2_000]);
        assert_eq!(fit_phases(&mixed, 700), vec![8_000, 2_000, 3_000, 1_000]);
        assert_eq!(fit_phases(&mixed, 400), vec![6_400, 1_600, 0, 0]);
        // A phase cut below 1 ms is not placed; one that asked for less
        // than that and fits keeps it.
        assert_eq!(fit_phases(&mixed, 520), vec![8_000, 2_000, 0, 0]);
        assert_eq!(fit_phases(&mixed, 100), vec![1_600, 0, 0, 0]);
        let small = [ask(0, 500, 25, true), ask(1, 500, 25, false)];
        assert_eq!(fit_phases(&small, 800), vec![500, 500]);
        // No room at all; nothing asked.
        assert_eq!(fit_phases(&two, 0), vec![0, 0]);
        assert_eq!(fit_phases(&fixed, 0), vec![0, 0]);
        assert_eq!(fit_phases(&[ask(0, 0, 0, true)], 800), vec![0]);
    }

    /// What the fitted phases hold of the host, per mille, exactly: each
    /// placed part of a phase holds that part of its ask.
    fn held(asks: &[Ask], fitted: &[u64]) -> f64 {
        asks.iter()
            .zip(fitted)
            .filter(|(a, _)| a.on_us > 0)
            .map(|(a, on)| a.permille as f64 * *on as f64 / a.on_us as f64)
            .sum()
    }

    proptest::proptest! {
        /// Whatever VMs ask (fixed or "auto", any period and width on up
        /// to 8 CPUs), the fitted phases hold at most the limit, none is
        /// longer than asked, a phase that fits with all the others runs
        /// whole, and what each VM gets does not depend on the order of
        /// the asks (VM id, registration order).
        #[test]
        fn fitted_phases_stay_within_the_limit_whatever_the_order(
            vms in proptest::collection::vec(
                (0u64..=20_000, 1_000u64..=100_000, 1u64..=8, proptest::bool::ANY),
                0..12,
            ),
            limit in 0u64..=1000,
            rotate in 0usize..12,
        ) {
            let host = 8u64;
            let asks: Vec<Ask> = vms
                .iter()
                .enumerate()
                .map(|(i, &(on, period, vcpus, auto))| {
                    let on = on.min(period);
                    let cpus = vcpus.min(host);
                    let permille = (on * 1000 * cpus).div_ceil(period * host);
                    ask(i as u32, on, permille, auto)
                })
                .collect();
            let fitted = fit_phases(&asks, limit);
            proptest::prop_assert!(held(&asks, &fitted) <= limit as f64 + 1e-6);
            for (a, on) in asks.iter().zip(&fitted) {
                proptest::prop_assert!(*on <= a.on_us);
            }
            let want: u64 = asks.iter().map(|a| a.permille).sum();
            if want <= limit {
                let asked: Vec<u64> = asks.iter().map(|a| a.on_us).collect();
                proptest::prop_assert_eq!(&fitted, &asked);
            }
            // The same asks in another order: each VM gets the same.
            let mut other = asks.clone();
            other.reverse();
            let n = other.len().max(1);
            other.rotate_left(rotate % n);
            let refit = fit_phases(&other, limit);
            for (a, on) in other.iter().zip(&refit) {
                proptest::prop_assert_eq!(*on, fitted[a.id as usize], "VM {}", a.id);
            }
        }
    }

    #[test]
    fn several_vms_phases_are_spread_over_the_period() {
        // Two VMs owed a third of the period each: each phase is followed
        // by half of the third left free, so the host's threads get a CPU
        // after at most one phase (6.7 ms), not after both (13.3 ms).
        let spread = Spread::new(&[6_666, 6_666]);
        assert_eq!(spread.gap_us(20_000), 3_334);
        let second = 6_666 + spread.gap_us(20_000);
        assert_eq!(phase_at(0, 0, 6_666, 20_000), (Phase::On, 6_666));
        assert_eq!(phase_at(6_666, 0, 6_666, 20_000), (Phase::Off, 13_334));
        assert_eq!(phase_at(6_666, second, 6_666, 20_000), (Phase::Off, 3_334));
        assert_eq!(phase_at(10_000, second, 6_666, 20_000), (Phase::On, 6_666));
        assert_eq!(
            phase_at(16_666, second, 6_666, 20_000),
            (Phase::Off, 13_334)
        );
        // One VM: nothing to spread. Phases that fill the period: no gap.
        assert_eq!(Spread::new(&[10_000]).gap_us(20_000), 10_000);
        assert_eq!(Spread::new(&[10_000, 10_000]).gap_us(20_000), 0);
        // Phases adding up to more than a period (mixed periods): no gap.
        assert_eq!(Spread::new(&[15_000, 10_000]).gap_us(20_000), 0);
        assert_eq!(Spread::new(&[]).gap_us(20_000), 20_000);
    }
}
