//! The registry of VMs by name: registration, caps, reservations and
//! the status the daemon reports, over the state the event loop and the
//! metrics thread share.

use crate::config::Config;
use crate::proto::{DaemonStatus, Region, RegisterVm, Reply, ThreadStatus, VmStatus};
use crate::wire;
use pvsched_agent::{Agent, RegionMmap, VmHandle, VmSpec};
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

/// A registered VM.
pub(crate) struct Vm {
    handle: VmHandle,
    pub(crate) pid: u32,
    /// The uid of the client that registered it (its quota, and who may
    /// see it in `status`).
    pub(crate) uid: u32,
    pub(crate) pidfd: Arc<OwnedFd>,
    /// The connection whose close unregisters it (None: detached).
    pub(crate) conn: Option<u64>,
    region: &'static str,
    caps_source: &'static str,
}

/// The state the loop and the metrics thread share.
pub struct State {
    pub(crate) cfg: Config,
    pub(crate) agent: Agent,
    pub(crate) vms: BTreeMap<String, Vm>,
    /// Device regions created by `reserve` for VMs not registered yet.
    pub(crate) reserved: BTreeMap<String, Arc<RegionMmap>>,
    pub(crate) started: Instant,
    pub(crate) clients: u32,
    pub(crate) registrations: u64,
    pub(crate) refused: u64,
}

/// Most regions reserved at once (each is a 16 KiB BPF map).
const MAX_RESERVED: usize = pvsched_agent::intf::MAX_VMS as usize;

/// VM `name`'s device region for its device process: the registered VM's
/// own region, the one reserved earlier, or a new one.
pub(crate) fn reserve(s: &mut State, name: &str) -> Result<(Reply, OwnedFd), Reply> {
    let region = match (s.vms.get(name), s.reserved.get(name)) {
        (Some(vm), _) => vm.handle.region().ok_or_else(|| {
            Reply::error(
                "exists",
                format!("VM {name} is registered without a device region"),
            )
        })?,
        (None, Some(r)) => r.clone(),
        (None, None) => {
            if s.reserved.len() >= MAX_RESERVED {
                return Err(Reply::error(
                    "busy",
                    format!(
                        "{MAX_RESERVED} regions are reserved already; `pvsched vm unregister` unused ones"
                    ),
                ));
            }
            let r = s
                .agent
                .create_region()
                .map_err(|e| Reply::error("internal", e.to_string()))?;
            tracing::info!(vm = %name, "device region reserved");
            s.reserved.insert(name.to_owned(), r.clone());
            r
        }
    };
    let fd = region
        .fd()
        .map_err(|e| Reply::error("internal", format!("dup of the region fd: {e}")))?;
    Ok((
        Reply::Reserved {
            region_len: region.len() as u64,
        },
        fd,
    ))
}

pub(crate) fn unknown_vm(name: &str) -> Reply {
    Reply::error(
        "unknown_vm",
        format!("no VM named {name} is registered (see `pvsched status`)"),
    )
}

