//! The registry of VMs by name: registration (with its checks: caps
//! files, owners, the operator's maximum, quotas), caps changes,
//! reservations of device regions, unregistration, and the status and
//! metrics figures as snapshots of plain data ([`DaemonStatus`],
//! [`VmStatus`]). It owns the [`Agent`] that does the BPF side of each.
//!
//! No socket code, and no dependency on the server: server.rs decides who
//! may ask for what, calls the registry under its mutex and sends the
//! replies it returns; the metrics thread gets only snapshots.

use crate::config::Config;
use crate::proto::{
    DaemonStatus, ENDED_KEEP, ENDED_KEEP_S, Ended, ErrorKind, Region, RegisterVm, Reply,
    ThreadStatus, UnregisterReason, Unregistrations, VmStatus,
};
use crate::wire;
use pvsched_agent::{Agent, RegionMmap, VmHandle, VmSpec};
use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

/// A registered VM. Dropping it restores every thread of the VM (its
/// handle's drop), so [`Registry::unregister`] hands it back to the
/// caller to drop once it has stopped watching the VMM.
pub(crate) struct Vm {
    handle: VmHandle,
    pid: u32,
    /// The uid of the client that registered it (its quota, and who may
    /// see it in `status`).
    uid: u32,
    pidfd: Arc<OwnedFd>,
    /// The connection whose close unregisters it (None: detached).
    conn: Option<u64>,
    region: &'static str,
    caps_source: &'static str,
}

impl Vm {
    /// The pidfd of its VMM process.
    pub(crate) fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Registered `detach`ed: no connection owns it.
    pub(crate) fn detached(&self) -> bool {
        self.conn.is_none()
    }
}

/// The registered VMs, the reserved regions and the daemon's counters.
pub(crate) struct Registry {
    cfg: Config,
    agent: Agent,
    vms: BTreeMap<String, Vm>,
    /// Device regions created by `reserve` for VMs not registered yet.
    reserved: BTreeMap<String, Arc<RegionMmap>>,
    started: Instant,
    clients: u32,
    registrations: u64,
    refused: u64,
    unregistrations: Unregistrations,
    /// SIGHUP reloads taken and refused.
    reloads: (u64, u64),
    /// Registrations that ended lately, each with its VMM's uid (who may
    /// see it).
    ended: std::collections::VecDeque<(Ended, u32)>,
    /// The metrics endpoint's state, for status.
    endpoint: crate::http::EndpointState,
}

/// Most regions reserved at once (each is a 16 KiB BPF map).
const MAX_RESERVED: usize = pvsched_agent::intf::MAX_VMS as usize;

impl Registry {
    /// An empty registry: VMs registered with `agent`, checked against
    /// `cfg` (its VM files, caps maximum, defaults and `max_vms_per_uid`).
    pub(crate) fn new(cfg: Config, agent: Agent) -> Registry {
        Registry {
            cfg,
            agent,
            vms: BTreeMap::new(),
            reserved: BTreeMap::new(),
            started: Instant::now(),
            clients: 0,
            registrations: 0,
            refused: 0,
            unregistrations: Unregistrations::default(),
            reloads: (0, 0),
            ended: std::collections::VecDeque::new(),
            endpoint: crate::http::EndpointState::default(),
        }
    }

    /// Counts a SIGHUP whose files were refused.
    pub(crate) fn count_reload_error(&mut self) {
        self.reloads.1 += 1;
    }

    /// A reloaded configuration: VM files, `[max]`, the defaults and the
    /// quotas from now on. A registered VM keeps its caps; returns each
    /// whose caps are above the new maximum, with why.
    pub(crate) fn set_config(&mut self, cfg: Config) -> Vec<(String, String)> {
        self.cfg = cfg;
        self.reloads.0 += 1;
        self.vms
            .iter()
            .filter_map(|(name, vm)| {
                vm.handle
                    .caps()
                    .check_within(&self.cfg.max)
                    .err()
                    .map(|e| (name.clone(), e.to_string()))
            })
            .collect()
    }

    /// The metrics endpoint's state, which its thread keeps up to date.
    pub(crate) fn endpoint(&self) -> crate::http::EndpointState {
        self.endpoint.clone()
    }

