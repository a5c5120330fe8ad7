//! `pvsched-sandbox-probe`: a tiny process that enters the sandbox the way
//! the device does, then does device-like work on request. Used by this
//! crate's tests (through `CARGO_BIN_EXE_pvsched-sandbox-probe`) and handy to
//! check a host: `pvsched-sandbox-probe --sock 1 --no-work` shows the report.
//!
//! Usage: `pvsched-sandbox-probe --sock FD [--memfd FD] [--keep FD,...]
//! [--profile mpqemu|vfio-user] [--no-namespaces] [--no-work]`
//!
//! After entering it prints the report on stdout, writes `R` to the socket,
//! then serves requests. Forbidden requests, each of which must end the
//! process with SIGSYS: `open` runs [`attempt_forbidden_open`], `socket`
//! creates a socket, `thread` starts a thread (clone), `exec` runs
//! `/bin/true`; if one returns, the probe answers `ESCAPED`. Any other message is
//! written into the memfd at offset 8 (mapped for the occasion) and answered
//! with the message reversed followed by the memfd's first 8 bytes. EOF
//! exits 0. Exit code 3: `enter` failed (message on stderr); 2: usage.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;

use pvsched_sandbox::{SandboxConfig, SeccompProfile, attempt_forbidden_open, enter};

const MEMFD_LEN: usize = 4096;

struct Args {
    sock: RawFd,
    memfd: Option<RawFd>,
    keep: Vec<RawFd>,
    profile: SeccompProfile,
    namespaces: bool,
    work: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        sock: -1,
        memfd: None,
        keep: Vec::new(),
        profile: SeccompProfile::DeviceVfioUser,
        namespaces: true,
        work: true,
    };
    let mut it = std::env::args().skip(1);
    let fd = |v: Option<String>| -> Result<RawFd, String> {
        v.ok_or("missing value")?
            .parse()
            .map_err(|e| format!("bad fd: {e}"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--sock" => a.sock = fd(it.next())?,
            "--memfd" => a.memfd = Some(fd(it.next())?),
            "--keep" => {
                for s in it.next().ok_or("missing value")?.split(',') {
                    a.keep
                        .push(s.parse().map_err(|e| format!("bad fd {s}: {e}"))?);
                }
            }
            "--profile" => {
                a.profile = match it.next().as_deref() {
                    Some("mpqemu") => SeccompProfile::DeviceMpqemu,
                    Some("vfio-user") => SeccompProfile::DeviceVfioUser,
                    other => return Err(format!("unknown profile {other:?}")),
                }
            }
            "--no-namespaces" => a.namespaces = false,
            "--no-work" => a.work = false,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.sock < 0 {
        return Err("--sock is required".into());
    }
    Ok(a)
}

/// Writes `msg` at offset 8 of the memfd and returns its first 8 bytes,
/// mapping and unmapping it as the device does on SYNC_SYSMEM.
fn memfd_work(memfd: RawFd, msg: &[u8]) -> Option<[u8; 8]> {
    let len = msg.len().min(MEMFD_LEN - 8);
    // SAFETY: a fresh shared mapping of a memfd the parent sized to
    // MEMFD_LEN; the result is checked before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            MEMFD_LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            memfd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let mut head = [0u8; 8];
    // SAFETY: `p` maps MEMFD_LEN bytes; 8 + len <= MEMFD_LEN; no other Rust
    // reference aliases the mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(p as *const u8, head.as_mut_ptr(), 8);
        std::ptr::copy_nonoverlapping(msg.as_ptr(), (p as *mut u8).add(8), len);
        libc::munmap(p, MEMFD_LEN);
    }
    Some(head)
}

/// Runs a forbidden request; returns false if `msg` is not one.
fn forbidden(msg: &[u8]) -> bool {
    match msg {
        b"open" => {
            attempt_forbidden_open();
        }
        b"socket" => {
            let _ = std::net::UdpSocket::bind("127.0.0.1:0");
        }
        b"thread" => {
            let _ = std::thread::spawn(|| ()).join();
        }
        b"exec" => {
            let _ = std::process::Command::new("/bin/true").status();
        }
        _ => return false,
    }
    true
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pvsched-sandbox-probe: {e}");
            return ExitCode::from(2);
        }
    };
    let mut keep = args.keep.clone();
    keep.push(args.sock);
    keep.extend(args.memfd);
    let cfg = SandboxConfig {
        namespaces: args.namespaces,
        ..SandboxConfig::new(keep, args.profile.clone())
    };
    let report = match enter(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pvsched-sandbox-probe: {e}");
            return ExitCode::from(3);
        }
    };
    println!("{report:?}");
    // SAFETY: `sock` was kept open by `enter` and nothing else owns it.
    let mut sock = unsafe { UnixStream::from_raw_fd(args.sock) };
    if sock.write_all(b"R").is_err() || !args.work {
        return ExitCode::SUCCESS;
    }
    let mut buf = [0u8; 512];
    loop {
        let n = match sock.read(&mut buf) {
            Ok(0) | Err(_) => return ExitCode::SUCCESS,
            Ok(n) => n,
        };
        let msg = &buf[..n];
        if forbidden(msg) {
            // Reached only if the sandbox failed to stop the syscall.
            let _ = sock.write_all(b"ESCAPED");
            continue;
        }
        let mut reply: Vec<u8> = msg.iter().rev().copied().collect();
        if let Some(memfd) = args.memfd {
            match memfd_work(memfd, msg) {
                Some(head) => reply.extend_from_slice(&head),
                None => reply.extend_from_slice(b"MMAPFAIL"),
            }
        }
        if sock.write_all(&reply).is_err() {
            return ExitCode::SUCCESS;
        }
    }
}
