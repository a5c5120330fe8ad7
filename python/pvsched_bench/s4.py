"""S4 seed reproduction: cyclictest in a real Linux guest under
QEMU TCG with the pvsched guest module, vanilla vs pvsched (and what a
user would pick instead: static SCHED_FIFO 1 vCPUs, a cgroup weight).

What it runs
------------
Debian kernels of tests/linux-guest/kernels.conf (`--kernels`, default
7.3-cloud and 6.1-cloud) under QEMU 11 TCG (`-accel tcg,thread=multi -smp
2`, 512 MiB), the pvsched device over vfio-user in device-region mode and
the DKMS-built module loaded by modprobe in both variants, Debian's
`cyclictest` (rt-tests, from the kernel's suite chroot) in the initramfs.
Per boot, four phases, each DURATION seconds:

  loaded i500, loaded i1000   host runs `stress-ng --cpu 2 --iomix 1 --vm 1
                              --vm-bytes 128M --fork 1`
  idle i500, idle i1000       stress-ng stopped (--no-idle: none)

  guest:  cyclictest --mlockall -q -p 8 --policy=rr -i {500,1000} -D DURATION
          -t 1 -h 200000 (1 us histogram up to 200 ms, for p50/p99)
  host:   cyclictest -p 8 --policy=rr -i 500 -t 1 -q -D DURATION -h 200000
          beside it (host impact)

vanilla = no daemon; pvsched = pvschedd (started once) with its default
caps (`--caps FILE`: that file as the VM's caps), the VM registered by
`pvsched qemu-attach --device-region`, QEMU's main-loop thread (which
raises a TCG guest's timers) its emulator thread (`--no-emulator` leaves
it out; the variant pvsched-noemu does the same in one boot of its own,
beside pvsched's; pvsched-kick, pvsched-nokick and pvsched-auto are
pvsched with `kick_pairs = true`, `false` or `"auto"` added to the caps,
whatever the default; pvsched-flat adds `max_rt_prio = 1`, so every boost
of the VM is FIFO 1 and its threads never preempt each other;
pvsched-halt4 adds `halt_prio = 4`, the default max_rt_prio, so a
latency-sensitive vCPU keeps one priority through its halts;
pvsched-cosched adds `cosched_us = 5000`, co-scheduling at about the
guest's fair share beside the load; pvsched-coauto `cosched_us = "auto"`,
which co-schedules no VM with a latency-sensitive vCPU). The alternatives (`--variants vanilla,pvsched,fifo1,weight`):
fifo1 = every vCPU thread SCHED_FIFO 1 (KubeVirt's realtime setting,
libvirt's <vcpusched scheduler='fifo' priority='1'/>; QEMU's main loop
stays SCHED_OTHER, as there); weight = QEMU in its own cgroup with
cpu.shares 4096 (the hogs in the root group). Every QEMU thread starts
SCHED_OTHER nice 0 in every variant, and the host's autogroup is off for
the run (`--autogroup`; put back afterwards): every thread of the root
cgroup is one nice-0 share, as the variants assume (with autogroup on,
QEMU and the host load, in different sessions, would split the CPUs by
session). One boot per (kernel, rep, variant); the variant order rotates
per rep (rep r starts at variant r mod k), and each rep first measures the
idle host's floor (cyclictest at SCHED_FIFO 99 on every CPU, nothing else
running).
stress-ng, every cyclictest and the tracer are always stopped, also on
error, Ctrl-C or SIGTERM.

--trace records the host's scheduler events (bench/trace-run.sh) during
each loaded phase and names every wait over 1 ms of the VM's QEMU threads
(its vCPU threads and main loop) with its cause (python3 -m pvsched_bench stall-trace:
stolen, unboosted, behind-rt, behind-fair, other): `stalls` in the run,
counts per cause in the summary. The trace costs host CPU itself; compare
traced runs with traced runs.

Usage
-----
  bash scripts/setup                  # QEMU 11, the kernels' chroots, rt-tests
  cargo build --release -p pvsched-transport --bin pvsched-device \\
      -p pvsched --bin pvsched -p pvsched-daemon --bin pvschedd
  python3 -m pvsched_bench s4 [--kernels 7.3-cloud,6.1-cloud] [--reps 3] \\
      [--duration 20] [--no-idle] [--trace] [--json s4.json] \\
      [--samples s4-samples.json] [--quick]

Run as root (BPF, RT priorities, tracefs). `--json -` prints the JSON on
stdout (progress goes to stderr); exit 0 on success, 1 on a failed run, 3
when something is missing (binaries, guest kernel, rt-tests/stress-ng),
130 on Ctrl-C. The binaries default to $CARGO_TARGET_DIR (or
target/)/release/. Work files (serial logs, host cyclictest JSON, traces,
pvschedd's log) go to --out (default $PVSCHED_CACHE/bench-s4).

Output (one JSON object: the raw rows; `pvsched-bench s4` computes the
report from them)
------------------------
  scenario "s4", quick, reps, duration_s, machine, command, caps,
  variants, kernels, loads, intervals, ...
  runs: one row per phase run: kernel, variant, rep, order (its place in
    the repetition), load, interval_us, guest and host ({avg_us, p50_us,
    p99_us, max_us, min_us, cycles, overflow, threads}: the guest's and the
    host's cyclictest), setup (what the variant left in force, read back:
    {threads: {main|vcpuN: [policy, rt_priority]}, cpu_cgroup}), cpu_s and
    switches per QEMU thread, migrations, steal_s, loadavg_start, policy
    (pvsched variants: pvschedd's boosts, throttles, boosted seconds in all
    and per thread, guest_features, decisions, first_boost_ms), break
    (--break-us)
  failed: every boot that failed: kernel, variant, rep, order, error
  floors: per kernel and repetition, the idle host's own floor (cyclictest,
    one SCHED_FIFO 99 thread per CPU: p99_us, max_us, samples, error): what
    no variant can beat on this host
  guest_driver_counters: the driver's debugfs counters after each boot
  stalls (--trace): every traced phase's waits and host-wide gaps over
    1 ms (stall_trace): with --break-us also "window": the waits, blocks
    and gaps of the VM's threads from 50 ms before the guest's stall until
    it ended
  breaks (--break-us): every phase whose guest cyclictest stopped at a
    latency over it: value_us, mark_at (host monotonic time the guest's
    mark arrived), run_s (how long it ran) and timed (it stopped before its
    last second; otherwise no window is drawn). Even then mark_at is the
    stall's end plus cyclictest's shutdown, whose length the host does not
    know; keep the trace (--keep-trace) to look further back.

--samples FILE writes the raw 1 us histograms:
  {"unit": "us", "runs": [{"kernel", "variant", "load", "interval_us", "rep",
   "guest": {"hist": [[us, count], ...], "cycles", "overflow"},
   "host": {...}}, ...]}
(`overflow`: samples past the last bucket; a CDF should end at cycles).
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from email.utils import parsedate_to_datetime
from pathlib import Path

from pvsched_guest.bench import (Autogroup, add_autogroup_option, BenchError, CGROUP_CPU,
                                 CLK_TCK, Daemon, Proc, WEIGHT_SHARES, between,
                                 driver_counters, first_line, loadavg, remove_cgroup,
                                 run_main, set_fifo1, ctx_switches, parse_cyclictest,
                                 stat_cpu_s, status_vm, thread_stats, vm_caps, weight_cgroup)
from pvsched_guest.boot import Boot
from pvsched_guest.kernel import build_initramfs, chroot_binary, matrix_kernel, modprobe_files
from pvsched_guest.qmp import qmp

from . import stall_trace

# The repository (default binaries and cache, bench/trace-run.sh).
REPO = Path(__file__).resolve().parents[2]
# The guest side: /bench.sh in the initramfs.
GUEST_SCRIPT = Path(__file__).resolve().parent / "guest" / "s4.sh"

HIST_BUCKETS = 200000  # 1 us buckets: 0..200 ms
STRESS = ["stress-ng", "--cpu", "2", "--iomix", "1", "--vm", "1", "--vm-bytes", "128M",
          "--fork", "1"]
INTERVALS = (500, 1000)
VARIANTS = ("vanilla", "pvsched", "pvsched-noemu", "pvsched-kick", "pvsched-nokick",
            "pvsched-auto", "pvsched-flat", "pvsched-halt4", "pvsched-cosched",
            "pvsched-coauto", "fifo1", "weight")
# Variants that register the VM with pvschedd; pvsched-noemu leaves QEMU's
# main loop out (no emulator thread), so whether its boost pays for its CPU
# is measured in the same invocation as pvsched.
PV_VARIANTS = ("pvsched", "pvsched-noemu", "pvsched-kick", "pvsched-nokick", "pvsched-auto",
               "pvsched-flat", "pvsched-halt4", "pvsched-cosched", "pvsched-coauto")
# Variants that are pvsched with one cap changed (added to the --caps file,
# which must not set it too): kick pairing always on, always off, or only
# where the guest cannot report wait_on, whatever the default.
VARIANT_CAPS = {"pvsched-flat": ("max_rt_prio", "1"),
                "pvsched-halt4": ("halt_prio", "4"),
                "pvsched-kick": ("kick_pairs", "true"),
                "pvsched-nokick": ("kick_pairs", "false"),
                "pvsched-auto": ("kick_pairs", '"auto"'),
                # Co-scheduling at about the guest's fair share beside S4's
                # stress-ng (2 vCPUs among ~7 runnable threads on 2 CPUs).
                "pvsched-cosched": ("cosched_us", "5000"),
                # The measured fair share, which leaves a VM with an RT
                # task (cyclictest) alone.
                "pvsched-coauto": ("cosched_us", '"auto"')}
LOAD_WARMUP_S = 3.0
IDLE_SETTLE_S = 2.0
# Guest max over vanilla's, in every repetition; host avg and max over
# vanilla's (medians).
GUEST_MAX_TARGET = 0.1
HOST_TARGET = 1.1
# Trace buffer per CPU and second traced, KiB (--trace).
TRACE_KB_PER_S = 6144
# A wait of a VM thread longer than this is a stall (--trace).
STALL_US = 1000.0
# --break-us: blocks shown in the window before the break, µs (a vCPU
# thread of a guest waking every 500 µs blocks for less).
WINDOW_US = 500.0
# --break-us: how far before the stall's start the window opens, s.
WINDOW_LEAD_S = 0.05
# --break-us: seconds traced past the phase's duration (the guest's
# cyclictest starts after the tracer and may stall at its very end).
BREAK_TRACE_TAIL_S = 5


def log(msg):
    print(f"s4: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- host side

def host_cyclictest(out, dur):
    return Proc("host-cyclictest",
                ["cyclictest", "-p", "8", "--policy=rr", "-i", "500", "-t", "1", "-q",
                 "-D", str(dur), "-h", str(HIST_BUCKETS), "--histfile=/dev/null",
                 f"--json={out}.json"], f"{out}.log")


# The host's floor: its own wake-up latency with the host idle (no load, no
# VM), once per repetition, measured as pvsched-bench measures S1 and S2's
# (crates/pvsched-bench/src/floor.rs): one SCHED_FIFO 99 thread pinned per
# CPU, memory locked, a 1 ms interval, /dev/cpu_dma_latency left alone.
FLOOR_CMD = ["cyclictest", "-m", "-S", "-p", "99", "-i", "1000", "--default-system", "-q"]


def host_floor(out, dur):
    """{p99_us, max_us, samples, error} of the idle-host floor over `dur`
    seconds (files OUT.json, OUT.log); a cyclictest that gave no result is
    an error in the row, not the end of the run."""
    p = Proc("host-floor", FLOOR_CMD + ["-D", str(dur), "-h", str(HIST_BUCKETS),
                                        "--histfile=/dev/null", f"--json={out}.json"],
             f"{out}.log")
    rc = p.wait(dur + 30)
    p.stop(signal.SIGINT)
    try:
        c = parse_cyclictest(json.loads(Path(f"{out}.json").read_text()))
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"cyclictest (rc {rc}) gave no result: {e}", "p99_us": None,
                "max_us": None, "samples": 0}
    return {"error": None, "p99_us": c["p99_us"], "max_us": c["max_us"], "samples": c["cycles"]}


def run_seconds(doc):
    """How long a cyclictest --json run lasted, s (its start_time and
    end_time have whole seconds), or None."""
    try:
        return int((parsedate_to_datetime(doc["end_time"])
                    - parsedate_to_datetime(doc["start_time"])).total_seconds())
    except (KeyError, TypeError, ValueError):
        return None


def steal_s():
    """Seconds of steal time so far, all CPUs (/proc/stat): time this host's
    own hypervisor ran something else while a CPU had work."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[8]) / CLK_TCK


