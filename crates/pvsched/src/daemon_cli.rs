//! `pvsched status`, `pvsched top`, `pvsched vm ...` and `pvsched metrics`:
//! the operator's view of a running pvschedd (docs/operating.md).

use crate::exit::Exit;
use clap::{Args, Subcommand};
use pvsched_daemon::proto::{DaemonStatus, ThreadStatus, VmStatus};
use pvsched_daemon::{Client, ClientError};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The daemon's socket.
#[derive(Args, Clone, Debug)]
pub struct SocketArg {
    /// pvschedd's socket.
    #[arg(long, global = true, alias = "daemon-socket", env = "PVSCHED_SOCKET", default_value = pvsched_daemon::config::DEFAULT_SOCKET)]
    pub socket: PathBuf,
}

/// `pvsched status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    socket: SocketArg,
    /// Print the daemon's JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// `pvsched top`.
#[derive(Args, Debug)]
pub struct TopArgs {
    #[command(flatten)]
    socket: SocketArg,
    /// Refresh period.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Stop after this many refreshes (default: until Ctrl-C).
    #[arg(long)]
    iterations: Option<u64>,
}

/// `pvsched metrics`.
#[derive(Args, Debug)]
pub struct MetricsArgs {
    #[command(flatten)]
    socket: SocketArg,
}

/// `pvsched vm`.
#[derive(Args, Debug)]
pub struct VmArgs {
    #[command(flatten)]
    socket: SocketArg,
    #[command(subcommand)]
    command: VmCommand,
}

#[derive(Subcommand, Debug)]
enum VmCommand {
    /// Change a running VM's caps (root): `pvsched vm set web-1
    /// max_rt_prio=2 halt_boost=nice`. Lasts until the VM unregisters;
    /// edit /etc/pvsched/vms/NAME.toml to keep it.
    Set {
        /// The VM.
        name: String,
        /// `key=value` caps (see /usr/share/doc/pvsched/caps.example.toml).
        #[arg(required = true)]
        settings: Vec<String>,
    },
    /// Unregister a VM now (its threads get their baselines back).
    Unregister {
        /// The VM.
        name: String,
    },
}

fn connect(s: &SocketArg) -> Result<Client, Exit> {
    Client::connect(&s.socket).map_err(|e| fail(&e))
}

/// The exit code of a failed exchange with pvschedd (every command that
/// talks to it: these, `qemu-attach`, `run --daemon`).
pub fn exit_for(e: &ClientError) -> Exit {
    match e {
        ClientError::Connect { .. } => Exit::NoDaemon,
        ClientError::Refused { .. } => Exit::Refused,
        _ => Exit::Failure,
    }
}

fn fail(e: &ClientError) -> Exit {
    eprintln!("pvsched: {e}");
    exit_for(e)
}

/// The daemon's status over a new connection, or the exit code (after
/// saying what failed).
fn fetch_status(s: &SocketArg) -> Result<(DaemonStatus, Vec<VmStatus>), Exit> {
    connect(s)?.status().map_err(|e| fail(&e))
}

/// `pvsched status`.
pub fn status(a: &StatusArgs) -> Exit {
    let (d, vms) = match fetch_status(&a.socket) {
        Ok(s) => s,
        Err(x) => return x,
    };
    let mut out = std::io::stdout().lock();
    let r = if a.json {
        serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "daemon": d, "vms": vms }))
            .map_err(std::io::Error::other)
            .and_then(|()| writeln!(out))
    } else {
        write_table(&mut out, &d, &vms, None)
    };
    if r.is_err() { Exit::Failure } else { Exit::Ok }
}

/// Per-thread boosts at the previous refresh, for rates.
type Previous = BTreeMap<(String, String), u64>;

fn boost_label(t: &ThreadStatus) -> String {
    match t.boost.as_str() {
        "none" => "-".into(),
        b => format!("{b}:{}", t.boost_prio),
    }
}

