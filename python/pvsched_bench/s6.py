"""S6: throughput of real Linux guests under overcommit, per CPU-second
of the whole VM, vanilla against pvsched and what a user would pick
instead. This module measures and writes one raw row per run; the report
(medians, spread, paired ratios, verdicts) is `pvsched-bench s6`'s.

What it runs
------------
N guests of V vCPUs each (`--topology NxV`, default 1x2), Debian kernel
`--kernel` of tests/linux-guest/kernels.conf (default 7.3-cloud) under
QEMU 11 TCG (`-accel tcg,thread=multi`, 256 MiB per vCPU, at least
512 MiB), each with the pvsched device over vfio-user in device-region
mode and the DKMS-built module loaded (by modprobe), but in the `none`
variant. The workloads are Debian's programs from the kernel's suite
chroot (scripts/setup.d/46-s6.sh), copied with their libraries into the
initramfs; guest/s6.sh runs them:

  cpu         stress-ng --cpu V --cpu-method int64 (control: compute, no
              synchronisation; must not regress)
  batch       stress-ng --cpu 3V --cpu-method int64 (a batch control with
              more tasks than vCPUs: the guest's scheduler switches them,
              still without synchronisation)
  tlb         stress-ng --tlb-shootdown V (TLB-shootdown IPIs)
  membarrier  stress-ng --membarrier V (expedited membarrier IPIs)
  hackbench   hackbench -g 2 -f 10 -l 10 again and again (sockets,
              wakeups), at least MIN_ITERS times and for the duration
  dbench      dbench 2V on tmpfs (VFS, locks)

A workload A+B+... gives the VMs different ones: VM i runs the i-th part,
the parts taken again from the first when there are more VMs than parts
(`--topology 3x2 --workloads hackbench+cpu+cpu`: one IPI-heavy VM beside
two batch ones, each batch VM's work and CPU against vanilla's). Its row
has no summed throughput (the units differ); each VM's is in `vms`.

The host's autogroup is off for the run (`--autogroup`; put back
afterwards), so that every thread of the root cgroup is one nice-0 share:
with autogroup on, the VMs (in the harness's session) and the hogs (in a
session of their own) split the CPUs by session, and that split swings
from run to run (2x2 vanilla hackbench, three runs: VM CPU 11.1-20.5 s,
hog work 365-35 152 bogo ops; with it off 13.4-14.4 s and 23 114-24 698).

Beside the guests, unless --hogs 0: `stress-ng --cpu H --cpu-method int64`
on the host (H = --hogs, default one per host CPU), started before the
workload command and stopped (SIGINT) only after the last guest reported,
so that they cover the whole measured window; their work is reported as
bogo ops and as a rate over their own elapsed time (stress-ng's
wall-clock-time): the host work a variant leaves to others.

Variants (--variants, each booted fresh; the order rotates per
repetition: repetition r starts at variant r mod k):

  none      no pvsched at all: no device, the module not loaded, no
            pvschedd and so none of its BPF programs
  vanilla   the device and the module, every QEMU thread SCHED_OTHER nice
            0 in the root cpu cgroup with the hogs; no pvschedd
  pvsched   pvschedd (started for this variant's round and stopped after
            it), the device's BAR2 its region map (`pvsched device
            --daemon-region`), the VM registered by `pvsched qemu-attach
            --device-region` with the daemon's default caps, QEMU's main
            loop as the emulator thread
  pvsched-nocs, pvsched-nowait, pvsched-nolock
            ablations: the same with the guest's critical sections
            ignored (cs_rt_prio = 0), its wait_on hints (wait_on = false)
            or its lock waits (lock_wait = false, the default since
            2026-11-27)
  pvsched-wait
            wait_on hints honoured whatever the VM's width (wait_on =
            true; the default, "auto", ignores them on a VM with more
            vCPUs than the CPUs its threads may run on)
  pvsched-lock
            lock waits honoured (lock_wait = true)
  pvsched-kick, pvsched-nokick, pvsched-auto
            kick pairing always on (kick_pairs = true), off (false), or
            "auto" (only a guest without wait_on, only from a boosted
            sender), whatever the default
  pvsched-clamped
            the control: registered the same way, every boost clamped to
            nothing (allow_rt = false, nice_floor = 0)
  pvsched-cosched, pvsched-coauto, pvsched-coauto10, pvsched-coauto5
            co-scheduling: a fixed phase at the VM's fair share (cosched_us
            computed from the topology, 20 ms period), or cosched_us =
            "auto" (the default since 2026-12-03) at the default 20 ms
            period, at 10 ms or at 5 ms
  pvsched-coauto40
            "auto" at a 40 ms period
  pvsched-nocosched
            the default caps but cosched_us = 0 (the default before
            2026-12-03: boosts only)
  pvsched-coauto-noyield
            "auto" with pvschedd's [cosched] yield = false: a host thread
            woken in a phase waits for its end (the yield's ablation)
  pvsched-slice0
            the default caps, pvschedd's [cosched] off_slice_us = 0: a
            vCPU outside its phase keeps the kernel's default slice (the
            longer slice's ablation)
  pvsched-noemu
            the default caps, QEMU's main-loop thread not registered as
            the VM's emulator thread (qemu-attach --no-emulator): to the
            policy it is a host thread, so a phase yields to its wake-ups
  fifo1     every vCPU thread SCHED_FIFO 1 (KubeVirt's realtime setting,
            libvirt's <vcpusched scheduler='fifo' priority='1'/>)
  weight    QEMU in its own cpu cgroup with cpu.shares 4096 (cgroup v1;
            cgroup v2's cpu.weight 400), the hogs in the root group
  slice     every vCPU thread SCHED_OTHER with a 24 ms custom slice

Per workload, topology, variant and repetition, one row: the tool's own
throughput summed over the VMs (stress-ng's bogo-ops-per-second-real-time,
which leaves out its start-up; hackbench's messages over the summed
`Time:` of its invocations; dbench's MB/s) and how many iterations it
took (hackbench invocations, stress-ng bogo ops, dbench operations); the
CPU seconds the whole VM cost over the measured window in parts
(`cost_cpu_s`: qemu, the VMs' QEMU processes; device, their device
processes; pvschedd, the daemon's process with its applier; bpf, the
policy's programs' run time from the kernel's BPF statistics, which are
on while pvschedd runs; the last two are the run's in total, for all its
VMs); the hogs' work; and for pvsched, pvschedd's boosts, throttles and
boosted time of the VMs' threads; where the host's CPU went over the
window (`host_cpu`, CPU-seconds of /proc/stat's user, nice, system, idle,
iowait, irq, softirq, steal: time the columns above leave out, such as a
CPU left idle or taken by the hypervisor); and with --host-costs-bin,
what a wake-up, a sleep and a sched_setattr cost the host as the variant's
round started (`host_costs`, `pvsched-bench host-costs`: on a host that
is itself a VM they differ severalfold over a day, and pvschedd's own CPU
with them). A repetition that failed is a row with an `error` and no
figures.

Usage
-----
  scripts/setup            # QEMU 11, the matrix kernels' chroots, the workloads
  cargo build --release -p pvsched-transport --bin pvsched-device \\
      -p pvsched --bin pvsched -p pvsched-daemon --bin pvschedd -p pvsched-bench
  pvsched-bench s6 [--quick] [--reps 5] [--duration 20] ...   # the report
  PYTHONPATH=python python3 -m pvsched_bench s6 ... --json raw.json  # rows only

--host-probe runs a SCHED_OTHER cyclictest on the host beside every
workload: what a variant costs an ordinary host thread's wake-ups (FIFO
vCPUs and co-scheduled phases make it wait), which the hogs' work does not
show. --host-probe-prio N runs it at SCHED_FIFO N instead: a host service
an operator raised above the phases' FIFO 1 and the policy's boosts.

A guest that does not report a workload within --duration + 120 s (static
FIFO under overcommit can starve QEMU's main loop, which raises a TCG
guest's timers) is recorded as an error row for that workload and the rest
of its round; the benchmark goes on with the next round. A workload that
exits non-zero in a guest is recorded the same way, and the round goes on
with the next workload.

Run as root. Exit 0 on success, 1 on a failed run, 3 when something is
missing, 130 on Ctrl-C. Every QEMU, device, daemon and hog process is
stopped however the run ends, and the weight variant's cgroup is removed.
"""

