//! `pvsched man` (hidden; for packagers): the manual pages of `pvsched`,
//! each of its subcommands and `pvschedd`, rendered from the clap
//! definitions the programs parse, so a page cannot drift from `--help`;
//! and pvschedd.toml(5), built from the annotated files the package
//! installs (`dist/pvschedd.toml`, `bpf-policy/caps.example.toml`, both
//! checked against the parsers' defaults by their crates' tests) and the
//! daemon's own list of restart-only keys.

use crate::exit::Exit;
use clap::{Args, CommandFactory};
use std::path::{Path, PathBuf};

/// Arguments of `pvsched man`.
#[derive(Args, Debug)]
pub struct ManArgs {
    /// Directory to write the pages into (created if missing):
    /// pvsched.1, pvsched-SUBCOMMAND.1, pvschedd.8, pvschedd.toml.5.
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
    std::fs::write(out.join("pvschedd.toml.5"), config_page()).map_err(write)?;
    Ok(())
}

/// Text for a roff no-fill block: a line starting with `.` or `'` would be
/// a request, and `\` starts an escape.
fn roff_literal(text: &str) -> String {
    text.lines()
        .map(|l| {
            let l = l.replace('\\', "\\e");
            if l.starts_with('.') || l.starts_with('\'') {
                format!("\\&{l}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect()
}

/// pvschedd.toml(5): the daemon's file, the per-VM and per-flavor caps
/// files, and what a reload takes.
fn config_page() -> String {
    let restart: Vec<String> = pvsched_daemon::config::RESTART_ONLY
        .iter()
        .map(|k| format!("\\fB{}\\fR", k.key))
        .collect();
    format!(
        r#".TH pvschedd.toml 5 "" "pvsched {version}" "File Formats"
.SH NAME
pvschedd.toml \- configuration of pvschedd, and the caps files of its VMs
.SH SYNOPSIS
.B /etc/pvsched/pvschedd.toml
.br
.BI /etc/pvsched/vms/ NAME .toml
.br
.BI /etc/pvsched/flavors/ FLAVOR .toml
.SH DESCRIPTION
All three are TOML. Every key is optional and has the default shown
below; a key the program does not know, or a value out of its range, is an
error that names it (pvschedd exits with code 7 at start).
.PP
\fBpvschedd \-\-check \-\-config\fR \fIFILE\fR checks the daemon's file,
every file of its \fBvm_dir\fR and of the flavor directory, without
starting. \fBsystemctl reload pvschedd\fR (SIGHUP) reads all three again:
if any is refused the running configuration stays and the journal says
why; otherwise it is taken, except for these keys, which take a restart
(\fBsystemctl restart pvschedd\fR; detached VMs, those of libvirt and
\fBpvsched qemu\-attach\fR, are registered again): {restart}.
.SH PVSCHEDD.TOML
The daemon's file as the package installs it, every key at its default.
The \fB[max]\fR section is the operator maximum: a VM's caps above it, from
wherever they come, are refused.
.PP
.nf
{daemon}.fi
.SH CAPS FILES
A VM's caps come from the first of: \fIvm_dir\fR\fB/\fR\fINAME\fR\fB.toml\fR;
the caps its VMM sends (for libvirt domains, the \fB<pvsched:vm>\fR
metadata); for a domain Nova started, the flavor's file in
\fB/etc/pvsched/flavors\fR; the \fB[defaults]\fR of pvschedd.toml.
\fBpvsched vm set\fR changes a running VM's caps until it unregisters.
A VM file may also name who may register the VM:
\fBowner_uids = [64055]\fR and \fBowner_cgroups = ["/machine.slice/..."]\fR.
Every cap, at its default (\fB/usr/share/doc/pvsched/caps.example.toml\fR):
.PP
.nf
{caps}.fi
.SH SEE ALSO
.BR pvschedd (8),
.BR pvsched (1),
.BR pvsched\-qemu\-attach (1),
/usr/share/doc/pvsched/operating.md ("Configure", "The caps").
"#,
        version = pvsched_daemon::proto::VERSION,
        restart = restart.join(", "),
        daemon = roff_literal(include_str!("../../../dist/pvschedd.toml")),
        caps = roff_literal(include_str!("../../../bpf-policy/caps.example.toml")),
    )
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

    /// A file's lines stay text in the page: a leading `.` or `'` is
    /// escaped, and so is every backslash.
    #[test]
    fn literal_lines_are_never_requests() {
        assert_eq!(
            roff_literal(".x = 1\n'y\na\\b\nkey = 2"),
            "\\&.x = 1\n\\&'y\na\\eb\nkey = 2\n"
        );
    }

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
        let config = page("pvschedd.toml.5");
        assert!(config.contains(".TH pvschedd.toml 5"), "{config}");
        // The daemon's keys, the caps and the restart-only list are there.
        for key in [
            "applier_rt_prio",
            "max_cosched_phase_us",
            "halt_boost",
            "cosched_period_us",
        ] {
            assert!(config.contains(key), "{key} not in pvschedd.toml(5)");
        }
        for k in &pvsched_daemon::config::RESTART_ONLY {
            assert!(config.contains(&format!("\\fB{}\\fR", k.key)), "{}", k.key);
        }
        // No line of the files is taken as a request.
        assert!(
            !config
                .lines()
                .any(|l| l.starts_with(".toml") || l.starts_with("#."))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
