//! The embedded BPF policy object: load (and optionally attach) it with aya,
//! populate its maps, mmap a VM's region element, run synthetic events with
//! `BPF_PROG_TEST_RUN` (raw `bpf(2)`; aya 0.14 has no test-run call), read
//! decisions and statistics. Used by the agent and by the differential test.

use crate::intf::{
    APIC_FAST, Decision, MAX_VMS, PvsStats, PvsTidHint, PvsVcpu, PvsVm, REGION_STRIDE,
    THREADS_PER_VM, TID_HINTS, vcpu_key,
};
use aya::maps::{Array, ArrayOfMaps, HashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::{BtfTracePoint, RawTracePoint};
use aya::{Btf, Ebpf, EbpfLoader};
use pvsched_abi::seq::{SharedRegion, SharedWords};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;

/// The compiled policy (built by build.rs from bpf-policy/).
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/pvsched.bpf.o"));

/// Tracepoint programs: (program, tp_btf tracepoint).
pub const TRACEPOINTS: [(&str, &str); 7] = [
    ("pvs_sched_switch", "sched_switch"),
    ("pvs_sched_wakeup", "sched_wakeup"),
    ("pvs_sched_process_exit", "sched_process_exit"),
    ("pvs_sched_process_exec", "sched_process_exec"),
    ("pvs_kvm_vcpu_wakeup", "kvm_vcpu_wakeup"),
    ("pvs_kvm_apic_ipi", "kvm_apic_ipi"),
    ("pvs_kvm_userspace_exit", "kvm_userspace_exit"),
];
/// Bytes of the decision ring buffer by default (4,681 records of 48 bytes
/// plus the ring's 8-byte header).
pub const DEFAULT_RING_BYTES: u32 = 256 * 1024;
/// The re-evaluation entry (agent timer, device KICK; the differential
/// test's synthetic events), run with `BPF_PROG_TEST_RUN`.
pub const REEVAL_PROG: &str = "pvs_reeval";

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum ObjectError {
    /// Kernel BTF unavailable.
    #[error(
        "reading kernel BTF from /sys/kernel/btf/vmlinux failed: {0} (the policy needs CONFIG_DEBUG_INFO_BTF)"
    )]
    Btf(#[source] aya::BtfError),
    /// The object could not be loaded.
    #[error(
        "loading the BPF policy object failed: {0} (needs root or CAP_BPF+CAP_PERFMON, kernel BTF, and cgroup memory for the maps)"
    )]
    Load(#[source] aya::EbpfError),
    /// A program is missing from the object.
    #[error("BPF program {0} missing from the embedded object (rebuild pvsched-agent)")]
    NoProgram(&'static str),
    /// A map is missing from the object.
    #[error("BPF map {0} missing from the embedded object (rebuild pvsched-agent)")]
    NoMap(&'static str),
    /// The verifier or the attach refused a program.
    #[error("BPF program {name}: {what} failed: {source}")]
    Program {
        /// Program.
        name: &'static str,
        /// load or attach.
        what: &'static str,
        /// Cause (the verifier log is in it).
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A map operation failed.
    #[error("BPF map {name}: {source}")]
    Map {
        /// Map.
        name: &'static str,
        /// The BPF map operation's error, from aya.
        #[source]
        source: aya::maps::MapError,
    },
    /// A system call failed.
    #[error("{what} failed: {source}")]
    Sys {
        what: &'static str,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// A bad argument.
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    /// A gid outside the `vcpus` array (a bug in the caller).
    #[error(
        "thread id {0:#x} names no element of the policy's vcpus array (VM id or index out of range)"
    )]
    BadGid(u32),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, ObjectError>;

fn map_err(name: &'static str) -> impl FnOnce(aya::maps::MapError) -> ObjectError {
    move |source| ObjectError::Map { name, source }
}

/// A new fd of map `d` (`what` names the call in the error).
fn dup_map_fd(d: &MapData, what: &'static str) -> Result<OwnedFd> {
    d.fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| ObjectError::Sys { what, source })
}

/// A loaded policy object.
pub struct PolicyObject {
    ebpf: Ebpf,
    reeval_fd: OwnedFd,
    ring: Option<RingBuf<MapData>>,
    regions: ArrayOfMaps<MapData, MapData>,
    /// A duplicate of `regions`' fd (aya's `ArrayOfMaps` has no delete).
    regions_fd: OwnedFd,
    /// What `tids` holds (only this object writes it): the threads of each
    /// `tid_hint` element, without reading the map back.
    tids: std::collections::HashMap<u32, u32>,
    /// The `vcpus` array, mapped (read through [`PolicyView`], written by
    /// the policy).
    vcpus_map: Arc<SharedRegion>,
}

/// Byte offset of the field at `field` of thread `gid`'s element of the
/// mapped `vcpus` array, None for a gid outside it (the mapping holds every
/// element a valid gid names).
fn vcpu_field(gid: u32, field: usize) -> Option<usize> {
    Some(vcpu_key(gid)? as usize * size_of::<PvsVcpu>() + field)
}

/// What the applier reads of the policy, held apart from the
/// [`PolicyObject`] so that reading it takes no lock another thread may
/// hold: the mapped `vcpus` array and its own handle of the `stats` map.
pub struct PolicyView {
    vcpus_map: Arc<SharedRegion>,
    stats: PerCpuArray<MapData, PvsStats>,
}

impl PolicyView {
    /// A thread's (tid, boost, boost_prio) as the policy holds them now,
    /// read from the mapped array with no system call (each word atomic;
    /// a boost changing meanwhile is seen at the next read).
    pub fn vcpu_boost(&self, gid: u32) -> Option<(u32, u32, i32)> {
        Some((
            self.vcpu_word(gid, std::mem::offset_of!(PvsVcpu, tid))?,
            self.vcpu_word(gid, std::mem::offset_of!(PvsVcpu, boost))?,
            self.vcpu_word(gid, std::mem::offset_of!(PvsVcpu, boost_prio))? as i32,
        ))
    }

    /// Whether the policy holds the thread throttled now (no boost until
    /// its throttle ends), read from the mapped array.
    pub fn vcpu_throttled(&self, gid: u32) -> Option<bool> {
        Some(self.vcpu_word(gid, std::mem::offset_of!(PvsVcpu, throttled))? != 0)
    }

    /// The 32-bit word at byte offset `off` of thread `gid`'s element of
    /// the mapped `vcpus` array (an atomic read), None for a gid outside it.
    fn vcpu_word(&self, gid: u32, off: usize) -> Option<u32> {
        Some(
            self.vcpus_map
                .words()
                .load(vcpu_field(gid, off)?, std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// Whether the policy ignores thread `gid`'s `wait_on` for its VM's
    /// width ([`PvsVcpu::wait_on_off`], the agent's own word).
    pub fn vcpu_wait_on_off(&self, gid: u32) -> Option<bool> {
        Some(self.vcpu_word(gid, std::mem::offset_of!(PvsVcpu, wait_on_off))? != 0)
    }

    /// Sets that word: a store into the mapped array, which the policy
    /// only reads (a gid outside it changes nothing).
    pub fn set_vcpu_wait_on_off(&self, gid: u32, off: bool) {
        if let Some(at) = vcpu_field(gid, std::mem::offset_of!(PvsVcpu, wait_on_off)) {
            self.vcpus_map
                .words()
                .store(at, u32::from(off), std::sync::atomic::Ordering::Release);
        }
    }

    /// Until when (`CLOCK_MONOTONIC` ns) the policy holds the thread
    /// latency-sensitive (its guest last ran an RT task).
    pub fn vcpu_ls_until(&self, gid: u32) -> Option<u64> {
        self.vcpu_u64(gid, std::mem::offset_of!(PvsVcpu, ls_until))
    }

    /// How much vCPU `gid` waited for its siblings so far: (halts while a
    /// sibling was preempted, wake-ups by a sibling).
    pub fn vcpu_sync(&self, gid: u32) -> Option<(u64, u64)> {
        Some((
            self.vcpu_u64(gid, std::mem::offset_of!(PvsVcpu, sync_halts))?,
            self.vcpu_u64(gid, std::mem::offset_of!(PvsVcpu, sib_wakes))?,
        ))
    }

    /// The u64 at `field` of thread `gid`'s record, read from the mapped
    /// array: the two halves again until they agree, so a value the policy
    /// rewrites meanwhile is never read torn.
    fn vcpu_u64(&self, gid: u32, field: usize) -> Option<u64> {
        let words = self.vcpus_map.words();
        let off = vcpu_field(gid, field)?;
        let read = || {
            let lo = words.load(off, std::sync::atomic::Ordering::Acquire);
            let hi = words.load(off + 4, std::sync::atomic::Ordering::Acquire);
            u64::from(hi) << 32 | u64::from(lo)
        };
        let mut v = read();
        for _ in 0..4 {
            let again = read();
            if again == v {
                break;
            }
            v = again;
        }
        Some(v)
    }

    /// Sums the per-CPU statistics.
    pub fn stats(&self) -> Result<PvsStats> {
        sum_stats(&self.stats)
    }
}

fn sum_stats<T: std::borrow::Borrow<MapData>>(a: &PerCpuArray<T, PvsStats>) -> Result<PvsStats> {
    let per = a.get(&0, 0).map_err(map_err("stats"))?;
    let mut s = PvsStats::default();
    for c in per.iter() {
        for (d, e) in s.events.iter_mut().zip(c.events.iter()) {
            *d += e;
        }
        s.decisions += c.decisions;
        s.dropped += c.dropped;
        s.boosts += c.boosts;
        s.unboosts += c.unboosts;
        s.throttles += c.throttles;
        s.ipi_pairs += c.ipi_pairs;
        s.slot_hits += c.slot_hits;
        s.torn_reads += c.torn_reads;
        s.read_errors += c.read_errors;
        s.publish_busy += c.publish_busy;
        for (d, e) in s.full_runs.iter_mut().zip(c.full_runs.iter()) {
            *d += e;
        }
    }
    Ok(s)
}

/// Loads every tracepoint program of `ebpf` (the kernel's verifier checks
/// each) and, with `attach`, attaches it.
fn load_tracepoints(ebpf: &mut Ebpf, btf: &Btf, attach: bool) -> Result<()> {
    for (name, tp) in TRACEPOINTS {
        let p: &mut BtfTracePoint = ebpf
            .program_mut(name)
            .ok_or(ObjectError::NoProgram(name))?
            .try_into()
            .map_err(|source| ObjectError::Program {
                name,
                what: "type",
                source,
            })?;
        p.load(tp, btf).map_err(|source| ObjectError::Program {
            name,
            what: "load",
            source,
        })?;
        if attach {
            p.attach().map_err(|source| ObjectError::Program {
                name,
                what: "attach",
                source,
            })?;
        }
    }
    Ok(())
}

/// Loads the re-evaluation entry (never attached: the agent test-runs it)
/// and returns a descriptor of it of its own.
fn load_reeval(ebpf: &mut Ebpf) -> Result<OwnedFd> {
    let p: &mut RawTracePoint = ebpf
        .program_mut(REEVAL_PROG)
        .ok_or(ObjectError::NoProgram(REEVAL_PROG))?
        .try_into()
        .map_err(|source| ObjectError::Program {
            name: REEVAL_PROG,
            what: "type",
            source,
        })?;
    p.load().map_err(|source| ObjectError::Program {
        name: REEVAL_PROG,
        what: "load",
        source,
    })?;
    p.fd()
        .map_err(|source| ObjectError::Program {
            name: REEVAL_PROG,
            what: "fd",
            source,
        })?
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| ObjectError::Sys {
            what: "dup program fd",
            source,
        })
}

impl PolicyObject {
    /// Loads every program of the policy into the kernel without attaching
    /// any, and unloads them as it returns: whether this kernel accepts
    /// the policy (`pvsched doctor`), without touching the host's events.
    pub fn verify() -> Result<()> {
        let btf = Btf::from_sys_fs().map_err(ObjectError::Btf)?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .load(OBJECT)
            .map_err(ObjectError::Load)?;
        load_tracepoints(&mut ebpf, &btf, false)?;
        load_reeval(&mut ebpf).map(drop)
    }

    /// Loads the object; loads and attaches the tracepoint programs if
    /// `attach`, and always loads (never attaches) the re-evaluation entry.
    pub fn load(attach: bool) -> Result<PolicyObject> {
        Self::load_with(attach, DEFAULT_RING_BYTES)
    }

    /// [`Self::load`] with a decision ring of `ring_bytes` (a power of two,
    /// at least one page; others are refused).
    pub fn load_with(attach: bool, ring_bytes: u32) -> Result<PolicyObject> {
        if !ring_bytes.is_power_of_two() || ring_bytes < 4096 {
            return Err(ObjectError::Invalid(
                "the decision ring size must be a power of two of at least 4096 bytes",
            ));
        }
        let btf = Btf::from_sys_fs().map_err(ObjectError::Btf)?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .map_max_entries("decisions", ring_bytes)
            .load(OBJECT)
            .map_err(ObjectError::Load)?;
        if attach {
            load_tracepoints(&mut ebpf, &btf, true)?;
        }
        let reeval_fd = load_reeval(&mut ebpf)?;
        let ring = RingBuf::try_from(
            ebpf.take_map("decisions")
                .ok_or(ObjectError::NoMap("decisions"))?,
        )
        .map_err(map_err("decisions"))?;
        let regions_fd = match ebpf.map("regions").ok_or(ObjectError::NoMap("regions"))? {
            aya::maps::Map::ArrayOfMaps(d) => dup_map_fd(d, "dup regions fd")?,
            _ => return Err(ObjectError::NoMap("regions")),
        };
        let regions = ArrayOfMaps::try_from(
            ebpf.take_map("regions")
                .ok_or(ObjectError::NoMap("regions"))?,
        )
        .map_err(map_err("regions"))?;
        let vcpus_fd = match ebpf.map("vcpus").ok_or(ObjectError::NoMap("vcpus"))? {
            aya::maps::Map::Array(d) => dup_map_fd(d, "dup vcpus fd")?,
            _ => return Err(ObjectError::NoMap("vcpus")),
        };
        let vcpus_len = (MAX_VMS * THREADS_PER_VM) as usize * size_of::<PvsVcpu>();
        let vcpus_map =
            SharedRegion::map(std::fs::File::from(vcpus_fd), vcpus_len).map_err(|e| {
                ObjectError::Sys {
                    what: "mmap of the policy's vcpus map (needs BPF_F_MMAPABLE)",
                    source: io::Error::other(e.to_string()),
                }
            })?;
        Ok(PolicyObject {
            ebpf,
            reeval_fd,
            ring: Some(ring),
            regions,
            regions_fd,
            tids: std::collections::HashMap::new(),
            vcpus_map: Arc::new(vcpus_map),
        })
    }

    /// A duplicate of the test-run program fd (for the agent's timer).
    pub fn reeval_fd(&self) -> io::Result<OwnedFd> {
        self.reeval_fd.try_clone()
    }

    /// Takes the decisions ring buffer (once).
    pub fn take_ring(&mut self) -> Option<RingBuf<MapData>> {
        self.ring.take()
    }

    /// The decisions ring buffer's fd (if not taken), for epoll: readable
    /// once the policy woke its reader.
    pub fn decisions_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.ring.as_ref().map(|r| r.as_fd())
    }

    /// Drains the decisions ring buffer (if not taken).
    pub fn drain_decisions(&mut self) -> Vec<Decision> {
        let mut out = Vec::new();
        if let Some(r) = self.ring.as_mut() {
            while let Some(item) = r.next() {
                if let Some(d) = Decision::from_bytes(&item) {
                    out.push(d);
                }
            }
        }
        out
    }

    /// Writes VM `vm_id`'s record.
    pub fn set_vm(&mut self, vm_id: u32, vm: &PvsVm) -> Result<()> {
        let mut a: Array<_, PvsVm> =
            Array::try_from(self.ebpf.map_mut("vms").ok_or(ObjectError::NoMap("vms"))?)
                .map_err(map_err("vms"))?;
        a.set(vm_id, vm, 0).map_err(map_err("vms"))
    }

    /// Reads VM `vm_id`'s record (with the BPF-owned `ls_until`).
    pub fn vm(&self, vm_id: u32) -> Result<PvsVm> {
        let a: Array<_, PvsVm> =
            Array::try_from(self.ebpf.map("vms").ok_or(ObjectError::NoMap("vms"))?)
                .map_err(map_err("vms"))?;
        a.get(&vm_id, 0).map_err(map_err("vms"))
    }

    /// Writes a thread's state (element [`vcpu_key`]`(gid)` of the array).
    pub fn set_vcpu(&mut self, gid: u32, v: &PvsVcpu) -> Result<()> {
        let key = vcpu_key(gid).ok_or(ObjectError::BadGid(gid))?;
        let mut a: Array<_, PvsVcpu> = Array::try_from(
            self.ebpf
                .map_mut("vcpus")
                .ok_or(ObjectError::NoMap("vcpus"))?,
        )
        .map_err(map_err("vcpus"))?;
        a.set(key, v, 0).map_err(map_err("vcpus"))
    }

    /// Reads a thread's state (all zeros for a thread never registered).
    pub fn vcpu(&self, gid: u32) -> Result<PvsVcpu> {
        let key = vcpu_key(gid).ok_or(ObjectError::BadGid(gid))?;
        let a: Array<_, PvsVcpu> =
            Array::try_from(self.ebpf.map("vcpus").ok_or(ObjectError::NoMap("vcpus"))?)
                .map_err(map_err("vcpus"))?;
        a.get(&key, 0).map_err(map_err("vcpus"))
    }

    /// Where the agent tells the policy thread `gid`'s co-scheduling phase
    /// (its `phase` word in the mapped array), None for a gid outside it.
    pub fn phase_word(&self, gid: u32) -> Option<crate::applier::PhaseWord> {
        let off = vcpu_field(gid, std::mem::offset_of!(PvsVcpu, phase))?;
        Some(crate::applier::PhaseWord::new(self.vcpus_map.clone(), off))
    }

    /// Clears a thread's state (array elements cannot be removed).
    pub fn remove_vcpu(&mut self, gid: u32) -> Result<()> {
        self.set_vcpu(gid, &PvsVcpu::default())
    }

    /// Removes thread `tid`'s mapping if it still maps to `gid` (a reused
    /// TID registered since by another VM keeps its own).
    pub fn unset_tid(&mut self, tid: u32, gid: u32) -> Result<()> {
        if self.tids.get(&tid) == Some(&gid) {
            self.set_tid(tid, None)?;
        }
        Ok(())
    }

    /// Maps a thread to a vCPU or emulator gid (`None` removes it) and keeps
    /// the `tid_hint` prefilter: the count of registered threads in each
    /// element and, where that is one, the thread and its `vcpus` key. The
    /// policy reads the element while it is written here and trusts its key
    /// only if the `vcpus` element it names is that thread; `tids` is
    /// written first on the way in and last on the way out, so a thread the
    /// element counts is always found there.
    pub fn set_tid(&mut self, tid: u32, gid: Option<u32>) -> Result<()> {
        match gid {
            Some(g) => {
                vcpu_key(g).ok_or(ObjectError::BadGid(g))?;
                self.tids_map()?
                    .insert(tid, g, 0)
                    .map_err(map_err("tids"))?;
                self.tids.insert(tid, g);
                self.write_hint(tid)
            }
            None => {
                if self.tids.remove(&tid).is_none() {
                    return Ok(());
                }
                self.write_hint(tid)?;
                self.tids_map()?.remove(&tid).map_err(map_err("tids"))
            }
        }
    }

    fn tids_map(&mut self) -> Result<HashMap<&mut MapData, u32, u32>> {
        HashMap::try_from(
            self.ebpf
                .map_mut("tids")
                .ok_or(ObjectError::NoMap("tids"))?,
        )
        .map_err(map_err("tids"))
    }

    /// Rewrites the `tid_hint` element of `tid` from the registered threads
    /// in `self.tids`.
    fn write_hint(&mut self, tid: u32) -> Result<()> {
        let slot = tid & (TID_HINTS - 1);
        let here: Vec<(u32, u32)> = self
            .tids
            .iter()
            .filter(|(t, _)| **t & (TID_HINTS - 1) == slot)
            .map(|(t, g)| (*t, *g))
            .collect();
        let hint = match here.as_slice() {
            [(t, g)] => PvsTidHint {
                count: 1,
                tid: *t,
                key: vcpu_key(*g).ok_or(ObjectError::BadGid(*g))?,
                pad0: 0,
            },
            more => PvsTidHint {
                count: u32::try_from(more.len()).unwrap_or(u32::MAX),
                ..PvsTidHint::default()
            },
        };
        let mut h: Array<_, PvsTidHint> = Array::try_from(
            self.ebpf
                .map_mut("tid_hint")
                .ok_or(ObjectError::NoMap("tid_hint"))?,
        )
        .map_err(map_err("tid_hint"))?;
        h.set(slot, hint, 0).map_err(map_err("tid_hint"))
    }

    /// Maps (vm, APIC ID) to a slot index (`None` removes it): in
    /// `apic_fast` below [`APIC_FAST`], in `apics` from there.
    pub fn set_apic(&mut self, vm_id: u32, apic_id: u32, index: Option<u32>) -> Result<()> {
        if apic_id < APIC_FAST {
            let key = vm_id
                .checked_mul(APIC_FAST)
                .and_then(|k| k.checked_add(apic_id))
                .filter(|_| vm_id < MAX_VMS)
                .ok_or(ObjectError::Invalid("VM id out of range"))?;
            let mut a: Array<_, u32> = Array::try_from(
                self.ebpf
                    .map_mut("apic_fast")
                    .ok_or(ObjectError::NoMap("apic_fast"))?,
            )
            .map_err(map_err("apic_fast"))?;
            let v = match index {
                Some(i) => i.checked_add(1).ok_or(ObjectError::Invalid("slot index"))?,
                None => 0,
            };
            return a.set(key, v, 0).map_err(map_err("apic_fast"));
        }
        let mut m: HashMap<_, u64, u32> = HashMap::try_from(
            self.ebpf
                .map_mut("apics")
                .ok_or(ObjectError::NoMap("apics"))?,
        )
        .map_err(map_err("apics"))?;
        let key = ((vm_id as u64) << 32) | apic_id as u64;
        match index {
            Some(i) => m.insert(key, i, 0).map_err(map_err("apics")),
            None => m.remove(&key).map_err(map_err("apics")),
        }
    }

    /// Sums the per-CPU statistics.
    pub fn stats(&self) -> Result<PvsStats> {
        let a: PerCpuArray<_, PvsStats> =
            PerCpuArray::try_from(self.ebpf.map("stats").ok_or(ObjectError::NoMap("stats"))?)
                .map_err(map_err("stats"))?;
        sum_stats(&a)
    }

    /// A [`PolicyView`]: the `vcpus` mapping shared, the `stats` map
    /// through a new fd.
    pub fn view(&self) -> Result<PolicyView> {
        let d = match self.ebpf.map("stats").ok_or(ObjectError::NoMap("stats"))? {
            aya::maps::Map::PerCpuArray(d) => dup_map_fd(d, "dup stats fd")?,
            _ => return Err(ObjectError::NoMap("stats")),
        };
        let map = aya::maps::Map::from_map_data(MapData::from_fd(d).map_err(map_err("stats"))?)
            .map_err(map_err("stats"))?;
        Ok(PolicyView {
            vcpus_map: self.vcpus_map.clone(),
            stats: PerCpuArray::try_from(map).map_err(map_err("stats"))?,
        })
    }

    /// Run time statistics of every loaded program: (name, run_cnt, run_time_ns).
    /// Counted only while `kernel.bpf_stats_enabled=1` or an
    /// [`aya::sys::enable_stats`] fd is held.
    pub fn prog_stats(&self) -> Vec<(String, u64, u64)> {
        self.ebpf
            .programs()
            .filter_map(|(name, p)| {
                let i = p.info().ok()?;
                Some((
                    name.to_string(),
                    i.run_count(),
                    i.run_time().as_nanos() as u64,
                ))
            })
            .collect()
    }

    /// Creates VM `vm_id`'s region (a one-element mmapable array, zeroed),
    /// installs it at element `vm_id` of `regions` and maps it. The
    /// mapping is shared with BPF and, through a KVM memslot, with the
    /// guest; [`RegionMmap::fd`] is what a VMM in another process maps.
    pub fn map_region(&mut self, vm_id: u32) -> Result<RegionMmap> {
        let region = Self::create_region()?;
        self.attach_region(vm_id, &region)?;
        Ok(region)
    }

    /// Creates a region map (zero-filled, mapped) that no VM uses yet: a
    /// device process can serve it as BAR2 before the VM's vCPU threads
    /// exist; [`PolicyObject::attach_region`] gives it to a VM later.
    pub fn create_region() -> Result<RegionMmap> {
        let def = aya_obj::Map::new_from_params(
            aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            size_of::<u32>() as u32,
            REGION_STRIDE,
            1,
            BPF_F_MMAPABLE,
        );
        let map = MapData::create(def, "pvs_region", None).map_err(map_err("pvs_region"))?;
        RegionMmap::new(map)
    }

    /// Makes `region` VM `vm_id`'s region (element vm_id of `regions`):
    /// the BPF programs read its slots from then on.
    pub fn attach_region(&mut self, vm_id: u32, region: &RegionMmap) -> Result<()> {
        if vm_id >= MAX_VMS {
            return Err(ObjectError::Invalid("vm_id >= MAX_VMS"));
        }
        self.regions
            .set(vm_id, &region.map, 0)
            .map_err(map_err("regions"))
    }

    /// Removes VM `vm_id`'s region from `regions` (BPF stops seeing it; the
    /// map itself lives while a mapping or an fd of it does).
    pub fn unmap_region(&mut self, vm_id: u32) -> Result<()> {
        bpf_delete(&self.regions_fd, &vm_id).map_err(|source| ObjectError::Sys {
            what: "bpf(BPF_MAP_DELETE_ELEM) on regions",
            source,
        })
    }

    /// Runs one event through the policy's re-evaluation entry
    /// (`BPF_PROG_TEST_RUN` on `pvs_reeval`).
    pub fn reevaluate(&self, event: u32, gid: u32, now: u64, a: u64, b: u64) -> Result<u32> {
        reevaluate(&self.reeval_fd, event, gid, now, a, b).map_err(|source| ObjectError::Sys {
            what: "bpf(BPF_PROG_TEST_RUN)",
            source,
        })
    }
}

/// `union bpf_attr`, the `test` member used by BPF_PROG_TEST_RUN.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;

/// `union bpf_attr`, the map element members.
#[repr(C)]
#[derive(Default)]
struct MapElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `bpf(BPF_MAP_DELETE_ELEM)` of a u32 key.
fn bpf_delete(map: &OwnedFd, key: &u32) -> io::Result<()> {
    let mut attr = MapElemAttr {
        map_fd: map.as_raw_fd() as u32,
        key: key as *const u32 as u64,
        ..Default::default()
    };
    // SAFETY: attr is a valid, initialised bpf_attr prefix of the size we
    // pass; `key` points to a live u32 for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_DELETE_ELEM,
            &mut attr as *mut MapElemAttr,
            size_of::<MapElemAttr>() as u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs the re-evaluation entry `fd` (`BPF_PROG_TEST_RUN`) with raw_tp args `[event, gid, now, a, b]`.
pub fn reevaluate(fd: &OwnedFd, event: u32, gid: u32, now: u64, a: u64, b: u64) -> io::Result<u32> {
    let args: [u64; 5] = [event as u64, gid as u64, now, a, b];
    let mut attr = TestRunAttr {
        prog_fd: fd.as_raw_fd() as u32,
        ctx_size_in: size_of_val(&args) as u32,
        ctx_in: args.as_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: attr is a valid, initialised bpf_attr prefix of the size we
    // pass; ctx_in points to `args`, alive for the call; the kernel writes
    // only into attr (retval, duration).
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestRunAttr,
            size_of::<TestRunAttr>() as u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr.retval)
}

/// A VM's region: its own one-element `REGION_STRIDE`-byte BPF array
/// (element vm_id of `regions`), mapped shared over the map's fd as a
/// [`SharedRegion`] (which it derefs to: `as_ptr`, `len`, `words`,
/// `write_guest`, `read_host`, `clear`). The VMM registers `as_ptr()`/`len()`
/// as BAR2's KVM memslot, or, in another process, maps [`RegionMmap::fd`] at
/// offset 0; BPF, the guest and the host see the same bytes.
pub struct RegionMmap {
    region: SharedRegion,
    map: MapData,
}

/// `BPF_F_MMAPABLE` (include/uapi/linux/bpf.h).
const BPF_F_MMAPABLE: u32 = 1 << 10;

impl RegionMmap {
    fn new(map: MapData) -> Result<RegionMmap> {
        let fd = dup_map_fd(&map, "dup of a VM's region map fd")?;
        // A shared mapping of the one-element mmapable array whose value is
        // REGION_STRIDE bytes (page aligned), at offset 0.
        let region =
            SharedRegion::map(std::fs::File::from(fd), REGION_STRIDE as usize).map_err(|e| {
                ObjectError::Sys {
                    what: "mmap of a VM's region map (needs BPF_F_MMAPABLE)",
                    source: io::Error::other(e.to_string()),
                }
            })?;
        Ok(RegionMmap { region, map })
    }

    /// A new fd of the region's BPF map, for the VMM (or device process)
    /// that maps it as BAR2: `mmap(NULL, len, PROT_READ|PROT_WRITE,
    /// MAP_SHARED, fd, 0)`. It gives access to this VM's region only.
    pub fn fd(&self) -> io::Result<OwnedFd> {
        self.map.fd().as_fd().try_clone_to_owned()
    }
}

impl std::ops::Deref for RegionMmap {
    type Target = SharedRegion;

    fn deref(&self) -> &SharedRegion {
        &self.region
    }
}