class Tracer:
    """bench/trace-run.sh around `sleep SECONDS`: the host's scheduler
    events while a phase runs, in OUT.trace."""

    def __init__(self, out, seconds):
        self.out = out
        # stress-ng --fork makes ~100 000 scheduler events per second
        # and CPU: TRACE_KB_PER_S per second of trace keeps them all.
        self.proc = Proc("trace", ["env", f"PVSCHED_TRACE_BUFFER_KB={TRACE_KB_PER_S * seconds}",
                                   "sh", str(REPO / "bench" / "trace-run.sh"), str(out), "--", "sleep",
                                   str(seconds)], f"{out}.log")

    def stalls(self, tids, timeout, keep=False, window=None):
        """Waits for the trace, then names the waits of `tids` ({tid:
        label}) over STALL_US; None (and why, logged) if there is none.
        `window` (start, end, host monotonic s): also every wait, block
        and host-wide gap of those threads that overlaps it, as "window"."""
        rc = self.proc.wait(timeout)
        self.proc.stop()
        text = Path(f"{self.out}.log").read_text(errors="replace")
        if rc != 0 or not Path(f"{self.out}.trace").exists():
            log(f"no trace (trace-run.sh rc {rc}): {text.strip()[-300:]}")
            return None
        overrun = sum(int(l.split()[-1]) for l in text.splitlines() if "overrun" in l)
        waits, gaps = stall_trace.analyze(f"{self.out}.trace", STALL_US, tids)
        seen = None
        if window is not None:
            lo, hi = window
            blocks = stall_trace.sleeps(f"{self.out}.trace", WINDOW_US, tids)
            seen = {"start": round(lo, 6), "end": round(hi, 6),
                    "waits": stall_trace.overlapping(waits, lo, hi, "wait_ms"),
                    "blocks": stall_trace.overlapping(blocks, lo, hi, "ms"),
                    "gaps": stall_trace.overlapping([{"at": t, "ms": ms} for t, ms in gaps],
                                                    lo, hi, "ms")}
        if not keep:
            Path(f"{self.out}.trace").unlink()  # hundreds of MB; the waits are kept
        by = {}
        for w in waits:
            by.setdefault(w["label"], Counter())[w["cause"]] += 1
        return {"overrun": overrun, "causes": dict(Counter(w["cause"] for w in waits)),
                "by_thread": {k: dict(v) for k, v in sorted(by.items())},
                "longest_boosted_ms": max((w["wait_ms"] for w in waits if w["prio"] < 100),
                                          default=0.0),
                "host_gaps": len(gaps), "longest_host_gap_ms": max((ms for _, ms in gaps),
                                                                    default=0.0),
                "waits": waits, "gaps": [{"at": t, "ms": ms} for t, ms in gaps],
                "window": seen}


