//! QEMU multi-process proxy (mpqemu) message format, as QEMU 7.2–10.0 speak
//! it on the socket of `-device x-pci-proxy-dev,fd=N`
//! (`include/hw/remote/mpqemu-link.h` in QEMU).
//!
//! A message is a 16-byte header (`i32 cmd` at 0, 4 bytes of padding,
//! `u64 size` at 8) followed by `size` payload bytes (at most 192, the size
//! of QEMU's payload union). File descriptors travel as `SCM_RIGHTS` with the
//! header (at most 8).
//!
//! Everything here is pure: [`Header::parse`] and [`Request::parse`] turn
//! bytes into a typed request or an error and never panic, whatever the
//! bytes (see the property tests and the fuzz target in `fuzz/`).

use thiserror::Error;

/// Header length in bytes.
pub const HEADER_LEN: usize = 16;
/// Largest payload QEMU sends (its `MPQemuMsg.data` union).
pub const MAX_PAYLOAD: usize = 192;
/// Most file descriptors a message carries (`REMOTE_MAX_FDS`).
pub const MAX_FDS: usize = 8;

/// Proxy → device: guest RAM layout changed (no reply).
pub const CMD_SYNC_SYSMEM: i32 = 0;
/// Reply carrying a `u64`.
pub const CMD_RET: i32 = 1;
/// Configuration space write (answered by RET).
pub const CMD_PCI_CFGWRITE: i32 = 2;
/// Configuration space read (answered by RET with the value).
pub const CMD_PCI_CFGREAD: i32 = 3;
/// BAR write (answered by RET).
pub const CMD_BAR_WRITE: i32 = 4;
/// BAR read (answered by RET with the value).
pub const CMD_BAR_READ: i32 = 5;
/// Interrupt eventfds (irqfd, resamplefd); no reply.
pub const CMD_SET_IRQFD: i32 = 6;
/// Device reset (answered by RET).
pub const CMD_DEVICE_RESET: i32 = 7;

/// Errors from parsing a message.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MessageError {
    /// The message is shorter than the header.
    #[error("message header is {0} bytes, need {HEADER_LEN}")]
    ShortHeader(usize),
    /// The header announces more payload than QEMU ever sends.
    #[error("payload size {0} exceeds the mpqemu maximum of {MAX_PAYLOAD} bytes")]
    PayloadTooLarge(u64),
    /// The payload is too short for the command.
    #[error("command {cmd}: payload of {got} bytes, need {need}")]
    ShortPayload {
        /// Command number.
        cmd: i32,
        /// Bytes received.
        got: usize,
        /// Bytes the command needs.
        need: usize,
    },
    /// A command number the protocol does not define (or RET sent to us).
    #[error("unknown or unexpected command {0}")]
    UnknownCommand(i32),
    /// Wrong number of file descriptors for the command.
    #[error("command {cmd}: {got} file descriptors, expected {expected}")]
    BadFdCount {
        /// Command number.
        cmd: i32,
        /// Descriptors received.
        got: usize,
        /// What the command needs (as text: "0", "2", "1..=8").
        expected: &'static str,
    },
    /// An access length the command does not allow.
    #[error("command {cmd}: access length {len} not in 1, 2, 4{}", if *.cmd == CMD_BAR_READ || *.cmd == CMD_BAR_WRITE { ", 8" } else { "" })]
    BadLength {
        /// Command number.
        cmd: i32,
        /// Length from the message.
        len: i64,
    },
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, MessageError>;

/// A parsed message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Command number.
    pub cmd: i32,
    /// Payload bytes that follow.
    pub size: u64,
}

impl Header {
    /// Parse the first [`HEADER_LEN`] bytes of `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Header> {
        let h = bytes
            .get(..HEADER_LEN)
            .ok_or(MessageError::ShortHeader(bytes.len()))?;
        let cmd = i32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let size = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        Ok(Header { cmd, size })
    }

    /// Check that the announced payload size is one QEMU could send.
    pub fn payload_len(&self) -> Result<usize> {
        match usize::try_from(self.size) {
            Ok(n) if n <= MAX_PAYLOAD => Ok(n),
            _ => Err(MessageError::PayloadTooLarge(self.size)),
        }
    }

    /// Encode a header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..4].copy_from_slice(&self.cmd.to_le_bytes());
        out[8..].copy_from_slice(&self.size.to_le_bytes());
        out
    }
}

