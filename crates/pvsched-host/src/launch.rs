//! Starting the reference VMM's VM with a host policy wired to it: the one
//! path `pvsched run` and `pvsched-bench run` share, so that what the bench
//! measures is what `pvsched run` does.

use crate::embedded::{Embedded, EmbeddedError};
use pvsched_device::RegionMode;
use pvsched_vmm::{DeviceMode, DeviceProgram, Run, RunConfig, Snapshot, Vm, VmConfig};
use std::time::{Duration, Instant};

/// Why the VM did not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The sandboxed device process is this binary, which could not be
    /// found.
    #[error(
        "cannot find this program to start the device process: {0}; use --device-mode in-process"
    )]
    CurrentExe(#[source] std::io::Error),
    /// The VM could not be built or started.
    #[error("{0}")]
    Vm(#[from] pvsched_vmm::Error),
    /// The policy could not be attached to the VM.
    #[error("{0}")]
    Policy(#[source] EmbeddedError),
}

/// The device in its own sandboxed process: this program's `device`
/// subcommand (both `pvsched` and `pvsched-bench` have one).
pub fn sandboxed_device() -> Result<DeviceMode, LaunchError> {
    let exe = std::env::current_exe().map_err(LaunchError::CurrentExe)?;
    Ok(DeviceMode::Sandboxed(DeviceProgram::new(exe, ["device"])))
}

/// A started VM.
pub struct Launched {
    /// The run: the guest is in its workload loops.
    pub run: Run,
    /// When the policy was attached (the VM registered with it).
    pub attached: Option<Instant>,
}

/// Starts `vm` for `duration` with `policy` (if any) wired to it: the
/// policy is the device's sink, forgets the VM if the device process dies,
/// and is attached where the region lives. A device region is attached
/// while the vCPUs are held, before the guest runs (the agent's map is
/// BAR2's backing); a guest region once the guest has placed it.
///
/// `policy` must outlive the returned run: drop it (unregistering the VM,
/// every vCPU thread back at its baseline) only after the run finished.
pub fn start(
    vm: VmConfig,
    duration: Duration,
    policy: Option<&mut Embedded>,
) -> Result<Launched, LaunchError> {
    launch(vm, duration, policy, |cfg, attach| {
        Run::start_with(cfg, attach)
    })
}

/// Like [`start`], for the VM of snapshot `snap`, which runs on where it
/// was ([`Run::restore_with`]); its configuration is the snapshot's.
pub fn restore(
    snap: Snapshot,
    duration: Duration,
    policy: Option<&mut Embedded>,
) -> Result<Launched, LaunchError> {
    let vm = snap.state.config();
    launch(vm, duration, policy, |cfg, attach| {
        Run::restore_with(cfg, snap, attach)
    })
}

/// The VM attach callback [`Run::start_with`] and [`Run::restore_with`]
/// take.
type Attach<'a> = &'a mut dyn FnMut(&mut Vm) -> Result<(), LaunchError>;

fn launch(
    mut vm: VmConfig,
    duration: Duration,
    mut policy: Option<&mut Embedded>,
    start: impl FnOnce(&RunConfig, Attach<'_>) -> Result<Run, LaunchError>,
) -> Result<Launched, LaunchError> {
    vm.policy_sink = policy.as_ref().map(|p| p.sink());
    vm.on_device_lost = policy.as_ref().map(|p| p.device_lost_hook());
    let device_region = vm.region == RegionMode::Device;
    let cfg = RunConfig::new(vm, duration);
    let mut attached = None;
    let run = start(&cfg, &mut |vm| match policy.as_deref_mut() {
        Some(p) if device_region => {
            attached = Some(Instant::now());
            p.attach_device(vm).map_err(LaunchError::Policy)
        }
        _ => Ok(()),
    })?;
    if let Some(p) = policy
        && !device_region
    {
        attached = Some(Instant::now());
        if let Err(e) = p.attach_guest(run.vm()) {
            let _ = run.finish();
            return Err(LaunchError::Policy(e));
        }
    }
    Ok(Launched { run, attached })
}
