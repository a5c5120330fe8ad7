"""Where a co-scheduled phase's time goes, from a host trace.

    bench/trace-run.sh OUT -- python3 -m pvsched_bench s6 --variants pvsched-coauto ... --json -
    python3 -m pvsched_bench phase-trace OUT.trace [--json]

Co-scheduling (caps `cosched_us`) moves every vCPU thread of a VM to
SCHED_FIFO 1 for its phase and to nice 19 for the rest of the period. Its
gain is the time the VM's vCPUs run at the same time; this tool measures
how much of each phase they did. It finds the phases from the trace alone:
the agent's sched_setattr calls (syscalls/sys_enter_sched_setattr, one
"edge" is the calls within EDGE_GAP_S of each other) and the priority the
threads it set then show in their next sched_switch (98 = FIFO 1: the
phase). For each phase (from the edge that put a VM's vCPU threads at
FIFO 1 to the edge that took them off) it splits the time by how many of
those threads were on a CPU (all, some, none) and, for the time a thread
was runnable but not on a CPU, what ran instead (by command name: CPU
time summed over the CPUs, as a share of the phases' time), and reports
how long after the edge every thread of the phase first ran. Outside the
phases it counts the VM's vCPU time (a vCPU at nice 19 still runs now and
then, without its siblings): in-phase and off-phase seconds, and the
off-phase runs per second and their length.

For every VM, phased or not (a vanilla one too), it also reports how much
of its vCPU time ran with all its vCPUs on a CPU at once ("together"), in
each workload run python3 -m pvsched_bench s6 marked in the trace: what co-scheduling
raises, so a vanilla run's figure says how much there was to gain. The
VMs are the ones s6.py names in the trace (a mark with each VM's vCPU
thread ids); in a trace without them, by names and thread ids: "CPU 0/..."
and, for each k, the next "CPU k/..." thread after it (right for one VM
at a time; VMs started together can interleave their threads).

vCPU threads are told by their command name (QEMU's debug-threads names,
"CPU n/TCG" or "CPU n/KVM"); a VM's threads are those set to FIFO 1 in the
same edge (at least two of them: one thread back at FIFO 1 alone is a boost
ending).
"""

import argparse
import bisect
import json
import math
import re
import statistics
from collections import Counter, defaultdict

from .ftrace import PREFIX
from .stall_trace import parse

# sched_setattr calls this close together are one phase change.
EDGE_GAP_S = 0.0005
MARK = re.compile(PREFIX + r"tracing_mark_write: s6 (?P<what>start|end|vm) (?P<run>.+?)\s*$")
VCPU = re.compile(r"^CPU \d+/(TCG|KVM)$")
SETATTR = re.compile(PREFIX + r"sys_sched_setattr\(pid: (?:0x)?(?P<pid>[0-9a-f]+),")


def load(path):
    """(switches, setattrs, comm, vcpus, runs): switches as (ts, cpu, prev,
    prev_prio, prev_state, next, next_prio) in time order (a wake-up as
    (ts, cpu, tid, -1, "W", None, prio)), setattr calls as (ts, tid), every
    thread's comm by tid, the vCPU threads' by tid, python3 -m pvsched_bench s6's
    workload runs its trace marks name, as (start, end, "TAG WORKLOAD"), and
    the VMs they name ({name: vCPU tids in vCPU order})."""
    switches, setattrs, comm = [], [], {}
    runs, started, named = [], {}, {}
    for cpu, ts, ev, rest, f in parse(path):
        if ev == "sched_switch" and f:
            prev, nxt = int(f["pp"]), int(f["np"])
            comm[prev], comm[nxt] = f["pc"], f["nc"]
            switches.append((ts, cpu, prev, int(f["ppr"]), f["ps"], nxt, int(f["npr"])))
        elif ev == "sched_wakeup" and f:
            # A wake-up: (ts, cpu, tid, -1, "W", None, prio); split() marks
            # the thread runnable.
            switches.append((ts, cpu, int(f["p"]), -1, "W", None, int(f["pr"])))
    # stall_trace's parser skips system-call records ("name(args)").
    for line in open(path, errors="replace"):
        m = SETATTR.match(line)
        if m:
            setattrs.append((float(m["ts"]), int(m["pid"], 16)))
            continue
        m = MARK.match(line)
        if m and m["what"] == "vm":
            name, _, tids = m["run"].partition(" ")
            named[name] = tuple(int(t) for t in tids.split(",") if t.isdigit())
        elif m and m["what"] == "start":
            started[m["run"]] = float(m["ts"])
        elif m and m["run"] in started:
            runs.append((started.pop(m["run"]), float(m["ts"]), m["run"]))
    vcpus = {t: c for t, c in comm.items() if VCPU.match(c)}
    # In time order once, for every reader (a switch parse() puts back can
    # come after later records of other CPUs).
    switches.sort(key=lambda s: s[0])
    return switches, setattrs, comm, vcpus, sorted(runs), named


