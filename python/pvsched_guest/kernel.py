"""Guest kernels, the pvsched module built against them, and the initramfs
a guest boots with."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from . import abi
from .host import Failure, run

# The Debian cloud kernel's ABI the default guest runs (scripts/setup fetches it).
KABI = os.environ.get("PVSCHED_GUEST_KABI", "6.1.0-56")


def guest_kabi(cache):
    """The guest kernel's ABI: $PVSCHED_GUEST_KABI, else the one
    scripts/setup fetched (it takes a newer 6.1 when Debian no longer
    offers KABI's, and records it in CACHE/linux-guest/kabi), else KABI."""
    recorded = cache / "linux-guest" / "kabi"
    if "PVSCHED_GUEST_KABI" not in os.environ and recorded.is_file():
        return recorded.read_text().strip() or KABI
    return KABI


def kernel_tree(cache, kabi=KABI):
    root = cache / "linux-guest" / "root"
    src = root / "usr" / "src"
    vmlinuz = root / "boot" / f"vmlinuz-{kabi}-cloud-amd64"
    trees = {f: src / f"linux-headers-{kabi}-{f}-amd64" for f in ("cloud", "rt")}
    missing = [p for p in [vmlinuz, *trees.values()] if not p.exists()]
    if missing:
        raise FileNotFoundError(f"not fetched: {missing} (run scripts/setup)")
    # Debian's per-flavour Makefile includes the -common tree by absolute
    # /usr/src path; point it at the unpacked copy (idempotent).
    for tree in trees.values():
        mk = tree / "Makefile"
        text = mk.read_text()
        fixed = re.sub(r"^include .*/(linux-headers-[^/]+/Makefile)$",
                       lambda m: f"include {src}/{m.group(1)}", text, flags=re.M)
        if fixed != text:
            mk.write_text(fixed)
    return vmlinuz, trees


def build_module(repo, kdir, out):
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in ("pvsched.c", "Kbuild", "Makefile", "dkms.conf"):
        shutil.copy(repo / "guest-driver" / f, out / f)
    shutil.copy(repo / "include" / "pvsched_abi.h", out / "pvsched_abi.h")
    t0 = time.monotonic()
    text = run(["make", "-C", str(out), f"KDIR={kdir}"])
    warnings = [l for l in text.splitlines() if "warning:" in l or "error:" in l]
    if warnings:
        raise Failure("module build warnings:\n" + "\n".join(warnings))
    ko = out / "pvsched.ko"
    # The id table is the alias udev loads the module by: the ABI's IDs and
    # only those (a vendor's own IDs are added through new_id at run time).
    want = [f"pci:v{abi.PCI_VENDOR_ID:08X}d{abi.PCI_DEVICE_ID:08X}sv*sd*bc*sc*i*"]
    modinfo = shutil.which("modinfo") or "/sbin/modinfo"
    aliases = run([modinfo, "-F", "alias", str(ko)]).split()
    if aliases != want:
        raise Failure(f"{ko}: module aliases {aliases}, expected the ABI's {want}")
    return ko, time.monotonic() - t0


def matrix_kernel(cache, name):
    """(release, chroot, vmlinuz) of kernels.conf's NAME, as scripts/setup
    fetched it (scripts/setup.d/42-guest-matrix.sh)."""
    d = cache / "guest-matrix" / name
    try:
        release = (d / "release").read_text().strip()
        suite = (d / "suite").read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"kernel {name} not in {d} (run scripts/setup, with "
                                f"PVSCHED_GUEST_MATRIX=all for the on-demand kernels)")
    return release, cache / "guest-matrix" / f"chroot-{suite}", d / "vmlinuz"


def suite_of(chroot):
    """The Debian suite of a guest-matrix chroot (what matrix_kernel
    returns: CACHE/guest-matrix/chroot-SUITE)."""
    return chroot.name.removeprefix("chroot-")


