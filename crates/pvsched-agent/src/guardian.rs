//! The guardian: a tiny process forked by the agent at load that restores
//! every boosted thread's baseline when the agent process dies, however it
//! dies (SIGKILL, OOM kill, abort), within a few milliseconds.
//!
//! Why a process and not only the VMM: an out-of-process agent
//! (`pvsched-agent-attach` on a QEMU) boosts threads of a VMM that knows
//! nothing of pvsched, and a baseline at a negative nice needs CAP_SYS_NICE
//! to restore; the guardian keeps the agent's privileges and has nothing
//! else to do.
//!
//! How: a shared ledger (an anonymous shared mapping, inherited across
//! `fork`) holds one entry per registered thread: its tid, its start time
//! (field 22 of `/proc/TID/stat`, so a reused TID is never touched) and the
//! baseline to restore. The applier *arms* an entry before a boost's
//! `sched_setattr` and *disarms* it after the baseline is back. The
//! guardian blocks in `poll` on the read end of a pipe whose only write end
//! the agent holds; when the agent process is gone the pipe reports hang-up,
//! and the guardian restores every armed entry whose thread still has the
//! recorded start time, then exits.
//!
//! The child runs only system calls on memory it already has (no
//! allocation, no locks: it was forked from a multi-threaded process). It
//! closes every inherited descriptor but the pipe, so it keeps none of the
//! agent's BPF links or maps alive, leaves the agent's process group (a
//! terminal's Ctrl-C is for the agent), asks the OOM killer to spare it and
//! runs at SCHED_FIFO 50 (like the agent's applier) so that it is not
//! queued behind the boosted threads it has to lower.

