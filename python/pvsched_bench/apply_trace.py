"""Where the decision -> applied time goes: reads a tracefs text trace
(bench/trace-run.sh, mono clock) and the agent's decision trace (`pvsched
run --trace FILE`, one JSON record per line, `ts` on the same clock) and,
for every record whose thread the agent then changed with sched_setattr,
the time from the decision (the BPF program's clock read) to each step:

    irq_work   the first irq_work interrupt after it (the ring buffer wakes
               its reader from irq_work: a self-IPI on x86)
    waking     sched_waking of the agent's applier thread (pvsched-apply)
    on_cpu     the applier switched in
    returned   back in user space: its first system call return after that
               (only with raw_syscalls events, PVSCHED_TRACE_EXTRA)
    setattr    sched_setattr(tid) entered
    applied    sched_setattr(tid) returned

and prints p50 / p90 / max of each (µs), with how often the applier was
woken on the CPU that took the irq_work. With --json, one JSON object.

    python3 -m pvsched_bench apply-trace TRACE DECISIONS.jsonl [--json]
"""

import argparse
import bisect
import json

from .ftrace import records
from .stats import quantiles

APPLIER = "pvsched-apply"
STEPS = ["irq_work", "waking", "on_cpu", "returned", "setattr", "applied"]
WINDOW_NS = 5_000_000  # a record not applied within 5 ms is not matched


def parse(path):
    """(ts_ns, event, task, tid, cpu, rest) of each trace line."""
    out = []
    for m in records(path):
        out.append((round(float(m["ts"]) * 1e9), m["ev"], m["task"], int(m["tid"]),
                    int(m["cpu"]), m["rest"]))
    out.sort(key=lambda e: e[0])
    return out


def analyse(events, records):
    applier = next((tid for _, _, task, tid, _, _ in events if task == APPLIER), None)
    times = [e[0] for e in events]
    steps = {s: [] for s in STEPS}
    same_cpu = 0
    matched = 0
    for r in records:
        t0, tid = r["ts"], r["tid"]
        got = {}
        irq_cpu = wake_cpu = None
        for ts, ev, task, pid, cpu, rest in events[bisect.bisect_left(times, t0):]:
            if ts - t0 > WINDOW_NS:
                break
            if ev == "irq_work_entry" and "irq_work" not in got:
                got["irq_work"], irq_cpu = ts, cpu
            elif ev == "sched_waking" and "waking" not in got and f"pid={applier} " in rest:
                got["waking"] = ts
            elif ev == "sched_switch" and "waking" in got and "on_cpu" not in got \
                    and f"next_pid={applier} " in rest:
                got["on_cpu"], wake_cpu = ts, cpu
            elif ev == "sys_exit" and pid == applier and "on_cpu" in got and "returned" not in got:
                got["returned"] = ts
            elif ev == "sys_sched_setattr" and pid == applier:
                if "setattr" not in got and rest.startswith(f"pid: {tid:#x},"):
                    got["setattr"] = ts
                elif "setattr" in got and "->" in rest:
                    got["applied"] = ts
                    break
        if "applied" not in got:
            continue
        matched += 1
        # Steps in order only: an irq_work or a wake-up of the applier that
        # came after it was already running belongs to another record.
        prev = t0
        for s in STEPS:
            if s in got and got[s] >= prev:
                steps[s].append((got[s] - t0) / 1e3)
                prev = got[s]
        if irq_cpu is not None and irq_cpu == wake_cpu:
            same_cpu += 1
    return {
        "records": len(records),
        "applied": matched,
        "applier_tid": applier,
        "us_after_decision": {s: quantiles(v) for s, v in steps.items()},
        "woken_on_the_irq_work_cpu": same_cpu,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("decisions")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    records = [json.loads(line) for line in open(a.decisions) if line.strip()]
    res = analyse(parse(a.trace), records)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['applied']} of {res['records']} records applied by {APPLIER} "
          f"({res['woken_on_the_irq_work_cpu']} woken on the CPU that took the irq_work)")
    print(f"{'µs after the decision':<24}{'p50':>9}{'p90':>9}{'max':>9}{'n':>7}")
    for s in STEPS:
        q = res["us_after_decision"][s]
        if q:
            print(f"{s:<24}{q['p50']:>9.1f}{q['p90']:>9.1f}{q['max']:>9.1f}{q['n']:>7}")
