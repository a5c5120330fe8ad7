//! `pvschedd`: the pvsched host daemon (see the crate docs and
//! docs/operating.md).

use clap::Parser;
use pvsched_daemon::cli::Args;
use pvsched_daemon::config::Overrides;
use pvsched_daemon::http::MetricsToken;
use pvsched_daemon::server::Reload;
use pvsched_daemon::{Config, Server};
use pvsched_util::exit::Exit;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Also routes the agent's `log` records here.
    pvsched_util::logging::init("info", pvsched_util::logging::Clock::Time);

    let args = Args::parse();
    let mut cfg = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return Exit::PolicyFile.into();
        }
    };
    for d in &cfg.deprecated {
        tracing::warn!(
            "{}: {d}; the old spelling still works",
            args.config.display()
        );
    }
    let overrides = Overrides {
        socket: args.socket,
        metrics_listen: args.metrics_listen,
        socket_group: args.socket_group,
    };
    overrides.apply(&mut cfg);
    let token = match cfg.metrics_token() {
        Ok(t) => t,
        Err(e) => {
            tracing::error!("{e}");
            return Exit::PolicyFile.into();
        }
    };
    if args.check {
        return match cfg.check_dirs(&args.flavor_dir) {
            Ok((vms, flavors)) => {
                println!(
                    "{}: OK; {vms} VM file(s) in {}, {flavors} flavor file(s) in {}: OK",
                    args.config.display(),
                    cfg.vm_dir.display(),
                    args.flavor_dir.display()
                );
                if let Some(pid) = args.reload {
                    return signal_reload(pid);
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                tracing::error!("{e}");
                Exit::PolicyFile.into()
            }
        };
    }
    if args.restore {
        return restore(&cfg);
    }
    // A panic anywhere ends the process at once: the guardian then
    // restores every boosted thread (no lock of this process involved).
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        prev(info);
        std::process::abort();
    }));
    let metrics = cfg.metrics_listen.clone();
    let token = MetricsToken::new(token);
    let mut server = match Server::new(cfg) {
        Ok(s) => s,
        // Only a policy that cannot load is exit code 6 (not restarted by
        // the unit); a ledger held by another pvschedd, say, is 1.
        Err(e @ pvsched_daemon::server::ServerError::Agent(pvsched_agent::AgentError::Bpf(_))) => {
            tracing::error!("{e}");
            return Exit::PolicyLoad.into();
        }
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    server.reload_with(Reload {
        path: args.config.clone(),
        overrides,
        flavor_dir: args.flavor_dir.clone(),
        token: token.clone(),
    });
    // A port another process holds is not fatal: the endpoint's thread
    // binds it again with back-off, and status says why it is down.
    if !metrics.is_empty() {
        let spawned = pvsched_daemon::http::spawn(
            metrics,
            Box::new(server.snapshots()),
            token,
            server.metrics_endpoint(),
        );
        if let Err(e) = spawned {
            tracing::error!("starting the metrics thread: {e}");
            return ExitCode::FAILURE;
        }
    }
    pvsched_daemon::server::notify(sd_notify::NotifyState::Ready);
    tracing::info!("ready");
    match server.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `--check --reload PID`: SIGHUP to pvschedd `pid`, which reads the
/// configuration again (it logs what it took, or why it kept the old one).
fn signal_reload(pid: u32) -> ExitCode {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if comm.trim() != "pvschedd" {
        tracing::error!("--reload {pid}: not a running pvschedd (its name is {comm:?})");
        return ExitCode::FAILURE;
    }
    let target = nix::unistd::Pid::from_raw(pid as i32);
    match nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGHUP) {
        Ok(()) => {
            println!("pvschedd {pid}: reloading (its log says what it took)");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("--reload {pid}: kill(SIGHUP): {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--restore`: what the ledger still lists as boosted gets its baseline
/// back.
fn restore(cfg: &Config) -> ExitCode {
    use pvsched_agent::guardian::{LEDGER_WAIT, Ledger};
    let path = pvsched_daemon::persist::ledger_path(&cfg.runtime_dir());
    if !path.exists() {
        println!("{}: no ledger, nothing to restore", path.display());
        return ExitCode::SUCCESS;
    }
    match Ledger::open(&path, LEDGER_WAIT) {
        Ok(l) => {
            let armed = l.armed();
            let n = l.restore_armed();
            let left = l.armed();
            println!(
                "{}: {armed} thread(s) listed as boosted, {n} restored, {} gone, {left} failed",
                path.display(),
                armed.saturating_sub(n + left)
            );
            if left > 0 {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}
