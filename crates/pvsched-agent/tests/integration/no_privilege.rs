//! Without privileges the agent refuses to start and says why (it never
//! runs silently doing nothing). The unprivileged agent is this test binary
//! re-executed with `PVSCHED_NOPRIV_CHILD=1`; it drops to uid 65534 first.

use crate::common;

use pvsched_agent::{Agent, AgentConfig};

#[test]
fn unprivileged_child() {
    if std::env::var("PVSCHED_NOPRIV_CHILD").is_err() {
        return;
    }
    // SAFETY: setgid/setuid take integers; as root they drop every
    // capability of this (single-purpose child) process.
    let (g, u) = unsafe { (libc::setgid(65534), libc::setuid(65534)) };
    assert_eq!((g, u), (0, 0), "could not drop privileges");
    match Agent::load(AgentConfig {
        handle_signals: false,
        ..AgentConfig::default()
    }) {
        Ok(_) => println!("NOPRIV-LOADED"),
        Err(e) => println!("NOPRIV-ERROR: {}", common::report(&e)),
    }
}

#[test]
fn agent_without_privileges_refuses_and_says_why() {
    if !pvsched_testkit::root(
        "agent_without_privileges_refuses_and_says_why",
        "dropping privileges in a child",
    ) {
        return;
    }
    let out = pvsched_testkit::test_child(module_path!(), "unprivileged_child")
        .env("PVSCHED_NOPRIV_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}");
    let line = stdout
        .lines()
        .find_map(|l| l.find("NOPRIV-").map(|i| &l[i..]))
        .expect("child result line");
    println!("{line}");
    assert!(
        line.starts_with("NOPRIV-ERROR: pvsched agent refuses to start"),
        "{line}"
    );
}
