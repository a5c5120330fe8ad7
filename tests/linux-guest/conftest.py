"""Fixtures of the Linux-guest tests: the guests (kernel, module, initramfs,
built once per session), the guest-matrix chroots with DKMS, the
capabilities the scenarios need, and `report`, whose result lines are
printed after the tests in a "linux-guest results" section."""

import json
import lzma
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from pvsched_guest import abi
from pvsched_guest.host import Failure, run
from pvsched_guest.kernel import (build_initramfs, build_module, guest_kabi, kernel_tree,
                                  matrix_kernel, modprobe_files, suite_of)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = pytest.StashKey[list]()


def pytest_configure(config):
    config.stash[RESULTS] = []


@pytest.fixture(scope="session")
def report(pytestconfig):
    """report(line): a result of a test (a boot's time, what it measured).
    Printed in the test's output and again after all tests."""
    lines = pytestconfig.stash[RESULTS]

    def add(line):
        line = f"linux-guest: {line}"
        print(line, flush=True)
        lines.append(line)
    return add


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(RESULTS, [])
    if lines:
        terminalreporter.write_sep("=", "linux-guest results")
        for line in lines:
            terminalreporter.line(line)


def matrix_kernels(config):
    """[(NAME, SUITE chroot)] of kernels.conf this run covers: --kernel's,
    else the CI ones, or all with PVSCHED_GUEST_MATRIX=all (the ones
    scripts/setup fetched: scripts/lib.sh, pvsched_matrix_kernels)."""
    rows = [line.split() for line in (HERE / "kernels.conf").read_text().splitlines()
            if not line.startswith("#")]
    rows = [r for r in rows if len(r) == 4]
    names = config.getoption("kernel")
    if names:
        unknown = set(names) - {r[0] for r in rows}
        if unknown:
            raise pytest.UsageError(f"--kernel {', '.join(sorted(unknown))}: not in kernels.conf")
        rows = [r for r in rows if r[0] in names]
    elif os.environ.get("PVSCHED_GUEST_MATRIX") != "all":
        rows = [r for r in rows if r[3] == "yes"]
    # A backports kernel is built in its suite's chroot (scripts/setup.d/42-guest-matrix.sh).
    return [(name, suite.removesuffix("-backports")) for name, suite, _, _ in rows]


def pytest_generate_tests(metafunc):
    if not {"kernel", "suite"} & set(metafunc.fixturenames):
        return
    kernels = matrix_kernels(metafunc.config)
    if "kernel" in metafunc.fixturenames:
        metafunc.parametrize("kernel", [name for name, _ in kernels])
    if "suite" in metafunc.fixturenames:
        metafunc.parametrize("suite", sorted({suite for _, suite in kernels}))


@pytest.fixture(scope="session")
def root(need_real):
    """Root: the policy loads BPF and changes QEMU's threads' scheduling;
    DKMS runs in chroots."""
    if os.geteuid() != 0:
        need_real("root", "BPF, RT priorities and chroots need root (run as root)")


@pytest.fixture(scope="session")
def qemu11(cache, need_real):
    """QEMU >= 10.1 for the vfio-user boots (scripts/setup.d/41-qemu11.sh)."""
    q = cache / "qemu11" / "qemu-system-x86_64"
    if not q.exists():
        need_real("QEMU >= 10.1", f"not in {q.parent} (run scripts/setup)")
    return q


@pytest.fixture(scope="session")
def guest_base(pytestconfig, cache, release_bins, need_real):
    """What every boot reads (pvsched_guest.boot.Boot's `args`) but the
    kernel and its initramfs: the binaries, the options, --out."""
    for tool in ("qemu-system-x86_64", "busybox", "cpio", "gcc", "make", "readelf"):
        if shutil.which(tool) is None:
            need_real(tool, "install it with scripts/setup (scripts/setup.d/40-linux-guest.sh)")
    opt = pytestconfig.getoption
    out = (opt("out") or cache / "linux-guest" / "run").resolve()
    return SimpleNamespace(
        device_bin=release_bins.device, agent_bin=release_bins.agent,
        pvsched_bin=release_bins.pvsched, pvschedd_bin=release_bins.pvschedd,
        qemu11=cache / "qemu11" / "qemu-system-x86_64", out=out, timeout=opt("boot_timeout"),
        kernel_log=opt("kernel_log"), verbose=opt("serial"), cycles=opt("cycles"),
        rounds=opt("rounds"), churn=opt("churn"), tag="", load_append="")


