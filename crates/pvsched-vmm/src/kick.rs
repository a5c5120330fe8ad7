//! Kicking vCPU threads out of `KVM_RUN`.
//!
//! Each vCPU thread registers the address of its `kvm_run` structure in a
//! thread-local. The kick signal's handler sets `immediate_exit` there, so
//! a kick that lands just before the thread enters `KVM_RUN` is not lost:
//! the next `KVM_RUN` returns `EINTR` at once. The handler is installed
//! without `SA_RESTART`, so a thread blocked in `KVM_RUN` (for example in an
//! in-kernel HLT) returns `EINTR` too.

use kvm_bindings::kvm_run;
use std::cell::Cell;
use std::sync::Once;

thread_local! {
    static KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

/// Errors installing the kick signal.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `sigaction` failed.
    #[error("installing the vCPU kick signal handler failed: {0}")]
    Sigaction(#[source] std::io::Error),
    /// `pthread_kill` failed.
    #[error("signalling a vCPU thread failed: {0}")]
    Kill(#[source] std::io::Error),
}

/// The signal used to kick vCPU threads.
pub fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN()
}

extern "C" fn handle_kick(_sig: libc::c_int) {
    // Only a thread-local read and a volatile byte store: async-signal-safe.
    let p = KVM_RUN.with(Cell::get);
    if !p.is_null() {
        // SAFETY: a non-null pointer is only registered by `register` for the
        // lifetime of the thread's VcpuFd, whose kvm_run mapping stays valid
        // until `unregister` clears the pointer before the VcpuFd is dropped.
        unsafe { std::ptr::write_volatile(&raw mut (*p).immediate_exit, 1) };
    }
}

/// Install the kick handler (once per process).
pub fn install() -> Result<(), Error> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid starting value.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = handle_kick as *const () as usize;
        act.sa_flags = 0; // no SA_RESTART: KVM_RUN must return EINTR
        // SAFETY: `act.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut act.sa_mask) };
        // SAFETY: valid signal number and sigaction; the handler is async-signal-safe.
        let rc = unsafe { libc::sigaction(kick_signal(), &act, std::ptr::null_mut()) };
        if rc != 0 {
            result = Err(Error::Sigaction(std::io::Error::last_os_error()));
        }
    });
    result
}

/// Register the calling thread's `kvm_run` for the kick handler.
///
/// # Safety
///
/// `run` must stay mapped until [`unregister`] is called on this thread.
pub unsafe fn register(run: *mut kvm_run) {
    KVM_RUN.with(|c| c.set(run));
}

/// Forget the calling thread's `kvm_run`.
pub fn unregister() {
    KVM_RUN.with(|c| c.set(std::ptr::null_mut()));
}

/// Send the kick signal to `thread`.
pub fn kick(thread: libc::pthread_t) -> Result<(), Error> {
    // SAFETY: `thread` is a live thread of this process (the caller joins
    // vCPU threads only after kicking them).
    let rc = unsafe { libc::pthread_kill(thread, kick_signal()) };
    if rc != 0 {
        return Err(Error::Kill(std::io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}
