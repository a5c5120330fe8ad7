"""What pvsched's applier thread did, from a bench/trace-run.sh --applier trace:
how long each of its runs lasted on a CPU, how long each of its system
calls took (enter to exit), how long it waited on locks (futex) and how
long it waited, runnable, for a CPU after being preempted. Prints p50 /
p99 / max (µs) and the waits over 1 ms; with --json, one JSON object.

    python3 -m pvsched_bench applier-waits OUT.trace [--json]

A futex call by the applier is a lock it shares with another thread of
its process: the applier sleeps in epoll_wait, never on a futex, so any
futex wait is time a decision may sit unapplied.
"""

import argparse
import json
import re

from .ftrace import fields, records
from .stats import quantiles

APPLIER = "pvsched-apply"
NR_FUTEX = 202  # x86_64
FUTEX_OPS = {0: "WAIT", 1: "WAKE", 6: "LOCK_PI", 7: "UNLOCK_PI", 9: "WAIT_BITSET",
             10: "WAKE_BITSET"}
SLOW_NS = 1_000_000


def analyse(path):
    runs, preempted, waits = [], [], []
    calls = {}          # nr -> [durations]
    futex_by_op = {}    # op name -> [durations]
    slow_futex = []
    on_cpu = {}         # tid -> switch-in ts
    runnable = {}       # tid -> preempted-at ts
    in_call = {}        # tid -> (ts, nr, args)
    tids = set()
    switched_out = {}   # tid -> ts of its last switch out
    last_at = {}        # cpu -> ts of its last record
    inferred = 0
    first = last = None
    for m in records(path):
        ts = round(float(m["ts"]) * 1e9)
        first = ts if first is None else first
        last = ts
        ev, rest, tid, cpu = m["ev"], m["rest"], int(m["tid"]), int(m["cpu"])
        if m["task"].strip() == APPLIER and tid in switched_out and tid not in on_cpu:
            # A record the applier made itself, on a CPU, with no switch in
            # since it last left one: the kernel did not record that switch
            # (some hosts never record a switch out of an idle task). Put it
            # at the latest time it can have been: that CPU's last record.
            on_cpu[tid] = max(last_at.get(cpu, ts), switched_out[tid])
            inferred += 1
            if tid in runnable:
                preempted.append(on_cpu[tid] - runnable.pop(tid))
        last_at[cpu] = ts
        if ev == "sched_switch":
            f = fields(rest.replace(" ==> ", " "))
            prev, nxt = int(f.get("prev_pid", -1)), int(f.get("next_pid", -1))
            if f.get("prev_comm") == APPLIER:
                tids.add(prev)
                if prev in on_cpu:
                    runs.append(ts - on_cpu.pop(prev))
                switched_out[prev] = ts
                if f.get("prev_state", "").startswith("R"):
                    runnable[prev] = ts
            if f.get("next_comm") == APPLIER:
                tids.add(nxt)
                on_cpu[nxt] = ts
                if nxt in runnable:
                    preempted.append(ts - runnable.pop(nxt))
        elif ev == "sys_enter" and m["task"] == APPLIER:
            mm = re.match(r"NR (\d+) \((.*)\)", rest)
            if mm:
                in_call[tid] = (ts, int(mm[1]), mm[2].split(", "))
        elif ev == "sys_exit" and m["task"] == APPLIER:
            mm = re.match(r"NR (\d+) = (-?\d+)", rest)
            if not mm or tid not in in_call:
                continue
            t0, nr, args = in_call.pop(tid)
            if nr != int(mm[1]):
                continue
            d = ts - t0
            calls.setdefault(nr, []).append(d)
            if nr == NR_FUTEX:
                op = int(args[1], 16) & 0x7f if len(args) > 1 else -1
                name = FUTEX_OPS.get(op, str(op))
                futex_by_op.setdefault(name, []).append(d)
                if name not in ("WAKE", "WAKE_BITSET", "UNLOCK_PI"):
                    waits.append(d)
                if d > SLOW_NS:
                    slow_futex.append({"at_s": round(t0 / 1e9, 6), "op": name,
                                       "ms": round(d / 1e6, 3)})
    span = (last - first) / 1e9 if first is not None else 0
    return {
        "applier_tids": sorted(tids),
        "span_s": round(span, 1),
        "runs_us": quantiles(runs, 1e3),
        "preempted_wait_us": quantiles(preempted, 1e3),
        "syscalls_us": {str(nr): quantiles(v, 1e3) for nr, v in sorted(calls.items())},
        "futex_by_op_us": {k: quantiles(v, 1e3) for k, v in sorted(futex_by_op.items())},
        "lock_waits_us": quantiles(waits, 1e3),
        "lock_waits_over_1ms": len([w for w in waits if w > SLOW_NS]),
        "lock_waits_over_2ms": len([w for w in waits if w > 2 * SLOW_NS]),
        "slow_futex": slow_futex,
        "idle_switch_ins": inferred,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = analyse(a.trace)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{APPLIER} threads {res['applier_tids']}, {res['span_s']} s traced")
    print(f"{'µs':<28}{'n':>8}{'p50':>9}{'p99':>9}{'max':>10}{'sum ms':>10}")
    rows = [("runs on a CPU", res["runs_us"]),
            ("preempted, waiting for CPU", res["preempted_wait_us"]),
            ("lock waits (futex)", res["lock_waits_us"])]
    rows += [(f"  futex {k}", v) for k, v in res["futex_by_op_us"].items()]
    for name, q in rows:
        if q:
            print(f"{name:<28}{q['n']:>8}{q['p50']:>9}{q['p99']:>9}{q['max']:>10}{round(q['sum'] / 1e3, 2):>10}")
        else:
            print(f"{name:<28}{0:>8}")
    print(f"lock waits over 1 ms: {res['lock_waits_over_1ms']}, "
          f"over 2 ms: {res['lock_waits_over_2ms']}")
    if res["idle_switch_ins"]:
        print(f"{res['idle_switch_ins']} switch(es) in the trace lacked, put back from the "
              f"applier's own records")
