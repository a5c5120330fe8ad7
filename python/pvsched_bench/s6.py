#!/usr/bin/env python3
"""S6: throughput of real Linux guests under overcommit, per host
CPU-second, vanilla against pvsched and what a user would pick instead.

What it runs
------------
N guests of V vCPUs each (`--topology NxV`, default 1x2), Debian kernel
`--kernel` of tests/linux-guest/kernels.conf (default 7.3-cloud) under
QEMU 11 TCG (`-accel tcg,thread=multi`, 256 MiB per vCPU, at least
512 MiB), each with the pvsched device over
vfio-user in device-region mode and the DKMS-built module loaded (by
modprobe) in every variant. The workloads are Debian's programs from the
kernel's suite chroot (scripts/setup.d/46-s6.sh), copied with their
libraries into the initramfs; bench/s6/bench.sh runs them:

  cpu         stress-ng --cpu V --cpu-method int64 (control: compute, no
              synchronisation; must not regress)
  tlb         stress-ng --tlb-shootdown V (TLB-shootdown IPIs)
  membarrier  stress-ng --membarrier V (expedited membarrier IPIs)
  hackbench   hackbench -g 2 -f 10 -l 100 in a loop (sockets, wakeups)
  dbench      dbench 2V on tmpfs (VFS, locks)

The host's autogroup is off for the run (`--autogroup`; put back
afterwards), so that every thread of the root cgroup is one nice-0 share:
with autogroup on, the VMs (in the harness's session) and the hogs (in a
session of their own) split the CPUs by session, and that split swings
from run to run (2x2 vanilla hackbench, three runs: VM CPU 11.1-20.5 s,
hog work 365-35 152 bogo ops; with it off 13.4-14.4 s and 23 114-24 698).

Beside the guests, unless --hogs 0: `stress-ng --cpu H --cpu-method int64`
on the host (H = --hogs, default one per host CPU), whose bogo ops are the
host work a variant leaves to others.

Variants (--variants, each booted fresh, repetitions interleaved):

  vanilla   every QEMU thread SCHED_OTHER nice 0, in the root cpu cgroup
            with the hogs
  pvsched   pvschedd (started once), the device's BAR2 its region map
            (`pvsched device --daemon-region`), the VM registered by
            `pvsched qemu-attach --device-region` with the daemon's default
            caps (printed), QEMU's main loop as the emulator thread
  pvsched-nocs, pvsched-nowait, pvsched-nolock
            ablations: the same with the guest's critical sections
            ignored (cs_rt_prio = 0), its wait_on hints (wait_on = false)
            or its lock waits (lock_wait = false, the default since
            2026-11-27)
  pvsched-lock
            lock waits honoured (lock_wait = true)
  pvsched-kick, pvsched-nokick, pvsched-auto
            kick pairing always on (kick_pairs = true), off (false), or
            "auto" (only a guest without wait_on, only from a boosted
            sender), whatever the default
  pvsched-none
            the control: registered the same way, every boost clamped to
            nothing (allow_rt = false, nice_floor = 0)
  pvsched-cosched, pvsched-coauto, pvsched-coauto10, pvsched-coauto5
            co-scheduling: a fixed phase at the VM's fair share (cosched_us
            computed from the topology, 20 ms period), or cosched_us =
            "auto" at the default 20 ms period, at 10 ms or at 5 ms
  fifo1     every vCPU thread SCHED_FIFO 1 (KubeVirt's realtime setting,
            libvirt's <vcpusched scheduler='fifo' priority='1'/>)
  weight    QEMU in its own cpu cgroup with cpu.shares 4096 (cgroup v1;
            cgroup v2's cpu.weight 400), the hogs in the root group

Per workload, topology and variant: the tool's own throughput (stress-ng
bogo ops per second, hackbench messages per second, dbench MB/s), summed
over the VMs; the CPU time the VMs' QEMU processes used (utime + stime
from /proc) and the throughput per CPU-second; the hogs' bogo ops; and for
pvsched, pvschedd's boosts, throttles and boosted on-CPU time of the VMs'
threads. Ratios are against vanilla's median.

Usage
-----
  scripts/setup            # QEMU 11, the matrix kernels' chroots, the workloads
  cargo build --release -p pvsched-transport --bin pvsched-device \\
      -p pvsched --bin pvsched -p pvsched-daemon --bin pvschedd
  python3 bench/s6.py [--quick] [--reps 5] [--duration 20] \\
      [--topology 1x2,2x2,3x2,1x4] [--workloads cpu,tlb,hackbench,dbench] \\
      [--variants vanilla,pvsched,fifo1,weight] [--hogs 2] [--host-probe] [--json s6.json]

--host-probe runs a SCHED_OTHER cyclictest on the host beside every
workload: what a variant costs an ordinary host thread's wake-ups (FIFO
vCPUs and co-scheduled phases make it wait), which the hogs' work does not
show. --host-probe-prio N runs it at SCHED_FIFO N instead: a host service
an operator raised above the phases' FIFO 1 and the policy's boosts.

A guest that does not report a workload within --duration + 120 s (static
FIFO under overcommit can starve QEMU's main loop, which raises a TCG
guest's timers) is recorded as no result for that workload and the rest of
its round (`error` in the run, `no_result` in the summary); the benchmark
goes on with the next round. A workload that exits non-zero in a guest is
recorded the same way, and the round goes on with the next workload.

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
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.dont_write_bytecode = True
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests" / "linux-guest"))
from pvsched_guest.bench import (Autogroup, add_autogroup_option,  # noqa: E402
                                 BenchError, CGROUP_CPU, Daemon, Proc,
                                 WEIGHT_SHARES, between, driver_counters, first_line,
                                 loadavg, qemu_cpu_s, ratio, remove_cgroup, run_main,
                                 parse_cyclictest, set_fifo1, stat_cpu_s, status_vm, thread_cpu_s,
                                 thread_stats, vm_caps, weight_cgroup)
from pvsched_guest.boot import Boot  # noqa: E402
from pvsched_guest.host import fair_slice, set_fair_slice  # noqa: E402
from pvsched_guest.kernel import (build_initramfs, chroot_binary, matrix_kernel,  # noqa: E402
                                  modprobe_files)
from pvsched_guest.qmp import qmp  # noqa: E402

WORKLOADS = ("cpu", "tlb", "membarrier", "hackbench", "dbench")
VARIANTS = ("vanilla", "pvsched", "pvsched-nocs", "pvsched-nowait", "pvsched-nolock",
            "pvsched-lock", "pvsched-kick", "pvsched-nokick", "pvsched-auto", "pvsched-none",
            "pvsched-cosched", "pvsched-coauto", "pvsched-coauto10", "pvsched-coauto5",
            "fifo1", "weight", "slice")
# The pvsched ablations: the daemon's default caps but for a line or two
# (pvschedd reads them from its vm_dir, NAME.toml). pvsched-none is the
# control: registered, every boost clamped to nothing.
ABLATION_CAPS = {"pvsched-nocs": "cs_rt_prio = 0\n", "pvsched-nowait": "wait_on = false\n",
                 "pvsched-nolock": "lock_wait = false\n", "pvsched-lock": "lock_wait = true\n",
                 "pvsched-kick": "kick_pairs = true\n",
                 "pvsched-nokick": "kick_pairs = false\n",
                 "pvsched-auto": "kick_pairs = \"auto\"\n",
                 "pvsched-none": "allow_rt = false\nnice_floor = 0\n",
                 "pvsched-cosched": None,
                 "pvsched-coauto": "cosched_us = \"auto\"\n",
                 # Half the default period: what a shorter phase costs the
                 # VM's work and saves a host thread's wake-ups.
                 "pvsched-coauto10": "cosched_us = \"auto\"\ncosched_period_us = 10000\n",
                 "pvsched-coauto5": "cosched_us = \"auto\"\ncosched_period_us = 5000\n"}
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


# The guest driver's debugfs counters kept per workload (summed over CPUs).
GUEST_COUNTERS = ("updates", "waits", "lock_waits")
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
    counted)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += stat_cpu_s(f"/proc/{p}/stat")
        except OSError:
            continue
        todo += children.get(p, [])
    return total


def stress_ng_ops(text, stressor):
    """Bogo ops of `stressor` from stress-ng's -Y YAML (or its brief
    metrics lines when the YAML is missing)."""
    m = re.search(rf"stressor: {stressor}\s*\n\s*bogo-ops: (\d+)", text)
    if m:
        return int(m.group(1))
    m = re.search(rf"metrc:.*\] {stressor}\s+(\d+)\s", text)
    return int(m.group(1)) if m else None


class WorkloadFailed(BenchError):
    """A guest's workload exited non-zero; the guests still answer."""


