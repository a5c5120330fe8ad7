//! What a device in its own process tells its VMM: typed [`DeviceEvent`]s,
//! and how the VMM turns a reported region into a [`RegionView`] of its own
//! ([`view_of_reported_region`]).
//!
//! The device process is the only owner of the device's state. A VMM that
//! runs it out of process still has to drive its policy sink
//! ([`PolicySink`](crate::PolicySink)) and hand out region views with host
//! addresses in its own address space, so the device process sends one
//! event for each sink call it makes (attach, detach, kick), together with
//! the register state the VMM needs to answer for a lost device.
//!
//! Wire format: one event per message of a `SOCK_SEQPACKET` socket, as
//! JSON, at most [`MAX_EVENT_SIZE`] bytes. The VMM treats every byte as
//! untrusted: [`DeviceEvent::decode`] refuses anything oversized, malformed
//! or with unknown fields, and the VMM checks the values against its own
//! configuration and memory before it acts on them.

use crate::region::{self, RegionInfo, RegionMode, RegionView};
use crate::registers::RegisterState;
use pvsched_abi as abi;
use serde::{Deserialize, Serialize};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use vm_memory::{GuestMemoryMmap, MmapRegion};

/// Largest encoded event. The largest real one (an attach with every
/// register at its maximum) is about 330 bytes.
pub const MAX_EVENT_SIZE: usize = 512;

/// Most events one access can cause is three (an 8-byte STATUS write:
/// detach, attach; a DMA map: detach, attach); more than this many waiting
/// at once is a flood from a device that is not following the protocol.
pub const MAX_EVENTS_PER_DRAIN: usize = 16;

/// A region as the device attached it, without the device's host address
/// (meaningless in another process).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportedRegion {
    /// Region mode.
    pub mode: RegionMode,
    /// GENERATION at attach (also in the region header).
    pub generation: u32,
    /// Number of slots.
    pub nr_vcpus: u32,
    /// Size in bytes (guest mode: SHM_SIZE; device mode: BAR2 size).
    pub size: u64,
    /// Guest-physical start (guest mode: SHM_GPA; device mode: BAR2 base).
    pub guest_addr: u64,
}

impl From<&RegionInfo> for ReportedRegion {
    fn from(i: &RegionInfo) -> Self {
        Self {
            mode: i.mode,
            generation: i.generation,
            nr_vcpus: i.nr_vcpus,
            size: i.size,
            guest_addr: i.guest_addr,
        }
    }
}

/// Why the region was detached, as the device's registers show it right
/// after the access that detached it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DetachReason {
    /// The guest reset the device (STATUS = 0).
    Reset,
    /// The device refused or failed (STATUS has FAILED; ERROR says why,
    /// e.g. the guest changed SHM_* while attached).
    Failed,
    /// The device cannot continue (DEVICE_NEEDS_RESET).
    NeedsReset,
    /// The region was detached while the handshake stands: it is being
    /// re-attached at another host address (an attach event follows).
    Moved,
}

impl DetachReason {
    /// The reason the registers `r` show.
    pub fn from_registers(r: &RegisterState) -> Self {
        if r.status == abi::STATUS_RESET {
            Self::Reset
        } else if r.status & abi::STATUS_DEVICE_NEEDS_RESET != 0 {
            Self::NeedsReset
        } else if r.status & abi::STATUS_FAILED != 0 {
            Self::Failed
        } else {
            Self::Moved
        }
    }
}

/// One thing that happened in the device, for the VMM's side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceEvent {
    /// The device attached a region (DRIVER_OK, or re-attached after a
    /// move). `registers` is the register file after the access.
    RegionAttached {
        /// Where the region is.
        region: ReportedRegion,
        /// The device's registers after the access that attached it.
        registers: RegisterState,
    },
    /// The device detached the region.
    RegionDetached {
        /// Why.
        why: DetachReason,
        /// The device's registers after the access that detached it.
        registers: RegisterState,
    },
    /// The guest kicked `slot` (a valid slot index, while DRIVER_OK).
    Kick {
        /// Slot index.
        slot: u32,
    },
}

