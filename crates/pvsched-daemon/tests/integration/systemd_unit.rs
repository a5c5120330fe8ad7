//! dist/systemd/pvschedd.service passes `systemd-analyze verify` (with
//! ExecStart pointing at the pvschedd just built), and its ExecStartPre
//! check accepts the shipped configuration.

use std::process::Command;

#[test]
fn the_unit_verifies_and_the_shipped_config_checks() {
    let unit = include_str!("../../../../dist/systemd/pvschedd.service");
    let exe = env!("CARGO_BIN_EXE_pvschedd");
    let o = Command::new(exe)
        .args(["--check", "--config"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../dist/pvschedd.toml"
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let Ok(v) = Command::new("systemd-analyze").arg("--version").output() else {
        pvsched_testkit::skip_or_fail(
            "the_unit_verifies_and_the_shipped_config_checks",
            "systemd-analyze missing (apt install systemd)",
        );
        return;
    };
    assert!(v.status.success());
    let dir = std::env::temp_dir().join(format!("pvschedd-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pvschedd.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/pvschedd", exe)).unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success() && out.trim().is_empty(), "{out}");
}
