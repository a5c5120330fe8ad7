//! Per-VM admin caps and policy knobs, with serde so an operator writes them
//! in TOML (`--policy-file caps.toml`). What each cap does and how to pick
//! values: `docs/operating.md`.
//!
//! Every time limit is charged in **on-CPU** time: only while a boosted vCPU
//! thread is on a CPU does its boost cost the host anything, so only then is
//! it counted. A boost held by a halted vCPU is free.
//!
//! ```toml
//! allow_rt = true
//! max_rt_prio = 4
//! nice_floor = -10
//! max_boost_us = 5000
//! ```
//! Missing keys take the defaults of [`Caps::default`].

use serde::{Deserialize, Serialize};

/// Errors reading caps.
#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    /// The TOML text did not parse or had wrong types.
    #[error("caps: invalid TOML (fix the file; see docs of pvsched_policy::Caps): {0}")]
    Toml(#[from] toml::de::Error),
    /// A value is out of range.
    #[error("caps: {0} (fix the value in the caps file)")]
    Range(&'static str),
}

/// Kind of boost a halted vCPU or a directed-yield target gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoostKind {
    /// No boost.
    None,
    /// A nice value (`*_prio` is the nice).
    #[default]
    Nice,
    /// SCHED_FIFO (`*_prio` is the RT priority).
    Rt,
}

impl BoostKind {
    /// The ABI's `BOOST_*` value.
    pub fn abi(self) -> u32 {
        match self {
            BoostKind::None => pvsched_abi::BOOST_NONE,
            BoostKind::Nice => pvsched_abi::BOOST_NICE,
            BoostKind::Rt => pvsched_abi::BOOST_RT,
        }
    }
}

/// Per-VM caps. Times are in microseconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Caps {
    /// Whether RT (SCHED_FIFO) boosts are allowed; if not, RT requests become
    /// nice boosts at `nice_floor`.
    pub allow_rt: bool,
    /// Highest SCHED_FIFO priority granted (1..=99).
    pub max_rt_prio: u32,
    /// Lowest nice value granted (-20..=19).
    pub nice_floor: i32,
    /// RT priority for a guest kernel critical section (NMI/IRQ/softirq/preempt-off).
    pub cs_rt_prio: u32,
    /// Boost a latency-sensitive vCPU holds while it halts (so the interrupt
    /// that wakes it preempts host batch work at once) and keeps when it
    /// wakes, until its guest stops asking (see `halt_hold_us`).
    pub halt_boost: BoostKind,
    /// Its nice or RT priority.
    pub halt_prio: i32,
    /// A vCPU counts as latency-sensitive for this long after the policy last
    /// saw its guest run an RT task or a kernel critical section, µs.
    pub halt_hold_us: u64,
    /// Every vCPU of this VM is latency-sensitive (the guest need not ask).
    pub halt_always: bool,
    /// Boost of a directed-yield target while its sender waits; a waiting
    /// sender's own boost is kept one step below it, so the target outranks it.
    pub yield_boost: BoostKind,
    /// Its nice or RT priority.
    pub yield_prio: i32,
    /// Longest a boosted vCPU thread may run on a CPU without blocking or
    /// halting, µs of on-CPU time (0 = unlimited).
    pub max_boost_us: u64,
    /// No boost for this long after hitting `max_boost_us`, µs.
    pub throttle_us: u64,
    /// Boosted on-CPU time allowed per window, µs (0 = unlimited).
    pub budget_us: u64,
    /// Budget window, µs of wall-clock time.
    pub window_us: u64,
    /// How long an IPI sender→receiver pair stays confirmed, µs.
    pub ipi_window_us: u64,
    /// Honour the guest's `wait_on` hint.
    pub wait_on: bool,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            allow_rt: true,
            max_rt_prio: 4,
            nice_floor: -10,
            cs_rt_prio: 1,
            halt_boost: BoostKind::Rt,
            halt_prio: 1,
            halt_hold_us: 1_000_000,
            halt_always: false,
            yield_boost: BoostKind::Rt,
            yield_prio: 2,
            max_boost_us: 20_000,
            throttle_us: 50_000,
            budget_us: 200_000,
            window_us: 1_000_000,
            ipi_window_us: 50_000,
            wait_on: true,
        }
    }
}

impl Caps {
    /// Parses TOML caps and checks ranges.
    pub fn from_toml(text: &str) -> Result<Caps, CapsError> {
        let c: Caps = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Checks value ranges.
    pub fn validate(&self) -> Result<(), CapsError> {
        if self.max_rt_prio > 99 {
            return Err(CapsError::Range("max_rt_prio must be 0..=99"));
        }
        if self.cs_rt_prio > 99 {
            return Err(CapsError::Range("cs_rt_prio must be 0..=99"));
        }
        if !(-20..=19).contains(&self.nice_floor) {
            return Err(CapsError::Range("nice_floor must be -20..=19"));
        }
        if self.budget_us != 0 && self.window_us == 0 {
            return Err(CapsError::Range("budget_us needs a non-zero window_us"));
        }
        for t in [
            self.max_boost_us,
            self.throttle_us,
            self.budget_us,
            self.window_us,
            self.ipi_window_us,
            self.halt_hold_us,
        ] {
            if t > u64::MAX / 1000 {
                return Err(CapsError::Range("a time does not fit in nanoseconds"));
            }
        }
        Ok(())
    }

    /// `us` in nanoseconds (saturating).
    pub fn ns(us: u64) -> u64 {
        us.saturating_mul(1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_partial_and_defaults() {
        let c =
            Caps::from_toml("allow_rt = false\nmax_rt_prio = 5\nhalt_boost = \"rt\"\n").unwrap();
        assert!(!c.allow_rt);
        assert_eq!(c.max_rt_prio, 5);
        assert_eq!(c.halt_boost, BoostKind::Rt);
        assert_eq!(c.nice_floor, Caps::default().nice_floor);
    }

    #[test]
    fn example_file_is_the_defaults() {
        let text = include_str!("../../../bpf-policy/caps.example.toml");
        assert_eq!(Caps::from_toml(text).unwrap(), Caps::default());
    }

    #[test]
    fn toml_rejects_bad_values() {
        assert!(matches!(
            Caps::from_toml("max_rt_prio = 100"),
            Err(CapsError::Range(_))
        ));
        assert!(matches!(
            Caps::from_toml("nice_floor = -21"),
            Err(CapsError::Range(_))
        ));
        assert!(matches!(
            Caps::from_toml("bogus = 1"),
            Err(CapsError::Toml(_))
        ));
    }
}
