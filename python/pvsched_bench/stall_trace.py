"""Names what kept vCPU threads off a CPU: reads a tracefs text trace of
sched_switch / sched_wakeup / sched_migrate_task (bench/trace-run.sh records
one around any command) and prints every wait of a thread named `vcpu N`
(or of the threads --tids names) longer than --over-us: woken (or
preempted) until switched in, its priority while it waited, the CPU it was
switched in on, the CPU it was queued on longest (they differ when another
CPU pulled it) and what ran there meanwhile (comm, pid, priority, time),
and how long that CPU recorded nothing at all (not even a timer tick): a
CPU taken away by the hypervisor of a host that is itself a VM.

    python3 -m pvsched_bench stall-trace TRACE [--over-us 1000] [--tids 123=main,124=vcpu0]
                         [--json] [--from S --to S]
    python3 -m pvsched_bench stall-trace TRACE --sleeps --tids 123=main,124=vcpu0,125=vcpu1

--sleeps looks at the other half of a thread's time off a CPU: every
block (switched out, not runnable) over --over-us until its wake-up, who
woke it and, when the trace has system calls (PVSCHED_TRACE_EXTRA=
"syscalls/sys_enter_futex" for bench/trace-run.sh), the futex word it
last waited on: a vCPU thread of QEMU TCG blocked on the word its sibling
wakes it on is waiting for a lock that sibling held (the BQL), not halted.

Each wait gets a cause, the first that fits:
  stolen       the CPU it was queued on recorded nothing (not even the
               reschedule IPI a wake-up sends) for at least half the wait,
               the thread at an RT priority or the silence over 10 ms:
               this host's own hypervisor ran something else
  unboosted    the thread waited at SCHED_OTHER priority (100-139)
  behind-rt    RT tasks at the thread's priority or above ran there for at
               least half the wait
  behind-fair  SCHED_OTHER tasks ran there for at least half the wait
               although the thread waited at an RT priority: RT bandwidth
               throttling (sched_rt_runtime_us), or a wake-up queued on
               another CPU than the one it ran on
  other        none of these
--windows FILE (a JSON list of {"label", "from", "to"}: a thread's comm,
e.g. "vcpu 0", and a latency sample's start and end on the trace's clock;
pvsched-bench --trace writes one per run from its samples over 1 ms) says
instead, per sample, where that thread was meanwhile: on a CPU, queued on
one, or asleep, for how long each, the longest silence of the CPU it ran
or was queued on, and a cause, the first that fits:
  queued-...   queued for at least half of it: the cause of its longest
               wait, as above (queued-stolen, queued-unboosted, ...;
               queued-in-short-waits: none of them over --over-us)
  asleep       blocked for at least half of it: the interrupt had not
               woken it (the injector, or KVM's delivery)
  running-silent  on a CPU for at least half of it, and that CPU recorded
               nothing for at least half of it: with KVM's events in the
               trace (pvsched-bench --trace records them for S1: exits,
               emulated instructions), not even KVM working for it, so the
               host's own hypervisor held the CPU (or the guest ran that
               long without one exit)
  running      on a CPU that kept recording: the guest, or the VMM's and
               KVM's exits, took the time
  mixed        none of these; untraced: the trace has nothing of it
With --decisions FILE (the policy's decision trace, one JSON record per
line: pvsched-bench --trace writes one per pvsched run) and a "tid" in each
window, each sample also gets the boost its thread had when it began:
boosted, throttled (its budget spent: throttled_until ahead) or none
(between two boosts); the JSON counts them ("boost") and by cause and
boost ("cause_boost", e.g. "queued-unboosted/throttled").
It then lists every interval over --over-us in which no CPU recorded
anything: the whole host stopped (its own hypervisor took all its CPUs),
which every thread waits through, runnable or not.
--json prints {"over_us", "waits": [...], "causes": {cause: count},
"ran": [...], "host_gaps": [{"at", "ms"}, ...]}: "ran" sums, over the
waits, the time each kind of thread ran where they waited (its comm with
the digits taken out, e.g. "CPU #/TCG", and its priority), longest first,
so a run's tail can be told by what it waited behind; --summary leaves the
waits out and gives their count and total ("n", "wait_ms") instead. --from/--to (the trace's clock, s:
CLOCK_MONOTONIC with trace_clock mono) keep only the waits and gaps that
overlap that window, e.g. a benchmark's measured time (pvsched-bench
--trace passes it).

Priorities are the kernel's: 0-98 SCHED_FIFO/RR (99 - rt priority), 100-139
SCHED_OTHER (120 + nice).
"""

