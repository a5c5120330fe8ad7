//! Differential test: ≥1,000 generated traces through the BPF policy (the
//! re-evaluation entry, `BPF_PROG_TEST_RUN`, guest writes into the real
//! mmapped region map) and through the Rust model must give identical
//! decisions (trace-only records included) and identical per-thread state,
//! including the on-CPU accounting (`acct_ns`, `cont_ns`, `budget_used`,
//! `boosted_ns`) and the VM's budget window, the latency hold, the unit
//! throttling of waiting pairs and the emulator threads that follow the VM's
//! latency-sensitive vCPUs.

use crate::common;

use std::sync::atomic::Ordering;

use pvsched_abi::seq::SharedWords;
use pvsched_abi::{F_DEVICE_REGION, F_KICK, F_WAIT_ON, SlotGuest};
use pvsched_agent::PolicyObject;
use pvsched_agent::intf::{MODE_DEVICE, PvsVcpu, PvsVm};
use pvsched_policy::event::{
    R_BUDGET, R_HALT, R_LIMITS, R_MAX_BOOST, R_THROTTLED, R_VM_BUDGET, R_YIELD,
};
use pvsched_policy::{BoostKind, Caps, Event, GuestFields, KickPairs, VmModel, WaitOn};

/// Byte offset of `driver_features_lo` in the region header.
const HEADER_DRIVER_FEATURES_LO: usize =
    std::mem::offset_of!(pvsched_abi::RegionHeader, driver_features_lo);

/// xorshift64*: small deterministic generator (the seed is printed on failure).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

fn gen_caps(r: &mut Rng) -> Caps {
    let kinds = [BoostKind::None, BoostKind::Nice, BoostKind::Rt];
    Caps {
        allow_rt: r.below(4) != 0,
        max_rt_prio: r.pick(&[0, 1, 5, 10, 50, 99]),
        nice_floor: r.below(21) as i32 - 20,
        cs_rt_prio: r.pick(&[0, 1, 2, 20, 99]),
        halt_boost: r.pick(&kinds),
        halt_prio: r.pick(&[-20, -5, 0, 1, 5, 50]),
        halt_hold_us: r.pick(&[0, 1_000, 50_000]),
        halt_always: r.below(4) == 0,
        yield_boost: r.pick(&kinds),
        yield_prio: r.pick(&[-20, -10, 0, 1, 5, 99]),
        max_boost_us: r.pick(&[0, 500, 2_000, 10_000]),
        throttle_us: r.pick(&[0, 1_000, 5_000]),
        budget_us: r.pick(&[0, 1_000, 4_000]),
        window_us: r.pick(&[1_000, 10_000, 50_000]),
        vm_budget_us: r.pick(&[0, 0, 2_000, 6_000]),
        ipi_window_us: r.pick(&[0, 500, 50_000]),
        kick_pairs: r.pick(&[KickPairs::Off, KickPairs::On, KickPairs::Auto]),
        wait_on: r.pick(&[WaitOn::Off, WaitOn::On, WaitOn::Auto]),
        lock_wait: r.below(3) != 0,
        // The agent's, not the policy's: the BPF program never sees it.
        cosched_us: pvsched_policy::CoschedUs::Us(0),
        cosched_period_us: 20_000,
    }
}

