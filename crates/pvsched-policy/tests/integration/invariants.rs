//! Property tests of the reference model: whatever the guest writes and
//! whatever the event order, a decision never exceeds the VM's caps, a
//! vCPU's consecutive records always change something (its boost, or for a
//! trace-only record its throttle or waiting target), an emulator thread
//! never gets more than the halt boost, nothing is
//! boosted while throttled, a waiting pair is never split (a sender boosted
//! while its target is throttled, or a throttled sender lending its boost),
//! no vCPU is charged more on-CPU time than passed, and no thread gets a
//! new boost while its VM's budget of the window is spent.

use proptest::prelude::*;
use pvsched_abi::{BOOST_NICE, BOOST_NONE, BOOST_RT};
use pvsched_policy::event::{R_LIMITS, R_THROTTLED};
use pvsched_policy::{BoostKind, Caps, Event, GuestFields, KickPairs, VmModel, WaitOn};
use std::collections::HashMap;

fn kind() -> impl Strategy<Value = BoostKind> {
    prop_oneof![
        Just(BoostKind::None),
        Just(BoostKind::Nice),
        Just(BoostKind::Rt)
    ]
}

fn caps() -> impl Strategy<Value = Caps> {
    (
        any::<bool>(),
        0u32..=99,
        -20i32..=19,
        0u32..=99,
        (kind(), -30i32..120, kind(), -30i32..120),
        (
            0u64..5_000,
            0u64..5_000,
            0u64..5_000,
            1u64..20_000,
            0u64..5_000,
        ),
        (
            0u64..5_000,
            any::<bool>(),
            prop_oneof![
                Just(KickPairs::Off),
                Just(KickPairs::On),
                Just(KickPairs::Auto)
            ],
            prop_oneof![Just(0u64), 1u64..5_000],
        ),
    )
        .prop_map(
            |(
                allow_rt,
                max_rt_prio,
                nice_floor,
                cs_rt_prio,
                (hk, hp, yk, yp),
                (mb, th, bu, wi, iw),
                (hold, always, kick_pairs, vm_budget_us),
            )| Caps {
                allow_rt,
                max_rt_prio,
                nice_floor,
                cs_rt_prio,
                halt_boost: hk,
                halt_prio: hp,
                halt_hold_us: hold,
                halt_always: always,
                yield_boost: yk,
                yield_prio: yp,
                max_boost_us: mb,
                throttle_us: th,
                budget_us: bu,
                window_us: wi,
                vm_budget_us,
                ipi_window_us: iw,
                kick_pairs,
                wait_on: WaitOn::On,
                lock_wait: true,
                ..Caps::default()
            },
        )
}

fn event(nr: u32) -> impl Strategy<Value = Event> {
    let v = 0..nr + 1; // includes an out-of-range vCPU
    prop_oneof![
        (v.clone(), any::<bool>())
            .prop_map(|(vcpu, preempted)| Event::SwitchOut { vcpu, preempted }),
        v.clone().prop_map(|vcpu| Event::SwitchIn { vcpu }),
        v.clone().prop_map(|vcpu| Event::Wakeup { vcpu }),
        v.clone().prop_map(|vcpu| Event::Tick { vcpu }),
        (v.clone(), 0..nr + 1).prop_map(|(vcpu, target)| Event::Kick { vcpu, target }),
        (v.clone(), any::<u32>(), any::<u32>()).prop_map(|(vcpu, dest_id, icr_low)| Event::Ipi {
            vcpu,
            dest_id: dest_id % 8,
            icr_low
        }),
        (
            v,
            any::<u32>(),
            any::<u32>(),
            any::<i32>(),
            any::<u32>(),
            any::<u32>()
        )
            .prop_map(|(vcpu, kern_cs, policy, nice, rt_prio, wait_on)| {
                Event::GuestWrite {
                    vcpu,
                    guest: GuestFields {
                        kern_cs,
                        policy: policy % 8,
                        nice,
                        rt_prio,
                        // WAIT_ANY (a lock spinner) for one draw in 7.
                        wait_on: if wait_on % 7 == 6 {
                            pvsched_abi::WAIT_ANY
                        } else {
                            wait_on % 6
                        },
                        // The kernel-thread bit from the same draw.
                        flags: (wait_on >> 8) & 1,
                    },
                }
            }),
    ]
}