import argparse
import bisect
import json
import re
from collections import Counter, defaultdict

from .ftrace import LINE, PREFIX

SWITCH = re.compile(r"prev_comm=(?P<pc>.*?) prev_pid=(?P<pp>\d+) prev_prio=(?P<ppr>\d+) prev_state=(?P<ps>\S+) ==> "
                    r"next_comm=(?P<nc>.*?) next_pid=(?P<np>\d+) next_prio=(?P<npr>\d+)")
WAKEUP = re.compile(r"comm=(?P<c>.*?) pid=(?P<p>\d+) prio=(?P<pr>\d+) target_cpu=(?P<cpu>\d+)")
# A silence this long is a CPU taken away whatever waited on it.
LONG_SILENCE_S = 0.010
MIGRATE = re.compile(r"pid=(?P<p>\d+) prio=\d+ orig_cpu=\d+ dest_cpu=(?P<dest>\d+)")
MIGRATE_COMM = re.compile(r"comm=(?P<c>.*?) pid=\d+ prio=\d+ orig_cpu=\d+ dest_cpu=(?P<dest>\d+)")


def parse(path, inferred=None):
    """(cpu, ts, event, rest, fields) of each record, oldest first
    (`fields`: the SWITCH match of a sched_switch, the WAKEUP match of a
    sched_wakeup, else None; matched once here for every reader), with every
    switch out of a CPU's idle task the trace lacks put back: on some hosts
    (this project's CI machines: CPU 1) the kernel never records
    sched_switch from the idle task, so a thread woken onto that idle CPU
    would look queued until it next switched out. A record made on a CPU by
    a thread while that CPU's last switch left it idle proves the switch;
    it is put at the latest time it can have been (the CPU's last record
    from idle, or the thread's wake-up if later). `inferred`, a dict, gets
    the count ("idle_switch_ins")."""
    current = {}  # cpu -> pid its last sched_switch left running
    last_at = {}  # cpu -> ts of its last record
    known = {}    # pid -> (comm, prio, ts of its last wake-up)
    for line in open(path, errors="replace"):
        m = LINE.match(line)
        if not m:
            continue
        cpu, ts, ev, rest, pid = int(m["cpu"]), float(m["ts"]), m["ev"], m["rest"], int(m["tid"])
        if pid != 0 and current.get(cpu) == 0:
            comm, prio, woken = known.get(pid, (m["task"].strip(), 120, 0.0))
            at = max(last_at.get(cpu, ts), woken)
            if inferred is not None:
                inferred["idle_switch_ins"] = inferred.get("idle_switch_ins", 0) + 1
            current[cpu] = pid
            put_back = (f"prev_comm=swapper/{cpu} prev_pid=0 prev_prio=120 prev_state=R ==> "
                        f"next_comm={comm} next_pid={pid} next_prio={prio}")
            yield cpu, at, "sched_switch", put_back, SWITCH.match(put_back)
        last_at[cpu] = ts
        fields = None
        if ev == "sched_switch":
            fields = sw = SWITCH.match(rest)
            if sw:
                current[cpu] = int(sw["np"])
                known[int(sw["np"])] = (sw["nc"], int(sw["npr"]),
                                        known.get(int(sw["np"]), ("", 0, 0.0))[2])
        elif ev == "sched_wakeup":
            fields = w = WAKEUP.match(rest)
            if w:
                known[int(w["p"])] = (w["c"], int(w["pr"]), ts)
        yield cpu, ts, ev, rest, fields


