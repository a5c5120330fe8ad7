"""A clean Debian root for the package tests, run the way an operator's
host runs the package: `apt` in it (not booted), then booted with
systemd-nspawn as PID 1, with BPF (and /dev/kvm for a VM) allowed as
pvschedd needs. The root is an overlay over the cached bookworm+systemd
chroot of scripts/setup.d/43-systemd-container.sh, so that chroot is never
written to."""

import os
import subprocess
import time
from pathlib import Path

import pytest

# Liveness bound of every wait (not a timing assertion).
LIMIT = 60


def sh(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def ok(args, **kw):
    r = sh(args, **kw)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def wait(what, probe, limit=LIMIT):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = probe()
        if v:
            return v
        time.sleep(0.2)
    pytest.fail(f"{what}: not there after {limit} s")


def nspawn(root, *cmd):
    """Runs cmd in the (not booted) root, as `apt` would be run there."""
    return sh(["systemd-nspawn", "-q", "--register=no", "--keep-unit", "--private-network",
               f"--directory={root}", "--setenv=DEBIAN_FRONTEND=noninteractive", *cmd])


def tasks(pid):
    """The thread ids of process pid ([] once it has gone: /proc entries
    vanish while they are read)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def descendants(pid):
    """Host pids of pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for t in tasks(p):
            try:
                todo += [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except OSError:
                pass
    return out


def comm(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def container_init(nspawn_pid):
    """The booted container's PID 1 (host pid) among nspawn's descendants."""
    for p in descendants(nspawn_pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        nspid = next((l.split()[1:] for l in status.splitlines() if l.startswith("NSpid:")), [])
        if len(nspid) > 1 and nspid[-1] == "1":
            return p
    return None


class Booted:
    """`root` booted by systemd-nspawn, with BPF allowed as pvschedd needs
    (and /dev/kvm bound in with `kvm=True`)."""

    def __init__(self, root, log, kvm=False):
        extra = ["--bind=/dev/kvm", "--property=DeviceAllow=/dev/kvm rw"] if kvm else []
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--boot", "--console=read-only", "--register=no",
             "--keep-unit", "--private-network", f"--directory={root}",
             f"--machine=pvsched-deb-{os.getpid()}",
             "--capability=CAP_BPF,CAP_PERFMON", "--system-call-filter=bpf perf_event_open",
             *extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.leader = wait("the container's systemd", lambda: container_init(self.proc.pid))
        wait("the container's boot", lambda: self.run("systemctl", "is-system-running").stdout.strip()
             in ("running", "degraded") or None)

    def run(self, *cmd):
        return sh(["nsenter", "-t", str(self.leader), "-a", *cmd])

    def host_pids(self, name):
        """Host pids of the container's processes whose comm is name."""
        return [p for p in descendants(self.leader) if comm(p) == name]

    def stop(self):
        if self.proc.poll() is None:
            self.run("systemctl", "poweroff")
            try:
                self.proc.wait(timeout=LIMIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