/// One guest RAM range of a SYNC_SYSMEM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SysmemRegion {
    /// Guest-physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// Offset of the range in its file descriptor.
    pub offset: i64,
    /// Index of the descriptor among the message's descriptors.
    pub fd_index: usize,
}

/// A request from the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Guest RAM is now exactly these ranges.
    SyncSysmem(Vec<SysmemRegion>),
    /// Configuration write of `len` bytes of `val` at byte `addr`.
    ConfigWrite {
        /// Byte offset in configuration space.
        addr: u32,
        /// Value (low `len` bytes used).
        val: u32,
        /// 1, 2 or 4.
        len: u8,
    },
    /// Configuration read of `len` bytes at byte `addr`.
    ConfigRead {
        /// Byte offset in configuration space.
        addr: u32,
        /// 1, 2 or 4.
        len: u8,
    },
    /// BAR write at absolute guest address `addr`.
    BarWrite {
        /// Absolute guest-physical (or port) address.
        addr: u64,
        /// Value (low `size` bytes used).
        val: u64,
        /// 1, 2, 4 or 8.
        size: u8,
        /// Memory (true) or I/O port (false) space.
        memory: bool,
    },
    /// BAR read at absolute guest address `addr`.
    BarRead {
        /// Absolute guest-physical (or port) address.
        addr: u64,
        /// 1, 2, 4 or 8.
        size: u8,
        /// Memory (true) or I/O port (false) space.
        memory: bool,
    },
    /// Interrupt eventfds (descriptor indices 0 = irqfd, 1 = resamplefd).
    SetIrqfd,
    /// Reset the device.
    DeviceReset,
}

impl Request {
    /// Whether QEMU waits for a RET reply to this command. Malformed
    /// messages of these commands are answered too, so the vCPU never hangs.
    pub fn cmd_wants_reply(cmd: i32) -> bool {
        matches!(
            cmd,
            CMD_PCI_CFGWRITE | CMD_PCI_CFGREAD | CMD_BAR_WRITE | CMD_BAR_READ | CMD_DEVICE_RESET
        )
    }

    /// Parse the payload of a message with header `cmd`, carrying `nfds`
    /// file descriptors.
    pub fn parse(cmd: i32, payload: &[u8], nfds: usize) -> Result<Request> {
        let need = |n: usize| -> Result<&[u8]> {
            payload.get(..n).ok_or(MessageError::ShortPayload {
                cmd,
                got: payload.len(),
                need: n,
            })
        };
        let no_fds = || -> Result<()> {
            if nfds == 0 {
                Ok(())
            } else {
                Err(MessageError::BadFdCount {
                    cmd,
                    got: nfds,
                    expected: "0",
                })
            }
        };
        match cmd {
            CMD_SYNC_SYSMEM => {
                if nfds == 0 || nfds > MAX_FDS {
                    return Err(MessageError::BadFdCount {
                        cmd,
                        got: nfds,
                        expected: "1..=8",
                    });
                }
                let p = need(MAX_PAYLOAD)?;
                let regions = (0..nfds)
                    .map(|i| SysmemRegion {
                        gpa: le_u64(p, i * 8),
                        size: le_u64(p, 64 + i * 8),
                        offset: le_u64(p, 128 + i * 8) as i64,
                        fd_index: i,
                    })
                    .collect();
                Ok(Request::SyncSysmem(regions))
            }
            CMD_PCI_CFGWRITE | CMD_PCI_CFGREAD => {
                no_fds()?;
                let p = need(12)?;
                let addr = le_u32(p, 0);
                let val = le_u32(p, 4);
                let len = le_u32(p, 8) as i32;
                let len = match len {
                    1 | 2 | 4 => len as u8,
                    _ => {
                        return Err(MessageError::BadLength {
                            cmd,
                            len: i64::from(len),
                        });
                    }
                };
                Ok(if cmd == CMD_PCI_CFGWRITE {
                    Request::ConfigWrite { addr, val, len }
                } else {
                    Request::ConfigRead { addr, len }
                })
            }
            CMD_BAR_WRITE | CMD_BAR_READ => {
                no_fds()?;
                let p = need(21)?;
                let addr = le_u64(p, 0);
                let val = le_u64(p, 8);
                let size = le_u32(p, 16);
                let memory = p[20] != 0;
                let size = match size {
                    1 | 2 | 4 | 8 => size as u8,
                    _ => {
                        return Err(MessageError::BadLength {
                            cmd,
                            len: i64::from(size),
                        });
                    }
                };
                Ok(if cmd == CMD_BAR_WRITE {
                    Request::BarWrite {
                        addr,
                        val,
                        size,
                        memory,
                    }
                } else {
                    Request::BarRead { addr, size, memory }
                })
            }
            CMD_SET_IRQFD => {
                if nfds != 2 {
                    return Err(MessageError::BadFdCount {
                        cmd,
                        got: nfds,
                        expected: "2",
                    });
                }
                Ok(Request::SetIrqfd)
            }
            CMD_DEVICE_RESET => {
                no_fds()?;
                Ok(Request::DeviceReset)
            }
            _ => Err(MessageError::UnknownCommand(cmd)),
        }
    }
}