/// An event for one of `nr` vCPUs or, for scheduler events and ticks, one of
/// the `nemu` emulator threads after them.
fn gen_event(r: &mut Rng, nr: u32, nemu: u32) -> Event {
    let mut vcpu = r.below(nr as u64) as u32;
    let kind = r.below(10);
    // Scheduler events and ticks for any thread; now and then a KVM event
    // for an emulator thread too, which the policy must shrug off (guest
    // writes only for vCPUs: an emulator thread has no slot).
    if kind <= 2 || kind == 6 || ((kind < 7 || kind == 8) && r.below(8) == 0) {
        vcpu = r.below((nr + nemu) as u64) as u32;
    }
    match kind {
        0 => Event::SwitchOut {
            vcpu,
            preempted: r.below(2) == 0,
        },
        1 => Event::SwitchIn { vcpu },
        2 => Event::Wakeup { vcpu },
        3 => Event::VcpuWakeup { vcpu },
        4 => Event::Ipi {
            vcpu,
            dest_id: if r.below(8) == 0 {
                77
            } else {
                r.below(nr as u64) as u32 * 2 + 1
            },
            icr_low: r.pick(&[0xfd, 0xec, 0x4fd, 0x8fd, 0x400fd, 0xc00fd, 0x2fd]),
        },
        5 => Event::UserExit {
            vcpu,
            reason: r.below(30) as u32,
        },
        6 => Event::Tick { vcpu },
        // A vCPU (now and then an emulator thread) wakes one of the vCPUs.
        8 => Event::Kick {
            vcpu,
            target: r.below(nr as u64 + 1) as u32,
        },
        _ => Event::GuestWrite {
            vcpu,
            guest: GuestFields {
                kern_cs: if r.below(2) == 0 {
                    0
                } else {
                    r.next() as u32 & 0x1f
                },
                policy: r.pick(&[0, 0, 1, 2, 3, 5, 6, 9]),
                nice: r.below(46) as i32 - 25,
                rt_prio: r.pick(&[0, 1, 5, 50, 99, 120]),
                // WAIT_ANY, a lock spinner, now and then.
                wait_on: if r.below(4) == 0 {
                    pvsched_abi::WAIT_ANY
                } else {
                    r.below(nr as u64 + 2) as u32
                },
                flags: r.pick(&[0, 0, 1, 2, 3]),
            },
        },
    }
}

