"""What the Linux-guest benchmarks (bench/s4.py, bench/s6.py) share on the
host: processes started in their own process group and always stopped,
console output between two marks, and the repetition statistics."""

import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from .host import Failure, die_with_parent


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

    def __init__(self, name, cmd, logfile, cwd=None):
        self.name = name
        self.logf = open(logfile, "w")
        self.p = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, cwd=cwd,
                                  preexec_fn=_session_and_pdeathsig)
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


def spread(vals):
    """Median, min, max over reps; `reps` keeps every rep in order (None: a
    p99 past the histogram), the statistics use the reps that have a value."""
    vals = [round(v, 2) if isinstance(v, float) else v for v in vals]
    have = [v for v in vals if v is not None]
    if not have:
        return {"median": None, "min": None, "max": None, "reps": vals}
    med = statistics.median(have)
    return {"median": round(med, 2) if isinstance(med, float) else med, "min": min(have),
            "max": max(have), "reps": vals}


def ratio(a, b):
    return round(a / b, 3) if a is not None and b not in (None, 0) else None