def edges(setattrs):
    """[(ts of the first call, [(tid, ts of its call), ...])], the calls
    grouped by EDGE_GAP_S."""
    out = []
    for ts, tid in sorted(setattrs):
        if out and ts - out[-1][2] <= EDGE_GAP_S:
            out[-1][1].append((tid, ts))
            out[-1][2] = ts
        else:
            out.append([ts, [(tid, ts)], ts])
    return [(a, calls) for a, calls, _ in out]


def phases(switches, edge_list, vcpus):
    """[(start, end, tids)]: each VM's phase, from the edge that put its
    vCPU threads in it to the next edge that took any of them out.

    An edge that sets two or more vCPU threads is a phase change (one
    thread alone is a boost). Each thread's new side is read from the
    priority it shows in its first record after its call and before its
    next call (RT: in the phase; a fair-class priority, >= 100: out); a
    thread with no such record (it stayed on its CPU until a later call
    changed it again) is taken to have changed sides, as a phase edge
    does."""
    by_tid = defaultdict(list)
    for s in switches:
        if s[2] in vcpus:
            by_tid[s[2]].append((s[0], s[3] if s[5] is not None else s[6]))
        if s[5] in vcpus:
            by_tid[s[5]].append((s[0], s[6]))
    calls = defaultdict(list)
    for _, cs in edge_list:
        for tid, ts in cs:
            calls[tid].append(ts)
    times = {t: [r[0] for r in recs] for t, recs in by_tid.items()}

    def prio(tid, ts):
        """tid's priority in its first record at or after its call at
        `ts` and before its next call, or None."""
        c = calls[tid]
        nxt = c[bisect.bisect_right(c, ts)] if bisect.bisect_right(c, ts) < len(c) else None
        i = bisect.bisect_left(times.get(tid, []), ts)
        recs = by_tid.get(tid, [])
        if i < len(recs) and (nxt is None or recs[i][0] < nxt):
            return recs[i][1]
        return None

    out, open_, inside = [], {}, {}
    for ts, cs in edge_list:
        vt = {}
        for tid, at in cs:
            if tid in vcpus:
                vt[tid] = at
        if len(vt) < 2:
            continue
        on, off = [], []
        for tid, at in sorted(vt.items()):
            p = prio(tid, at)
            now = p < 100 if p is not None else not inside.get(tid, False)
            if now != inside.get(tid, False):
                (on if now else off).append(tid)
            inside[tid] = now
        for key in list(open_):
            if any(t in key for t in off):
                out.append((open_.pop(key), ts, key))
        if len(on) >= 2:
            open_.setdefault(tuple(on), ts)
    return sorted(out)


# A run that begins this soon after a phase end, of a thread the edge left
# runnable, is that thread coming back off its phase.
AFTER_END_S = 0.0002


def outside(switches, plist):
    """How much of a VM's vCPU threads' time on a CPU fell outside its
    phases (from its first phase's start to its last one's end): the
    in-phase and off-phase seconds, the off-phase runs' lengths (ms), and
    the off-phase seconds by how the run began. Off the phase a vCPU runs
    without its siblings. How a run began: "past_phase_end" (it began in
    the phase and went on after its end), "back_after_phase_end" (the
    thread was taken off a CPU at a phase end, runnable, and picked again
    later in the off part), "preempted_off_phase" (taken off a CPU,
    runnable, elsewhere in the off part) or "woken" (it had slept)."""
    tids = plist[0][2]
    lo, hi = plist[0][0], plist[-1][1]
    starts = [p[0] for p in plist]
    ends = [p[1] for p in plist]

    def phase_of(t):
        i = bisect.bisect_right(starts, t) - 1
        return i if i >= 0 and t < plist[i][1] else None

    def near_end(t):
        i = bisect.bisect_left(ends, t - AFTER_END_S)
        return i < len(ends) and abs(ends[i] - t) <= AFTER_END_S

    runs, on_since, last = [], {}, {}
    for ts, _, prev, _, pstate, nxt, _ in switches:
        if nxt is None:
            if prev in tids:
                last[prev] = ("woken", ts)
            continue
        if prev in on_since:
            a, how = on_since.pop(prev)
            runs.append((a, ts, how))
        if prev in tids:
            last[prev] = ("preempted" if pstate.startswith("R") else "slept", ts)
        if nxt in tids:
            what, at = last.get(nxt, ("woken", ts))
            if what == "preempted":
                how = "back_after_phase_end" if near_end(at) else "preempted_off_phase"
            else:
                how = "woken"
            on_since[nxt] = (ts, how)
    in_s = off_s = 0.0
    off_runs = []
    by_start = Counter()
    for a, b, how in runs:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        inside = 0.0
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(plist) and plist[i][0] < b:
            inside += max(0.0, min(b, plist[i][1]) - max(a, plist[i][0]))
            i += 1
        in_s += inside
        off = (b - a) - inside
        off_s += off
        if off > 1e-5:
            off_runs.append(off * 1e3)
            by_start["past_phase_end" if phase_of(a) is not None else how] += off
    return in_s, off_s, sorted(off_runs), hi - lo, by_start


