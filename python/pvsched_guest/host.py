"""Host-side helpers of the guest harness."""

import os
import signal
import subprocess


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


def attrs(tid):
    """(policy, rt priority, nice) of thread `tid`, as the kernel reports them."""
    return (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
            os.getpriority(os.PRIO_PROCESS, tid))