/// Checks and registers VM `r` of process `pid` (held by `pidfd`), owned by
/// connection `conn` unless detached; on success the reply, the region fd
/// to pass and the name.
pub(crate) fn register(
    s: &mut State,
    r: RegisterVm,
    pid: u32,
    uid: u32,
    pidfd: Arc<OwnedFd>,
    conn: Option<u64>,
) -> Result<(Reply, Option<OwnedFd>, String), Reply> {
    if s.vms.contains_key(&r.name) {
        return Err(Reply::error(
            "exists",
            format!("a VM named {} is registered already", r.name),
        ));
    }
    let file = s
        .cfg
        .vm_file_of(&r.name)
        .map_err(|e| Reply::error("caps", e.to_string()))?;
    // A name with a file is bound to the VMMs the file names: whoever
    // registers (root's qemu-attach too), the VMM process must be one.
    // A file that names none is for root's registrations only.
    if let Some(f) = &file {
        let path = s.cfg.vm_file(&r.name);
        if f.owners.is_empty() && uid != 0 {
            return Err(Reply::error(
                "denied",
                format!(
                    "VM {} is bound by {}, which names no owner: only root may register it \
                     (add owner_uids or owner_cgroups to let its VMM do so)",
                    r.name,
                    path.display()
                ),
            ));
        }
        if !f.owners.is_empty() {
            let Some((vmm_uid, cgroup)) = crate::config::process_identity(pid) else {
                return Err(Reply::error("invalid", format!("process {pid} exited")));
            };
            if !f.owners.admit(vmm_uid, &cgroup) {
                return Err(Reply::error(
                    "denied",
                    format!(
                        "VM {}'s file {} does not name its VMM (process {pid}, uid {vmm_uid}, \
                         cgroup {cgroup}) in owner_uids or owner_cgroups",
                        r.name,
                        path.display()
                    ),
                ));
            }
        }
    }
    let file_caps = file.map(|f| f.caps);
    if file_caps.is_none() && s.cfg.require_vm_file {
        return Err(Reply::error(
            "denied",
            format!(
                "VM {} has not opted in: pvschedd serves only VMs with a caps file ({} missing)",
                r.name,
                s.cfg.vm_file(&r.name).display()
            ),
        ));
    }
    let (caps, caps_source) = match (file_caps, r.caps) {
        (Some(c), _) => (c, "file"),
        (None, Some(c)) => (c, "client"),
        (None, None) => (s.cfg.defaults.clone(), "default"),
    };
    caps.check_within(&s.cfg.max)
        .map_err(|e| Reply::error("caps", e.to_string()))?;
    // Every thread must be a thread of the VMM process, checked through
    // its pidfd: if the process is gone after the check, a reused pid
    // may have answered, so the check is void.
    let tids: Vec<u32> = r
        .vcpus
        .iter()
        .map(|v| v.tid)
        .chain(r.emulator_tids.iter().copied())
        .collect();
    for &tid in &tids {
        if !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
            return Err(Reply::error(
                "denied",
                format!("thread {tid} is not a thread of process {pid}"),
            ));
        }
    }
    if wire::exited(&pidfd) {
        return Err(Reply::error("invalid", format!("process {pid} exited")));
    }
    let region_name = r.region.name();
    let reserved = match r.region {
        Region::Reserved => Some(s.reserved.get(&r.name).cloned().ok_or_else(|| {
            Reply::error(
                "invalid",
                format!(
                    "no region is reserved for VM {}: start its device process with \
                     `pvsched device --daemon-region {}` first",
                    r.name, r.name
                ),
            )
        })?),
        _ => None,
    };
    let send_fd = r.region == Region::Device;
    let spec = VmSpec {
        owner: Some(pid),
        vcpu_tids: r.vcpus.iter().map(|v| v.tid).collect(),
        emulator_tids: r.emulator_tids.clone(),
        apic_ids: r.vcpus.iter().map(|v| v.apic_id).collect(),
        caps: caps.clone(),
        region: r.region.into(),
    };
    let registered = match reserved {
        Some(region) => s.agent.register_vm_with_region(spec, region),
        None => s.agent.register_vm(spec),
    };
    let handle = registered.map_err(|e| match e {
        pvsched_agent::AgentError::Full => Reply::error("busy", e.to_string()),
        pvsched_agent::AgentError::Invalid(_) => Reply::error("invalid", e.to_string()),
        e => Reply::error("internal", e.to_string()),
    })?;
    s.reserved.remove(&r.name);
    let (fd, region_len) = match handle.region().filter(|_| send_fd) {
        Some(reg) => match reg.fd() {
            Ok(fd) => (Some(fd), reg.len() as u64),
            Err(e) => {
                return Err(Reply::error(
                    "internal",
                    format!("dup of the region fd: {e}"),
                ));
            }
        },
        None => (None, 0),
    };
    let vm_id = handle.vm_id();
    tracing::info!(
        vm = %r.name, vm_id, pid, vcpus = r.vcpus.len(),
        emulators = r.emulator_tids.len(), region = region_name, caps = caps_source,
        "registered"
    );
    s.vms.insert(
        r.name.clone(),
        Vm {
            handle,
            pid,
            uid,
            pidfd,
            conn,
            region: region_name,
            caps_source,
        },
    );
    Ok((
        Reply::Registered {
            vm_id,
            caps,
            caps_source: caps_source.into(),
            region_len,
        },
        fd,
        r.name,
    ))
}

