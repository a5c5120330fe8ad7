//! BAR0 register file and the STATUS handshake state machine.
//!
//! Registers are 32 bits wide and accessed with aligned 4-byte accesses
//! (the ABI); the device also accepts an aligned 8-byte access to a LO/HI
//! pair (DEV_FEATURES, DRV_FEATURES, SHM_GPA). Any other access (unaligned,
//! another length, at or beyond `REG_END`) reads as 0 and is ignored on
//! write, with a rate-limited log.
//!
//! # Handshake (virtio-like)
//!
//! STATUS writes may only add bits, in this order:
//!
//! 1. `ACKNOWLEDGE`.
//! 2. `DRIVER` (needs ACKNOWLEDGE).
//! 3. `FEATURES_OK` (needs DRIVER): accepted only if DRIVER_FEATURES is a
//!    subset of DEVICE_FEATURES (else ERROR = `FEATURES_UNSUPPORTED`) and
//!    selects exactly one of `F_DEVICE_REGION`/`F_GUEST_REGION` (else
//!    `NO_REGION_MODE`). A refused FEATURES_OK is simply not set (no FAILED):
//!    the driver may change DRIVER_FEATURES and try again.
//! 4. `DRIVER_OK` (needs FEATURES_OK): DRIVER_VERSION's major must equal
//!    `ABI_MAJOR` (else `VERSION_MISMATCH`), then the region is validated and
//!    attached; the device writes the header and APIC table, zeroes the host
//!    halves and increments GENERATION. Any refusal sets FAILED and ERROR.
//!
//! Several bits may be added in one write; they are processed in the order
//! above. Adding a bit whose predecessor is missing, or an undefined bit, or
//! `DEVICE_NEEDS_RESET`, sets FAILED with ERROR = `BAD_SEQUENCE`. Adding
//! FAILED is allowed (the driver gives up; the region is detached). A write
//! that clears any bit but is not 0 is ignored (logged). While FAILED or
//! DEVICE_NEEDS_RESET is set every non-zero write is ignored. Writing 0
//! resets: the region is detached and DRIVER_FEATURES, STATUS, ERROR,
//! SHM_GPA, SHM_SIZE and DRIVER_VERSION return to 0 (GENERATION is kept).
//! DRIVER_OK and FAILED are never set together: every failure clears
//! DRIVER_OK.
//!
//! Other rules: DRIVER_FEATURES writes after FEATURES_OK are ignored with
//! ERROR = `BAD_SEQUENCE` (STATUS unchanged). SHM_GPA/SHM_SIZE writes after
//! DRIVER_OK set FAILED with ERROR = `REGION_CHANGED` and detach the region.
//! DRIVER_VERSION writes after DRIVER_OK are ignored. ERROR keeps the code of
//! the last refusal until reset. KICK with a slot index below NR_VCPUS while
//! DRIVER_OK is forwarded to the policy; otherwise it is ignored (logged).

use crate::log_limit::{LogLimiter, warn_limited};
use crate::region::RegionMode;
use pvsched_abi as abi;
use serde::{Deserialize, Serialize};

/// STATUS bits the handshake defines, in the order they must be set.
const HANDSHAKE_ORDER: [u32; 4] = [
    abi::STATUS_ACKNOWLEDGE,
    abi::STATUS_DRIVER,
    abi::STATUS_FEATURES_OK,
    abi::STATUS_DRIVER_OK,
];

/// The guest-visible register state (what a snapshot holds).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterState {
    /// DRIVER_FEATURES (64 bits).
    pub drv_features: u64,
    /// STATUS.
    pub status: u32,
    /// ERROR.
    pub error: u32,
    /// SHM_GPA (64 bits).
    pub shm_gpa: u64,
    /// SHM_SIZE.
    pub shm_size: u32,
    /// GENERATION.
    pub generation: u32,
    /// DRIVER_VERSION.
    pub driver_version: u32,
}

