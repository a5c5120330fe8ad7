//! The threads that put boosted threads back run above anything a boost
//! can reach: the guardian process and the agent's decision consumer are
//! at SCHED_FIFO 99 (`RESTORER_RT_PRIO`), while caps grant at most 98, so
//! a boosted thread can never keep its restorer off a CPU.

use crate::common;

use common::need_bpf;
use pvsched_abi::POLICY_FIFO;
use pvsched_agent::guardian::RESTORER_RT_PRIO;
use pvsched_agent::sched;
use pvsched_agent::{Agent, AgentConfig};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(10);

/// Threads of this process named `name`.
fn threads_named(name: &str) -> Vec<u32> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

/// Child processes of this process named `name`.
fn children_named(name: &str) -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir(format!("/proc/{me}/task"))
        .unwrap()
        .flatten()
        .flat_map(|t| {
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == name)
        })
        .collect()
}

#[test]
fn the_guardian_and_the_consumer_run_at_fifo_99() {
    const TEST: &str = "the_guardian_and_the_consumer_run_at_fifo_99";
    if !need_bpf(TEST) || !pvsched_testkit::root(TEST, "SCHED_FIFO 99") {
        return;
    }
    assert_eq!(RESTORER_RT_PRIO, 99);
    let agent = Agent::load(AgentConfig::default()).unwrap();
    let consumer = common::wait_for("the consumer at its priority", LIMIT, || {
        threads_named("pvsched-apply")
            .into_iter()
            .map(|t| sched::get(t).unwrap())
            .find(|a| a.policy == POLICY_FIFO)
    });
    let guardian = common::wait_for("the guardian at its priority", LIMIT, || {
        children_named("pvsched-guard")
            .into_iter()
            .map(|p| sched::get(p).unwrap())
            .find(|a| a.policy == POLICY_FIFO)
    });
    println!("consumer {consumer:?}, guardian {guardian:?}");
    assert_eq!(consumer.priority, 99, "the decision consumer");
    assert_eq!(guardian.priority, 99, "the guardian");
    drop(agent);
}
