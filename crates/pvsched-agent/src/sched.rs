//! Thread scheduling attributes: `sched_getattr`/`sched_setattr` through
//! `libc::syscall` with the kernel's `struct sched_attr`, the baseline a
//! thread had before its first boost, and [`restore_baselines`], which a VMM
//! calls on its own vCPU threads when the agent dies (lowering a thread's
//! priority back to what it was needs no privilege).

use std::io;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// sched_getattr failed.
    #[error("sched_getattr(tid {tid}) failed: {source} (is the thread alive?)")]
    Get {
        /// Thread.
        tid: u32,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// sched_setattr failed.
    #[error(
        "sched_setattr(tid {tid}, {attr:?}) failed: {source} (EPERM: raising needs CAP_SYS_NICE; ESRCH: the thread exited)"
    )]
    Set {
        /// Thread.
        tid: u32,
        /// What was asked.
        attr: SchedAttr,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
}

/// Result alias.
pub type Result<T> = std::result::Result<T, SchedError>;

/// The kernel's `struct sched_attr` (VER0 + utilization clamps, 56 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RawSchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
    sched_util_min: u32,
    sched_util_max: u32,
}

/// `SCHED_FLAG_RESET_ON_FORK`.
pub const SCHED_FLAG_RESET_ON_FORK: u64 = 0x01;

/// The attributes the agent changes and restores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedAttr {
    /// `SCHED_*` policy.
    pub policy: u32,
    /// RT priority (FIFO/RR), else 0.
    pub priority: u32,
    /// Nice (NORMAL/BATCH/IDLE).
    pub nice: i32,
    /// `SCHED_FLAG_*` (only RESET_ON_FORK is kept and set).
    pub flags: u64,
    /// The fair-class time slice (`sched_attr.sched_runtime` of a
    /// NORMAL/BATCH/IDLE thread: EEVDF's custom slice, Linux 6.12+), ns;
    /// 0 = the kernel's default. [`get`] reports a slice equal to the
    /// default as 0, so a thread that never had one set gets none back.
    pub slice_ns: u64,
}

/// Whether `policy` is a fair-class one, whose slice `sched_runtime` sets.
fn fair(policy: u32) -> bool {
    matches!(
        policy,
        pvsched_abi::POLICY_NORMAL | pvsched_abi::POLICY_BATCH | pvsched_abi::POLICY_IDLE
    )
}

/// The kernel's default fair-class slice, ns, read once from the calling
/// thread or, if that one is not in the fair class (pvsched's applier runs
/// at SCHED_FIFO), from the process's main thread (pvsched never sets the
/// slice of its own threads); 0 on a kernel that reports none (before
/// 6.12: no custom slices) or if neither thread is in the fair class.
pub fn default_slice_ns() -> u64 {
    static DEFAULT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *DEFAULT.get_or_init(|| {
        [0, std::process::id()]
            .into_iter()
            .filter_map(|tid| raw_get(tid).ok())
            .find(|a| fair(a.sched_policy))
            .map_or(0, |a| a.sched_runtime)
    })
}

impl SchedAttr {
    /// Whether a thread that reads back as `cur` (sched_getattr) already has
    /// these attributes: policy and priority, and nice where the policy uses
    /// it (sched_getattr reports nice 0 for an RT thread).
    pub fn is_set_in(&self, cur: &SchedAttr) -> bool {
        let rt = self.policy == pvsched_abi::POLICY_FIFO || self.policy == pvsched_abi::POLICY_RR;
        cur.policy == self.policy
            && cur.priority == self.priority
            && (rt || cur.nice == self.nice)
            && (!fair(self.policy) || cur.slice_ns == self.slice_ns)
    }
}

/// Reads a thread's attributes.
pub fn get(tid: u32) -> Result<SchedAttr> {
    let a = raw_get(tid).map_err(|source| SchedError::Get { tid, source })?;
    let slice = if fair(a.sched_policy) && a.sched_runtime != default_slice_ns() {
        a.sched_runtime
    } else {
        0
    };
    Ok(SchedAttr {
        policy: a.sched_policy,
        priority: a.sched_priority,
        nice: a.sched_nice,
        flags: a.sched_flags,
        slice_ns: slice,
    })
}

/// `sched_getattr(tid)` (0: the calling thread).
fn raw_get(tid: u32) -> io::Result<RawSchedAttr> {
    let mut a = RawSchedAttr::default();
    // SAFETY: sched_getattr writes at most `size` (= size_of RawSchedAttr)
    // bytes into the valid, writable struct we pass; other args are integers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            tid as libc::pid_t,
            &mut a as *mut RawSchedAttr,
            size_of::<RawSchedAttr>() as u32,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(a)
}

