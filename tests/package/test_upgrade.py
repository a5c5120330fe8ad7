"""Upgrade and rollback of the host package with a VM served throughout.

Release N is this tree's package; N+1 is the same tree at the next patch
version (`scripts/version bump`, conftest.py's package_next). In a clean
bookworm root (pkgroot.py) with N installed, booted with systemd-nspawn
and /dev/kvm: a real QEMU (Debian's 7.2, KVM, 2 vCPUs, SeaBIOS halting
without a boot device) is registered with pvschedd by `pvsched
qemu-attach`, detached, with a caps file that holds every halted vCPU at
SCHED_FIFO (`halt_always`, `halt_boost = "rt"`), so its threads are
boosted most of the time and a thread left boosted would be seen. Then
`apt install ./pvsched_N+1.deb` (dpkg restarts the unit), and back with
`apt install --allow-downgrades ./pvsched_N.deb`.

A sampler reads every QEMU thread's policy and nice value from the host
every few milliseconds and, before and after, whether any pvschedd process
(the daemon, its guardian, the unit's `--restore`) exists in the
container. Must hold:
- no sample taken with no pvschedd before and after it shows a QEMU thread
  off its baseline (SCHED_OTHER, nice 0): nothing is left boosted at any
  point of either package change;
- after each change the daemon reports the new version, the VM is
  registered again with its file's caps, and its threads are boosted
  again (samples show SCHED_FIFO: the check above is not vacuous);
- `pvsched doctor` on this root says what it finds (printed), and exits
  1 only for what blocks (nothing here: pvschedd and BPF work);
- with the unit's watchdog at 2 s (a drop-in), systemd never restarted
  pvschedd for a missed ping through all of it.
"""

import json
import os
import threading
import time
from pathlib import Path


from pkgroot import Booted, nspawn, tasks, wait

CAPS = 'halt_always = true\nhalt_boost = "rt"\n'
QMP = "/run/web1.qmp"


def stat_policy(path):
    """(policy, nice) of /proc/.../stat; None if the thread is gone."""
    try:
        rest = Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 19 (nice) and 41 (policy), counting from 1 with comm as 2.
    return int(rest[38]), int(rest[16])


class Sampler(threading.Thread):
    """Samples QEMU's threads (host pid qemu) and the container's pvschedd
    processes until stopped; `era` labels the samples."""

    def __init__(self, container, qemu):
        super().__init__(daemon=True)
        self.c, self.qemu = container, qemu
        self.era = "N"
        self.halt = threading.Event()
        self.samples = []  # (era, daemon before, daemon after, {tid: (policy, nice)})
        self.error = None

    def run(self):
        try:
            while not self.halt.is_set():
                before = bool(self.c.host_pids("pvschedd"))
                threads = {}
                for t in tasks(self.qemu):
                    p = stat_policy(f"/proc/{self.qemu}/task/{t}/stat")
                    if p is not None:
                        threads[t] = p
                after = bool(self.c.host_pids("pvschedd"))
                self.samples.append((self.era, before, after, threads))
                time.sleep(0.005)
        except Exception as e:  # shown by the test, not lost in a thread
            self.error = e

    def boosted(self, era):
        return sum(1 for e, _, _, th in self.samples
                   if e == era and any(p != 0 for p, _ in th.values()))

    def stop(self):
        self.halt.set()
        self.join()
        assert self.error is None, f"sampler failed: {self.error!r}"


