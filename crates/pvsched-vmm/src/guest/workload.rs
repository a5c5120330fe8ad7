//! The workloads the test guest runs, selected by the VMM at boot.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What the test guest does after the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// cyclictest-shaped: halt; the VMM injects interrupts (MSI) and times
    /// the guest's acknowledgement. The handler is the "RT task": it asks
    /// for RT (FIFO 1, `kern_cs = HARDIRQ`) in its slot before it
    /// acknowledges, and clears the slot (NORMAL) before it halts again.
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
    /// Every vCPU asks for RT forever (FIFO 1, `kern_cs` 0) and PAUSE-spins
    /// with interrupts enabled until the stop flag is set; it never halts.
    Greedy,
}

impl Workload {
    /// Every workload, in documentation order.
    pub const ALL: [Workload; 6] = [
        Workload::Wakeup,
        Workload::Ipi,
        Workload::Spin,
        Workload::Hostile,
        Workload::Idle,
        Workload::Greedy,
    ];

    /// Value the VMM writes to the parameter block.
    pub const fn code(self) -> u32 {
        match self {
            Workload::Idle => 0,
            Workload::Wakeup => 1,
            Workload::Ipi => 2,
            Workload::Spin => 3,
            Workload::Hostile => 4,
            Workload::Greedy => 5,
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
            Workload::Greedy => "greedy",
        }
    }

    /// Whether vCPU `index` of `nr` checks the stop flag itself (it drives
    /// an `ipi`/`spin` pair, or it is a `greedy` vCPU) rather than waiting
    /// for interrupts.
    pub fn is_active(self, index: u32, nr: u32) -> bool {
        match self {
            Workload::Ipi | Workload::Spin => index.is_multiple_of(2) && index + 1 < nr,
            Workload::Greedy => index < nr,
            Workload::Wakeup | Workload::Hostile | Workload::Idle => false,
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A workload name that is not one of [`Workload::ALL`].
#[derive(Debug, thiserror::Error)]
#[error("unknown workload {0:?}: use wakeup, ipi, spin, hostile, idle or greedy")]
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
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), Workload::ALL.len());
        assert!("nope".parse::<Workload>().is_err());
        assert!(Workload::Ipi.is_active(0, 2));
        assert!(!Workload::Ipi.is_active(1, 2));
        assert!(!Workload::Ipi.is_active(2, 3));
        assert!(!Workload::Wakeup.is_active(0, 2));
        assert!(Workload::Greedy.is_active(0, 2));
        assert!(Workload::Greedy.is_active(1, 2));
        assert!(!Workload::Greedy.is_active(2, 2));
    }

    #[test]
    fn greedy_parses_and_has_the_next_code() {
        assert_eq!("greedy".parse::<Workload>().unwrap(), Workload::Greedy);
        assert_eq!(Workload::Greedy.to_string(), "greedy");
        assert_eq!(Workload::Greedy.code(), 5);
        let e = "greed".parse::<Workload>().unwrap_err().to_string();
        assert!(e.contains("greedy"), "{e}");
    }
}
