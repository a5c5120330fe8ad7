//! pvschedd's request parser on arbitrary bytes: it returns a request or an
//! error and never panics; whatever it accepts passes its own checks and
//! survives a serialize/parse round trip unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pvsched_daemon::proto::parse_request;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = parse_request(data) {
        let again = serde_json::to_vec(&req).expect("a parsed request serializes");
        assert_eq!(parse_request(&again).as_ref(), Ok(&req));
    }
});
