//! The pvschedd wire protocol: one JSON object per `SOCK_SEQPACKET`
//! message, a request from the client and exactly one reply from the
//! daemon; the reply to a device-region registration carries the VM's
//! region map fd (`SCM_RIGHTS`). Messages are at most [`MAX_REQUEST`]
//! bytes; anything larger, malformed or out of range is refused with an
//! [`Reply::Error`] and changes nothing.
//!
//! ```json
//! {"op":"register","name":"web1","vcpus":[{"tid":4242,"apic_id":0}],"region":"device"}
//! {"op":"set","name":"web1","settings":{"max_rt_prio":"2"}}
//! {"op":"status"}
//! ```

use pvsched_agent::RegionSpec;
use pvsched_agent::agent::ThreadCounters;
use pvsched_agent::intf::{MAX_EMULATORS, MAX_VCPUS_PER_VM};
use pvsched_policy::Caps;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The protocol's version. A change an older peer would misread (a
/// field's meaning, a request's effect) bumps it; a new optional field or
/// request does not. A client says its version in [`Request::Hello`], and
/// pvschedd refuses one of another version with a message naming both
/// packages' versions.
pub const PROTOCOL: u32 = 1;

/// The pvsched release this build is (the workspace's one version,
/// `scripts/version`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The guest ABI this build speaks, `major.minor`.
pub fn abi() -> String {
    abi_of(pvsched_abi::ABI_VERSION)
}

/// An ABI version word (`(major << 16) | minor`, as DRIVER_VERSION and
/// the region header hold it) as `major.minor`: two numbers, whatever
/// word a guest wrote.
pub fn abi_of(version: u32) -> String {
    format!(
        "{}.{}",
        pvsched_abi::version_major(version),
        pvsched_abi::version_minor(version)
    )
}

/// Largest request, bytes (a 64-vCPU registration with caps is ~4 KiB).
pub const MAX_REQUEST: usize = 64 * 1024;
/// Largest reply message; a longer reply is sent as [`Reply::Chunked`].
/// Fits the kernel's default socket send buffer (`net.core.wmem_default`,
/// 212 992 bytes) with room to spare.
pub const MAX_PART: usize = 32 * 1024;
/// Largest chunked reply a client accepts.
pub const MAX_REPLY: u64 = 64 << 20;
/// Longest VM name.
pub const MAX_NAME: usize = 64;
/// Most `key=value` settings in one `set`.
pub const MAX_SETTINGS: usize = 32;

/// Errors of this module: why a request was refused before it reached
/// the daemon's state.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    /// Larger than [`MAX_REQUEST`].
    #[error("request of {0} bytes or more refused (at most {MAX_REQUEST})")]
    TooLarge(usize),
    /// Not a JSON request of this protocol.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// A field is out of range.
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// One vCPU thread of a registration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vcpu {
    /// Thread id (host PID namespace).
    pub tid: u32,
    /// The vCPU's APIC ID (what the guest's IPIs name).
    pub apic_id: u32,
}

/// Where the VM's pvsched region is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Region {
    /// No region: halt and directed-yield boosts only.
    None,
    /// Device region: the daemon creates the VM's region map and sends its
    /// fd with the reply; the VMM maps it as BAR2.
    Device,
    /// Guest region: the VMM's host address of each slot, in vCPU order.
    Guest(Vec<u64>),
    /// Device region created beforehand by [`Request::Reserve`] for this
    /// VM's name and served as BAR2 by its device process (QEMU:
    /// `pvsched device --daemon-region NAME`, then `pvsched qemu-attach
    /// --device-region`). No fd comes with the reply: the device process
    /// holds the region already.
    Reserved,
}

impl Region {
    /// The mode's name, as status shows it.
    pub fn name(&self) -> &'static str {
        match self {
            Region::None => "none",
            Region::Device => "device",
            Region::Guest(_) => "guest",
            Region::Reserved => "device",
        }
    }
}

