//! The decision trace: every record of the policy's ring buffer, one JSON
//! object per line (`AgentConfig::trace`, `pvsched run --trace FILE`), and
//! the check that a waiting pair was never split in it.
//!
//! The BPF policy sends a record whenever a thread's boost changes, and a
//! trace-only record when a throttle is extended or a boosted vCPU starts or
//! stops waiting on a target; so replaying the records in time order gives,
//! at every moment, each thread's boost, throttle end and waiting target.
//!
//! ```text
//! {"ts":81234567890,"tid":4242,"gid":1,"kind":1,"prio":2,"reason":5,"event":3,"throttled_until":0,"waits_on":0}
//! ```

use crate::intf::{Decision, gid, gid_vm};
use pvsched_abi::BOOST_NONE;
use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::path::Path;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum TraceError {
    /// The trace file could not be read.
    #[error("reading the decision trace {path}: {source}")]
    Io {
        path: String,
        /// The error the system call returned (errno).
        #[source]
        source: io::Error,
    },
    /// A line is not a trace record.
    #[error("decision trace {path} line {line}: not a trace record ({why})")]
    Parse {
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        why: String,
    },
}

/// Writes one record as a JSON line.
pub fn write_record(w: &mut impl Write, d: &Decision) -> io::Result<()> {
    writeln!(
        w,
        "{}",
        serde_json::json!({
            "ts": d.ts,
            "tid": d.tid,
            "gid": d.gid,
            "kind": d.kind,
            "prio": d.prio,
            "reason": d.reason,
            "event": d.event,
            "throttled_until": d.throttled_until,
            "waits_on": d.waits_on,
        })
    )
}

fn field(v: &serde_json::Value, name: &str) -> Result<u64, String> {
    v.get(name)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("no unsigned field {name:?}"))
}

fn small(v: &serde_json::Value, name: &str) -> Result<u32, String> {
    u32::try_from(field(v, name)?).map_err(|_| format!("{name:?} out of range"))
}

fn parse(line: &str) -> Result<Decision, String> {
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let prio = v
        .get("prio")
        .and_then(serde_json::Value::as_i64)
        .and_then(|p| i32::try_from(p).ok())
        .ok_or("no integer field \"prio\"")?;
    Ok(Decision {
        ts: field(&v, "ts")?,
        tid: small(&v, "tid")?,
        gid: small(&v, "gid")?,
        kind: small(&v, "kind")?,
        prio,
        reason: small(&v, "reason")?,
        event: small(&v, "event")?,
        throttled_until: field(&v, "throttled_until")?,
        waits_on: small(&v, "waits_on")?,
        pad0: 0,
    })
}

/// Reads a trace written by the agent.
pub fn read(path: &Path) -> Result<Vec<Decision>, TraceError> {
    let name = path.display().to_string();
    let f = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in io::BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: name.clone(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse(&line).map_err(|why| TraceError::Parse {
            path: name.clone(),
            line: i + 1,
            why,
        })?);
    }
    Ok(out)
}

/// A waiting pair split in a trace: the sender was boosted while the target
/// it waited on was throttled, from `from_ns` until `to_ns` (None: still at
/// the end of the trace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// The boosted, waiting sender.
    pub sender_gid: u32,
    /// The throttled target.
    pub target_gid: u32,
    /// First moment seen split.
    pub from_ns: u64,
    /// First later moment seen whole again.
    pub to_ns: Option<u64>,
}

impl Split {
    /// How long the pair was split; `None` if it still was at the end.
    ///
    /// A record carries the time its BPF program started, and two programs
    /// can run at once on two CPUs (the sender's event on one, the
    /// target's on the other): their records then interleave in time by up
    /// to one program's run, and a pair can look split for that long while
    /// the policy's state never left it split once both programs finished
    /// (each re-reads the other's throttle after a fence). A split that
    /// lasts longer is the policy's.
    pub fn duration_ns(&self) -> Option<u64> {
        self.to_ns.map(|t| t.saturating_sub(self.from_ns))
    }
}

#[derive(Clone, Copy, Default)]
struct Seen {
    kind: u32,
    waits_on: u32,
    throttled_until: u64,
}