import argparse
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pvsched_guest.bench import (Autogroup, add_autogroup_option, BenchError, CGROUP_CPU,
                                 Daemon, Proc, WEIGHT_SHARES, between, driver_counters,
                                 first_line, loadavg, qemu_cpu_s, remove_cgroup, run_main,
                                 parse_cyclictest, set_fifo1, stat_cpu_s, status_vm,
                                 thread_cpu_s, thread_stats, vm_caps, weight_cgroup)
from pvsched_guest.boot import Boot
from pvsched_guest.host import fair_slice, set_fair_slice
from pvsched_guest.kernel import build_initramfs, chroot_binary, matrix_kernel, modprobe_files
from pvsched_guest.qmp import qmp

# The guest side: /bench.sh in the initramfs.
GUEST_SCRIPT = Path(__file__).resolve().parent / "guest" / "s6.sh"
# The repository (default binaries and cache).
REPO = Path(__file__).resolve().parents[2]

WORKLOADS = ("cpu", "batch", "tlb", "membarrier", "hackbench", "dbench")
VARIANTS = ("none", "vanilla", "pvsched", "pvsched-nocs", "pvsched-nowait", "pvsched-wait",
            "pvsched-nolock",
            "pvsched-lock", "pvsched-kick", "pvsched-nokick", "pvsched-auto", "pvsched-clamped",
            "pvsched-cosched", "pvsched-coauto", "pvsched-coauto10", "pvsched-coauto5",
            "pvsched-coauto40", "pvsched-coauto-noyield", "pvsched-nocosched", "fifo1", "weight", "slice", "pvsched-slice0",
            "pvsched-noemu")
# The pvsched ablations: the daemon's default caps but for a line or two
# (pvschedd reads them from its vm_dir, NAME.toml). pvsched-clamped is the
# control: registered, every boost clamped to nothing.
ABLATION_CAPS = {"pvsched-nocs": "cs_rt_prio = 0\n", "pvsched-nowait": "wait_on = false\n",
                 "pvsched-wait": "wait_on = true\n",
                 "pvsched-nolock": "lock_wait = false\n", "pvsched-lock": "lock_wait = true\n",
                 "pvsched-kick": "kick_pairs = true\n",
                 "pvsched-nokick": "kick_pairs = false\n",
                 "pvsched-auto": "kick_pairs = \"auto\"\n",
                 "pvsched-clamped": "allow_rt = false\nnice_floor = 0\n",
                 "pvsched-cosched": None,
                 "pvsched-coauto": "cosched_us = \"auto\"\n",
                 # Half the default period: what a shorter phase costs the
                 # VM's work and saves a host thread's wake-ups.
                 "pvsched-coauto10": "cosched_us = \"auto\"\ncosched_period_us = 10000\n",
                 "pvsched-coauto5": "cosched_us = \"auto\"\ncosched_period_us = 5000\n",
                 # Twice the default period: half the phase changes a
                 # second, each phase twice as long for the yield to serve.
                 "pvsched-coauto40": "cosched_us = \"auto\"\ncosched_period_us = 40000\n",
                 "pvsched-coauto-noyield": "cosched_us = \"auto\"\n",
                 "pvsched-nocosched": "cosched_us = 0\n"}
# Ablations of pvschedd's own settings (pvschedd.toml text, appended).
ABLATION_DAEMON = {"pvsched-coauto-noyield": "[cosched]\nyield = false\n",
                   "pvsched-slice0": "[cosched]\noff_slice_us = 0\n"}
# pvsched-cosched: the period of the co-scheduled phase, µs.
COSCHED_PERIOD_US = 20_000


def cosched_caps(nvm, vcpus, hogs):
    """The caps of the pvsched-cosched variant: the default caps with a
    co-scheduled phase as long as the VM's fair share of the host, as an
    operator would set it: every runnable thread (the guests' vCPUs and the
    hogs) weighs the same, so a VM's vCPUs are owed vcpus / threads of the
    host's CPUs; running together they use min(vcpus, CPUs) of them, so the
    phase is that share of the period (at most the default limit, 50 %)."""
    ncpu = os.cpu_count()
    fair_cpus = vcpus * ncpu / (nvm * vcpus + hogs)
    frac = min(0.5, fair_cpus / min(vcpus, ncpu))
    on = int(COSCHED_PERIOD_US * frac)
    return f"cosched_us = {on}\ncosched_period_us = {COSCHED_PERIOD_US}\n"


