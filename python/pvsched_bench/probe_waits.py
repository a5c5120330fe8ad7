"""What the host probe's slow wake-ups waited behind, vanilla against
pvsched: runs S6 one repetition at a time under bench/trace-run.sh (the
variants alternate, their order swapped every repetition), and for each run
gives the probe's figures (S6's row: p99, max) and stall-trace's summary of
the probe thread's waits over --over-us inside the workload's window: how
many, their total, and the time each kind of thread ran where they waited
(comm with digits as '#', priority when it was switched in). Root, KVM not
needed (QEMU TCG); each run's trace is kept in --keep DIR if given, else
deleted (about 70 MB each).

    python3 -m pvsched_bench probe-waits --reps 3 --json OUT.json [--over-us 1000] \\
        [--keep DIR] -- --kernel 7.3-cloud --topology 2x2 --duration 20 --workloads tlb ...

    python3 -m pvsched_bench probe-waits --resum OUT.json

--resum recomputes the per-variant sums ("variants") of an earlier OUT.json
from its runs, in place (after a change to what is summed).

The arguments after `--` go to `python3 -m pvsched_bench s6` as they are,
with `--variants V --reps 1 --host-probe --json -` added; give exactly one
workload and one topology. OUT.json: {"command", "over_us", "runs": [{"variant", "rep",
"loadavg_start", "host_probe", "phase_changes", "throughput", "waits": {"n",
"wait_ms", "ran", "causes", "host_gaps"}}], "variants": {V: {"runs",
"probe_p99_us": [...], "waits_n", "wait_ms", "behind_ms", "ran"}}}: the
per-variant entries sum the runs' waits and "ran"; "behind_ms" sums "ran"
by kind: vcpu_* (QEMU's vCPU threads) or host_* (any other), each _rt,
_nice19 (a vCPU outside its phase) or _fair (another fair priority).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

from .ftrace import LINE
from .phase_trace import MARK
from .stall_trace import WAKEUP

REPO = Path(__file__).resolve().parents[2]


class ProbeWaitsError(Exception):
    """A run or its trace gave no figures: the message says which and why."""


def window_and_probe(trace):
    """(start, end, tid) of the one workload run in `trace`: its marks'
    times and the cyclictest thread woken most often (the measuring
    thread; its main thread sleeps)."""
    marks, wakes = {}, Counter()
    with open(trace, errors="replace") as f:
        for line in f:
            m = MARK.match(line)
            if m:
                marks.setdefault(m["what"], float(m["ts"]))
                continue
            m = LINE.match(line)
            w = m and m["ev"] == "sched_wakeup" and WAKEUP.match(m["rest"])
            if w and w["c"] == "cyclictest":
                wakes[int(w["p"])] += 1
    if "start" not in marks or "end" not in marks:
        raise ProbeWaitsError(f"{trace}: no 's6 start'/'s6 end' marks (did the run fail?)")
    if not wakes:
        raise ProbeWaitsError(f"{trace}: no wake-up of the probe (cyclictest) in the trace")
    return marks["start"], marks["end"], wakes.most_common(1)[0][0]


def run_one(args, variant, rep, tmp):
    base = Path(tmp) / f"{variant}-r{rep}"
    cmd = [str(REPO / "bench" / "trace-run.sh"), str(base), "--", sys.executable, "-B", "-m",
           "pvsched_bench", "s6", *args.s6, "--variants", variant, "--reps", "1",
           "--host-probe", "--json", "-"]
    # One 2x2 run of 20 s writes about 70 MB of text: 32 MiB per CPU
    # (trace-run.sh's default) would lose events.
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    env.setdefault("PVSCHED_TRACE_BUFFER_KB", "196608")
    print(f"probe-waits: {variant} r{rep}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise ProbeWaitsError(f"{variant} r{rep}: trace-run.sh exited {p.returncode}")
    if "overrun: 0" not in p.stdout or re.search(r"overrun: [1-9]", p.stdout):
        raise ProbeWaitsError(f"{variant} r{rep}: the trace lost events ({p.stdout.strip()}); "
                              "raise PVSCHED_TRACE_BUFFER_KB")
    rows = json.loads(Path(f"{base}.json").read_text())["rows"]
    if len(rows) != 1 or rows[0].get("error"):
        raise ProbeWaitsError(f"{variant} r{rep}: want one row without error, got {rows}")
    row = rows[0]
    lo, hi, tid = window_and_probe(f"{base}.trace")
    st = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace",
                         f"{base}.trace", "--tids", f"{tid}=probe", "--over-us",
                         str(args.over_us), "--from", str(lo), "--to", str(hi), "--json",
                         "--summary"], env=env, stdout=subprocess.PIPE, text=True, check=True)
    waits = json.loads(st.stdout)
    if args.keep:
        for ext in (".json", ".trace"):
            shutil.move(f"{base}{ext}", Path(args.keep) / f"{base.name}{ext}")
    return {"variant": variant, "rep": rep, "loadavg_start": row.get("loadavg_start"),
            "host_probe": row["host_probe"],
            "phase_changes": (row.get("policy") or {}).get("phase_changes"),
            "throughput": row["throughput"], "unit": row["unit"],
            "waits": {k: waits[k] for k in ("n", "wait_ms", "ran", "causes")}
            | {"host_gaps": len(waits["host_gaps"])}}


def kind(comm, prio):
    """A thread the probe waited behind, by what it was: one of QEMU's vCPU
    threads ("CPU #/TCG", "CPU #/KVM") or another (a host thread: the hogs,
    QEMU's own other threads, pvsched), and its priority when it was
    switched in: RT (below 100), nice 19 (139: a vCPU outside its phase)
    or another fair one."""
    who = "vcpu" if comm.startswith("CPU #/") else "host"
    prio_kind = "rt" if prio < 100 else "nice19" if prio == 139 else "fair"
    return f"{who}_{prio_kind}"


KINDS = [f"{w}_{p}" for w in ("vcpu", "host") for p in ("rt", "nice19", "fair")]


def per_variant(runs):
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        ms, n, by = defaultdict(float), Counter(), dict.fromkeys(KINDS, 0.0)
        for r in mine:
            for k in r["waits"]["ran"]:
                ms[(k["comm"], k["prio"])] += k["ms"]
                n[(k["comm"], k["prio"])] += k["waits"]
                by[kind(k["comm"], k["prio"])] += k["ms"]
        out[variant] = {"runs": len(mine),
                    "probe_p99_us": [r["host_probe"]["p99_us"] for r in mine],
                    "waits_n": sum(r["waits"]["n"] for r in mine),
                    "wait_ms": round(sum(r["waits"]["wait_ms"] for r in mine), 3),
                    "behind_ms": {k: round(v, 1) for k, v in by.items()},
                    "ran": [{"comm": c, "prio": p, "ms": round(t, 3), "waits": n[(c, p)]}
                            for (c, p), t in sorted(ms.items(), key=lambda x: -x[1])]}
    return out


def main():
    argv = sys.argv[1:]
    s6 = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="where the result goes")
    ap.add_argument("--resum", default=None, help="recompute this output's per-variant sums")
    ap.add_argument("--over-us", type=float, default=1000.0)
    ap.add_argument("--keep", default=None, help="keep each run's trace and S6 JSON here")
    ap.add_argument("--variants", default="vanilla,pvsched")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.s6 = s6
    if args.resum:
        doc = json.loads(Path(args.resum).read_text())
        doc["variants"] = per_variant(doc["runs"])
        Path(args.resum).write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    if not args.json:
        ap.error("--json OUT.json is needed (or --resum)")
    if any(a in s6 for a in ("--variants", "--reps", "--json", "--host-probe")):
        ap.error("give --variants and --reps to probe-waits, not after --")
    if os.geteuid() != 0:
        ap.error("needs root (tracefs, the hogs, the policy)")
    variants = args.variants.split(",")
    runs = []
    with tempfile.TemporaryDirectory(prefix="probe-waits-") as tmp:
        for rep in range(args.reps):
            order = variants if rep % 2 == 0 else variants[::-1]
            for v in order:
                try:
                    runs.append(run_one(args, v, rep, tmp))
                except (ProbeWaitsError, subprocess.CalledProcessError, OSError, ValueError) as e:
                    print(f"probe-waits: {e}", file=sys.stderr)
                    return 1
    doc = {"command": "python3 -m pvsched_bench probe-waits " + " ".join(sys.argv[1:]),
           "over_us": args.over_us, "runs": runs, "variants": per_variant(runs)}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    for v, s in doc["variants"].items():
        top = ", ".join(f"{k['comm']} prio {k['prio']} {k['ms']:.0f} ms" for k in s["ran"][:4])
        print(f"{v}: probe p99 {s['probe_p99_us']} us; {s['waits_n']} waits over "
              f"{args.over_us:.0f} us, {s['wait_ms']:.0f} ms; behind {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