def analyze(path, over_us, tids=None, inferred=None):
    """(waits, gaps) of one pass over the trace. waits: every wait over
    `over_us` of the selected threads (`tids`: {tid: label}; None: threads
    whose comm starts with "vcpu "), oldest first, each a dict with its
    cause (see the module's docstring). gaps: every interval over
    `over_us` in which no CPU recorded any event, [(start, ms)] oldest
    first: on a busy host (each CPU ticks every few ms), the whole host
    stopped, i.e. its own hypervisor ran something else on all its CPUs
    at once. Every thread waits through such a gap, runnable or not, so
    it shows in no thread's wait."""
    def chosen(comm, pid):
        return pid in tids if tids is not None else comm.startswith("vcpu ")

    runs = defaultdict(list)  # cpu -> [(start, comm, pid, prio)]
    seen = defaultdict(list)  # cpu -> timestamps of every event there
    resched = defaultdict(list)  # cpu -> timestamps of reschedule IPIs taken
    waiting = {}  # pid -> (since, why, prio, [(from, CPU it is queued on)])
    raw, gaps, last = [], [], None
    for cpu, ts, ev, rest, m in parse(path, inferred):
        seen[cpu].append(ts)
        if last is not None and (ts - last) * 1e6 > over_us:
            gaps.append((last, round((ts - last) * 1e3, 3)))
        last = ts if last is None else max(last, ts)
        if ev == "reschedule_entry":
            resched[cpu].append(ts)
        if ev == "sched_switch":
            if not m:
                continue
            if not runs[cpu]:
                # The task switched out first ran since before the trace.
                runs[cpu].append((0.0, m["pc"], int(m["pp"]), int(m["ppr"])))
            runs[cpu].append((ts, m["nc"], int(m["np"]), int(m["npr"])))
            pp, np_ = int(m["pp"]), int(m["np"])
            if chosen(m["pc"], pp) and m["ps"].startswith("R"):
                waiting[pp] = (ts, "preempted", int(m["ppr"]), [(ts, cpu)])
            if np_ in waiting:
                since, why, prio, queued = waiting.pop(np_)
                if (ts - since) * 1e6 > over_us:
                    raw.append((since, ts, m["nc"], np_, why, prio, queued, cpu))
        elif ev == "sched_wakeup":
            if m and chosen(m["c"], int(m["p"])):
                waiting[int(m["p"])] = (ts, "woken", int(m["pr"]), [(ts, int(m["cpu"]))])
        elif ev == "sched_migrate_task":
            m = MIGRATE.search(rest)
            if m and int(m["p"]) in waiting:
                waiting[int(m["p"])][3].append((ts, int(m["dest"])))
    starts = {c: [r[0] for r in seq] for c, seq in runs.items()}
    waits = []
    for since, until, comm, pid, why, prio, moves, cpu in raw:
        # What kept it waiting is on the CPU it was queued on longest
        # (woken onto, preempted on, or migrated to), which may not be the
        # one it ran on in the end: a CPU the host's hypervisor took away
        # keeps its queued FIFO thread until another CPU pulls it.
        ends = [t for t, _ in moves[1:]] + [until]
        segs = [(a, e, c) for (a, c), e in zip(moves, ends)]
        lo_q, hi_q, queued = max(segs, key=lambda x: x[1] - x[0])
        ran = defaultdict(float)
        seq = runs[queued]
        # Each CPU's records are in time order: look only at the runs that
        # overlap the wait (a whole trace has millions).
        first = max(bisect.bisect_right(starts[queued], lo_q) - 1, 0)
        last = bisect.bisect_right(starts[queued], hi_q)
        for i in range(first, last):
            start, c, p, pr = seq[i]
            end = seq[i + 1][0] if i + 1 < len(seq) else until
            lo, hi = max(start, lo_q), min(end, hi_q)
            if hi > lo and p != pid:
                ran[(c, p, pr)] += hi - lo
        # A CPU that records nothing at all (not even its timer tick)
        # while a task is queued there was not running: on a host that is
        # itself a VM, its hypervisor had taken it.
        ev = seen[queued]
        there = ev[bisect.bisect_left(ev, lo_q):bisect.bisect_right(ev, hi_q)]
        edges = [lo_q] + there + [hi_q]
        silent = max(b - a for a, b in zip(edges, edges[1:]))
        rs = resched[queued]
        k = bisect.bisect_left(rs, lo_q)
        ipi = rs[k] if k < len(rs) and rs[k] <= hi_q else None
        span = hi_q - lo_q
        rt = sum(t for (_, _, pr), t in ran.items() if pr <= prio)
        fair = sum(t for (_, _, pr), t in ran.items() if pr >= 100)
        # A busy CPU of a HZ=250 host records a tick every 4 ms: a silence
        # that long only means the thread queued there was not preferred,
        # unless it waited at an RT priority (whose wake-up sends a
        # reschedule IPI at once) or the silence spans several ticks.
        if silent >= span / 2 and (prio < 100 or silent >= LONG_SILENCE_S):
            cause = "stolen"
        elif prio >= 100:
            cause = "unboosted"
        elif rt >= span / 2:
            cause = "behind-rt"
        elif fair >= span / 2:
            cause = "behind-fair"
        else:
            cause = "other"
        waits.append({"at": since, "thread": comm, "tid": pid,
                      "label": tids.get(pid) if tids is not None else comm,
                      "why": why, "prio": prio, "wait_ms": round((until - since) * 1e3, 3),
                      "queued_cpu": queued, "queued_ms": round(span * 1e3, 3), "cpu": cpu,
                      "cause": cause, "silent_ms": round(silent * 1e3, 3),
                      "events": len(there),
                      "resched_ipi_ms": None if ipi is None else round((ipi - since) * 1e3, 3),
                      "ran": [{"comm": c, "pid": p, "prio": pr, "ms": round(t * 1e3, 3)}
                              for (c, p, pr), t in sorted(ran.items(), key=lambda x: -x[1])]})
    return waits, gaps


