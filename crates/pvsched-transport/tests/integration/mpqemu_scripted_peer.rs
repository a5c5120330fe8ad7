//! The mpqemu transport against a scripted peer that replays what QEMU 7.2's
//! `x-pci-proxy-dev` sends: realize (config reads), BAR sizing, SYNC_SYSMEM
//! storms with memfds, the driver's handshake over BAR_WRITE/BAR_READ,
//! malformed messages, SET_IRQFD and DEVICE_RESET.
//!
//! Assertions are on the values QEMU would get back and on the bytes the
//! device wrote into guest RAM (the memfd), not on logs.

use crate::common;

use common::{BAR0, Qemu, REGION_GPA};
use nix::sys::eventfd::EventFd;
use pvsched_abi as abi;
use pvsched_transport::fault::Fault;
use pvsched_transport::mpqemu::message::*;
use std::os::unix::fs::FileExt;

#[test]
fn qemu_7_2_session() {
    let mut q = Qemu::start(None);
    // Memory topology settles while the machine is built: a storm of syncs.
    for _ in 0..55 {
        q.sync_sysmem();
    }
    let sizes = q.realize();
    assert_eq!(
        sizes[0],
        !(abi::REG_BAR_SIZE - 1),
        "BAR0: 4 KiB, 32-bit MMIO"
    );
    assert_eq!(
        &sizes[1..],
        &[0; 6],
        "no other BARs over mpqemu (no BAR2, no CIS)"
    );
    q.program_bar0();

    let status = q.handshake(REGION_GPA);
    assert_eq!(status & abi::STATUS_DRIVER_OK, abi::STATUS_DRIVER_OK);
    assert_eq!(
        q.ram_u32(REGION_GPA),
        abi::REGION_MAGIC,
        "header written into guest RAM"
    );
    assert_eq!(q.ram_u32(REGION_GPA + 8), 2, "nr_vcpus in the header");

    // The guest writes slot 1 (FIFO 8); the device's view reads it back.
    let slots = u64::from(abi::slots_offset(2));
    let slot1 = REGION_GPA + slots + u64::from(abi::SLOT_SIZE);
    for (off, v) in [
        (4u64, abi::CS_HARDIRQ),
        (8, abi::POLICY_FIFO),
        (16, 8),
        (0, 2),
    ] {
        q.ram
            .write_all_at(&v.to_le_bytes(), slot1 + off)
            .expect("pwrite");
    }
    let _ = q.reg(abi::REG_STATUS); // one round trip: the monitor is updated
    let view = q.monitor.snapshot().view.expect("attached region view");
    let g = view.read_guest_slot(1).expect("slot 1");
    assert_eq!(
        (g.policy, g.rt_prio, g.kern_cs),
        (abi::POLICY_FIFO, 8, abi::CS_HARDIRQ)
    );

    // Remapping guest RAM (same layout) keeps the region attached.
    for _ in 0..10 {
        q.sync_sysmem();
    }
    assert_eq!(
        q.reg(abi::REG_STATUS) & abi::STATUS_DRIVER_OK,
        abi::STATUS_DRIVER_OK
    );

    // Malformed requests are answered (reads all-ones) and the stream stays in sync.
    q.send(CMD_BAR_READ, &bar_payload(BAR0, 0, 3, true), &[]);
    assert_eq!(q.ret(), u64::MAX);
    q.send(99, &[0; 8], &[]);
    q.send(CMD_PCI_CFGREAD, &[0; 4], &[]);
    assert_eq!(q.ret(), u64::MAX);
    // A BAR access outside every decoded BAR.
    assert_eq!(q.bar_read(0xdead_0000), u32::MAX);
    assert_eq!(q.reg(abi::REG_MAGIC), abi::MAGIC);

    // Interrupt eventfds: kept, no reply.
    let irq = EventFd::new().expect("eventfd");
    let resample = EventFd::new().expect("eventfd");
    q.send(CMD_SET_IRQFD, &[], &[&irq, &resample]);

    // DEVICE_RESET answers RET and detaches the region.
    q.send(CMD_DEVICE_RESET, &[], &[]);
    assert_eq!(q.ret(), 0);
    assert_eq!(q.reg(abi::REG_STATUS), 0);

    // A second handshake works and bumps GENERATION.
    assert_eq!(
        q.handshake(REGION_GPA) & abi::STATUS_DRIVER_OK,
        abi::STATUS_DRIVER_OK
    );
    assert_eq!(q.reg(abi::REG_GENERATION), 2);

    let m = q.close().snapshot();
    assert!(m.disconnected);
    assert_eq!(m.malformed, 3);
    assert_eq!(m.stray_bar_accesses, 1);
    assert_eq!(m.messages.get("sync_sysmem"), Some(&65));
    assert_eq!(m.messages.get("set_irqfd"), Some(&1));
    assert_eq!(m.generation, 2);
    assert!(m.resets_seen >= 1);
}

#[test]
fn region_outside_ram_is_refused() {
    let mut q = Qemu::start(None);
    q.sync_sysmem();
    q.realize();
    q.program_bar0();
    // Inside the VGA hole: not RAM.
    let status = q.handshake(0xa_0000);
    assert_eq!(status & abi::STATUS_FAILED, abi::STATUS_FAILED);
    assert_eq!(q.reg(abi::REG_ERROR), abi::ERR_REGION_OUTSIDE_RAM);
    q.close();
}

#[test]
fn faults_for_the_driver_negative_tests() {
    let mut q = Qemu::start(Some(Fault::WrongVersion));
    q.sync_sysmem();
    q.realize();
    q.program_bar0();
    assert_eq!(
        abi::version_major(q.reg(abi::REG_VERSION)),
        abi::ABI_MAJOR + 1
    );
    q.close();

    let mut q = Qemu::start(Some(Fault::RefuseRegion));
    q.sync_sysmem();
    q.realize();
    q.program_bar0();
    let status = q.handshake(REGION_GPA);
    assert_eq!(status & abi::STATUS_FAILED, abi::STATUS_FAILED);
    assert_eq!(q.reg(abi::REG_ERROR), abi::ERR_REGION_OUTSIDE_RAM);
    q.close();
}

#[test]
fn peer_closing_mid_message_ends_the_session() {
    let q = Qemu::start(None);
    // Half a header, then EOF.
    let n = nix::unistd::write(&q.sock, &[1, 2, 3]).expect("write");
    assert_eq!(n, 3);
    let (tx, rx) = std::sync::mpsc::channel();
    let Qemu {
        sock,
        peer,
        monitor,
        ..
    } = q;
    drop(sock);
    std::thread::spawn(move || {
        let r = peer.map(|p| p.join().expect("peer thread"));
        let _ = tx.send(r);
    });
    // serve() ends with an error (short read) rather than hanging.
    let served_ok = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("peer ended");
    assert_eq!(served_ok, Some(false));
    assert!(monitor.snapshot().disconnected);
}
