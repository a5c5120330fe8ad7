"""Host-side helpers of the guest harness."""

import os
import signal
import subprocess
import time
from pathlib import Path


class Failure(Exception):
    """The harness, the guest or a host program it runs failed; the message
    says what (and where its logs are)."""


def run(cmd, **kw):
    """Runs `cmd`, returns its output (stdout and stderr); Failure with the
    output if it fails."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        raise Failure(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stdout}")
    return r.stdout


def die_with_parent():
    """Child side of Popen: get SIGKILL if the harness dies (prctl PDEATHSIG)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def kill(p):
    """Stops child `p` (SIGTERM, SIGKILL after 5 s) if it still runs."""
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


SYS_SCHED_SETATTR = 314  # x86_64
SYS_SCHED_GETATTR = 315


def _sched_attr():
    import ctypes

    class SchedAttr(ctypes.Structure):
        _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                    ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                    ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                    ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64)]
    return ctypes, SchedAttr


def set_fair_slice(tid, slice_ns):
    """SCHED_OTHER nice 0 with a custom slice (sched_attr.sched_runtime, fair
    class, Linux >= 6.12; the kernel clamps it to 0.1..100 ms)."""
    ctypes, SchedAttr = _sched_attr()
    libc = ctypes.CDLL(None, use_errno=True)
    a = SchedAttr(size=ctypes.sizeof(SchedAttr), sched_policy=0, sched_runtime=slice_ns)
    if libc.syscall(SYS_SCHED_SETATTR, tid, ctypes.byref(a), 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"sched_setattr({tid}, slice {slice_ns} ns): {os.strerror(e)}")


def fair_slice(tid):
    """The custom slice of thread `tid` in ns (0: the kernel's default)."""
    ctypes, SchedAttr = _sched_attr()
    libc = ctypes.CDLL(None, use_errno=True)
    a = SchedAttr()
    if libc.syscall(SYS_SCHED_GETATTR, tid, ctypes.byref(a), ctypes.sizeof(a), 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"sched_getattr({tid}): {os.strerror(e)}")
    return a.sched_runtime


def attrs(tid):
    """(policy, rt priority, nice) of thread `tid`, as the kernel reports them."""
    return (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
            os.getpriority(os.PRIO_PROCESS, tid))


def wait_for(what, probe, procs=(), timeout=40, interval=0.1):
    """probe()'s first truthy result, polled every `interval` seconds;
    Failure after `timeout` seconds (a liveness bound, not a timing
    assertion) or as soon as one of `procs` ((name, Popen, log path)) has
    exited, with the end of its log."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = probe()
        if last:
            return last
        for name, p, log in procs:
            if p.poll() is not None:
                raise Failure(f"{name} exited ({p.returncode}) while waiting for {what}:\n"
                              f"{Path(log).read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            raise Failure(f"{what}: not within {timeout:.0f} s (last: {last!r})")
        time.sleep(interval)