/// The agent's region mode of a registration.
impl From<Region> for RegionSpec {
    fn from(r: Region) -> RegionSpec {
        match r {
            Region::None => RegionSpec::None,
            Region::Device | Region::Reserved => RegionSpec::DeviceMap,
            Region::Guest(a) => RegionSpec::GuestAddrs(a),
        }
    }
}

/// What a VMM that embeds the agent's `RegionSpec` sends pvschedd.
impl From<RegionSpec> for Region {
    fn from(r: RegionSpec) -> Region {
        match r {
            RegionSpec::None => Region::None,
            RegionSpec::DeviceMap => Region::Device,
            RegionSpec::GuestAddrs(a) => Region::Guest(a),
        }
    }
}

/// A VM to register: the body of `{"op":"register", ...}`; also what the
/// client sends and what the daemon checks and registers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterVm {
    /// Unique name (`[A-Za-z0-9._-]`, 1..=64 bytes), also the name of its
    /// caps file `/etc/pvsched/vms/<name>.toml`.
    pub name: String,
    /// The vCPU threads, by slot index.
    pub vcpus: Vec<Vcpu>,
    /// Emulator / I/O threads (at most 4).
    #[serde(default)]
    pub emulator_tids: Vec<u32>,
    /// Region mode.
    pub region: Region,
    /// Caps asked for, used when the VM has no caps file; must be within
    /// the operator maximum.
    #[serde(default)]
    pub caps: Option<Caps>,
    /// The VMM process, if not the client itself (root clients only, e.g.
    /// `pvsched qemu-attach`).
    #[serde(default)]
    pub pid: Option<u32>,
    /// Keep the VM registered after this connection closes, until the VMM
    /// exits or `pvsched vm unregister` (root clients only).
    #[serde(default)]
    pub detach: bool,
}

/// A request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum Request {
    /// Register a VM.
    Register(RegisterVm),
    /// Unregister a VM and restore its threads (its VMM or root).
    Unregister {
        /// The VM.
        name: String,
    },
    /// Change a VM's caps live (root only).
    Set {
        /// The VM.
        name: String,
        /// Cap name → TOML value (`"2"`, `"true"`, `"rt"`).
        settings: BTreeMap<String, String>,
    },
    /// Create VM `name`'s device region before its VMM exists, for a
    /// device process that serves it as BAR2 (root only). The reply,
    /// [`Reply::Reserved`], carries the region map's fd. Asked again, the
    /// same region is returned (a restarted device process gets the
    /// bytes the guest wrote). The VMM's later registration with
    /// [`Region::Reserved`] uses it; `unregister NAME` drops it.
    Reserve {
        /// The VM.
        name: String,
    },
    /// Every VM's state and statistics.
    Status,
    /// Prometheus text exposition of the same.
    Metrics,
    /// The client's protocol and release ([`Client::connect`] sends it
    /// first): pvschedd answers [`Reply::Hello`], or refuses a client of
    /// another [`PROTOCOL`]. A client that sends none is taken to speak
    /// version 1 (every client before the field existed).
    ///
    /// [`Client::connect`]: crate::Client::connect
    Hello {
        /// Its [`PROTOCOL`].
        proto: u32,
        /// Its release, for the message.
        #[serde(default)]
        version: String,
    },
}

/// Statistics of one registered thread.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadStatus {
    /// Thread id.
    pub tid: u32,
    /// Current boost (`none`, `nice`, `rt`).
    pub boost: String,
    /// Its priority (nice or RT priority).
    pub boost_prio: i32,
    /// Throttled now.
    pub throttled: bool,
    /// The policy ignores the guest's `wait_on` for this vCPU: its VM's
    /// `wait_on` is "auto" and it has more vCPUs than the CPUs their
    /// threads may run on (absent from older daemons: false).
    #[serde(default)]
    pub wait_on_off: bool,
    /// What pvsched counted for it: one field each (`boosts`,
    /// `boosted_ns`, `phase_yields`, ...), absent ones 0.
    #[serde(flatten)]
    pub counters: ThreadCounters,
}