/// Encode a RET reply carrying `value` (header + 8 payload bytes).
pub fn encode_ret(value: u64) -> [u8; HEADER_LEN + 8] {
    let mut out = [0u8; HEADER_LEN + 8];
    out[..HEADER_LEN].copy_from_slice(
        &Header {
            cmd: CMD_RET,
            size: 8,
        }
        .encode(),
    );
    out[HEADER_LEN..].copy_from_slice(&value.to_le_bytes());
    out
}

/// Encode a request as QEMU would (used by tests and the scripted peer).
pub fn encode_request(cmd: i32, payload: &[u8]) -> Vec<u8> {
    let mut out = Header {
        cmd,
        size: payload.len() as u64,
    }
    .encode()
    .to_vec();
    out.extend_from_slice(payload);
    out
}

/// Payload of PCI_CFGWRITE / PCI_CFGREAD (`PciConfDataMsg`).
pub fn config_payload(addr: u32, val: u32, len: i32) -> [u8; 12] {
    let mut p = [0u8; 12];
    p[..4].copy_from_slice(&addr.to_le_bytes());
    p[4..8].copy_from_slice(&val.to_le_bytes());
    p[8..].copy_from_slice(&len.to_le_bytes());
    p
}

/// Payload of BAR_WRITE / BAR_READ (`BarAccessMsg`, 24 bytes with padding).
pub fn bar_payload(addr: u64, val: u64, size: u32, memory: bool) -> [u8; 24] {
    let mut p = [0u8; 24];
    p[..8].copy_from_slice(&addr.to_le_bytes());
    p[8..16].copy_from_slice(&val.to_le_bytes());
    p[16..20].copy_from_slice(&size.to_le_bytes());
    p[20] = u8::from(memory);
    p
}

/// Payload of SYNC_SYSMEM (`SyncSysmemMsg`): `(gpa, size, offset)` per fd.
pub fn sysmem_payload(regions: &[(u64, u64, i64)]) -> [u8; MAX_PAYLOAD] {
    let mut p = [0u8; MAX_PAYLOAD];
    for (i, (gpa, size, off)) in regions.iter().take(MAX_FDS).enumerate() {
        p[i * 8..i * 8 + 8].copy_from_slice(&gpa.to_le_bytes());
        p[64 + i * 8..72 + i * 8].copy_from_slice(&size.to_le_bytes());
        p[128 + i * 8..136 + i * 8].copy_from_slice(&off.to_le_bytes());
    }
    p
}

/// Little-endian u32 at `off`; the caller checked the length.
fn le_u32(p: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    if let Some(s) = p.get(off..off + 4) {
        b.copy_from_slice(s);
    }
    u32::from_le_bytes(b)
}

