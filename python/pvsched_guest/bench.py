"""What the Linux-guest benchmarks (pvsched_bench s4 and s6) share on the
host: processes started in their own process group and always stopped,
pvschedd with its own socket and caps directory, console output between
two marks, cyclictest's results, and the alternatives a user would
pick instead of pvsched (static SCHED_FIFO 1 vCPUs, a cgroup weight)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .host import Failure, die_with_parent

CLK_TCK = os.sysconf("SC_CLK_TCK")
# Seconds pvschedd may take to answer its first `pvsched status`.
DAEMON_READY_S = 20.0
# One window of the co-scheduling gate in pvschedd's log (agent consumer,
# debug): VM id, score per vCPU and second, on/off.
GATE_LINE = re.compile(r"pvsched cosched gate: VM (\d+): ([0-9.]+) per vCPU and second, (on|off)")
# The host's autogroup switch (CONFIG_SCHED_AUTOGROUP).
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP_MODES = ("off", "on", "host")
# The weight alternative's cgroup (v1 cpu controller; shares 1024 = nice 0).
WEIGHT_SHARES = 4096
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


class BenchError(Exception):
    """A benchmark run failed; the message says what (and where its logs are)."""


def run_main(name, main):
    """Runs a benchmark's `main()` and exits with its code: 0 on success,
    1 on a failed run, 3 when something it needs is missing
    (FileNotFoundError), 130 on Ctrl-C. SIGTERM unwinds like a failure, and
    every Proc is stopped however the run ends."""
    def terminate(signum, _frame):
        raise BenchError(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    rc = 1
    try:
        rc = main()
    except FileNotFoundError as e:
        print(f"{name}: MISSING: {e}", file=sys.stderr)
        rc = 3
    except (BenchError, Failure) as e:
        print(f"{name}: FAIL: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        rc = 130
    finally:
        Proc.stop_all()
    sys.exit(rc)


class Proc:
    """A host process we start and always stop (its own process group)."""

    live = []

    def __init__(self, name, cmd, logfile, cwd=None, env=None):
        self.name = name
        self.logf = open(logfile, "w")
        self.p = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, cwd=cwd,
                                  env=env, preexec_fn=_session_and_pdeathsig)
        Proc.live.append(self)

    def wait(self, timeout):
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig=signal.SIGTERM, grace=10.0):
        """Signals the whole process group, then SIGKILL after `grace`."""
        if self in Proc.live:
            Proc.live.remove(self)
        for s, wait in ((sig, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.p.pid, s)
            except ProcessLookupError:
                break
            if self.wait(wait) is not None:
                # The leader is gone; make sure no worker of the group is left.
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
        self.p.poll()
        self.logf.close()
        return self.p.returncode

    @classmethod
    def stop_all(cls):
        for p in list(cls.live):
            p.stop()


def _session_and_pdeathsig():
    os.setsid()
    die_with_parent()


def first_line(cmd):
    """The first line `cmd` prints (a version string), or None if it cannot
    run: for a benchmark's record of the machine."""
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, timeout=10).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def between(lines, begin, end):
    """Lines strictly between the last `begin` marker and the `end` after it."""
    start = max((i for i, l in enumerate(lines) if l.startswith(begin)), default=None)
    if start is None:
        return []
    out = []
    for l in lines[start + 1:]:
        if l.startswith(end):
            break
        out.append(l)
    return out


def driver_counters(lines):
    """The guest driver's per-CPU debugfs counters (the table under the
    "cpu slot ..." header of /sys/kernel/debug/pvsched/stats) as one dict
    of ints per CPU, by column name."""
    head = next((l.split() for l in lines if l.startswith("cpu slot ")), None)
    if head is None:
        return []
    rows = [dict(zip(head, l.split())) for l in lines]
    return [{k: int(v) for k, v in r.items()} for r in rows
            if len(r) == len(head) and r["cpu"].isdigit()]


def loadavg():
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def parse_cyclictest(doc):
    """Summary and merged histogram of all threads of a cyclictest --json
    result (avg weighted by cycles, max over threads)."""
    threads = list(doc["thread"].values())
    if not threads:
        raise KeyError("no thread in the cyclictest result")
    merged = {}
    for t in threads:
        for k, v in t.get("histogram", {}).items():
            merged[int(k)] = merged.get(int(k), 0) + int(v)
    hist = sorted(merged.items())
    cycles = sum(int(t["cycles"]) for t in threads)
    overflow = max(0, cycles - sum(c for _, c in hist))
    avg = sum(float(t["avg"]) * int(t["cycles"]) for t in threads) / cycles if cycles else None
    return {"avg_us": avg, "max_us": max(int(t["max"]) for t in threads),
            "min_us": min(int(t["min"]) for t in threads), "threads": len(threads),
            "cycles": cycles, "p50_us": percentile(hist, cycles, 0.50),
            "p99_us": percentile(hist, cycles, 0.99), "hist": hist, "overflow": overflow}