/// One VM in [`Reply::Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    /// Name.
    pub name: String,
    /// The agent's VM id.
    pub vm_id: u32,
    /// The VMM process.
    pub pid: u32,
    /// Region mode (`none`, `device`, `guest`).
    pub region: String,
    /// The features the guest's driver negotiated, from the device
    /// region's header (what `kick_pairs = "auto"` reads); absent without
    /// a device region, before the guest's driver attached, or from a
    /// device older than ABI 1.3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_features: Option<u64>,
    /// The guest ABI its driver says it speaks, `MAJOR.MINOR` (the
    /// region header's `driver_version`, ABI 1.6; the guest can write
    /// anything there, so it is shown, never acted on); absent as
    /// `guest_features`, or from a device older than 1.6.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_abi: Option<String>,
    /// Where its caps came from (`file`, `client`, `default`, `set`).
    pub caps_source: String,
    /// Caps in force.
    pub caps: Caps,
    /// vCPU threads by slot index.
    pub vcpus: Vec<ThreadStatus>,
    /// Emulator threads.
    pub emulators: Vec<ThreadStatus>,
    /// Decisions applied for this VM.
    pub decisions: u64,
    /// Reconciliation corrections in this VM.
    pub corrections: u64,
    /// Decision → applied latency samples behind the percentiles.
    pub apply_samples: u64,
    /// Decision → applied latency p50, ns.
    pub apply_p50_ns: u64,
    /// p99, ns.
    pub apply_p99_ns: u64,
    /// Every decision → applied latency since the VM registered, by
    /// bucket (the metrics' `pvsched_apply_latency_seconds` histogram).
    #[serde(default)]
    pub apply_latency: pvsched_agent::agent::LatencyHistogram,
    /// The co-scheduled phase the VM holds now, µs of its
    /// `cosched_period_us` (0: not co-scheduled): its `cosched_us`, or
    /// what `"auto"` measured.
    #[serde(default)]
    pub cosched_now_us: u64,
    /// With `cosched_us = "auto"`: how much its vCPUs waited for each
    /// other over the last second, as its guest driver counts it (ABI 1.5:
    /// wake-ups of a task that last ran on another vCPU plus 8 × waits,
    /// per vCPU and second, rounded). It gets phases from 16 and loses them
    /// after 3 seconds below 12. Absent: not "auto", or a guest that
    /// reports no counts (it gets no "auto" phase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cosched_sync: Option<u64>,
}

impl VmStatus {
    /// Every thread with its name as status and metrics show it: `vcpu0`,
    /// `vcpu1`, ..., then `emu0`, ...
    pub fn threads(&self) -> impl Iterator<Item = (String, &ThreadStatus)> {
        let vcpus = self
            .vcpus
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("vcpu{i}"), t));
        let emus = self
            .emulators
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("emu{i}"), t));
        vcpus.chain(emus)
    }
}

