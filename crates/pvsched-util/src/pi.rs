//! A priority-inheriting mutex.
//!
//! pvsched's applier runs at `SCHED_FIFO` and shares a few locks with
//! `SCHED_OTHER` threads (status requests, registration). With a plain
//! futex a FIFO waiter sleeps for as long as the holder is not scheduled:
//! on a host whose CPUs are busy (the case pvsched is for) that was
//! measured at up to 13 ms. A PI futex (`FUTEX_LOCK_PI`) lends the
//! waiter's priority to the holder until it unlocks, so the wait lasts as
//! long as the holder's critical section, not as long as the host's CPU
//! queue.
//!
//! The lock word is the kernel's PI futex protocol (futex(2)): 0 when
//! free, else the owner's TID, with `FUTEX_WAITERS` set by the kernel
//! while anyone sleeps on it. Locking and unlocking without contention
//! are one compare-and-swap; only contention enters the kernel.
//!
//! Like [`crate::lock`], a panic while holding the lock does not poison
//! it: the guard unlocks as it is dropped.

use std::cell::{Cell, UnsafeCell};
use std::io;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

/// A mutex whose waiters lend their scheduling priority to its holder.
pub struct PiMutex<T: ?Sized> {
    word: AtomicU32,
    data: UnsafeCell<T>,
}

// SAFETY: the lock word gives one thread at a time access to `data`, as
// std's Mutex does; `T: Send` is all that sharing it then requires.
unsafe impl<T: ?Sized + Send> Send for PiMutex<T> {}
// SAFETY: as above.
unsafe impl<T: ?Sized + Send> Sync for PiMutex<T> {}

thread_local! {
    static TID: Cell<u32> = const { Cell::new(0) };
}

/// This thread's TID, asked of the kernel once per thread.
fn tid() -> u32 {
    TID.with(|t| {
        if t.get() == 0 {
            // SAFETY: gettid has no arguments and cannot fail.
            t.set(unsafe { libc::gettid() } as u32);
        }
        t.get()
    })
}

impl<T> PiMutex<T> {
    /// A new, unlocked mutex.
    pub const fn new(value: T) -> PiMutex<T> {
        PiMutex {
            word: AtomicU32::new(0),
            data: UnsafeCell::new(value),
        }
    }

    /// The value, consuming the mutex.
    pub fn into_inner(self) -> T {
        self.data.into_inner()
    }
}

impl<T: ?Sized> PiMutex<T> {
    /// Locks, sleeping (and lending this thread's priority to the holder)
    /// while another thread holds it.
    ///
    /// # Panics
    /// If the kernel refuses the lock for a reason that means the lock
    /// word is corrupt or this thread already holds it (`EDEADLK`,
    /// `EPERM`, `ESRCH`): those are bugs in the caller, not conditions
    /// to wait out.
    pub fn lock(&self) -> PiMutexGuard<'_, T> {
        let me = tid();
        if self
            .word
            .compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            loop {
                match self.futex(libc::FUTEX_LOCK_PI) {
                    Ok(()) => break,
                    // The owner is exiting (EAGAIN) or a signal came:
                    // try again, as pthread_mutex_lock does.
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) => {}
                    Err(e) => panic!("PiMutex: FUTEX_LOCK_PI failed: {e}"),
                }
            }
        }
        PiMutexGuard {
            m: self,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Locks if no thread holds it now.
    pub fn try_lock(&self) -> Option<PiMutexGuard<'_, T>> {
        self.word
            .compare_exchange(0, tid(), Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| PiMutexGuard {
                m: self,
                _not_send: std::marker::PhantomData,
            })
    }

    /// The value, through exclusive access (no locking needed).
    pub fn get_mut(&mut self) -> &mut T {
        self.data.get_mut()
    }

    fn futex(&self, op: i32) -> io::Result<()> {
        // SAFETY: the word is a live, aligned u32 for as long as `self`;
        // the PI operations use no timeout (null: wait for ever), second
        // address or value.
        let r = unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word.as_ptr(),
                op | libc::FUTEX_PRIVATE_FLAG,
                0,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn unlock(&self) {
        // Without waiters the word is our TID alone; with them the kernel
        // has set FUTEX_WAITERS and must hand the lock over itself.
        if self
            .word
            .compare_exchange(tid(), 0, Ordering::Release, Ordering::Relaxed)
            .is_err()
            && let Err(e) = self.futex(libc::FUTEX_UNLOCK_PI)
        {
            // Only possible if the word no longer names this thread,
            // which the guard rules out; say so rather than hang waiters
            // silently.
            log_unlock_failure(e);
        }
    }
}

#[cold]
fn log_unlock_failure(e: io::Error) {
    eprintln!("PiMutex: FUTEX_UNLOCK_PI failed: {e}");
}

impl<T: Default> Default for PiMutex<T> {
    fn default() -> PiMutex<T> {
        PiMutex::new(T::default())
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for PiMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.try_lock() {
            Some(g) => f.debug_struct("PiMutex").field("data", &&*g).finish(),
            None => f
                .debug_struct("PiMutex")
                .field("data", &"<locked>")
                .finish(),
        }
    }
}

/// Access to a [`PiMutex`]'s value; unlocks when dropped.
pub struct PiMutexGuard<'a, T: ?Sized> {
    m: &'a PiMutex<T>,
    /// The guard must be dropped by the thread that locked (the kernel's
    /// PI protocol names the owner by TID): a raw pointer makes it !Send.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl<T: ?Sized> Deref for PiMutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock: no other reference exists.
        unsafe { &*self.m.data.get() }
    }
}

impl<T: ?Sized> DerefMut for PiMutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock and is borrowed mutably.
        unsafe { &mut *self.m.data.get() }
    }
}

impl<T: ?Sized> Drop for PiMutexGuard<'_, T> {
    fn drop(&mut self) {
        self.m.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_and_counts() {
        let m = Arc::new(PiMutex::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        *m.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*m.lock(), 80_000);
        assert_eq!(m.word.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn try_lock_fails_while_held_and_a_panic_unlocks() {
        let m = Arc::new(PiMutex::new(1));
        {
            let _g = m.lock();
            let m2 = m.clone();
            assert!(
                std::thread::spawn(move || m2.try_lock().is_none())
                    .join()
                    .unwrap()
            );
        }
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let _g = m2.lock();
            panic!("holder panics");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*m.try_lock().expect("unlocked by the panic"), 1);
    }
}