class NoProgress(BenchError):
    """A guest did not report its workload in time: the variant starved it."""


class GuestEnded(BenchError):
    """A guest's boot ended while it had a command to answer (a soft lockup
    the boot stopped at, QEMU gone)."""


# ---------------------------------------------------------------- one guest

class Guest:
    """One QEMU guest serving bench/s6/bench.sh's commands. Its boot runs in
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
        dev = None
        if variant.startswith("pvsched"):
            dev = daemon.device_cmd(name)
            caps = daemon.vms / f"{name}.toml"
            if variant == "pvsched-cosched":
                caps.write_text(cosched_caps(nvm, vcpus, args.hogs))
            elif variant in ABLATION_CAPS:
                caps.write_text(ABLATION_CAPS[variant])
            elif caps.exists():
                caps.unlink()
        self.boot = Boot(args, name, vcpus, "bench", transport="vfio-user", device_cmd=dev,
                         hooks={"bench-wait": self._on_wait},
                         extra_append="pvload=modprobe",
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


def apply_variant(g, variant, daemon, cgroup):
    """Puts guest `g` under `variant` once it waits for its first command."""
    pid = g.boot.qemu.pid
    if variant.startswith("pvsched"):
        daemon.pvsched("qemu-attach", "--qmp", str(g.boot.qmp_path), "--name", g.name,
                       "--pid", str(pid), "--device-region")
        if variant not in daemon.caps:
            daemon.caps[variant] = vm_caps(daemon, g.name)
            log(f"{variant} caps: {daemon.caps[variant]}")
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

def run_round(args, topo, variant, rep, daemon, cgroup):
    """Boots topo's guests under `variant`, runs every workload on all of
    them at once (with the hogs), and returns one row per workload."""
    nvm, vcpus = topo
    tag = f"{nvm}x{vcpus}-{variant}-r{rep}"
    guests = [Guest(args, f"s6-{tag}-vm{i}", vcpus, variant, daemon, nvm) for i in range(nvm)]
    rows = []
    # Why the guests stopped answering, once they have.
    stuck = None
    try:
        for g in guests:
            g.thread.start()
        for g in guests:
            g.wait_ready(BOOT_S)
            apply_variant(g, variant, daemon, cgroup)
            if variant.startswith("pvsched"):
                g.guest_counters()  # the baseline: boot and attach
        for w in args.workloads:
            if stuck is not None:
                rows.append(no_progress_row(w, variant, tag, f"not run: {stuck}"))
                log(f"{tag} {w}: {rows[-1]['brief']}")
                continue
            try:
                rows.append(run_workload(args, tag, guests, w, variant, daemon))
            except WorkloadFailed as e:
                rows.append(no_progress_row(w, variant, tag, str(e)))
            except (NoProgress, GuestEnded) as e:
                # Recorded, not fatal: the variant starved its guests or
                # locked them up (FIFO 1 vCPUs that outnumber the CPUs can).
                # They cannot take another command; QEMU is stopped below.
                stuck = str(e)
                rows.append(no_progress_row(w, variant, tag, stuck))
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
    bench/phase_trace.py can tell the workload runs from boots; nothing
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


def no_progress_row(w, variant, tag, why):
    """The row of a workload that gave no result: it counts as a failed
    run of its variant, with no figures."""
    return {"workload": w, "variant": variant, "tag": tag, "throughput": None, "vm_cpu_s": None,
            "per_cpu_s": None, "hog_ops": None, "error": why, "vms": [],
            "brief": f"NO RESULT: {why}"}


def run_workload(args, tag, guests, w, variant, daemon):
    dur = args.duration
    cpu0 = [qemu_cpu_s(g.boot.qemu.pid) for g in guests]
    thr0 = [thread_cpu_s(g.boot.qemu.pid) for g in guests]
    # The host processes beside the guests: each guest's device process
    # (every variant has one) and, for pvsched, the daemon.
    aux0 = host_aux_cpu_s(guests, daemon, variant)
    bpf0 = policy_bpf() if args.bpf_stats else None
    st0 = daemon.status() if variant.startswith("pvsched") else None
    la = loadavg()
    hogs = None
    if args.hogs:
        hog_dir = args.out / "hogs"
        hog_dir.mkdir(parents=True, exist_ok=True)
        yaml = hog_dir / f"{tag}-{w}.yaml"
        hogs = Proc("hogs", ["stress-ng", "--cpu", str(args.hogs), "--cpu-method", "int64",
                             "-t", str(dur), "--metrics-brief", "-Y", str(yaml)],
                    hog_dir / f"{tag}-{w}.log")
    probe = None
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
    trace_mark(f"s6 start {tag} {w}")
    for g in guests:
        g.cmd.put(f"run {w} {dur}")
    try:
        for g in guests:
            g.wait_ready(dur + PROGRESS_S)
    finally:
        if sys.exc_info()[0] is not None:
            for p in (hogs, probe):
                if p is not None and p.p.poll() is None:
                    p.stop()
    wall = time.monotonic() - t0
    trace_mark(f"s6 end {tag} {w}")
    cpu1 = [qemu_cpu_s(g.boot.qemu.pid) for g in guests]
    thr1 = [thread_cpu_s(g.boot.qemu.pid) for g in guests]
    aux1 = host_aux_cpu_s(guests, daemon, variant)
    bpf1 = policy_bpf() if bpf0 is not None else None
    hog_ops = None
    if hogs is not None:
        hogs.wait(dur + 60)
        hogs.stop()
        hog_ops = stress_ng_ops(yaml.read_text() if yaml.exists() else "", "cpu")
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
    for g, c0, c1, t0, t1 in zip(guests, cpu0, cpu1, thr0, thr1):
        if not g.results:
            raise BenchError(f"{g.name}: no result for {w} (see {g.boot.dir}/serial.log)")
        # Every guest's counters, a failed one's too: the next workload's
        # are taken against them.
        counters = g.guest_counters() if variant.startswith("pvsched") else None
        fields, out = g.results[-1]
        if fields.get("w") != w or fields.get("rc") != "0":
            failed.append(f"{g.name}: {w} failed: {fields} {out[-5:]}")
            continue
        vms.append({"vm": g.name, "throughput": throughput(w, fields, out),
                    "guest_secs": float(fields["secs"]), "cpu_s": round(c1 - c0, 2),
                    "threads_cpu_s": {k: round(t1[k] - t0[k], 2) for k in t0}})
        ipis = guest_ipis(fields)
        if ipis is not None:
            vms[-1]["guest_ipis"] = ipis
        if counters is not None:
            vms[-1]["guest_counters"] = counters
    if failed:
        raise WorkloadFailed("; ".join(failed))
    tp = sum(v["throughput"] for v in vms)
    cpu = sum(v["cpu_s"] for v in vms)
    row = {"workload": w, "variant": variant, "tag": tag, "throughput": round(tp, 2),
           "vm_cpu_s": round(cpu, 2), "per_cpu_s": round(tp / cpu, 4) if cpu else None,
           "hog_ops": hog_ops, "wall_s": round(wall, 1), "loadavg_start": la, "vms": vms,
           "probe_p99_us": probe_fig and probe_fig["p99_us"],
           "probe_max_us": probe_fig and probe_fig["max_us"]}
    if probe_fig is not None:
        row["host_probe"] = probe_fig
    if st0 is not None:
        st1 = daemon.status()
        pol = {"boosts": 0, "throttles": 0, "boosted_ns": 0, "phase_changes": 0}
        for g in guests:
            a, b = thread_stats(st0, g.name), thread_stats(st1, g.name)
            if a and b:
                for k in pol:
                    pol[k] += b[k] - a[k]
        row["policy"] = {"boosts": pol["boosts"], "throttles": pol["throttles"],
                         "boosted_s": round(pol["boosted_ns"] / 1e9, 3),
                         "phase_changes": pol["phase_changes"]}
        # Each VM's co-scheduled phase as the run ended (what "auto" measured).
        phases = [(status_vm(st1, g.name) or {}).get("cosched_now_us", 0) for g in guests]
        if any(phases):
            row["cosched_now_us"] = phases
    row["aux_cpu_s"] = {k: round(aux1[k] - aux0[k], 3) for k in aux0}
    if bpf0 is not None and bpf1 is not None:
        # Host-wide: every thread's events, the hogs' and the VMs' alike.
        row["policy_bpf"] = {"ms": round((bpf1["ns"] - bpf0["ns"]) / 1e6, 1),
                             "runs": bpf1["runs"] - bpf0["runs"]}
    gc = [v["guest_counters"] for v in vms if v.get("guest_counters")]
    if gc:
        row["guest_counters"] = {k: sum(c[k] for c in gc) for k in GUEST_COUNTERS}
    gi = [v["guest_ipis"] for v in vms if v.get("guest_ipis")]
    if vms and len(gi) == len(vms):
        row["guest_ipis"] = {k: sum(c[k] for c in gi) for k in GUEST_IPIS}
        # IPIs per second of a guest's run, the mean over the VMs: how much
        # the workload signals other vCPUs (a wake-up, a function call, a
        # TLB flush), which is what running them together can speed up.
        rates = [sum(c.values()) / v["guest_secs"] for c, v in zip(gi, vms) if v["guest_secs"] > 0]
        row["ipis_per_s"] = round(statistics.mean(rates), 1) if rates else None
    split = {k: round(sum(v["threads_cpu_s"][k] for v in vms), 1) for k in ("vcpus", "main", "other")}
    row["brief"] = (f"throughput {tp:.1f}, VM CPU {cpu:.1f}s {split}, per CPU-s "
                    f"{row['per_cpu_s']}, hogs {hog_ops}"
                    + (f", policy {row['policy']}" if "policy" in row else "")
                    + (f", guest {row['guest_counters']}" if "guest_counters" in row else "")
                    + (f", guest IPIs {row['guest_ipis']}" if "guest_ipis" in row else "")
                    + f", beside {row['aux_cpu_s']}"
                    + (f", policy BPF {row['policy_bpf']}" if "policy_bpf" in row else "")
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


def host_aux_cpu_s(guests, daemon, variant):
    """CPU seconds so far of the guests' device processes and of pvschedd."""
    children = process_children()
    out = {"devices": sum(tree_cpu_s(g.boot.dev.pid, children) for g in guests
                          if g.boot.dev is not None)}
    if variant.startswith("pvsched"):
        out["pvschedd"] = tree_cpu_s(daemon.proc.p.pid, children)
    return out