/// Daemon-wide figures in [`Reply::Status`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStatus {
    /// pvschedd's release ([`VERSION`]; empty from a pvschedd before 1.1.0).
    #[serde(default)]
    pub version: String,
    /// The guest ABI it speaks ([`abi`]).
    #[serde(default)]
    pub abi: String,
    /// pvschedd's pid.
    pub pid: u32,
    /// Seconds since it started.
    pub uptime_s: u64,
    /// Decision records the ring buffer dropped (all VMs).
    pub dropped: u64,
    /// Connected clients.
    pub clients: u32,
    /// Registrations accepted since start.
    pub registrations: u64,
    /// Requests refused since start.
    pub refused: u64,
    /// Resident set size, KiB.
    pub rss_kib: u64,
    /// Registrations ended since start, by why.
    #[serde(default)]
    pub unregistrations: Unregistrations,
    /// Threads whose baseline could not be put back when their VM's
    /// registration ended (the VM is gone from the status then; this
    /// count stays).
    #[serde(default)]
    pub restore_errors: u64,
    /// The metrics endpoint: "off", "listening on ADDR", or why it is not
    /// listening (a port taken: pvschedd binds again with back-off).
    #[serde(default)]
    pub metrics: String,
    /// Configurations read again on SIGHUP and taken.
    #[serde(default)]
    pub reloads: u64,
    /// SIGHUPs whose files were refused (the running configuration stayed;
    /// the log says why).
    #[serde(default)]
    pub reload_errors: u64,
    /// Registrations that ended in the last [`ENDED_KEEP_S`] seconds, the
    /// latest last (at most [`ENDED_KEEP`]): what tells a VM that shut
    /// down from one that vanished while its VMM ran on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ended: Vec<Ended>,
}

/// How long a registration that ended stays in [`DaemonStatus::ended`].
pub const ENDED_KEEP_S: u64 = 15 * 60;
/// How many ended registrations it holds at most.
pub const ENDED_KEEP: usize = 256;

/// A registration that ended ([`DaemonStatus::ended`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ended {
    /// The VM's name.
    pub name: String,
    /// Its VM id then.
    pub vm_id: u32,
    /// Why ([`UnregisterReason::label`]).
    pub reason: String,
    /// When, seconds since the epoch.
    pub at_unix_s: u64,
}

/// Registrations ended since pvschedd started, by why
/// ([`DaemonStatus::unregistrations`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unregistrations {
    /// The VMM process ended while its VM was registered (a crash, a
    /// kill, or a QEMU that simply stopped: QEMU never unregisters).
    pub vmm_exited: u64,
    /// The VMM closed the connection that owned the VM.
    pub connection_closed: u64,
    /// `unregister` requests (the VMM, or root with `pvsched vm
    /// unregister`).
    pub request: u64,
    /// pvschedd could not watch the VMM, or could not register a detached
    /// VM again after a restart.
    pub failed: u64,
    /// pvschedd stopped (detached VMs are registered again by the next).
    pub shutdown: u64,
    /// Root registered the name (or reserved its device region) while an
    /// unprivileged VMM held it without a VM file binding the name to
    /// that VMM: names are the operator's, so the squatter's
    /// registration ended.
    #[serde(default)]
    pub superseded: u64,
}

/// Why a registration ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnregisterReason {
    /// See [`Unregistrations::vmm_exited`].
    VmmExited,
    /// See [`Unregistrations::connection_closed`].
    ConnectionClosed,
    /// See [`Unregistrations::request`].
    Request,
    /// See [`Unregistrations::failed`].
    Failed,
    /// See [`Unregistrations::shutdown`].
    Shutdown,
    /// See [`Unregistrations::superseded`].
    Superseded,
}

impl UnregisterReason {
    /// Its label in metrics and status.
    pub fn label(self) -> &'static str {
        match self {
            UnregisterReason::VmmExited => "vmm_exited",
            UnregisterReason::ConnectionClosed => "connection_closed",
            UnregisterReason::Request => "request",
            UnregisterReason::Failed => "failed",
            UnregisterReason::Shutdown => "shutdown",
            UnregisterReason::Superseded => "superseded",
        }
    }
}

impl Unregistrations {
    /// Counts one registration ended for `why`.
    pub fn count(&mut self, why: UnregisterReason) {
        let c = match why {
            UnregisterReason::VmmExited => &mut self.vmm_exited,
            UnregisterReason::ConnectionClosed => &mut self.connection_closed,
            UnregisterReason::Request => &mut self.request,
            UnregisterReason::Failed => &mut self.failed,
            UnregisterReason::Shutdown => &mut self.shutdown,
            UnregisterReason::Superseded => &mut self.superseded,
        };
        *c = c.saturating_add(1);
    }