impl RegisterState {
    /// Make a state from an untrusted source (a snapshot) consistent:
    /// unknown STATUS bits dropped, DRIVER_OK cleared if FAILED or
    /// DEVICE_NEEDS_RESET is set, an unknown ERROR becomes `DEVICE_FAILED`.
    pub fn sanitized(mut self) -> Self {
        let known = HANDSHAKE_ORDER.iter().fold(0, |a, b| a | b)
            | abi::STATUS_FAILED
            | abi::STATUS_DEVICE_NEEDS_RESET;
        self.status &= known;
        if self.status & (abi::STATUS_FAILED | abi::STATUS_DEVICE_NEEDS_RESET) != 0 {
            self.status &= !abi::STATUS_DRIVER_OK;
        }
        if self.error > abi::ERR_MAX {
            self.error = abi::ERR_DEVICE_FAILED;
        }
        self
    }
}

/// What the device must do after a register write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Nothing.
    None,
    /// STATUS was written 0: detach the region, tell the policy.
    Reset,
    /// DRIVER_OK passed every register check: validate and attach the
    /// region, then call [`Registers::attached`] or [`Registers::fail`].
    Attach,
    /// The device failed while possibly attached: detach the region.
    Detach,
    /// Forward a kick for this slot to the policy.
    Kick(u32),
}

/// The BAR0 register file.
///
/// ```
/// use pvsched_abi as abi;
/// use pvsched_device::registers::{Effect, Registers};
/// let mut r = Registers::new(abi::F_ALL, 2);
/// assert_eq!(r.read(abi::REG_MAGIC), abi::MAGIC);
/// r.write(abi::REG_STATUS, abi::STATUS_DRIVER); // out of order
/// assert_eq!(r.read(abi::REG_STATUS), abi::STATUS_FAILED);
/// assert_eq!(r.read(abi::REG_ERROR), abi::ERR_BAD_SEQUENCE);
/// assert_eq!(r.write(abi::REG_STATUS, 0), Effect::Reset);
/// assert_eq!(r.read(abi::REG_ERROR), abi::ERR_NONE);
/// ```
#[derive(Debug)]
pub struct Registers {
    dev_features: u64,
    nr_vcpus: u32,
    state: RegisterState,
    bad_access: LogLimiter,
}

impl Registers {
    /// A register file offering `dev_features` for `nr_vcpus` slots, in reset state.
    pub fn new(dev_features: u64, nr_vcpus: u32) -> Self {
        Self {
            dev_features,
            nr_vcpus,
            state: RegisterState::default(),
            bad_access: LogLimiter::new(),
        }
    }

    /// The guest-visible state.
    pub fn state(&self) -> &RegisterState {
        &self.state
    }

    /// Replace the state (restore); it is sanitized first.
    pub fn set_state(&mut self, s: RegisterState) {
        self.state = s.sanitized();
    }

    /// STATUS.
    pub fn status(&self) -> u32 {
        self.state.status
    }

    /// ERROR.
    pub fn error(&self) -> u32 {
        self.state.error
    }

    /// The negotiated region mode (meaningful once FEATURES_OK is set).
    pub fn region_mode(&self) -> Option<RegionMode> {
        let f = self.state.drv_features & (abi::F_DEVICE_REGION | abi::F_GUEST_REGION);
        match f {
            abi::F_DEVICE_REGION => Some(RegionMode::Device),
            abi::F_GUEST_REGION => Some(RegionMode::Guest),
            _ => None,
        }
    }