def guest_ipis(fields):
    """The IPIs the guest's CPUs received during the run ("@@ result"'s
    ipi_res, ipi_cal and ipi_tlb: /proc/interrupts' RES, CAL and TLB lines),
    or None from a guest image that does not count them."""
    try:
        return {k: int(fields[f"ipi_{k}"]) for k in GUEST_IPIS}
    except (KeyError, ValueError):
        return None


def throughput(w, fields, out):
    """The tool's own throughput metric of workload `w`, per second."""
    text = "\n".join(out)
    secs = float(fields["secs"])
    if w in ("cpu", "tlb", "membarrier"):
        stressor = {"cpu": "cpu", "tlb": "tlb-shootdown", "membarrier": "membarrier"}[w]
        ops = stress_ng_ops(text, stressor)
        if ops is None:
            raise BenchError(f"no bogo ops of {stressor} in: {out[-5:]}")
        return ops / secs
    if w == "hackbench":
        # 2 groups x 10 senders x 10 receivers x 100 loops per run.
        return int(fields["iters"]) * 2 * 10 * 10 * 100 / secs
    m = re.search(r"Throughput ([0-9.]+) MB/sec", text)
    if not m:
        raise BenchError(f"no dbench throughput in: {out[-5:]}")
    return float(m.group(1))


