"""The host Debian package, built by scripts/package and installed for real.

`scripts/package` builds pvsched_VERSION_amd64.deb twice into two
directories: both must be byte-identical (the packaging adds nothing that
changes from one build to the next). The package is then installed with
`apt install ./pvsched_*.deb` into a clean Debian bookworm root (the
minbase + systemd chroot of scripts/setup.d/43-systemd-container.sh, under
an overlay so the cached chroot is never written): every file where Debian
expects it, the unit enabled, its paths the package's, the kvm group made.
That root is then booted with systemd-nspawn: the enabled unit must bring
pvschedd up (BPF loaded, socket answering `pvsched status`), and `apt
purge` must stop it and leave none of its files or symlinks behind.
"""

import hashlib
import os
import shutil
from pathlib import Path

from pkgroot import Booted, nspawn, ok, wait


def sha256(p):
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def device_unit(c):
    """The device's template unit as `pvsched attach` starts it (its
    arguments in /run/pvsched/device/NAME.env, the instance escaped as
    systemd-escape does): the device listens on its socket, owned by the
    user named (QEMU's; 64055 is Debian's libvirt-qemu), after reserving
    the VM's region with pvschedd; stopping the unit ends it."""
    name, unit = "web-1", "pvsched-device@web\\x2d1.service"
    sock = f"/run/pvsched/device/{name}.sock"
    args = (f"--transport vfio-user --socket {sock} --vcpus 2 --apic-ids 0,1 "
            f"--daemon-region {name} --socket-owner 64055:64055")
    r = c.run("sh", "-c", f"mkdir -p /run/pvsched/device && echo 'PVSCHED_DEVICE_ARGS={args}' "
              f"> /run/pvsched/device/{name}.env && systemctl start '{unit}'")
    assert r.returncode == 0, f"systemctl start {unit}: {r.stdout}{r.stderr}"
    try:
        wait(f"{unit} listening", lambda: c.run("test", "-S", sock).returncode == 0)
        owner = c.run("stat", "-c", "%u:%g %a", sock).stdout.strip()
        assert owner == "64055:64055 600", owner
        assert c.run("systemctl", "is-active", unit).stdout.strip() == "active"
    finally:
        c.run("systemctl", "stop", unit)
    assert c.run("systemctl", "is-active", unit).stdout.strip() != "active"
    # The reservation the device made goes with `vm unregister`.
    assert c.run("pvsched", "vm", "unregister", name).returncode == 0