#[test]
fn bpf_and_model_agree_on_1000_traces() {
    if !common::need_bpf("bpf_and_model_agree_on_1000_traces") {
        return;
    }
    let mut obj = PolicyObject::load(false).unwrap();
    let region = obj.map_region(0).unwrap();
    let traces: u64 = 1000;
    let mut decisions = 0usize;
    let mut events = 0usize;
    let mut by_reason = [0usize; R_VM_BUDGET as usize + 1];
    let mut emu_boosts = 0u64;
    let mut trace_only = 0usize;
    let ring_waits = RingWaits::new(&obj);
    // Steps whose first boost change came after a trace-only record: the
    // kernel wakes the reader for a record only if every record before it
    // was read, unless the policy forces it.
    let mut behind_trace_only = 0usize;
    for seed in 1..=traces {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let nr = 1 + r.below(4) as u32;
        let nemu = r.below(3) as u32;
        let caps = gen_caps(&mut r);
        let tids: Vec<u32> = (0..nr).map(|i| 1000 + i).collect();
        let emus: Vec<u32> = (0..nemu).map(|j| 2000 + j).collect();
        let apics: Vec<u32> = (0..nr).map(|i| i * 2 + 1).collect();
        let mut model = VmModel::with_emulators(caps.clone(), &tids, &apics, &emus);
        // Fresh BPF state for vm 0, with the features a driver negotiated
        // in the region header: unknown (0), without wait_on (a Linux < 6.3
        // guest) or with it, for kick_pairs "auto".
        region.clear();
        model.driver_features = r.pick(&[
            0,
            F_DEVICE_REGION | F_KICK,
            F_DEVICE_REGION | F_KICK | F_WAIT_ON,
        ]);
        let words = region.words();
        words.store(
            HEADER_DRIVER_FEATURES_LO,
            model.driver_features as u32,
            Ordering::Release,
        );
        for i in 0..6u32 {
            let _ = obj.remove_vcpu(i);
            let _ = obj.set_apic(0, i * 2 + 1, None);
        }
        obj.set_vm(
            0,
            &PvsVm {
                active: 1,
                nr_vcpus: nr,
                mode: MODE_DEVICE,
                nr_emulators: nemu,
                ..Default::default()
            }
            .with_caps(&caps),
        )
        .unwrap();
        for (i, &tid) in tids.iter().chain(&emus).enumerate() {
            let i = i as u32;
            obj.set_vcpu(
                i,
                &PvsVcpu {
                    tid,
                    index: i,
                    ..Default::default()
                },
            )
            .unwrap();
            if i < nr {
                obj.set_apic(0, apics[i as usize], Some(i)).unwrap();
            }
        }
        obj.drain_decisions();
        ring_waits.woken(0);
        let mut last = std::collections::HashMap::new();
        let mut now: u64 = 1_000_000 + r.below(1_000_000);
        let len = 20 + r.below(60);
        for step in 0..len {
            now += match r.below(10) {
                0 => 0,
                1 => 20_000_000 + r.below(50_000_000),
                _ => r.below(3_000_000),
            };
            // Now and then an event whose clock was read a little before
            // the last one's (another CPU's, or a caller's read before its
            // system call): the policy must not take it for a new window.
            let at = if r.below(8) == 0 {
                now.saturating_sub(r.below(2_000_000)).max(1)
            } else {
                now
            };
            let ev = gen_event(&mut r, nr, nemu);
            let want = model.step(at, ev);
            match ev {
                Event::GuestWrite { vcpu, guest } => {
                    let g = SlotGuest {
                        kern_cs: guest.kern_cs,
                        policy: guest.policy,
                        nice: guest.nice,
                        rt_prio: guest.rt_prio,
                        wait_on: guest.wait_on,
                        flags: guest.flags,
                        ..Default::default()
                    };
                    assert!(region.write_guest(nr, vcpu, &g));
                }
                _ => {
                    let (code, vcpu, a, b) = ev.encode().unwrap();
                    assert_eq!(obj.reevaluate(code, vcpu, at, a, b).unwrap(), 0);
                }
            }
            // Whether the policy woke the ring's reader, as the agent's
            // epoll waits for: it must have, if a record changed a boost
            // (the wake-up comes from the kernel's irq_work: it may land
            // just after the records are read).
            let mut woken = ring_waits.woken(0);
            let got = obj.drain_decisions();
            assert_eq!(
                got, want,
                "seed {seed} step {step} event {ev:?} caps {caps:?}"
            );
            decisions += got.len();
            // The first record that changed its thread's boost, if any.
            let mut first_change = None;
            for (i, d) in got.iter().enumerate() {
                // A record that leaves the thread's boost as it was is
                // trace-only (throttle extended, waiting target changed).
                let prev = last.insert(d.tid, (d.kind, d.prio));
                if prev.unwrap_or((pvsched_abi::BOOST_NONE, 0)) == (d.kind, d.prio) {
                    trace_only += usize::from(!R_LIMITS.contains(&d.reason));
                } else {
                    first_change = first_change.or(Some(i));
                }
            }
            if let Some(first) = first_change {
                if !woken {
                    woken = ring_waits.woken(100);
                }
                assert!(
                    woken,
                    "seed {seed} step {step}: a boost changed and the reader was not woken: {got:?}"
                );
                behind_trace_only += usize::from(first > 0);
            }
            ring_waits.woken(0);
            events += 1;
            for d in &got {
                by_reason[(d.reason as usize).min(R_VM_BUDGET as usize)] += 1;
            }
        }
        let vm = obj.vm(0).unwrap();
        assert_eq!(
            (vm.ls_until, vm.window_start, vm.budget_used),
            (model.ls_until, model.window_start, model.budget_used),
            "seed {seed} VM latency hold and budget window"
        );
        for i in 0..nr + nemu {
            let b = obj.vcpu(i).unwrap();
            let m = &model.vcpus[i as usize];
            let bs = (
                (
                    b.state,
                    b.boost,
                    b.boost_prio,
                    b.boost_reason,
                    b.throttled,
                    b.yield_slot,
                    b.yield_mask,
                    b.yield_boosting,
                ),
                (
                    b.boosts,
                    b.throttles,
                    b.boosted_ns,
                    b.ipis,
                    b.slot_hits,
                    b.budget_used,
                    b.wait_on,
                    b.guest_idle,
                ),
                (
                    b.acct_ns,
                    b.cont_ns,
                    b.throttled_until,
                    b.ls_until,
                    b.last_kick_target,
                    b.last_kick_ns,
                    b.sync_halts,
                    b.sync_wait_ns,
                    b.sync_since,
                ),
            );
            let ms = (
                (
                    m.state,
                    m.boost,
                    m.boost_prio,
                    m.boost_reason,
                    m.throttled,
                    m.yield_slot,
                    m.yield_mask,
                    m.yield_boosting,
                ),
                (
                    m.boosts,
                    m.throttles,
                    m.boosted_ns,
                    m.ipis,
                    m.slot_hits,
                    m.budget_used,
                    m.wait_on,
                    m.guest_idle,
                ),
                (
                    m.acct_ns,
                    m.cont_ns,
                    m.throttled_until,
                    m.ls_until,
                    m.last_kick_target,
                    m.last_kick_ns,
                    m.sync_halts,
                    m.sync_wait_ns,
                    m.sync_since,
                ),
            );
            assert_eq!(bs, ms, "seed {seed} vcpu {i} final state");
            if i >= nr {
                emu_boosts += b.boosts;
                continue;
            }
            // The host half of the region mirrors the BPF state.
            let h = region.read_host(nr, i).unwrap();
            assert_eq!(
                (h.boost, h.boost_prio, h.throttled, h.yield_target, h.boosts),
                (b.boost, b.boost_prio, b.throttled, b.yield_slot, b.boosts)
            );
        }
    }
    println!(
        "differential: {traces} traces, {events} events, {decisions} decisions ({trace_only} \
         trace-only), all identical; by reason (none, cs, rt, nice, halt, yield, max_boost, \
         budget, unit throttle, exited, VM budget): {by_reason:?}; emulator-thread boosts \
         {emu_boosts}"
    );
    println!(
        "differential: {behind_trace_only} steps changed a boost after a trace-only record; \
         the reader was woken for every step that changed one"
    );
    assert!(trace_only > 10, "trace-only records barely exercised");
    assert!(
        behind_trace_only > 0,
        "no boost change came after a trace-only record"
    );
    assert!(emu_boosts > 10, "emulator threads barely exercised");
    // Every throttling path is exercised, the unit throttle of pairs included.
    for r in [
        R_MAX_BOOST,
        R_BUDGET,
        R_VM_BUDGET,
        R_THROTTLED,
        R_HALT,
        R_YIELD,
    ] {
        assert!(
            by_reason[r as usize] > 10,
            "reason {r} barely exercised: {by_reason:?}"
        );
    }
    assert!(
        decisions > 1000,
        "traces too tame: only {decisions} decisions"
    );
}