# How often the device process samples its slots for the boot's dump (S6
# reads the driver's own counters, not the dump): the device's default,
# 500 µs, wakes it every millisecond, and each wake-up on a CPU a phased
# vCPU holds is a yield pvschedd applies, a cost no production device has.
DEVICE_SAMPLE_US = 100_000
# The guest driver's debugfs counters kept per workload (summed over CPUs).
GUEST_COUNTERS = ("updates", "waits", "lock_waits", "wakes")
# The guest's IPIs per run: rescheduling, function call, TLB shootdown.
GUEST_IPIS = ("res", "cal", "tlb")
# The slice variant: every vCPU thread SCHED_OTHER nice 0 with this custom
# slice (sched_attr.sched_runtime; the host kernel gives 1.4 ms by default).
SLICE_NS = 24_000_000
# Guest memory: MIB_PER_VCPU per vCPU, at least MIN_MIB. dbench runs 2
# clients per CPU on the initramfs's tmpfs (half the guest's memory), and
# 8 clients in a 512 MiB guest fill it within a second (ENOSPC).
MIB_PER_VCPU = 256
MIN_MIB = 512
# Seconds a boot may take to reach its first command (TCG, 4 vCPUs, load).
BOOT_S = 240
# Seconds past --duration a guest may take to report a workload before it
# counts as making no progress (static FIFO under overcommit can starve
# QEMU's main loop, which raises a TCG guest's timers).
PROGRESS_S = 120
# hackbench: at least this many invocations per run, so that one is a small
# part of the figure (each is 2 groups x 10 senders x 10 receivers x
# HACKBENCH_LOOPS messages; the guest script holds the same numbers).
MIN_ITERS = 60
HACKBENCH_MESSAGES = 2 * 10 * 10 * 10
# Seconds pvschedd's programs may stay loaded after it exited.
RESTORE_S = 5.0
# Seconds the hogs run before the workload command: stress-ng forks its
# workers first.
HOG_LEAD_S = 1.0


def log(msg):
    print(f"s6: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- host side

def process_children():
    """{ppid: [pid, ...]} of every process now."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    return children


def tree_cpu_s(pid, children):
    """CPU seconds of process `pid` and every process below it in
    `children` (process_children(); a process that already exited is not
    counted), from /proc/PID/stat: whole clock ticks (10 ms), which count
    the process's exited threads too (per-thread schedstat, in ns, would
    lose those)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += stat_cpu_s(f"/proc/{p}/stat")
        except OSError:
            continue
        todo += children.get(p, [])
    return total


def stress_ng_metrics(text, stressor):
    """{"ops", "rate", "wall_s"} of `stressor` from stress-ng's -Y YAML:
    its bogo ops, its own bogo ops per second of real time (its stressors'
    run, without its start-up) and its wall-clock time; None if the YAML
    has no such stressor."""
    m = re.search(rf"stressor: {re.escape(stressor)}\s*\n((?:\s+[\w-]+: \S+\n?)+)", text)
    if not m:
        return None
    f = dict(re.findall(r"([\w-]+): (\S+)", m.group(1)))
    try:
        return {"ops": int(f["bogo-ops"]), "rate": float(f["bogo-ops-per-second-real-time"]),
                "wall_s": float(f["wall-clock-time"])}
    except (KeyError, ValueError):
        return None


class WorkloadFailed(BenchError):
    """A guest's workload exited non-zero; the guests still answer."""


class NoProgress(BenchError):
    """A guest did not report its workload in time: the variant starved it."""


class GuestEnded(BenchError):
    """A guest's boot ended while it had a command to answer (a soft lockup
    the boot stopped at, QEMU gone)."""


# ---------------------------------------------------------------- one guest

class Guest:
    """One QEMU guest serving guest/s6.sh's commands. Its boot runs in
    a thread; the "@@ bench-wait" hook hands control to the main thread
    (self.ready) and blocks until it sends the next command (self.cmd)."""

    def __init__(self, args, name, vcpus, variant, daemon, nvm=1):
        self.args, self.name, self.vcpus, self.variant = args, name, vcpus, variant
        self.daemon = daemon
        self.ready, self.cmd = queue.Queue(), queue.Queue()
        self.error = None
        # (fields of "@@ result", the tool's output) per workload run, and
        # the boot time of the last "@@ result" taken.
        self.results = []
        self.last_result_at = -1
        # The driver's counters at the last `stats` (cumulative since load).
        self.counters = {}
        # Every variant with a device samples alike (vanilla's device too:
        # its CPU is part of the VM's cost on both sides of a ratio).
        sample = ["--sample-us", str(DEVICE_SAMPLE_US)]
        dev, transport, load = [str(args.device_bin), *sample], "vfio-user", "modprobe"
        if variant == "none":
            dev, transport, load = None, "none", "none"
        elif variant.startswith("pvsched"):
            dev = daemon.device_cmd(name) + sample
            caps = daemon.vms / f"{name}.toml"
            if variant == "pvsched-cosched":
                caps.write_text(cosched_caps(nvm, vcpus, args.hogs))
            elif variant in ABLATION_CAPS:
                caps.write_text(ABLATION_CAPS[variant])
            elif caps.exists():
                caps.unlink()
        self.boot = Boot(args, name, vcpus, "bench", transport=transport, device_cmd=dev,
                         hooks={"bench-wait": self._on_wait},
                         extra_append=f"pvload={load}",
                         mem_mib=max(MIN_MIB, MIB_PER_VCPU * vcpus))
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self):
        try:
            self.boot.run()
        except BaseException as e:  # noqa: B036 (handed to the main thread)
            self.error = e
        finally:
            self.ready.put(None)

    def _on_wait(self, boot):
        r = between(boot.serial, "@@ out-begin", "@@ out-end")
        res = boot.marks.get("result")
        if res is not None and res[0] > self.last_result_at:
            self.last_result_at = res[0]
            self.results.append((res[1], r))
        self.ready.put(True)
        line = self.cmd.get()
        boot.answer(line)

    def wait_ready(self, timeout):
        try:
            ok = self.ready.get(timeout=timeout)
        except queue.Empty:
            raise NoProgress(f"{self.name}: no '@@ bench-wait' within {timeout:.0f}s "
                             f"(see {self.boot.dir}/serial.log)")
        if not ok:
            raise GuestEnded(f"{self.name}: the boot ended: {self.error or 'no error'} "
                             f"(see {self.boot.dir}/serial.log)")

    def guest_counters(self):
        """The driver's GUEST_COUNTERS since the last call, summed over CPUs
        (None when the driver shows no stats: no device attached)."""
        self.cmd.put("stats")
        self.wait_ready(60)
        rows = driver_counters(between(self.boot.serial, "@@ stats-begin", "@@ stats-end"))
        if not rows:
            return None
        now = {k: sum(r.get(k, 0) for r in rows) for k in GUEST_COUNTERS}
        delta = {k: now[k] - self.counters.get(k, 0) for k in GUEST_COUNTERS}
        self.counters = now
        return delta

    def vcpu_tids(self):
        cpus = qmp(self.boot.qmp_path, "query-cpus-fast")
        return [c["thread-id"] for c in sorted(cpus, key=lambda c: c["cpu-index"])]