/// Why an event was refused.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// Larger than [`MAX_EVENT_SIZE`].
    #[error("event of {0} bytes is larger than {MAX_EVENT_SIZE}")]
    TooLarge(usize),
    /// Not a well-formed event.
    #[error("malformed event: {0}")]
    Malformed(String),
    /// The device closed the event socket.
    #[error("the event socket was closed")]
    Closed,
    /// More events waiting at once than one access can cause.
    #[error("more than {0} events at once")]
    TooMany(usize),
    /// Reading the event socket failed.
    #[error("reading the event socket: {0}")]
    Io(#[from] std::io::Error),
}

impl DeviceEvent {
    /// The event as one message (JSON).
    pub fn encode(&self) -> Vec<u8> {
        // Serialising these plain structs cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// An event from one untrusted message.
    ///
    /// ```
    /// use pvsched_device::event::DeviceEvent;
    /// let e = DeviceEvent::Kick { slot: 3 };
    /// assert_eq!(DeviceEvent::decode(&e.encode()).unwrap(), e);
    /// assert!(DeviceEvent::decode(b"{\"event\":\"kick\"}").is_err());
    /// assert!(DeviceEvent::decode(&[b' '; 4096]).is_err());
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<Self, EventError> {
        if bytes.len() > MAX_EVENT_SIZE {
            return Err(EventError::TooLarge(bytes.len()));
        }
        serde_json::from_slice(bytes).map_err(|e| EventError::Malformed(e.to_string()))
    }
}

/// Every event waiting on `fd` (the VMM's end of the event socket), read
/// without blocking: at most `max`. A closed socket, an oversized or
/// malformed message, or more than `max` waiting is an error: no device
/// that follows the protocol sends that.
pub fn read_ready(fd: BorrowedFd<'_>, max: usize) -> Result<Vec<DeviceEvent>, EventError> {
    let mut buf = [0u8; MAX_EVENT_SIZE];
    let mut out = Vec::new();
    while let Some(n) = pvsched_util::recv_ready(fd, &mut buf)? {
        if n == 0 {
            return Err(EventError::Closed);
        }
        if out.len() == max {
            return Err(EventError::TooMany(max));
        }
        let msg = buf.get(..n).ok_or(EventError::TooLarge(n))?;
        out.push(DeviceEvent::decode(msg)?);
    }
    Ok(out)
}

/// Build this process's view of a region the device reported, after
/// validating it against this process's own memory with the checks the
/// device makes at attach: a guest region must lie in `mem` (aligned, not
/// wrapping, large enough for `nr_vcpus`); a device region must be exactly
/// `bar2`'s mapping, at the BAR2 address `bar2_at` this process has
/// programmed. The region header is not touched. Returns the `ERR_*` code
/// the device would have refused with.
pub fn view_of_reported_region(
    r: &ReportedRegion,
    mem: Option<&GuestMemoryMmap>,
    bar2: Option<&Arc<MmapRegion>>,
    bar2_at: Option<u64>,
    apic_ids: Arc<[u32]>,
) -> Result<RegionView, u32> {
    if r.nr_vcpus == 0 || r.nr_vcpus as usize != apic_ids.len() {
        return Err(abi::ERR_REGION_TOO_SMALL);
    }
    let mapping = match r.mode {
        RegionMode::Guest => region::resolve_guest_region(mem, r.guest_addr, r.size, r.nr_vcpus)?,
        RegionMode::Device => {
            let m = region::resolve_device_region(bar2.cloned())?;
            if Some(r.guest_addr) != bar2_at {
                return Err(abi::ERR_REGION_UNMAPPED);
            }
            if m.len() as u64 != r.size {
                return Err(abi::ERR_REGION_UNAVAILABLE);
            }
            m
        }
    };
    let info = RegionInfo {
        mode: r.mode,
        generation: r.generation,
        nr_vcpus: r.nr_vcpus,
        size: r.size,
        guest_addr: r.guest_addr,
        host_addr: mapping.host_addr(),
    };
    Ok(RegionView::new(info, mapping, apic_ids))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    fn ids(n: u32) -> Arc<[u32]> {
        (0..n).collect::<Vec<_>>().into()
    }

    #[test]
    fn every_event_round_trips_within_the_size_limit() {
        let big = RegisterState {
            drv_features: u64::MAX,
            status: u32::MAX,
            error: u32::MAX,
            shm_gpa: u64::MAX,
            shm_size: u32::MAX,
            generation: u32::MAX,
            driver_version: u32::MAX,
        };
        for e in [
            DeviceEvent::RegionAttached {
                region: ReportedRegion {
                    mode: RegionMode::Guest,
                    generation: u32::MAX,
                    nr_vcpus: u32::MAX,
                    size: u64::MAX,
                    guest_addr: u64::MAX,
                },
                registers: big.clone(),
            },
            DeviceEvent::RegionDetached {
                why: DetachReason::NeedsReset,
                registers: big,
            },
            DeviceEvent::Kick { slot: u32::MAX },
        ] {
            let b = e.encode();
            assert!(b.len() <= MAX_EVENT_SIZE, "{} bytes", b.len());
            assert_eq!(DeviceEvent::decode(&b).unwrap(), e);
        }
    }

    #[test]
    fn garbage_is_refused_not_a_panic() {
        for g in [
            &b""[..],
            b"\xff\xfe",
            b"null",
            b"{\"event\":\"kick\",\"slot\":-1}",
            b"{\"event\":\"kick\",\"slot\":1,\"extra\":0}",
            b"{\"event\":\"reboot\"}",
            b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        ] {
            assert!(DeviceEvent::decode(g).is_err(), "{g:?}");
        }
    }

    #[test]
    fn a_reported_region_is_checked_against_this_process_memory() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let guest = |gpa: u64, size: u64| ReportedRegion {
            mode: RegionMode::Guest,
            generation: 1,
            nr_vcpus: 2,
            size,
            guest_addr: gpa,
        };
        let v = view_of_reported_region(&guest(0x10000, 4096), Some(&mem), None, None, ids(2))
            .expect("inside RAM");
        assert_eq!(v.info().guest_addr, 0x10000);
        let host = vm_memory::GuestMemoryBackend::get_host_address(&mem, GuestAddress(0x10000));
        assert_eq!(v.info().host_addr, host.unwrap() as usize);
        for (r, code) in [
            (guest(1 << 20, 4096), abi::ERR_REGION_OUTSIDE_RAM),
            (guest((1 << 20) - 4096, 8192), abi::ERR_REGION_OUTSIDE_RAM),
            (guest(0x10001, 4096), abi::ERR_REGION_UNALIGNED),
            (guest(u64::MAX - 4095, 4096), abi::ERR_REGION_WRAPS),
            (guest(0x10000, 0), abi::ERR_REGION_ZERO_SIZE),
        ] {
            assert_eq!(
                view_of_reported_region(&r, Some(&mem), None, None, ids(2)).unwrap_err(),
                code,
                "{r:?}"
            );
        }
        let wrong_n = guest(0x10000, 4096);
        assert!(view_of_reported_region(&wrong_n, Some(&mem), None, None, ids(3)).is_err());

        let size = crate::PvschedDevice::region_bar_size(2);
        let bar2 = Arc::new(MmapRegion::new(size as usize).unwrap());
        let dev = |at: u64, size: u64| ReportedRegion {
            mode: RegionMode::Device,
            generation: 1,
            nr_vcpus: 2,
            size,
            guest_addr: at,
        };
        let v = view_of_reported_region(
            &dev(0xc000_0000, size),
            None,
            Some(&bar2),
            Some(0xc000_0000),
            ids(2),
        )
        .expect("BAR2");
        assert_eq!(v.info().host_addr, bar2.as_ptr() as usize);
        let bad = [
            (
                dev(0xd000_0000, size),
                Some(&bar2),
                abi::ERR_REGION_UNMAPPED,
            ),
            (
                dev(0xc000_0000, size * 2),
                Some(&bar2),
                abi::ERR_REGION_UNAVAILABLE,
            ),
            (dev(0xc000_0000, size), None, abi::ERR_REGION_UNAVAILABLE),
        ];
        for (r, b, code) in bad {
            assert_eq!(
                view_of_reported_region(&r, None, b, Some(0xc000_0000), ids(2)).unwrap_err(),
                code
            );
        }
    }

    #[test]
    fn detach_reasons_follow_the_registers() {
        let r = |status| RegisterState {
            status,
            ..RegisterState::default()
        };
        assert_eq!(DetachReason::from_registers(&r(0)), DetachReason::Reset);
        assert_eq!(
            DetachReason::from_registers(&r(abi::STATUS_DEVICE_NEEDS_RESET | 7)),
            DetachReason::NeedsReset
        );
        assert_eq!(
            DetachReason::from_registers(&r(abi::STATUS_FAILED | 7)),
            DetachReason::Failed
        );
        assert_eq!(DetachReason::from_registers(&r(0xf)), DetachReason::Moved);
    }
}