/// Little-endian u64 at `off`; the caller checked the length.
fn le_u64(p: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    if let Some(s) = p.get(off..off + 8) {
        b.copy_from_slice(s);
    }
    u64::from_le_bytes(b)
}

/// Parse a whole frame (header + payload) as one buffer; what the fuzz
/// target and the property tests drive.
pub fn parse_frame(bytes: &[u8], nfds: usize) -> Result<Request> {
    let h = Header::parse(bytes)?;
    let n = h.payload_len()?;
    let payload = bytes.get(HEADER_LEN..).unwrap_or(&[]);
    let payload = payload.get(..n).unwrap_or(payload);
    Request::parse(h.cmd, payload, nfds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn config_read_round_trip() {
        let f = encode_request(CMD_PCI_CFGREAD, &config_payload(0x10, 0, 4));
        assert_eq!(
            parse_frame(&f, 0),
            Ok(Request::ConfigRead { addr: 0x10, len: 4 })
        );
    }

    #[test]
    fn bar_write_round_trip() {
        let f = encode_request(CMD_BAR_WRITE, &bar_payload(0xfebf_0020, 7, 4, true));
        assert_eq!(
            parse_frame(&f, 0),
            Ok(Request::BarWrite {
                addr: 0xfebf_0020,
                val: 7,
                size: 4,
                memory: true
            })
        );
    }

    #[test]
    fn sysmem_takes_one_region_per_fd() {
        let p = sysmem_payload(&[(0, 0xa0000, 0), (0x100000, 0x1000_0000, 0x100000)]);
        let f = encode_request(CMD_SYNC_SYSMEM, &p);
        let Ok(Request::SyncSysmem(r)) = parse_frame(&f, 2) else {
            panic!("not parsed")
        };
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].gpa, 0x100000);
        assert_eq!(r[1].offset, 0x100000);
        assert_eq!(
            parse_frame(&f, 0).unwrap_err().to_string(),
            "command 0: 0 file descriptors, expected 1..=8"
        );
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert_eq!(parse_frame(&[0; 3], 0), Err(MessageError::ShortHeader(3)));
        let mut h = Header { cmd: 3, size: 4096 }.encode().to_vec();
        assert_eq!(parse_frame(&h, 0), Err(MessageError::PayloadTooLarge(4096)));
        h = encode_request(CMD_PCI_CFGREAD, &config_payload(0, 0, 3));
        assert!(matches!(
            parse_frame(&h, 0),
            Err(MessageError::BadLength { .. })
        ));
        h = encode_request(CMD_BAR_READ, &[0; 8]);
        assert!(matches!(
            parse_frame(&h, 0),
            Err(MessageError::ShortPayload { .. })
        ));
        h = encode_request(CMD_RET, &[0; 8]);
        assert_eq!(
            parse_frame(&h, 0),
            Err(MessageError::UnknownCommand(CMD_RET))
        );
        h = encode_request(CMD_SET_IRQFD, &[]);
        assert!(matches!(
            parse_frame(&h, 1),
            Err(MessageError::BadFdCount { .. })
        ));
    }

    #[test]
    fn ret_encoding() {
        let r = encode_ret(0x1122_3344_5566_7788);
        assert_eq!(
            Header::parse(&r),
            Ok(Header {
                cmd: CMD_RET,
                size: 8
            })
        );
        assert_eq!(&r[16..], &0x1122_3344_5566_7788u64.to_le_bytes());
    }

    proptest! {
        #[test]
        fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..260), nfds in 0usize..12) {
            let _ = parse_frame(&bytes, nfds);
        }

        #[test]
        fn bar_access_round_trips(addr in any::<u64>(), val in any::<u64>(), sz in prop::sample::select(vec![1u32, 2, 4, 8]), mem in any::<bool>()) {
            let f = encode_request(CMD_BAR_READ, &bar_payload(addr, val, sz, mem));
            prop_assert_eq!(parse_frame(&f, 0), Ok(Request::BarRead { addr, size: sz as u8, memory: mem }));
        }
    }
}