pub(crate) fn set_caps(s: &mut State, name: &str, settings: &BTreeMap<String, String>) -> Reply {
    let Some(vm) = s.vms.get_mut(name) else {
        return unknown_vm(name);
    };
    let new = match vm
        .handle
        .caps()
        .with_settings(settings.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .and_then(|c| c.check_within(&s.cfg.max).map(|()| c))
    {
        Ok(c) => c,
        Err(e) => return Reply::error("caps", e.to_string()),
    };
    if let Err(e) = vm.handle.set_caps(new.clone()) {
        return Reply::error("caps", e.to_string());
    }
    vm.caps_source = "set";
    tracing::info!(vm = %name, ?settings, "caps changed");
    Reply::Ok { caps: Some(new) }
}

fn thread_status(t: &pvsched_agent::agent::ThreadStats) -> ThreadStatus {
    ThreadStatus {
        tid: t.tid,
        boosts: t.boosts,
        throttles: t.throttles,
        boosts_applied: t.boosts_applied,
        boosted_ns: t.boosted_ns,
        boost: boost_name(t.boost).into(),
        boost_prio: t.boost_prio,
        throttled: t.throttled != 0,
        corrections: t.corrections,
        errors: t.errors,
    }
}

/// The name of an ABI boost kind, as in caps files.
fn boost_name(kind: u32) -> &'static str {
    use pvsched_policy::BoostKind;
    match kind {
        k if k == BoostKind::Rt.abi() => "rt",
        k if k == BoostKind::Nice.abi() => "nice",
        _ => "none",
    }
}

/// The status of every VM `uid` registered (None: every VM) with its
/// statistics.
fn vm_statuses(s: &State, uid: Option<u32>) -> Vec<VmStatus> {
    s.vms
        .iter()
        .filter(|(_, vm)| uid.is_none_or(|u| vm.uid == u))
        .map(|(name, vm)| {
            let st = vm.handle.stats();
            VmStatus {
                name: name.clone(),
                vm_id: vm.handle.vm_id(),
                pid: vm.pid,
                region: vm.region.into(),
                caps_source: vm.caps_source.into(),
                caps: vm.handle.caps(),
                vcpus: st.vcpus.iter().map(thread_status).collect(),
                emulators: st.emulators.iter().map(thread_status).collect(),
                decisions: st.decisions,
                corrections: st.corrections,
                apply_samples: st.apply_samples as u64,
                apply_p50_ns: st.apply_p50_ns,
                apply_p99_ns: st.apply_p99_ns,
            }
        })
        .collect()
}

/// The daemon-wide figures.
fn daemon_status(s: &State) -> DaemonStatus {
    DaemonStatus {
        pid: std::process::id(),
        uptime_s: s.started.elapsed().as_secs(),
        dropped: s.agent.bpf_stats().map(|b| b.dropped).unwrap_or(0),
        clients: s.clients,
        registrations: s.registrations,
        refused: s.refused,
        rss_kib: rss_kib(),
    }
}

/// The daemon-wide figures and the status of every VM `uid` registered
/// (None: every VM): plain data, for a `status` reply or a metrics
/// exposition, taken under one lock so that they agree.
pub(crate) fn snapshot(s: &State, uid: Option<u32>) -> (DaemonStatus, Vec<VmStatus>) {
    (daemon_status(s), vm_statuses(s, uid))
}

pub(crate) fn status(s: &State, uid: Option<u32>) -> Reply {
    let (daemon, vms) = snapshot(s, uid);
    Reply::Status { daemon, vms }
}

/// VmRSS of this process, KiB.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}