def test_package_builds_reproducibly_installs_enables_and_purges(repo, root_fs, package_n,
                                                                tmp_path):
    deb = package_n
    deb_b = Path(ok([str(repo / "scripts" / "package"), "--out", str(tmp_path / "b")],
                    cwd=repo).splitlines()[-1])
    assert deb.name == deb_b.name and deb.name.startswith("pvsched_")
    assert sha256(deb) == sha256(deb_b), "two builds of the package differ"

    root = root_fs
    # Not /tmp: nspawn mounts a fresh tmpfs there.
    shutil.copy(deb, root / "root" / deb.name)
    r = nspawn(root, "--chdir=/root", "apt", "install", "-y", f"./{deb.name}")
    assert r.returncode == 0, f"apt install ./{deb.name}:\n{r.stdout}\n{r.stderr}"
    status = nspawn(root, "dpkg-query", "-W", "-f=${Status} ${Version}", "pvsched").stdout
    assert status.startswith("install ok installed "), status

    # Files where Debian expects them, with their modes.
    expect = {
        "usr/bin/pvsched": 0o755,
        "usr/sbin/pvschedd": 0o755,
        "etc/pvsched/pvschedd.toml": 0o644,
        "etc/pvsched/vms": 0o755,
        "etc/pvsched/flavors": 0o755,
        "lib/systemd/system/pvschedd.service": 0o644,
        "lib/systemd/system/pvsched-device@.service": 0o644,
        "usr/lib/tmpfiles.d/pvsched.conf": 0o644,
        "usr/lib/sysusers.d/pvsched.conf": 0o644,
        "etc/libvirt/hooks/qemu.d/pvsched": 0o755,
        "etc/pvsched/libvirt-hook.conf": 0o644,
        "usr/share/man/man8/pvschedd.8.gz": 0o644,
        "usr/share/man/man5/pvschedd.toml.5.gz": 0o644,
        "usr/share/man/man1/pvsched.1.gz": 0o644,
        "usr/share/man/man1/pvsched-run.1.gz": 0o644,
        "usr/share/man/man1/pvsched-qemu-attach.1.gz": 0o644,
        "usr/share/man/man1/pvsched-attach.1.gz": 0o644,
        "usr/share/man/man1/pvsched-detach.1.gz": 0o644,
        "usr/share/doc/pvsched/copyright": 0o644,
        "usr/share/doc/pvsched/caps.example.toml": 0o644,
        "usr/share/doc/pvsched/operating.md": 0o644,
        "usr/share/pvsched/prometheus/pvsched.rules.yml": 0o644,
    }
    for path, mode in expect.items():
        p = root / path
        assert p.exists(), f"/{path} not installed"
        assert p.stat().st_mode & 0o7777 == mode, f"/{path}: mode {oct(p.stat().st_mode)}"
    conffiles = set(nspawn(root, "cat", "/var/lib/dpkg/info/pvsched.conffiles").stdout.split())
    assert {"/etc/pvsched/pvschedd.toml", "/etc/pvsched/libvirt-hook.conf",
            "/etc/libvirt/hooks/qemu.d/pvsched"} <= conffiles

    # The unit names the package's paths and is enabled; its group exists.
    unit = (root / "lib/systemd/system/pvschedd.service").read_text()
    assert "ExecStart=/usr/sbin/pvschedd --config /etc/pvsched/pvschedd.toml" in unit
    assert "/usr/local" not in unit
    wants = root / "etc/systemd/system/multi-user.target.wants/pvschedd.service"
    assert wants.is_symlink() and os.readlink(wants) == "/lib/systemd/system/pvschedd.service"
    assert any(l.startswith("kvm:") for l in (root / "etc/group").read_text().splitlines())
    for args in (["pvschedd", "--version"], ["pvsched", "--version"],
                 ["pvschedd", "--check", "--config", "/etc/pvsched/pvschedd.toml"],
                 ["systemd-analyze", "verify", "/lib/systemd/system/pvschedd.service"],
                 ["systemd-analyze", "verify", "/lib/systemd/system/pvsched-device@.service"]):
        r = nspawn(root, *args)
        assert r.returncode == 0, f"{args}: {r.stdout}{r.stderr}"

    # Booted: the enabled unit brings pvschedd up, and its socket answers.
    with open(tmp_path / "console.log", "w") as log:
        c = Booted(root, log)
        try:
            wait("pvschedd active", lambda: c.run("systemctl", "is-active", "pvschedd")
                 .stdout.strip() == "active")
            st = c.run("pvsched", "status")
            assert st.returncode == 0, f"pvsched status: {st.stdout}{st.stderr}"
            assert c.run("test", "-S", "/run/pvsched/pvschedd.sock").returncode == 0
            device_unit(c)

            r = c.run("env", "DEBIAN_FRONTEND=noninteractive", "apt", "purge", "-y", "pvsched")
            assert r.returncode == 0, f"apt purge:\n{r.stdout}\n{r.stderr}"
            assert c.run("systemctl", "is-active", "pvschedd").stdout.strip() != "active"
            assert c.run("pgrep", "-x", "pvschedd").returncode == 1, "pvschedd still running"
        finally:
            c.stop()
    for path in ("usr/sbin/pvschedd", "usr/bin/pvsched", "etc/pvsched",
                 "lib/systemd/system/pvschedd.service", "etc/libvirt/hooks/qemu.d/pvsched"):
        assert not (root / path).exists(), f"/{path} left after apt purge"
    assert not os.path.lexists(wants), "the unit's enable symlink left after apt purge"