@pytest.fixture(scope="session")
def guest(guest_base, cache, report, need_real):
    """The Debian 6.1 cloud guest with the module built on the host: built
    against the cloud headers and build-tested against the PREEMPT_RT ones
    (no warning allowed, the ABI's IDs its only alias), in an initramfs
    with a static helper and /init (pvsched_guest/initramfs/init.sh); the
    guest loads it with insmod."""
    kabi = guest_kabi(cache)
    if not (cache / "linux-guest" / "root" / "boot" / f"vmlinuz-{kabi}-cloud-amd64").exists():
        need_real("Debian guest kernel", f"not in {cache}/linux-guest (run scripts/setup)")
    vmlinuz, trees = kernel_tree(cache, kabi)
    out = guest_base.out
    ko, secs = build_module(REPO, trees["cloud"], out / "build-cloud")
    report(f"module built against {kabi}-cloud-amd64 in {secs:.1f}s")
    _, secs = build_module(REPO, trees["rt"], out / "build-rt")
    report(f"module build-tested against {kabi}-rt-amd64 (PREEMPT_RT) in {secs:.1f}s")
    initrd = build_initramfs(ko, out)
    return SimpleNamespace(**{**vars(guest_base), "vmlinuz": vmlinuz, "initrd": initrd})


def in_chroot(chroot, *cmd, check=True):
    """Runs `cmd` in the Debian chroot with /proc and /dev mounted in a
    private mount namespace and a clean environment (scripts/lib.sh,
    pvsched_in_chroot, which scripts/setup uses too); its CompletedProcess
    (text stdout and stderr). With `check`, Failure with both if it fails."""
    argv = ["bash", "-c", '. "$0" && pvsched_in_chroot "$@"', str(REPO / "scripts" / "lib.sh"),
            str(chroot), *map(str, cmd)]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise Failure(f"in {chroot}: {' '.join(map(str, cmd))} failed ({r.returncode}):\n"
                      f"{r.stdout}{r.stderr}")
    return r


def once(method):
    """Memoizes `method(self, *args)` per args, failures too: a package
    that did not build or install is not tried again by every test that
    needs it."""
    def wrapper(self, *key):
        memo = self.memo.setdefault(method.__name__, {})
        if key not in memo:
            try:
                memo[key] = (True, method(self, *key))
            except Exception as e:
                memo[key] = (False, e)
        ok, value = memo[key]
        if not ok:
            raise value
        return value
    return wrapper