# ---------------------------------------------------------------- one boot

class BenchBoot:
    """Hooks driving one `pvtest=bench` boot through its phases."""

    def __init__(self, args, kernel, variant, rep, phases, daemon, cgroup):
        self.args, self.kernel, self.variant, self.rep = args, kernel, variant, rep
        self.daemon, self.cgroup = daemon, cgroup
        self.phases = list(phases)  # [(load, interval)]
        self.next = 0
        self.name = f"s4-{kernel}-{variant}-r{rep}"
        self.dir = args.out / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.load = None
        self.host = None
        self.tracer = None
        self.tids = None  # {tid: label} of the VM's QEMU threads, once attached
        self.results = []
        self.counters = None
        self.current = None
        self.status0 = None
        self.caps = None  # pvschedd's caps for the VM (pvsched)
        self.setup = None  # the QEMU threads' policies and cgroup, read back
        self.broke = None  # (host monotonic s, latency µs) of a --break-us stop
        self.first_boost = None  # FirstBoost of the running phase (pvsched variants)

    def hooks(self):
        return {"bench-wait": self.on_wait, "cyc-end": self.on_cyc_end,
                "stats-end": self.on_stats_end, "cyc-break": self.on_break}

    def on_break(self, boot):
        """The guest's cyclictest stopped at a latency over --break-us and
        exited: the mark arrives now (host monotonic time, the trace's
        clock), after cyclictest's shutdown; on_cyc_end decides whether that
        times the stall."""
        self.broke = (time.monotonic(), int(boot.mark("cyc-break").get("value", 0)))

    def attach(self, boot):
        pid = boot.qemu.pid
        cpus = sorted(qmp(boot.qmp_path, "query-cpus-fast"), key=lambda c: c["cpu-index"])
        self.tids = {pid: "main"} | {c["thread-id"]: f"vcpu{c['cpu-index']}" for c in cpus}
        if self.variant in PV_VARIANTS:
            argv = ["qemu-attach", "--qmp", str(boot.qmp_path), "--name", self.name,
                    "--pid", str(pid), "--device-region"]
            if self.args.no_emulator or self.variant == "pvsched-noemu":
                argv.append("--no-emulator")
            self.daemon.pvsched(*argv)
            boot.cleanups.append(self.unregister)
            self.caps = vm_caps(self.daemon, self.name)
            log(f"caps: {self.caps}")
        elif self.variant == "fifo1":
            set_fifo1(c["thread-id"] for c in cpus)
        elif self.variant == "weight":
            (self.cgroup / "cgroup.procs").write_text(str(pid))
        self.setup = thread_setup(pid, self.tids)
        log(f"{self.variant}: {self.setup}")

    def unregister(self):
        if self.daemon is not None and self.variant in PV_VARIANTS:
            self.daemon.pvsched("vm", "unregister", self.name, check=False)

    def policy(self):
        """pvschedd's counters of the VM: summed, and per thread (by label)."""
        if self.variant not in PV_VARIANTS:
            return None
        st = self.daemon.status()
        out = thread_stats(st, self.name)
        vm = status_vm(st, self.name)
        if out is not None and vm is not None:
            out["threads"] = {self.tids.get(t["tid"], str(t["tid"])): t
                              for t in vm["vcpus"] + vm["emulators"]}
            # What the guest's driver negotiated, as the policy reads it
            # (kick_pairs "auto" pairs only without F_WAIT_ON).
            out["guest_features"] = vm.get("guest_features")
            # Every boost change the applier made (a sched_setattr each).
            out["decisions"] = vm.get("decisions", 0)
            # The co-scheduled phase "auto" gives the VM now (0: none).
            out["cosched_now_us"] = vm.get("cosched_now_us", 0)
        return out

    def on_wait(self, boot):
        if self.tids is None:
            self.attach(boot)
        if self.next >= len(self.phases):
            if self.counters is None:
                self.counters = {}
                boot.answer("stats")
                return
            self.stop_load()
            boot.answer("quit")
            return
        load, interval = self.phases[self.next]
        self.next += 1
        if load == "loaded" and self.load is None:
            tmp = self.dir / "stress-tmp"
            tmp.mkdir(exist_ok=True)
            # --timeout: a safety net should every stop path fail.
            guard = int(len(self.phases) * (self.args.duration + 60) + 120)
            self.load = Proc("stress-ng", STRESS + ["--temp-path", str(tmp),
                                                    "--timeout", f"{guard}s"],
                             self.dir / "stress-ng.log", cwd=tmp)
            time.sleep(LOAD_WARMUP_S)
            if self.load.p.poll() is not None:
                raise BenchError(f"stress-ng exited with {self.load.p.returncode} "
                                 f"(see {self.dir}/stress-ng.log)")
        elif load == "idle" and self.load is not None:
            self.stop_load()
            time.sleep(IDLE_SETTLE_S)
        tag = f"{load}-i{interval}"
        self.current = {"kernel": self.kernel, "load": load, "interval_us": interval,
                        "rep": self.rep, "variant": self.variant, "loadavg_start": loadavg()}
        self.status0 = self.policy()
        self.sample0 = self.threads_sample(boot)
        self.steal0 = steal_s()
        if self.args.trace and load == "loaded":
            # A stall --break-us stops at can end with the run: trace past it.
            extra = BREAK_TRACE_TAIL_S if self.args.break_us else 1
            self.tracer = Tracer(self.dir / f"trace-{tag}", self.args.duration + extra)
        self.host = host_cyclictest(self.dir / f"host-{tag}", self.args.duration)
        self.host_out = self.dir / f"host-{tag}.json"
        log(f"{self.name}: {tag} ({self.args.duration}s)")
        self.broke = None
        self.first_boost = None
        if self.variant in PV_VARIANTS:
            self.first_boost = FirstBoost(t for t, lb in self.tids.items() if lb != "main")
            self.first_boost.start()
        boot.answer(f"run {interval} {self.args.duration} {HIST_BUCKETS} "
                    f"{self.args.guest_threads} {self.args.break_us}")

    def threads_sample(self, boot):
        """{label: (CPU seconds, voluntary, involuntary context switches,
        migrations between CPUs)} so far of each of the VM's QEMU threads;
        a thread gone is left out."""
        out = {}
        for tid, label in self.tids.items():
            task = f"/proc/{boot.qemu.pid}/task/{tid}"
            try:
                out[label] = (stat_cpu_s(f"{task}/stat"), *ctx_switches(task),
                              migrations(task))
            except (OSError, KeyError):
                pass
        return out

    def on_cyc_end(self, boot):
        rc = boot.mark("cyc-end").get("rc")
        lines = between(boot.serial, "@@ cyc-json-begin", "@@ cyc-end")
        try:
            doc = json.loads("\n".join(lines))
            guest = parse_cyclictest(doc)
        except (ValueError, KeyError) as e:
            raise BenchError(f"{self.name}: guest cyclictest (rc {rc}) gave no result: {e}; "
                             f"see {boot.dir}/serial.log")
        host_rc = self.host.wait(timeout=self.args.duration + 30)
        if host_rc is None:
            self.host.stop(signal.SIGINT)
        else:
            self.host.stop()
        try:
            host = parse_cyclictest(json.loads(self.host_out.read_text()))
        except (OSError, ValueError, KeyError) as e:
            raise BenchError(f"{self.name}: host cyclictest (rc {host_rc}) gave no result: {e}")
        g, h = guest, host
        if g["avg_us"] is None or h["avg_us"] is None:
            raise BenchError(f"{self.name}: a cyclictest ran no cycles (guest {g['cycles']}, "
                             f"host {h['cycles']})")
        self.current.update(guest=guest, host=host, setup=self.setup)
        self.current["steal_s"] = round(steal_s() - self.steal0, 3)
        s0, s1 = self.sample0, self.threads_sample(boot)
        both = [k for k in s1 if k in s0]
        self.current["cpu_s"] = {k: round(s1[k][0] - s0[k][0], 3) for k in both}
        self.current["switches"] = {k: [s1[k][1] - s0[k][1], s1[k][2] - s0[k][2]] for k in both}
        # An RT thread preempted by a higher one is pushed to another CPU
        # if it can run there: what a boost costs the host beyond CPU time.
        self.current["migrations"] = {k: s1[k][3] - s0[k][3] for k in both}
        pol = self.policy()
        if pol is not None and self.status0 is not None:
            self.current["policy"] = policy_delta(self.status0, pol)
            # ms from "run" to the first vCPU at SCHED_FIFO (None: not
            # within FirstBoost.LIMIT_S).
            if self.first_boost is not None:
                self.current["policy"]["first_boost_ms"] = self.first_boost.result()
            self.current["policy"]["threads"] = {
                k: policy_delta(self.status0["threads"].get(k, {}), t)
                for k, t in pol.get("threads", {}).items()}
            self.current["policy"]["guest_features"] = pol.get("guest_features")
            self.current["policy"]["cosched_now_us"] = pol.get("cosched_now_us", 0)
        window = None
        if self.broke is not None:
            at, value = self.broke
            ran = run_seconds(doc)
            # cyclictest prints the break when it exits: at once after a
            # break in the run, but only after its shutdown (seconds under
            # TCG) when the break came in the run's last second or in the
            # shutdown itself. Then the host cannot tell when it was.
            timed = ran is not None and ran < self.args.duration - 1
            self.current["break"] = {"value_us": value, "mark_at": round(at, 6),
                                     "run_s": ran, "timed": timed}
            if timed:
                window = (at - value / 1e6 - WINDOW_LEAD_S, at)
            else:
                log(f"{self.name}: guest latency {value} us at the end of its {ran} s run: "
                    "when is not known to the host, no window")
        if self.tracer is not None:
            self.current["stalls"] = self.tracer.stalls(self.tids, self.args.duration + 60,
                                                        keep=self.args.keep_trace, window=window)
            self.tracer = None
        self.results.append(self.current)
        st = self.current.get("stalls")
        if window is not None:
            self.log_window(st and st.get("window"))
        log(f"{self.name}: {self.current['load']}-i{self.current['interval_us']}: guest avg "
            f"{g['avg_us']:.0f} p99 {g['p99_us']} max {g['max_us']} us; host avg "
            f"{h['avg_us']:.0f} p99 {h['p99_us']} max {h['max_us']} us"
            + f"; CPU s {self.current['cpu_s']}, steal {self.current['steal_s']} s"
            + f"; switches (vol, invol) {self.current['switches']}"
            + (f"; policy {self.current['policy']}" if "policy" in self.current else "")
            + (f"; stalls {st['by_thread']}, longest at an RT priority "
               f"{st['longest_boosted_ms']} ms; {st['host_gaps']} host-wide gaps, longest "
               f"{st['longest_host_gap_ms']} ms (overrun {st['overrun']})" if st else ""))

    def log_window(self, win):
        """Logs what the VM's threads did around a --break-us stall."""
        at, value = self.broke
        if win is None:
            log(f"{self.name}: guest latency {value} us ended at {at:.6f} (phase not traced: "
                "--trace records the loaded phases)")
            return
        log(f"{self.name}: guest latency {value} us ended at {at:.6f}; from {win['start']:.6f}:")
        for w in win["waits"]:
            log(f"  {w['at']:.6f} {w['label']} {w['why']} at prio {w['prio']}, waited "
                f"{w['wait_ms']} ms: {w['cause']} (silent {w['silent_ms']} ms; ran there: "
                + ", ".join(f"{r['comm']}/{r['pid']} prio {r['prio']} {r['ms']} ms"
                            for r in w["ran"][:3]) + ")")
        for b in win["blocks"]:
            log(f"  {b['at']:.6f} {b['label']} blocked {b['ms']} ms on futex {b['futex']}, "
                f"woken by {b['waker']}")
        for g in win["gaps"]:
            log(f"  {g['at']:.6f} every CPU silent {g['ms']} ms")

    def on_stats_end(self, boot):
        self.counters = driver_counters(between(boot.serial, "@@ stats-begin", "@@ stats-end"))

    def stop_load(self):
        if self.load is not None:
            self.load.stop()
            self.load = None
            shutil.rmtree(self.dir / "stress-tmp", ignore_errors=True)

    def cleanup(self):
        self.stop_load()
        if self.host is not None:
            self.host.stop(signal.SIGINT)
        if self.tracer is not None:
            self.tracer.proc.stop()