/// Sets a thread's policy, priority, nice, fair-class slice and
/// RESET_ON_FORK flag.
pub fn set(tid: u32, attr: &SchedAttr) -> Result<()> {
    let a = RawSchedAttr {
        size: size_of::<RawSchedAttr>() as u32,
        sched_policy: attr.policy,
        sched_flags: attr.flags & SCHED_FLAG_RESET_ON_FORK,
        sched_nice: attr.nice,
        sched_priority: attr.priority,
        // A kernel before 6.12 ignores it for the fair policies; 0 puts
        // the default slice back.
        sched_runtime: if fair(attr.policy) { attr.slice_ns } else { 0 },
        ..Default::default()
    };
    // SAFETY: sched_setattr reads `a.size` bytes from the valid struct we
    // pass and nothing else; the other args are integers.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            tid as libc::pid_t,
            &a as *const RawSchedAttr,
            0u32,
        )
    };
    if r != 0 {
        return Err(SchedError::Set {
            tid,
            attr: *attr,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// A thread and the attributes it must get back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadBaseline {
    /// Thread id.
    pub tid: u32,
    /// Its attributes before any boost.
    pub attr: SchedAttr,
}

/// Captures the current attributes of `tids` (a VMM does this for its vCPU
/// threads before registering them, to restore them itself if the agent dies).
pub fn capture_baselines(tids: &[u32]) -> Result<Vec<ThreadBaseline>> {
    tids.iter()
        .map(|&tid| {
            Ok(ThreadBaseline {
                tid,
                attr: get(tid)?,
            })
        })
        .collect()
}

/// Puts every thread back to its baseline when it differs; returns how many
/// were changed, and the first error after trying them all.
///
/// ```no_run
/// let b = pvsched_agent::sched::capture_baselines(&[std::process::id()]).unwrap();
/// pvsched_agent::sched::restore_baselines(&b).unwrap();
/// ```
pub fn restore_baselines(baselines: &[ThreadBaseline]) -> Result<usize> {
    let mut n = 0;
    let mut first_err = None;
    for b in baselines {
        match get(b.tid) {
            Ok(cur) if b.attr.is_set_in(&cur) => {}
            _ => match set(b.tid, &b.attr) {
                Ok(()) => n += 1,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            },
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(n),
    }
}

/// How many CPUs threads `tids` may run on together: the CPUs in the
/// union of their affinity masks. None when no mask could be read (every
/// thread gone, or a host with more CPUs than a `cpu_set_t` holds).
pub fn cpus_of(tids: &[u32]) -> Option<u32> {
    // SAFETY: a zeroed cpu_set_t is an empty set.
    let mut all: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let mut read = false;
    for &tid in tids {
        // SAFETY: as above.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: sched_getaffinity writes at most the size passed into the
        // valid, writable set.
        let r = unsafe {
            libc::sched_getaffinity(tid as libc::pid_t, size_of::<libc::cpu_set_t>(), &mut set)
        };
        if r != 0 {
            continue;
        }
        read = true;
        for cpu in 0..libc::CPU_SETSIZE as usize {
            // SAFETY: cpu is below CPU_SETSIZE, the sets' size.
            if unsafe { libc::CPU_ISSET(cpu, &set) } {
                // SAFETY: as above.
                unsafe { libc::CPU_SET(cpu, &mut all) };
            }
        }
    }
    // SAFETY: CPU_COUNT reads only the set.
    read.then(|| unsafe { libc::CPU_COUNT(&all) } as u32)
}

/// The calling thread's id.
pub fn gettid() -> u32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_of_counts_the_union_of_the_threads_masks() {
        let own = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        assert_eq!(cpus_of(&[gettid()]), Some(own));
        assert_eq!(cpus_of(&[u32::MAX - 1]), None, "no such thread");
    }

    #[test]
    fn get_set_roundtrip_on_own_thread() {
        let tid = gettid();
        let before = get(tid).unwrap();
        let lower = SchedAttr {
            nice: (before.nice + 1).min(19),
            ..before
        };
        set(tid, &lower).unwrap();
        assert_eq!(get(tid).unwrap().nice, lower.nice);
        // Going back down from a raised nice needs CAP_SYS_NICE unless it is
        // within RLIMIT_NICE; this test thread only raises (lowers priority).
        let b = [ThreadBaseline { tid, attr: lower }];
        assert_eq!(restore_baselines(&b).unwrap(), 0);
    }

    #[test]
    fn a_slice_is_set_read_back_and_reset_to_the_default() {
        if default_slice_ns() == 0 {
            eprintln!("skipped: this kernel has no custom slices (before 6.12)");
            return;
        }
        // Its own thread: a longer slice needs no privilege.
        std::thread::spawn(|| {
            let tid = gettid();
            let base = get(tid).unwrap();
            assert_eq!(base.slice_ns, 0, "the default reads as 0");
            let long = SchedAttr {
                slice_ns: 4_000_000,
                ..base
            };
            set(tid, &long).unwrap();
            let got = get(tid).unwrap();
            assert_eq!(got.slice_ns, 4_000_000);
            assert!(long.is_set_in(&got) && !base.is_set_in(&got));
            set(tid, &base).unwrap();
            assert_eq!(get(tid).unwrap(), base, "back to the default");
        })
        .join()
        .unwrap();
    }
}
