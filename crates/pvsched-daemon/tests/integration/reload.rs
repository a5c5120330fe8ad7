//! Reload: SIGHUP (the unit's `systemctl reload`) has pvschedd read its
//! configuration file, its VM files and the flavor files again and take
//! all of it, or none of it, while the VMs it serves stay registered; and
//! `--check` validates the same three.

use crate::common::{need_bpf, wait_for};
use crate::support::{self, Daemon, LIMIT};
use pvsched_daemon::proto::Region;
use pvsched_daemon::{ClientError, ErrorKind, RegisterVm};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

fn hup(d: &Daemon) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.pid() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
}

/// Asks for VM `vm`'s `max_rt_prio` = `prio`: Ok, or the refusal's kind.
fn set_prio(d: &Daemon, prio: u32) -> Result<(), ErrorKind> {
    let settings = BTreeMap::from([("max_rt_prio".to_string(), prio.to_string())]);
    match d.client().set("vm", settings) {
        Ok(_) => Ok(()),
        Err(ClientError::Refused { kind, .. }) => Err(kind),
        Err(e) => panic!("set max_rt_prio={prio}: {e}"),
    }
}

/// (reloads taken, reloads refused) as pvschedd's status says.
fn reloads(d: &Daemon) -> (u64, u64) {
    let (s, _) = d.client().status().unwrap();
    (s.reloads, s.reload_errors)
}

/// The test's configuration file with `[max] max_rt_prio = prio` and
/// `extra` after it.
fn rewrite(d: &Daemon, prio: u32, extra: &str) {
    let path = d.dir.join("pvschedd.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let head = text.split("[max]").next().unwrap().to_string();
    std::fs::write(&path, format!("{head}[max]\nmax_rt_prio = {prio}\n{extra}")).unwrap();
}

/// `pvschedd --check` of the test's files: (exit code, stderr).
fn check(d: &Daemon, flavors: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pvschedd"))
        .arg("--check")
        .arg("--config")
        .arg(d.dir.join("pvschedd.toml"))
        .arg("--flavor-dir")
        .arg(flavors)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn sighup_takes_good_files_whole_and_keeps_the_running_ones_on_a_bad_one() {
    const TEST: &str = "sighup_takes_good_files_whole_and_keeps_the_running_ones_on_a_bad_one";
    if !need_bpf(TEST) {
        return;
    }
    let d = Daemon::start("reload", "[max]\nmax_rt_prio = 4\n");
    let flavors = d.dir.join("flavors");
    std::fs::create_dir_all(&flavors).unwrap();
    let threads = support::baseline_threads();
    let mut owner = d.client();
    owner
        .register(RegisterVm {
            name: "vm".into(),
            vcpus: support::vcpus(threads.iter().map(|t| t.0)),
            emulator_tids: vec![],
            region: Region::None,
            caps: None,
            pid: None,
            detach: false,
        })
        .unwrap();
    assert_eq!(
        set_prio(&d, 5),
        Err(ErrorKind::Caps),
        "above the first [max]"
    );
    assert_eq!(reloads(&d), (0, 0));

    // A good file: taken, the VM still registered.
    rewrite(&d, 6, "");
    assert_eq!(check(&d, &flavors).0, 0);
    hup(&d);
    wait_for("the reload", LIMIT, || {
        (reloads(&d) == (1, 0)).then_some(())
    });
    assert_eq!(set_prio(&d, 5), Ok(()), "within the reloaded [max]");
    assert_eq!(set_prio(&d, 7), Err(ErrorKind::Caps));

    // Not TOML: refused; the running [max] (6) stays.
    rewrite(&d, 9, "[max\n");
    assert_eq!(check(&d, &flavors).0, 7, "--check refuses it too");
    hup(&d);
    wait_for("the refused reload", LIMIT, || {
        (reloads(&d) == (1, 1)).then_some(())
    });
    assert_eq!(
        set_prio(&d, 7),
        Err(ErrorKind::Caps),
        "the bad file's 9 not taken"
    );
    assert_eq!(set_prio(&d, 6), Ok(()));

    // A good main file beside a VM file above its [max]: refused whole,
    // the main file's 8 not taken either.
    rewrite(&d, 8, "");
    std::fs::write(d.dir.join("vms").join("other.toml"), "max_rt_prio = 9\n").unwrap();
    let (code, err) = check(&d, &flavors);
    assert_eq!(code, 7, "{err}");
    assert!(err.contains("other.toml"), "--check names the file: {err}");
    hup(&d);
    wait_for("the second refused reload", LIMIT, || {
        (reloads(&d) == (1, 2)).then_some(())
    });
    assert_eq!(set_prio(&d, 7), Err(ErrorKind::Caps));

    // A flavor file above [max] is named by --check as well.
    std::fs::remove_file(d.dir.join("vms").join("other.toml")).unwrap();
    std::fs::write(flavors.join("m1.big.toml"), "max_rt_prio = 12\n").unwrap();
    let (code, err) = check(&d, &flavors);
    assert_eq!(code, 7, "{err}");
    assert!(err.contains("m1.big.toml"), "{err}");
    std::fs::remove_file(flavors.join("m1.big.toml")).unwrap();

    // All good again: taken, and the VM was served throughout.
    hup(&d);
    wait_for("the last reload", LIMIT, || {
        (reloads(&d) == (2, 2)).then_some(())
    });
    assert_eq!(set_prio(&d, 7), Ok(()));
    let (_, vms) = d.client().status().unwrap();
    assert_eq!(
        vms.len(),
        1,
        "the VM stayed registered through every reload"
    );
    drop(owner);
}