def thread_setup(pid, tids):
    """What the variant left in force, read back from the kernel: each
    QEMU thread's policy and RT priority by label, and QEMU's cpu cgroup."""
    names = {os.SCHED_OTHER: "other", os.SCHED_FIFO: "fifo", os.SCHED_RR: "rr"}
    out = {"threads": {}, "cpu_cgroup": None}
    for tid, label in tids.items():
        try:
            pol = os.sched_getscheduler(tid)
            out["threads"][label] = [names.get(pol, pol), os.sched_getparam(tid).sched_priority]
        except OSError:
            pass
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if "cpu" in ctrls.split(","):
                out["cpu_cgroup"] = path
    except (OSError, ValueError):
        pass
    return out


class FirstBoost(threading.Thread):
    """Polls the VM's vCPU threads' scheduling policy every POLL_S from
    its start until one is SCHED_FIFO (or LIMIT_S passed): how long the
    policy took to boost the VM after the guest was told to start its RT
    cyclictest (guest start-up included, alike in every variant)."""

    POLL_S = 0.0005
    LIMIT_S = 10.0

    def __init__(self, tids):
        super().__init__(daemon=True)
        self.tids, self.stop_at, self.ms = list(tids), None, None

    def run(self):
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.LIMIT_S and self.stop_at is None:
            for t in self.tids:
                try:
                    if os.sched_getscheduler(t) == os.SCHED_FIFO:
                        self.ms = round((time.monotonic() - t0) * 1000, 1)
                        return
                except OSError:
                    pass
            time.sleep(self.POLL_S)

    def result(self):
        self.stop_at = time.monotonic()
        self.join(1.0)
        return self.ms