def timeline(path, labels, inferred=None):
    """Each thread whose comm is in `labels`: its intervals
    {comm: [(start, end, state, cpu, prio)]} with state "run", "queued" or
    "asleep", oldest first (the first begins at its first event), and
    every CPU's event timestamps {cpu: [ts]} (for its silences)."""
    spans = defaultdict(list)
    now = {}  # comm -> (since, state, cpu, prio)
    seen = defaultdict(list)

    def move(comm, ts, state, cpu, prio):
        if comm in now:
            since, st, c, pr = now[comm]
            spans[comm].append((since, ts, st, c, pr))
        now[comm] = (ts, state, cpu, prio)

    for cpu, ts, ev, rest, m in parse(path, inferred):
        seen[cpu].append(ts)
        if ev == "sched_switch":
            if not m:
                continue
            if m["pc"] in labels:
                state = "queued" if m["ps"].startswith("R") else "asleep"
                move(m["pc"], ts, state, cpu, int(m["ppr"]))
            if m["nc"] in labels:
                move(m["nc"], ts, "run", cpu, int(m["npr"]))
        elif ev == "sched_wakeup":
            if m and m["c"] in labels:
                move(m["c"], ts, "queued", int(m["cpu"]), int(m["pr"]))
        elif ev == "sched_migrate_task":
            m = MIGRATE_COMM.match(rest)
            if m and m["c"] in labels and now.get(m["c"], (0, ""))[1] == "queued":
                move(m["c"], ts, "queued", int(m["dest"]), now[m["c"]][3])
    end = max((t[-1] for t in seen.values() if t), default=0.0)
    for comm, (since, st, c, pr) in now.items():
        spans[comm].append((since, end, st, c, pr))
    return spans, seen


