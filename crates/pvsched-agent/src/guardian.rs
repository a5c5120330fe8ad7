//! The guardian: a tiny process forked by the agent at load that restores
//! every boosted thread's baseline when the agent process dies, however it
//! dies (SIGKILL, OOM kill, abort), within a few milliseconds; and the
//! ledger it restores from, which can live in a file so that whatever kills
//! both the agent and its guardian (`systemctl kill -s KILL` signals every
//! process of the unit), the next start of the agent (or `pvschedd
//! --restore`) restores what they left boosted.
//!
//! Why a process and not only the VMM: an out-of-process agent
//! (`pvsched-agent-attach` on a QEMU) boosts threads of a VMM that knows
//! nothing of pvsched, and a baseline at a negative nice needs CAP_SYS_NICE
//! to restore; the guardian keeps the agent's privileges and has nothing
//! else to do.
//!
//! How: a shared ledger (an anonymous shared mapping inherited across
//! `fork`, or a file mapped shared: pvschedd's `/run/pvsched/ledger`) holds
//! one entry per registered thread: its tid, its start time (field 22 of
//! `/proc/TID/stat`, so a reused TID is never touched) and the baseline to
//! restore. The applier *arms* an entry before a boost's `sched_setattr`
//! and *disarms* it after the baseline is back. An armed entry never reads
//! as free while it is re-armed: each entry has two records, a new one is
//! written into the record not in use and published by one atomic store of
//! the entry's state, so a crash at any instant leaves either the old or
//! the new record armed. The guardian blocks in `poll` on the read end of a
//! pipe whose only write end the agent holds; when the agent process is
//! gone the pipe reports hang-up, and the guardian restores every armed
//! entry whose thread still has the recorded start time, then exits.
//!
//! A ledger file is locked (`flock`) by the agent for as long as the agent
//! or its guardian lives (the guardian inherits the lock): a new agent on
//! the same file waits for the previous one's guardian to finish its
//! restore, then restores whatever is still armed (the guardian was killed
//! too) before it loads its policy. A file written before the last boot
//! (another boot id) is cleared: its threads are gone.
//!
//! The child runs only system calls on memory it already has (no
//! allocation, no locks: it was forked from a multi-threaded process). It
//! closes every inherited descriptor but the pipe and the ledger file, so
//! it keeps none of the agent's BPF links or maps alive, leaves the agent's
//! process group (a terminal's Ctrl-C is for the agent), ignores every
//! signal that can be ignored (`systemctl kill` sends any signal to every
//! process of the unit), asks the OOM killer to spare it and runs at
//! SCHED_FIFO [`RESTORER_RT_PRIO`] so that no boosted thread it has to
//! lower can keep it off a CPU.

