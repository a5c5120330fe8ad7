//! Slot reads: clamping of hostile values, the sequence protocol under a
//! concurrent writer (never a torn snapshot), and bounded retries.

use pvsched_abi as abi;
use pvsched_device::testing::guest_handshake;
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice, RegionView, SlotError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const NR: u32 = 4;
const GPA: u64 = 0x4000;

fn attached() -> (PvschedDevice, GuestMemoryMmap, RegionView) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    let mut dev = PvschedDevice::new(DeviceConfig::new(NR), Arc::new(NullSink)).unwrap();
    dev.set_guest_memory(mem.clone());
    assert_eq!(guest_handshake(&mut dev, GPA, 4096), 0xf);
    let view = dev.region_view().unwrap();
    (dev, mem, view)
}

fn put(mem: &GuestMemoryMmap, index: u32, g: abi::SlotGuest) {
    let at = GPA + u64::from(abi::slot_offset(NR, index));
    mem.write_obj(g, GuestAddress(at)).unwrap();
}

#[test]
fn clamping() {
    let (_dev, mem, view) = attached();
    let base = abi::SlotGuest {
        seq: 2,
        ..Default::default()
    };
    let cases: Vec<(abi::SlotGuest, u32, i32, u32, Option<u32>, bool)> = vec![
        // raw, policy, nice, rt_prio, wait_on, clamped
        (
            abi::SlotGuest { policy: 4, ..base },
            abi::POLICY_NORMAL,
            0,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                policy: u32::MAX,
                ..base
            },
            abi::POLICY_NORMAL,
            0,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest { nice: -21, ..base },
            abi::POLICY_NORMAL,
            -20,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                nice: i32::MIN,
                ..base
            },
            abi::POLICY_NORMAL,
            -20,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest { nice: 20, ..base },
            abi::POLICY_NORMAL,
            19,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                nice: 19,
                policy: abi::POLICY_BATCH,
                ..base
            },
            abi::POLICY_BATCH,
            19,
            0,
            None,
            false,
        ),
        (
            abi::SlotGuest {
                policy: abi::POLICY_FIFO,
                rt_prio: 100,
                ..base
            },
            abi::POLICY_FIFO,
            0,
            99,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                policy: abi::POLICY_RR,
                rt_prio: 99,
                ..base
            },
            abi::POLICY_RR,
            0,
            99,
            None,
            false,
        ),
        (
            abi::SlotGuest {
                policy: abi::POLICY_NORMAL,
                rt_prio: 50,
                ..base
            },
            abi::POLICY_NORMAL,
            0,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                policy: abi::POLICY_DEADLINE,
                rt_prio: 5,
                ..base
            },
            abi::POLICY_DEADLINE,
            0,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                wait_on: NR,
                ..base
            },
            abi::POLICY_NORMAL,
            0,
            0,
            Some(NR - 1),
            false,
        ),
        (
            abi::SlotGuest {
                wait_on: NR + 1,
                ..base
            },
            abi::POLICY_NORMAL,
            0,
            0,
            None,
            true,
        ),
        (
            abi::SlotGuest {
                wait_on: u32::MAX - 1,
                ..base
            },
            abi::POLICY_NORMAL,
            0,
            0,
            None,
            true,
        ),
        // WAIT_ANY (u32::MAX) is a lock wait with no slot: not clamped.
        (
            abi::SlotGuest {
                wait_on: abi::WAIT_ANY,
                ..base
            },
            abi::POLICY_NORMAL,
            0,
            0,
            None,
            false,
        ),
    ];
    for (raw, policy, nice, rt_prio, wait_on, clamped) in cases {
        put(&mem, 2, raw);
        let s = view.read_guest_slot(2).unwrap();
        assert_eq!(
            (s.policy, s.nice, s.rt_prio, s.wait_on, s.clamped),
            (policy, nice, rt_prio, wait_on, clamped),
            "{raw:?}"
        );
    }
    // Reserved kern_cs bits, flags and reserved words are ignored.
    put(
        &mem,
        3,
        abi::SlotGuest {
            kern_cs: 0xffff_fff5,
            flags: 7,
            reserved0: 1,
            reserved: [9; 2],
            ..base
        },
    );
    let s = view.read_guest_slot(3).unwrap();
    assert_eq!(s.kern_cs, abi::CS_NMI | abi::CS_SOFTIRQ);
    assert!(!s.clamped);
    assert_eq!(
        view.read_guest_slot(NR),
        Err(SlotError::OutOfRange {
            index: NR,
            nr_vcpus: NR
        })
    );
    assert_eq!(
        view.read_guest_slot(u32::MAX).unwrap_err(),
        SlotError::OutOfRange {
            index: u32::MAX,
            nr_vcpus: NR
        }
    );
}