def explain_windows(path, windows, over_us, inferred=None):
    """Where each window's thread was during it (see the module's
    docstring, --windows): one dict per window, in the order given."""
    labels = {w["label"] for w in windows}
    spans, seen = timeline(path, labels, inferred)
    starts = {label: [x[0] for x in seq] for label, seq in spans.items()}
    waits, _ = analyze(path, over_us, None)
    # A thread waits once at a time: its waits, oldest first, end in order.
    by_thread = defaultdict(list)
    for x in waits:
        by_thread[x["thread"]].append(x)
    wait_at = {t: [x["at"] for x in seq] for t, seq in by_thread.items()}
    out = []
    for w in windows:
        lo, hi, label = float(w["from"]), float(w["to"]), w["label"]
        span = max(hi - lo, 1e-9)
        took = defaultdict(float)
        silent = run_silent = 0.0
        # A thread's intervals are back to back, oldest first: only those
        # from the one holding `lo` up to `hi` overlap (a trace of a busy
        # vCPU has hundreds of thousands).
        seq = spans.get(label, [])
        first = max(bisect.bisect_right(starts.get(label, []), lo) - 1, 0)
        for a, b, st, cpu, _ in seq[first:]:
            if a >= hi:
                break
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            took[st] += b - a
            if st in ("run", "queued"):
                ev = seen[cpu]
                there = ev[bisect.bisect_left(ev, a):bisect.bisect_right(ev, b)]
                edges = [a] + there + [b]
                gap = max(y - x for x, y in zip(edges, edges[1:]))
                silent = max(silent, gap)
                if st == "run":
                    run_silent = max(run_silent, gap)
        if not took:
            cause = "untraced"
        elif took["queued"] >= span / 2:
            k = bisect.bisect_right(wait_at.get(label, []), hi)
            mine = []
            for x in reversed(by_thread.get(label, [])[:k]):
                if x["at"] + x["wait_ms"] / 1e3 < lo:
                    break
                mine.append(x)
            longest = max(mine, key=lambda x: x["wait_ms"], default=None)
            cause = "queued-" + (longest["cause"] if longest else "in-short-waits")
        elif took["asleep"] >= span / 2:
            cause = "asleep"
        elif took["run"] >= span / 2:
            cause = "running-silent" if run_silent >= span / 2 else "running"
        else:
            cause = "mixed"
        out.append({"label": label, "from": lo, "ms": round(span * 1e3, 3),
                    "run_ms": round(took["run"] * 1e3, 3),
                    "queued_ms": round(took["queued"] * 1e3, 3),
                    "asleep_ms": round(took["asleep"] * 1e3, 3),
                    "silent_ms": round(silent * 1e3, 3), "cause": cause})
    return out


def boosts_at(path, windows):
    """The boost each window's thread ("tid") had when the window began,
    from the policy's decision trace at `path` (JSON lines with ts ns on
    CLOCK_MONOTONIC, tid, kind, throttled_until): "boosted" (a boost of
    any kind), "throttled" (none, its throttle not yet over), "none"."""
    recs = defaultdict(list)
    for line in open(path):
        try:
            r = json.loads(line)
            recs[int(r["tid"])].append((int(r["ts"]), int(r["kind"]), int(r["throttled_until"])))
        except (ValueError, KeyError, TypeError):
            continue
    for seq in recs.values():
        seq.sort()
    times = {t: [x[0] for x in seq] for t, seq in recs.items()}
    out = []
    for w in windows:
        tid, at = int(w.get("tid", 0)), round(float(w["from"]) * 1e9)
        k = bisect.bisect_right(times.get(tid, []), at) - 1
        if k < 0:
            out.append("none")
            continue
        _, kind, until = recs[tid][k]
        out.append("boosted" if kind != 0 else "throttled" if until > at else "none")
    return out


# A futex system call's entry (syscalls/sys_enter_futex, recorded when
# PVSCHED_TRACE_EXTRA asks for it): who, and on which word.
FUTEX = re.compile(PREFIX + r"sys_futex\(uaddr: (?P<uaddr>[0-9a-fx]+), op: (?P<op>[0-9a-fx]+)")
# FUTEX_CMD_MASK: the op without FUTEX_PRIVATE_FLAG / FUTEX_CLOCK_REALTIME.
FUTEX_WAKE_OPS = {1, 5, 7, 10}  # WAKE, WAKE_OP, UNLOCK_PI, WAKE_BITSET


