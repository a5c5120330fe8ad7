//! Host-side view of the region for tests and operators (`--dump-slots`):
//! the device process samples every slot often (default every 500 µs),
//! accumulates what it saw and periodically rewrites a JSON file.
//!
//! No thread: the sandbox allows none after it is entered, and a thread
//! started before would keep the privileges the sandbox drops (capabilities,
//! `PR_SET_NO_NEW_PRIVS`, namespaces and Landlock are per thread). The
//! serving loop calls [`SlotDumper::tick`] instead: mpqemu waits for its
//! socket with a timeout of [`SlotDumper::until_next_sample`], vfio-user
//! ticks on every message and, through the server's idle hook, whenever
//! the client has been silent for a sample period; both call
//! [`SlotDumper::finish`] at disconnect.
//!
//! The file is opened (created, truncated) before the sandbox and kept: it
//! is rewritten in place with `pwrite` at offset 0, padded with spaces to
//! its longest length so far (JSON allows trailing whitespace), because
//! `open`/`rename` are forbidden afterwards. A reader may therefore catch a
//! half-rewritten file: it should retry on a parse error (the Linux-guest
//! harness does). The file's mtime is its last write time.
//!
//! The accumulated counters let a test assert on things too brief to catch
//! in a single snapshot (a hard-IRQ bit that is set for microseconds, an RT
//! task that ran for a second).

use crate::monitor::{MonitorState, TransportMonitor};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Errors of the slot dumper.
#[derive(Debug, Error)]
pub enum DumpError {
    /// Creating the JSON file failed.
    #[error("creating slot dump {path}: {source}; check the directory exists and is writable")]
    Create {
        /// Target path.
        path: PathBuf,
        /// The error the system call returned (errno).
        #[source]
        source: std::io::Error,
    },
    /// Writing the JSON file failed.
    #[error("writing slot dump {path}: {source}")]
    Write {
        /// Target path.
        path: PathBuf,
        /// The error the system call returned (errno).
        #[source]
        source: std::io::Error,
    },
}

/// What was seen in one slot since the dumper started.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SlotStats {
    /// APIC ID the device put in the table for this slot.
    pub apic_id: Option<u32>,
    /// Samples taken.
    pub samples: u64,
    /// Samples that failed (slot mid-update too long, detached).
    pub failed_samples: u64,
    /// Last sample: sequence, kern_cs, policy, nice, rt_prio, updates.
    pub seq: u32,
    /// Last kern_cs.
    pub kern_cs: u32,
    /// Last policy.
    pub policy: u32,
    /// Last nice.
    pub nice: i32,
    /// Last rt_prio.
    pub rt_prio: u32,
    /// Last updates counter.
    pub updates: u64,
    /// Last wakes counter (`F_SYNC_COUNTS`).
    pub wakes: u64,
    /// Last waits counter (`F_SYNC_COUNTS`).
    pub sync_waits: u64,
    /// Samples with each kern_cs bit set: `[NMI, HARDIRQ, SOFTIRQ, PREEMPT_OFF]`.
    pub cs_set: [u64; 4],
    /// Samples where the slot changed since the previous sample.
    pub changes: u64,
    /// Samples per `"policy/rt_prio/nice"` seen.
    pub seen: BTreeMap<String, u64>,
    /// Samples per `wait_on` seen: the slot index waited for, `"lock"` (a
    /// lock wait, `WAIT_ANY`) or `"none"`.
    pub waits: BTreeMap<String, u64>,
    /// Samples per `"policy/rt_prio"` reported with `TASK_F_RT_SLEEPER`
    /// (the CPU idle after an RT task that went to sleep).
    pub rt_sleepers: BTreeMap<String, u64>,
}

/// The JSON document written to the dump file.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Dump {
    /// Milliseconds since the dumper started.
    pub elapsed_ms: u64,
    /// Transport and register state.
    pub device: MonitorState,
    /// Whether a region is attached now.
    pub attached: bool,
    /// Region header fields now (magic, version, nr_vcpus, generation).
    pub header: Option<[u32; 4]>,
    /// Per-slot accumulated view, indexed by slot.
    pub slots: Vec<SlotStats>,
}

/// The dump file and the accumulated samples, driven by the serving loop.
pub struct SlotDumper {
    file: File,
    path: PathBuf,
    sample_every: Duration,
    write_every: Duration,
    start: Instant,
    last_sample: Option<Instant>,
    last_write: Instant,
    written_len: usize,
    dump: Dump,
}

impl SlotDumper {
    /// Create (truncate) `path` now; sample every `sample`, rewrite the
    /// file every `write`.
    pub fn open(path: &Path, sample: Duration, write: Duration) -> Result<SlotDumper, DumpError> {
        let file = File::create(path).map_err(|source| DumpError::Create {
            path: path.to_owned(),
            source,
        })?;
        let now = Instant::now();
        Ok(SlotDumper {
            file,
            path: path.to_owned(),
            sample_every: sample,
            write_every: write,
            start: now,
            last_sample: None,
            last_write: now,
            written_len: 0,
            dump: Dump::default(),
        })
    }

