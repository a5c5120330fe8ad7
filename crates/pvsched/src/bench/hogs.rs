//! CPU hogs for loaded-host runs: busy threads at SCHED_OTHER, nice 0,
//! started by the bench and always stopped (dropping [`Hogs`] stops and
//! joins them; they die with the process in any case).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// Running hog threads.
pub struct Hogs {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// SCHED_OTHER at nice 0 for the calling thread, whatever the bench was
/// started with (e.g. under `nice`): the hogs must compete fairly with the
/// vCPU threads, which the worker also puts at nice 0.
pub fn normal_nice0() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler(0, ...) on the calling thread with a valid
    // sched_param; it reads `param` only during the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_OTHER, &param) } != 0 {
        log::warn!("bench: SCHED_OTHER: {}", std::io::Error::last_os_error());
    }
    // SAFETY: plain syscall, no pointers.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on our own thread id; no pointers.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 0) } != 0 {
        log::warn!("bench: nice 0: {}", std::io::Error::last_os_error());
    }
}

impl Hogs {
    /// Starts `n` busy threads (0: none).
    pub fn start(n: usize) -> std::io::Result<Hogs> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut hogs = Hogs {
            stop: stop.clone(),
            threads: Vec::new(),
        };
        for i in 0..n {
            let stop = stop.clone();
            let t = std::thread::Builder::new()
                .name(format!("bench-hog {i}"))
                .spawn(move || {
                    normal_nice0();
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_add(1));
                    }
                })?;
            hogs.threads.push(t);
        }
        Ok(hogs)
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hogs_start_and_stop() {
        let h = Hogs::start(2).unwrap();
        assert_eq!(h.threads.len(), 2);
        drop(h);
        assert!(Hogs::start(0).unwrap().threads.is_empty());
    }
}