def sleeps(path, over_us, tids):
    """Every time a thread of `tids` ({tid: label}) blocked (switched out
    not runnable) for over `over_us` until a wake-up: when, how long, the
    futex word it last waited on before blocking (when the trace has
    syscalls/sys_enter_futex) and who woke it (the task current at the
    wake-up: a sibling thread releasing a lock or kicking it, or an
    interrupt taken while that task ran). Oldest first."""
    asleep = {}  # tid -> (since, futex word)
    last_futex = {}  # tid -> futex word of its last wait since it last ran
    out = []
    for line in open(path, errors="replace"):
        f = FUTEX.match(line)
        if f:
            tid = int(f["tid"])
            if tid in tids and (int(f["op"], 16) & 0x7f) not in FUTEX_WAKE_OPS:
                last_futex[tid] = f["uaddr"]
            continue
        m = LINE.match(line)
        if not m:
            continue
        ts, ev = float(m["ts"]), m["ev"]
        if ev == "sched_switch":
            sw = SWITCH.match(m["rest"])
            if sw and int(sw["pp"]) in tids and not sw["ps"].startswith("R"):
                pp = int(sw["pp"])
                asleep[pp] = (ts, last_futex.pop(pp, None))
        elif ev == "sched_wakeup":
            w = WAKEUP.match(m["rest"])
            if not w or int(w["p"]) not in asleep:
                continue
            pid = int(w["p"])
            since, word = asleep.pop(pid)
            if (ts - since) * 1e6 > over_us:
                waker = int(m["tid"])
                out.append({"at": since, "label": tids[pid], "tid": pid,
                            "ms": round((ts - since) * 1e3, 3), "futex": word,
                            "waker": tids.get(waker, m["task"].strip()), "waker_tid": waker})
    return out


def overlapping(items, lo, hi, ms_key):
    """The items (dicts with "at", s, and a length in ms under `ms_key`)
    whose interval overlaps [lo, hi]."""
    return [i for i in items if i["at"] <= hi and i["at"] + i[ms_key] / 1e3 >= lo]