    /// Read the register at `offset` (must be 4-byte aligned and below
    /// `REG_END`; anything else reads 0).
    pub fn read(&self, offset: u32) -> u32 {
        let s = &self.state;
        match offset {
            abi::REG_MAGIC => abi::MAGIC,
            abi::REG_VERSION => abi::ABI_VERSION,
            abi::REG_DEV_FEATURES_LO => self.dev_features as u32,
            abi::REG_DEV_FEATURES_HI => (self.dev_features >> 32) as u32,
            abi::REG_DRV_FEATURES_LO => s.drv_features as u32,
            abi::REG_DRV_FEATURES_HI => (s.drv_features >> 32) as u32,
            abi::REG_NR_VCPUS => self.nr_vcpus,
            abi::REG_SLOT_SIZE => abi::SLOT_SIZE,
            abi::REG_STATUS => s.status,
            abi::REG_ERROR => s.error,
            abi::REG_SHM_GPA_LO => s.shm_gpa as u32,
            abi::REG_SHM_GPA_HI => (s.shm_gpa >> 32) as u32,
            abi::REG_SHM_SIZE => s.shm_size,
            abi::REG_REGION_SIZE => abi::region_size(self.nr_vcpus),
            abi::REG_GENERATION => s.generation,
            abi::REG_DRIVER_VERSION => s.driver_version,
            // KICK is write-only; undefined offsets read 0.
            _ => 0,
        }
    }

    /// Serve a BAR0 read of `data.len()` bytes at `offset`: an access
    /// [`access_ok`] allows is filled little-endian (an 8-byte one from the
    /// register and the one after it); anything else reads 0 and returns
    /// false.
    pub fn read_bar(&self, offset: u64, data: &mut [u8]) -> bool {
        data.fill(0);
        let Some(off) = access_ok(offset, data.len()) else {
            return false;
        };
        let mut v = u64::from(self.read(off));
        if data.len() == 8 {
            v |= u64::from(self.read(off + 4)) << 32;
        }
        let len = data.len();
        data.copy_from_slice(&v.to_le_bytes()[..len]);
        true
    }

    /// Write `value` to the register at `offset`.
    pub fn write(&mut self, offset: u32, value: u32) -> Effect {
        let driver_ok = self.state.status & abi::STATUS_DRIVER_OK != 0;
        match offset {
            abi::REG_STATUS => return self.write_status(value),
            abi::REG_DRV_FEATURES_LO | abi::REG_DRV_FEATURES_HI => {
                if self.state.status & abi::STATUS_FEATURES_OK != 0 {
                    warn_limited!(
                        self.bad_access,
                        "pvsched: DRIVER_FEATURES written after FEATURES_OK; ignored"
                    );
                    self.state.error = abi::ERR_BAD_SEQUENCE;
                } else if offset == abi::REG_DRV_FEATURES_LO {
                    self.state.drv_features =
                        (self.state.drv_features & !0xffff_ffff) | u64::from(value);
                } else {
                    self.state.drv_features =
                        (self.state.drv_features & 0xffff_ffff) | u64::from(value) << 32;
                }
            }
            abi::REG_SHM_GPA_LO | abi::REG_SHM_GPA_HI | abi::REG_SHM_SIZE => {
                let s = &mut self.state;
                match offset {
                    abi::REG_SHM_GPA_LO => {
                        s.shm_gpa = (s.shm_gpa & !0xffff_ffff) | u64::from(value)
                    }
                    abi::REG_SHM_GPA_HI => {
                        s.shm_gpa = (s.shm_gpa & 0xffff_ffff) | u64::from(value) << 32
                    }
                    _ => s.shm_size = value,
                }
                if driver_ok {
                    warn_limited!(
                        self.bad_access,
                        "pvsched: SHM_* written after DRIVER_OK; device failed"
                    );
                    self.fail(abi::ERR_REGION_CHANGED);
                    return Effect::Detach;
                }
            }
            abi::REG_DRIVER_VERSION => {
                if driver_ok {
                    warn_limited!(
                        self.bad_access,
                        "pvsched: DRIVER_VERSION written after DRIVER_OK; ignored"
                    );
                } else {
                    self.state.driver_version = value;
                }
            }
            abi::REG_KICK => {
                if driver_ok && value < self.nr_vcpus {
                    return Effect::Kick(value);
                }
                warn_limited!(
                    self.bad_access,
                    "pvsched: KICK {value} ignored (driver_ok={driver_ok}, nr_vcpus={})",
                    self.nr_vcpus
                );
            }
            _ => {
                warn_limited!(
                    self.bad_access,
                    "pvsched: write {value:#x} to read-only or undefined register {offset:#x} ignored"
                );
            }
        }
        Effect::None
    }