/// PROPTEST_CASES, capped at 2,000 (proptest! would let the environment
/// override the cap; each case is a whole trace).
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    ProptestConfig::with_cases(u32::min(cases, 2000))
}

fn check(c: Caps, evs: Vec<(u64, Event)>) -> Result<(), TestCaseError> {
    // Four vCPUs and one emulator thread (index 4, tid 5).
    let mut vm = VmModel::with_emulators(c.clone(), &[1, 2, 3, 4], &[0, 1, 2, 3], &[5]);
    // A guest that cannot report wait_on, so kick_pairs "auto" pairs.
    vm.driver_features = pvsched_abi::F_DEVICE_REGION;
    let mut halt = (c.halt_boost.abi(), c.halt_prio);
    pvsched_policy::model::caps_clamp(&c, &mut halt.0, &mut halt.1);
    let mut now = 1u64;
    let mut last: HashMap<u32, (u32, i32, u64, u32)> = HashMap::new();
    let (vm_budget, window) = (Caps::ns(c.vm_budget_us), Caps::ns(c.window_us));
    for (dt, ev) in evs {
        now += dt;
        // Spent before the step and its window not over: it stays spent
        // through the step (a charge only adds).
        let spent = vm_budget != 0
            && vm.budget_used >= vm_budget
            && now.saturating_sub(vm.window_start) < window;
        for d in vm.step(now, ev) {
            match d.kind {
                BOOST_RT => {
                    prop_assert!(c.allow_rt && c.max_rt_prio > 0);
                    prop_assert!(d.prio >= 1 && d.prio as u32 <= c.max_rt_prio);
                }
                BOOST_NICE => prop_assert!(d.prio >= c.nice_floor && d.prio < 0),
                BOOST_NONE => prop_assert_eq!(d.prio, 0),
                k => prop_assert!(false, "unknown kind {}", k),
            }
            if R_LIMITS.contains(&d.reason) || d.reason == R_THROTTLED {
                prop_assert_eq!(d.kind, BOOST_NONE);
            }
            if d.tid == 5 {
                prop_assert!(
                    d.kind == BOOST_NONE || (d.kind, d.prio) == halt,
                    "emulator thread got {:?}, more than the halt boost {:?}",
                    (d.kind, d.prio),
                    halt
                );
                prop_assert_eq!(d.waits_on, 0);
            }
            let rec = (d.kind, d.prio, d.throttled_until, d.waits_on);
            let prev = last.insert(d.tid, rec).unwrap_or((BOOST_NONE, 0, 0, 0));
            prop_assert!(
                !(spent && prev.0 == BOOST_NONE && d.kind != BOOST_NONE),
                "thread {} boosted while its VM's budget was spent",
                d.tid
            );
            if !R_LIMITS.contains(&d.reason) {
                prop_assert_ne!(prev, rec, "a record that changes nothing");
            }
        }
        for v in &vm.vcpus {
            if now < v.throttled_until {
                prop_assert_eq!(v.boost, BOOST_NONE);
                prop_assert_eq!(v.yield_boosting, 0, "a throttled sender lends nothing");
            }
            prop_assert!(v.boosted_ns <= now, "charged more time than passed");
            if v.yield_boosting != 0 {
                let t = &vm.vcpus[v.yield_boosting as usize - 1];
                prop_assert!(
                    !(now < t.throttled_until && v.boost != BOOST_NONE),
                    "split pair: sender {} boosted, its target {} throttled",
                    v.index,
                    t.index
                );
                prop_assert!(t.yield_mask & (1 << v.index) != 0, "lend without a mark");
            }
        }
    }
    Ok(())
}

#[test]
fn decisions_respect_caps() {
    let mut runner = proptest::test_runner::TestRunner::new(config());
    let strategy = (
        caps(),
        prop::collection::vec((0u64..3_000_000, event(5)), 1..80),
    );
    if let Err(e) = runner.run(&strategy, |(c, evs)| check(c, evs)) {
        panic!("{e}");
    }
}
