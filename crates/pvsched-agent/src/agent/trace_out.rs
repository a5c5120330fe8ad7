//! The decision trace, written by a thread of its own.
//!
//! The applier runs at `SCHED_FIFO` and is the only part of pvsched that
//! ends a boost: whatever it waits for, every boosted thread keeps its
//! boost meanwhile. A write to a file can wait for the kernel's writeback
//! (a page cache over its dirty limit) or for a filesystem lock, both held
//! by `SCHED_OTHER` threads, and those may not get a CPU while boosted vCPU
//! threads hold every CPU: the applier would then wait until the kernel's
//! RT throttling lets them run, up to a second later. So the applier only
//! hands each record to a bounded queue; a `SCHED_OTHER` thread writes the
//! file. When the queue is full the record is counted, not waited for, and
//! the count is reported when the trace closes.

use pvsched_policy::event::Decision;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

/// Records the queue holds (48 bytes each): at the applier's highest rate
/// seen (a few thousand records a second) many seconds of a stalled disk.
const QUEUE: usize = 1 << 16;

/// The applier's end of the trace.
pub(super) struct TraceOut {
    tx: Option<SyncSender<Decision>>,
    dropped: Arc<AtomicU64>,
}

impl TraceOut {
    /// No trace.
    pub(super) fn none() -> TraceOut {
        TraceOut {
            tx: None,
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Queues one record for the writer; never blocks.
    pub(super) fn record(&mut self, d: &Decision) {
        let Some(tx) = &self.tx else { return };
        match tx.try_send(*d) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            // The writer stopped after a write error (it said so).
            Err(TrySendError::Disconnected(_)) => self.tx = None,
        }
    }
}

/// The writer thread; join it after the applier has stopped (its end of
/// the queue closes the trace).
pub(super) struct TraceWriter {
    thread: JoinHandle<()>,
}

impl TraceWriter {
    /// Waits until every queued record is in the file.
    pub(super) fn join(self) {
        let _ = self.thread.join();
    }
}

/// Starts the writer of `file` (named `path` in messages).
pub(super) fn spawn(
    file: BufWriter<File>,
    path: String,
) -> std::io::Result<(TraceOut, TraceWriter)> {
    let (tx, rx) = sync_channel(QUEUE);
    let dropped = Arc::new(AtomicU64::new(0));
    let d2 = dropped.clone();
    let thread = std::thread::Builder::new()
        .name("pvsched-trace".into())
        .spawn(move || write_all(rx, file, &path, &d2))?;
    Ok((
        TraceOut {
            tx: Some(tx),
            dropped,
        },
        TraceWriter { thread },
    ))
}

/// Writes records as they come and flushes whenever the queue is empty, so
/// the file is at most one burst behind; ends when the applier's end
/// closes or a write fails.
fn write_all(rx: Receiver<Decision>, mut w: BufWriter<File>, path: &str, dropped: &AtomicU64) {
    let result = (|| -> std::io::Result<()> {
        while let Ok(d) = rx.recv() {
            crate::trace::write_record(&mut w, &d)?;
            while let Ok(d) = rx.try_recv() {
                crate::trace::write_record(&mut w, &d)?;
            }
            w.flush()?;
        }
        w.flush()
    })();
    if let Err(e) = result {
        log::warn!("pvsched agent: writing the decision trace {path} failed, tracing stops: {e}");
    }
    let n = dropped.load(Ordering::Relaxed);
    if n > 0 {
        log::warn!(
            "pvsched agent: the decision trace {path} lacks {n} record(s): its writer fell \
             behind the policy (a slow disk?); the applier never waits for it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_counts_records_and_never_waits() {
        let (tx, rx) = sync_channel(2);
        let mut out = TraceOut {
            tx: Some(tx),
            dropped: Arc::new(AtomicU64::new(0)),
        };
        for ts in 0..5 {
            out.record(&Decision {
                ts,
                ..Default::default()
            });
        }
        assert_eq!(out.dropped.load(Ordering::Relaxed), 3);
        assert_eq!(rx.try_iter().map(|d| d.ts).collect::<Vec<_>>(), [0, 1]);
        drop(rx);
        out.record(&Decision::default());
        assert!(out.tx.is_none(), "a stopped writer ends the trace");
    }

    #[test]
    fn every_queued_record_is_in_the_file_once_joined() {
        let path = std::env::temp_dir().join(format!("pvsched-trace-out-{}", std::process::id()));
        let file = BufWriter::new(File::create(&path).unwrap());
        let (mut out, w) = spawn(file, path.display().to_string()).unwrap();
        for ts in 1..=1000 {
            out.record(&Decision {
                ts,
                tid: 7,
                ..Default::default()
            });
        }
        drop(out);
        w.join();
        let recs = crate::trace::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(recs.len(), 1000);
        assert!(recs.iter().zip(1..).all(|(d, ts)| d.ts == ts && d.tid == 7));
    }
}