/// The status table; with `prev` (and the seconds since), a BOOSTS/S column.
fn write_table(
    out: &mut impl Write,
    d: &DaemonStatus,
    vms: &[VmStatus],
    prev: Option<(&Previous, f64)>,
) -> std::io::Result<()> {
    let release = if d.version.is_empty() {
        String::new()
    } else {
        format!(" {} (ABI {})", d.version, d.abi)
    };
    writeln!(
        out,
        "pvschedd{release} pid {}, up {}, {} VM(s), {} client(s), {} registrations, {} refused, {} ring drops, RSS {:.1} MiB",
        d.pid,
        humantime::format_duration(Duration::from_secs(d.uptime_s)),
        vms.len(),
        d.clients,
        d.registrations,
        d.refused,
        d.dropped,
        d.rss_kib as f64 / 1024.0
    )?;
    // Said only when something is wrong with it (a port another process
    // holds): the header stays as it was while scrapes work.
    if !d.metrics.is_empty() && d.metrics != "off" && !d.metrics.starts_with("listening") {
        writeln!(out, "metrics endpoint down: {}", d.metrics)?;
    }
    // As wide as the longest name (a Nova instance's, instance-0000002a, has 17), so
    // the columns stay aligned.
    let w = vms.iter().map(|v| v.name.len()).max().unwrap_or(0).max(16);
    writeln!(
        out,
        "{:<w$} {:>7} {:<6} {:<5} {:<7} {:<6} {:>7} {:<7} {:>9} {:>9} {:>9} {:>10} {:>6}",
        "VM",
        "PID",
        "REGION",
        "GUEST",
        "CAPS",
        "THREAD",
        "TID",
        "BOOST",
        "BOOSTS",
        "BOOSTS/S",
        "THROTTLES",
        "BOOSTED_S",
        "ERRORS"
    )?;
    for vm in vms {
        for (name, t) in vm.threads() {
            let rate = match prev {
                Some((p, secs)) if secs > 0.0 => p
                    .get(&(vm.name.clone(), name.clone()))
                    .map(|&b| format!("{:.1}", t.counters.boosts.saturating_sub(b) as f64 / secs))
                    .unwrap_or_else(|| "-".into()),
                _ => "-".into(),
            };
            writeln!(
                out,
                "{:<w$} {:>7} {:<6} {:<5} {:<7} {:<6} {:>7} {:<7} {:>9} {:>9} {:>9} {:>10.3} {:>6}",
                vm.name,
                vm.pid,
                vm.region,
                vm.guest_abi.as_deref().unwrap_or("-"),
                vm.caps_source,
                name,
                t.tid,
                if t.throttled {
                    "thrtl".into()
                } else {
                    boost_label(t)
                },
                t.counters.boosts,
                rate,
                t.counters.throttles,
                t.counters.boosted_ns as f64 / 1e9,
                t.counters.errors
            )?;
        }
    }
    Ok(())
}

/// `pvsched top`: the status table, refreshed, with boost rates.
pub fn top(a: &TopArgs) -> Exit {
    let mut prev: Option<(Previous, Instant)> = None;
    let mut n = 0u64;
    loop {
        // A connection per refresh: pvschedd closes a client that holds no
        // VM and stays silent longer than its client_timeout_ms (5 s by
        // default), which a longer --interval would be.
        let (d, vms) = match fetch_status(&a.socket) {
            Ok(s) => s,
            Err(x) => return x,
        };
        let now = Instant::now();
        let mut out = std::io::stdout().lock();
        // Clear the screen and home the cursor (ANSI), then the table.
        let _ = write!(out, "\x1b[2J\x1b[H");
        let p = prev
            .as_ref()
            .map(|(m, t)| (m, now.duration_since(*t).as_secs_f64()));
        if write_table(&mut out, &d, &vms, p).is_err() || out.flush().is_err() {
            return Exit::Failure;
        }
        let snapshot = vms
            .iter()
            .flat_map(|vm| {
                vm.threads()
                    .map(|(name, t)| ((vm.name.clone(), name), t.counters.boosts))
                    .collect::<Vec<_>>()
            })
            .collect();
        prev = Some((snapshot, now));
        n += 1;
        if a.iterations.is_some_and(|max| n >= max) {
            return Exit::Ok;
        }
        std::thread::sleep(a.interval);
    }
}

/// `pvsched metrics`: the Prometheus exposition, from the socket.
pub fn metrics(a: &MetricsArgs) -> Exit {
    let mut c = match connect(&a.socket) {
        Ok(c) => c,
        Err(x) => return x,
    };
    match c.metrics() {
        Ok(t) => {
            print!("{t}");
            Exit::Ok
        }
        Err(e) => fail(&e),
    }
}

/// `pvsched vm ...`.
pub fn vm(a: &VmArgs) -> Exit {
    let mut c = match connect(&a.socket) {
        Ok(c) => c,
        Err(x) => return x,
    };
    match &a.command {
        VmCommand::Set { name, settings } => {
            let mut map = BTreeMap::new();
            for s in settings {
                let Some((k, v)) = s.split_once('=') else {
                    eprintln!("pvsched vm set: {s:?} is not key=value");
                    return Exit::Usage;
                };
                map.insert(k.trim().to_string(), v.trim().to_string());
            }
            match c.set(name, map) {
                Ok(caps) => {
                    println!("{name}: caps now in force:");
                    print!("{}", toml::to_string(&caps).unwrap_or_default());
                    Exit::Ok
                }
                Err(e) => fail(&e),
            }
        }
        VmCommand::Unregister { name } => match c.unregister(name) {
            Ok(()) => {
                println!("{name}: unregistered; its threads are back at their baselines");
                Exit::Ok
            }
            Err(e) => fail(&e),
        },
    }
}