#[test]
fn odd_sequence_forever_is_busy() {
    let (_dev, mem, view) = attached();
    put(
        &mem,
        1,
        abi::SlotGuest {
            seq: 7,
            nice: 3,
            ..Default::default()
        },
    );
    assert!(matches!(
        view.read_guest_slot(1),
        Err(SlotError::Busy { index: 1, .. })
    ));
    put(
        &mem,
        1,
        abi::SlotGuest {
            seq: 8,
            nice: 3,
            ..Default::default()
        },
    );
    assert_eq!(view.read_guest_slot(1).unwrap().nice, 3);
}

/// The writer derives every field from one counter; a reader that ever sees
/// fields from two different updates has read a torn slot.
fn slot_for(k: u64) -> abi::SlotGuest {
    abi::SlotGuest {
        kern_cs: (k & 0xf) as u32,
        policy: if k.is_multiple_of(2) {
            abi::POLICY_FIFO
        } else {
            abi::POLICY_NORMAL
        },
        nice: (k % 40) as i32 - 20,
        rt_prio: if k.is_multiple_of(2) {
            (k % 99 + 1) as u32
        } else {
            0
        },
        wait_on: (k % u64::from(NR)) as u32 + 1,
        updates: k,
        ..Default::default()
    }
}

#[test]
fn concurrent_writer_never_torn() {
    let (_dev, _mem, view) = attached();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (view, stop) = (view.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                view.write_guest_slot(0, &slot_for(k)).unwrap();
            }
            k
        })
    };
    let (mut ok, mut busy, mut last) = (0u32, 0u32, 0u64);
    while ok < 20_000 {
        match view.read_guest_slot(0) {
            Ok(s) => {
                let k = s.updates;
                if k == 0 {
                    assert_eq!(s.seq, 0, "untouched slot");
                    continue;
                }
                let want = slot_for(k);
                assert_eq!(s.kern_cs, want.kern_cs, "torn read at update {k}");
                assert_eq!(s.policy, want.policy, "torn read at update {k}");
                assert_eq!(s.nice, want.nice, "torn read at update {k}");
                assert_eq!(s.rt_prio, want.rt_prio, "torn read at update {k}");
                assert_eq!(s.wait_on, Some(want.wait_on - 1), "torn read at update {k}");
                assert!(!s.clamped);
                assert_eq!(
                    s.seq,
                    (k as u32).wrapping_mul(2),
                    "seq advances by 2 per update"
                );
                assert!(k >= last, "updates went backwards");
                last = k;
                ok += 1;
            }
            Err(SlotError::Busy { .. }) => busy += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().unwrap();
    assert!(written >= last);
    println!("{ok} consistent reads, {busy} busy, {written} writes");
}

/// A policy thread writing host halves in a loop while the guest resets:
/// once the reset returns, the device's memory is never written again.
#[test]
fn reset_stops_concurrent_host_writes() {
    let (mut dev, mem, view) = attached();
    let writer = {
        let view = view.clone();
        std::thread::spawn(move || {
            let mut n = 0u64;
            loop {
                let h = abi::SlotHost {
                    boosts: n,
                    ..Default::default()
                };
                match view.write_host_slot((n % u64::from(NR)) as u32, &h) {
                    Ok(()) => n += 1,
                    Err(SlotError::Detached) => return n,
                    Err(e) => panic!("unexpected {e}"),
                }
            }
        })
    };
    // Let the writer run, then reset from this thread.
    while view.read_host_slot(0).map(|h| h.boosts).unwrap_or(0) < 100 {
        std::thread::yield_now();
    }
    pvsched_device::testing::reg_write(&mut dev, abi::REG_STATUS, 0);
    let mut after_reset = vec![0u8; 4096];
    mem.read_slice(&mut after_reset, GuestAddress(GPA)).unwrap();
    let writes = writer.join().unwrap();
    let mut after_join = vec![0u8; 4096];
    mem.read_slice(&mut after_join, GuestAddress(GPA)).unwrap();
    assert!(writes >= 100);
    assert_eq!(
        after_reset, after_join,
        "region written after reset returned"
    );
    for i in 0..NR {
        let seq: u32 = mem
            .read_obj(GuestAddress(GPA + u64::from(abi::slot_offset(NR, i)) + 64))
            .unwrap();
        assert_eq!(seq & 1, 0, "no host half left mid-update");
    }
}