    /// `(reason label, count)` for each reason, in a fixed order.
    pub fn by_reason(&self) -> [(&'static str, u64); 6] {
        use UnregisterReason as R;
        [
            (R::VmmExited.label(), self.vmm_exited),
            (R::ConnectionClosed.label(), self.connection_closed),
            (R::Request.label(), self.request),
            (R::Failed.label(), self.failed),
            (R::Shutdown.label(), self.shutdown),
            (R::Superseded.label(), self.superseded),
        ]
    }
}

/// A reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "lowercase")]
pub enum Reply {
    /// The VM is registered; with [`Region::Device`] the message carries
    /// the region map's fd (map it at offset 0, `region_len` bytes).
    Registered {
        /// The agent's VM id.
        vm_id: u32,
        /// Caps in force (boxed: the other replies are small).
        caps: Box<Caps>,
        /// Where they came from.
        caps_source: String,
        /// Bytes of the region map (device region), else 0.
        region_len: u64,
    },
    /// VM `name`'s reserved region: the message carries the region map's
    /// fd (map it at offset 0, `region_len` bytes, MAP_SHARED).
    Reserved {
        /// Bytes of the region map.
        region_len: u64,
    },
    /// Done (unregister, set).
    Ok {
        /// Caps in force after a `set`.
        #[serde(default)]
        caps: Option<Box<Caps>>,
    },
    /// Status.
    Status {
        /// The daemon (boxed: the other replies are small).
        daemon: Box<DaemonStatus>,
        /// Every VM, by name.
        vms: Vec<VmStatus>,
    },
    /// Prometheus text.
    Metrics {
        /// The exposition (text format 0.0.4).
        text: String,
    },
    /// The daemon speaks the client's protocol.
    Hello {
        /// Its [`PROTOCOL`].
        proto: u32,
        /// Its release.
        version: String,
        /// The guest ABI it speaks, `major.minor`.
        abi: String,
    },
    /// The reply is `bytes` bytes of JSON too large for one message: it
    /// follows in `parts` messages of at most [`MAX_PART`] bytes each,
    /// to be joined and parsed as one reply.
    Chunked {
        /// Messages that follow.
        parts: u32,
        /// Their total length.
        bytes: u64,
    },
    /// Refused; nothing changed.
    Error {
        /// Why, for programs.
        kind: ErrorKind,
        /// What failed and what to do, for people.
        message: String,
    },
}

impl Reply {
    /// An error reply.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
        Reply::Error {
            kind,
            message: message.into(),
        }
    }
}

/// Why a request was refused: the `kind` of a [`Reply::Error`], on the
/// wire a stable string (`"unknown_vm"`). docs/operating.md lists each
/// with what to do about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Not a request of this protocol: not JSON, an unknown `op` or
    /// field, or larger than [`MAX_REQUEST`].
    Malformed,
    /// A value out of range or not true (a bad VM name, a thread listed
    /// twice, a process that does not exist or exited, no region reserved
    /// for a [`Region::Reserved`] registration).
    Invalid,
    /// Not this client's to do: root only, another process's threads or
    /// VM, a VM file that does not name the VMM, a VM with no caps file
    /// where one is required.
    Denied,
    /// A VM of that name is registered already (for `reserve`: without a
    /// device region).
    Exists,
    /// No VM of that name is registered.
    UnknownVm,
    /// Caps not valid, above the operator's maximum, or from a VM file
    /// that cannot be read.
    Caps,
    /// A limit is reached: clients, connections or VMs of one uid,
    /// reserved regions, VMs the policy holds.
    Busy,
    /// No request came within `client_timeout_ms`; the connection is
    /// closed.
    Timeout,
    /// pvschedd failed (a system call, a BPF map), not the request.
    Internal,
    /// A kind this build does not know, from a newer pvschedd: still a
    /// refusal. pvschedd never sends it.
    #[serde(other)]
    Unknown,
}

