//! Property test: random sequences of configuration accesses, BAR0/BAR2
//! accesses, register writes biased towards the handshake, region
//! scribbles, resets, memory swaps and snapshot/restore never panic and keep
//! the device invariants (see `pvsched_device::testing::Harness::check`):
//! DRIVER_OK only with a valid region attached, no region access after
//! reset, never DRIVER_OK together with FAILED, ERROR within 0..=ERR_MAX.
//!
//! The number of cases comes from `PROPTEST_CASES` (CI sets 10000).

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use pvsched_device::testing::{Harness, decode_ops};
use pvsched_device::{DeviceConfig, NullSink, PciDevice, PvschedDevice, RegionMode};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Longest operation sequence per case.
const MAX_OPS: usize = 64;

proptest! {
    // ProptestConfig::default() reads PROPTEST_CASES from the environment.
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn random_sequences_keep_invariants(
        nr in prop::sample::select(vec![1u32, 3, 40]),
        bytes in prop::collection::vec(any::<u8>(), 0..(MAX_OPS * 6)),
    ) {
        let mut h = Harness::new(nr);
        h.check();
        for op in decode_ops(&bytes, MAX_OPS) {
            h.apply(&op);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::default())]

    /// Whatever is written, read-only fields keep their values, BAR type
    /// bits stay fixed, BAR size bits read 0, absent BARs read 0, and a
    /// byte write changes no other byte of its dword.
    #[test]
    fn config_writes_respect_masks(
        writes in prop::collection::vec((0usize..70, 0u64..6, 0usize..6, any::<u32>()), 0..48),
    ) {
        let mut d = PvschedDevice::new(DeviceConfig::new(40), Arc::new(NullSink)).unwrap();
        let fixed: Vec<(usize, u32)> = [0, 2, 10, 11, 12, 13, 14, 20, 63]
            .iter()
            .map(|&i| (i, d.read_config_register(i)))
            .collect();
        let bar2 = PvschedDevice::region_bar_size(40) as u32;
        for (idx, off, len, value) in writes {
            let before = d.read_config_register(idx);
            let bytes = value.to_le_bytes();
            d.write_config_register(idx, off, &bytes[..len.min(4)]);
            let after = d.read_config_register(idx);
            if idx < 64 && matches!(len, 1 | 2) && off + len as u64 <= 4 {
                let touched = ((1u64 << (8 * len)) - 1) << (8 * off);
                prop_assert_eq!(u64::from(before) & !touched, u64::from(after) & !touched);
            }
            for &(i, v) in &fixed {
                prop_assert_eq!(d.read_config_register(i), v);
            }
            prop_assert_eq!(d.read_config_register(1) >> 16, 0, "status");
            prop_assert_eq!(d.read_config_register(3) >> 16, 0, "header type, BIST");
            prop_assert_eq!(d.read_config_register(15) >> 8, 0, "pin, min_gnt, max_lat");
            prop_assert_eq!(d.read_config_register(4) & 0xfff, 0, "BAR0 size bits, type");
            prop_assert_eq!(d.read_config_register(6) & (bar2 - 1), 0x8, "BAR2 size bits, type");
            for i in [5, 7, 8, 9] {
                prop_assert_eq!(d.read_config_register(i), 0);
            }
            for b in d.bars() {
                if let Some(a) = b.address {
                    prop_assert_eq!(a % b.size, 0);
                }
            }
        }
    }
}

#[test]
fn default_config_reads_proptest_cases() {
    // Guard the CI assumption that the env var drives the case count.
    if let Ok(v) = std::env::var("PROPTEST_CASES") {
        assert_eq!(ProptestConfig::default().cases.to_string(), v.trim());
    }
}

/// The operation language must actually reach the interesting states
/// (attached in both modes, detached again), or the property test proves
/// little. Deterministic seed.
#[test]
fn op_language_reaches_attach_in_both_modes() {
    let mut runner = TestRunner::deterministic();
    let strategy = prop::collection::vec(any::<u8>(), 0..(MAX_OPS * 6));
    let (mut attaches, mut detaches) = (0, 0);
    let mut modes = std::collections::HashSet::new();
    for _ in 0..500 {
        let bytes = strategy.new_tree(&mut runner).unwrap().current();
        let mut h = Harness::new(3);
        for op in decode_ops(&bytes, MAX_OPS) {
            h.apply(&op);
            if let Some(v) = h.dev.region_view() {
                modes.insert(v.info().mode);
            }
        }
        attaches += h.sink.attaches.load(Ordering::SeqCst);
        detaches += h.sink.detaches.load(Ordering::SeqCst);
    }
    assert!(attaches > 100, "only {attaches} attaches in 500 sequences");
    assert!(detaches > 100, "only {detaches} detaches in 500 sequences");
    assert!(modes.contains(&RegionMode::Guest) && modes.contains(&RegionMode::Device));
}