/// An epoll instance watching the decision ring, as the agent's consumer
/// does: it reports the ring only once the policy woke its reader.
struct RingWaits(std::os::fd::OwnedFd);

impl RingWaits {
    fn new(obj: &PolicyObject) -> Self {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: epoll_create1 takes no pointer; it returns a new fd or -1.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(
            ep >= 0,
            "epoll_create1: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: ep is a new fd that nothing else owns.
        let ep = unsafe { std::os::fd::OwnedFd::from_raw_fd(ep) };
        let ring = obj.decisions_fd().expect("the decision ring");
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 1,
        };
        // SAFETY: valid epoll fd, valid target fd, valid event struct.
        let rc = unsafe {
            libc::epoll_ctl(
                ep.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                ring.as_raw_fd(),
                &mut ev,
            )
        };
        assert_eq!(rc, 0, "epoll_ctl: {}", std::io::Error::last_os_error());
        RingWaits(ep)
    }

    /// Whether the ring was reported readable within `timeout_ms`: after
    /// its records were all read, only a wake-up since reports it again.
    fn woken(&self, timeout_ms: i32) -> bool {
        use std::os::fd::AsRawFd;
        let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 1];
        // SAFETY: ev is a valid buffer of one event.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), ev.as_mut_ptr(), 1, timeout_ms) };
        n > 0
    }
}