class Matrix:
    """The guest-matrix chroots scripts/setup.d/42-guest-matrix.sh prepared
    (a minimal Debian of each suite with its kernels installed, image and
    headers, as on a guest image), cleaned of every pvsched package, DKMS
    tree and module an earlier run left, with the driver's source in
    /tmp/pvsched-src."""

    def __init__(self, cache, base, report, kernels):
        self.cache, self.base, self.report = cache, base, report
        self.kernels = [name for name, _ in kernels]
        self.memo = {}
        self.version = next(l.split('"')[1] for l in (REPO / "guest-driver" / "dkms.conf")
                            .read_text().splitlines() if l.startswith("PACKAGE_VERSION="))
        # The ABI the driver speaks (its `modinfo` abi field).
        self.abi = f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"
        # The module alias udev loads the driver by: the ABI's IDs (a
        # vendor's own are added through new_id at run time,
        # docs/guest-driver.md).
        self.alias = f"pci:v{abi.PCI_VENDOR_ID:08X}d{abi.PCI_DEVICE_ID:08X}sv*sd*bc*sc*i*"
        self.deb_path = cache / "guest-matrix" / "deb" / f"pvsched-dkms_{self.version}_all.deb"
        self.releases = {}
        for name, _ in kernels:
            release, chroot, _ = matrix_kernel(cache, name)
            self.releases.setdefault(suite_of(chroot), []).append(release)
        if self.deb_path.exists():
            self.deb_path.unlink()
        for suite, rels in self.releases.items():
            ch = self.chroot(suite)
            v = self.version
            in_chroot(ch, "sh", "-c", "; ".join([
                "apt-get purge -y -qq pvsched-dkms >/dev/null 2>&1",
                f"dkms remove -m pvsched -v {v} --all >/dev/null 2>&1",
                "rm -rf /usr/src/pvsched-* /var/lib/dkms/pvsched /tmp/pvsched-src /tmp/pvsched-deb "
                "/tmp/pvsched-next-src /tmp/pvsched-next-src-deb",
                f"for r in {' '.join(rels)}; do rm -f /lib/modules/$r/updates/dkms/pvsched.ko*; done",
                "true"]))
            src = ch / "tmp" / "pvsched-src"
            shutil.copytree(REPO / "guest-driver", src / "guest-driver",
                            ignore=shutil.ignore_patterns("deb"))
            shutil.copytree(REPO / "include", src / "include")

    def chroot(self, suite):
        if suite not in self.releases:
            raise Failure(f"no kernel of this run is built in the {suite} chroot")
        return self.cache / "guest-matrix" / f"chroot-{suite}"

    def run(self, suite, *cmd, check=True):
        return in_chroot(self.chroot(suite), *cmd, check=check)

    def dkms(self, suite, verb, *args, check=True):
        return self.run(suite, "dkms", verb, "-m", "pvsched", "-v", self.version, *args, check=check)

    @once
    def deb_suite(self):
        """The first chroot with dh-dkms (bookworm's dkms has no
        dh-sequence-dkms), where the .debs are built; the same .deb goes to
        every suite."""
        suite = next((s for s in sorted(self.releases)
                      if self.run(s, "dpkg", "-s", "dh-dkms", check=False).returncode == 0), None)
        if suite is None:
            raise Failure(f"no chroot of {', '.join(sorted(self.releases))} has dh-dkms to build the "
                          f".deb (scripts/setup installs it in trixie's)")
        return suite

    def build_deb(self, src, version):
        """pvsched-dkms_VERSION_all.deb by `make deb` (dpkg-buildpackage,
        dh-dkms) of the driver source at SRC/guest-driver in the
        deb_suite chroot, copied to CACHE/guest-matrix/deb."""
        suite = self.deb_suite()
        out = f"{src}-deb"
        r = self.run(suite, "make", "-s", "-C", f"{src}/guest-driver", "deb", f"DEB_OUT={out}",
                     check=False)
        name = f"pvsched-dkms_{version}_all.deb"
        if r.returncode != 0:
            raise Failure(f"building {name} in the {suite} chroot failed:\n{r.stdout}{r.stderr}")
        path = self.cache / "guest-matrix" / "deb" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.chroot(suite) / out.lstrip("/") / name, path)
        info = [l.strip() for l in run(["dpkg-deb", "--info", str(path)]).splitlines()
                if l.startswith((" Package:", " Version:", " Depends:"))]
        self.report(f"{name} built in the {suite} chroot: {'; '.join(info)}")
        return path

    @once
    def deb(self):
        """This tree's pvsched-dkms_VERSION_all.deb, built once."""
        return self.build_deb("/tmp/pvsched-src", self.version)

    @once
    def next_deb(self, tree, version):
        """pvsched-dkms_N+1_all.deb of the next-version copy of this tree
        (tests/conftest.py, next_tree) at path `tree`."""
        src = self.chroot(self.deb_suite()) / "tmp" / "pvsched-next-src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(Path(tree) / "guest-driver", src / "guest-driver",
                        ignore=shutil.ignore_patterns("deb"))
        shutil.copytree(Path(tree) / "include", src / "include")
        return self.build_deb("/tmp/pvsched-next-src", version)

    def apt_install(self, suite, deb, *opts):
        """`apt-get install OPTS ./DEB` in the suite's chroot; `dkms status`
        of pvsched (every version) for each kernel there after it."""
        shutil.copy(deb, self.chroot(suite) / "tmp" / deb.name)
        apt = self.run(suite, "apt-get", "install", "-y", "-qq", *opts, f"/tmp/{deb.name}")
        print("\n".join(l for l in (apt.stdout + apt.stderr).splitlines()
                        if not l.startswith("(Reading database")))
        return {r: self.run(suite, "dkms", "status", "-m", "pvsched", "-k", r).stdout.strip()
                for r in self.releases[suite]}

    @once
    def install(self, suite):
        """`apt install ./pvsched-dkms_VERSION_all.deb` in the suite's
        chroot: its postinst builds and installs the module with DKMS for
        each kernel there. `dkms status` of each kernel's module after it."""
        return self.apt_install(suite, self.deb())

    @once
    def guest(self, name):
        """Kernel NAME's guest: the initramfs packs the chroot's
        /lib/modules/RELEASE (the module DKMS installed and depmod's
        indexes) and kmod with its libraries; the guest loads the module
        with modprobe."""
        release, chroot, vmlinuz = matrix_kernel(self.cache, name)
        self.install(suite_of(chroot))
        out = self.base.out / name
        out.mkdir(parents=True, exist_ok=True)
        initrd = build_initramfs(None, out, extra_files=modprobe_files(chroot, release))
        self.report(f"kernel {name}: {release}, the module DKMS installed in {chroot}, "
                    f"loaded with modprobe")
        return SimpleNamespace(**{**vars(self.base), "vmlinuz": vmlinuz, "initrd": initrd,
                                  "out": out, "tag": f"@{name}", "load_append": "pvload=modprobe"})

    @once
    def upgraded(self, suite, tree, version):
        """The suite's chroot upgraded from this tree's package (N) to
        `version` (N+1) with `apt-get install` (the prerm of N removes it
        from DKMS, the postinst of N+1 builds and installs N+1). Returns
        `dkms status` of each kernel after it, and release N's module of
        each kernel as DKMS had built it (uncompressed, for busybox's
        insmod; DKMS xz-compresses it where the kernel's own modules are)."""
        self.install(suite)
        prev = {}
        for r in self.releases[suite]:
            mdir = self.chroot(suite) / "lib" / "modules" / r / "updates" / "dkms"
            ko = sorted(mdir.glob("pvsched.ko*"))
            if not ko:
                raise Failure(f"no DKMS-installed pvsched {self.version} in {mdir}")
            data = ko[0].read_bytes()
            prev[r] = self.base.out / f"pvsched-{self.version}-{r}.ko"
            prev[r].parent.mkdir(parents=True, exist_ok=True)
            prev[r].write_bytes(lzma.decompress(data) if ko[0].suffix == ".xz" else data)
        return self.apt_install(suite, self.next_deb(tree, version)), prev

    @once
    def upgrade_guest(self, name, tree, version):
        """Kernel NAME's guest for the upgrade scenario: release N's module
        as /pvsched-prev.ko, and the module tree after the upgrade to N+1,
        loaded by modprobe."""
        release, chroot, vmlinuz = matrix_kernel(self.cache, name)
        _, prev = self.upgraded(suite_of(chroot), tree, version)
        out = self.base.out / f"{name}-upgrade"
        out.mkdir(parents=True, exist_ok=True)
        initrd = build_initramfs(None, out, extra_files={
            **modprobe_files(chroot, release), "/pvsched-prev.ko": prev[release]})
        return SimpleNamespace(**{**vars(self.base), "vmlinuz": vmlinuz, "initrd": initrd,
                                  "out": out, "tag": f"@{name}", "load_append": "pvload=modprobe"})


