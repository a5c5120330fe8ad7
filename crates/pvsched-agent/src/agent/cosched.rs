//! Co-scheduling: which VMs' vCPU threads run together, when, and for how
//! long. [`plan`] is the planner, a pure function of what each VM asks
//! and of the host (its CPUs and the host-wide limit); [`Cosched`] feeds it
//! from the registry, the sync gates ([`super::gate`]) and the fair shares
//! ([`super::fairshare`]), moves the threads to their phases and arms the
//! timer for the next edge. The applier thread runs all of it.

use super::Inner;
use super::fairshare::{self, AutoPhase, Window};
use super::gate::{self, SyncGate};
use super::scan::ScanHandle;
use super::width::Widths;
use crate::applier::Phase;
use crate::object::{PolicyView, RegionMmap, reevaluate};
use pvsched_policy::{Caps, CoschedUs};
use pvsched_util::mono_ns;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// The co-scheduling timer: when the next phase edge of any co-scheduling
/// VM is.
#[derive(Default)]
pub(super) struct Cosched {
    /// Absolute `CLOCK_MONOTONIC` ns of the next edge, None when no VM
    /// co-schedules.
    pub(super) next_edge: Option<u64>,
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
    /// Every VM's width ([`super::width`]): a VM with more vCPUs than the
    /// CPUs they may run on gets no "auto" phase.
    widths: Widths,
}

impl Cosched {
    /// The co-scheduler of an agent with `cfg`, its host-thread scan
    /// `scan`.
    pub(super) fn new(cfg: &super::AgentConfig, scan: ScanHandle) -> Self {
        Cosched {
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
        }
    }