def parse_tids(text):
    """--tids: TID[=LABEL],... -> {tid: label}."""
    out = {}
    for part in filter(None, text.split(",")):
        tid, _, label = part.partition("=")
        out[int(tid)] = label or tid
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--over-us", type=float, default=1000.0)
    ap.add_argument("--tids", type=parse_tids, default=None,
                    help="TID[=LABEL],...: these threads instead of those named 'vcpu N'")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--from", dest="lo", type=float, default=None,
                    help="only waits and gaps that end at or after this trace time, s")
    ap.add_argument("--to", dest="hi", type=float, default=None,
                    help="only waits and gaps that start at or before this trace time, s")
    ap.add_argument("--summary", action="store_true",
                    help="with --json: the count and total of the waits instead of each one")
    ap.add_argument("--windows", default=None,
                    help="a JSON file of samples [{label, from, to}]: where each one's thread was")
    ap.add_argument("--decisions", default=None,
                    help="with --windows: the policy's decision trace (JSON lines)")
    ap.add_argument("--sleeps", action="store_true",
                    help="instead: every block of the --tids threads over --over-us, the futex "
                    "word it waited on and who woke it, then counts by (thread, waker, word)")
    a = ap.parse_args()
    inferred = {}
    if a.sleeps:
        if a.tids is None:
            ap.error("--sleeps needs --tids")
        got = sleeps(a.trace, a.over_us, a.tids)
        by, longest = Counter(), defaultdict(float)
        for s in got:
            key = (s["label"], s["waker"], s["futex"])
            by[key] += 1
            longest[key] = max(longest[key], s["ms"])
        if a.json:
            print(json.dumps({"over_us": a.over_us, "sleeps": got,
                              "by": [{"thread": t, "waker": w, "futex": f, "count": n,
                                      "longest_ms": longest[(t, w, f)]}
                                     for (t, w, f), n in by.most_common()]}))
            return
        for s in got:
            print(f"{s['at']:.6f} {s['label']}/{s['tid']} blocked {s['ms']:.2f} ms on futex "
                  f"{s['futex']}, woken by {s['waker']}/{s['waker_tid']}")
        print(f"{len(got)} block(s) over {a.over_us:.0f} µs, by (thread, waker, futex word):")
        for (t, w, f), n in by.most_common():
            print(f"  {t} woken by {w} on {f}: {n}, longest {longest[(t, w, f)]:.2f} ms")
        return
    if a.windows:
        windows = json.load(open(a.windows))
        got = explain_windows(a.trace, windows, a.over_us, inferred)
        doc = {"windows": got, "causes": dict(Counter(w["cause"] for w in got)),
               "idle_switch_ins": inferred.get("idle_switch_ins", 0)}
        if a.decisions:
            states = boosts_at(a.decisions, windows)
            for w, st in zip(got, states):
                w["boost"] = st
            doc["boost"] = dict(Counter(states))
            doc["cause_boost"] = dict(Counter(f"{w['cause']}/{w['boost']}" for w in got))
        if a.json:
            print(json.dumps(doc))
            return
        for w in got:
            print(f"{w['from']:.6f} {w['label']} sample {w['ms']:.2f} ms: ran {w['run_ms']:.2f}, "
                  f"queued {w['queued_ms']:.2f}, asleep {w['asleep_ms']:.2f}, longest silence of "
                  f"its CPU {w['silent_ms']:.2f} ms; cause {w['cause']}")
        print(f"{len(got)} sample(s):", ", ".join(f"{c} {n}" for c, n in
                                                 Counter(w["cause"] for w in got).most_common()))
        if inferred:
            print(idle_note(inferred))
        return
    waits, gaps = analyze(a.trace, a.over_us, a.tids, inferred)
    if a.lo is not None or a.hi is not None:
        lo = float("-inf") if a.lo is None else a.lo
        hi = float("inf") if a.hi is None else a.hi
        waits = overlapping(waits, lo, hi, "wait_ms")
        gaps = [(t, ms) for t, ms in gaps if t <= hi and t + ms / 1e3 >= lo]
    if a.json:
        doc = {"over_us": a.over_us, "waits": waits,
               "causes": dict(Counter(w["cause"] for w in waits)),
               "ran": ran_summary(waits),
               "host_gaps": [{"at": t, "ms": ms} for t, ms in gaps],
               "idle_switch_ins": inferred.get("idle_switch_ins", 0)}
        if a.summary:
            del doc["waits"]
            doc["n"] = len(waits)
            doc["wait_ms"] = round(sum(w["wait_ms"] for w in waits), 3)
        print(json.dumps(doc))
        return
    what = "vCPU" if a.tids is None else "thread"
    print(f"{len(waits)} {what} wait(s) over {a.over_us:.0f} µs")
    for w in waits:
        who = ", ".join(f"{r['comm']}/{r['pid']} prio {r['prio']} {r['ms']:.2f} ms" for r in w["ran"])
        ipi = ("no reschedule IPI" if w["resched_ipi_ms"] is None
               else f"reschedule IPI taken at +{w['resched_ipi_ms']:.2f} ms")
        where = (f"{w['queued_ms']:.2f} ms of it queued on CPU {w['queued_cpu']}, "
                 if w["queued_cpu"] != w["cpu"] else "")
        print(f"{w['at']:.6f} {w['thread']}/{w['tid']} {w['why']} at prio {w['prio']}, waited "
              f"{w['wait_ms']:.2f} ms, {where}switched in on CPU {w['cpu']}; meanwhile there: "
              f"{who or 'nothing traced'}; {w['events']} events on CPU {w['queued_cpu']} in the "
              f"wait, "
              f"longest silence {w['silent_ms']:.2f} ms, {ipi}; cause {w['cause']}")
    print(f"what ran where they waited, summed over {len(waits)} wait(s) "
          f"({sum(w['wait_ms'] for w in waits):.1f} ms):")
    for r in ran_summary(waits)[:12]:
        print(f"  {r['comm']} prio {r['prio']}: {r['ms']:.1f} ms in {r['waits']} wait(s)")
    print(f"{len(gaps)} interval(s) over {a.over_us:.0f} µs with no event on any CPU"
          + "".join(f"\n{t:.6f} all CPUs silent {ms:.2f} ms" for t, ms in gaps))
    if inferred:
        print(idle_note(inferred))


def ran_summary(waits):
    """Per kind of thread (comm with its digits replaced by '#', priority):
    how long it ran where the waits waited, summed, and in how many waits,
    longest first."""
    ms, n = Counter(), Counter()
    for w in waits:
        mine = Counter()
        for r in w["ran"]:
            mine[(re.sub(r"[0-9]+", "#", r["comm"]), r["prio"])] += r["ms"]
        ms.update(mine)
        n.update(mine.keys())
    return [{"comm": c, "prio": p, "ms": round(v, 3), "waits": n[(c, p)]}
            for (c, p), v in ms.most_common()]


def idle_note(inferred):
    n = inferred.get("idle_switch_ins", 0)
    return (f"{n} switch(es) out of an idle task the trace lacked, put back from the "
            f"threads' own records")