def apply_variant(g, variant, daemon, cgroup, caps):
    """Puts guest `g` under `variant` once it waits for its first command
    (`caps`: each pvsched variant's caps as pvschedd reported them, filled
    in once)."""
    pid = g.boot.qemu.pid
    if variant.startswith("pvsched"):
        extra = ["--no-emulator"] if variant == "pvsched-noemu" else []
        daemon.pvsched("qemu-attach", "--qmp", str(g.boot.qmp_path), "--name", g.name,
                       "--pid", str(pid), "--device-region", *extra)
        if variant not in caps:
            caps[variant] = vm_caps(daemon, g.name)
            log(f"{variant} caps: {caps[variant]}")
    elif variant == "fifo1":
        set_fifo1(g.vcpu_tids())
    elif variant == "weight":
        (cgroup / "cgroup.procs").write_text(str(pid))
    elif variant == "slice":
        for t in g.vcpu_tids():
            set_fair_slice(t, SLICE_NS)
            if fair_slice(t) != SLICE_NS:
                raise BenchError(f"vCPU thread {t}: slice {fair_slice(t)} ns after setting "
                                 f"{SLICE_NS}")


# ---------------------------------------------------------------- one round

def run_round(args, topo, variant, rep, cgroup, caps):
    """Boots topo's guests under `variant`, runs every workload on all of
    them at once (with the hogs), and returns one row per workload. A
    pvsched variant's round has pvschedd of its own, started before its
    guests and stopped after them; every other variant runs without it (so
    without its BPF programs on the host's scheduler events)."""
    nvm, vcpus = topo
    tag = f"{nvm}x{vcpus}-{variant}-r{rep}"
    daemon = (Daemon(args, args.out, ABLATION_DAEMON.get(variant, ""))
              if variant.startswith("pvsched") else None)
    try:
        return guest_round(args, tag, nvm, vcpus, variant, daemon, cgroup, caps)
    finally:
        if daemon is not None:
            daemon.stop()
            check_restored(tag)


def check_restored(tag):
    """After pvschedd stopped: none of the policy's programs is left on the
    host's events (the daemon unloads them and restores its threads on
    exit); a leftover would run in every later round, so it fails the run.
    The kernel frees a program once its last reference goes, which can
    lag the daemon's exit: a few seconds are allowed."""
    deadline = time.monotonic() + RESTORE_S
    while (left := policy_bpf()) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    if left is not None:
        raise BenchError(f"{tag}: pvschedd stopped but the policy's BPF programs are still "
                         f"loaded ({left})")


def guest_round(args, tag, nvm, vcpus, variant, daemon, cgroup, caps):
    guests = [Guest(args, f"s6-{tag}-vm{i}", vcpus, variant, daemon, nvm) for i in range(nvm)]
    rows = []
    # Why the guests stopped answering, once they have.
    stuck = None
    try:
        for g in guests:
            g.thread.start()
        for g in guests:
            g.wait_ready(BOOT_S)
            apply_variant(g, variant, daemon, cgroup, caps)
            if variant.startswith("pvsched"):
                g.guest_counters()  # the baseline: boot and attach
        for w in args.workloads:
            if stuck is not None:
                rows.append(error_row(w, variant, tag, f"not run: {stuck}"))
                log(f"{tag} {w}: {rows[-1]['brief']}")
                continue
            try:
                rows.append(run_workload(args, tag, guests, w, variant, daemon))
            except WorkloadFailed as e:
                rows.append(error_row(w, variant, tag, str(e)))
            except (NoProgress, GuestEnded) as e:
                # Recorded, not fatal: the variant starved its guests or
                # locked them up (FIFO 1 vCPUs that outnumber the CPUs can).
                # They cannot take another command; QEMU is stopped below.
                stuck = str(e)
                rows.append(error_row(w, variant, tag, stuck))
            log(f"{tag} {w}: {rows[-1]['brief']}")
        if stuck is not None:
            for g in guests:
                g.boot.qemu.kill()
        for g in guests:
            g.cmd.put("quit")
        for g in guests:
            g.thread.join(timeout=120)
    finally:
        for g in guests:
            if g.thread.is_alive():
                g.cmd.put("quit")
        for g in guests:
            g.thread.join(timeout=60)
        if daemon is not None:
            for g in guests:
                daemon.pvsched("vm", "unregister", g.name, check=False)
    for g in guests:
        if g.error is not None and stuck is None:
            if not rows:
                raise BenchError(f"{g.name}: {g.error}")
            # The guest ended after its last workload under the variant
            # (a soft lockup found as it finished): the variant's result,
            # kept with the round's rows.
            log(f"{tag}: {g.name} ended after its workloads: {g.error}")
            for r in rows:
                r.setdefault("guest_errors", []).append(f"{g.name}: {g.error}")
    return rows


def trace_mark(text):
    """Marks a step in the host trace bench/trace-run.sh records around this
    run (it names its tracefs instance's marker in PVSCHED_TRACE_MARKER), so
    python3 -m pvsched_bench phase-trace can tell the workload runs from boots; nothing
    without it. A marker that cannot be written costs the trace its marks,
    not the run."""
    path = os.environ.get("PVSCHED_TRACE_MARKER")
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(text + "\n")
    except OSError as e:
        log(f"trace marker {path}: {e}")


def error_row(w, variant, tag, why):
    """The row of a workload that gave no result: a failed repetition of
    its variant, kept and counted, with no figures."""
    return {"workload": w, "variant": variant, "tag": tag, "error": why, "vms": [],
            "brief": f"NO RESULT: {why}"}


