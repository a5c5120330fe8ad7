//! `pvsched migrate`: live-migrates a QEMU that has the pvsched device to
//! another QEMU, taking the device along the only way QEMU allows.
//!
//! QEMU's vfio-user client migrates no device state (a `migrate` with the
//! device plugged reports `"vfio": {"transferred": 0}`), and a
//! destination started without the device cannot load a stream that has
//! it. So the device goes before and comes back after:
//!
//! 1. `detach` on the source: the VM is unregistered (every thread back
//!    at its baseline), the guest releases the device, its process ends;
//! 2. QMP `migrate` on the source to `--uri`, whose destination QEMU
//!    (`--to-qmp`, `--to-pid`) waits with `-incoming`; the guest keeps
//!    running throughout;
//! 3. once QEMU says `completed`: `attach` on the destination (its vCPU
//!    threads, the same caps, a new device process, the device plugged,
//!    the guest driver's DRIVER_OK);
//! 4. if the migration fails or is cancelled, or does not end within
//!    `--timeout` (then it is cancelled): `attach` on the source again,
//!    which runs on as it was, and the exit status says it failed.

use crate::attach::{AttachArgs, DetachArgs, attach_inner, detach_inner, qmp_of};
use crate::exit::Exit;
use crate::qemu_attach::Failed;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `pvsched migrate`.
#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// The source VM, as for `pvsched attach --qmp` (its QMP socket,
    /// `--pid`, `--name`, the caps options).
    #[command(flatten)]
    from: AttachArgs,
    /// The destination QEMU's QMP socket (QEMU started with `-incoming`).
    #[arg(long, value_name = "SOCKET")]
    to_qmp: PathBuf,
    /// The destination QEMU process (its QMP socket's peer must be it).
    #[arg(long, value_name = "PID")]
    to_pid: u32,
    /// Where the source sends its state: the URI the destination listens
    /// on (`unix:PATH`, `tcp:HOST:PORT`).
    #[arg(long, value_name = "URI")]
    uri: String,
    /// Longest migration; then it is cancelled and the source attached
    /// again.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// How often the migration's state is asked.
const POLL: Duration = Duration::from_millis(200);

/// Runs `pvsched migrate`.
pub fn migrate(a: &MigrateArgs) -> Exit {
    match migrate_inner(a) {
        Ok(code) => code,
        Err((code, e)) => {
            eprintln!("pvsched migrate: {e}");
            code
        }
    }
}

fn migrate_inner(a: &MigrateArgs) -> Result<Exit, Failed> {
    let fail = |e: String| (Exit::Failure, e);
    let src = &a.from.vm;
    let (Some(qmp), Some(pid), Some(name)) = (&src.target.qmp, src.target.pid, &src.target.name)
    else {
        return Err((
            Exit::Usage,
            "migrate takes the source as --qmp SOCKET --pid PID --name NAME".into(),
        ));
    };
    // The destination must answer before the source gives anything up.
    drop(qmp_of(&a.to_qmp, a.to_pid).map_err(|e| fail(format!("{name}: destination: {e}")))?);
    let detach = DetachArgs {
        target: src.target.clone(),
        timeout: Duration::from_secs(30),
        dir: a.from.dir.clone(),
    };
    let again = |why: String| -> Result<Exit, Failed> {
        // The source as it was: its device and registration back.
        match attach_inner(&a.from) {
            Ok(_) => Err(fail(format!(
                "{name}: {why}; the source QEMU {pid} runs on, attached again"
            ))),
            Err((_, e)) => Err(fail(format!(
                "{name}: {why}; attaching the source again failed too: {e}"
            ))),
        }
    };
    if let Err((_, e)) = detach_inner(&detach) {
        return again(format!("detaching the source failed: {e}"));
    }
    let started = Instant::now();
    let outcome = run_migration(a, qmp, pid);
    let secs = started.elapsed().as_secs_f64();
    match outcome {
        Ok(()) => {
            let mut to = a.from.clone();
            to.vm.target.qmp = Some(a.to_qmp.clone());
            to.vm.target.pid = Some(a.to_pid);
            println!(
                "{name}: migrated from QEMU {pid} to QEMU {} in {secs:.1} s (the device \
                 detached before, attached after)",
                a.to_pid
            );
            attach_inner(&to)
        }
        Err(why) => again(why),
    }
}

/// `migrate` on the source, then its state until it ends: Ok once
/// `completed`, else why not (a migration past `--timeout` is cancelled).
fn run_migration(a: &MigrateArgs, qmp: &std::path::Path, pid: u32) -> Result<(), String> {
    let mut mon = qmp_of(qmp, pid)?;
    mon.execute("migrate", Some(&json!({ "uri": a.uri })))
        .map_err(|e| format!("migrate to {}: {e}", a.uri))?;
    let start = Instant::now();
    loop {
        let st = mon.execute("query-migrate", None)?;
        match st["status"].as_str().unwrap_or("") {
            "completed" => return Ok(()),
            s @ ("failed" | "cancelled") => {
                let why = st["error-desc"].as_str().unwrap_or("no reason given");
                return Err(format!("the migration {s}: {why}"));
            }
            _ if start.elapsed() > a.timeout => {
                let _ = mon.execute("migrate_cancel", None);
                return Err(format!(
                    "the migration did not complete within {}: cancelled",
                    humantime::format_duration(a.timeout)
                ));
            }
            _ => std::thread::sleep(POLL),
        }
    }
}
