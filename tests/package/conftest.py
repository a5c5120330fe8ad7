"""Fixtures of the package tests: the clean root (pkgroot.py) and the
packages, built once per session from this tree (version N) and from a
copy of it with the next version (N+1, for the upgrade tests)."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pkgroot import ok, sh


@pytest.fixture
def root_fs(cache, need_real, tmp_path):
    """A writable overlay over the cached bookworm+systemd chroot."""
    if os.geteuid() != 0:
        need_real("root", "mounting an overlay and running systemd-nspawn need root")
    for tool in ("systemd-nspawn", "dpkg-buildpackage", "dh", "nsenter"):
        if shutil.which(tool) is None:
            need_real(tool, "run scripts/setup (systemd-container, debhelper)")
    lower = cache / "systemd-bookworm"
    if not (lower / ".pvsched-ready").exists():
        need_real("the bookworm systemd chroot", f"{lower} is missing: run scripts/setup")
    up, work, merged = tmp_path / "upper", tmp_path / "work", tmp_path / "root"
    for d in (up, work, merged):
        d.mkdir()
    ok(["mount", "-t", "overlay", "overlay", "-o",
        f"lowerdir={lower},upperdir={up},workdir={work}", str(merged)])
    try:
        yield merged
    finally:
        sh(["umount", "-l", str(merged)])


@pytest.fixture(scope="session")
def package_n(repo, tmp_path_factory):
    """pvsched_N_amd64.deb of this tree (`scripts/package`)."""
    out = tmp_path_factory.mktemp("deb-n")
    return Path(ok([str(repo / "scripts" / "package"), "--out", str(out)], cwd=repo).splitlines()[-1])


@pytest.fixture(scope="session")
def package_next(repo, next_tree, package_n, tmp_path_factory):
    """pvsched_N+1_amd64.deb: `scripts/package` in next_tree, into this
    tree's target directory (only pvsched's own crates compile again);
    then this tree's release binaries are linked back in place, so later
    tests run version N."""
    out = tmp_path_factory.mktemp("deb-next")
    target = Path(os.environ.get("CARGO_TARGET_DIR") or repo / "target").resolve()
    env = {**os.environ, "CARGO_TARGET_DIR": str(target)}
    deb = Path(ok([str(next_tree.path / "scripts" / "package"), "--out", str(out)],
                  cwd=next_tree.path, env=env).splitlines()[-1])
    # The build scripts/package starts with: the N artifacts are still in
    # the target directory (the copy's crates have other hashes), so this
    # only links them back.
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    ok([cargo, "build", "--release", "--locked", "-p", "pvsched", "--bin", "pvsched",
        "-p", "pvsched-daemon", "--bin", "pvschedd"], cwd=repo, env=env)
    v = ok([str(target / "release" / "pvschedd"), "--version"]).split()[-1]
    assert v == package_n.name.split("_")[1], f"target/release/pvschedd is {v} after the N+1 build"
    return SimpleNamespace(deb=deb, version=next_tree.version)