def elf_needed(path):
    """DT_NEEDED of an ELF file, and its interpreter (readelf)."""
    text = run(["readelf", "-d", "-l", str(path)])
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", text)
    interp = re.search(r"Requesting program interpreter: ([^\]]+)\]", text)
    return needed, interp.group(1) if interp else None


def chroot_binary(chroot, binary, dest):
    """{initramfs path: host file} for `binary` (a path inside `chroot`) at
    `dest` with its libraries (resolved in the chroot) and loader."""
    libdirs = [chroot / "usr/lib/x86_64-linux-gnu", chroot / "lib/x86_64-linux-gnu"]
    files = {dest: chroot / binary.lstrip("/")}
    todo, seen = [chroot / binary.lstrip("/")], set()
    while todo:
        needed, interp = elf_needed(todo.pop())
        if interp:
            files[interp] = chroot / interp.lstrip("/")
        for lib in needed:
            if lib in seen:
                continue
            seen.add(lib)
            hit = next((d / lib for d in libdirs if (d / lib).exists()), None)
            if hit is None:
                raise Failure(f"{lib} (needed by {binary}) not in the chroot {chroot}")
            files[f"/usr/lib/x86_64-linux-gnu/{lib}"] = hit
            todo.append(hit)
    return files


def modprobe_files(chroot, release):
    """Initramfs files for `modprobe pvsched`: the DKMS-installed module and
    depmod's indexes from the chroot's /lib/modules/RELEASE, and kmod (as
    /usr/sbin/modprobe) with its libraries."""
    mdir = chroot / "lib" / "modules" / release
    kos = sorted(mdir.glob("updates/dkms/pvsched.ko*"))
    if not kos:
        raise Failure(f"no DKMS-installed pvsched in {mdir}/updates/dkms "
                      f"(install it: python3 -m pytest tests/linux-guest/test_guest_matrix.py "
                      f"-k test_deb_install; a test run of other kernels only removes it)")
    files = {f"/lib/modules/{release}/{p.relative_to(mdir)}": p for p in kos}
    files.update({f"/lib/modules/{release}/{p.name}": p for p in mdir.glob("modules.*")})
    files.update(chroot_binary(chroot, "/usr/bin/kmod", "/usr/sbin/modprobe"))
    return files


# The test initramfs's sources: its /init and static helper, shared by the
# Linux-guest tests and the benchmarks' guests.
INITRAMFS = Path(__file__).resolve().parent / "initramfs"


def build_initramfs(ko, out, extra_files=None):
    """The initramfs of INITRAMFS (init.sh as /init, pvsched-helper.c built
    static) with module `ko`, in `out`. `extra_files` ({path in the
    initramfs: host file}) adds files, e.g. the S4 benchmark's cyclictest
    with its shared libraries and /bench.sh. `ko` None: no /pvsched.ko (the
    guest modprobes a packed module tree)."""
    here = INITRAMFS
    root = out / "initramfs"
    if root.exists():
        shutil.rmtree(root)
    for d in ("bin", "dev", "proc", "sys", "tmp"):
        (root / d).mkdir(parents=True)
    bb = shutil.which("busybox") or "/bin/busybox"
    shutil.copy(bb, root / "bin" / "busybox")
    shutil.copy(here / "init.sh", root / "init")
    os.chmod(root / "init", 0o755)
    if ko is not None:
        shutil.copy(ko, root / "pvsched.ko")
    run(["gcc", "-O2", "-static", "-Wall", "-Wextra", "-Werror", "-o",
         str(root / "pvsched-helper"), str(here / "pvsched-helper.c")])
    for dest, src in (extra_files or {}).items():
        target = root / str(dest).lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, target)  # follows symlinks; keeps the mode bits
    img = out / "initramfs.cpio.gz"
    with open(img, "wb") as f:
        files = subprocess.run(["find", "."], cwd=root, stdout=subprocess.PIPE, check=True).stdout
        cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files,
                              stdout=subprocess.PIPE, check=True).stdout
        gz = subprocess.run(["gzip", "-1"], input=cpio, stdout=subprocess.PIPE, check=True).stdout
        f.write(gz)
    return img