def status(c):
    r = c.run("pvsched", "status", "--json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def served_by(c, version):
    """Status once pvschedd `version` serves web1 with its file's caps."""
    def probe():
        s = status(c)
        if not s or s["daemon"].get("version") != version:
            return None
        vm = next((v for v in s["vms"] if v["name"] == "web1"), None)
        if vm and vm["caps_source"] == "file" and vm["caps"]["halt_always"]:
            return s
        return None
    return wait(f"web1 registered with pvschedd {version}", probe)


def apt(c, *args):
    r = c.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", *args)
    assert r.returncode == 0, f"apt-get install {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_upgrade_and_rollback_keep_the_vm_and_leave_nothing_boosted(
        root_fs, package_n, package_next, need_real, tmp_path):
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        need_real("/dev/kvm", "the VM in the package root runs on KVM")
    root = root_fs
    if not (root / "usr/bin/qemu-system-x86_64").exists():
        need_real("QEMU in the package root", "run scripts/setup (43-systemd-container.sh)")
    n = package_n.name.split("_")[1]
    n1 = package_next.version
    for deb in (package_n, package_next.deb):
        (root / "root" / deb.name).write_bytes(deb.read_bytes())
    r = nspawn(root, "--chdir=/root", "apt-get", "install", "-y", f"./{package_n.name}")
    assert r.returncode == 0, f"apt-get install ./{package_n.name}:\n{r.stdout}\n{r.stderr}"
    (root / "etc/pvsched/vms/web1.toml").write_text(CAPS)
    # The watchdog at 2 s instead of the unit's 30 s: every step below must
    # find the request loop pinging (a missed ping restarts pvschedd, which
    # NRestarts counts).
    dropin = root / "etc/systemd/system/pvschedd.service.d"
    dropin.mkdir(parents=True)
    (dropin / "watchdog.conf").write_text("[Service]\nWatchdogSec=2s\n")

    log = open(tmp_path / "console.log", "w")
    c = Booted(root, log, kvm=True)
    sampler = None
    try:
        wait("pvschedd active", lambda: c.run("systemctl", "is-active", "pvschedd")
             .stdout.strip() == "active")
        r = c.run("systemd-run", "--unit=web1", "--", "qemu-system-x86_64", "-accel", "kvm",
                  "-M", "q35", "-smp", "2", "-m", "64", "-nodefaults", "-display", "none",
                  "-serial", "none", "-monitor", "none", "-qmp", f"unix:{QMP},server=on,wait=off")
        assert r.returncode == 0, f"systemd-run qemu: {r.stdout}{r.stderr}"
        wait("QEMU's QMP socket", lambda: c.run("test", "-S", QMP).returncode == 0)
        qemu = wait("QEMU's process", lambda: c.host_pids("qemu-system-x86"))[0]
        inner = c.run("systemctl", "show", "-P", "MainPID", "web1").stdout.strip()
        # Before any registration: every thread at the baseline this test assumes.
        base = {t: stat_policy(f"/proc/{qemu}/task/{t}/stat") for t in tasks(qemu)}
        assert all(p in (None, (0, 0)) for p in base.values()), f"QEMU threads at start: {base}"

        sampler = Sampler(c, qemu)
        sampler.start()
        r = c.run("pvsched", "qemu-attach", "--qmp", QMP, "--pid", inner, "--name", "web1")
        assert r.returncode == 0, f"pvsched qemu-attach: {r.stdout}{r.stderr}"
        served_by(c, n)
        wait(f"a boosted QEMU thread under {n}", lambda: sampler.boosted("N"))

        doctor = c.run("pvsched", "doctor")
        print(f"pvsched doctor in the package root (exit {doctor.returncode}):\n"
              f"{doctor.stdout}{doctor.stderr}")
        assert doctor.returncode == 0, "doctor reports a blocking problem in the package root"
        lines = doctor.stdout.splitlines()
        assert any(l.startswith("ok") and "pvschedd" in l and n in l for l in lines), lines
        assert any("web1" in l for l in lines), "doctor does not list the VM"

        for era, args, version in (("N+1", [f"/root/{package_next.deb.name}"], n1),
                                   ("N again", ["--allow-downgrades", f"/root/{package_n.name}"], n)):
            sampler.era = f"{era} (apt)"
            out = apt(c, "-o", "Dpkg::Options::=--force-confold", *args)
            print(f"apt-get install {' '.join(args)}:\n" + "\n".join(
                l for l in out.splitlines() if not l.startswith("(Reading database")))
            served_by(c, version)
            sampler.era = era
            wait(f"a boosted QEMU thread under {version}", lambda: sampler.boosted(era))
            got = c.run("dpkg-query", "-W", "-f=${Version}", "pvsched").stdout
            assert got == version, f"dpkg says pvsched {got}, expected {version}"

        show = c.run("systemctl", "show", "-p", "WatchdogUSec", "-p", "NRestarts", "pvschedd")
        assert show.stdout.split() == ["WatchdogUSec=2s", "NRestarts=0"], show.stdout
        sampler.era = "stop"
        r = c.run("systemctl", "stop", "pvschedd")
        assert r.returncode == 0, r.stderr
        wait("pvschedd gone", lambda: not c.host_pids("pvschedd"))
        wait("a sample with pvschedd gone", lambda: any(
            e == "stop" and not before and not after
            for e, before, after, _ in list(sampler.samples)))
    finally:
        if sampler is not None:
            sampler.stop()
        c.stop()
        log.close()

    left = [(e, th) for e, before, after, th in sampler.samples
            if not before and not after and any(p != (0, 0) for p in th.values())]
    eras = {}
    for e, before, after, th in sampler.samples:
        k = eras.setdefault(e, [0, 0, 0])
        k[0] += 1
        k[1] += any(p != 0 for p, _ in th.values())
        k[2] += not before and not after
    print("samples by era (all, with a boosted thread, with no pvschedd): "
          + "; ".join(f"{e}: {a}/{b}/{d}" for e, (a, b, d) in eras.items()))
    assert not left, f"{len(left)} samples with no pvschedd and a QEMU thread boosted: {left[:3]}"
    assert eras.get("stop", [0, 0, 0])[2] > 0, "no sample after pvschedd stopped"
