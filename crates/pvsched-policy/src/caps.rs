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
// Each field is named by its variant's #[error] message.
#[allow(missing_docs)]
pub enum CapsError {
    /// The TOML text did not parse or had wrong types.
    #[error("caps: invalid TOML (fix the file; see docs of pvsched_policy::Caps): {0}")]
    Toml(#[from] toml::de::Error),
    /// A value is out of range.
    #[error("caps: {0} (fix the value in the caps file)")]
    Range(&'static str),
    /// A value is above the operator's maximum (pvschedd's `[max]`).
    #[error("caps: {0} is above the operator maximum (pvschedd.toml [max]: {1})")]
    AboveMax(&'static str, String),
    /// A value is below the operator's minimum (pvschedd's `[max]`).
    #[error("caps: {0} is below the operator minimum (pvschedd.toml [max]: {1})")]
    BelowMin(&'static str, String),
    /// A caps file could not be read.
    #[error("caps: reading {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A caps file is invalid (the inner error says how).
    #[error("caps file {path}: {source}")]
    InFile {
        path: std::path::PathBuf,
        /// What is wrong.
        #[source]
        source: Box<CapsError>,
    },
    /// A `key=value` setting is not a cap or not a valid value.
    #[error("caps: setting {key}={value}: {why}")]
    Setting {
        /// The key as given.
        key: String,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        why: String,
    },
}

/// The operator's maximum for every VM's caps (pvschedd.toml `[max]`): a
/// VM's caps, from its file, its VMM or `pvsched vm set`, are refused if
/// they exceed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapsLimit {
    /// A VM may use SCHED_FIFO boosts.
    pub allow_rt: bool,
    /// Highest RT priority any cap may name (`max_rt_prio`, `cs_rt_prio`,
    /// an RT `halt_prio`/`yield_prio`), 0..=99.
    pub max_rt_prio: u32,
    /// Lowest `nice_floor` a VM may have, -20..=19.
    pub nice_floor: i32,
    /// Longest continuous boosted run a VM may allow, µs; a VM's
    /// `max_boost_us` must be in 1..=this (0 here: no limit, and a VM
    /// may set 0 = unlimited).
    pub max_boost_us: u64,
    /// Largest share of a window a VM's budget may be, percent (100: no
    /// limit, and a VM may set `budget_us = 0` = unlimited).
    pub max_budget_pct: u32,
    /// Largest VM-wide budget a VM may set, percent of one CPU over its
    /// window (above 100 for VMs with several vCPUs; 0: no limit, and a VM
    /// may set `vm_budget_us = 0` = unlimited). With a limit, every VM's
    /// `vm_budget_us` must be in 1..=this share of its `window_us`.
    pub max_vm_budget_pct: u32,
    /// A VM may set `halt_always` (every vCPU latency-sensitive).
    pub halt_always: bool,
    /// Shortest `throttle_us` a VM may set, µs: a throttle shorter than
    /// this would let a thread that hit `max_boost_us` be boosted again at
    /// once.
    pub min_throttle_us: u64,
    /// Longest budget window (`window_us`) a VM may set, µs: the budget's
    /// share is kept over each window, so a very long window would let a
    /// VM spend all of it in one run.
    pub max_window_us: u64,
    /// Longest `halt_hold_us` a VM may set, µs: how long a guest that
    /// stopped asking keeps its halt boost.
    pub max_halt_hold_us: u64,
    /// Longest `ipi_window_us` a VM may set, µs: how long an IPI pair
    /// stays confirmed (and its receiver boosted for its sender).
    pub max_ipi_window_us: u64,
    /// Largest share of its period a VM's co-scheduled phase may be,
    /// percent (`cosched_us` of `cosched_period_us`; 0: no VM may
    /// co-schedule). In that phase the VM's vCPU threads run at
    /// SCHED_FIFO, so this bounds what a VM can take from the host's
    /// other work.
    pub max_cosched_pct: u32,
    /// Longest co-scheduling period (`cosched_period_us`) a VM may set,
    /// µs, 1 000..=1 000 000: the off part of a period holds every vCPU
    /// of the VM at nice 19, so a long period is a long wait for a guest.
    pub max_cosched_period_us: u64,
    /// Longest co-scheduled phase a VM may hold, µs, 0..=
    /// `max_cosched_period_us` (0: no VM may co-schedule): a number in
    /// `cosched_us`, and what the agent lets an `"auto"` phase grow to.
    /// A phase is one continuous SCHED_FIFO run of every vCPU, like a
    /// boost, so it is also bounded by the VM's own `max_boost_us`.
    pub max_cosched_phase_us: u64,
}

impl Default for CapsLimit {
    fn default() -> Self {
        CapsLimit {
            allow_rt: true,
            max_rt_prio: 10,
            nice_floor: -15,
            max_boost_us: 50_000,
            max_budget_pct: 50,
            max_vm_budget_pct: 0,
            halt_always: true,
            min_throttle_us: 10_000,
            max_window_us: 1_000_000,
            max_halt_hold_us: 1_000_000,
            max_ipi_window_us: 100_000,
            max_cosched_pct: 75,
            // Five times the default period: room for a longer period
            // without the off part (nice 19) growing past 0.1 s.
            max_cosched_period_us: 100_000,
            // The default caps' max_boost_us: a phase holds the CPUs at
            // FIFO no longer than a default boost may.
            max_cosched_phase_us: 20_000,
        }
    }
}

/// Highest RT priority any cap may name: pvsched's own restorers (the
/// decision consumer and the guardian) run at SCHED_FIFO 99 so that no
/// boosted thread can keep them from putting it back.
pub const MAX_CAP_RT_PRIO: u32 = 98;

impl CapsLimit {
    /// Checks the limit's own ranges.
    pub fn validate(&self) -> Result<(), CapsError> {
        if self.max_rt_prio > MAX_CAP_RT_PRIO {
            return Err(CapsError::Range(
                "[max] max_rt_prio must be 0..=98 (pvsched's restorers run at FIFO 99)",
            ));
        }
        if !(-20..=19).contains(&self.nice_floor) {
            return Err(CapsError::Range("[max] nice_floor must be -20..=19"));
        }
        if self.max_budget_pct == 0 || self.max_budget_pct > 100 {
            return Err(CapsError::Range("[max] max_budget_pct must be 1..=100"));
        }
        if self.max_window_us == 0 {
            return Err(CapsError::Range("[max] max_window_us must be > 0"));
        }
        if self.max_cosched_pct > 100 {
            return Err(CapsError::Range("[max] max_cosched_pct must be 0..=100"));
        }
        if !(1_000..=1_000_000).contains(&self.max_cosched_period_us) {
            return Err(CapsError::Range(
                "[max] max_cosched_period_us must be 1000..=1000000",
            ));
        }
        if self.max_cosched_phase_us > self.max_cosched_period_us {
            return Err(CapsError::Range(
                "[max] max_cosched_phase_us must be 0..=max_cosched_period_us",
            ));
        }
        for t in [
            self.max_boost_us,
            self.min_throttle_us,
            self.max_window_us,
            self.max_halt_hold_us,
            self.max_ipi_window_us,
        ] {
            if t > u64::MAX / 1000 {
                return Err(CapsError::Range(
                    "[max]: a time does not fit in nanoseconds",
                ));
            }
        }
        Ok(())
    }
}

/// The longest co-scheduled phase of a VM whose `max_boost_us` is
/// `max_boost_us`, under a phase limit of `limit_us` (`[max]
/// max_cosched_phase_us`), µs: the smaller of the two, where a
/// `max_boost_us` of 0 (unlimited) bounds nothing. The agent holds an
/// `"auto"` phase to it; [`Caps::check_within`] refuses a number above it.
pub fn cosched_phase_max_us(limit_us: u64, max_boost_us: u64) -> u64 {
    match max_boost_us {
        0 => limit_us,
        b => limit_us.min(b),
    }
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

/// A switch whose default is decided per VM: `false`, `true` or `"auto"`
/// in TOML and in `pvsched vm set` (`"on"`/`"off"` too). The form of
/// [`KickPairs`] and [`WaitOn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnOffAuto {
    Off,
    On,
    Auto,
}

impl Serialize for OnOffAuto {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            OnOffAuto::Off => s.serialize_bool(false),
            OnOffAuto::On => s.serialize_bool(true),
            OnOffAuto::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for OnOffAuto {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = OnOffAuto;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false or \"auto\"")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<OnOffAuto, E> {
                Ok(if v { OnOffAuto::On } else { OnOffAuto::Off })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OnOffAuto, E> {
                match v {
                    "auto" => Ok(OnOffAuto::Auto),
                    "true" | "on" => Ok(OnOffAuto::On),
                    "false" | "off" => Ok(OnOffAuto::Off),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// When a vCPU's wake-up of a sibling confirms an IPI pair (`kick_pairs`).
/// Written `false`, `true` or `"auto"` in TOML and in `pvsched vm set`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "OnOffAuto", into = "OnOffAuto")]
pub enum KickPairs {
    /// Never.
    Off,
    /// Always.
    On,
    /// Only for a guest that does not report `wait_on` (its driver did not
    /// negotiate `F_WAIT_ON`; device-region mode, where the policy reads
    /// the negotiated features from the region header) and only from a
    /// boosted sender (the default).
    #[default]
    Auto,
}

impl KickPairs {
    /// `pvs_caps.kick_pairs` (`PVS_KICK_*` in bpf-policy/intf.h).
    pub fn abi(self) -> u32 {
        match self {
            KickPairs::Off => crate::intf::KICK_OFF,
            KickPairs::On => crate::intf::KICK_ON,
            KickPairs::Auto => crate::intf::KICK_AUTO,
        }
    }
}

impl From<OnOffAuto> for KickPairs {
    fn from(v: OnOffAuto) -> Self {
        match v {
            OnOffAuto::Off => KickPairs::Off,
            OnOffAuto::On => KickPairs::On,
            OnOffAuto::Auto => KickPairs::Auto,
        }
    }
}

impl From<KickPairs> for OnOffAuto {
    fn from(v: KickPairs) -> Self {
        match v {
            KickPairs::Off => OnOffAuto::Off,
            KickPairs::On => OnOffAuto::On,
            KickPairs::Auto => OnOffAuto::Auto,
        }
    }
}

/// Whether the policy honours the guest's `wait_on` hint (`wait_on`):
/// written `false`, `true` or `"auto"` in TOML and in `pvsched vm set`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "OnOffAuto", into = "OnOffAuto")]
pub enum WaitOn {
    /// Never.
    Off,
    /// Always.
    On,
    /// While the VM's vCPUs fit the CPUs their threads may run on (the
    /// default). On a VM with more vCPUs than that, the yield boost a
    /// waiter lends its target takes a CPU that a sibling doing the
    /// guest's work holds, and cost hackbench on a 4-vCPU VM on 2 CPUs
    /// several per cent of its work (docs/benchmarks.md, "One 4-vCPU
    /// VM"). The agent reads the threads' affinity once a second.
    #[default]
    Auto,
}

impl WaitOn {
    /// Whether the hint is honoured on a VM that fits its CPUs (`fits`).
    pub fn honoured(self, fits: bool) -> bool {
        match self {
            WaitOn::Off => false,
            WaitOn::On => true,
            WaitOn::Auto => fits,
        }
    }
}

impl From<OnOffAuto> for WaitOn {
    fn from(v: OnOffAuto) -> Self {
        match v {
            OnOffAuto::Off => WaitOn::Off,
            OnOffAuto::On => WaitOn::On,
            OnOffAuto::Auto => WaitOn::Auto,
        }
    }
}

impl From<WaitOn> for OnOffAuto {
    fn from(v: WaitOn) -> Self {
        match v {
            WaitOn::Off => OnOffAuto::Off,
            WaitOn::On => OnOffAuto::On,
            WaitOn::Auto => OnOffAuto::Auto,
        }
    }
}

/// The co-scheduled phase of every period (`cosched_us`): a number of µs
/// (0 = off), or `"auto"`. Written `5000` or `"auto"` in TOML and in
/// `pvsched vm set`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoschedUs {
    /// This many µs of every `cosched_period_us` (0: the VM does not
    /// co-schedule).
    Us(u64),
    /// The agent measures the VM's fair share of the host and co-schedules
    /// it for that share, within `[max] max_cosched_pct` of the period and
    /// the phase bound ([`cosched_phase_max_us`]; a bound of 0: no
    /// phase), while the host is overcommitted, the guest counts waits for
    /// its siblings (ABI `F_SYNC_COUNTS`) often enough, and none of the
    /// VM's vCPUs is latency-sensitive (docs/operating.md,
    /// "Co-scheduling"). The default.
    Auto,
}

impl Default for CoschedUs {
    /// `"auto"`: the agent co-schedules a VM only while its guest reports
    /// that its vCPUs wait for each other, at its fair share, and a phase
    /// yields to host threads woken on its CPUs (docs/operating.md,
    /// "Co-scheduling"), so a VM that gains nothing costs the host nothing.
    fn default() -> Self {
        CoschedUs::Auto
    }
}

impl CoschedUs {
    /// Whether the VM may co-schedule at all.
    pub fn is_on(self) -> bool {
        self != CoschedUs::Us(0)
    }
}

impl Serialize for CoschedUs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CoschedUs::Us(us) => s.serialize_u64(*us),
            CoschedUs::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for CoschedUs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = CoschedUs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number of microseconds or \"auto\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<CoschedUs, E> {
                Ok(CoschedUs::Us(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<CoschedUs, E> {
                u64::try_from(v)
                    .map(CoschedUs::Us)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<CoschedUs, E> {
                match v {
                    "auto" => Ok(CoschedUs::Auto),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(V)
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
    /// RT priority for a guest kernel critical section (NMI/IRQ/softirq/preempt-off);
    /// 0: critical sections ask for no boost.
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
    /// Boosted on-CPU time allowed per window to all the VM's threads
    /// together, µs (0 = no VM-wide limit): what the VM's boosts may cost
    /// the host, however many vCPUs it has. `budget_us` still bounds each
    /// thread; `window_us` is the window of both.
    pub vm_budget_us: u64,
    /// How long an IPI sender→receiver pair stays confirmed, µs.
    pub ipi_window_us: u64,
    /// A vCPU thread that wakes a sibling vCPU's idle, halted thread twice
    /// within `ipi_window_us` (under QEMU TCG that is the IPI itself: the
    /// sender kicks the halted receiver) confirms the pair as an IPI would.
    /// `false`, `true` or `"auto"` (the default): only for a guest whose
    /// driver did not negotiate `F_WAIT_ON` (a kernel without csd
    /// tracepoints, Linux < 6.3, cannot say whom it waits on) and only
    /// from a sender that is boosted itself, whose FIFO run would
    /// otherwise keep the sibling it kicked off the CPU (docs/operating.md).
    /// An unboosted sender's wake-ups cost the policy no event.
    pub kick_pairs: KickPairs,
    /// Honour the guest's `wait_on` hint: `true`, `false` or `"auto"` (the
    /// default: while the VM's vCPUs fit the CPUs they may run on; see
    /// [`WaitOn::Auto`]).
    pub wait_on: WaitOn,
    /// Honour a guest vCPU that says it spins on a contended lock
    /// (`wait_on` = `WAIT_ANY`): lend the yield boost to one of the VM's
    /// preempted vCPUs, the likely holder. Off by default: where a guest
    /// reports its spinlock waits, the lending cost its throughput
    /// (docs/bench/NOTES.md, "Lock waits: lending costs more than it gives").
    pub lock_wait: bool,
    /// Co-scheduling: for this long in every `cosched_period_us`, µs, all
    /// the VM's vCPU threads run together at SCHED_FIFO 1 (within
    /// `allow_rt`/`max_rt_prio`), and for the rest of the period at nice
    /// 19, unless a boost holds them higher; 0 = off. Set to the VM's
    /// fair share of the host, it gives the VM no more CPU than without
    /// it, in bursts in which its vCPUs run at the same time: what a vCPU
    /// waits for (an IPI's answer, a lock holder, a TLB shootdown) is then
    /// running (docs/operating.md, "Co-scheduling"). `"auto"` (the
    /// default): the VM's measured fair share, only while its guest
    /// reports waits for its siblings (see [`CoschedUs::Auto`]).
    /// A phase is one continuous FIFO run, like a boost: at most
    /// `[max] max_cosched_phase_us` and this VM's `max_boost_us` (unless
    /// 0), and at most `[max] max_cosched_pct` of the period.
    pub cosched_us: CoschedUs,
    /// The co-scheduling period, µs (1 000..=1 000 000, and at most
    /// `[max] max_cosched_period_us`). VMs that co-schedule take their
    /// phases one after another in VM-id order.
    pub cosched_period_us: u64,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            allow_rt: true,
            max_rt_prio: 4,
            nice_floor: -10,
            cs_rt_prio: 0,
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
            vm_budget_us: 0,
            ipi_window_us: 50_000,
            kick_pairs: KickPairs::Auto,
            wait_on: WaitOn::Auto,
            lock_wait: false,
            cosched_us: CoschedUs::default(),
            cosched_period_us: 20_000,
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

    /// The caps of a parsed TOML table (e.g. a file whose other keys the
    /// caller took out first), ranges checked.
    pub fn from_table(table: toml::Table) -> Result<Caps, CapsError> {
        let c: Caps = toml::Value::Table(table).try_into()?;
        c.validate()?;
        Ok(c)
    }

    /// Reads the caps file at `path`: the one way every pvsched program
    /// reads one (`--policy-file`, `--caps`); errors name the file.
    pub fn from_file(path: &std::path::Path) -> Result<Caps, CapsError> {
        let text = std::fs::read_to_string(path).map_err(|source| CapsError::Read {
            path: path.into(),
            source,
        })?;
        Caps::from_toml(&text).map_err(|e| CapsError::InFile {
            path: path.into(),
            source: Box::new(e),
        })
    }

    /// Checks value ranges.
    pub fn validate(&self) -> Result<(), CapsError> {
        if self.max_rt_prio > MAX_CAP_RT_PRIO {
            return Err(CapsError::Range(
                "max_rt_prio must be 0..=98 (pvsched's restorers run at FIFO 99)",
            ));
        }
        if self.cs_rt_prio > MAX_CAP_RT_PRIO {
            return Err(CapsError::Range("cs_rt_prio must be 0..=98"));
        }
        // A priority is an RT priority or a nice value by its boost kind;
        // an out-of-range one is refused, never clamped in silence.
        for (kind, prio, rt_msg, nice_msg) in [
            (
                self.halt_boost,
                self.halt_prio,
                "halt_prio must be 1..=98 with halt_boost = \"rt\"",
                "halt_prio must be -20..=19 with halt_boost = \"nice\"",
            ),
            (
                self.yield_boost,
                self.yield_prio,
                "yield_prio must be 1..=98 with yield_boost = \"rt\"",
                "yield_prio must be -20..=19 with yield_boost = \"nice\"",
            ),
        ] {
            match kind {
                BoostKind::Rt if !(1..=MAX_CAP_RT_PRIO as i32).contains(&prio) => {
                    return Err(CapsError::Range(rt_msg));
                }
                BoostKind::Nice if !(-20..=19).contains(&prio) => {
                    return Err(CapsError::Range(nice_msg));
                }
                _ => {}
            }
        }
        if !(-20..=19).contains(&self.nice_floor) {
            return Err(CapsError::Range("nice_floor must be -20..=19"));
        }
        if self.budget_us != 0 && self.window_us == 0 {
            return Err(CapsError::Range("budget_us needs a non-zero window_us"));
        }
        if self.vm_budget_us != 0 && self.window_us == 0 {
            return Err(CapsError::Range("vm_budget_us needs a non-zero window_us"));
        }
        if !(1_000..=1_000_000).contains(&self.cosched_period_us) {
            return Err(CapsError::Range("cosched_period_us must be 1000..=1000000"));
        }
        if matches!(self.cosched_us, CoschedUs::Us(us) if us > self.cosched_period_us) {
            return Err(CapsError::Range(
                "cosched_us must be at most cosched_period_us",
            ));
        }
        for t in [
            self.max_boost_us,
            self.throttle_us,
            self.budget_us,
            self.window_us,
            self.vm_budget_us,
            self.ipi_window_us,
            self.halt_hold_us,
        ] {
            if t > u64::MAX / 1000 {
                return Err(CapsError::Range("a time does not fit in nanoseconds"));
            }
        }
        Ok(())
    }

    /// Checks that every cap is within the operator's maximum (after
    /// [`Caps::validate`]).
    pub fn check_within(&self, lim: &CapsLimit) -> Result<(), CapsError> {
        let above = |what: &'static str, max: String| Err(CapsError::AboveMax(what, max));
        let rt_uses = [
            (true, "max_rt_prio", self.max_rt_prio),
            (true, "cs_rt_prio", self.cs_rt_prio),
            (
                self.halt_boost == BoostKind::Rt,
                "halt_prio",
                self.halt_prio.max(0) as u32,
            ),
            (
                self.yield_boost == BoostKind::Rt,
                "yield_prio",
                self.yield_prio.max(0) as u32,
            ),
        ];
        if self.allow_rt && !lim.allow_rt {
            return above("allow_rt = true", "allow_rt = false".into());
        }
        for (used, what, prio) in rt_uses {
            if used && self.allow_rt && prio > lim.max_rt_prio {
                return above(what, format!("max_rt_prio = {}", lim.max_rt_prio));
            }
        }
        if self.nice_floor < lim.nice_floor {
            return above("nice_floor", format!("nice_floor = {}", lim.nice_floor));
        }
        if lim.max_boost_us != 0 && (self.max_boost_us == 0 || self.max_boost_us > lim.max_boost_us)
        {
            return above(
                "max_boost_us",
                format!("1..={} (0 = unlimited is not allowed)", lim.max_boost_us),
            );
        }
        // A budget under a limit must be set (0 = unlimited is refused) and
        // within the limit's share of the window.
        for (limited, what, budget, pct, key) in [
            (
                lim.max_budget_pct < 100,
                "budget_us",
                self.budget_us,
                lim.max_budget_pct,
                "max_budget_pct",
            ),
            (
                lim.max_vm_budget_pct != 0,
                "vm_budget_us",
                self.vm_budget_us,
                lim.max_vm_budget_pct,
                "max_vm_budget_pct",
            ),
        ] {
            let pct_ok = budget != 0
                && u128::from(budget) * 100 <= u128::from(pct) * u128::from(self.window_us);
            if limited && !pct_ok {
                return above(
                    what,
                    format!("{key} = {pct} of window_us (0 = unlimited is not allowed)"),
                );
            }
        }
        // "auto" is held to the same share when the agent sets its phase:
        // under a limit of 0 it means no phase (it is the default, so a
        // host that allows no co-scheduling must not refuse every VM).
        let cosched_above = match self.cosched_us {
            CoschedUs::Us(us) => {
                u128::from(us) * 100
                    > u128::from(lim.max_cosched_pct) * u128::from(self.cosched_period_us)
            }
            CoschedUs::Auto => false,
        };
        if cosched_above {
            return above(
                "cosched_us",
                format!(
                    "max_cosched_pct = {} of cosched_period_us",
                    lim.max_cosched_pct
                ),
            );
        }
        if self.cosched_period_us > lim.max_cosched_period_us {
            return above(
                "cosched_period_us",
                format!("max_cosched_period_us = {}", lim.max_cosched_period_us),
            );
        }
        // A phase is one continuous FIFO run of every vCPU: bounded like a
        // boost, by the operator's phase limit and by the VM's own
        // max_boost_us. "auto" is held to both when the agent sets its
        // phase (a limit of 0: no phase).
        let phase_max = self.cosched_phase_max_us(lim);
        let phase_above = match self.cosched_us {
            CoschedUs::Us(us) => us > phase_max,
            CoschedUs::Auto => false,
        };
        if phase_above {
            return above(
                "cosched_us",
                format!(
                    "max_cosched_phase_us = {}, and at most the VM's max_boost_us = {} \
                     (0: no bound): a phase is one continuous FIFO run, like a boost",
                    lim.max_cosched_phase_us, self.max_boost_us
                ),
            );
        }
        if self.halt_always && !lim.halt_always {
            return above("halt_always = true", "halt_always = false".into());
        }
        if self.throttle_us < lim.min_throttle_us {
            return Err(CapsError::BelowMin(
                "throttle_us",
                format!("min_throttle_us = {}", lim.min_throttle_us),
            ));
        }
        for (what, v, max, key) in [
            (
                "window_us",
                self.window_us,
                lim.max_window_us,
                "max_window_us",
            ),
            (
                "halt_hold_us",
                self.halt_hold_us,
                lim.max_halt_hold_us,
                "max_halt_hold_us",
            ),
            (
                "ipi_window_us",
                self.ipi_window_us,
                lim.max_ipi_window_us,
                "max_ipi_window_us",
            ),
        ] {
            if v > max {
                return above(what, format!("{key} = {max}"));
            }
        }
        Ok(())
    }

    /// The longest co-scheduled phase these caps may hold under `lim`, µs:
    /// `[max] max_cosched_phase_us`, and the VM's own `max_boost_us`
    /// unless that is 0 (a phase is one continuous FIFO run, like a boost).
    pub fn cosched_phase_max_us(&self, lim: &CapsLimit) -> u64 {
        cosched_phase_max_us(lim.max_cosched_phase_us, self.max_boost_us)
    }

    /// These caps with `key=value` settings applied (`pvsched vm set`):
    /// `value` is a TOML value (`4`, `true`, `-5`) or a bare word for the
    /// boost kinds (`rt`, `nice`, `none`). Unknown keys and bad values are
    /// refused and change nothing; the result is validated.
    pub fn with_settings<'a>(
        &self,
        settings: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Caps, CapsError> {
        let mut caps = self.clone();
        let mut table = toml::Table::try_from(self).map_err(|e| CapsError::Setting {
            key: String::new(),
            value: String::new(),
            why: e.to_string(),
        })?;
        for (key, value) in settings {
            let bad = |why: String| CapsError::Setting {
                key: key.to_string(),
                value: value.to_string(),
                why,
            };
            if !table.contains_key(key) {
                return Err(bad("no such cap (see /usr/share/doc/pvsched/caps.example.toml, bpf-policy/caps.example.toml in the source)".into()));
            }
            let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or_else(|| toml::Value::String(value.to_string()));
            table.insert(key.to_string(), parsed);
            caps = toml::Value::Table(table.clone())
                .try_into::<Caps>()
                .map_err(|e| bad(e.to_string()))?;
        }
        caps.validate()?;
        Ok(caps)
    }

    /// The VM-wide budget as the policy holds it, ns: `u64::MAX` for none.
    pub fn vm_budget_ns(&self) -> u64 {
        match self.vm_budget_us {
            0 => u64::MAX,
            us => Caps::ns(us),
        }
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
    fn the_default_caps_are_within_the_default_limit() {
        Caps::default().check_within(&CapsLimit::default()).unwrap();
        CapsLimit::default().validate().unwrap();
    }

    #[test]
    fn caps_above_the_limit_are_refused() {
        let lim = CapsLimit {
            allow_rt: true,
            max_rt_prio: 3,
            nice_floor: -5,
            max_boost_us: 10_000,
            max_budget_pct: 10,
            halt_always: false,
            ..CapsLimit::default()
        };
        let ok = Caps {
            max_rt_prio: 3,
            nice_floor: -5,
            max_boost_us: 10_000,
            budget_us: 100_000,
            ..Caps::default()
        };
        ok.check_within(&lim).unwrap();
        for bad in [
            Caps {
                max_rt_prio: 4,
                ..ok.clone()
            },
            Caps {
                nice_floor: -6,
                ..ok.clone()
            },
            Caps {
                max_boost_us: 0,
                ..ok.clone()
            },
            Caps {
                max_boost_us: 10_001,
                ..ok.clone()
            },
            Caps {
                budget_us: 0,
                ..ok.clone()
            },
            Caps {
                budget_us: 100_001,
                ..ok.clone()
            },
            Caps {
                halt_always: true,
                ..ok.clone()
            },
            Caps {
                cs_rt_prio: 4,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.check_within(&lim), Err(CapsError::AboveMax(..))),
                "{bad:?}"
            );
        }
        let no_rt = CapsLimit {
            allow_rt: false,
            ..lim
        };
        assert!(ok.check_within(&no_rt).is_err());
        Caps {
            allow_rt: false,
            ..ok
        }
        .check_within(&no_rt)
        .unwrap();
    }

    /// A co-scheduled phase is bounded by its period and by the operator's
    /// share; a limit of 0 refuses every VM asking a phase in µs, naming
    /// the key.
    #[test]
    fn the_cosched_phase_is_bounded_by_its_period_and_the_limit() {
        let on = |us, period| Caps {
            cosched_us: CoschedUs::Us(us),
            cosched_period_us: period,
            ..Caps::default()
        };
        on(10_000, 20_000).validate().unwrap();
        on(10_000, 20_000)
            .check_within(&CapsLimit::default())
            .unwrap();
        assert!(on(20_001, 20_000).validate().is_err());
        assert!(on(0, 999).validate().is_err());
        assert!(on(0, 1_000_001).validate().is_err());
        match on(15_001, 20_000).check_within(&CapsLimit::default()) {
            Err(CapsError::AboveMax(what, max)) => {
                assert_eq!(what, "cosched_us");
                assert!(max.contains("max_cosched_pct = 75"), "{max}");
            }
            other => panic!("{other:?}"),
        }
        let none = CapsLimit {
            max_cosched_pct: 0,
            ..CapsLimit::default()
        };
        assert!(on(1, 20_000).check_within(&none).is_err());
        on(0, 20_000).check_within(&none).unwrap();
        let auto = Caps {
            cosched_us: CoschedUs::Auto,
            ..Caps::default()
        };
        auto.validate().unwrap();
        auto.check_within(&CapsLimit::default()).unwrap();
        // The default: a host that allows no phase accepts it (no phase).
        auto.check_within(&none).unwrap();
        assert!(
            CapsLimit {
                max_cosched_pct: 101,
                ..CapsLimit::default()
            }
            .validate()
            .is_err()
        );
    }

    /// An operator's VM-wide limit (percent of one CPU, may exceed 100)
    /// refuses a VM without a VM budget or with one above it, naming it.
    #[test]
    fn the_vm_budget_is_bounded_by_the_limit() {
        let lim = CapsLimit {
            max_vm_budget_pct: 150,
            ..CapsLimit::default()
        };
        let ok = Caps {
            vm_budget_us: 1_500_000,
            ..Caps::default()
        };
        ok.check_within(&lim).unwrap();
        for vm_budget_us in [0, 1_500_001] {
            let e = Caps {
                vm_budget_us,
                ..ok.clone()
            }
            .check_within(&lim)
            .unwrap_err();
            assert!(
                matches!(e, CapsError::AboveMax("vm_budget_us", _)),
                "{vm_budget_us}: {e}"
            );
        }
        // No limit: unlimited is allowed, and a VM budget needs a window.
        Caps::default().check_within(&CapsLimit::default()).unwrap();
        assert!(
            Caps {
                vm_budget_us: 1,
                window_us: 0,
                budget_us: 0,
                ..Caps::default()
            }
            .validate()
            .is_err()
        );
    }

    /// Every time cap is bounded by the operator's `[max]`: a zero
    /// throttle, a huge window, a huge halt hold and a huge IPI window
    /// are each refused under the default limit, naming the cap.
    #[test]
    fn every_time_cap_is_bounded_by_the_limit() {
        let lim = CapsLimit::default();
        for (bad, key) in [
            (
                Caps {
                    throttle_us: 0,
                    ..Caps::default()
                },
                "throttle_us",
            ),
            (
                Caps {
                    window_us: 1_000_000_000,
                    budget_us: 500_000_000,
                    ..Caps::default()
                },
                "window_us",
            ),
            (
                Caps {
                    halt_hold_us: 3_600_000_000,
                    ..Caps::default()
                },
                "halt_hold_us",
            ),
            (
                Caps {
                    ipi_window_us: 10_000_000,
                    ..Caps::default()
                },
                "ipi_window_us",
            ),
            (
                Caps {
                    cosched_period_us: 1_000_000,
                    ..Caps::default()
                },
                "cosched_period_us",
            ),
        ] {
            bad.validate().unwrap();
            let e = bad.check_within(&lim).unwrap_err();
            assert!(
                matches!(e, CapsError::AboveMax(k, _) | CapsError::BelowMin(k, _) if k == key),
                "{key}: {e}"
            );
        }
        let at_limit = Caps {
            throttle_us: lim.min_throttle_us,
            window_us: lim.max_window_us,
            budget_us: lim.max_window_us / 2,
            halt_hold_us: lim.max_halt_hold_us,
            ipi_window_us: lim.max_ipi_window_us,
            cosched_period_us: lim.max_cosched_period_us,
            cosched_us: CoschedUs::Us(lim.max_cosched_phase_us),
            ..Caps::default()
        };
        at_limit.check_within(&lim).unwrap();
    }

    /// A co-scheduled phase is one continuous FIFO run of every vCPU: the
    /// review's `cosched_us = 750000` of `cosched_period_us = 1000000`
    /// (FIFO 75 % of the time in 750 ms stretches) is refused, naming the
    /// key, and so is any phase above `[max] max_cosched_phase_us` or the
    /// VM's own `max_boost_us`.
    #[test]
    fn a_cosched_phase_is_bounded_like_a_boost() {
        let lim = CapsLimit::default();
        let on = |us, period| Caps {
            cosched_us: CoschedUs::Us(us),
            cosched_period_us: period,
            ..Caps::default()
        };
        let refused = |c: &Caps, l: &CapsLimit| match c.check_within(l) {
            Err(CapsError::AboveMax(key, max)) => (key, max),
            other => panic!("{c:?}: {other:?}"),
        };
        // The review's caps: valid in themselves, above the limit.
        let review = Caps::default()
            .with_settings([("cosched_us", "750000"), ("cosched_period_us", "1000000")])
            .unwrap();
        let (key, max) = refused(&review, &lim);
        assert_eq!(key, "cosched_period_us");
        assert!(max.contains("max_cosched_period_us = 100000"), "{max}");
        // Within the period limit and max_cosched_pct, longer than a phase
        // may be.
        for (caps, why) in [
            (on(75_000, 100_000), "max_cosched_phase_us = 20000"),
            (on(20_001, 100_000), "max_cosched_phase_us = 20000"),
            (
                Caps {
                    max_boost_us: 5_000,
                    ..on(5_001, 20_000)
                },
                "max_boost_us = 5000",
            ),
        ] {
            caps.validate().unwrap();
            let (key, max) = refused(&caps, &lim);
            assert_eq!(key, "cosched_us", "{caps:?}");
            assert!(max.contains(why), "{max}");
        }
        on(20_000, 100_000).check_within(&lim).unwrap();
        Caps {
            max_boost_us: 5_000,
            ..on(5_000, 20_000)
        }
        .check_within(&lim)
        .unwrap();
        // An unlimited max_boost_us (where [max] allows it) leaves the
        // phase limit alone to bound it.
        let no_boost_limit = CapsLimit {
            max_boost_us: 0,
            ..CapsLimit::default()
        };
        let unlimited = |us| Caps {
            max_boost_us: 0,
            ..on(us, 100_000)
        };
        unlimited(20_000).check_within(&no_boost_limit).unwrap();
        assert_eq!(refused(&unlimited(20_001), &no_boost_limit).0, "cosched_us");
        // "auto" is held to the bound by the agent; under a bound of 0 it
        // is accepted and means no phase.
        let auto = Caps {
            cosched_us: CoschedUs::Auto,
            max_boost_us: 1_000,
            ..Caps::default()
        };
        auto.check_within(&lim).unwrap();
        let none = CapsLimit {
            max_cosched_phase_us: 0,
            ..CapsLimit::default()
        };
        none.validate().unwrap();
        auto.check_within(&none).unwrap();
        assert_eq!(auto.cosched_phase_max_us(&none), 0);
        assert_eq!(refused(&on(1, 20_000), &none).0, "cosched_us");
        on(0, 20_000).check_within(&none).unwrap();
        assert_eq!(auto.cosched_phase_max_us(&lim), 1_000);
        assert_eq!(Caps::default().cosched_phase_max_us(&lim), 20_000);
        assert_eq!(cosched_phase_max_us(20_000, 0), 20_000);
        // The limit's own ranges.
        for (bad, key) in [
            (
                CapsLimit {
                    max_cosched_period_us: 999,
                    ..CapsLimit::default()
                },
                "max_cosched_period_us",
            ),
            (
                CapsLimit {
                    max_cosched_period_us: 1_000_001,
                    max_cosched_phase_us: 0,
                    ..CapsLimit::default()
                },
                "max_cosched_period_us",
            ),
            (
                CapsLimit {
                    max_cosched_period_us: 10_000,
                    max_cosched_phase_us: 10_001,
                    ..CapsLimit::default()
                },
                "max_cosched_phase_us",
            ),
        ] {
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    /// A priority out of its range is refused naming its key, never
    /// clamped; no cap may reach the restorers' FIFO 99.
    #[test]
    fn a_caps_file_is_read_once_and_its_errors_name_it() {
        let dir = std::env::temp_dir().join(format!("pvsched-caps-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, "budget_us = 1000\n").unwrap();
        assert_eq!(Caps::from_file(&good).unwrap().budget_us, 1000);
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "halt_boost = \"rt\"\nhalt_prio = 200\n").unwrap();
        let e = Caps::from_file(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("halt_prio"), "{e}");
        let missing = dir.join("missing.toml");
        let e = Caps::from_file(&missing).unwrap_err();
        assert!(matches!(e, CapsError::Read { .. }), "{e}");
        assert!(e.to_string().contains("missing.toml"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn out_of_range_priorities_are_refused_by_name() {
        for (text, key) in [
            ("halt_prio = 200\n", "halt_prio"),
            ("halt_prio = 0\n", "halt_prio"),
            ("halt_boost = \"nice\"\nhalt_prio = -21\n", "halt_prio"),
            ("yield_prio = 99\n", "yield_prio"),
            ("yield_boost = \"nice\"\nyield_prio = 20\n", "yield_prio"),
            ("max_rt_prio = 99\n", "max_rt_prio"),
            ("cs_rt_prio = 99\n", "cs_rt_prio"),
        ] {
            let e = Caps::from_toml(text).unwrap_err();
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
        let e = CapsLimit {
            max_rt_prio: 99,
            ..CapsLimit::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("max_rt_prio"), "{e}");
        // A priority of a boost kind that is off is not checked.
        Caps::from_toml("halt_boost = \"none\"\nhalt_prio = 200\n").unwrap();
    }

    #[test]
    fn settings_change_only_what_they_name() {
        let c = Caps::default()
            .with_settings([
                ("max_rt_prio", "2"),
                ("halt_boost", "nice"),
                ("wait_on", "false"),
            ])
            .unwrap();
        assert_eq!(c.max_rt_prio, 2);
        assert_eq!(c.halt_boost, BoostKind::Nice);
        assert_eq!(c.wait_on, WaitOn::Off);
        assert_eq!(
            Caps {
                max_rt_prio: 4,
                halt_boost: BoostKind::Rt,
                wait_on: WaitOn::Auto,
                ..c
            },
            Caps::default()
        );
        for (k, v) in [
            ("bogus", "1"),
            ("max_rt_prio", "x"),
            ("max_rt_prio", "100"),
            ("halt_boost", "fast"),
            ("kick_pairs", "sometimes"),
            ("kick_pairs", "1"),
        ] {
            assert!(Caps::default().with_settings([(k, v)]).is_err(), "{k}={v}");
        }
    }

    #[test]
    fn switches_are_a_bool_or_auto_everywhere() {
        use OnOffAuto::{Auto, Off, On};
        let both = |c: &Caps| (OnOffAuto::from(c.kick_pairs), OnOffAuto::from(c.wait_on));
        assert_eq!(both(&Caps::default()), (Auto, Auto));
        for key in ["kick_pairs", "wait_on"] {
            let of = |c: &Caps| {
                if key == "kick_pairs" {
                    both(c).0
                } else {
                    both(c).1
                }
            };
            for (text, want) in [("true", On), ("false", Off), ("\"auto\"", Auto)] {
                let c = Caps::from_toml(&format!("{key} = {text}")).unwrap();
                assert_eq!(of(&c), want, "{key} = {text}");
                // What a client sends and pvschedd persists reads back the same.
                let json = serde_json::to_string(&c).unwrap();
                assert_eq!(serde_json::from_str::<Caps>(&json).unwrap(), c, "{json}");
                let toml = toml::to_string(&c).unwrap();
                assert_eq!(Caps::from_toml(&toml).unwrap(), c, "{toml}");
            }
            for (v, want) in [("auto", Auto), ("true", On), ("off", Off)] {
                let c = Caps::default().with_settings([(key, v)]).unwrap();
                assert_eq!(of(&c), want, "{key}={v}");
            }
            let e = Caps::from_toml(&format!("{key} = \"maybe\""))
                .unwrap_err()
                .to_string();
            assert!(e.contains("auto"), "{e}");
        }
        assert!(!WaitOn::Off.honoured(true));
        assert!(WaitOn::On.honoured(false));
        assert_eq!(
            (WaitOn::Auto.honoured(true), WaitOn::Auto.honoured(false)),
            (true, false)
        );
    }

    #[test]
    fn cosched_us_is_a_number_or_auto_everywhere() {
        assert_eq!(Caps::default().cosched_us, CoschedUs::Auto);
        for (text, want) in [
            ("cosched_us = 5000", CoschedUs::Us(5000)),
            ("cosched_us = 0", CoschedUs::Us(0)),
            ("cosched_us = \"auto\"", CoschedUs::Auto),
        ] {
            let c = Caps::from_toml(text).unwrap();
            assert_eq!(c.cosched_us, want, "{text}");
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<Caps>(&json).unwrap(), c, "{json}");
            let toml = toml::to_string(&c).unwrap();
            assert_eq!(Caps::from_toml(&toml).unwrap(), c, "{toml}");
        }
        for (v, want) in [("auto", CoschedUs::Auto), ("4000", CoschedUs::Us(4000))] {
            let c = Caps::default().with_settings([("cosched_us", v)]).unwrap();
            assert_eq!(c.cosched_us, want, "cosched_us={v}");
        }
        for bad in ["cosched_us = -1", "cosched_us = \"sometimes\""] {
            let e = Caps::from_toml(bad).unwrap_err().to_string();
            assert!(e.contains("auto"), "{bad}: {e}");
        }
        assert!(CoschedUs::Auto.is_on() && CoschedUs::Us(1).is_on());
        assert!(!CoschedUs::Us(0).is_on());
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
