"""The guest driver on the kernels guest images ship (kernels.conf: the CI
kernels in every run; all of them with PVSCHED_GUEST_MATRIX=all, which
`scripts/test --guest-matrix` sets; or those named with --kernel). For each
suite chroot that scripts/setup.d/42-guest-matrix.sh prepared (a minimal
Debian with the kernels installed, image and headers, as on a guest image):

- test_dkms: `make dkms-src`, then `dkms add`, and `dkms build` and `dkms
  install` for each kernel: its make.log must hold no warning (a compile
  error, e.g. a probe whose prototype does not match the kernel's
  tracepoint, fails `dkms build` itself), modinfo's vermagic must be the
  kernel's, its alias and depmod's modules.alias the ABI's IDs; then `dkms
  remove`.
- test_deb_install: `apt install ./pvsched-dkms_VERSION_all.deb`: its
  postinst builds and installs the module with DKMS; `dkms status` must
  say installed for each kernel. The package is built once, in the first
  chroot with dh-dkms (conftest.py, Matrix.deb).

Then each kernel boots under QEMU 7.2 TCG, -smp 2, guest region, with the
module apt and DKMS installed, loaded by `modprobe` (scenarios.py): main
(the end-to-end assertions with 20 load/unload cycles, and a load by a
vendor's modalias with the documented modprobe.d lines), wait (wait_on with
the policy in the loop) and hostile (hostile region headers).

Last, upgrade and rollback: the package of the next version (N+1, built
from a bumped copy of this tree, tests/conftest.py next_tree) installed
over N in each suite chroot, a guest running N's module reloading it as
N+1 (scenarios.upgrade), then N installed back over N+1.

pytest runs a module's tests in the order written here, which this needs:
a suite's DKMS checks add and remove the module by hand before its package
is installed. A boot installs the package itself if no test did.
"""

import shutil
import time

import pytest

import scenarios
from pvsched_guest.kernel import matrix_kernel, suite_of


def test_dkms(matrix, report, suite):
    v = matrix.version
    ch = matrix.chroot(suite)
    t0 = time.monotonic()
    matrix.run(suite, "make", "-s", "-C", "/tmp/pvsched-src/guest-driver", "dkms-src",
               f"DKMS_DIR=/usr/src/pvsched-{v}")
    matrix.dkms(suite, "add")
    try:
        for r in matrix.releases[suite]:
            built = matrix.dkms(suite, "build", "-k", r, check=False)
            # dkms 3.2 keeps the build log per kernel; 3.0 (bookworm) in build/.
            mklog = ch / f"var/lib/dkms/pvsched/{v}/{r}/x86_64/log/make.log"
            if not mklog.is_file() or mklog.stat().st_size == 0:
                mklog = ch / f"var/lib/dkms/pvsched/{v}/build/make.log"
            assert mklog.is_file() and mklog.stat().st_size, \
                f"no DKMS make.log for {r}: {built.stdout}{built.stderr}"
            lines = mklog.read_text(errors="replace").splitlines()
            if built.returncode != 0:
                # A compile error (e.g. a probe whose prototype is not its
                # tracepoint's in this kernel) fails dkms build: show it.
                shown = [l for l in lines if "error:" in l or "note:" in l][:20] or lines[-30:]
                pytest.fail(f"dkms build of pvsched for {r} failed (see {mklog}):\n" + "\n".join(shown))
            warned = [l for l in lines if "warning:" in l or "error:" in l]
            assert not warned, f"building pvsched against {r} warned (see {mklog}):\n" + "\n".join(warned)
            matrix.dkms(suite, "install", "-k", r)
            vermagic = matrix.run(suite, "modinfo", "-k", r, "-F", "vermagic", "pvsched").stdout
            assert any(l.startswith(f"{r} ") for l in vermagic.splitlines()), \
                f"modinfo -k {r} pvsched does not show vermagic {r}: {vermagic!r}"
            # The package's version and the ABI it speaks, as scripts/version
            # and include/pvsched_abi.h say.
            for field, want in (("version", v), ("abi", matrix.abi)):
                got = matrix.run(suite, "modinfo", "-k", r, "-F", field, "pvsched").stdout.strip()
                assert got == want, f"modinfo -k {r} -F {field} pvsched: {got!r}, expected {want!r}"
            alias = matrix.run(suite, "modinfo", "-k", r, "-F", "alias", "pvsched").stdout.rstrip("\n")
            indexed = (ch / "lib" / "modules" / r / "modules.alias").read_text().splitlines()
            assert alias == matrix.alias and f"alias {matrix.alias} pvsched" in indexed, \
                f"pvsched for {r}: alias '{alias}' and modules.alias, expected '{matrix.alias}'"
        print(matrix.dkms(suite, "status").stdout)
    finally:
        removed = matrix.dkms(suite, "remove", "--all", check=False)
        shutil.rmtree(ch / "usr" / "src" / f"pvsched-{v}", ignore_errors=True)
    assert removed.returncode == 0, f"dkms remove: {removed.stdout}{removed.stderr}"
    report(f"dkms-{suite}: {', '.join(matrix.releases[suite])}: dkms build without a warning, "
           f"install, vermagic, version {v}, ABI {matrix.abi} and the ABI's alias, remove; "
           f"{time.monotonic() - t0:.1f}s")


