//! Hostile peer: random (well-framed) messages of every command, with
//! random payloads and lengths, never make the transport panic, hang or
//! lose framing: every command QEMU waits on gets exactly one RET, and the
//! device still answers a normal configuration read afterwards.

use crate::common;

use common::read_ret;
use proptest::prelude::*;
use pvsched_abi as abi;
use pvsched_device::{DeviceConfig, NullSink, PvschedDevice};
use pvsched_transport::monitor::TransportMonitor;
use pvsched_transport::mpqemu::MpqemuPeer;
use pvsched_transport::mpqemu::message::*;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

fn session(msgs: &[(i32, Vec<u8>)]) {
    let (mut q, d) = UnixStream::pair().expect("socketpair");
    q.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut cfg = DeviceConfig::new(2);
    cfg.features = abi::F_ALL & !abi::F_DEVICE_REGION;
    let dev = PvschedDevice::new(cfg, Arc::new(NullSink)).expect("device");
    let peer = std::thread::spawn(move || {
        MpqemuPeer::new(d, dev, Arc::new(TransportMonitor::new()))
            .serve()
            .is_ok()
    });
    for (cmd, payload) in msgs {
        q.write_all(&encode_request(*cmd, payload)).expect("send");
        if Request::cmd_wants_reply(*cmd) {
            read_ret(&mut q);
        }
    }
    q.write_all(&encode_request(CMD_PCI_CFGREAD, &config_payload(0, 0, 2)))
        .expect("send");
    assert_eq!(read_ret(&mut q), u64::from(abi::PCI_VENDOR_ID));
    drop(q);
    assert!(peer.join().expect("peer thread"));
}

fn message() -> impl Strategy<Value = (i32, Vec<u8>)> {
    (
        prop_oneof![0i32..9, any::<i32>()],
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..=256),
            // Structured accesses around BAR0 and the config space.
            (0u64..0x1_0000_0000, any::<u64>(), 0u32..10, any::<bool>())
                .prop_map(|(a, v, s, m)| bar_payload(a, v, s, m).to_vec()),
            (0u32..300, any::<u32>(), -1i32..6)
                .prop_map(|(a, v, l)| config_payload(a, v, l).to_vec()),
        ],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_messages_keep_the_session_alive(msgs in proptest::collection::vec(message(), 0..20)) {
        session(&msgs);
    }
}