def migrations(task):
    """se.nr_migrations of thread directory `task` (/proc/PID/task/TID):
    how often the scheduler moved it to another CPU; 0 where the kernel
    does not show it (no CONFIG_SCHED_DEBUG)."""
    with open(f"{task}/sched") as f:
        for line in f:
            if line.startswith("se.nr_migrations"):
                return int(line.split(":")[1])
    return 0


def policy_delta(a, b):
    """Boosts, throttles and boosted seconds (and, for a VM, decisions)
    from pvschedd counters a to b."""
    out = {"boosts": b["boosts"] - a.get("boosts", 0),
           "throttles": b["throttles"] - a.get("throttles", 0),
           "boosted_s": round((b["boosted_ns"] - a.get("boosted_ns", 0)) / 1e9, 3)}
    for k in ("decisions", "phase_changes"):
        if k in b:
            out[k] = b[k] - a.get(k, 0)
    return out


def run_boot(args, kernel, variant, rep, phases, daemon, cgroup):
    bb = BenchBoot(args, kernel, variant, rep, phases, daemon, cgroup)
    dev = daemon.device_cmd(bb.name) if variant in PV_VARIANTS else None
    if variant in PV_VARIANTS:
        caps = daemon.vms / f"{bb.name}.toml"
        text = args.caps.read_text() if args.caps else ""
        if variant in VARIANT_CAPS:
            key, value = VARIANT_CAPS[variant]
            text += f"\n{key} = {value}\n"
        if text:
            caps.write_text(text)
        elif caps.exists():
            caps.unlink()
    boot = Boot(args, bb.name, 2, "bench", transport="vfio-user", device_cmd=dev,
                hooks=bb.hooks(), extra_append="pvload=modprobe")
    try:
        boot.run()
    finally:
        bb.cleanup()
    boot.mark("done")
    if len(bb.results) != len(phases):
        raise BenchError(f"{bb.name}: {len(bb.results)} of {len(phases)} phases ran "
                         f"(see {boot.dir}/serial.log)")
    return bb