def split(switches, phase_list, comm):
    """Per phase: its length, the time all / some / none of its threads
    ran, each thread's first run after the start, and what ran while one
    of them was runnable and off a CPU."""
    running = {}   # cpu -> tid on it
    state = {}     # tid -> "run", "queued" (runnable, off a CPU) or "sleep"
    results = []
    i = 0

    def step(s):
        _, cpu, prev, _, pstate, nxt, _ = s
        if nxt is None:  # a wake-up
            if state.get(prev) != "run":
                state[prev] = "queued"
            return
        running[cpu] = nxt
        state[prev] = "queued" if pstate.startswith("R") else "sleep"
        state[nxt] = "run"
    for start, end, tids in phase_list:
        while i < len(switches) and switches[i][0] < start:
            step(switches[i])
            i += 1
        t, all_s, some_s, none_s = start, 0.0, 0.0, 0.0
        instead = Counter()
        first = {tid: (0.0 if state.get(tid) == "run" else None) for tid in tids}

        def account(upto):
            nonlocal all_s, some_s, none_s
            d = upto - t
            if d <= 0:
                return
            on = sum(1 for tid in tids if state.get(tid) == "run")
            if on == len(tids):
                all_s += d
            elif on:
                some_s += d
            else:
                none_s += d
            if any(state.get(tid) == "queued" for tid in tids):
                for cpu, r in running.items():
                    if r not in tids:
                        instead[comm.get(r, str(r)) if r else "idle"] += d
        while i < len(switches) and switches[i][0] < end:
            ts, nxt = switches[i][0], switches[i][5]
            account(ts)
            t = ts
            step(switches[i])
            if nxt in first and first[nxt] is None:
                first[nxt] = ts - start
            i += 1
        account(end)
        results.append({"start": start, "len_ms": (end - start) * 1e3,
                        "all_ms": all_s * 1e3, "some_ms": some_s * 1e3, "none_ms": none_s * 1e3,
                        "first_run_ms": [None if v is None else v * 1e3 for v in first.values()],
                        "instead_ms": {k: v * 1e3 for k, v in instead.items()}})
    return results


def vms(vcpus):
    """[(tid of CPU 0, ..., tid of CPU n-1)]: each VM's vCPU threads, by
    name and thread id (see the module's docstring)."""
    idx = {}
    for tid, c in vcpus.items():
        idx[tid] = int(c.split()[1].split("/")[0])
    firsts = sorted(t for t, k in idx.items() if k == 0)
    out = []
    for n, t0 in enumerate(firsts):
        limit = firsts[n + 1] if n + 1 < len(firsts) else math.inf
        group, k = [t0], 1
        for t in sorted(t for t in idx if t0 < t < limit):
            if idx[t] == k:
                group.append(t)
                k += 1
        if len(group) >= 2:
            out.append(tuple(group))
    return out


def together(switches, tids, lo=-math.inf, hi=math.inf):
    """One VM's vCPU time on a CPU (s) between `lo` and `hi`, and the share
    of it with all its vCPUs on a CPU at once (None with no vCPU time).
    `switches` may be only those of the VM's threads (see
    together_by_run)."""
    on = set()
    t = None
    vcpu_s = all_s = 0.0

    def add(upto):
        nonlocal vcpu_s, all_s
        d = min(upto, hi) - max(t, lo)
        if d > 0:
            vcpu_s += len(on) * d
            if len(on) == len(tids):
                all_s += len(tids) * d
    for ts, _, prev, _, _, nxt, _ in switches:
        if nxt is None or (prev not in tids and nxt not in tids):
            continue
        if ts >= hi:
            break
        if t is not None:
            add(ts)
        t = ts
        on.discard(prev)
        if nxt in tids:
            on.add(nxt)
    if t is not None and hi < math.inf:
        add(hi)
    return round(vcpu_s, 3), (round(all_s / vcpu_s, 4) if vcpu_s else None)


