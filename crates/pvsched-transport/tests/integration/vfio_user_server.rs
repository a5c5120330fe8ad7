//! The vfio-user transport against the `vfio_user` crate's own `Client`
//! over a UNIX socket, the server in a thread: realize, configuration space,
//! device-region and guest-region handshakes, invalid regions, reset,
//! hostile input, and the BAR0 round-trip measurement.

use crate::vfio_client;

use pvsched_abi as abi;
use pvsched_device::testing::guest_handshake;
use pvsched_device::{DeviceConfig, NullSink, PciDevice, PvschedDevice};
use pvsched_transport::monitor::TransportMonitor;
use pvsched_transport::vfio_user::{VfioUserDevice, VfioUserError, VfioUserServer, VfioUserStats};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_NUM_REGIONS, VFIO_REGION_INFO_FLAG_MMAP,
};
use vfio_client::{
    bar0_read_rtt, cfg_read, cfg_write, driver_ok, map_bar2, map_bars, negotiate, reg, set_reg,
    write_guest_slot,
};
use vfio_user::Client;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

const NR_VCPUS: u32 = 4;
const RAM: u64 = 16 << 20;
const CONFIG: u32 = VFIO_PCI_CONFIG_REGION_INDEX;

type ServeResult = Result<(), VfioUserError>;

struct Harness {
    path: PathBuf,
    monitor: Arc<TransportMonitor>,
    stats: Arc<VfioUserStats>,
    server: Option<JoinHandle<ServeResult>>,
    _dir: TempDir,
}