class Hogs:
    """The host's CPU hogs of one workload run: `stress-ng --cpu N` with no
    time limit, started before the workload command and stopped with
    SIGINT after the last guest reported (stress-ng then stops its workers
    and writes its metrics), so that they cover the whole window."""

    def __init__(self, args, name):
        d = args.out / "hogs"
        d.mkdir(parents=True, exist_ok=True)
        self.n, self.yaml = args.hogs, d / f"{name}.yaml"
        if self.yaml.exists():
            self.yaml.unlink()
        self.t0 = time.monotonic()
        self.proc = Proc("hogs", ["stress-ng", "--cpu", str(self.n), "--cpu-method", "int64",
                                  "--metrics-brief", "-Y", str(self.yaml)], d / f"{name}.log")

    def stop(self, window_start, window_end):
        """Stops them; their figures: bogo ops, their own elapsed time
        (stress-ng's wall-clock-time), ops per second of it, and how long
        before and after the workload's window they started and stopped
        (host clock)."""
        self.proc.stop(signal.SIGINT, grace=30.0)
        t1 = time.monotonic()
        m = stress_ng_metrics(self.yaml.read_text() if self.yaml.exists() else "", "cpu")
        if m is None:
            raise BenchError(f"the hogs wrote no metrics (see {self.yaml} and its .log)")
        return {"n": self.n, "ops": m["ops"], "elapsed_s": round(m["wall_s"], 3),
                "rate": round(m["ops"] / m["wall_s"], 2) if m["wall_s"] > 0 else None,
                "lead_s": round(window_start - self.t0, 3),
                "tail_s": round(t1 - window_end, 3)}


def run_workload(args, tag, guests, w, variant, daemon):
    dur = args.duration
    hogs = Hogs(args, f"{tag}-{w}") if args.hogs else None
    probe = None
    try:
        if hogs is not None:
            time.sleep(HOG_LEAD_S)
            if hogs.proc.p.poll() is not None:
                raise BenchError(f"the hogs exited with {hogs.proc.p.returncode} (see "
                                 f"{hogs.yaml.with_suffix('.log')})")
        cpu0 = [qemu_cpu_s(g.boot.qemu.pid) for g in guests]
        thr0 = [thread_cpu_s(g.boot.qemu.pid) for g in guests]
        aux0 = host_aux_cpu_s(guests, daemon)
        bpf0 = policy_bpf() if daemon is not None else None
        st0 = daemon.status() if daemon is not None else None
        log0 = daemon.log_size() if daemon is not None else None
        la = loadavg()
        if args.host_probe:
            probe_dir = args.out / "probe"
            probe_dir.mkdir(parents=True, exist_ok=True)
            probe_json = probe_dir / f"{tag}-{w}.json"
            probe = Proc("host-probe", host_probe_cmd(dur, probe_json, args.host_probe_prio),
                         probe_dir / f"{tag}-{w}.log")
        if os.environ.get("PVSCHED_TRACE_MARKER"):
            # Which vCPU threads are one VM's: the trace alone cannot say.
            for g in guests:
                trace_mark(f"s6 vm {g.name} " + ",".join(str(t) for t in g.vcpu_tids()))
        t0 = time.monotonic()
        ticks0 = host_cpu_ticks()
        trace_mark(f"s6 start {tag} {w}")
        for g, gw in zip(guests, vm_workloads(w, len(guests))):
            g.cmd.put(f"run {gw} {dur} {MIN_ITERS}")
        for g in guests:
            g.wait_ready(dur + PROGRESS_S)
        t1 = time.monotonic()
        ticks1 = host_cpu_ticks()
        trace_mark(f"s6 end {tag} {w}")
        cpu1 = [qemu_cpu_s(g.boot.qemu.pid) for g in guests]
        thr1 = [thread_cpu_s(g.boot.qemu.pid) for g in guests]
        aux1 = host_aux_cpu_s(guests, daemon)
        bpf1 = policy_bpf() if daemon is not None else None
        hog_fig = hogs.stop(t0, t1) if hogs is not None else None
    except BaseException:
        for p in (hogs and hogs.proc, probe):
            if p is not None:
                p.stop()
        raise
    probe_fig = None
    if probe is not None:
        probe.wait(dur + 30)
        probe.stop()
        try:
            c = parse_cyclictest(json.loads(probe_json.read_text()))
            probe_fig = {k: c[k] for k in ("p50_us", "p99_us", "max_us", "cycles", "overflow")}
        except (OSError, ValueError, KeyError) as e:
            raise BenchError(f"host probe gave no result: {e} (see {probe_dir})")
    vms, failed = [], []
    for g, gw, c0, c1, s0, s1 in zip(guests, vm_workloads(w, len(guests)), cpu0, cpu1, thr0,
                                     thr1):
        if not g.results:
            raise BenchError(f"{g.name}: no result for {w} (see {g.boot.dir}/serial.log)")
        # Every guest's counters, a failed one's too: the next workload's
        # are taken against them.
        counters = g.guest_counters() if variant.startswith("pvsched") else None
        fields, out = g.results[-1]
        if fields.get("w") != gw or fields.get("rc") != "0":
            failed.append(f"{g.name}: {gw} failed: {fields} {out[-5:]}")
            continue
        rate, iters = throughput(gw, out)
        vms.append({"vm": g.name, "workload": gw, "unit": UNITS[gw],
                    "throughput": round(rate, 3), "iterations": iters,
                    "guest_secs": float(fields["secs"]), "cpu_s": round(c1 - c0, 3),
                    "threads_cpu_s": {k: round(s1[k] - s0[k], 3) for k in s0}})
        ipis = guest_ipis(fields)
        if ipis is not None:
            vms[-1]["guest_ipis"] = ipis
        if counters is not None:
            vms[-1]["guest_counters"] = counters
    if failed:
        raise WorkloadFailed("; ".join(failed))
    tp = sum(v["throughput"] for v in vms)
    cost = {"qemu": round(sum(v["cpu_s"] for v in vms), 3),
            "device": round(aux1["device"] - aux0["device"], 3),
            "pvschedd": round(aux1["pvschedd"] - aux0["pvschedd"], 3),
            "bpf": 0.0}
    if bpf0 is not None and bpf1 is not None:
        # Host-wide: the policy's programs run on every thread's events,
        # the hogs' too, and only while this round's pvschedd runs: all of
        # it is the round's VMs' cost, in total. They run in the context of
        # the thread switching or waking, so part of it is in qemu's too.
        cost["bpf"] = round((bpf1["ns"] - bpf0["ns"]) / 1e9, 4)
    elif daemon is not None:
        raise BenchError("no BPF run-time statistics of the policy's programs (bpftool, "
                         "kernel.bpf_stats_enabled)")
    row = {"workload": w, "variant": variant, "tag": tag, "error": None,
           "throughput": None if mixed(w) else round(tp, 3),
           "unit": "mixed" if mixed(w) else UNITS[w],
           "iterations": sum(v["iterations"] for v in vms), "window_s": round(t1 - t0, 3),
           "cost_cpu_s": cost, "hogs": hog_fig, "loadavg_start": la, "vms": vms,
           "host_probe": probe_fig, "host_cpu": host_cpu_s(ticks0, ticks1)}
    if st0 is not None:
        st1 = daemon.status()
        pol = {"boosts": 0, "throttles": 0, "boosted_ns": 0, "phase_changes": 0,
               "phase_yields": 0, "boost_yields": 0}
        for g in guests:
            a, b = thread_stats(st0, g.name), thread_stats(st1, g.name)
            if a and b:
                for k in pol:
                    pol[k] += b[k] - a[k]
                # Per VM: how much its vCPUs waited for each other (what
                # co-scheduling serves and what gates it).
                v = next((v for v in vms if v["vm"] == g.name), None)
                if v is not None:
                    v["sync"] = {k: b[k] - a[k] for k in ("sync_halts", "sib_wakes",
                                                             "sync_wait_ns")}
        row["policy"] = {"boosts": pol["boosts"], "throttles": pol["throttles"],
                         "boosted_s": round(pol["boosted_ns"] / 1e9, 3),
                         "phase_changes": pol["phase_changes"],
                         "phase_yields": pol["phase_yields"],
                         "boost_yields": pol["boost_yields"],
                         "bpf_runs": bpf1["runs"] - bpf0["runs"]}
        # Each VM's gate over the run: every window's score and whether
        # its phases were on (why a VM got phases, or did not).
        gates = daemon.gate_windows(log0)
        for g in guests:
            v = next((v for v in vms if v["vm"] == g.name), None)
            st = status_vm(st1, g.name)
            if v is not None and st is not None and st["vm_id"] in gates:
                wins = gates[st["vm_id"]]
                v["gate"] = {"scores": [round(r, 1) for r, _ in wins],
                             "on": [on for _, on in wins]}
        # Each VM's co-scheduled phase as the run ended (what "auto" measured).
        phases = [(status_vm(st1, g.name) or {}).get("cosched_now_us", 0) for g in guests]
        if any(phases):
            row["cosched_now_us"] = phases
        # With "auto": each VM's guest-counted waits per vCPU and second
        # as the run ended (what opens its phases; absent: no counts).
        syncs = [(status_vm(st1, g.name) or {}).get("cosched_sync") for g in guests]
        if any(s is not None for s in syncs):
            row["cosched_sync"] = syncs
    gc = [v["guest_counters"] for v in vms if v.get("guest_counters")]
    if gc:
        row["guest_counters"] = {k: sum(c[k] for c in gc) for k in GUEST_COUNTERS}
    gi = [v["guest_ipis"] for v in vms if v.get("guest_ipis")]
    if vms and len(gi) == len(vms):
        row["guest_ipis"] = {k: sum(c[k] for c in gi) for k in GUEST_IPIS}
    split = {k: round(sum(v["threads_cpu_s"][k] for v in vms), 1)
             for k in ("vcpus", "main", "other")}
    work = ("; ".join(f"{v['workload']} {v['throughput']:.1f} {v['unit']}" for v in vms)
            if mixed(w) else f"{tp:.1f} {UNITS[w]}")
    row["brief"] = (f"throughput {work} ({row['iterations']} iterations), "
                    f"cost CPU s {cost} {split}, hogs {hog_fig}"
                    + (f", policy {row['policy']}" if "policy" in row else "")
                    + (f", guest {row['guest_counters']}" if "guest_counters" in row else "")
                    + (f", guest IPIs {row['guest_ipis']}" if "guest_ipis" in row else "")
                    + (f", host probe p99/max {probe_fig['p99_us']}/{probe_fig['max_us']} us"
                       if probe_fig else ""))
    return row


BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


class BpfStats:
    """With --bpf-stats, the kernel's BPF run-time statistics on for the run
    (kernel.bpf_stats_enabled, put back afterwards), so that each row can
    say how long pvschedd's policy programs ran on the host's tracepoints
    during it (bpftool's run_time_ns; the programs run in the context of
    every switching or waking thread, a vCPU thread's too, and count in
    its CPU time). Usable as a context manager."""

    def __init__(self, on):
        self.on, self.saved = on, None

    def __enter__(self):
        if self.on:
            self.saved = BPF_STATS.read_text().strip()
            BPF_STATS.write_text("1")
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            BPF_STATS.write_text(self.saved)
            self.saved = None
        return False


def policy_bpf():
    """The pvsched policy's tracepoint programs (name pvs_*, all but the
    agent's own pvs_reeval) so far, summed over every loaded copy: {"ns":
    run time, "runs": run count}, or None if bpftool shows no statistics
    (kernel.bpf_stats_enabled off, no bpftool)."""
    try:
        out = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        progs = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    mine = [p for p in progs if str(p.get("name", "")).startswith("pvs_")
            and p.get("name") != "pvs_reeval" and "run_time_ns" in p]
    if not mine:
        return None
    return {"ns": sum(int(p["run_time_ns"]) for p in mine),
            "runs": sum(int(p.get("run_cnt", 0)) for p in mine)}


def host_aux_cpu_s(guests, daemon):
    """CPU seconds so far of the guests' device processes (none without a
    device) and of pvschedd (0 without it), each with its children."""
    children = process_children()
    return {"device": sum(tree_cpu_s(g.boot.dev.pid, children) for g in guests
                          if g.boot.dev is not None),
            "pvschedd": tree_cpu_s(daemon.proc.p.pid, children) if daemon is not None else 0.0}


