//! Host-side view of the region for tests and operators: a sampler thread
//! reads every slot often (default every 500 µs), accumulates what it saw
//! and periodically writes a JSON file (written to a temporary name, then
//! renamed, so readers never see half a file).
//!
//! The accumulated counters let a test assert on things too brief to catch
//! in a single snapshot (a hard-IRQ bit that is set for microseconds, an RT
//! task that ran for a second).

use crate::monitor::{Monitor, MonitorState};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Errors of the slot dumper.
#[derive(Debug, Error)]
pub enum DumpError {
    /// Writing the JSON file failed.
    #[error("writing slot dump {path}: {source}")]
    Write {
        /// Target path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The sampler thread could not start.
    #[error("starting the slot sampler thread: {0}")]
    Spawn(#[source] std::io::Error),
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
    /// Samples with each kern_cs bit set: `[NMI, HARDIRQ, SOFTIRQ, PREEMPT_OFF]`.
    pub cs_set: [u64; 4],
    /// Samples where the slot changed since the previous sample.
    pub changes: u64,
    /// Samples per `"policy/rt_prio/nice"` seen.
    pub seen: BTreeMap<String, u64>,
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

/// Handle to the sampler thread; stops it (after a final dump) on drop.
pub struct SlotDumper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SlotDumper {
    /// Start sampling `monitor` every `sample`, writing `path` every `write`.
    pub fn start(
        monitor: Arc<Monitor>,
        path: PathBuf,
        sample: Duration,
        write: Duration,
    ) -> Result<SlotDumper, DumpError> {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("pvsched-dump".into())
            .spawn(move || run(&monitor, &path, sample, write, &stop2))
            .map_err(DumpError::Spawn)?;
        Ok(SlotDumper {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for SlotDumper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Take one sample of every slot into `dump`.
pub fn sample(monitor: &Monitor, dump: &mut Dump) {
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
                    for (bit, c) in st.cs_set.iter_mut().enumerate() {
                        if g.kern_cs & (1 << bit) != 0 {
                            *c += 1;
                        }
                    }
                    *st.seen
                        .entry(format!("{}/{}/{}", g.policy, g.rt_prio, g.nice))
                        .or_default() += 1;
                }
                Err(_) => st.failed_samples += 1,
            }
        }
    }
    dump.device = state;
}

/// Write `dump` to `path` atomically.
pub fn write(dump: &Dump, path: &std::path::Path) -> Result<(), DumpError> {
    let tmp = path.with_extension("tmp");
    let err = |source| DumpError::Write {
        path: path.to_owned(),
        source,
    };
    let body = serde_json::to_vec_pretty(dump).map_err(|e| err(e.into()))?;
    std::fs::write(&tmp, body).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

fn run(
    monitor: &Monitor,
    path: &std::path::Path,
    every: Duration,
    write_every: Duration,
    stop: &AtomicBool,
) {
    let start = Instant::now();
    let mut dump = Dump::default();
    let mut last_write = Instant::now();
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        sample(monitor, &mut dump);
        if stopping || last_write.elapsed() >= write_every {
            dump.elapsed_ms = start.elapsed().as_millis() as u64;
            if let Err(e) = write(&dump, path) {
                log::warn!("{e}");
            }
            last_write = Instant::now();
        }
        if stopping {
            break;
        }
        std::thread::sleep(every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detached_device_dumps_no_slots() {
        let m = Monitor::new();
        let mut d = Dump::default();
        sample(&m, &mut d);
        assert!(!d.attached);
        assert!(d.slots.is_empty());
        let dir = std::env::temp_dir().join(format!("pvsched-dump-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("slots.json");
        write(&d, &path).expect("write");
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
        assert_eq!(v["attached"], serde_json::Value::Bool(false));
        assert!(!path.with_extension("tmp").exists());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