/// A private directory for the socket, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(tag: &str) -> TempDir {
    static N: AtomicU32 = AtomicU32::new(0);
    let p = std::env::temp_dir().join(format!(
        "pvsched-vfio-user-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&p).expect("temp dir");
    TempDir(p)
}

fn model() -> PvschedDevice {
    PvschedDevice::new(DeviceConfig::new(NR_VCPUS), Arc::new(NullSink)).expect("device")
}

impl Harness {
    fn start(tag: &str) -> Harness {
        let dir = temp_dir(tag);
        let path = dir.0.join("sock");
        let monitor = Arc::new(TransportMonitor::new());
        let backend = VfioUserDevice::new(model(), monitor.clone()).expect("backend");
        let mut server = VfioUserServer::bind(&path, backend).expect("bind");
        let stats = server.stats();
        let handle = std::thread::spawn(move || server.serve());
        Harness {
            path,
            monitor,
            stats,
            server: Some(handle),
            _dir: dir,
        }
    }

    fn client(&self) -> Client {
        Client::new(&self.path).expect("vfio-user client connects")
    }

    fn finish(mut self) -> ServeResult {
        self.server
            .take()
            .expect("server thread")
            .join()
            .expect("server thread did not panic")
    }
}

fn guest_ram() -> File {
    pvsched_testkit::sealed_memfd(c"guest-ram", RAM)
}

const OK: u32 =
    abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER | abi::STATUS_FEATURES_OK | abi::STATUS_DRIVER_OK;

#[test]
fn realize_reports_regions_and_bar2_fd() {
    let h = Harness::start("realize");
    let c = h.client();
    let bar0 = c.region(u32::from(abi::REG_BAR)).expect("BAR0 region");
    assert_eq!(bar0.size, u64::from(abi::REG_BAR_SIZE));
    assert_eq!(
        bar0.flags & VFIO_REGION_INFO_FLAG_MMAP,
        0,
        "BAR0 is not mmapable"
    );
    assert!(bar0.file_offset.is_none());
    let bar2 = c.region(u32::from(abi::REGION_BAR)).expect("BAR2 region");
    assert_eq!(bar2.size, PvschedDevice::region_bar_size(NR_VCPUS));
    assert_ne!(bar2.flags & VFIO_REGION_INFO_FLAG_MMAP, 0);
    let fo = bar2.file_offset.as_ref().expect("BAR2 carries its fd");
    assert_eq!(fo.start(), 0);
    assert_eq!(
        fo.file().metadata().expect("stat").len(),
        PvschedDevice::region_bar_size(NR_VCPUS),
        "the fd is exactly the BAR2 backing"
    );
    assert_eq!(bar2.sparse_areas.len(), 1);
    assert_eq!(bar2.sparse_areas[0].size, bar2.size);
    assert_eq!(c.region(CONFIG).expect("config").size, 256);
    for i in 0..VFIO_PCI_NUM_REGIONS {
        assert!(c.region(i).is_some(), "region {i} declared");
    }
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

#[test]
fn config_space_ids_and_bar_sizing_match_the_model() {
    let h = Harness::start("config");
    let mut c = h.client();
    let mut m = model();
    for dword in 0..16 {
        assert_eq!(
            cfg_read(&mut c, dword),
            m.read_config_register(dword as usize),
            "config dword {dword}"
        );
    }
    assert_eq!(
        cfg_read(&mut c, 0),
        u32::from(abi::PCI_VENDOR_ID) | u32::from(abi::PCI_DEVICE_ID) << 16
    );
    for bar in 0..6u32 {
        cfg_write(&mut c, 4 + bar, 0xffff_ffff);
        m.write_config_register(4 + bar as usize, 0, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(
            cfg_read(&mut c, 4 + bar),
            m.read_config_register(4 + bar as usize),
            "BAR{bar} sizing"
        );
    }
    let bar0_mask = cfg_read(&mut c, 4) & !0xf;
    assert_eq!(!bar0_mask + 1, abi::REG_BAR_SIZE);
    let bar2_mask = cfg_read(&mut c, 6) & !0xf;
    assert_eq!(
        u64::from(!bar2_mask) + 1,
        PvschedDevice::region_bar_size(NR_VCPUS)
    );
    // Sub-dword access: the device ID alone.
    let mut b = [0u8; 2];
    c.region_read(CONFIG, 2, &mut b).expect("2-byte read");
    assert_eq!(u16::from_le_bytes(b), abi::PCI_DEVICE_ID);
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

#[test]
fn device_region_handshake_and_slot_updates_cross_no_socket() {
    let h = Harness::start("device");
    let mut c = h.client();
    map_bars(&mut c);
    negotiate(&mut c, abi::F_DEVICE_REGION | abi::F_WAIT_ON | abi::F_KICK);
    assert_eq!(driver_ok(&mut c), OK);
    assert_eq!(reg(&mut c, abi::REG_ERROR), abi::ERR_NONE);

    // Map BAR2 through the fd the server sent.
    let map = map_bar2(&c);
    let base = map.as_ptr();
    // The header the device wrote at DRIVER_OK is visible through the mmap.
    let mut magic = [0u8; 4];
    // SAFETY: `map` is a live mapping of at least 64 bytes.
    unsafe { std::ptr::copy_nonoverlapping(base, magic.as_mut_ptr(), 4) };
    assert_eq!(u32::from_le_bytes(magic), abi::REGION_MAGIC);

    let view = h.monitor.snapshot().view.expect("device region attached");
    let before = h.stats.messages();
    const UPDATES: u64 = 100_000;
    for i in 1..=UPDATES {
        // SAFETY: `map` covers region_bar_size(NR_VCPUS) >= region_size bytes
        // and lives until the end of the test.
        unsafe { write_guest_slot(base, NR_VCPUS, 1, (i % 20) as i32, i) };
    }
    let after = h.stats.messages();
    assert_eq!(
        before, after,
        "slot updates through the mmap crossed the socket"
    );
    let slot = view.read_guest_slot(1).expect("slot readable");
    assert_eq!(slot.updates, UPDATES);
    assert_eq!(slot.nice, (UPDATES % 20) as i32);
    assert_eq!(slot.seq, (UPDATES * 2) as u32);
    println!("messages before/after {UPDATES} slot updates: {before}/{after}");

    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

#[test]
fn guest_region_handshake_after_dma_map() {
    let h = Harness::start("guest");
    let mut c = h.client();
    let ram = guest_ram();
    c.dma_map(0, 0, RAM, ram.as_raw_fd()).expect("DMA_MAP");
    negotiate(&mut c, abi::F_GUEST_REGION | abi::F_WAIT_ON);
    let gpa = 0x10_0000u64;
    let size = reg(&mut c, abi::REG_REGION_SIZE);
    set_reg(&mut c, abi::REG_SHM_GPA_LO, gpa as u32);
    set_reg(&mut c, abi::REG_SHM_GPA_HI, (gpa >> 32) as u32);
    set_reg(&mut c, abi::REG_SHM_SIZE, size);
    assert_eq!(driver_ok(&mut c), OK);
    // The device wrote the header into the memfd.
    let mut b = [0u8; 4];
    ram.read_exact_at(&mut b, gpa).expect("pread");
    assert_eq!(u32::from_le_bytes(b), abi::REGION_MAGIC);
    // A guest slot written into RAM is seen by the server's view.
    let g = abi::SlotGuest {
        seq: 2,
        nice: -5,
        updates: 7,
        ..Default::default()
    };
    let off = gpa + u64::from(abi::slot_offset(NR_VCPUS, 2));
    ram.write_all_at(vm_memory::ByteValued::as_slice(&g), off)
        .expect("pwrite");
    let view = h.monitor.snapshot().view.expect("guest region attached");
    let s = view.read_guest_slot(2).expect("slot");
    assert_eq!((s.nice, s.updates), (-5, 7));

    // More RAM mapped while attached: the region is re-resolved and stays
    // attached.
    let more = guest_ram();
    c.dma_map(0, 1 << 32, RAM, more.as_raw_fd())
        .expect("DMA_MAP");
    assert_eq!(reg(&mut c, abi::REG_STATUS), OK);
    let view = h.monitor.snapshot().view.expect("still attached");
    assert_eq!(view.read_guest_slot(2).expect("slot").nice, -5);

    // Unmapping the RAM under an attached region: the device needs a reset.
    c.dma_unmap(0, RAM).expect("DMA_UNMAP");
    assert_ne!(
        reg(&mut c, abi::REG_STATUS) & abi::STATUS_DEVICE_NEEDS_RESET,
        0
    );
    assert!(!view.is_attached());
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

/// ERROR the model gives for a guest region at `gpa` of `size` bytes over
/// the same RAM.
fn model_error(ram: &File, gpa: u64, size: u32) -> u32 {
    let mut m = model();
    let mem = GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0),
        RAM as usize,
        Some(FileOffset::new(ram.try_clone().expect("dup"), 0)),
    )])
    .expect("map RAM");
    m.set_guest_memory(mem);
    guest_handshake(&mut m, gpa, size);
    m.error()
}

#[test]
fn invalid_guest_regions_refused_like_the_model() {
    let ram = guest_ram();
    let size = abi::region_size(NR_VCPUS);
    let cases = [
        ("outside RAM", RAM + 0x1000, size),
        ("unaligned", 0x10_0010, size),
        ("straddles the end of RAM", RAM - 0x1000, size.max(0x2000)),
        ("too small", 0x10_0000, 64),
    ];
    for (what, gpa, sz) in cases {
        let h = Harness::start("invalid");
        let mut c = h.client();
        c.dma_map(0, 0, RAM, ram.as_raw_fd()).expect("DMA_MAP");
        negotiate(&mut c, abi::F_GUEST_REGION);
        set_reg(&mut c, abi::REG_SHM_GPA_LO, gpa as u32);
        set_reg(&mut c, abi::REG_SHM_GPA_HI, (gpa >> 32) as u32);
        set_reg(&mut c, abi::REG_SHM_SIZE, sz);
        let status = driver_ok(&mut c);
        let err = reg(&mut c, abi::REG_ERROR);
        let expected = model_error(&ram, gpa, sz);
        assert_ne!(expected, abi::ERR_NONE, "{what}: the model refuses it");
        assert_eq!(err, expected, "{what}: same ERROR as the model");
        assert_eq!(status & abi::STATUS_DRIVER_OK, 0, "{what}: not attached");
        assert!(h.monitor.snapshot().view.is_none());
        c.shutdown().expect("shutdown");
        h.finish().expect("clean end");
    }
    assert_eq!(
        model_error(&ram, RAM + 0x1000, size),
        abi::ERR_REGION_OUTSIDE_RAM
    );
    assert_eq!(
        model_error(&ram, 0x10_0010, size),
        abi::ERR_REGION_UNALIGNED
    );
}

#[test]
fn bad_dma_maps_are_refused_and_counted() {
    let h = Harness::start("dma");
    let mut c = h.client();
    let ram = guest_ram();
    // Beyond the file, wrapping, overlapping.
    c.dma_map(0, 0, RAM * 2, ram.as_raw_fd()).expect("answered");
    c.dma_map(0, u64::MAX - 0xfff, 0x2000, ram.as_raw_fd())
        .expect("answered");
    c.dma_map(0, 0, RAM, ram.as_raw_fd()).expect("DMA_MAP");
    c.dma_map(0, RAM / 2, 0x1000, ram.as_raw_fd())
        .expect("answered");
    // A read-only fd cannot be mapped shared read-write.
    let ro = File::open(format!("/proc/self/fd/{}", ram.as_raw_fd())).expect("reopen read-only");
    c.dma_map(0, RAM * 4, 0x1000, ro.as_raw_fd())
        .expect("answered");
    assert_eq!(h.stats.dma_refused.load(Ordering::SeqCst), 4);
    // The first map was kept: a guest region in it attaches.
    negotiate(&mut c, abi::F_GUEST_REGION);
    let gpa = 0x20_0000u64;
    set_reg(&mut c, abi::REG_SHM_GPA_LO, gpa as u32);
    set_reg(&mut c, abi::REG_SHM_GPA_HI, 0);
    set_reg(&mut c, abi::REG_SHM_SIZE, abi::region_size(NR_VCPUS));
    assert_eq!(driver_ok(&mut c), OK);
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

#[test]
fn device_reset_clears_status_and_detaches() {
    let h = Harness::start("reset");
    let mut c = h.client();
    map_bars(&mut c);
    negotiate(&mut c, abi::F_DEVICE_REGION);
    assert_eq!(driver_ok(&mut c), OK);
    let view = h.monitor.snapshot().view.expect("attached");
    c.reset().expect("DEVICE_RESET");
    assert_eq!(reg(&mut c, abi::REG_STATUS), abi::STATUS_RESET);
    assert!(!view.is_attached());
    assert_eq!(h.monitor.snapshot().resets_seen, 1);
    // And the device can be brought up again.
    negotiate(&mut c, abi::F_DEVICE_REGION);
    assert_eq!(driver_ok(&mut c), OK);
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

#[test]
fn out_of_range_accesses_are_answered_without_panic() {
    let h = Harness::start("oob");
    let mut c = h.client();
    let mut b8 = [0u8; 8];
    for (region, offset) in [
        (u32::from(abi::REG_BAR), u64::from(abi::REG_BAR_SIZE)),
        (u32::from(abi::REG_BAR), u64::MAX - 3),
        (CONFIG, 252),
        (
            u32::from(abi::REGION_BAR),
            PvschedDevice::region_bar_size(NR_VCPUS) - 4,
        ),
        (1, 0),
        (6, 0),
    ] {
        c.region_read(region, offset, &mut b8).expect("answered");
        assert_eq!(b8, [0xff; 8], "region {region} offset {offset:#x}");
        c.region_write(region, offset, &[0xaa; 8])
            .expect("answered");
    }
    // A 3-byte BAR0 access is not a register access.
    let mut b3 = [0u8; 3];
    c.region_read(u32::from(abi::REG_BAR), 0, &mut b3)
        .expect("answered");
    assert_eq!(b3, [0xff; 3]);
    assert!(h.stats.stray.load(Ordering::SeqCst) >= 13);
    assert_eq!(reg(&mut c, abi::REG_MAGIC), abi::MAGIC, "still serving");
    assert_eq!(reg(&mut c, abi::REG_STATUS), 0, "no stray write applied");
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

/// Raw vfio-user header.
fn header(id: u16, command: u16, size: u32) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&command.to_le_bytes());
    v.extend_from_slice(&size.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v
}

#[test]
fn unknown_command_gets_an_error_reply() {
    let h = Harness::start("unknown");
    let mut s = UnixStream::connect(&h.path).expect("connect");
    s.write_all(&header(7, 99, 16)).expect("send");
    let mut r = [0u8; 16];
    s.read_exact(&mut r).expect("reply");
    let flags = u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"));
    assert_eq!(u16::from_le_bytes([r[0], r[1]]), 7, "reply to message 7");
    assert_ne!(flags & (1 << 5), 0, "error flag set");
    drop(s);
    h.finish().expect("clean end");
}

#[test]
fn malformed_version_gets_an_error_reply_and_serving_continues() {
    // VERSION whose capability string lacks its NUL (vfio_user 0.1.7
    // panicked on it), then one whose JSON is not JSON: both refused with
    // EINVAL, and the connection keeps serving.
    let h = Harness::start("version");
    let mut s = UnixStream::connect(&h.path).expect("connect");
    for (id, data) in [(1u16, &b"{}"[..]), (2, &b"{not json}\0"[..])] {
        let mut msg = header(id, 1, (16 + 4 + data.len()) as u32);
        msg.extend_from_slice(&[0, 0, 0, 0]);
        msg.extend_from_slice(data);
        s.write_all(&msg).expect("send");
        let mut r = [0u8; 16];
        s.read_exact(&mut r).expect("reply");
        assert_eq!(u16::from_le_bytes([r[0], r[1]]), id);
        if id == 1 {
            // A capability string without its NUL is still valid JSON.
            assert_eq!(reply_flags(&r) & (1 << 5), 0, "accepted");
            let size = u32::from_le_bytes(r[4..8].try_into().expect("4 bytes")) as usize;
            let mut rest = vec![0u8; size - 16];
            s.read_exact(&mut rest).expect("version reply body");
        } else {
            assert_ne!(reply_flags(&r) & (1 << 5), 0, "refused");
            assert_eq!(u32::from_le_bytes(r[12..16].try_into().expect("4")), 22);
        }
    }
    s.write_all(&raw_region_read(3, 0, u64::from(abi::REG_MAGIC), 4))
        .expect("send");
    let mut r = [0u8; 36];
    s.read_exact(&mut r).expect("reply");
    assert_eq!(
        u32::from_le_bytes(r[32..36].try_into().expect("4")),
        abi::MAGIC
    );
    drop(s);
    h.finish().expect("clean end");
}

#[test]
fn bar0_round_trip_latency_measured() {
    let h = Harness::start("latency");
    let mut c = h.client();
    const N: usize = 10_000;
    let rtt = bar0_read_rtt(&mut c, N);
    println!(
        "vfio-user BAR0 read round trip over {N} reads: p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        rtt.p50_us, rtt.p99_us, rtt.max_us
    );
    c.shutdown().expect("shutdown");
    h.finish().expect("clean end");
}

/// A raw REGION_READ message.
fn raw_region_read(id: u16, region: u32, offset: u64, count: u32) -> Vec<u8> {
    let mut v = header(id, 9, 32);
    v.extend_from_slice(&offset.to_le_bytes());
    v.extend_from_slice(&region.to_le_bytes());
    v.extend_from_slice(&count.to_le_bytes());
    v
}

fn reply_flags(r: &[u8]) -> u32 {
    u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"))
}

#[test]
fn raw_hostile_messages_get_error_replies_and_serving_continues() {
    let h = Harness::start("raw");
    let mut s = UnixStream::connect(&h.path).expect("connect");
    // A 4 GiB read, a read of a region that does not exist.
    for (id, region, count) in [(1u16, 0u32, u32::MAX), (2, 50, 4)] {
        s.write_all(&raw_region_read(id, region, 0, count))
            .expect("send");
        let mut r = [0u8; 16];
        s.read_exact(&mut r).expect("error reply");
        assert_eq!(u16::from_le_bytes([r[0], r[1]]), id);
        assert_ne!(reply_flags(&r) & (1 << 5), 0, "error flag for message {id}");
    }
    // A well-formed read still works on the same connection.
    s.write_all(&raw_region_read(3, 0, u64::from(abi::REG_MAGIC), 4))
        .expect("send");
    let mut r = [0u8; 36];
    s.read_exact(&mut r).expect("reply");
    assert_eq!(reply_flags(&r) & (1 << 5), 0);
    assert_eq!(
        u32::from_le_bytes(r[32..36].try_into().expect("4 bytes")),
        abi::MAGIC
    );
    drop(s);
    h.finish().expect("clean end");
}

#[test]
fn short_version_message_gets_an_error_reply() {
    // message_size smaller than VERSION's fixed part: vfio_user 0.1.7
    // subtracted without checking (a panic in debug, a huge allocation in
    // release). Now the whole message is read and refused with EINVAL.
    let h = Harness::start("short-version");
    let mut s = UnixStream::connect(&h.path).expect("connect");
    let mut msg = header(1, 1, 18);
    msg.extend_from_slice(&[1, 0]);
    s.write_all(&msg).expect("send");
    let mut r = [0u8; 16];
    s.read_exact(&mut r).expect("reply");
    assert_ne!(reply_flags(&r) & (1 << 5), 0, "refused");
    assert_eq!(u32::from_le_bytes(r[12..16].try_into().expect("4")), 22);
    drop(s);
    h.finish().expect("clean end");
}

#[test]
fn every_path_a_socket_address_holds_binds() {
    // The socket is bound under a temporary name first: that name must not
    // make a path that fits a socket address (< 108 bytes) fail, whether
    // its file name is long or short.
    let dir = temp_dir("long-paths");
    let base = dir.0.as_os_str().len();
    for (len, name_len) in [(100, 12), (107, 20), (107, 3), (106, 1)] {
        // A directory whose path makes the whole `len` bytes long.
        let sub_len = len - base - 2 - name_len;
        let sub = dir.0.join("d".repeat(sub_len));
        std::fs::create_dir_all(&sub).expect("subdir");
        let path = sub.join("s".repeat(name_len));
        assert_eq!(path.as_os_str().len(), len);
        let backend = VfioUserDevice::new(model(), Arc::new(TransportMonitor::new())).unwrap();
        let server = VfioUserServer::bind(&path, backend)
            .unwrap_or_else(|e| panic!("{len}-byte path, {name_len}-byte name: {e}"));
        assert!(path.exists(), "{len}: the socket is in place");
        let left: Vec<_> = std::fs::read_dir(&sub)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "{len}: only the socket is left: {left:?}");
        drop(server);
        let _ = std::fs::remove_file(&path);
    }
    let path = dir.0.join("x".repeat(108 - base - 1));
    assert_eq!(path.as_os_str().len(), 108);
    let backend = VfioUserDevice::new(model(), Arc::new(TransportMonitor::new())).unwrap();
    let e = VfioUserServer::bind(&path, backend)
        .err()
        .expect("108 bytes do not fit");
    assert!(e.to_string().contains("108 bytes"), "{e}");
    assert!(!path.exists());
}