use crate::sched::SchedAttr;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum GuardianError {
    /// A system call setting the guardian up failed.
    #[error("starting the pvsched guardian process: {what} failed: {source}")]
    Setup {
        /// What.
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
}

/// Ledger entries per VM: its vCPUs, then its emulator threads.
const PER_VM: usize = (crate::intf::MAX_VCPUS_PER_VM + crate::intf::MAX_EMULATORS) as usize;

/// Entries of the ledger: every thread the agent can register.
pub const LEDGER_ENTRIES: usize = crate::intf::MAX_VMS as usize * PER_VM;

/// The ledger entry of thread `index` (vCPU slot, then emulator threads)
/// of VM `vm_id`.
pub fn ledger_slot(vm_id: u32, index: u32) -> usize {
    vm_id as usize * PER_VM + index as usize
}

const FREE: u32 = 0;
const ARMED: u32 = 1;

/// One ledger entry; every field is written before `state` is set to ARMED
/// (release) and read after it is seen ARMED (acquire).
#[repr(C)]
struct Entry {
    state: AtomicU32,
    tid: AtomicU32,
    start_time: AtomicU64,
    policy: AtomicU32,
    priority: AtomicU32,
    nice: AtomicU32,
    pad: AtomicU32,
    flags: AtomicU64,
}

/// The shared ledger of armed (boosted) threads.
pub struct Ledger {
    entries: *mut Entry,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics, and it lives as
// long as the Ledger (unmapped in Drop).
unsafe impl Send for Ledger {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for Ledger {}

impl Ledger {
    fn new() -> io::Result<Ledger> {
        let len = LEDGER_ENTRIES * size_of::<Entry>();
        // SAFETY: a fresh anonymous shared mapping; the kernel picks the
        // address; we check for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // Zeroed by the kernel: every entry FREE.
        Ok(Ledger {
            entries: p.cast(),
            len,
        })
    }

    fn entry(&self, slot: usize) -> Option<&Entry> {
        if slot >= LEDGER_ENTRIES {
            return None;
        }
        // SAFETY: slot < LEDGER_ENTRIES, inside the mapping of `len` bytes,
        // which outlives &self; Entry is made of atomics (any bit pattern,
        // shared access is fine).
        Some(unsafe { &*self.entries.add(slot) })
    }

    /// Records that thread `tid` (started at `start_time`) is about to be
    /// boosted and must get `baseline` back if the agent dies.
    pub fn arm(&self, slot: usize, tid: u32, start_time: u64, baseline: &SchedAttr) {
        let Some(e) = self.entry(slot) else {
            log::error!("pvsched guardian: ledger slot {slot} out of range; tid {tid} unguarded");
            return;
        };
        e.state.store(FREE, Ordering::Release);
        e.tid.store(tid, Ordering::Relaxed);
        e.start_time.store(start_time, Ordering::Relaxed);
        e.policy.store(baseline.policy, Ordering::Relaxed);
        e.priority.store(baseline.priority, Ordering::Relaxed);
        e.nice.store(baseline.nice as u32, Ordering::Relaxed);
        e.flags.store(baseline.flags, Ordering::Relaxed);
        e.state.store(ARMED, Ordering::Release);
    }

    /// The thread in `slot` has its baseline back.
    pub fn disarm(&self, slot: usize) {
        if let Some(e) = self.entry(slot) {
            e.state.store(FREE, Ordering::Release);
        }
    }

    /// Restores every armed entry whose thread is still the one recorded,
    /// and disarms it; returns how many were restored. Lock-free and
    /// allocation-free: the agent's signal and panic paths call it, so a
    /// lock held by a panicking thread can never make them skip a thread.
    pub fn restore_armed(&self) -> usize {
        let mut n = 0;
        for i in 0..LEDGER_ENTRIES {
            if let Some(e) = self.entry(i) {
                if restore_entry(e) {
                    n += 1;
                }
                e.state.store(FREE, Ordering::Release);
            }
        }
        n
    }

    /// Armed entries (for tests and statistics).
    pub fn armed(&self) -> usize {
        (0..LEDGER_ENTRIES)
            .filter(|&i| {
                self.entry(i)
                    .is_some_and(|e| e.state.load(Ordering::Acquire) == ARMED)
            })
            .count()
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in new().
        unsafe { libc::munmap(self.entries.cast(), self.len) };
    }
}

/// The running guardian: the agent holds the pipe's write end; dropping it
/// tells the guardian the agent is gone on purpose (it restores anything
/// still armed, normally nothing, and exits) and reaps it.
pub struct Guardian {
    ledger: Ledger,
    pid: libc::pid_t,
    write_fd: libc::c_int,
}

/// Start time of thread `tid` (clock ticks since boot, field 22 of
/// `/proc/TID/stat`), or None if it is gone. Allocation-free: the guardian
/// child calls it.
pub fn start_time(tid: u32) -> Option<u64> {
    // "/proc/" + up to 10 digits + "/stat" + NUL.
    let mut path = [0u8; 32];
    let mut n = 0;
    for &b in b"/proc/" {
        path[n] = b;
        n += 1;
    }
    let mut digits = [0u8; 10];
    let (mut d, mut t) = (0, tid);
    loop {
        digits[d] = b'0' + (t % 10) as u8;
        d += 1;
        t /= 10;
        if t == 0 {
            break;
        }
    }
    while d > 0 {
        d -= 1;
        path[n] = digits[d];
        n += 1;
    }
    for &b in b"/stat" {
        path[n] = b;
        n += 1;
    }
    // SAFETY: path is NUL-terminated (zeroed buffer, n < 32).
    let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let mut buf = [0u8; 1024];
    // SAFETY: reads at most buf.len() bytes into buf from the fd we opened.
    let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: closes the fd we opened.
    unsafe { libc::close(fd) };
    if r <= 0 {
        return None;
    }
    parse_start_time(&buf[..r as usize])
}

/// Field 22 of a `/proc/TID/stat` line (fields counted after the comm in
/// parentheses, which may itself hold spaces and parentheses).
fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    // The tokens after the comm are fields 3 (state), 4, ...: starttime,
    // field 22, is token 19.
    stat[close + 1..]
        .split(|&b| b == b' ' || b == b'\n')
        .filter(|t| !t.is_empty())
        .nth(19)
        .and_then(|t| {
            t.iter().try_fold(0u64, |acc, &b| {
                b.is_ascii_digit()
                    .then(|| acc.checked_mul(10)?.checked_add((b - b'0') as u64))
                    .flatten()
            })
        })
}

/// Restores one armed entry if its thread is the one recorded.
/// Allocation-free (the guardian child calls it).
fn restore_entry(e: &Entry) -> bool {
    if e.state.load(Ordering::Acquire) != ARMED {
        return false;
    }
    let tid = e.tid.load(Ordering::Relaxed);
    if start_time(tid) != Some(e.start_time.load(Ordering::Relaxed)) {
        return false; // gone, or a new thread with a reused TID
    }
    let attr = SchedAttr {
        policy: e.policy.load(Ordering::Relaxed),
        priority: e.priority.load(Ordering::Relaxed),
        nice: e.nice.load(Ordering::Relaxed) as i32,
        flags: e.flags.load(Ordering::Relaxed),
    };
    crate::sched::set(tid, &attr).is_ok()
}

impl Guardian {
    /// Forks the guardian. Call before the agent boosts anything.
    pub fn spawn() -> Result<Guardian, GuardianError> {
        let setup = |what| move |source| GuardianError::Setup { what, source };
        let ledger = Ledger::new().map_err(setup("mmap of the ledger"))?;
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two fds into the array we pass.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(setup("pipe2")(io::Error::last_os_error()));
        }
        let (read_fd, write_fd) = (fds[0], fds[1]);
        // SAFETY: fork; the child below only makes system calls on memory
        // it already has and never returns (it ends with _exit).
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            let e = io::Error::last_os_error();
            // SAFETY: closing the two fds we just made.
            unsafe {
                libc::close(read_fd);
                libc::close(write_fd);
            }
            return Err(setup("fork")(e));
        }
        if pid == 0 {
            child(&ledger, read_fd);
        }
        // SAFETY: the parent keeps only the write end.
        unsafe { libc::close(read_fd) };
        Ok(Guardian {
            ledger,
            pid,
            write_fd,
        })
    }

    /// The ledger the applier arms and disarms.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The guardian's process id.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }
}