use crate::sched::SchedAttr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// SCHED_FIFO priority of the threads that put boosted threads back: the
/// guardian and the agent's decision consumer. The highest there is, so
/// that no boost (caps allow at most 98) can outrank the thread that has
/// to lower it.
pub const RESTORER_RT_PRIO: u32 = 99;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum GuardianError {
    /// A system call setting the guardian up failed.
    #[error("starting the pvsched guardian process: {what} failed: {source}")]
    Setup {
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// The ledger file could not be opened, sized or mapped.
    #[error("pvsched ledger {path}: {what} failed: {source}")]
    Ledger {
        path: PathBuf,
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// Another agent (or its guardian, still restoring) holds the ledger.
    #[error(
        "pvsched ledger {path} is still locked after {waited:?}: another pvschedd (or its \
         pvsched-guard process) uses it; stop it first"
    )]
    Busy {
        path: PathBuf,
        /// How long this agent waited for it.
        waited: Duration,
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

/// How long a new agent waits for the previous holder of a ledger file
/// (its guardian restoring) before it gives up.
pub const LEDGER_WAIT: Duration = Duration::from_secs(10);

const MAGIC: u64 = u64::from_le_bytes(*b"PVSLEDG1");
const VERSION: u32 = 1;

const FREE: u32 = 0;
/// Armed, record 0 (ARMED + 1: record 1) holds the thread.
const ARMED: u32 = 1;

/// The file's first 64 bytes: what it is and of which boot.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    entries: AtomicU32,
    boot_id: [AtomicU64; 2],
    reserved: [AtomicU64; 4],
}

/// A thread and its baseline.
#[repr(C)]
struct Record {
    tid: AtomicU32,
    nice: AtomicU32,
    start_time: AtomicU64,
    policy: AtomicU32,
    priority: AtomicU32,
    flags: AtomicU64,
}

impl Record {
    fn write(&self, tid: u32, start_time: u64, b: &SchedAttr) {
        self.tid.store(tid, Ordering::Relaxed);
        self.start_time.store(start_time, Ordering::Relaxed);
        self.policy.store(b.policy, Ordering::Relaxed);
        self.priority.store(b.priority, Ordering::Relaxed);
        self.nice.store(b.nice as u32, Ordering::Relaxed);
        self.flags.store(b.flags, Ordering::Relaxed);
    }

    fn is(&self, tid: u32, start_time: u64) -> bool {
        self.tid.load(Ordering::Relaxed) == tid
            && self.start_time.load(Ordering::Relaxed) == start_time
    }

    fn attr(&self) -> SchedAttr {
        SchedAttr {
            policy: self.policy.load(Ordering::Relaxed),
            priority: self.priority.load(Ordering::Relaxed),
            nice: self.nice.load(Ordering::Relaxed) as i32,
            flags: self.flags.load(Ordering::Relaxed),
            // Not in the ledger (its layout is older): a thread the
            // guardian restores gets the kernel's default slice, as every
            // thread has unless its VMM set one.
            slice_ns: 0,
        }
    }
}

/// One ledger entry: `state` says which record is armed (FREE: none); a
/// record is written while it is not the armed one and published by the
/// store of `state` (release), read after `state` is seen (acquire).
#[repr(C)]
struct Entry {
    state: AtomicU32,
    pad: AtomicU32,
    rec: [Record; 2],
}

impl Entry {
    /// The armed record, if any.
    fn armed(&self) -> Option<(u32, &Record)> {
        match self.state.load(Ordering::Acquire) {
            s @ (ARMED | 2) => Some((s, &self.rec[(s - ARMED) as usize])),
            _ => None,
        }
    }
}

const LEDGER_BYTES: usize = size_of::<Header>() + LEDGER_ENTRIES * size_of::<Entry>();

/// The shared ledger of armed (boosted) threads.
pub struct Ledger {
    base: *mut u8,
    /// The ledger file, locked (None: an anonymous mapping).
    file: Option<(OwnedFd, PathBuf)>,
}

// SAFETY: the mapping is only accessed through atomics, and it lives as
// long as the Ledger (unmapped in Drop).
unsafe impl Send for Ledger {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for Ledger {}

/// What restoring one entry did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Restored {
    /// Nothing armed.
    Free,
    /// The thread has its baseline back.
    Done,
    /// The thread is gone, or its TID belongs to another thread now.
    Gone,
    /// sched_setattr failed: the entry stays armed.
    Failed,
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), as two words.
fn boot_id() -> [u64; 2] {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hex: String = text.chars().filter(char::is_ascii_hexdigit).collect();
    let word = |r: std::ops::Range<usize>| {
        hex.get(r)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .unwrap_or(0)
    };
    [word(0..16), word(16..32)]
}

/// Maps `len` bytes of `fd` (-1: anonymous) shared.
fn map_shared(fd: libc::c_int) -> io::Result<*mut u8> {
    let flags = if fd < 0 {
        libc::MAP_SHARED | libc::MAP_ANONYMOUS
    } else {
        libc::MAP_SHARED
    };
    // SAFETY: a new shared mapping of LEDGER_BYTES; the kernel picks the
    // address; `fd` is ours (or -1 with MAP_ANONYMOUS); MAP_FAILED checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEDGER_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

impl Ledger {
    /// A ledger in anonymous shared memory: only this process and the
    /// guardian it forks see it (`pvsched run`, `pvsched-agent-attach`).
    pub fn anonymous() -> io::Result<Ledger> {
        let base = map_shared(-1)?;
        // Zeroed by the kernel: every entry FREE.
        Ok(Ledger { base, file: None })
    }

    /// The ledger in file `path` (created mode 0600 if missing), locked for
    /// this process and the guardian it forks. Waits up to `wait` for a
    /// previous holder (a guardian still restoring). Entries armed by the
    /// previous holder are kept: [`Ledger::restore_armed`] restores them.
    /// A file of another layout or of an earlier boot is cleared.
    pub fn open(path: &Path, wait: Duration) -> Result<Ledger, GuardianError> {
        use std::os::unix::fs::OpenOptionsExt;
        let err = |what| {
            move |source| GuardianError::Ledger {
                path: path.into(),
                what,
                source,
            }
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(err("open"))?;
        let fd = OwnedFd::from(file);
        let t0 = Instant::now();
        loop {
            // SAFETY: flock on the fd we own; no pointers.
            if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(err("flock")(e));
            }
            if t0.elapsed() >= wait {
                return Err(GuardianError::Busy {
                    path: path.into(),
                    waited: t0.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if t0.elapsed() > Duration::from_millis(5) {
            log::info!(
                "pvsched ledger {}: waited {:?} for the previous agent's guardian",
                path.display(),
                t0.elapsed()
            );
        }
        let len = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map(|m| m.len())
            .map_err(err("fstat"))?;
        if len != LEDGER_BYTES as u64 {
            if len != 0 {
                log::warn!(
                    "pvsched ledger {}: {len} bytes, not {LEDGER_BYTES} (another version): cleared",
                    path.display()
                );
            }
            // SAFETY: ftruncate on the fd we own.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), 0) } != 0
                // SAFETY: as above.
                || unsafe { libc::ftruncate(fd.as_raw_fd(), LEDGER_BYTES as libc::off_t) } != 0
            {
                return Err(err("ftruncate")(io::Error::last_os_error()));
            }
        }
        let base = map_shared(fd.as_raw_fd()).map_err(err("mmap"))?;
        let l = Ledger {
            base,
            file: Some((fd, path.into())),
        };
        let h = l.header();
        let boot = boot_id();
        let same = h.magic.load(Ordering::Acquire) == MAGIC
            && h.version.load(Ordering::Relaxed) == VERSION
            && h.entries.load(Ordering::Relaxed) == LEDGER_ENTRIES as u32
            && h.boot_id[0].load(Ordering::Relaxed) == boot[0]
            && h.boot_id[1].load(Ordering::Relaxed) == boot[1];
        if !same {
            // A new file, another layout, or threads of an earlier boot.
            for i in 0..LEDGER_ENTRIES {
                l.entry_at(i).state.store(FREE, Ordering::Release);
            }
            h.version.store(VERSION, Ordering::Relaxed);
            h.entries.store(LEDGER_ENTRIES as u32, Ordering::Relaxed);
            h.boot_id[0].store(boot[0], Ordering::Relaxed);
            h.boot_id[1].store(boot[1], Ordering::Relaxed);
            h.magic.store(MAGIC, Ordering::Release);
        }
        Ok(l)
    }

    /// The file, if the ledger is one.
    pub fn path(&self) -> Option<&Path> {
        self.file.as_ref().map(|(_, p)| p.as_path())
    }

    fn raw_fd(&self) -> Option<libc::c_int> {
        self.file.as_ref().map(|(fd, _)| fd.as_raw_fd())
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header (LEDGER_BYTES long,
        // page aligned) and outlives &self; Header is made of atomics.
        unsafe { &*self.base.cast::<Header>() }
    }

    fn entry_at(&self, slot: usize) -> &Entry {
        debug_assert!(slot < LEDGER_ENTRIES);
        // SAFETY: slot < LEDGER_ENTRIES (callers check), so the entry lies
        // inside the mapping of LEDGER_BYTES, which outlives &self; Entry
        // is made of atomics (any bit pattern, shared access is fine) and
        // 8-byte aligned (Header is 64 bytes, Entry a multiple of 8).
        unsafe { &*self.base.add(size_of::<Header>()).cast::<Entry>().add(slot) }
    }

    fn entry(&self, slot: usize) -> Option<&Entry> {
        (slot < LEDGER_ENTRIES).then(|| self.entry_at(slot))
    }

    /// Records that thread `tid` (started at `start_time`) is about to be
    /// boosted and must get `baseline` back if the agent dies. An entry
    /// already armed for this thread with this baseline is left as it is;
    /// a changed baseline, or another thread, is written into the entry's
    /// other record and published by one store: the entry never reads as
    /// free in between.
    pub fn arm(&self, slot: usize, tid: u32, start_time: u64, baseline: &SchedAttr) {
        let Some(e) = self.entry(slot) else {
            log::error!("pvsched guardian: ledger slot {slot} out of range; tid {tid} unguarded");
            return;
        };
        let next = match e.armed() {
            Some((_, r)) if r.is(tid, start_time) && r.attr() == *baseline => return,
            Some((state, r)) => {
                if !r.is(tid, start_time) {
                    // Its restore failed earlier: try once more before the
                    // entry stops guarding it.
                    let old = r.tid.load(Ordering::Relaxed);
                    let done = restore_entry(e);
                    log::error!(
                        "pvsched guardian: ledger slot {slot} still guarded thread {old} \
                         (restore now: {done:?}); it now guards {tid}"
                    );
                }
                // The record not in use.
                if state == ARMED { ARMED + 1 } else { ARMED }
            }
            None => ARMED,
        };
        e.rec[(next - ARMED) as usize].write(tid, start_time, baseline);
        e.state.store(next, Ordering::Release);
    }

    /// The thread in `slot` has its baseline back.
    pub fn disarm(&self, slot: usize) {
        if let Some(e) = self.entry(slot) {
            e.state.store(FREE, Ordering::Release);
        }
    }

    /// Disarms `slot` if it still guards thread `tid` started at
    /// `start_time` (its guard moved to another slot).
    pub fn disarm_thread(&self, slot: usize, tid: u32, start_time: u64) {
        if let Some(e) = self.entry(slot)
            && let Some((state, r)) = e.armed()
            && r.is(tid, start_time)
        {
            let _ = e
                .state
                .compare_exchange(state, FREE, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// The armed entry of thread `tid` started at `start_time`, if any:
    /// its slot and the baseline it records. A thread with such an entry is
    /// boosted (its restore failed, or it was boosted by an agent that is
    /// gone): that baseline is its baseline, never its current attributes.
    pub fn armed_baseline(&self, tid: u32, start_time: u64) -> Option<(usize, SchedAttr)> {
        (0..LEDGER_ENTRIES).find_map(|i| {
            let (_, r) = self.entry_at(i).armed()?;
            r.is(tid, start_time).then(|| (i, r.attr()))
        })
    }

    /// Restores every armed entry whose thread is still the one recorded,
    /// and disarms it (also if its thread is gone); an entry whose restore
    /// failed stays armed. Returns how many were restored. Lock-free and
    /// allocation-free: the guardian and the agent's signal and panic paths
    /// call it, so a lock held by a panicking thread can never make them
    /// skip a thread.
    pub fn restore_armed(&self) -> usize {
        let mut n = 0;
        for i in 0..LEDGER_ENTRIES {
            let e = self.entry_at(i);
            let state = e.state.load(Ordering::Acquire);
            let r = restore_entry(e);
            if matches!(r, Restored::Done | Restored::Gone) {
                // Unless it was re-armed meanwhile (the agent's own
                // signal path races its consumer thread).
                let _ = e
                    .state
                    .compare_exchange(state, FREE, Ordering::AcqRel, Ordering::Relaxed);
            }
            n += usize::from(r == Restored::Done);
        }
        n
    }

    /// Armed entries (for tests and statistics).
    pub fn armed(&self) -> usize {
        (0..LEDGER_ENTRIES)
            .filter(|&i| self.entry_at(i).armed().is_some())
            .count()
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in anonymous()/open();
        // the file (and its lock) closes with `file` after this.
        unsafe { libc::munmap(self.base.cast(), LEDGER_BYTES) };
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

/// When process (or thread) `pid` started, seconds since the epoch: its
/// [`start_time`] over the clock-tick rate, after the boot time of
/// `/proc/stat`. None if it is gone or /proc says neither.
pub fn start_unix_s(pid: u32) -> Option<f64> {
    // SAFETY: sysconf takes a constant and reads no memory of ours.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let btime: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    let ticks = start_time(pid)?;
    (tck > 0).then(|| btime + ticks as f64 / tck as f64)
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
fn restore_entry(e: &Entry) -> Restored {
    let Some((_, r)) = e.armed() else {
        return Restored::Free;
    };
    let tid = r.tid.load(Ordering::Relaxed);
    if start_time(tid) != Some(r.start_time.load(Ordering::Relaxed)) {
        return Restored::Gone; // gone, or a new thread with a reused TID
    }
    match crate::sched::set(tid, &r.attr()) {
        Ok(()) => Restored::Done,
        Err(crate::sched::SchedError::Set { source, .. })
            if source.raw_os_error() == Some(libc::ESRCH) =>
        {
            Restored::Gone
        }
        Err(_) => Restored::Failed,
    }
}

impl Guardian {
    /// Forks the guardian over `ledger`. Call before the agent boosts
    /// anything.
    pub fn spawn(ledger: Ledger) -> Result<Guardian, GuardianError> {
        let setup = |what| move |source| GuardianError::Setup { what, source };
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
            child(&ledger, read_fd, write_fd);
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
fn child(ledger: &Ledger, read_fd: libc::c_int, write_fd: libc::c_int) -> ! {
    // SAFETY: raw system calls on stack memory, static C strings, the
    // inherited ledger mapping and the pipe and ledger fds; no allocation
    // and no locks (this process was forked from a multi-threaded one).
    unsafe {
        // Keep only the pipe (fd 3) and the ledger file (fd 4, whose lock
        // this process now shares): no BPF link, map or socket of the
        // agent stays open here. Both are first copied above 4 so that
        // moving one cannot close the other.
        // The agent's end first, whatever its number: open here, it would
        // hide the agent's death from the poll below.
        libc::close(write_fd);
        let pipe = libc::fcntl(read_fd, libc::F_DUPFD, 16);
        let file = ledger
            .raw_fd()
            .map(|lfd| libc::fcntl(lfd, libc::F_DUPFD, 16));
        if pipe < 0 || libc::dup2(pipe, 3) != 3 {
            libc::_exit(1);
        }
        match file {
            Some(l) if l < 0 || libc::dup2(l, 4) != 4 => libc::_exit(1),
            Some(_) => {}
            // Whatever fd 4 was (the pipe's write end, even) must not stay
            // open here: the guardian would never see the agent go.
            None => {
                libc::close(4);
            }
        }
        let fd = 3;
        let _ = libc::syscall(libc::SYS_close_range, 5u32, u32::MAX, 0u32);
        // Leave the agent's process group; never die before it. Every
        // signal that can be ignored is: `systemctl kill` sends the one it
        // is given to every process of the unit.
        libc::setpgid(0, 0);
        for sig in 1..libc::SIGRTMAX() {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_IGN);
            }
        }
        let adj = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if adj >= 0 {
            libc::write(adj, b"-1000".as_ptr().cast(), 5);
            libc::close(adj);
        }
        libc::prctl(libc::PR_SET_NAME, c"pvsched-guard".as_ptr());
        // Wake and restore ahead of every boosted thread it restores (it
        // runs once, for a few milliseconds); stays as it is if refused.
        let _ = crate::sched::set(
            0,
            &SchedAttr {
                policy: pvsched_abi::POLICY_FIFO,
                priority: RESTORER_RT_PRIO,
                nice: 0,
                flags: crate::sched::SCHED_FLAG_RESET_ON_FORK,
                slice_ns: 0,
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

    fn nice(n: i32) -> SchedAttr {
        SchedAttr {
            policy: pvsched_abi::POLICY_NORMAL,
            priority: 0,
            nice: n,
            flags: 0,
            slice_ns: 0,
        }
    }

    /// A thread of this process that lives until the returned sender is
    /// dropped or sent to.
    fn thread() -> (
        u32,
        std::sync::mpsc::Sender<()>,
        std::thread::JoinHandle<()>,
    ) {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(crate::sched::gettid()).unwrap();
            let _ = stop_rx.recv();
        });
        (rx.recv().unwrap(), stop_tx, t)
    }

    /// A reused TID (same tid, other start time) is never touched; the
    /// recorded thread gets exactly its baseline back. Lowering a thread's
    /// priority needs no privilege, so this runs as any user.
    #[test]
    fn restore_checks_the_thread_start_time() {
        let (tid, stop, t) = thread();
        crate::sched::set(tid, &nice(5)).unwrap();
        let start = start_time(tid).unwrap();
        let l = Ledger::anonymous().unwrap();
        l.arm(0, tid, start + 1, &nice(7)); // another thread's start time
        assert_eq!(restore_entry(l.entry_at(0)), Restored::Gone);
        assert_eq!(crate::sched::get(tid).unwrap().nice, 5, "untouched");
        l.arm(0, tid, start, &nice(7));
        assert_eq!(restore_entry(l.entry_at(0)), Restored::Done);
        assert_eq!(crate::sched::get(tid).unwrap(), nice(7));
        l.disarm(0);
        assert_eq!(restore_entry(l.entry_at(0)), Restored::Free);
        stop.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn ledger_arms_and_disarms() {
        let l = Ledger::anonymous().unwrap();
        let b = SchedAttr::default();
        l.arm(3, 10, 20, &b);
        l.arm(LEDGER_ENTRIES, 10, 20, &b); // out of range: refused, logged
        assert_eq!(l.armed(), 1);
        assert_eq!(l.armed_baseline(10, 20), Some((3, b)));
        assert_eq!(l.armed_baseline(10, 21), None, "another thread");
        l.disarm_thread(3, 10, 21);
        assert_eq!(l.armed(), 1, "disarm_thread checks the thread");
        l.disarm_thread(3, 10, 20);
        assert_eq!(l.armed(), 0);
        l.arm(3, 10, 20, &b);
        l.disarm(3);
        assert_eq!(l.armed(), 0);
    }

    /// Re-arming an armed entry (the same thread with another baseline,
    /// or another thread) never lets it read as free, not even for an
    /// instant: a reader polling the entry while it is re-armed 200,000
    /// times always finds a complete, armed record.
    #[test]
    fn rearming_never_passes_through_free() {
        let l = std::sync::Arc::new(Ledger::anonymous().unwrap());
        l.arm(7, 1000, 1, &nice(1));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (l, stop) = (l.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut reads, mut free) = (0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    match l.entry_at(7).armed() {
                        Some(_) => {}
                        None => free += 1,
                    }
                    reads += 1;
                }
                (reads, free)
            })
        };
        for i in 0..200_000u32 {
            // Alternately another baseline of the same thread and another
            // thread.
            if i % 2 == 0 {
                l.arm(7, 1000, 1, &nice((i % 19) as i32));
            } else {
                l.arm(7, 1000 + i, 1, &nice(0));
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (reads, free) = reader.join().unwrap();
        println!("{reads} reads while re-arming, {free} saw the entry free");
        assert_eq!(free, 0, "an armed entry read as free while re-armed");
    }

    /// A registered thread that the ledger lists as boosted (an earlier
    /// registration could not restore it) gets the ledger's baseline, not
    /// its current attributes: it is restored at once, and a later boost
    /// starts from, and returns to, that baseline.
    #[test]
    fn the_ledger_baseline_wins_over_a_boosted_state() {
        let (tid, stop, t) = thread();
        crate::sched::set(tid, &nice(3)).unwrap();
        let start = start_time(tid).unwrap();
        let g = std::sync::Arc::new(Guardian::spawn(Ledger::anonymous().unwrap()).unwrap());
        // An earlier registration (VM 5) boosted it to nice 1 and could
        // not restore it.
        g.ledger().arm(ledger_slot(5, 0), tid, start, &nice(3));
        crate::sched::set(tid, &nice(1)).unwrap();
        let mut th = crate::applier::ThreadState::guarded(tid, 0, 0, g.clone(), ledger_slot(0, 0));
        assert_eq!(crate::sched::get(tid).unwrap(), nice(3), "restored at once");
        assert_eq!(g.ledger().armed(), 0, "and no longer listed");
        let caps = pvsched_policy::Caps::default();
        assert!(th.apply(pvsched_abi::BOOST_NICE, -5, 0, &caps));
        assert_eq!(th.baseline, Some(nice(3)));
        assert_eq!(
            g.ledger().armed_baseline(tid, start),
            Some((ledger_slot(0, 0), nice(3)))
        );
        assert!(th.restore());
        assert_eq!(crate::sched::get(tid).unwrap(), nice(3));
        drop(th);
        drop(g);
        stop.send(()).unwrap();
        t.join().unwrap();
    }

    /// The file ledger survives its agent: entries armed by an agent that
    /// died without its guardian are restored by the next one to open the
    /// file, which waits while another holds it.
    #[test]
    fn a_file_ledger_outlives_its_agent() {
        let dir = std::env::temp_dir().join(format!("pvsched-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger");
        let (tid, stop, t) = thread();
        crate::sched::set(tid, &nice(3)).unwrap();
        let start = start_time(tid).unwrap();
        let first = Ledger::open(&path, Duration::ZERO).unwrap();
        // The "boost" (lowering needs no privilege: nice 3 → 6, with nice 3
        // recorded as the baseline).
        first.arm(ledger_slot(2, 1), tid, start, &nice(3));
        crate::sched::set(tid, &nice(6)).unwrap();
        // Held: a second agent on the same file waits, then gives up.
        match Ledger::open(&path, Duration::from_millis(50)) {
            Err(GuardianError::Busy { .. }) => {}
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("two holders of one ledger file"),
        }
        drop(first); // the agent and its guardian are gone; nothing restored
        assert_eq!(crate::sched::get(tid).unwrap().nice, 6);
        let next = Ledger::open(&path, Duration::ZERO).unwrap();
        assert_eq!(
            next.armed_baseline(tid, start),
            Some((ledger_slot(2, 1), nice(3)))
        );
        assert_eq!(next.restore_armed(), 1);
        assert_eq!(crate::sched::get(tid).unwrap(), nice(3));
        assert_eq!(next.armed(), 0);
        drop(next);
        let _ = std::fs::remove_dir_all(&dir);
        stop.send(()).unwrap();
        t.join().unwrap();
    }
}