    /// VM `name`'s device region for its device process (root's request):
    /// the region of the VM root registered (its device process started
    /// again, or a detached VM registered again after a restart), the one
    /// reserved earlier, or a new one. A region an unprivileged VMM got
    /// with its own registration is that VMM's: it is never handed to
    /// another process (the server first ends a squatter's registration,
    /// [`Registry::squatter`]).
    pub(crate) fn reserve(&mut self, name: &str) -> Result<(Reply, OwnedFd), Reply> {
        let region = match (self.vms.get(name), self.reserved.get(name)) {
            (Some(vm), _) if vm.uid == 0 => vm.handle.region().ok_or_else(|| {
                Reply::error(
                    ErrorKind::Exists,
                    format!("VM {name} is registered without a device region"),
                )
            })?,
            (Some(vm), _) => {
                return Err(Reply::error(
                    ErrorKind::Exists,
                    format!(
                        "VM {name} is registered by the VMM process {} (uid {}), which its VM \
                         file admits: its region is that VMM's own",
                        vm.pid, vm.uid
                    ),
                ));
            }
            (None, Some(r)) => r.clone(),
            (None, None) => {
                if self.reserved.len() >= MAX_RESERVED {
                    return Err(Reply::error(
                        ErrorKind::Busy,
                        format!(
                            "{MAX_RESERVED} regions are reserved already; `pvsched vm unregister` unused ones"
                        ),
                    ));
                }
                let r = self
                    .agent
                    .create_region()
                    .map_err(|e| Reply::error(ErrorKind::Internal, e.to_string()))?;
                tracing::info!(vm = %name, "device region reserved");
                self.reserved.insert(name.to_owned(), r.clone());
                r
            }
        };
        let fd = region
            .fd()
            .map_err(|e| Reply::error(ErrorKind::Internal, format!("dup of the region fd: {e}")))?;
        Ok((
            Reply::Reserved {
                region_len: region.len() as u64,
            },
            fd,
        ))
    }

    /// The VMM (pid, uid) of VM `name` if an unprivileged client holds the
    /// name without a VM file binding it: such a name is anyone's first
    /// come, and root (the libvirt hook, `qemu-attach`, a device process
    /// asking for its region) takes it over. A name with a file is bound
    /// to the VMMs the file admits and is never taken over.
    pub(crate) fn squatter(&self, name: &str) -> Option<(u32, u32)> {
        let vm = self.vms.get(name).filter(|vm| vm.uid != 0)?;
        matches!(self.cfg.vm_file_of(name), Ok(None)).then_some((vm.pid, vm.uid))
    }

