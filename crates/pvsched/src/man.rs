//! `pvsched man` (hidden; for packagers): the manual pages of `pvsched`,
//! each of its subcommands and `pvschedd`, rendered from the clap
//! definitions the programs parse, so a page cannot drift from `--help`.

use crate::exit::Exit;
use clap::{Args, CommandFactory};
use std::path::{Path, PathBuf};

/// Arguments of `pvsched man`.
#[derive(Args, Debug)]
pub struct ManArgs {
    /// Directory to write the pages into (created if missing):
    /// pvsched.1, pvsched-SUBCOMMAND.1, pvschedd.8.
    #[arg(long, default_value = ".")]
    pub out: PathBuf,
}

/// Why the pages could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ManError {
    /// The directory or a page could not be written.
    #[error("writing manual pages into {dir}: {source}")]
    Write {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Writes every page into `out`.
pub fn generate(pvsched: clap::Command, out: &Path) -> Result<(), ManError> {
    let write = |source| ManError::Write {
        dir: out.to_owned(),
        source,
    };
    std::fs::create_dir_all(out).map_err(write)?;
    clap_mangen::generate_to(pvsched, out).map_err(write)?;
    let daemon = pvsched_daemon::cli::Args::command();
    clap_mangen::Man::new(daemon)
        .section("8")
        .generate_to(out)
        .map_err(write)?;
    Ok(())
}

/// Runs the subcommand; returns the exit code.
pub fn main(args: &ManArgs, pvsched: clap::Command) -> Exit {
    match generate(pvsched, &args.out) {
        Ok(()) => Exit::Ok,
        Err(e) => {
            eprintln!("pvsched man: {e}");
            Exit::Failure
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every page is written, with its section, and names its options.
    #[test]
    fn pages_for_pvsched_its_subcommands_and_pvschedd() {
        let dir = std::env::temp_dir().join(format!("pvsched-man-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cmd = clap::Command::new("pvsched")
            .about("test")
            .subcommand(clap::Command::new("run").arg(clap::arg!(--vcpus <N> "vCPUs")))
            .subcommand(clap::Command::new("man").hide(true));
        generate(cmd, &dir).unwrap();
        let page = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        assert!(page("pvsched.1").contains(".TH pvsched 1"));
        assert!(page("pvsched-run.1").contains("vcpus"));
        assert!(!dir.join("pvsched-man.1").exists(), "hidden: no page");
        let daemon = page("pvschedd.8");
        assert!(daemon.contains(".TH pvschedd 8"), "{daemon}");
        assert!(daemon.contains("restore"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