    /// The file's descriptor (to keep open across the sandbox).
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Time left until the next sample is due (zero if overdue).
    pub fn until_next_sample(&self) -> Duration {
        match self.last_sample {
            None => Duration::ZERO,
            Some(t) => self.sample_every.saturating_sub(t.elapsed()),
        }
    }

    /// Sample if a sample is due, rewrite the file if a write is due.
    /// Write errors are logged, not fatal.
    pub fn tick(&mut self, monitor: &TransportMonitor) {
        if self.until_next_sample().is_zero() {
            sample(monitor, &mut self.dump);
            self.last_sample = Some(Instant::now());
        }
        if self.last_write.elapsed() >= self.write_every {
            self.write_now();
        }
    }

    /// A last sample and write (at disconnect).
    pub fn finish(&mut self, monitor: &TransportMonitor) {
        sample(monitor, &mut self.dump);
        self.last_sample = Some(Instant::now());
        self.write_now();
    }

    /// The accumulated dump.
    pub fn dump(&self) -> &Dump {
        &self.dump
    }

    fn write_now(&mut self) {
        self.dump.elapsed_ms = self.start.elapsed().as_millis() as u64;
        match write_padded(&self.dump, &self.file, self.written_len) {
            Ok(len) => self.written_len = len,
            Err(source) => log::warn!(
                "{}",
                DumpError::Write {
                    path: self.path.clone(),
                    source
                }
            ),
        }
        self.last_write = Instant::now();
    }
}

/// Rewrite `file` from offset 0 with `dump`, padded with spaces to at least
/// `prev_len` bytes so no tail of a longer earlier dump survives. Returns
/// the length written.
pub fn write_padded(dump: &Dump, file: &File, prev_len: usize) -> std::io::Result<usize> {
    let mut body = serde_json::to_vec_pretty(dump).map_err(std::io::Error::from)?;
    body.push(b'\n');
    if body.len() < prev_len {
        body.resize(prev_len, b' ');
    }
    file.write_all_at(&body, 0)?;
    Ok(body.len())
}

/// Take one sample of every slot into `dump`.
pub fn sample(monitor: &TransportMonitor, dump: &mut Dump) {
    let state = monitor.snapshot();
    dump.attached = state.view.is_some();
    if let Some(view) = &state.view {
        let h = view.read_header();
        dump.header = Some([h.magic, h.version, h.nr_vcpus, h.generation]);
        let n = view.info().nr_vcpus;
        if dump.slots.len() < n as usize {
            dump.slots.resize(n as usize, SlotStats::default());
        }
        for (i, st) in dump.slots.iter_mut().enumerate().take(n as usize) {
            let i = i as u32;
            st.apic_id = view.apic_id(i);
            st.samples += 1;
            match view.read_guest_slot(i) {
                Ok(g) => {
                    if g.seq != st.seq || g.updates != st.updates {
                        st.changes += 1;
                    }
                    st.seq = g.seq;
                    st.kern_cs = g.kern_cs;
                    st.policy = g.policy;
                    st.nice = g.nice;
                    st.rt_prio = g.rt_prio;
                    st.updates = g.updates;
                    st.wakes = g.wakes;
                    st.sync_waits = g.waits;
                    for (bit, c) in st.cs_set.iter_mut().enumerate() {
                        if g.kern_cs & (1 << bit) != 0 {
                            *c += 1;
                        }
                    }
                    *st.seen
                        .entry(format!("{}/{}/{}", g.policy, g.rt_prio, g.nice))
                        .or_default() += 1;
                    let wait = match g.wait_on {
                        Some(w) => w.to_string(),
                        None if g.lock_wait => "lock".to_owned(),
                        None => "none".to_owned(),
                    };
                    *st.waits.entry(wait).or_default() += 1;
                    if g.task_flags & pvsched_abi::TASK_F_RT_SLEEPER != 0 {
                        *st.rt_sleepers
                            .entry(format!("{}/{}", g.policy, g.rt_prio))
                            .or_default() += 1;
                    }
                }
                Err(_) => st.failed_samples += 1,
            }
        }
    }
    dump.device = state;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorter_rewrite_leaves_valid_json() {
        let dir = std::env::temp_dir().join(format!("pvsched-dump-pad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("slots.json");
        let file = File::create(&path).expect("create");
        let long = Dump {
            slots: vec![SlotStats::default(); 4],
            ..Default::default()
        };
        let n = write_padded(&long, &file, 0).expect("write");
        let m = write_padded(&Dump::default(), &file, n).expect("rewrite");
        assert_eq!(m, n, "padded to the earlier length");
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(v["slots"].as_array().map(Vec::len), Some(0));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn detached_device_dumps_no_slots() {
        let m = TransportMonitor::new();
        let mut d = Dump::default();
        sample(&m, &mut d);
        assert!(!d.attached);
        assert!(d.slots.is_empty());
        let dir = std::env::temp_dir().join(format!("pvsched-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("slots.json");
        let mut dumper = SlotDumper::open(&path, Duration::ZERO, Duration::ZERO).expect("open");
        dumper.finish(&m);
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(v["attached"], serde_json::Value::Bool(false));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
