//! Measures the vfio-user transport against a real, sandboxed device
//! process:
//!
//! 1. BAR0 register read round trip over the socket (10,000 reads of
//!    MAGIC, p50/p99/max in µs);
//! 2. that device-region slot updates cross no socket: BAR2 is mapped
//!    through the fd the client received, the guest slot is updated 100,000
//!    times with the sequence protocol, and the device's own message count
//!    (read from its `--dump-slots` JSON, written by the device process) is
//!    printed before and after. It must stay flat, while the device's view
//!    of the slot shows the last update.
//!
//! The device process is this executable re-run as `vfio_user_rtt device
//! ...`, which calls the same `pvsched_transport::cli::main` as the
//! `pvsched-device` binary (so `cargo run --example` needs no other build),
//! sandbox on (the default).
//!
//! ```text
//! cargo run --release -p pvsched-transport --example vfio_user_rtt
//! ```

use clap::Parser;
#[path = "../tests/integration/support/vfio_client.rs"]
mod vfio_client;

use pvsched_abi as abi;
use pvsched_transport::cli::DeviceArgs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};
use vfio_client::{
    bar0_read_rtt, connect, driver_ok, map_bar2, map_bars, negotiate, reg, write_guest_slot,
};

const NR_VCPUS: u32 = 2;
const READS: usize = 10_000;
const UPDATES: u64 = 100_000;

/// `vfio_user_rtt device ARGS`: run as the device process.
#[derive(Parser)]
struct DeviceCli {
    #[command(flatten)]
    args: DeviceArgs,
}

/// Total messages the device counted, from its dump.
fn dumped_messages(dump: &Path) -> (u64, serde_json::Value) {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dump).expect("read dump")).expect("dump is JSON");
    let n = v["device"]["messages"]
        .as_object()
        .expect("messages")
        .values()
        .filter_map(serde_json::Value::as_u64)
        .sum();
    (n, v)
}

fn main() -> ExitCode {
    let mut argv = std::env::args();
    let me = argv.next().unwrap_or_default();
    if argv.next().as_deref() == Some("device") {
        pvsched_util::logging::init("warn", pvsched_util::logging::Clock::Time);
        let cli = DeviceCli::parse_from(std::iter::once(me).chain(argv));
        return pvsched_transport::cli::main("vfio_user_rtt device", &cli.args);
    }
    measure();
    ExitCode::SUCCESS
}

fn measure() {
    let dir = std::env::temp_dir().join(format!("pvsched-rtt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sock: PathBuf = dir.join("sock");
    let dump = dir.join("slots.json");
    let mut child = Command::new(std::env::current_exe().expect("own path"))
        .arg("device")
        .args(["--transport", "vfio-user", "--vcpus", &NR_VCPUS.to_string()])
        .arg("--socket")
        .arg(&sock)
        .args(["--dump-ms", "10", "--dump-slots"])
        .arg(&dump)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn the device process");
    let mut c = connect(&sock, &mut child);
    let st = std::fs::read_to_string(format!("/proc/{}/status", child.id())).expect("status");
    println!("device pid {} (separate process):", child.id());
    for l in st.lines().filter(|l| {
        l.starts_with("CapEff") || l.starts_with("NoNewPrivs") || l.starts_with("Seccomp:")
    }) {
        println!("  {l}");
    }

    // 1. BAR0 round trip.
    let rtt = bar0_read_rtt(&mut c, READS);
    println!(
        "BAR0 read round trip over vfio-user ({READS} reads): p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        rtt.p50_us, rtt.p99_us, rtt.max_us
    );

    // 2. Device-region handshake, then slot updates through the mapping.
    map_bars(&mut c);
    negotiate(&mut c, abi::F_DEVICE_REGION);
    let s = abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER | abi::STATUS_FEATURES_OK;
    assert_eq!(driver_ok(&mut c), s | abi::STATUS_DRIVER_OK);

    let map = map_bar2(&c);
    assert!(map.size() >= abi::region_size(NR_VCPUS) as usize);

    // One more message after the dump period so the device rewrites its
    // dump while answering it: that dump holds the "before" count.
    std::thread::sleep(Duration::from_millis(20));
    reg(&mut c, abi::REG_STATUS);
    let (before, _) = dumped_messages(&dump);
    let t = Instant::now();
    for i in 1..=UPDATES {
        // SAFETY: `map` covers the region and lives until the end.
        unsafe { write_guest_slot(map.as_ptr(), NR_VCPUS, 1, (i % 20) as i32, i) };
    }
    let took = t.elapsed();
    // Disconnect: the device takes a last sample and writes its final dump.
    c.shutdown().expect("shutdown");
    drop(c);
    let st = child.wait().expect("wait device");
    assert!(st.success(), "device exited with {st}");
    let (after, v) = dumped_messages(&dump);
    println!(
        "{UPDATES} slot updates through the BAR2 mapping in {:.1} ms ({:.0} ns each)",
        took.as_secs_f64() * 1e3,
        took.as_nanos() as f64 / UPDATES as f64
    );
    println!(
        "device's message count: before {before}, after {after} (flat: {})",
        before == after
    );
    println!(
        "device's view of slot 1 at disconnect: updates {}, seq {}",
        v["slots"][1]["updates"], v["slots"][1]["seq"]
    );
    assert_eq!(before, after, "slot updates crossed the socket");
    assert_eq!(v["slots"][1]["updates"], UPDATES);
    let _ = std::fs::remove_dir_all(&dir);
}
