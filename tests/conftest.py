"""pvsched's cross-component tests: real Debian Linux guests under QEMU with
the real guest driver, the device process and the host policy
(tests/linux-guest). Run as root after scripts/setup, with Debian's pytest
(python3-pytest, which scripts/setup installs):

    /usr/bin/python3 -B -m pytest tests [-v] [--cycles N] [--kernel NAME] ...

scripts/test runs it (with -v, under `timeout`) after the Rust tests. A
capability a test needs (a tool, the guest kernel, QEMU 11, root) that is
missing skips it with the reason, or fails it with PVSCHED_REQUIRE_REAL=1
(CI), as pvsched-testkit's skip_or_fail does for the Rust tests.
"""

import os
import shutil
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
from pvsched_guest.host import run  # noqa: E402


def pytest_addoption(parser):
    # Every option is here: pytest takes options only from the conftest.py
    # files it loads before collecting, and this one is always among them.
    g = parser.getgroup("pvsched", "pvsched cross-component tests")
    g.addoption("--cache", type=Path, default=None,
                help="what scripts/setup fetched (default: $PVSCHED_CACHE, else .cache)")
    g.addoption("--out", type=Path, default=None,
                help="boot directories (serial, device and agent logs, dumps); default: "
                     "CACHE/linux-guest/run")
    g.addoption("--cycles", type=int, default=20, help="module load/unload cycles per main boot")
    g.addoption("--rounds", type=int, default=3000, help="pipe round trips per hook-cost run")
    g.addoption("--churn", type=int, default=60000,
                help="pipe round trips of the device-region no-message check")
    g.addoption("--boot-timeout", type=int, default=240, help="seconds per boot")
    g.addoption("--kernel", action="append", default=None, metavar="NAME",
                help="boot this kernel of tests/linux-guest/kernels.conf in the matrix tests "
                     "(repeatable; default: its CI kernels, all of them with "
                     "PVSCHED_GUEST_MATRIX=all)")
    g.addoption("--kernel-log", action="store_true", help="boot without 'quiet'")
    g.addoption("--serial", action="store_true",
                help="print every guest console line (with -s to see them as they come)")


def pytest_configure(config):
    # SIGTERM (from `timeout`) unwinds like Ctrl-C: `finally` blocks and
    # fixture finalizers stop every QEMU, device, agent and pvschedd, and
    # the session ends instead of going on with the next test.
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@pytest.fixture(scope="session")
def need_real():
    """need_real(what, why): a capability the test needs is missing. With
    PVSCHED_REQUIRE_REAL=1 (CI) that fails the test; otherwise it is skipped
    with the reason."""
    def need(what, why):
        if os.environ.get("PVSCHED_REQUIRE_REAL", "0") == "1":
            pytest.fail(f"{what} is required (PVSCHED_REQUIRE_REAL=1): {why}", pytrace=False)
        pytest.skip(f"{what} unavailable: {why}")
    return need


@pytest.fixture(scope="session")
def repo():
    return REPO


@pytest.fixture(scope="session")
def cache(pytestconfig):
    c = pytestconfig.getoption("cache") or Path(os.environ.get("PVSCHED_CACHE") or REPO / ".cache")
    return c.resolve()


@pytest.fixture(scope="session")
def release_bins(need_real):
    """The release binaries the guests need, built once per session as
    `cargo build --locked --release` (incremental) into $CARGO_TARGET_DIR,
    else target/: pvsched-device, pvsched-agent-attach, pvsched, pvschedd."""
    cargo = shutil.which("cargo") or shutil.which("cargo", path=Path.home() / ".cargo" / "bin")
    if cargo is None:
        need_real("cargo", "install Rust with rustup (scripts/setup says how)")
    run([cargo, "build", "--locked", "--release",
         "-p", "pvsched-transport", "--bin", "pvsched-device",
         "-p", "pvsched-agent", "--bin", "pvsched-agent-attach",
         "-p", "pvsched", "--bin", "pvsched", "-p", "pvsched-daemon", "--bin", "pvschedd"], cwd=REPO)
    release = REPO / os.environ.get("CARGO_TARGET_DIR", "target") / "release"
    return SimpleNamespace(device=release / "pvsched-device", agent=release / "pvsched-agent-attach",
                           pvsched=release / "pvsched", pvschedd=release / "pvschedd")


@pytest.fixture(scope="session")
def next_tree(repo, tmp_path_factory, need_real):
    """A copy of this tree (without .git, target, .cache) at the next
    patch version, made by `scripts/version bump`: what the upgrade tests
    build release N+1 from. .version is N+1, .current is N."""
    if shutil.which("cargo") is None and not (Path.home() / ".cargo" / "bin" / "cargo").exists():
        need_real("cargo", "install Rust with rustup (scripts/setup says how)")
    current = run([str(repo / "scripts" / "version")], cwd=repo).strip()
    major, minor, patch = (int(x) for x in current.split("."))
    version = f"{major}.{minor}.{patch + 1}"
    tree = tmp_path_factory.mktemp("next") / "pvsched"
    shutil.copytree(repo, tree, symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == repo and n in
                                             (".git", "target", ".cache")])
    env = {**os.environ, "PATH": f"{Path.home() / '.cargo' / 'bin'}:{os.environ['PATH']}"}
    run([str(tree / "scripts" / "version"), "bump", version], cwd=tree, env=env)
    run([str(tree / "scripts" / "version"), "check"], cwd=tree, env=env)
    return SimpleNamespace(path=tree, version=version, current=current)
