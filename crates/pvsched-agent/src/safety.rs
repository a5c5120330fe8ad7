//! Restoring every boosted thread when the process ends abnormally:
//! SIGINT/SIGTERM (a signal-hook thread restores, then lets the default
//! action end the process) and panics (a chained panic hook). Normal exit
//! restores through `Drop` of the agent and its VM handles.

use std::sync::{Mutex, Once, Weak};

/// Something that can put threads back to their baselines.
pub trait Restore: Send + Sync {
    /// Restores every thread it boosted; must not block on a lock a
    /// panicking thread may hold (the agent uses the guardian's lock-free
    /// ledger).
    fn restore_all(&self);
}

static LIVE: Mutex<Vec<Weak<dyn Restore>>> = Mutex::new(Vec::new());
static SIGNALS: Once = Once::new();
static PANIC: Once = Once::new();

/// Registers `r` for restore on signal and panic.
pub fn register(r: Weak<dyn Restore>) {
    let mut l = pvsched_util::lock(&LIVE);
    l.retain(|w| w.strong_count() > 0);
    l.push(r);
}

/// Restores everything registered and alive.
pub fn restore_everything() {
    // LIVE is only held to push or upgrade a Weak (nothing there panics),
    // so waiting for it cannot deadlock.
    let list: Vec<_> = pvsched_util::lock(&LIVE)
        .iter()
        .filter_map(|w| w.upgrade())
        .collect();
    for r in list {
        r.restore_all();
    }
}

/// Installs the panic hook (once per process).
pub fn install_panic_hook() {
    PANIC.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore_everything();
            prev(info);
        }));
    });
}

/// Installs the SIGINT/SIGTERM thread (once per process).
pub fn install_signal_thread() -> std::io::Result<()> {
    let mut res = Ok(());
    SIGNALS.call_once(|| {
        use signal_hook::consts::{SIGINT, SIGTERM};
        match signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) {
            Ok(mut sigs) => {
                let spawned = std::thread::Builder::new()
                    .name("pvsched-signals".into())
                    .spawn(move || {
                        if let Some(sig) = sigs.forever().next() {
                            log::warn!("pvsched agent: signal {sig}: restoring vCPU baselines");
                            restore_everything();
                            let _ = signal_hook::low_level::emulate_default_handler(sig);
                        }
                    });
                if let Err(e) = spawned {
                    res = Err(e);
                }
            }
            Err(e) => res = Err(e),
        }
    });
    res
}