def machine(args, releases):
    model = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                  if l.startswith("model name")), None)
    mem = next((int(l.split()[1]) // 1024 for l in Path("/proc/meminfo").read_text().splitlines()
                if l.startswith("MemTotal")), None)
    return {"cpus": os.cpu_count(), "cpu_model": model, "mem_mib": mem,
            "host_kernel": platform.release(), "qemu": first_line([str(args.qemu11), "--version"]),
            "accel": "tcg,thread=multi", "guest_smp": 2, "guest_mem": "512M",
            "guest_kernels": releases, "device": "vfio-user, device-region mode",
            "cyclictest": first_line(["cyclictest", "--help"]),
            "stress_ng": first_line(["stress-ng", "--version"]),
            "sched_rt_runtime_us": Path("/proc/sys/kernel/sched_rt_runtime_us").read_text().strip(),
            "note": "emulated guest (QEMU TCG) on a shared host that is itself a VM"}


# ---------------------------------------------------------------- main

def initramfs_extras(chroot, release):
    """The DKMS-built module with modprobe, the chroot's cyclictest with its
    libraries, and the guest script."""
    files = modprobe_files(chroot, release)
    ct = "/usr/bin/cyclictest"
    if not (chroot / ct.lstrip("/")).exists():
        raise FileNotFoundError(f"{chroot}{ct} (scripts/setup.d/46-s6.sh installs rt-tests)")
    files.update(chroot_binary(chroot, ct, ct))
    files["/bench.sh"] = GUEST_SCRIPT
    return files