    /// Moves every vCPU thread of every co-scheduling VM to its phase now,
    /// as [`plan`] places it, and arms the timer fd for the next edge.
    /// Only the co-scheduling VMs' threads are visited: with `all` (every
    /// tick: new threads, changed caps, a failed system call) every one of
    /// them, else those of the VMs whose phase changed.
    ///
    /// A VM whose phase starts is then checked by the policy
    /// ([`EV_PHASE_ON`](pvsched_policy::event::EV_PHASE_ON)): a vCPU that was
    /// already running on its CPU took no context switch, so a host thread
    /// woken there before the phase and still waiting is found only so.
    pub(super) fn run(&mut self, inner: &Inner, tfd: &OwnedFd, reeval_fd: &OwnedFd, all: bool) {
        let now = mono_ns();
        let mut guard = inner.reg.lock();
        let reg = &mut *guard;
        let vms: Vec<PlanVm> = reg
            .vms
            .iter()
            .filter(|(id, v)| v.caps.cosched_us.is_on() || self.on_vms.iter().any(|o| o.0 == **id))
            .map(|(&id, vm)| {
                let period = vm.caps.cosched_period_us;
                // A phase is one continuous FIFO run: never longer than the
                // operator's limit and the VM's max_boost_us. pvschedd
                // refuses a number above them; "auto" is held to them here,
                // and so is a number from a caller that did not check it.
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
                PlanVm {
                    id,
                    vcpus: vm.vcpus,
                    period_us: period,
                    on_us,
                    auto,
                }
            })
            .collect();
        if vms.is_empty() {
            self.next_edge = None;
            return;
        }
        let Plan {
            vms: placed,
            left_out,
            cut,
        } = plan(&vms, now / 1000, self.host_cpus, self.host_permille);
        let mut next: Option<u64> = None;
        let mut on_vms = Vec::with_capacity(placed.len());
        let mut entered = Vec::new();
        for p in &placed {
            let Some(vm) = reg.vms.get_mut(&p.id) else {
                continue;
            };
            vm.cosched_now_us = p.on_us;
            if let Some(edge_in_us) = p.edge_in_us {
                let edge = now.saturating_add(edge_in_us.saturating_mul(1000));
                next = Some(next.map_or(edge, |n| n.min(edge)));
                on_vms.push((p.id, p.phase));
            }
            let was = self.on_vms.iter().find(|o| o.0 == p.id).map(|o| o.1);
            if !all && was == Some(p.phase) {
                continue;
            }
            if p.phase == Phase::On && was != Some(Phase::On) {
                entered.push(p.id);
            }
            for n in 0..vm.threads {
                let index = if n < vm.vcpus {
                    (n + p.first_vcpu) % vm.vcpus
                } else {
                    n
                };
                if let Some(t) = reg.threads.get_mut(&crate::intf::gid(p.id, index)) {
                    let to = if index < vm.vcpus {
                        p.phase
                    } else {
                        Phase::Free
                    };
                    // A thread out of the phase for a host thread comes
                    // back when that thread leaves its CPU or at the edge,
                    // not at a tick within the phase.
                    if !(was == Some(p.phase) && to == Phase::On && t.phase == Phase::Yielded) {
                        t.set_phase(to, &vm.caps);
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
                     fit {} % of the host's CPUs ([cosched] host_pct), would be \
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
                     proportion, to fit {} % of the host's CPUs ([cosched] host_pct)",
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
    pub(super) fn measure(&mut self, inner: &Inner, view: &PolicyView, now: u64) {
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
                    let threads = reg.live_vcpus(*id, v.vcpus);
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
        self.widths.update(
            inner,
            view,
            now,
            u32::try_from(self.cpu_ids).unwrap_or(u32::MAX),
        );
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
                // VM got phases when (RUST_LOG=pvsched_agent::agent::cosched=debug).
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
        // A VM whose gate is closed, or wider than its CPUs, holds no
        // phase, and starts afresh when it may.
        let autos: Vec<AutoSpec> = autos
            .into_iter()
            .filter(|a| self.gates.get(&a.0).is_some_and(SyncGate::on))
            .filter(|a| !self.widths.too_wide(a.0, a.5))
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

/// One co-scheduling VM as [`plan`] sees it.
#[derive(Clone, Debug)]
pub(super) struct PlanVm {
    /// Its VM id: the order its phases take in each period.
    pub id: u32,
    /// Its vCPUs.
    pub vcpus: u32,
    /// Its `cosched_period_us`.
    pub period_us: u64,
    /// The phase it asks for, µs of its period, within its caps (0: none
    /// now).
    pub on_us: u64,
    /// Set by "auto" (the measured fair share), not by a number.
    pub auto: bool,
}

/// What [`plan`] gives one VM now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Placement {
    /// The VM id.
    pub id: u32,
    /// Its phase, µs of its period (0: none: its threads are free).
    pub on_us: u64,
    /// Where its vCPUs are now ([`Phase::Free`] without a phase).
    pub phase: Phase,
    /// µs from now to its next edge (None without a phase).
    pub edge_in_us: Option<u64>,
    /// The vCPU put at FIFO first in this period: a VM with more vCPUs
    /// than the host has CPUs starts each period with the next one.
    pub first_vcpu: u32,
}

/// Every co-scheduling VM's placement, and which the host-wide limit
/// changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// One per VM, in VM-id order.
    pub vms: Vec<Placement>,
    /// VMs that asked for a phase and got none (cut below
    /// [`MIN_FITTED_US`]).
    pub left_out: Vec<u32>,
    /// VMs whose phase set as a number was cut to fit.
    pub cut: Vec<u32>,
}

/// The planner: where every co-scheduling VM's phase is at `now_us`, on a
/// host of `host_cpus` CPUs whose phases together may hold
/// `limit_permille` of it. Each VM's phase is first fitted into the limit
/// ([`fit_phases`]), then the phases take their turns in VM-id order, each
/// followed by an equal part of the time the phases leave free
/// ([`Spread`]): VMs with the same period whose phases add up to at most
/// the period never hold the host's CPUs at the same time, and a host
/// thread waits at most one phase, not all of them in a row. A pure
/// function of its arguments, so that its properties can be tested.
pub(super) fn plan(vms: &[PlanVm], now_us: u64, host_cpus: u64, limit_permille: u64) -> Plan {
    let mut vms: Vec<&PlanVm> = vms.iter().collect();
    vms.sort_by_key(|v| v.id);
    let host_cpus = host_cpus.max(1);
    // What each VM's phase holds of the host: its vCPUs (at most one per
    // CPU run at once) for on / period of the time, rounded up so that
    // phases fitted by these figures never hold more.
    let asks: Vec<Ask> = vms
        .iter()
        .map(|v| {
            let cpus = u64::from(v.vcpus).min(host_cpus).max(1);
            let permille = v
                .on_us
                .saturating_mul(1000)
                .saturating_mul(cpus)
                .div_ceil(v.period_us.max(1).saturating_mul(host_cpus));
            Ask {
                id: v.id,
                on_us: v.on_us,
                permille,
                auto: v.auto,
            }
        })
        .collect();
    let fitted = fit_phases(&asks, limit_permille);
    let left_out = asks
        .iter()
        .zip(&fitted)
        .filter(|(a, on)| a.on_us > 0 && **on == 0)
        .map(|(a, _)| a.id)
        .collect();
    let cut = asks
        .iter()
        .zip(&fitted)
        .filter(|(a, on)| !a.auto && **on > 0 && **on < a.on_us)
        .map(|(a, _)| a.id)
        .collect();
    let placed: Vec<u64> = fitted.iter().copied().filter(|on| *on > 0).collect();
    let spread = Spread::new(&placed);
    let mut offset_us: u64 = 0;
    let vms = vms
        .iter()
        .zip(fitted)
        .map(|(v, on)| {
            let period = v.period_us.max(1);
            if on == 0 {
                return Placement {
                    id: v.id,
                    on_us: 0,
                    phase: Phase::Free,
                    edge_in_us: None,
                    first_vcpu: 0,
                };
            }
            let (phase, edge_in_us) = phase_at(now_us, offset_us, on, period);
            offset_us = offset_us
                .saturating_add(on)
                .saturating_add(spread.gap_us(period));
            // The first vCPUs put at FIFO take the CPUs and keep them until
            // they halt (FIFO has no time slice).
            let first_vcpu = if v.vcpus > 0 && u64::from(v.vcpus) > host_cpus {
                ((now_us / period) % u64::from(v.vcpus)) as u32
            } else {
                0
            };
            Placement {
                id: v.id,
                on_us: on,
                phase,
                edge_in_us: Some(edge_in_us),
                first_vcpu,
            }
        })
        .collect();
    Plan { vms, left_out, cut }
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

    /// Any mix of VMs on a host of 1 to 8 CPUs.
    fn plan_vms() -> impl proptest::strategy::Strategy<Value = (Vec<PlanVm>, u64)> {
        use proptest::prelude::*;
        (
            proptest::collection::vec(
                (0u64..=20_000, 1u32..=12, proptest::bool::ANY, 0u32..1000),
                0..8,
            ),
            1u64..=8,
        )
            .prop_map(|(vms, host)| {
                let mut seen = std::collections::HashSet::new();
                let vms = vms
                    .into_iter()
                    .filter(|v| seen.insert(v.3))
                    .map(|(on, vcpus, auto, id)| PlanVm {
                        id,
                        vcpus,
                        period_us: 20_000,
                        on_us: on,
                        auto,
                    })
                    .collect();
                (vms, host)
            })
    }

    proptest::proptest! {
        /// With one period, the phases the planner places never overlap
        /// when they fit in the period (the host-wide limit at most 100 %
        /// makes them fit), each VM's phase is at most what it asked, and
        /// the VMs' placements do not depend on the order they are given
        /// in.
        #[test]
        fn placed_phases_never_overlap(
            (vms, host) in plan_vms(),
            limit in 0u64..=1000,
            now0 in 0u64..1_000_000_000,
        ) {
            let first = plan(&vms, now0, host, limit);
            for (p, v) in first.vms.iter().zip({
                let mut s: Vec<&PlanVm> = vms.iter().collect();
                s.sort_by_key(|v| v.id);
                s
            }) {
                proptest::prop_assert_eq!(p.id, v.id);
                proptest::prop_assert!(p.on_us <= v.on_us);
            }
            let total: u64 = first.vms.iter().map(|p| p.on_us).sum();
            // Every 97 µs of one period: at most one VM in its phase.
            for step in 0..(20_000 / 97) {
                let now = now0 + step * 97;
                let on = plan(&vms, now, host, limit)
                    .vms
                    .iter()
                    .filter(|p| p.phase == Phase::On)
                    .count();
                if total <= 20_000 {
                    proptest::prop_assert!(on <= 1, "{} VMs on at {}", on, now);
                }
            }
            let mut reversed = vms.clone();
            reversed.reverse();
            proptest::prop_assert_eq!(plan(&reversed, now0, host, limit), first);
        }

        /// A VM with more vCPUs than the host has CPUs starts each period
        /// with the next vCPU: over as many periods as it has vCPUs, every
        /// one of them starts once. A VM that fits starts with vCPU 0.
        #[test]
        fn a_vm_wider_than_the_host_takes_turns(
            vcpus in 1u32..=16,
            host in 1u64..=8,
            now0 in 0u64..1_000_000_000,
        ) {
            let vm = PlanVm {
                id: 1,
                vcpus,
                period_us: 20_000,
                on_us: 5_000,
                auto: false,
            };
            let firsts: std::collections::BTreeSet<u32> = (0..u64::from(vcpus))
                .map(|k| plan(std::slice::from_ref(&vm), now0 + k * 20_000, host, 1000).vms[0].first_vcpu)
                .collect();
            if u64::from(vcpus) > host {
                proptest::prop_assert_eq!(firsts.len(), vcpus as usize);
            } else {
                proptest::prop_assert_eq!(firsts.into_iter().collect::<Vec<_>>(), vec![0]);
            }
        }
    }

    #[test]
    fn the_plan_names_the_vms_the_limit_changed() {
        let vm = |id, on_us, auto| PlanVm {
            id,
            vcpus: 2,
            period_us: 20_000,
            on_us,
            auto,
        };
        // Two 2-vCPU VMs set at half the period each on 2 CPUs ask for the
        // whole host: under 80 % both numbers are cut alike, and the
        // "auto" VM gets nothing of what is left.
        let vms = [
            vm(2, 10_000, true),
            vm(3, 10_000, false),
            vm(1, 10_000, false),
        ];
        let p = plan(&vms, 0, 2, 800);
        assert_eq!(p.vms.iter().map(|p| p.id).collect::<Vec<_>>(), [1, 2, 3]);
        let on: Vec<u64> = p.vms.iter().map(|p| p.on_us).collect();
        assert_eq!(on, [8_000, 0, 8_000]);
        assert_eq!((p.cut, p.left_out), (vec![1, 3], vec![2]));
        assert_eq!(p.vms[1].phase, Phase::Free);
        assert_eq!(p.vms[1].edge_in_us, None);
        // Within the limit: the second VM's phase follows the first and
        // half of the free time.
        let p = plan(&[vm(1, 6_000, false), vm(2, 6_000, false)], 0, 2, 1000);
        assert_eq!(p.vms[0].phase, Phase::On);
        assert_eq!(p.vms[0].edge_in_us, Some(6_000));
        assert_eq!(p.vms[1].phase, Phase::Off);
        assert_eq!(p.vms[1].edge_in_us, Some(6_000 + 4_000));
        assert!(p.cut.is_empty() && p.left_out.is_empty());
    }
}
