//! Configuration space through the `PciDevice` trait: identity, BAR sizing,
//! partial writes, and `BarChange` reporting.

use pvsched_abi as abi;
use pvsched_device::testing::cfg_write;
use pvsched_device::{
    BarChange, BarIndex, DeviceConfig, NullSink, PciDevice, PciIds, PvschedDevice,
};
use std::sync::Arc;

fn dev(nr: u32, features: u64) -> PvschedDevice {
    let mut c = DeviceConfig::new(nr);
    c.features = features;
    PvschedDevice::new(c, Arc::new(NullSink)).unwrap()
}

#[test]
fn identity_and_overrides() {
    let d = dev(2, abi::F_ALL);
    assert_eq!(d.read_config_register(0), 0x5c4e_5056);
    assert_eq!(d.read_config_register(2) >> 8, abi::PCI_CLASS);
    assert_eq!(
        d.read_config_register(2) & 0xff,
        u32::from(abi::PCI_REVISION)
    );
    assert_eq!(d.read_config_register(3) >> 16 & 0xff, 0, "header type 0");
    assert_eq!(d.read_config_register(11), 0x0001_5056);
    assert_eq!(d.read_config_register(13), 0, "no capabilities");
    assert_eq!(
        d.read_config_register(15) >> 8 & 0xff,
        0,
        "interrupt pin none"
    );
    assert_eq!(d.read_config_register(64), 0xffff_ffff);
    assert_eq!(d.read_config_register(usize::MAX), 0xffff_ffff);
    let mut c = DeviceConfig::new(1);
    c.ids = PciIds {
        vendor: 0x1af4,
        device: 0x1234,
        subsys_vendor: 0x1af4,
        subsys: 7,
        revision: 9,
    };
    let d = PvschedDevice::new(c, Arc::new(NullSink)).unwrap();
    assert_eq!(d.read_config_register(0), 0x1234_1af4);
    assert_eq!(d.read_config_register(11), 0x0007_1af4);
    assert_eq!(d.read_config_register(2) & 0xff, 9);
}

#[test]
fn bar_sizing() {
    let mut d = dev(64, abi::F_ALL);
    let bar2_size = PvschedDevice::region_bar_size(64) as u32;
    assert_eq!(bar2_size, 0x4000);
    for idx in 4..=9 {
        cfg_write(&mut d, idx, 0xffff_ffff);
    }
    assert_eq!(
        d.read_config_register(4),
        0xffff_f000,
        "BAR0: 4 KiB, 32-bit, non-prefetchable"
    );
    assert_eq!(
        d.read_config_register(6),
        !(bar2_size - 1) | 0x8,
        "BAR2: prefetchable"
    );
    for idx in [5, 7, 8, 9] {
        assert_eq!(d.read_config_register(idx), 0, "absent BAR dword {idx}");
    }
    cfg_write(&mut d, 12, 0xffff_ffff);
    assert_eq!(d.read_config_register(12), 0, "no expansion ROM");
    // Without F_DEVICE_REGION there is no BAR2.
    let mut d = dev(2, abi::F_GUEST_REGION | abi::F_KICK);
    cfg_write(&mut d, 6, 0xffff_ffff);
    assert_eq!(d.read_config_register(6), 0);
    assert_eq!(d.bars().len(), 1);
}

#[test]
fn byte_and_word_writes() {
    let mut d = dev(2, abi::F_ALL);
    // Program BAR0 byte by byte (little endian), like a guest doing outb.
    for (i, b) in 0xfebf_1000u32.to_le_bytes().iter().enumerate() {
        d.write_config_register(4, i as u64, &[*b]);
    }
    assert_eq!(d.read_config_register(4), 0xfebf_1000);
    // Word write to the upper half only.
    d.write_config_register(4, 2, &0xfe00u16.to_le_bytes());
    assert_eq!(d.read_config_register(4), 0xfe00_1000);
    // COMMAND via a word write, STATUS half ignored.
    d.write_config_register(1, 0, &0xffffu16.to_le_bytes());
    assert_eq!(d.read_config_register(1), 0x0547);
    d.write_config_register(1, 2, &0xffffu16.to_le_bytes());
    assert_eq!(d.read_config_register(1) >> 16, 0, "status reads 0");
    // Interrupt line is writable, pin is not.
    d.write_config_register(15, 0, &0xffffu16.to_le_bytes());
    assert_eq!(d.read_config_register(15), 0xff);
    // Invalid offsets and lengths are ignored.
    let before = d.read_config_register(4);
    d.write_config_register(4, 3, &[0, 0]);
    d.write_config_register(4, 4, &[0]);
    d.write_config_register(4, 0, &[0; 8]);
    d.write_config_register(4, 0, &[]);
    d.write_config_register(99, 0, &[0; 4]);
    assert_eq!(d.read_config_register(4), before);
}

#[test]
fn bar_changes_reported() {
    let mut d = dev(2, abi::F_ALL);
    // Program BAR2 while memory decoding is off: no change.
    assert!(cfg_write(&mut d, 6, 0xc000_0000).bar_changes.is_empty());
    assert!(cfg_write(&mut d, 4, 0xfebf_0000).bar_changes.is_empty());
    // Enabling memory decodes both BARs.
    let r = d.write_config_register(1, 0, &[0x02]);
    assert_eq!(
        r.bar_changes,
        vec![
            BarChange {
                index: BarIndex(0),
                old: None,
                new: Some(0xfebf_0000)
            },
            BarChange {
                index: BarIndex(2),
                old: None,
                new: Some(0xc000_0000)
            },
        ]
    );
    let bars = d.bars();
    assert_eq!(bars[1].address, Some(0xc000_0000));
    assert!(bars[1].prefetchable && !bars[0].prefetchable);
    // Moving BAR2.
    let r = cfg_write(&mut d, 6, 0xd000_0000);
    assert_eq!(
        r.bar_changes,
        vec![BarChange {
            index: BarIndex(2),
            old: Some(0xc000_0000),
            new: Some(0xd000_0000)
        }]
    );
    // Sizing while decoded: the sizing pattern is not an address.
    let r = cfg_write(&mut d, 6, 0xffff_ffff);
    assert_eq!(
        r.bar_changes,
        vec![BarChange {
            index: BarIndex(2),
            old: Some(0xd000_0000),
            new: None
        }]
    );
    let r = cfg_write(&mut d, 6, 0xd000_0000);
    assert_eq!(r.bar_changes[0].new, Some(0xd000_0000));
    // Disabling memory undecodes both.
    let r = d.write_config_register(1, 0, &[0x00]);
    assert_eq!(r.bar_changes.len(), 2);
    assert!(r.bar_changes.iter().all(|c| c.new.is_none()));
    // Writes that change nothing decoded report nothing.
    assert!(cfg_write(&mut d, 3, 0x10).bar_changes.is_empty());
}