/// Replays `records` in time order (the records of one BPF run share a
/// time stamp and are applied together) and returns every split of a
/// waiting pair: a sender boosted while its target was throttled.
pub fn split_pairs(records: &[Decision]) -> Vec<Split> {
    let mut recs: Vec<&Decision> = records.iter().collect();
    recs.sort_by_key(|d| d.ts);
    let mut state: HashMap<u32, Seen> = HashMap::new();
    let mut open: HashMap<(u32, u32), u64> = HashMap::new();
    let mut out = Vec::new();
    let mut i = 0;
    while i < recs.len() {
        let ts = recs[i].ts;
        while i < recs.len() && recs[i].ts == ts {
            let d = recs[i];
            state.insert(
                d.gid,
                Seen {
                    kind: d.kind,
                    waits_on: d.waits_on,
                    throttled_until: d.throttled_until,
                },
            );
            i += 1;
        }
        let mut now_split: Vec<(u32, u32)> = state
            .iter()
            .filter(|(_, s)| s.kind != BOOST_NONE && s.waits_on != 0)
            .filter_map(|(&sender, s)| {
                let target = gid(gid_vm(sender), s.waits_on - 1);
                let t = state.get(&target)?;
                (ts < t.throttled_until).then_some((sender, target))
            })
            .collect();
        now_split.sort_unstable();
        for pair in &now_split {
            open.entry(*pair).or_insert(ts);
        }
        let ended: Vec<(u32, u32)> = open
            .keys()
            .filter(|p| !now_split.contains(p))
            .copied()
            .collect();
        for pair in ended {
            if let Some(from) = open.remove(&pair) {
                out.push(Split {
                    sender_gid: pair.0,
                    target_gid: pair.1,
                    from_ns: from,
                    to_ns: Some(ts),
                });
            }
        }
    }
    let mut rest: Vec<_> = open.into_iter().collect();
    rest.sort_unstable();
    out.extend(rest.into_iter().map(|((s, t), from)| Split {
        sender_gid: s,
        target_gid: t,
        from_ns: from,
        to_ns: None,
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvsched_abi::BOOST_RT;

    fn rec(ts: u64, gid: u32, kind: u32, throttled_until: u64, waits_on: u32) -> Decision {
        Decision {
            ts,
            tid: 100 + gid,
            gid,
            kind,
            prio: if kind == BOOST_NONE { 0 } else { 1 },
            reason: 0,
            event: 0,
            throttled_until,
            waits_on,
            pad0: 0,
        }
    }

    #[test]
    fn a_unit_throttle_is_not_a_split() {
        // 0 waits on 1 (boosted); both throttled at 100 in one BPF run,
        // recorded in either order, interleaved with another CPU's record.
        let t = vec![
            rec(10, 0, BOOST_RT, 0, 2),
            rec(10, 1, BOOST_RT, 0, 0),
            rec(100, 1, BOOST_NONE, 150, 0),
            rec(99, 5, BOOST_RT, 0, 0),
            rec(100, 0, BOOST_NONE, 150, 0),
            rec(160, 0, BOOST_RT, 150, 2),
        ];
        assert!(split_pairs(&t).is_empty());
    }

    #[test]
    fn a_sender_boosted_while_its_target_is_throttled_is_a_split() {
        let t = vec![
            rec(10, 1, BOOST_NONE, 200, 0),
            rec(20, 0, BOOST_RT, 0, 2),
            rec(30, 0, BOOST_RT, 0, 0),
            rec(40, gid(1, 3), BOOST_RT, 0, 2),
        ];
        let s = split_pairs(&t);
        assert_eq!(
            s,
            vec![Split {
                sender_gid: 0,
                target_gid: 1,
                from_ns: 20,
                to_ns: Some(30)
            }]
        );
    }

    #[test]
    fn records_round_trip_and_garbage_is_reported() {
        let d = Decision {
            ts: 5,
            tid: 7,
            gid: 1025,
            kind: 1,
            prio: -3,
            reason: 4,
            event: 2,
            throttled_until: 9,
            waits_on: 1,
            pad0: 0,
        };
        let mut buf = Vec::new();
        write_record(&mut buf, &d).unwrap();
        let line = String::from_utf8(buf).unwrap();
        assert_eq!(parse(line.trim()).unwrap(), d);
        assert!(parse("{\"ts\":1}").unwrap_err().contains("prio"));
        assert!(parse("not json").is_err());
    }
}