@pytest.fixture(scope="session")
def matrix(pytestconfig, cache, guest_base, report, need_real, root):
    """The Matrix of the kernels this run covers."""
    if shutil.which("unshare") is None:
        need_real("unshare", "install util-linux")
    kernels = matrix_kernels(pytestconfig)
    for name, _ in kernels:
        if not (cache / "guest-matrix" / name / "release").is_file():
            need_real(f"kernel {name}", f"not in {cache}/guest-matrix (run scripts/setup, with "
                      f"PVSCHED_GUEST_MATRIX=all for the kernels CI does not boot)")
    return Matrix(cache, guest_base, report, kernels)


@pytest.fixture
def matrix_guest(matrix, kernel):
    """The guest of the test's matrix kernel (`kernel`), its module
    installed from the .deb, its initramfs built once per session."""
    return matrix.guest(kernel)


@pytest.fixture(scope="session")
def bench_bin(release_bins, need_real):
    """pvsched-bench, built once per session as `cargo build --locked
    --release` into $CARGO_TARGET_DIR (else target/), beside the binaries
    of release_bins."""
    cargo = shutil.which("cargo") or shutil.which("cargo", path=Path.home() / ".cargo" / "bin")
    if cargo is None:
        need_real("cargo", "install Rust with rustup (scripts/setup says how)")
    run([cargo, "build", "--locked", "--release", "-p", "pvsched-bench", "--bin",
         "pvsched-bench"], cwd=REPO)
    return release_bins.device.parent / "pvsched-bench"


@pytest.fixture
def bench_report(matrix, release_bins, bench_bin, qemu11, repo, cache, tmp_path, need_real):
    """Runs `pvsched-bench SCENARIO` (s4, s6) on matrix kernel KERNEL (its
    module installed from the .deb) with this run's binaries, cache and
    QEMU 11 and the given options; asserts it exited 0 and returns its
    report (the JSON of s4::S4Report / s6::S6Report, raw rows in `raw`)."""
    def run_bench(scenario, kernel_opt, kernel, *options):
        if kernel not in matrix.kernels:
            need_real(f"kernel {kernel}", "not among this run's matrix kernels (kernels.conf)")
        matrix.guest(kernel)
        out = tmp_path / f"{scenario}.json"
        cmd = [str(bench_bin), scenario, kernel_opt, kernel, *options,
               "--json", str(out), "--raw", str(tmp_path / f"{scenario}-raw.json"),
               "--repo", str(repo), "--cache", str(cache), "--out", str(tmp_path / "work"),
               "--device-bin", str(release_bins.device), "--pvsched-bin",
               str(release_bins.pvsched), "--pvschedd-bin", str(release_bins.pvschedd),
               "--qemu11", str(qemu11)]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=900, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        print(r.stdout)
        assert r.returncode == 0, f"pvsched-bench {scenario} exited {r.returncode}"
        return json.loads(out.read_text())
    return run_bench
