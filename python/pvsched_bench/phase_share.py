"""What share of the CPU a thread moved between SCHED_FIFO and a low
fair-class setting every few ms really gets, beside CPU-bound threads at
nice 0: the question behind the co-scheduling phases (caps `cosched_us`),
whose phase outside the co-scheduled one must give the VM ~nothing on a
busy host.

Starts as many busy "host" processes as CPUs and as many busy "vCPU"
processes, then, from a SCHED_FIFO 50 loop, sets every vCPU process to
SCHED_FIFO 1 for ON ms and to the low setting for OFF ms, for 4 s, and
prints the vCPUs' share of the CPU time used against ON / (ON + OFF).
Needs root (SCHED_FIFO); Python's stdlib only.

    python3 -m pvsched_bench phase-share ON_MS OFF_MS [idle|idle-slice|nice19] [--pin]

idle: SCHED_IDLE; idle-slice: SCHED_IDLE with a 100 µs slice
(sched_attr.sched_runtime); nice19: SCHED_OTHER nice 19. --pin: one host
and one vCPU process, both on CPU 1.
"""

import argparse
import ctypes
import multiprocessing as mp
import os
import time

SYS_SCHED_SETATTR = 314  # x86_64
libc = ctypes.CDLL(None, use_errno=True)


class SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32),
                ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64)]


def set_attr(pid, policy, priority=0, nice=0, runtime=0):
    a = SchedAttr(ctypes.sizeof(SchedAttr), policy, 0, nice, priority, runtime, 0, 0)
    if libc.syscall(SYS_SCHED_SETATTR, pid, ctypes.byref(a), 0) != 0:
        raise OSError(ctypes.get_errno(), f"sched_setattr({pid})")


LOW = {"idle": {"policy": os.SCHED_IDLE},
       "idle-slice": {"policy": os.SCHED_IDLE, "runtime": 100_000},
       "nice19": {"policy": os.SCHED_OTHER, "nice": 19}}


def spin(cpu, seconds):
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])  # utime + stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("on_ms", type=float)
    ap.add_argument("off_ms", type=float)
    ap.add_argument("low", nargs="?", default="nice19", choices=sorted(LOW))
    ap.add_argument("--pin", action="store_true")
    a = ap.parse_args()
    n, cpu = (1, 1) if a.pin else (os.cpu_count(), None)
    hosts = [mp.Process(target=spin, args=(cpu, 6)) for _ in range(n)]
    vcpus = [mp.Process(target=spin, args=(cpu, 6)) for _ in range(n)]
    for p in hosts + vcpus:
        p.start()
    try:
        set_attr(0, os.SCHED_FIFO, priority=50)
        time.sleep(0.3)
        t0 = [cpu_ticks(p.pid) for p in hosts + vcpus]
        end = time.monotonic() + 4
        while time.monotonic() < end:
            for p in vcpus:
                set_attr(p.pid, os.SCHED_FIFO, priority=1)
            time.sleep(a.on_ms / 1000)
            for p in vcpus:
                set_attr(p.pid, **LOW[a.low])
            time.sleep(a.off_ms / 1000)
        d = [t1 - t0 for t0, t1 in zip(t0, (cpu_ticks(p.pid) for p in hosts + vcpus))]
    finally:
        for p in vcpus:
            set_attr(p.pid, os.SCHED_OTHER)
        for p in hosts + vcpus:
            p.join()
    share = sum(d[n:]) / max(1, sum(d))
    print(f"{a.low}{' pinned' if a.pin else ''}, {a.on_ms:g} ms on / {a.off_ms:g} ms off: "
          f"vCPU share {share:.3f} (meant {a.on_ms / (a.on_ms + a.off_ms):.3f})")