# ---------------------------------------------------------------- report

# A row's figures summarized per variant (the probe's: None without --host-probe).
FIGURES = ("throughput", "vm_cpu_s", "per_cpu_s", "hog_ops", "probe_p99_us", "probe_max_us",
           "ipis_per_s")


def host_probe_cmd(dur, out, prio=0):
    """A SCHED_OTHER nice-0 cyclictest on the host: how long an ordinary
    host thread that wakes every ms waits for a CPU beside the guests
    (co-scheduled phases and FIFO vCPUs make it wait; the hogs' bogo ops do
    not show that). With `prio` > 0, SCHED_FIFO `prio` instead."""
    policy = ["-p", str(prio), "--policy=fifo"] if prio > 0 else ["-p", "0", "--policy=other"]
    return ["cyclictest", *policy, "-i", "1000", "-t", "1", "-q",
            "-D", str(dur), "-h", "100000", "--histfile=/dev/null", f"--json={out}"]


def summarize(rows, variants):
    """Per (topology, workload): each variant's medians and spread, and
    ratios to vanilla's median."""
    out = {}
    keys = sorted({(r["topology"], r["workload"]) for r in rows})
    for topo, w in keys:
        cell = {}
        for v in variants:
            rs = [r for r in rows if r["topology"] == topo and r["workload"] == w
                  and r["variant"] == v]
            if not rs:
                continue
            s = {}
            for k in FIGURES:
                vals = [r[k] for r in rs if r.get(k) is not None]
                s[k] = stats(vals)
            s["no_result"] = [r["error"] for r in rs if r.get("error")]
            if any("policy" in r for r in rs):
                s["policy"] = [r.get("policy") for r in rs]
            cell[v] = s
        van = cell.get("vanilla")
        if van:
            vrows = {r["rep"]: r for r in rows if r["topology"] == topo and r["workload"] == w
                     and r["variant"] == "vanilla"}
            for v, s in cell.items():
                if v == "vanilla":
                    continue
                s["ratio"] = {k: ratio(s[k]["median"], van[k]["median"]) for k in FIGURES}
                # The same rep's vanilla ran next to it, under the same
                # outer-host conditions (this host is itself a VM): the
                # median of the per-rep ratios is the steadier figure.
                paired = {}
                for k in FIGURES:
                    rs = [ratio(r.get(k), vrows[r["rep"]].get(k)) for r in rows
                          if r["topology"] == topo and r["workload"] == w and r["variant"] == v
                          and r["rep"] in vrows]
                    paired[k] = stats([x for x in rs if x is not None])
                s["paired_ratio"] = paired
        out[f"{topo}/{w}"] = cell
    return out


