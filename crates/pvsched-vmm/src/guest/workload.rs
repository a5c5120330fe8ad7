//! The workloads the test guest runs, selected by the VMM at boot.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What the test guest does after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Halt; the VMM injects interrupts (MSI) and times the guest's acknowledgement.
    Wakeup,
    /// x2APIC IPI ping-pong in vCPU pairs (0,1), (2,3)...; round trips timed.
    Ipi,
    /// The even vCPU of a pair sets `wait_on`, IPIs its partner and PAUSE-loops
    /// until the partner's handler answers.
    Spin,
    /// Garbage to the registers, the region and configuration space.
    Hostile,
    /// Handshake and slot burst, then halt.
    Idle,
}

impl Workload {
    /// Every workload, in documentation order.
    pub const ALL: [Workload; 5] = [
        Workload::Wakeup,
        Workload::Ipi,
        Workload::Spin,
        Workload::Hostile,
        Workload::Idle,
    ];

    /// Value the VMM writes to the parameter block.
    pub const fn code(self) -> u32 {
        match self {
            Workload::Idle => 0,
            Workload::Wakeup => 1,
            Workload::Ipi => 2,
            Workload::Spin => 3,
            Workload::Hostile => 4,
        }
    }

    /// Lower-case name (also the CLI spelling).
    pub const fn name(self) -> &'static str {
        match self {
            Workload::Idle => "idle",
            Workload::Wakeup => "wakeup",
            Workload::Ipi => "ipi",
            Workload::Spin => "spin",
            Workload::Hostile => "hostile",
        }
    }

    /// Whether vCPU `index` of `nr` drives its pair (checks the stop flag
    /// itself) rather than waiting for interrupts.
    pub fn is_active(self, index: u32, nr: u32) -> bool {
        matches!(self, Workload::Ipi | Workload::Spin) && index.is_multiple_of(2) && index + 1 < nr
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A workload name that is not one of [`Workload::ALL`].
#[derive(Debug, thiserror::Error)]
#[error("unknown workload {0:?}: use wakeup, ipi, spin, hostile or idle")]
pub struct UnknownWorkload(String);

impl FromStr for Workload {
    type Err = UnknownWorkload;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Workload::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| UnknownWorkload(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_codes_differ() {
        for w in Workload::ALL {
            assert_eq!(w.name().parse::<Workload>().unwrap(), w);
        }
        let mut codes: Vec<u32> = Workload::ALL.iter().map(|w| w.code()).collect();
        codes.dedup();
        assert_eq!(codes.len(), Workload::ALL.len());
        assert!("nope".parse::<Workload>().is_err());
        assert!(Workload::Ipi.is_active(0, 2));
        assert!(!Workload::Ipi.is_active(1, 2));
        assert!(!Workload::Ipi.is_active(2, 3));
        assert!(!Workload::Wakeup.is_active(0, 2));
    }
}
