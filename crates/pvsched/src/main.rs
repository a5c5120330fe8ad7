//! `pvsched` command line. Each subcommand lives in its own module; this
//! file only parses and dispatches.

mod exit;
mod run;

use clap::{Parser, Subcommand};

/// pvsched: paravirtualized scheduling hints between guest and host.
#[derive(Parser)]
#[command(name = "pvsched", version, about, after_help = exit::HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot the reference VMM with the test guest and measure a workload.
    #[command(after_help = exit::HELP)]
    Run(run::RunArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run(args) => run::main(&args),
    };
    std::process::ExitCode::from(code as u8)
}
