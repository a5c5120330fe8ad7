//! What every pvsched integration test shares, written once:
//!
//! - [`skip_or_fail`]: the rule for a test that needs something this
//!   machine may not have (root, KVM, BPF, QEMU): with
//!   `PVSCHED_REQUIRE_REAL=1` (CI sets it) the test fails, otherwise it
//!   prints `SKIP: <test>: <why>` and returns;
//! - [`root`]: that rule applied to "runs as root";
//! - [`wait_for`]: bounded polling (a liveness bound, never a timing
//!   assertion);
//! - [`test_child`]: this test binary re-run for one test, as a child
//!   process;
//! - [`layout`]: the C ↔ Rust layout check of a header and its mirror.

use std::time::{Duration, Instant};

pub mod layout;

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

/// A command that runs this test binary again for the one test `name` of
/// the module `module` (the caller's `module_path!()`), with its output
/// not captured: how a test gets a child process that does one thing
/// (drops privileges, is SIGKILLed, plays a hostile VMM) while the parent
/// asserts on what the child leaves behind. The child test tells that it
/// is the child by an environment variable the caller sets.
pub fn test_child(module: &str, name: &str) -> std::process::Command {
    let exe = std::env::current_exe().expect("the test binary's path (/proc/self/exe)");
    let mut cmd = std::process::Command::new(exe);
    cmd.args(test_child_args(module, name));
    cmd
}

/// The arguments that make this test binary run only the test `name` of
/// `module` ([`test_child`]'s, for a caller that starts the binary some
/// other way, e.g. under `systemd-run`).
pub fn test_child_args(module: &str, name: &str) -> [String; 4] {
    // libtest names a test by its path without the crate: the first
    // component of `module_path!()` is the test binary's crate.
    let path = match module.split_once("::") {
        Some((_, m)) => format!("{m}::{name}"),
        None => name.to_string(),
    };
    [
        "--exact".into(),
        path,
        "--nocapture".into(),
        "--test-threads=1".into(),
    ]
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

/// Reads `out` (a child's stdout) line by line until a line contains
/// `marker`; panics if the child closes its output first.
pub fn wait_for_line(out: &mut impl std::io::BufRead, marker: &str) {
    let mut line = String::new();
    while !line.contains(marker) {
        line.clear();
        let n = out
            .read_line(&mut line)
            .expect("reading the child's output");
        assert!(n > 0, "the child exited before printing {marker}");
    }
}

/// A close-on-exec memfd of `size` bytes named `name`, sealed against any
/// change of size: guest RAM as QEMU's `memory-backend-memfd` (and the
/// reference VMM) share it, the only kind a device process maps.
pub fn sealed_memfd(name: &std::ffi::CStr, size: u64) -> std::fs::File {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: memfd_create with a NUL-terminated name; the flags are valid.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(size).expect("size the memfd");
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl(F_ADD_SEALS) on the fd `f` owns; no pointers.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(rc, 0, "F_ADD_SEALS: {}", std::io::Error::last_os_error());
    f
}

/// A close-on-exec memfd of `size` bytes (a multiple of the huge page size)
/// on the kernel's hugetlbfs, sealed against any change of size: guest RAM
/// as QEMU's `memory-backend-memfd,hugetlb=on` shares it. The seals pass the
/// devices' shrink check, yet touching a page of it when no huge page is
/// free faults with SIGBUS, so a device must never map it. `None` when this
/// kernel has no hugetlbfs (`memfd_create` refuses `MFD_HUGETLB`) or `size`
/// is no multiple of its default huge page size.
pub fn sealed_hugetlb_memfd(name: &std::ffi::CStr, size: u64) -> Option<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB;
    // SAFETY: memfd_create with a NUL-terminated name; the flags are valid.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        eprintln!("memfd_create(MFD_HUGETLB): {e}");
        return None;
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    // Sizing reserves no huge page: only a fault allocates one.
    if let Err(e) = f.set_len(size) {
        eprintln!("sizing a hugetlb memfd to {size:#x} bytes: {e}");
        return None;
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl(F_ADD_SEALS) on the fd `f` owns; no pointers.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(rc, 0, "F_ADD_SEALS: {}", std::io::Error::last_os_error());
    Some(f)
}
