#!/usr/bin/env python3
"""Names what kept vCPU threads off a CPU: reads a tracefs text trace of
sched_switch / sched_wakeup / sched_migrate_task (bench/trace-run.sh records
one around any command) and prints every wait of a thread named `vcpu N`
longer than --over-us: woken (or preempted) until switched in, its priority
while it waited, the CPU it was switched in on and what ran there meanwhile
(comm, pid, priority, time), and how long that CPU recorded nothing at
all (not even a timer tick): a CPU taken away by the hypervisor of a host
that is itself a VM.

    bench/stall_trace.py TRACE [--over-us 1000]

Priorities are the kernel's: 0-98 SCHED_FIFO/RR (99 - rt priority), 100-139
SCHED_OTHER (120 + nice).
"""

import argparse
import re
from collections import defaultdict

LINE = re.compile(r"^\s*(?P<task>.+?)-(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>[\d.]+):\s+(?P<ev>\w+):\s+(?P<rest>.*)$")
SWITCH = re.compile(r"prev_comm=(?P<pc>.*?) prev_pid=(?P<pp>\d+) prev_prio=(?P<ppr>\d+) prev_state=(?P<ps>\S+) ==> "
                    r"next_comm=(?P<nc>.*?) next_pid=(?P<np>\d+) next_prio=(?P<npr>\d+)")
WAKEUP = re.compile(r"comm=(?P<c>.*?) pid=(?P<p>\d+) prio=(?P<pr>\d+) target_cpu=(?P<cpu>\d+)")


def parse(path):
    for line in open(path, errors="replace"):
        m = LINE.match(line)
        if m:
            yield int(m["cpu"]), float(m["ts"]), m["ev"], m["rest"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--over-us", type=float, default=1000.0)
    a = ap.parse_args()
    runs = defaultdict(list)  # cpu -> [(start, comm, pid, prio)]
    seen = defaultdict(list)  # cpu -> timestamps of every event there
    resched = defaultdict(list)  # cpu -> timestamps of reschedule IPIs taken
    waiting = {}  # vcpu pid -> (since, why, prio)
    waits = []
    for cpu, ts, ev, rest in parse(a.trace):
        seen[cpu].append(ts)
        if ev == "reschedule_entry":
            resched[cpu].append(ts)
        if ev == "sched_switch":
            m = SWITCH.match(rest)
            if not m:
                continue
            if not runs[cpu]:
                # The task switched out first ran since before the trace.
                runs[cpu].append((0.0, m["pc"], int(m["pp"]), int(m["ppr"])))
            runs[cpu].append((ts, m["nc"], int(m["np"]), int(m["npr"])))
            pp, np_ = int(m["pp"]), int(m["np"])
            if m["pc"].startswith("vcpu ") and m["ps"].startswith("R"):
                waiting[pp] = (ts, "preempted", int(m["ppr"]))
            if np_ in waiting:
                since, why, prio = waiting.pop(np_)
                if (ts - since) * 1e6 > a.over_us:
                    waits.append((since, ts, m["nc"], np_, why, prio, cpu))
        elif ev == "sched_wakeup":
            m = WAKEUP.match(rest)
            if m and m["c"].startswith("vcpu "):
                waiting[int(m["p"])] = (ts, "woken", int(m["pr"]))
    print(f"{len(waits)} vCPU wait(s) over {a.over_us:.0f} µs")
    for since, until, comm, pid, why, prio, cpu in waits:
        ran = defaultdict(float)
        seq = runs[cpu]
        for i, (start, c, p, pr) in enumerate(seq):
            end = seq[i + 1][0] if i + 1 < len(seq) else until
            lo, hi = max(start, since), min(end, until)
            if hi > lo and p != pid:
                ran[(c, p, pr)] += hi - lo
        who = ", ".join(f"{c}/{p} prio {pr} {t * 1e3:.2f} ms"
                        for (c, p, pr), t in sorted(ran.items(), key=lambda x: -x[1]))
        # A CPU that records nothing at all (not even its timer tick)
        # while a task is queued there was not running: on a host that is
        # itself a VM, its hypervisor had taken it.
        there = [t for t in seen[cpu] if since <= t <= until]
        edges = [since] + there + [until]
        silent = max(b - a for a, b in zip(edges, edges[1:]))
        ipi = next((t for t in resched[cpu] if since <= t <= until), None)
        ipi = "no reschedule IPI" if ipi is None else f"reschedule IPI taken at +{(ipi - since) * 1e3:.2f} ms"
        print(f"{since:.6f} {comm}/{pid} {why} at prio {prio}, waited {(until - since) * 1e3:.2f} ms, "
              f"switched in on CPU {cpu}; meanwhile there: {who or 'nothing traced'}; "
              f"{len(there)} events on CPU {cpu} in the wait, longest silence {silent * 1e3:.2f} ms, {ipi}")


if __name__ == "__main__":
    main()
