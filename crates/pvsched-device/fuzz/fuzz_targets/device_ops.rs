//! Fuzz target: decode an operation sequence from the input bytes (the same
//! decoder the property test uses) and apply it to a device, checking the
//! device invariants after every operation.
//!
//! Run with `cargo +nightly fuzz run device_ops` from `crates/pvsched-device`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pvsched_device::testing::{Harness, decode_ops};

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let nr = [1u32, 3, 40][usize::from(first) % 3];
    let mut h = Harness::new(nr);
    h.check();
    for op in decode_ops(rest, 256) {
        h.apply(&op);
    }
});
