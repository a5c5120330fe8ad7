//! The test guest's reporting protocol: ports, event codes, interrupt vectors.
//!
//! The guest reports what it does with 32-bit `out` instructions to
//! [`EVENT_PORT`]: the value is `code << 24 | arg` (arg is 24 bits). The VMM
//! knows which vCPU exited and timestamps each event with the host
//! monotonic clock on arrival, so latencies are host clock on both ends.
//! Bytes written to [`SERIAL_PORT`] (COM1 THR) or [`DEBUG_PORT`] are
//! collected as console text.

/// COM1 transmit register: console bytes.
pub const SERIAL_PORT: u16 = 0x3f8;
/// Bochs/QEMU debug console port: console bytes.
pub const DEBUG_PORT: u16 = 0xe9;
/// 32-bit event port.
pub const EVENT_PORT: u16 = 0x510;

/// Interrupt vector the VMM injects in the `wakeup` workload.
pub const VEC_WAKE: u8 = 0x40;
/// IPI vector of a ping (`ipi`).
pub const VEC_PING: u8 = 0x41;
/// IPI vector of a pong (`ipi`).
pub const VEC_PONG: u8 = 0x42;
/// IPI vector asking the partner to answer a spinning vCPU (`spin`).
pub const VEC_SPIN: u8 = 0x43;
/// Vector the VMM injects to wake a vCPU so it sees the stop flag. Its
/// priority class (3) is below the workload vectors, so a pending workload
/// interrupt is always handled first.
pub const VEC_STOP: u8 = 0x30;
/// Spurious-interrupt vector programmed in the x2APIC SVR.
pub const VEC_SPURIOUS: u8 = 0xff;

/// One guest report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestEvent {
    /// The vCPU started; its x2APIC ID.
    Boot(u32),
    /// vCPU 0 found pvsched at this bus/device/function (`dev << 3 | fn`).
    PciFound(u32),
    /// Handshake result: STATUS and ERROR registers after DRIVER_OK.
    Handshake {
        /// STATUS register.
        status: u32,
        /// ERROR register.
        error: u32,
    },
    /// The vCPU found its slot (`None`: not in the APIC table or no region).
    Slot(Option<u32>),
    /// A burst of this many slot updates starts.
    BurstBegin(u32),
    /// The burst ended.
    BurstEnd(u32),
    /// The vCPU entered its workload loop.
    Ready,
    /// `wakeup`: the interrupt handler ran (acknowledgement), its slot
    /// already asking for RT (FIFO 1, `kern_cs = HARDIRQ`).
    WakeAck,
    /// `ipi`: a ping was sent to this vCPU index.
    IpiSent(u32),
    /// `ipi`: a ping from this vCPU index was received.
    IpiReceived(u32),
    /// `ipi`: the pong came back from this vCPU index (round trip done).
    PongReceived(u32),
    /// `spin`: the vCPU set `wait_on` for this vCPU index and spins.
    SpinBegin(u32),
    /// `spin`: the answer arrived after this many PAUSE iterations.
    SpinEnd(u32),
    /// `spin`: the partner answered a spin request from this vCPU index.
    SpinAnswered(u32),
    /// `hostile`: refusal observed at `step`, with the ERROR register.
    HostileError {
        /// Which hostile step (see the guest program).
        step: u32,
        /// ERROR register value read back.
        error: u32,
    },
    /// vCPU 0 moved BAR2 to this base.
    BarMoved(u64),
    /// The vCPU saw the stop flag and halted.
    Done,
    /// An unexpected exception with this vector.
    Fault(u32),
    /// A code this VMM does not know.
    Unknown(u32),
}