def stats(vals):
    if not vals:
        return {"median": None, "mean": None, "min": None, "max": None, "reps": []}
    return {"median": round(statistics.median(vals), 4), "mean": round(statistics.mean(vals), 4),
            "min": min(vals), "max": max(vals), "reps": vals}


def machine(args, release, loadavg_start, autogroup):
    return {"cpus": os.cpu_count(), "host_kernel": platform.release(),
            "qemu": first_line([str(args.qemu11), "--version"]), "accel": "tcg,thread=multi",
            "guest_kernel": release,
            "guest_mem": f"{MIB_PER_VCPU} MiB per vCPU, at least {MIN_MIB} MiB",
            "stress_ng_host": first_line(["stress-ng", "--version"]),
            "loadavg_start": loadavg_start,
            "autogroup": autogroup,
            "cgroups": {"vanilla, pvsched, fifo1": (
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
    files["/bench.sh"] = HERE / "s6" / "bench.sh"
    return files


def parse_topology(text):
    out = []
    for t in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", t.strip())
        if not m:
            raise argparse.ArgumentTypeError(f"topology '{t}': expected NxV, e.g. 2x2")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def main():
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release"
    cache = Path(os.environ.get("PVSCHED_CACHE", REPO / ".cache"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="7.3-cloud", help="a kernel of kernels.conf")
    ap.add_argument("--topology", type=parse_topology, default=parse_topology("1x2"),
                    help="NxV[,NxV...]: N guests of V vCPUs (default 1x2)")
    ap.add_argument("--workloads", default="cpu,tlb,hackbench,dbench",
                    help=f"comma-separated, of {','.join(WORKLOADS)}")
    ap.add_argument("--variants", default="vanilla,pvsched,fifo1,weight",
                    help=f"comma-separated, of {','.join(VARIANTS)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=20, help="seconds per workload")
    ap.add_argument("--hogs", type=int, default=os.cpu_count(),
                    help="host CPU hogs beside the guests (0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="1 rep, 8 s per workload, workloads cpu,hackbench")
    ap.add_argument("--json", default=None, help="write the result here ('-': stdout)")
    ap.add_argument("--cache", type=Path, default=cache)
    ap.add_argument("--out", type=Path, default=None, help="work files (default CACHE/bench-s6)")
    ap.add_argument("--device-bin", type=Path, default=target / "pvsched-device")
    ap.add_argument("--pvsched-bin", type=Path, default=target / "pvsched")
    ap.add_argument("--pvschedd-bin", type=Path, default=target / "pvschedd")
    ap.add_argument("--qemu11", type=Path, default=None)
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
    ap.add_argument("--bpf-stats", action="store_true",
                    help="turn the kernel's BPF run-time statistics on for the run "
                         "(kernel.bpf_stats_enabled) and record per run how long the "
                         "policy's programs ran (policy_bpf: host-wide; needs bpftool)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.duration = 1, 8
        if args.workloads == ap.get_default("workloads"):
            args.workloads = "cpu,hackbench"
    args.workloads = args.workloads.split(",")
    variants = args.variants.split(",")
    for w in args.workloads:
        if w not in WORKLOADS:
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
            raise FileNotFoundError(f"{p} (build it: see bench/s6.py's usage)")
    if os.geteuid() != 0:
        raise BenchError("run as root (BPF, RT priorities, cgroups)")
    # Boot's settings (pvsched_guest.boot.Boot).
    args.timeout = BOOT_S + len(args.workloads) * (args.duration + 600)
    args.kernel_log = False
    args.tag, args.load_append = "", ""
    release, chroot, args.vmlinuz = matrix_kernel(args.cache, args.kernel)
    args.out.mkdir(parents=True, exist_ok=True)
    args.initrd = build_initramfs(REPO / "tests" / "linux-guest", None, args.out,
                                  extra_files=initramfs_extras(chroot, release))
    la0 = loadavg()
    log(f"guest kernel {release}; workloads {','.join(args.workloads)}; variants "
        f"{','.join(variants)}; {args.reps} reps of {args.duration} s; hogs {args.hogs}; "
        f"-cpu {args.cpu}; load average {la0}")
    daemon = cgroup = None
    rows = []
    t_all = time.monotonic()
    with Autogroup(args.autogroup) as autogroup, BpfStats(args.bpf_stats):
        ag_state = autogroup.state
        log(f"autogroup {ag_state}")
        try:
            if any(v.startswith("pvsched") for v in variants):
                daemon = Daemon(args, args.out)
            if "weight" in variants:
                cgroup = weight_cgroup("pvsched-s6-vm")
            for topo in args.topology:
                for rep in range(args.reps):
                    # Interleaved, the order rotated per rep.
                    order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                    for v in order:
                        for r in run_round(args, topo, v, rep, daemon, cgroup):
                            r["topology"] = f"{topo[0]}x{topo[1]}"
                            r["rep"] = rep
                            rows.append(r)
                        if args.json and args.json != "-":
                            # What is done so far, so that a run cut short
                            # (a failed boot, ^C) keeps its rounds.
                            doc = result_doc(args, daemon, release, la0, ag_state, t_all,
                                             rows, variants)
                            doc["partial"] = True
                            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        finally:
            if daemon is not None:
                daemon.stop()
            remove_cgroup(cgroup)
    result = result_doc(args, daemon, release, la0, ag_state, t_all, rows, variants)
    text = json.dumps(result, indent=1)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
    print_table(result["summary"], variants)
    return 0


def result_doc(args, daemon, release, la0, ag_state, t_all, rows, variants):
    """The JSON result of the rows run so far."""
    return {"scenario": "s6", "quick": args.quick,
            "caps": daemon.caps if daemon is not None else None, "reps": args.reps,
            "duration_s": args.duration, "hogs": args.hogs, "kernel": args.kernel,
            "cpu": args.cpu,
            "machine": machine(args, release, la0, ag_state),
            "command": " ".join(sys.argv),
            "seconds": round(time.monotonic() - t_all, 1),
            "summary": summarize(rows, variants), "runs": rows}


def print_table(summary, variants):
    for key, cell in summary.items():
        log(f"{key}:")
        for v in variants:
            s = cell.get(v)
            if not s:
                continue
            r = {k: x["median"] for k, x in s.get("paired_ratio", {}).items()}
            log(f"  {v:14} throughput {s['throughput']['median']} "
                f"(x{r.get('throughput', 1.0)}), per CPU-s {s['per_cpu_s']['median']} "
                f"(x{r.get('per_cpu_s', 1.0)}), VM CPU {s['vm_cpu_s']['median']} s "
                f"(x{r.get('vm_cpu_s', 1.0)}), hogs kept x{r.get('hog_ops', 1.0)} "
                f"(paired medians)")


if __name__ == "__main__":
    run_main("s6", main)
