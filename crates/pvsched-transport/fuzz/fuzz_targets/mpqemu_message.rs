//! Fuzz target: the mpqemu message parser. The first byte chooses how many
//! file descriptors the message claims to carry (0..=9, one past the
//! protocol maximum); the rest is the frame (header + payload). Parsing must
//! never panic, and a parsed request must re-encode to what was parsed.
//!
//! Run with `cargo +nightly fuzz run mpqemu_message` from
//! `crates/pvsched-transport`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pvsched_transport::mpqemu::message::{
    CMD_BAR_READ, CMD_BAR_WRITE, Request, bar_payload, encode_request, parse_frame,
};

fuzz_target!(|data: &[u8]| {
    let Some((&first, frame)) = data.split_first() else {
        return;
    };
    let nfds = usize::from(first % 10);
    match parse_frame(frame, nfds) {
        Ok(Request::BarRead { addr, size, memory }) => {
            let again = encode_request(CMD_BAR_READ, &bar_payload(addr, 0, size.into(), memory));
            assert_eq!(
                parse_frame(&again, 0),
                Ok(Request::BarRead { addr, size, memory })
            );
        }
        Ok(Request::BarWrite {
            addr,
            val,
            size,
            memory,
        }) => {
            let again = encode_request(CMD_BAR_WRITE, &bar_payload(addr, val, size.into(), memory));
            assert_eq!(
                parse_frame(&again, 0),
                Ok(Request::BarWrite {
                    addr,
                    val,
                    size,
                    memory
                })
            );
        }
        Ok(Request::SyncSysmem(r)) => assert_eq!(r.len(), nfds),
        _ => {}
    }
});
