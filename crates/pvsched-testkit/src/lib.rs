//! What every pvsched integration test shares, written once:
//!
//! - [`skip_or_fail`]: the rule for a test that needs something this
//!   machine may not have (root, KVM, BPF, QEMU): with
//!   `PVSCHED_REQUIRE_REAL=1` (CI sets it) the test fails, otherwise it
//!   prints `SKIP: <test>: <why>` and returns;
//! - [`root`]: that rule applied to "runs as root";
//! - [`wait_for`]: bounded polling (a liveness bound, never a timing
//!   assertion).

use std::time::{Duration, Instant};

/// The variable that turns a missing capability from a skip into a
/// failure.
pub const REQUIRE_REAL: &str = "PVSCHED_REQUIRE_REAL";

/// Whether missing capabilities must fail the tests (`PVSCHED_REQUIRE_REAL=1`).
pub fn real_required() -> bool {
    std::env::var(REQUIRE_REAL).as_deref() == Ok("1")
}

/// Test `test` cannot run here because of `why`: panics under
/// `PVSCHED_REQUIRE_REAL=1`, else prints `SKIP: test: why` and returns
/// false (so `if !cond && !skip_or_fail(..) { return; }` reads naturally:
/// callers `return` on false).
pub fn skip_or_fail(test: &str, why: &str) -> bool {
    if real_required() {
        panic!("{test}: {REQUIRE_REAL}=1 but {why}");
    }
    eprintln!("SKIP: {test}: {why}");
    false
}

/// Whether the test runs as root; if not, [`skip_or_fail`] with `why`
/// (what needs root).
pub fn root(test: &str, why: &str) -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    skip_or_fail(test, &format!("not root ({why} needs root)"))
}

/// Polls `f` every 200 µs (short enough to catch a boost or a throttle
/// window between two polls) until it returns `Some` or `limit` passes
/// (then panics naming `what`). A liveness bound, not a timing assertion.
pub fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if t0.elapsed() > limit {
            panic!("gave up after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