    /// Checks and registers VM `r` of process `pid` (held by `pidfd`), owned by
    /// connection `conn` unless detached; on success the reply, the region fd
    /// to pass and the name.
    pub(crate) fn register(
        &mut self,
        r: RegisterVm,
        pid: u32,
        uid: u32,
        pidfd: Arc<OwnedFd>,
        conn: Option<u64>,
    ) -> Result<(Reply, Option<OwnedFd>, String), Reply> {
        if self.vms.contains_key(&r.name) {
            return Err(Reply::error(
                ErrorKind::Exists,
                format!("a VM named {} is registered already", r.name),
            ));
        }
        // A reservation is root's: the region is served by a device process
        // root started for this name, and only root's registration may
        // consume (or replace) it.
        if uid != 0 && self.reserved.contains_key(&r.name) {
            return Err(Reply::error(
                ErrorKind::Denied,
                format!(
                    "a device region is reserved for VM {} by root (`pvsched device \
                     --daemon-region {}`): only root may register that name",
                    r.name, r.name
                ),
            ));
        }
        let file = self
            .cfg
            .vm_file_of(&r.name)
            .map_err(|e| Reply::error(ErrorKind::Caps, e.to_string()))?;
        // A name with a file is bound to the VMMs the file names: whoever
        // registers (root's qemu-attach too), the VMM process must be one.
        // A file that names none is for root's registrations only.
        if let Some(f) = &file {
            let path = self.cfg.vm_file(&r.name);
            if f.owners.is_empty() && uid != 0 {
                return Err(Reply::error(
                    ErrorKind::Denied,
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
                    return Err(Reply::error(
                        ErrorKind::Invalid,
                        format!("process {pid} exited"),
                    ));
                };
                if !f.owners.admit(vmm_uid, &cgroup) {
                    return Err(Reply::error(
                        ErrorKind::Denied,
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
        // Root's registrations (the libvirt hook's, qemu-attach's) are the
        // operator's own opt-in, by domain metadata or Nova flavor.
        if file_caps.is_none() && self.cfg.require_vm_file && uid != 0 {
            return Err(Reply::error(
                ErrorKind::Denied,
                format!(
                    "VM {} has not opted in: pvschedd serves only VMs with a caps file ({} missing)",
                    r.name,
                    self.cfg.vm_file(&r.name).display()
                ),
            ));
        }
        let (caps, caps_source) = match (file_caps, r.caps) {
            (Some(c), _) => (c, "file"),
            (None, Some(c)) => (c, "client"),
            (None, None) => (self.cfg.defaults.clone(), "default"),
        };
        caps.check_within(&self.cfg.max)
            .map_err(|e| Reply::error(ErrorKind::Caps, e.to_string()))?;
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
                    ErrorKind::Denied,
                    format!("thread {tid} is not a thread of process {pid}"),
                ));
            }
        }
        if wire::exited(&pidfd) {
            return Err(Reply::error(
                ErrorKind::Invalid,
                format!("process {pid} exited"),
            ));
        }
        let region_name = r.region.name();
        let reserved = match r.region {
            Region::Reserved => Some(self.reserved.get(&r.name).cloned().ok_or_else(|| {
                Reply::error(
                    ErrorKind::Invalid,
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
            Some(region) => self.agent.register_vm_with_region(spec, region),
            None => self.agent.register_vm(spec),
        };
        let handle = registered.map_err(|e| match e {
            pvsched_agent::AgentError::Full => Reply::error(ErrorKind::Busy, e.to_string()),
            pvsched_agent::AgentError::Invalid(_) => {
                Reply::error(ErrorKind::Invalid, e.to_string())
            }
            e => Reply::error(ErrorKind::Internal, e.to_string()),
        })?;
        // Consumed, or replaced by root's registration (the reservation is
        // root's: a non-root registration never gets this far with one).
        self.reserved.remove(&r.name);
        let (fd, region_len) = match handle.region().filter(|_| send_fd) {
            Some(reg) => match reg.fd() {
                Ok(fd) => (Some(fd), reg.len() as u64),
                Err(e) => {
                    return Err(Reply::error(
                        ErrorKind::Internal,
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
        self.vms.insert(
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
                caps: Box::new(caps),
                caps_source: caps_source.into(),
                region_len,
            },
            fd,
            r.name,
        ))
    }

    /// Changes VM `name`'s caps live: `settings` over the caps in force,
    /// within the operator's maximum; the reply (the new caps, or why not).
    pub(crate) fn set_caps(&mut self, name: &str, settings: &BTreeMap<String, String>) -> Reply {
        let Some(vm) = self.vms.get_mut(name) else {
            return unknown_vm(name);
        };
        let new = match vm
            .handle
            .caps()
            .with_settings(settings.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .and_then(|c| c.check_within(&self.cfg.max).map(|()| c))
        {
            Ok(c) => c,
            Err(e) => return Reply::error(ErrorKind::Caps, e.to_string()),
        };
        if let Err(e) = vm.handle.set_caps(new.clone()) {
            return Reply::error(ErrorKind::Caps, e.to_string());
        }
        vm.caps_source = "set";
        tracing::info!(vm = %name, ?settings, "caps changed");
        Reply::Ok {
            caps: Some(Box::new(new)),
        }
    }

    /// Refuses another registration by `uid` if it has `max_vms_per_uid`
    /// VMs registered already (the caller exempts root).
    pub(crate) fn within_quota(&self, uid: u32) -> Result<(), Reply> {
        let quota = self.cfg.max_vms_per_uid;
        if self.vms.values().filter(|v| v.uid == uid).count() >= quota {
            return Err(Reply::error(
                ErrorKind::Busy,
                format!(
                    "uid {uid} has {quota} VMs registered already \
                     (max_vms_per_uid); unregister one first"
                ),
            ));
        }
        Ok(())
    }

    /// Ends VM `name`'s registration for `why` and hands the VM back
    /// (None: no such VM); dropping it restores its threads.
    pub(crate) fn unregister(&mut self, name: &str, why: UnregisterReason) -> Option<Vm> {
        let vm = self.vms.remove(name);
        if let Some(v) = &vm {
            self.unregistrations.count(why);
            let now = unix_now_s();
            while self.ended.len() >= ENDED_KEEP
                || self
                    .ended
                    .front()
                    .is_some_and(|(e, _)| e.at_unix_s + ENDED_KEEP_S < now)
            {
                self.ended.pop_front();
            }
            self.ended.push_back((
                Ended {
                    name: name.into(),
                    vm_id: v.handle.vm_id(),
                    reason: why.label().into(),
                    at_unix_s: now,
                },
                v.uid,
            ));
        }
        vm
    }

    /// Whether a region is reserved for VM `name`.
    pub(crate) fn is_reserved(&self, name: &str) -> bool {
        self.reserved.contains_key(name)
    }

    /// Drops the region reserved for VM `name`; false if there was none.
    pub(crate) fn drop_reservation(&mut self, name: &str) -> bool {
        self.reserved.remove(name).is_some()
    }

    /// The VMM process of VM `name`.
    pub(crate) fn pid_of(&self, name: &str) -> Option<u32> {
        self.vms.get(name).map(|v| v.pid)
    }

    /// Every registered VM's name.
    pub(crate) fn names(&self) -> Vec<String> {
        self.vms.keys().cloned().collect()
    }

    /// The VMs connection `conn` registered (not detached).
    pub(crate) fn owned_by(&self, conn: u64) -> Vec<String> {
        self.vms
            .iter()
            .filter(|(_, v)| v.conn == Some(conn))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Whether connection `conn` holds a registration.
    pub(crate) fn holds_vm(&self, conn: u64) -> bool {
        self.vms.values().any(|v| v.conn == Some(conn))
    }

    /// Counts connected clients (for status).
    pub(crate) fn set_clients(&mut self, n: u32) {
        self.clients = n;
    }

    /// Counts a registration accepted.
    pub(crate) fn count_registration(&mut self) {
        self.registrations += 1;
    }

    /// Counts a request refused.
    pub(crate) fn count_refused(&mut self) {
        self.refused += 1;
    }

    /// The daemon-wide figures and the status of every VM `uid` registered
    /// (None: every VM): plain data, for a `status` reply or a metrics
    /// exposition, taken under one lock so that they agree.
    pub(crate) fn snapshot(&self, uid: Option<u32>) -> (DaemonStatus, Vec<VmStatus>) {
        (self.daemon_status(uid), self.vm_statuses(uid))
    }

    /// The status of every VM `uid` registered (None: every VM) with its
    /// statistics.
    fn vm_statuses(&self, uid: Option<u32>) -> Vec<VmStatus> {
        self.vms
            .iter()
            .filter(|(_, vm)| uid.is_none_or(|u| vm.uid == u))
            .map(|(name, vm)| {
                let st = vm.handle.stats();
                VmStatus {
                    name: name.clone(),
                    vm_id: vm.handle.vm_id(),
                    pid: vm.pid,
                    region: vm.region.into(),
                    guest_features: vm.handle.guest_features(),
                    guest_abi: vm.handle.guest_abi().map(crate::proto::abi_of),
                    caps_source: vm.caps_source.into(),
                    caps: vm.handle.caps(),
                    vcpus: st.vcpus.iter().map(thread_status).collect(),
                    emulators: st.emulators.iter().map(thread_status).collect(),
                    decisions: st.decisions,
                    corrections: st.corrections,
                    apply_samples: st.apply_samples as u64,
                    apply_p50_ns: st.apply_p50_ns,
                    apply_latency: st.apply_hist.clone(),
                    apply_p99_ns: st.apply_p99_ns,
                    cosched_now_us: st.cosched_now_us,
                    cosched_sync: st
                        .cosched_sync_rate
                        .filter(|r| r.is_finite() && *r >= 0.0)
                        .map(|r| r.round() as u64),
                }
            })
            .collect()
    }

    /// The daemon-wide figures, with the ended registrations of `uid`'s
    /// VMs (None: every VM's).
    fn daemon_status(&self, uid: Option<u32>) -> DaemonStatus {
        let now = unix_now_s();
        DaemonStatus {
            version: crate::proto::VERSION.into(),
            abi: crate::proto::abi(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs(),
            dropped: self.agent.bpf_stats().map(|b| b.dropped).unwrap_or(0),
            clients: self.clients,
            registrations: self.registrations,
            refused: self.refused,
            rss_kib: rss_kib(),
            unregistrations: self.unregistrations,
            restore_errors: self.agent.restore_errors(),
            metrics: match self.endpoint.get() {
                s if s.is_empty() => "off".into(),
                s => s,
            },
            reloads: self.reloads.0,
            reload_errors: self.reloads.1,
            ended: self
                .ended
                .iter()
                .filter(|(e, u)| uid.is_none_or(|x| x == *u) && e.at_unix_s + ENDED_KEEP_S >= now)
                .map(|(e, _)| e.clone())
                .collect(),
        }
    }
}

/// The reply to a request that names a VM not registered.
pub(crate) fn unknown_vm(name: &str) -> Reply {
    Reply::error(
        ErrorKind::UnknownVm,
        format!("no VM named {name} is registered (see `pvsched status`)"),
    )
}

fn thread_status(t: &pvsched_agent::agent::ThreadStats) -> ThreadStatus {
    ThreadStatus {
        tid: t.tid,
        boost: boost_name(t.boost).into(),
        boost_prio: t.boost_prio,
        throttled: t.throttled != 0,
        wait_on_off: t.wait_on_off,
        counters: t.counters,
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

/// VmRSS of this process, KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Seconds since the epoch (0 before it, on a clock that is wrong).
fn unix_now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