def measure():
    ap = argparse.ArgumentParser(description="S4 seed reproduction: cyclictest in a Linux "
                                 "guest under QEMU TCG, vanilla vs pvsched.", epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release"
    ap.add_argument("--kernels", default="7.3-cloud,6.1-cloud",
                    help="comma-separated kernels of tests/linux-guest/kernels.conf")
    ap.add_argument("--device-bin", type=Path, default=target / "pvsched-device")
    ap.add_argument("--pvsched-bin", type=Path, default=target / "pvsched")
    ap.add_argument("--pvschedd-bin", type=Path, default=target / "pvschedd")
    ap.add_argument("--qemu11", type=Path, default=None)
    ap.add_argument("--quick", action="store_true",
                    help="1 rep, 8 s phases, the first kernel only (~3 min)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    ap.add_argument("--duration", type=int, default=None,
                    help="seconds per cyclictest phase (default 20, quick 8)")
    ap.add_argument("--json", default=None, help="write the result here ('-' = stdout)")
    ap.add_argument("--samples", type=Path, default=None, help="raw histograms (JSON)")
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("PVSCHED_CACHE", REPO / ".cache")))
    ap.add_argument("--out", type=Path, default=None, help="work dir (logs, serial)")
    ap.add_argument("--guest-threads", type=int, default=1,
                    help="guest cyclictest -t (seed 001 used 2; merged histogram)")
    ap.add_argument("--no-idle", action="store_true", help="skip the idle-host phases")
    ap.add_argument("--daemon-toml", type=Path, default=None,
                    help="appended to the pvschedd.toml the bench writes (top-level keys, "
                         "then tables: e.g. applier_rt_prio and [max])")
    ap.add_argument("--caps", type=Path, default=None,
                    help="caps TOML for the VM (default: pvschedd's default caps)")
    ap.add_argument("--no-emulator", action="store_true",
                    help="do not register QEMU's main-loop thread as the emulator thread")
    ap.add_argument("--trace", action="store_true",
                    help="record the host's scheduler events in each loaded phase and name "
                    "the VM threads' waits over 1 ms")
    ap.add_argument("--break-us", type=int, default=0,
                    help="stop each guest cyclictest at its first latency over this (-b) and, "
                    "with --trace, list what the VM's threads did from 50 ms before that "
                    "stall began until the guest's mark of it arrived, after cyclictest's "
                    "shutdown (a diagnostic: the phase's statistics stop there)")
    ap.add_argument("--keep-trace", action="store_true",
                    help="keep each phase's trace (OUT/NAME/trace-*.trace; large)")
    ap.add_argument("--variants", default="vanilla,pvsched",
                    help=f"comma-separated, of {','.join(VARIANTS)} (one alone: no ratios, "
                    "for a look at its stalls)")
    add_autogroup_option(ap, "QEMU against the host load")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the guest console")
    args = ap.parse_args()
    args.reps = args.reps or (1 if args.quick else 3)
    args.duration = args.duration or (8 if args.quick else 20)
    args.cache = args.cache.resolve()
    args.out = (args.out or args.cache / "bench-s4").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.qemu11 = args.qemu11 or args.cache / "qemu11" / "qemu-system-x86_64"
    args.kernel_log = False
    args.tag, args.load_append = "", ""
    kernels = args.kernels.split(",")[:1] if args.quick else args.kernels.split(",")
    variants = args.variants.split(",")
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants {args.variants}: of {', '.join(VARIANTS)}")
    for b in (args.device_bin, args.pvsched_bin, args.pvschedd_bin, args.qemu11):
        if not b.exists():
            raise FileNotFoundError(f"{b} (build it: see python3 -m pvsched_bench s4's usage)")
    for tool in ("stress-ng", "cyclictest"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(f"{tool} (run scripts/setup)")
    if args.caps and not args.caps.is_file():
        raise FileNotFoundError(f"{args.caps} (--caps)")
    if args.daemon_toml and not args.daemon_toml.is_file():
        raise FileNotFoundError(f"{args.daemon_toml} (--daemon-toml)")
    for v in variants:
        key = VARIANT_CAPS.get(v, (None,))[0]
        if key and args.caps and re.search(rf"^\s*{key}\s*=", args.caps.read_text(), re.M):
            ap.error(f"--variants {v} sets {key}, and so does --caps {args.caps}")
    if os.geteuid() != 0:
        raise BenchError("run as root (BPF, RT priorities, tracefs)")
    loads = ["loaded"] if args.no_idle else ["loaded", "idle"]
    phases = [(l, iv) for l in loads for iv in INTERVALS]
    # Boot + module + attach ~40 s under TCG, each phase duration + output.
    args.timeout = 240 + len(phases) * (args.duration + 60)
    t_all = time.monotonic()
    la0 = loadavg()
    log(f"kernels {','.join(kernels)}; {args.reps} reps x {len(phases)} phases x "
        f"{args.duration}s per variant; load average {la0}")

    # Every kernel's initramfs first: a kernel that is missing (or has no
    # DKMS-built module) stops the run before the first boot, not half-way.
    releases, images = {}, {}
    for kernel in kernels:
        release, chroot, vmlinuz = matrix_kernel(args.cache, kernel)
        releases[kernel] = release
        kdir = args.out / f"initramfs-{kernel}"
        kdir.mkdir(parents=True, exist_ok=True)
        images[kernel] = (vmlinuz, build_initramfs(None, kdir,
                                                   extra_files=initramfs_extras(chroot, release)))
    runs, counters, floors, failed = [], {}, [], []
    caps = cgroup = None
    caps_by_variant = {}
    with Autogroup(args.autogroup) as autogroup:
        ag_state = autogroup.state
        log(f"autogroup {ag_state}")
        daemon = Daemon(args, args.out)
        try:
            if "weight" in variants:
                cgroup = weight_cgroup("pvsched-s4-vm")
            for kernel in kernels:
                args.vmlinuz, args.initrd = images[kernel]
                for rep in range(args.reps):
                    # The host's own floor in this repetition: what its
                    # best wake-up latency is with nothing else running.
                    floors.append({"kernel": kernel, "rep": rep, "order": 0}
                                  | host_floor(args.out / f"floor-{kernel}-r{rep}",
                                               args.duration))
                    log(f"{kernel} r{rep}: host floor {floors[-1]}")
                    # Repetition r starts at variant r mod k: no variant
                    # always runs first or after the same one.
                    k = rep % len(variants)
                    for order, variant in enumerate(variants[k:] + variants[:k]):
                        try:
                            bb = run_boot(args, kernel, variant, rep, phases, daemon, cgroup)
                        except BenchError as e:
                            # Kept and counted: a failed repetition of the
                            # variant, with no figures.
                            log(f"{kernel} {variant} r{rep}: FAILED: {e}")
                            failed.append({"kernel": kernel, "variant": variant, "rep": rep,
                                           "order": order, "error": str(e)})
                            continue
                        for r in bb.results:
                            r["order"] = order
                        runs += bb.results
                        counters.setdefault(kernel, {}).setdefault(variant, []).append(
                            bb.counters)
                        caps = caps or bb.caps
                        if bb.caps:
                            caps_by_variant.setdefault(variant, bb.caps)
        finally:
            daemon.stop()
            remove_cgroup(cgroup)

    result = {"scenario": "s4", "quick": args.quick, "reps": args.reps,
              "caps": caps, "caps_file": str(args.caps) if args.caps else None,
              "daemon_toml": args.daemon_toml.read_text() if args.daemon_toml else None,
              "variant_caps": {v: f"{k} = {x}" for v, (k, x) in VARIANT_CAPS.items()
                               if v in variants},
              "caps_by_variant": caps_by_variant,
              "emulator_thread": not args.no_emulator, "trace": args.trace, "break_us": args.break_us,
              "variants": variants,
              "alternatives_setup": {
                  "fifo1": "every vCPU thread SCHED_FIFO 1; QEMU's main loop SCHED_OTHER",
                  "weight": f"QEMU in {CGROUP_CPU}/pvsched-s4-vm, cpu.shares "
                  f"{WEIGHT_SHARES}; the host load in the root cgroup"},
              "duration_s": args.duration,
              "machine": machine(args, releases) | {"autogroup": ag_state},
              "loadavg_start": la0,
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "guest_cmd": ("cyclictest --mlockall -q -p 8 --policy=rr -i {500,1000} "
                            f"-t {args.guest_threads}"),
              "host_cmd": "cyclictest -p 8 --policy=rr -i 500 -t 1 -q",
              "host_load": " ".join(STRESS),
              "headline_interval_us": INTERVALS[0], "kernels": kernels,
              "loads": loads, "intervals": list(INTERVALS),
              "floor_cmd": " ".join(FLOOR_CMD),
              # One row per phase run (the histograms are --samples'), the
              # failed boots, and the host's floor per repetition: the
              # report is pvsched-bench s4's.
              "runs": [{k: v for k, v in r.items() if k != "stalls"}
                       | {side: {k: v for k, v in r[side].items() if k != "hist"}
                          for side in ("guest", "host")} for r in runs],
              "failed": failed, "floors": floors}
    result["guest_driver_counters"] = counters
    result["stalls"] = [{k: r[k] for k in ("kernel", "variant", "load", "interval_us", "rep")}
                        | {k: r["stalls"].get(k) for k in ("waits", "gaps", "overrun", "window")}
                        for r in runs if r.get("stalls")]
    result["breaks"] = [{k: r[k] for k in ("kernel", "variant", "load", "interval_us", "rep")}
                        | r["break"] for r in runs if r.get("break")]
    result["seconds"] = round(time.monotonic() - t_all, 1)
    if args.samples:
        samples = {"unit": "us", "bucket_us": 1, "buckets": HIST_BUCKETS, "runs": [
            {k: r[k] for k in ("kernel", "variant", "load", "interval_us", "rep")} |
            {side: {"hist": r[side]["hist"], "cycles": r[side]["cycles"],
                    "overflow": r[side]["overflow"]} for side in ("guest", "host")}
            for r in runs]}
        args.samples.write_text(json.dumps(samples, separators=(",", ":")) + "\n")
    text = json.dumps(result, indent=1)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text + "\n")
        log(f"wrote {args.json}")
    log(f"total {result['seconds']}s")
    return 0


def main():
    """`python3 -m pvsched_bench s4`: exits with run_main's code."""
    run_main("s4", measure)