    /// Refuse: STATUS gains FAILED and loses DRIVER_OK, ERROR = `code`.
    pub fn fail(&mut self, code: u32) {
        self.state.status = (self.state.status & !abi::STATUS_DRIVER_OK) | abi::STATUS_FAILED;
        self.state.error = code;
    }

    /// The region was attached at `generation`: set DRIVER_OK and GENERATION.
    pub fn attached(&mut self, generation: u32) {
        self.state.generation = generation;
        self.state.status |= abi::STATUS_DRIVER_OK;
    }

    /// The back end is gone: STATUS gains DEVICE_NEEDS_RESET and loses
    /// DRIVER_OK, ERROR = `DEVICE_FAILED`.
    pub fn needs_reset(&mut self) {
        self.state.status =
            (self.state.status & !abi::STATUS_DRIVER_OK) | abi::STATUS_DEVICE_NEEDS_RESET;
        self.state.error = abi::ERR_DEVICE_FAILED;
    }

    fn write_status(&mut self, value: u32) -> Effect {
        let cur = self.state.status;
        if value == abi::STATUS_RESET {
            self.state = RegisterState {
                generation: self.state.generation,
                ..RegisterState::default()
            };
            return Effect::Reset;
        }
        if cur & (abi::STATUS_FAILED | abi::STATUS_DEVICE_NEEDS_RESET) != 0 {
            warn_limited!(
                self.bad_access,
                "pvsched: STATUS {value:#x} written while failed ({cur:#x}); reset first"
            );
            return Effect::None;
        }
        if cur & !value != 0 {
            warn_limited!(
                self.bad_access,
                "pvsched: STATUS {value:#x} would clear bits of {cur:#x}; ignored (write 0 to reset)"
            );
            return Effect::None;
        }
        let added = value & !cur;
        if added & abi::STATUS_FAILED != 0 {
            self.state.status = (cur & !abi::STATUS_DRIVER_OK) | abi::STATUS_FAILED;
            return Effect::Detach;
        }
        let defined = HANDSHAKE_ORDER.iter().fold(0, |a, b| a | b);
        if added & !defined != 0 {
            // `fail` clears DRIVER_OK: the region must be let go as well.
            self.fail(abi::ERR_BAD_SEQUENCE);
            return Effect::Detach;
        }
        let mut prev = 0;
        for bit in HANDSHAKE_ORDER {
            if added & bit != 0 {
                if prev != 0 && self.state.status & prev == 0 {
                    self.fail(abi::ERR_BAD_SEQUENCE);
                    return Effect::Detach;
                }
                match bit {
                    abi::STATUS_FEATURES_OK => {
                        if let Err(code) = self.check_features() {
                            self.state.error = code;
                            return Effect::None;
                        }
                    }
                    abi::STATUS_DRIVER_OK => {
                        if abi::version_major(self.state.driver_version) != abi::ABI_MAJOR {
                            self.fail(abi::ERR_VERSION_MISMATCH);
                            return Effect::None;
                        }
                        // DRIVER_OK is set by `attached` once the region is in place.
                        return Effect::Attach;
                    }
                    _ => {}
                }
                self.state.status |= bit;
            }
            prev = bit;
        }
        Effect::None
    }

    fn check_features(&self) -> Result<(), u32> {
        let drv = self.state.drv_features;
        if drv & !self.dev_features != 0 {
            return Err(abi::ERR_FEATURES_UNSUPPORTED);
        }
        if self.region_mode().is_none() {
            return Err(abi::ERR_NO_REGION_MODE);
        }
        Ok(())
    }
}