impl Drop for Guardian {
    fn drop(&mut self) {
        // SAFETY: closing our write end: the guardian sees hang-up, restores
        // whatever is still armed and exits; we reap it.
        unsafe { libc::close(self.write_fd) };
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(self.pid, &mut status, 0) };
    }
}

/// The guardian process. Never returns.
fn child(ledger: &Ledger, read_fd: libc::c_int) -> ! {
    // SAFETY: raw system calls on stack memory, static C strings, the
    // inherited ledger mapping and the pipe fd; no allocation and no locks
    // (this process was forked from a multi-threaded one).
    unsafe {
        // Keep only the pipe (moved to fd 3): no BPF link, map or socket
        // of the agent stays open here.
        let fd = if read_fd == 3 {
            3
        } else {
            let r = libc::dup2(read_fd, 3);
            if r != 3 {
                libc::_exit(1);
            }
            3
        };
        let _ = libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
        // Leave the agent's process group; never die before it.
        libc::setpgid(0, 0);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        let adj = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if adj >= 0 {
            libc::write(adj, b"-1000".as_ptr().cast(), 5);
            libc::close(adj);
        }
        libc::prctl(libc::PR_SET_NAME, c"pvsched-guard".as_ptr());
        // Wake and restore ahead of the boosted threads it restores (it
        // runs once, for a few milliseconds); stays as it is if refused.
        let _ = crate::sched::set(
            0,
            &SchedAttr {
                policy: pvsched_abi::POLICY_FIFO,
                priority: 50,
                nice: 0,
                flags: crate::sched::SCHED_FLAG_RESET_ON_FORK,
            },
        );
        // Wait for the agent to go away (EOF or hang-up on the pipe).
        let mut buf = [0u8; 64];
        loop {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let r = libc::poll(&mut p, 1, -1);
            if r < 0 {
                if *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                break;
            }
            if p.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
                break;
            }
            if p.revents & libc::POLLIN != 0 {
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                if n <= 0 {
                    break;
                }
            }
        }
        ledger.restore_armed();
        libc::_exit(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_even_with_odd_comms() {
        let line =
            b"4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_time(line), Some(987654));
        assert_eq!(parse_start_time(b"1 (x) S 2 3"), None);
        assert_eq!(parse_start_time(b"no parenthesis"), None);
        let me = crate::sched::gettid();
        let a = start_time(me).expect("our own start time");
        assert_eq!(start_time(me), Some(a));
        assert_eq!(start_time(u32::MAX), None);
    }

    /// A reused TID (same tid, other start time) is never touched; the
    /// recorded thread gets exactly its baseline back. Lowering a thread's
    /// priority needs no privilege, so this runs as any user.
    #[test]
    fn restore_checks_the_thread_start_time() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(crate::sched::gettid()).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        let nice = |n| SchedAttr {
            policy: pvsched_abi::POLICY_NORMAL,
            priority: 0,
            nice: n,
            flags: 0,
        };
        crate::sched::set(tid, &nice(5)).unwrap();
        let start = start_time(tid).unwrap();
        let l = Ledger::new().unwrap();
        l.arm(0, tid, start + 1, &nice(7)); // another thread's start time
        assert!(!restore_entry(l.entry(0).unwrap()));
        assert_eq!(crate::sched::get(tid).unwrap().nice, 5, "untouched");
        l.arm(0, tid, start, &nice(7));
        assert!(restore_entry(l.entry(0).unwrap()));
        assert_eq!(crate::sched::get(tid).unwrap(), nice(7));
        l.disarm(0);
        assert!(
            !restore_entry(l.entry(0).unwrap()),
            "disarmed: nothing to do"
        );
        stop_tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn ledger_arms_and_disarms() {
        let l = Ledger::new().unwrap();
        let b = SchedAttr::default();
        l.arm(3, 10, 20, &b);
        l.arm(LEDGER_ENTRIES, 10, 20, &b); // out of range: refused, logged
        assert_eq!(l.armed(), 1);
        l.disarm(3);
        assert_eq!(l.armed(), 0);
    }
}