def together_by_run(switches, tids, runs):
    """together() for each workload run (python3 -m pvsched_bench s6's trace marks) in
    which this VM's vCPUs ran, or for the whole trace without marks."""
    # The VM's own switches, picked once for all its runs.
    switches = [s for s in switches if s[5] is not None and (s[2] in tids or s[5] in tids)]
    if not runs:
        vcpu_s, share = together(switches, tids)
        return [{"run": "whole trace", "vcpu_s": vcpu_s, "together_share": share}]
    out = []
    for a, b, name in runs:
        vcpu_s, share = together(switches, tids, a, b)
        if vcpu_s:
            out.append({"run": name, "vcpu_s": vcpu_s, "together_share": share})
    return out


def p90(xs):
    """The 90th percentile of `xs` by nearest rank."""
    xs = sorted(xs)
    return xs[max(math.ceil(0.9 * len(xs)) - 1, 0)]


def summary(rows, off):
    """One VM's figures from its phases (split()) and outside()."""
    if not rows:
        return {"phases": 0}
    in_s, off_s, off_runs, span, by_start = off
    tot = sum(r["len_ms"] for r in rows)
    instead = Counter()
    for r in rows:
        instead.update(r["instead_ms"])
    firsts = [max(v for v in r["first_run_ms"] if v is not None)
              for r in rows if all(v is not None for v in r["first_run_ms"])]
    return {
        "phases": len(rows),
        "phase_ms_median": round(statistics.median(r["len_ms"] for r in rows), 3),
        "all_running": round(sum(r["all_ms"] for r in rows) / tot, 4),
        "some_running": round(sum(r["some_ms"] for r in rows) / tot, 4),
        "none_running": round(sum(r["none_ms"] for r in rows) / tot, 4),
        "last_first_run_ms_median": round(statistics.median(firsts), 3) if firsts else None,
        "last_first_run_ms_p90": round(p90(firsts), 3) if firsts else None,
        "phases_with_a_thread_never_run": len(rows) - len(firsts),
        "instead_share": {k: round(v / tot, 4) for k, v in instead.most_common(8)},
        "vcpu_s_in_phase": round(in_s, 3),
        "vcpu_s_off_phase": round(off_s, 3),
        "off_phase_share": round(off_s / (in_s + off_s), 4) if in_s + off_s else None,
        "off_phase_runs_per_s": round(len(off_runs) / span, 1) if span else None,
        "off_phase_run_ms_p50": round(off_runs[len(off_runs) // 2], 3) if off_runs else None,
        "off_phase_run_ms_p90": round(p90(off_runs), 3) if off_runs else None,
        "off_phase_ms_per_s_by_start": ({k: round(v * 1e3 / span, 1)
                                         for k, v in sorted(by_start.items())} if span else {}),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    a = ap.parse_args()
    switches, setattrs, comm, vcpus, runs, named = load(a.trace)
    rows = phases(switches, edges(setattrs), vcpus)
    by_vm = defaultdict(list)
    for start, end, tids in rows:
        by_vm[tids].append((start, end, tids))
    # A key that shares a thread with a more frequent one is an edge that
    # mixed one VM's phase change with another's boost: not a VM. Where
    # the trace names the VMs, only theirs are.
    kept = []
    vm_sets = [set(t) for t in named.values()]
    for tids in sorted(by_vm, key=lambda k: -len(by_vm[k])):
        if vm_sets and set(tids) not in vm_sets:
            continue
        if not any(set(tids) & set(k) for k in kept):
            kept.append(tids)
    out = {}
    for tids, plist in sorted((k, by_vm[k]) for k in kept):
        out[",".join(f"{vcpus[t]}({t})" for t in tids)] = summary(split(switches, plist, comm),
                                                                   outside(switches, plist))
    for tids in (named.values() if named else vms(vcpus)):
        key = ",".join(f"{vcpus.get(t, 'vCPU')}({t})" for t in sorted(tids))
        out.setdefault(key, {"phases": 0})["together"] = together_by_run(switches, set(tids), runs)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(k)
            for f, x in v.items():
                print(f"  {f}: {x}")