# /proc/stat's first line, in order: where the host's CPU time went.
HOST_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def host_cpu_ticks():
    """The host's CPU time so far per /proc/stat field (HOST_CPU_FIELDS),
    in clock ticks, all CPUs together."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    return [int(x) for x in parts[1:1 + len(HOST_CPU_FIELDS)]]


def host_cpu_s(t0, t1):
    """CPU-seconds per HOST_CPU_FIELDS field between two host_cpu_ticks()."""
    hz = os.sysconf("SC_CLK_TCK")
    return {k: round((b - a) / hz, 2) for k, a, b in zip(HOST_CPU_FIELDS, t0, t1)}


# The figures of `pvsched-bench host-costs` a row keeps (µs of CPU each).
HOST_COSTS = ("wake_same_cpu_us", "wake_same_cpu_timer_us", "wake_other_cpu_us",
              "timer_sleep_us", "setattr_preempting_us", "setattr_queued_us")


def host_costs(args):
    """What a wake-up, a sleep and a sched_setattr cost the host now (one
    short round of `pvsched-bench host-costs`): the price of each thing
    pvschedd does, which a host that is itself a VM changes over a day.
    None without --host-costs-bin, or if it failed (logged: the run goes
    on without it)."""
    if args.host_costs_bin is None:
        return None
    cmd = [str(args.host_costs_bin), "host-costs", "--ops", "5000", "--rounds", "1",
           "--json", "-"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        j = json.loads(out.stdout)
        return {k: j[k]["median"] for k in HOST_COSTS if j[k]["median"] is not None}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as e:
        log(f"host-costs: {' '.join(cmd)}: {e}")
        return None


def guest_ipis(fields):
    """The IPIs the guest's CPUs received during the run ("@@ result"'s
    ipi_res, ipi_cal and ipi_tlb: /proc/interrupts' RES, CAL and TLB lines),
    or None from a guest image that does not count them."""
    try:
        out = {k: int(fields[f"ipi_{k}"]) for k in GUEST_IPIS}
    except (KeyError, ValueError):
        return None
    # Cross-CPU wake-ups and context switches, from images that count them.
    for k in ("rwk", "csw"):
        if f"ipi_{k}" in fields:
            try:
                out[k] = int(fields[f"ipi_{k}"])
            except ValueError:
                pass
    return out


# The unit of each workload's throughput.
UNITS = {"cpu": "bogo ops/s", "batch": "bogo ops/s", "tlb": "bogo ops/s", "membarrier": "bogo ops/s",
         "hackbench": "messages/s", "dbench": "MB/s"}
STRESSORS = {"cpu": "cpu", "batch": "cpu", "tlb": "tlb-shootdown", "membarrier": "membarrier"}


def mixed(w):
    """Whether `w` gives its VMs different workloads (A+B+...)."""
    return "+" in w


def vm_workloads(w, n):
    """The workload of each of `n` VMs: `w` for all of them, or for a mix
    A+B+... the i-th part for VM i, the parts taken again from the first
    when there are more VMs than parts (hackbench+cpu+cpu: one IPI-heavy
    VM beside two batch ones)."""
    parts = w.split("+")
    return [parts[i % len(parts)] for i in range(n)]


def throughput(w, out):
    """(rate, iterations) of workload `w` from its output in one guest,
    each by the tool's own timing: stress-ng's bogo ops per second of real
    time (its bogo ops), hackbench's messages over the sum of its
    invocations' `Time:` (its invocations), dbench's MB/s (its operations,
    the sum of its operation table's counts)."""
    text = "\n".join(out)
    if w in STRESSORS:
        m = stress_ng_metrics(text, STRESSORS[w])
        if m is None:
            raise BenchError(f"no metrics of {STRESSORS[w]} in: {out[-5:]}")
        return m["rate"], m["ops"]
    if w == "hackbench":
        times = [float(x) for x in re.findall(r"^Time: ([0-9.]+)", text, re.M)]
        if not times or sum(times) <= 0:
            raise BenchError(f"no hackbench Time: in: {out[-5:]}")
        return len(times) * HACKBENCH_MESSAGES / sum(times), len(times)
    m = re.search(r"Throughput ([0-9.]+) MB/sec", text)
    if not m:
        raise BenchError(f"no dbench throughput in: {out[-5:]}")
    ops = sum(int(c) for c in re.findall(r"^\s*[A-Z][A-Za-z]+\s+(\d+)\s", text, re.M))
    return float(m.group(1)), ops


def host_probe_cmd(dur, out, prio=0):
    """A SCHED_OTHER nice-0 cyclictest on the host: how long an ordinary
    host thread that wakes every ms waits for a CPU beside the guests
    (co-scheduled phases and FIFO vCPUs make it wait; the hogs' bogo ops do
    not show that). With `prio` > 0, SCHED_FIFO `prio` instead."""
    policy = ["-p", str(prio), "--policy=fifo"] if prio > 0 else ["-p", "0", "--policy=other"]
    return ["cyclictest", *policy, "-i", "1000", "-t", "1", "-q",
            "-D", str(dur), "-h", "100000", "--histfile=/dev/null", f"--json={out}"]


# ---------------------------------------------------------------- the run

def machine(args, release, loadavg_start, autogroup):
    return {"cpus": os.cpu_count(), "host_kernel": platform.release(),
            "qemu": first_line([str(args.qemu11), "--version"]), "accel": "tcg,thread=multi",
            "guest_kernel": release,
            "guest_mem": f"{MIB_PER_VCPU} MiB per vCPU, at least {MIN_MIB} MiB",
            "stress_ng_host": first_line(["stress-ng", "--version"]),
            "loadavg_start": loadavg_start,
            "autogroup": autogroup,
            "cgroups": {"none, vanilla, pvsched, fifo1": (
                "every QEMU thread and the hogs in the root cpu cgroup (cgroup v1), each "
                "thread one nice-0 share" if autogroup != "on" else
                "the root cpu cgroup (cgroup v1) with autogroup on: all the VMs' QEMUs (the "
                "harness's session) one nice-0 share, the hogs (a session of their own) "
                "another"),
                        "weight": f"each VM's QEMU in {CGROUP_CPU}/pvsched-s6-vm, cpu.shares "
                        f"{WEIGHT_SHARES}; the hogs in the root cgroup"},
            "note": "emulated guests (QEMU TCG) on a shared 2-CPU host"}


def initramfs_extras(chroot, release):
    files = modprobe_files(chroot, release)
    for b in ("/usr/bin/stress-ng", "/usr/bin/hackbench", "/usr/bin/dbench"):
        if not (chroot / b.lstrip("/")).exists():
            raise FileNotFoundError(f"{chroot}{b} (scripts/setup.d/46-s6.sh installs it)")
        files.update(chroot_binary(chroot, b, b))
    files["/usr/share/dbench/client.txt"] = chroot / "usr/share/dbench/client.txt"
    files["/bench.sh"] = GUEST_SCRIPT
    return files


def parse_topology(text):
    out = []
    for t in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", t.strip())
        if not m:
            raise argparse.ArgumentTypeError(f"topology '{t}': expected NxV, e.g. 2x2")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def measure():
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release"
    cache = Path(os.environ.get("PVSCHED_CACHE", REPO / ".cache"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="7.3-cloud", help="a kernel of kernels.conf")
    ap.add_argument("--topology", type=parse_topology, default=parse_topology("1x2"),
                    help="NxV[,NxV...]: N guests of V vCPUs (default 1x2)")
    ap.add_argument("--workloads", default="cpu,tlb,hackbench,dbench",
                    help=f"comma-separated, of {','.join(WORKLOADS)}")
    ap.add_argument("--variants", default="none,vanilla,pvsched,fifo1,weight",
                    help=f"comma-separated, of {','.join(VARIANTS)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=20, help="seconds per workload")
    ap.add_argument("--hogs", type=int, default=os.cpu_count(),
                    help="host CPU hogs beside the guests (0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="1 rep, 8 s per workload, workloads cpu,hackbench")
    ap.add_argument("--json", default=None,
                    help="write the raw rows here ('-': stdout), also after each round")
    ap.add_argument("--cache", type=Path, default=cache)
    ap.add_argument("--out", type=Path, default=None, help="work files (default CACHE/bench-s6)")
    ap.add_argument("--device-bin", type=Path, default=target / "pvsched-device")
    ap.add_argument("--pvsched-bin", type=Path, default=target / "pvsched")
    ap.add_argument("--pvschedd-bin", type=Path, default=target / "pvschedd")
    ap.add_argument("--qemu11", type=Path, default=None)
    ap.add_argument("--host-costs-bin", type=Path, default=None,
                    help="pvsched-bench: run its host-costs before every round and keep "
                         "the figures in the round's rows (pvsched-bench s6 passes itself)")
    ap.add_argument("--cpu", default="max",
                    help="QEMU's -cpu model for every guest (default max). "
                         "'max,hypervisor=off' hides the CPUID hypervisor bit: the guest "
                         "then takes contended spinlocks through the queued slow path, "
                         "whose lock:contention_* tracepoints a KVM guest with "
                         "paravirtual spinlocks also fires, instead of the "
                         "virt_spin_lock() test-and-set loop a TCG guest uses")
    ap.add_argument("--host-probe", action="store_true",
                    help="run a SCHED_OTHER cyclictest on the host beside every workload "
                         "(its p99 and max: what the variant costs an ordinary host "
                         "thread's wake-ups)")
    ap.add_argument("--host-probe-prio", type=int, default=0, metavar="N",
                    help="with --host-probe: run the probe at SCHED_FIFO N (1-99) instead "
                         "of SCHED_OTHER")
    add_autogroup_option(ap, "the VMs together against the hogs")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.duration = 1, 8
        if args.workloads == ap.get_default("workloads"):
            args.workloads = "cpu,hackbench"
    args.workloads = args.workloads.split(",")
    variants = args.variants.split(",")
    for w in args.workloads:
        if any(part not in WORKLOADS for part in w.split("+")):
            ap.error(f"unknown workload {w}")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")
    if not 0 <= args.host_probe_prio <= 99 or (args.host_probe_prio and not args.host_probe):
        ap.error("--host-probe-prio takes 1-99 and needs --host-probe")
    args.out = args.out or args.cache / "bench-s6"
    args.qemu11 = args.qemu11 or args.cache / "qemu11" / "qemu-system-x86_64"
    for p in (args.device_bin, args.pvsched_bin, args.pvschedd_bin, args.qemu11):
        if not p.exists():
            raise FileNotFoundError(f"{p} (build it: see `python3 -m pvsched_bench s6 --help`)")
    if os.geteuid() != 0:
        raise BenchError("run as root (BPF, RT priorities, cgroups)")
    # Boot's settings (pvsched_guest.boot.Boot).
    args.timeout = BOOT_S + len(args.workloads) * (args.duration + 600)
    args.kernel_log = False
    args.tag, args.load_append = "", ""
    release, chroot, args.vmlinuz = matrix_kernel(args.cache, args.kernel)
    args.out.mkdir(parents=True, exist_ok=True)
    args.initrd = build_initramfs(None, args.out, extra_files=initramfs_extras(chroot, release))
    la0 = loadavg()
    log(f"guest kernel {release}; workloads {','.join(args.workloads)}; variants "
        f"{','.join(variants)}; {args.reps} reps of {args.duration} s; hogs {args.hogs}; "
        f"-cpu {args.cpu}; load average {la0}")
    cgroup = None
    rows, caps = [], {}
    t_all = time.monotonic()
    pv = any(v.startswith("pvsched") for v in variants)
    # The policy's BPF run time is part of a pvsched VM's cost.
    with Autogroup(args.autogroup) as autogroup, BpfStats(pv):
        ag_state = autogroup.state
        log(f"autogroup {ag_state}")
        try:
            if "weight" in variants:
                cgroup = weight_cgroup("pvsched-s6-vm")
            for topo in args.topology:
                for rep in range(args.reps):
                    # Repetition r starts at variant r mod k: no variant
                    # always runs first (a fresh host) or after another.
                    k = rep % len(variants)
                    for order, v in enumerate(variants[k:] + variants[:k]):
                        costs = host_costs(args)
                        for r in run_round(args, topo, v, rep, cgroup, caps):
                            r.update(topology=f"{topo[0]}x{topo[1]}", rep=rep, order=order)
                            if costs is not None:
                                r["host_costs"] = costs
                            rows.append(r)
                        if args.json and args.json != "-":
                            # What is done so far, so that a run cut short
                            # (a failed boot, ^C) keeps its rounds.
                            doc = raw_doc(args, caps, release, la0, ag_state, t_all, rows,
                                          variants, partial=True)
                            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        finally:
            remove_cgroup(cgroup)
    text = json.dumps(raw_doc(args, caps, release, la0, ag_state, t_all, rows, variants,
                              partial=False), indent=1)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
    failed = sum(1 for r in rows if r.get("error"))
    log(f"{len(rows)} rows, {failed} failed, in {time.monotonic() - t_all:.0f} s")
    return 0


def raw_doc(args, caps, release, la0, ag_state, t_all, rows, variants, partial):
    """The raw result: the run's settings and one row per run (the report is
    `pvsched-bench s6`'s)."""
    return {"scenario": "s6", "partial": partial, "quick": args.quick, "reps": args.reps,
            "duration_s": args.duration, "hogs": args.hogs, "kernel": args.kernel,
            "cpu": args.cpu, "variants": variants, "workloads": args.workloads,
            "topologies": [f"{n}x{v}" for n, v in args.topology],
            "min_iters": MIN_ITERS, "caps": caps,
            "machine": machine(args, release, la0, ag_state),
            "command": " ".join(sys.argv),
            "seconds": round(time.monotonic() - t_all, 1), "rows": rows}


def main():
    """`python3 -m pvsched_bench s6`: exits with run_main's code."""
    run_main("s6", measure)