/// Event codes (the top byte of the value).
pub mod code {
    /// [`super::GuestEvent::Boot`].
    pub const BOOT: u32 = 1;
    /// [`super::GuestEvent::PciFound`].
    pub const PCI_FOUND: u32 = 2;
    /// [`super::GuestEvent::Handshake`].
    pub const HANDSHAKE: u32 = 3;
    /// [`super::GuestEvent::Slot`].
    pub const SLOT: u32 = 4;
    /// [`super::GuestEvent::BurstBegin`].
    pub const BURST_BEGIN: u32 = 5;
    /// [`super::GuestEvent::BurstEnd`].
    pub const BURST_END: u32 = 6;
    /// [`super::GuestEvent::Ready`].
    pub const READY: u32 = 7;
    /// [`super::GuestEvent::WakeAck`].
    pub const WAKE_ACK: u32 = 8;
    /// [`super::GuestEvent::IpiSent`].
    pub const IPI_SENT: u32 = 9;
    /// [`super::GuestEvent::IpiReceived`].
    pub const IPI_RECV: u32 = 10;
    /// [`super::GuestEvent::PongReceived`].
    pub const PONG_RECV: u32 = 11;
    /// [`super::GuestEvent::SpinBegin`].
    pub const SPIN_BEGIN: u32 = 12;
    /// [`super::GuestEvent::SpinEnd`].
    pub const SPIN_END: u32 = 13;
    /// [`super::GuestEvent::SpinAnswered`].
    pub const SPIN_ANSWERED: u32 = 14;
    /// [`super::GuestEvent::HostileError`].
    pub const HOSTILE_ERROR: u32 = 15;
    /// [`super::GuestEvent::BarMoved`].
    pub const BAR_MOVED: u32 = 16;
    /// [`super::GuestEvent::Done`].
    pub const DONE: u32 = 17;
    /// [`super::GuestEvent::Fault`].
    pub const FAULT: u32 = 18;
}

/// Arg value meaning "none" in [`GuestEvent::Slot`].
pub const ARG_NONE: u32 = 0xff_ffff;

impl GuestEvent {
    /// Decode a 32-bit value written to [`EVENT_PORT`].
    pub fn decode(value: u32) -> Self {
        let arg = value & 0xff_ffff;
        match value >> 24 {
            code::BOOT => Self::Boot(arg),
            code::PCI_FOUND => Self::PciFound(arg),
            code::HANDSHAKE => Self::Handshake {
                status: arg & 0xff,
                error: arg >> 8,
            },
            code::SLOT => Self::Slot((arg != ARG_NONE).then_some(arg)),
            code::BURST_BEGIN => Self::BurstBegin(arg),
            code::BURST_END => Self::BurstEnd(arg),
            code::READY => Self::Ready,
            code::WAKE_ACK => Self::WakeAck,
            code::IPI_SENT => Self::IpiSent(arg),
            code::IPI_RECV => Self::IpiReceived(arg),
            code::PONG_RECV => Self::PongReceived(arg),
            code::SPIN_BEGIN => Self::SpinBegin(arg),
            code::SPIN_END => Self::SpinEnd(arg),
            code::SPIN_ANSWERED => Self::SpinAnswered(arg),
            code::HOSTILE_ERROR => Self::HostileError {
                step: arg >> 16,
                error: arg & 0xffff,
            },
            code::BAR_MOVED => Self::BarMoved(u64::from(arg) << 12),
            code::DONE => Self::Done,
            code::FAULT => Self::Fault(arg),
            _ => Self::Unknown(value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_every_code() {
        assert_eq!(
            GuestEvent::decode(code::BOOT << 24 | 3),
            GuestEvent::Boot(3)
        );
        assert_eq!(
            GuestEvent::decode(code::HANDSHAKE << 24 | 0x0d << 8 | 0x8f),
            GuestEvent::Handshake {
                status: 0x8f,
                error: 0x0d
            }
        );
        assert_eq!(
            GuestEvent::decode(code::SLOT << 24 | ARG_NONE),
            GuestEvent::Slot(None)
        );
        assert_eq!(
            GuestEvent::decode(code::HOSTILE_ERROR << 24 | 2 << 16 | 6),
            GuestEvent::HostileError { step: 2, error: 6 }
        );
        assert_eq!(
            GuestEvent::decode(code::BAR_MOVED << 24 | 0xd0000),
            GuestEvent::BarMoved(0xd000_0000)
        );
        assert_eq!(
            GuestEvent::decode(0xee00_0000),
            GuestEvent::Unknown(0xee00_0000)
        );
    }
}