def percentile(hist, total, q):
    """Smallest bucket (us) whose cumulative count reaches q * total; None
    if that falls past the histogram (overflow) or there are no samples."""
    if total <= 0:
        return None
    need = q * total
    acc = 0
    for us, c in hist:
        acc += c
        if acc >= need:
            return us
    return None


def stat_cpu_s(path):
    """CPU seconds (utime + stime) of a /proc .../stat file."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def ctx_switches(task_dir):
    """(voluntary, involuntary) context switches so far of a thread or
    process (`task_dir`: /proc/PID or /proc/PID/task/TID): voluntary ones
    are the times it blocked (a vCPU thread: mostly halts), involuntary
    the times it was preempted."""
    got = {}
    for line in Path(task_dir, "status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            got[k] = int(v)
    return got["voluntary_ctxt_switches"], got["nonvoluntary_ctxt_switches"]


def qemu_cpu_s(pid):
    """CPU seconds (user + system) of process `pid`, all its threads."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def thread_cpu_s(pid):
    """CPU seconds of each thread of `pid` by kind: `vcpus` (QEMU's
    "CPU n/TCG" threads), `main` (the main loop, tid = pid) and `other`."""
    out = {"vcpus": 0.0, "main": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            cpu = stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        kind = "main" if tid == str(pid) else "vcpus" if comm.startswith("CPU ") else "other"
        out[kind] += cpu
    return out


class Daemon:
    """pvschedd for the pvsched variants, with its own socket and caps
    directory (`vms`): a VM gets the daemon's default caps unless its
    variant writes NAME.toml there."""

    def __init__(self, args, out, settings=""):
        """`settings`: pvschedd.toml text of this daemon only, after
        --daemon-toml's (it may open a table: [cosched])."""
        self.args, self.dir = args, out / "pvschedd"
        # Each variant's caps, as pvschedd reports them (printed once).
        self.caps = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket = self.dir / "pvschedd.sock"
        vms = self.vms = self.dir / "vms"
        vms.mkdir(exist_ok=True)
        cfg = self.dir / "pvschedd.toml"
        extra = getattr(args, "daemon_toml", None)
        cfg.write_text(f'socket = "{self.socket}"\nsocket_group = ""\nvm_dir = "{vms}"\n'
                       f'metrics_listen = ""\n' + (extra.read_text() if extra else "") + "\n" + settings)
        if self.socket.exists():
            self.socket.unlink()
        self.log = self.dir / "pvschedd.log"
        # The co-scheduling gate's score of every window (debug lines of
        # the agent's co-scheduler, one per VM and second): which VM got
        # phases when, and why (gate_windows).
        env = {**os.environ}
        env.setdefault("RUST_LOG", "info,pvsched_agent::agent::cosched=debug")
        self.proc = Proc("pvschedd", [str(args.pvschedd_bin), "--config", str(cfg)],
                         self.log, env=env)
        deadline = time.monotonic() + DAEMON_READY_S
        while self.pvsched("status", check=False).returncode != 0:
            if self.proc.p.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"pvschedd did not come up (see {self.dir}/pvschedd.log)")
            time.sleep(0.1)

    def pvsched(self, *argv, check=True):
        r = subprocess.run([str(self.args.pvsched_bin), *argv], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=30,
                           env={**os.environ, "PVSCHED_SOCKET": str(self.socket)})
        if check and r.returncode != 0:
            raise BenchError(f"pvsched {' '.join(argv)}: rc {r.returncode}: {r.stdout.strip()}")
        return r

    def status(self):
        return json.loads(self.pvsched("status", "--json").stdout)

    def log_size(self):
        """Bytes in pvschedd's log so far (where gate_windows starts)."""
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def gate_windows(self, since):
        """The co-scheduling gate's windows logged after byte `since`, by
        VM id: [(score per vCPU and second, phases on)], oldest first."""
        out = {}
        try:
            with open(self.log, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return out
        for m in GATE_LINE.finditer(text):
            out.setdefault(int(m[1]), []).append((float(m[2]), m[3] == "on"))
        return out

    def device_cmd(self, name):
        return [str(self.args.pvsched_bin), "device", "--daemon-region", name,
                "--daemon-socket", str(self.socket)]

    def stop(self):
        self.proc.stop()


def status_vm(status, name):
    """VM `name` in a `pvsched status --json` reply, None if not there."""
    return next((v for v in status.get("vms", []) if v["name"] == name), None)


def vm_caps(daemon, name):
    """The caps pvschedd gave registered VM `name`, with their source."""
    vm = status_vm(daemon.status(), name)
    if vm is None:
        raise BenchError(f"VM {name} is not registered with pvschedd")
    return {"source": vm["caps_source"], **vm["caps"]}


def thread_stats(status, name):
    """Sum of boosts, throttles, boosted ns, co-scheduling phase changes
    and yields, boosts ended for host threads, and the vCPUs' waits for each other (halts beside a
    preempted sibling, wake-ups by a sibling) over VM `name`'s threads."""
    vm = status_vm(status, name)
    tot = {"boosts": 0, "throttles": 0, "boosted_ns": 0, "phase_changes": 0, "phase_yields": 0,
           "boost_yields": 0, "sync_halts": 0, "sib_wakes": 0, "sync_wait_ns": 0}
    if vm is None:
        return None
    for t in vm["vcpus"] + vm["emulators"]:
        for k in tot:
            tot[k] += t.get(k, 0)
    return tot


def set_fifo1(tids):
    """Every thread of `tids` SCHED_FIFO 1: KubeVirt's realtime setting,
    libvirt's <vcpusched scheduler='fifo' priority='1'/>."""
    for t in tids:
        os.sched_setscheduler(t, os.SCHED_FIFO, os.sched_param(1))


def weight_cgroup(name):
    """The weight alternative's cgroup CGROUP_CPU/name, shares
    WEIGHT_SHARES (created if missing); a process joins it by writing its
    PID to cgroup.procs (all its threads move)."""
    d = CGROUP_CPU / name
    if not CGROUP_CPU.is_dir():
        raise FileNotFoundError(f"{CGROUP_CPU} (the cgroup v1 cpu controller)")
    d.mkdir(exist_ok=True)
    (d / "cpu.shares").write_text(str(WEIGHT_SHARES))
    return d


def remove_cgroup(d):
    """Moves what is left in cgroup `d` back to the root and removes it
    (None: nothing to do); a failure is printed, not raised, since this
    runs while a benchmark unwinds."""
    if d is None or not d.exists():
        return
    for pid in (d / "cgroup.procs").read_text().split():
        try:
            (CGROUP_CPU / "cgroup.procs").write_text(pid)
        except OSError:
            pass
    try:
        d.rmdir()
    except OSError as e:
        print(f"could not remove {d}: {e}", file=sys.stderr, flush=True)


def add_autogroup_option(ap, split):
    """The benchmarks' --autogroup option; `split` says what autogroup on
    would split the CPUs between."""
    ap.add_argument("--autogroup", choices=AUTOGROUP_MODES, default="off",
                    help="the host's sched_autogroup_enabled during the run: off (every "
                    "thread of the root cgroup its own share; default), on (each session "
                    f"one share: {split}), host (left as it is)")


class Autogroup:
    """Puts the host's autogroup switch where a benchmark wants it for the
    run and back afterwards. With autogroup on, every session (setsid) in
    the root cgroup is a task group of its own with one nice-0 share: the
    benchmark's QEMUs (in the harness's session) split the CPUs with the
    host load (started in sessions of their own) by group, not by thread.
    `off` makes every thread in the root cgroup one nice-0 share (for
    processes started after it); `host` leaves the switch alone. Usable as
    a context manager; `state` is what the run's JSON records."""

    def __init__(self, mode):
        if mode not in AUTOGROUP_MODES:
            raise ValueError(f"autogroup mode {mode!r}: one of {', '.join(AUTOGROUP_MODES)}")
        self.mode = mode
        self.saved = None

    def __enter__(self):
        if self.mode != "host" and AUTOGROUP.exists():
            self.saved = AUTOGROUP.read_text().strip()
            AUTOGROUP.write_text("0" if self.mode == "off" else "1")
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            try:
                AUTOGROUP.write_text(self.saved)
            except OSError as e:
                print(f"could not restore {AUTOGROUP} to {self.saved}: {e}", file=sys.stderr,
                      flush=True)
            self.saved = None
        return False

    @property
    def state(self):
        """The switch in force: "on", "off", or None without autogroup."""
        if not AUTOGROUP.exists():
            return None
        return "off" if AUTOGROUP.read_text().strip() == "0" else "on"