/// The register offset of a BAR0 access of `len` bytes at `offset`, if the
/// register file serves it: 4 bytes aligned, or 8 bytes at the low half of
/// a 64-bit register, below `REG_END`.
pub fn access_ok(offset: u64, len: usize) -> Option<u32> {
    let off = u32::try_from(offset).ok()?;
    let end = off.checked_add(len as u32)?;
    let ok = match len {
        4 => off.is_multiple_of(4),
        8 => matches!(
            off,
            abi::REG_DEV_FEATURES_LO | abi::REG_DRV_FEATURES_LO | abi::REG_SHM_GPA_LO
        ),
        _ => false,
    };
    (ok && end <= abi::REG_END).then_some(off)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to_features_ok(r: &mut Registers, features: u64) {
        r.write(abi::REG_DRV_FEATURES_LO, features as u32);
        r.write(abi::REG_DRV_FEATURES_HI, (features >> 32) as u32);
        r.write(
            abi::REG_STATUS,
            abi::STATUS_ACKNOWLEDGE | abi::STATUS_DRIVER,
        );
        r.write(abi::REG_STATUS, 0xb);
    }

    #[test]
    fn features_ok_and_attach_request() {
        let mut r = Registers::new(abi::F_ALL, 2);
        to_features_ok(&mut r, abi::F_GUEST_REGION);
        assert_eq!(r.status(), 0xb);
        // DRIVER_VERSION still 0: refused.
        assert_eq!(r.write(abi::REG_STATUS, 0xf), Effect::None);
        assert_eq!(r.error(), abi::ERR_VERSION_MISMATCH);
        assert_eq!(r.status(), 0xb | abi::STATUS_FAILED);
        assert_eq!(r.write(abi::REG_STATUS, 0), Effect::Reset);
        to_features_ok(&mut r, abi::F_GUEST_REGION);
        r.write(abi::REG_DRIVER_VERSION, abi::ABI_VERSION);
        assert_eq!(r.write(abi::REG_STATUS, 0xf), Effect::Attach);
        assert_eq!(r.status(), 0xb, "DRIVER_OK waits for the region");
        r.attached(7);
        assert_eq!((r.status(), r.read(abi::REG_GENERATION)), (0xf, 7));
    }

    #[test]
    fn refused_features() {
        let mut r = Registers::new(abi::F_ALL, 2);
        to_features_ok(&mut r, abi::F_GUEST_REGION | 1 << 40);
        assert_eq!(r.status(), 0x3);
        assert_eq!(r.error(), abi::ERR_FEATURES_UNSUPPORTED);
        to_features_ok(&mut r, abi::F_ALL);
        assert_eq!(r.error(), abi::ERR_NO_REGION_MODE);
        to_features_ok(&mut r, 0);
        assert_eq!(r.error(), abi::ERR_NO_REGION_MODE);
        to_features_ok(&mut r, abi::F_DEVICE_REGION);
        assert_eq!(r.status(), 0xb);
        r.write(abi::REG_DRV_FEATURES_LO, 0);
        assert_eq!(r.error(), abi::ERR_BAD_SEQUENCE);
        assert_eq!(
            r.read(abi::REG_DRV_FEATURES_LO),
            abi::F_DEVICE_REGION as u32
        );
    }

    #[test]
    fn clearing_bits_ignored_and_bad_bits_fail() {
        let mut r = Registers::new(abi::F_ALL, 2);
        r.write(abi::REG_STATUS, 0x3);
        r.write(abi::REG_STATUS, 0x1);
        assert_eq!(r.status(), 0x3);
        r.write(abi::REG_STATUS, 0x3 | 0x10);
        assert_eq!(r.status(), 0x3 | abi::STATUS_FAILED);
        assert_eq!(r.error(), abi::ERR_BAD_SEQUENCE);
        r.write(abi::REG_STATUS, 0xff);
        assert_eq!(r.status(), 0x3 | abi::STATUS_FAILED, "ignored while failed");
    }

    #[test]
    fn bad_offsets_read_zero() {
        let r = Registers::new(abi::F_ALL, 2);
        assert_eq!(r.read(abi::REG_KICK), 0);
        assert_eq!(r.read(abi::REG_END), 0);
        assert_eq!(r.read(0xffc), 0);
        assert_eq!(r.read(abi::REG_REGION_SIZE), 4096);
    }
}