impl ErrorKind {
    /// Every kind pvschedd sends.
    pub const ALL: [ErrorKind; 9] = [
        ErrorKind::Malformed,
        ErrorKind::Invalid,
        ErrorKind::Denied,
        ErrorKind::Exists,
        ErrorKind::UnknownVm,
        ErrorKind::Caps,
        ErrorKind::Busy,
        ErrorKind::Timeout,
        ErrorKind::Internal,
    ];

    /// The kind as it is on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Malformed => "malformed",
            ErrorKind::Invalid => "invalid",
            ErrorKind::Denied => "denied",
            ErrorKind::Exists => "exists",
            ErrorKind::UnknownVm => "unknown_vm",
            ErrorKind::Caps => "caps",
            ErrorKind::Busy => "busy",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "internal",
            ErrorKind::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether `name` is a valid VM name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// Parses and checks one request message. Never panics, whatever the
/// bytes.
pub fn parse_request(bytes: &[u8]) -> Result<Request, ProtoError> {
    if bytes.len() > MAX_REQUEST {
        return Err(ProtoError::TooLarge(bytes.len()));
    }
    let req: Request =
        serde_json::from_slice(bytes).map_err(|e| ProtoError::Malformed(e.to_string()))?;
    check(&req)?;
    Ok(req)
}

fn check(req: &Request) -> Result<(), ProtoError> {
    let name_ok = |name: &str| {
        if valid_name(name) {
            Ok(())
        } else {
            Err(ProtoError::Invalid(format!(
                "VM name {name:?}: use 1..={MAX_NAME} of [A-Za-z0-9._-], not starting with '.'"
            )))
        }
    };
    match req {
        Request::Register(RegisterVm {
            name,
            vcpus,
            emulator_tids,
            region,
            caps,
            pid,
            ..
        }) => {
            name_ok(name)?;
            if vcpus.is_empty() || vcpus.len() > MAX_VCPUS_PER_VM as usize {
                return Err(ProtoError::Invalid(format!(
                    "{} vCPUs (1..={MAX_VCPUS_PER_VM} supported)",
                    vcpus.len()
                )));
            }
            if emulator_tids.len() > MAX_EMULATORS as usize {
                return Err(ProtoError::Invalid(format!(
                    "{} emulator threads (at most {MAX_EMULATORS})",
                    emulator_tids.len()
                )));
            }
            let tids: Vec<u32> = vcpus
                .iter()
                .map(|v| v.tid)
                .chain(emulator_tids.iter().copied())
                .collect();
            if let Some(t) = tids.iter().find(|&&t| t == 0 || t > i32::MAX as u32) {
                return Err(ProtoError::Invalid(format!("thread id {t} is not valid")));
            }
            for (i, t) in tids.iter().enumerate() {
                if tids[..i].contains(t) {
                    return Err(ProtoError::Invalid(format!("thread {t} is listed twice")));
                }
            }
            let apics: Vec<u32> = vcpus.iter().map(|v| v.apic_id).collect();
            for (i, a) in apics.iter().enumerate() {
                if apics[..i].contains(a) {
                    return Err(ProtoError::Invalid(format!("APIC ID {a} is listed twice")));
                }
            }
            if let Region::Guest(addrs) = region
                && addrs.len() != vcpus.len()
            {
                return Err(ProtoError::Invalid(format!(
                    "guest region: {} slot addresses for {} vCPUs",
                    addrs.len(),
                    vcpus.len()
                )));
            }
            if let Some(c) = caps {
                c.validate()
                    .map_err(|e| ProtoError::Invalid(e.to_string()))?;
            }
            if let Some(p) = pid
                && (*p == 0 || *p > i32::MAX as u32)
            {
                return Err(ProtoError::Invalid(format!("pid {p} is not valid")));
            }
            Ok(())
        }
        Request::Unregister { name } | Request::Reserve { name } => name_ok(name),
        Request::Set { name, settings } => {
            name_ok(name)?;
            if settings.is_empty() || settings.len() > MAX_SETTINGS {
                return Err(ProtoError::Invalid(format!(
                    "{} settings (1..={MAX_SETTINGS})",
                    settings.len()
                )));
            }
            Ok(())
        }
        Request::Status | Request::Metrics => Ok(()),
        Request::Hello { version, .. } => {
            if version.len() > MAX_NAME {
                return Err(ProtoError::Invalid(format!(
                    "a version of {} bytes (at most {MAX_NAME})",
                    version.len()
                )));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn register(n: usize) -> Request {
        Request::Register(RegisterVm {
            name: "vm-1".into(),
            vcpus: (0..n as u32)
                .map(|i| Vcpu {
                    tid: 100 + i,
                    apic_id: i,
                })
                .collect(),
            emulator_tids: vec![],
            region: Region::Device,
            caps: None,
            pid: None,
            detach: false,
        })
    }

    /// Any word a guest wrote reads as two numbers.
    #[test]
    fn an_abi_word_is_major_dot_minor() {
        assert_eq!(abi_of(0x0001_0006), "1.6");
        assert_eq!(abi_of(u32::MAX), "65535.65535");
        assert_eq!(abi(), abi_of(pvsched_abi::ABI_VERSION));
    }

    #[test]
    fn a_request_round_trips() {
        let r = register(4);
        let bytes = serde_json::to_vec(&r).unwrap();
        assert_eq!(parse_request(&bytes).unwrap(), r);
        let text = r#"{"op":"register","name":"web1","vcpus":[{"tid":4242,"apic_id":0}],"region":"device"}"#;
        assert!(matches!(
            parse_request(text.as_bytes()).unwrap(),
            Request::Register(_)
        ));
        let set = r#"{"op":"set","name":"web1","settings":{"max_rt_prio":"2"}}"#;
        assert!(matches!(
            parse_request(set.as_bytes()).unwrap(),
            Request::Set { .. }
        ));
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let cases: &[(&str, &str)] = &[
            (r#"{"op":"unregister","name":"a","x":1}"#, "unknown field"),
            (
                r#"{"op":"register","name":"a","vcpus":[{"tid":5,"apic_id":0}],"region":"none","x":1}"#,
                "unknown field",
            ),
            (r#"{"op":"fly"}"#, "unknown variant"),
            (r#"{"op":"unregister","name":"../etc/passwd"}"#, "VM name"),
            (r#"{"op":"unregister","name":".hidden"}"#, "VM name"),
            (
                r#"{"op":"register","name":"a","vcpus":[],"region":"none"}"#,
                "0 vCPUs",
            ),
            (
                r#"{"op":"register","name":"a","vcpus":[{"tid":1,"apic_id":0},{"tid":1,"apic_id":1}],"region":"none"}"#,
                "listed twice",
            ),
            (
                r#"{"op":"register","name":"a","vcpus":[{"tid":0,"apic_id":0}],"region":"none"}"#,
                "not valid",
            ),
            (
                r#"{"op":"register","name":"a","vcpus":[{"tid":5,"apic_id":0}],"region":{"guest":[]}}"#,
                "slot addresses",
            ),
            (
                r#"{"op":"register","name":"a","vcpus":[{"tid":5,"apic_id":0}],"region":"none","caps":{"max_rt_prio":100}}"#,
                "max_rt_prio",
            ),
            (r#"{"op":"set","name":"a","settings":{}}"#, "0 settings"),
            (r#"{"op":"hello"}"#, "missing field `proto`"),
            (r#"{"op":"hello","proto":1,"x":1}"#, "unknown field"),
            (
                &format!(
                    r#"{{"op":"hello","proto":1,"version":"{}"}}"#,
                    "9".repeat(65)
                ),
                "version of 65 bytes",
            ),
        ];
        for (text, why) in cases {
            let e = parse_request(text.as_bytes()).unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
        }
        let big = vec![b' '; MAX_REQUEST + 1];
        assert_eq!(
            parse_request(&big),
            Err(ProtoError::TooLarge(MAX_REQUEST + 1))
        );
        assert!(parse_request(&serde_json::to_vec(&register(65)).unwrap()).is_err());
        // A client before the version field: protocol 1, no version.
        assert_eq!(
            parse_request(br#"{"op":"hello","proto":1}"#),
            Ok(Request::Hello {
                proto: 1,
                version: String::new()
            })
        );
    }

    /// A thread's counters are plain fields of its status, under the names
    /// clients (pvsched status --json, the benchmarks) read, and a status
    /// from a daemon that did not have a counter yet reads it as 0.
    #[test]
    fn thread_counters_are_flat_fields_of_the_status() {
        let t = ThreadStatus {
            tid: 7,
            boost: "rt".into(),
            boost_prio: 1,
            throttled: false,
            wait_on_off: false,
            counters: ThreadCounters {
                boosts: 3,
                phase_yields: 5,
                ..ThreadCounters::default()
            },
        };
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["boosts"], 3);
        assert_eq!(v["phase_yields"], 5);
        assert_eq!(v["sync_wait_ns"], 0);
        assert!(v.get("counters").is_none(), "{v}");
        assert_eq!(serde_json::from_value::<ThreadStatus>(v).unwrap(), t);
        let old = serde_json::json!({
            "tid": 7, "boosts": 3, "throttles": 0, "boosts_applied": 0, "boosted_ns": 0,
            "boost": "none", "boost_prio": 0, "throttled": false, "corrections": 0, "errors": 0
        });
        let t = serde_json::from_value::<ThreadStatus>(old).unwrap();
        assert_eq!((t.counters.boosts, t.counters.phase_yields), (3, 0));
    }

    #[test]
    fn error_kinds_keep_their_wire_strings() {
        let wire = [
            "malformed",
            "invalid",
            "denied",
            "exists",
            "unknown_vm",
            "caps",
            "busy",
            "timeout",
            "internal",
        ];
        assert_eq!(ErrorKind::ALL.len(), wire.len());
        for (kind, s) in ErrorKind::ALL.into_iter().zip(wire) {
            assert_eq!(kind.as_str(), s);
            assert_eq!(kind.to_string(), s);
            assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{s}\""));
            let back: ErrorKind = serde_json::from_str(&format!("\"{s}\"")).unwrap();
            assert_eq!(back, kind);
        }
        let reply = Reply::error(ErrorKind::UnknownVm, "no VM named a");
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"reply":"error","kind":"unknown_vm","message":"no VM named a"}"#
        );
        // A kind from a newer pvschedd is still an error reply.
        let newer: Reply =
            serde_json::from_str(r#"{"reply":"error","kind":"overheated","message":"m"}"#).unwrap();
        assert_eq!(newer, Reply::error(ErrorKind::Unknown, "m"));
    }

    #[test]
    fn every_error_kind_is_documented() {
        let doc = include_str!("../../../docs/operating.md");
        for kind in ErrorKind::ALL {
            assert!(
                doc.contains(&format!("| `{kind}` |")),
                "docs/operating.md has no row for error kind `{kind}`"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any bytes: a request or an error, never a panic.
        #[test]
        fn any_bytes_parse_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = parse_request(&bytes);
        }

        /// A valid registration mutated byte by byte: still never a panic,
        /// and whatever parses passes the checks.
        #[test]
        fn mutated_registrations_parse_or_fail_cleanly(
            n in 1usize..8,
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        ) {
            let mut bytes = serde_json::to_vec(&register(n)).unwrap();
            for (at, b) in edits {
                let i = at % bytes.len();
                bytes[i] = b;
            }
            if let Ok(req) = parse_request(&bytes) {
                prop_assert!(check(&req).is_ok());
            }
        }
    }
}