def test_deb_install(matrix, report, suite):
    status = matrix.install(suite)
    for r, line in status.items():
        if "installed" not in line:
            pytest.fail(f"after apt install, DKMS did not install pvsched for {r}; dkms status:\n"
                        f"{matrix.run(suite, 'dkms', 'status').stdout}")
    report(f"deb-{suite}: apt install ./{matrix.deb().name}: dkms status {'; '.join(status.values())}")


def test_main(matrix_guest, report):
    failures = scenarios.main(matrix_guest, report, 2)
    assert not failures, "\n".join(failures)


def test_wait(matrix_guest, report):
    failures = scenarios.wait(matrix_guest, report)
    assert not failures, "\n".join(failures)


def test_hostile(matrix_guest, report):
    failures = scenarios.hostile(matrix_guest, report)
    assert not failures, "\n".join(failures)


def test_attach(matrix_guest, report, root):
    """`pvsched attach` and `detach`, 5 times, on a running guest whose
    QEMU 11 has no pvsched device on its command line."""
    failures = scenarios.attach(matrix_guest, report)
    assert not failures, "\n".join(failures)


def test_attach_topology(matrix_guest, report, root):
    """`pvsched attach` to a QEMU whose topology gives non-contiguous APIC
    IDs (2 sockets of 3 cores, 4 present: 0, 1, 2 and 4): the device's
    table is QEMU's, and the guest finds a slot for every CPU."""
    failures = scenarios.attach(matrix_guest, report, cycles=1,
                                smp="4,sockets=2,cores=3,maxcpus=6", apic_ids=(0, 1, 2, 4))
    assert not failures, "\n".join(failures)


def test_migrate(matrix_guest, report, root):
    """`pvsched migrate`, three live migrations of a guest with the
    device between QEMU 11 processes, and one that fails midway."""
    failures = scenarios.migrate(matrix_guest, report)
    assert not failures, "\n".join(failures)


def test_deb_upgrade(matrix, report, kernel, next_tree):
    """Release N → N+1 of the DKMS package: `apt-get install` of N+1 over N
    in the kernel's suite chroot (DKMS builds N+1, N leaves), then a guest
    running N's module reloads it as N+1 and the device re-negotiates
    (scenarios.upgrade)."""
    g = matrix.upgrade_guest(kernel, str(next_tree.path), next_tree.version)
    release, chroot, _ = matrix_kernel(matrix.cache, kernel)
    suite = suite_of(chroot)
    status, _ = matrix.upgraded(suite, str(next_tree.path), next_tree.version)
    line = status[release]
    assert f"pvsched/{next_tree.version}" in line and "installed" in line, \
        f"after the upgrade, dkms status for {release}: {line!r}"
    assert f"pvsched/{next_tree.current}" not in line, f"release N left in DKMS: {line!r}"
    got = matrix.run(suite, "modinfo", "-k", release, "-F", "version", "pvsched").stdout.strip()
    assert got == next_tree.version, f"modinfo -k {release} -F version pvsched: {got!r}"
    failures = scenarios.upgrade(g, report, next_tree.current, next_tree.version)
    assert not failures, "\n".join(failures)


def test_deb_rollback(matrix, report, suite, next_tree):
    """Back from N+1 to N: `apt-get install --allow-downgrades` of N's
    package; DKMS has N again (and not N+1) for every kernel of the suite,
    which leaves the chroot as the tests above found it."""
    matrix.upgraded(suite, str(next_tree.path), next_tree.version)
    status = matrix.apt_install(suite, matrix.deb(), "--allow-downgrades")
    for r, line in status.items():
        assert f"pvsched/{next_tree.current}" in line and "installed" in line, \
            f"after the rollback, dkms status for {r}: {line!r}"
        assert f"pvsched/{next_tree.version}" not in line, f"N+1 left in DKMS: {line!r}"
        got = matrix.run(suite, "modinfo", "-k", r, "-F", "version", "pvsched").stdout.strip()
        assert got == next_tree.current, f"modinfo -k {r} -F version pvsched: {got!r}"
    report(f"deb-{suite}: {next_tree.current} -> {next_tree.version} -> {next_tree.current} with "
           f"apt-get install: dkms status {'; '.join(status.values())}")
