#!/usr/bin/env python3
"""Rebuilds an S6 JSON result from the log of a `bench/s6.py` run that
ended before it wrote its JSON (runs since 49a8d1b write it after every
round; this is for the log of one that did not).

    python3 bench/s6_fromlog.py RUN.log OUT.json [--command "bench/s6.py ..."]

One row per "s6: NxV-VARIANT-rN WORKLOAD: ..." line (the figures the log
prints: throughput, VM CPU, per CPU-second, hogs, pvschedd's policy
counters, the guests' IPIs, the host probe's p99 and max; a "NO RESULT"
line is a failed run of its variant, as in the JSON). Only the
repetitions in which every variant has a row for every workload are kept;
the JSON's "note" says which and how many rows were left out. The
summary is bench/s6.py's own, so bench/tables.py prints it as any
other result.
"""
import argparse
import ast
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import s6  # noqa: E402

ROW = re.compile(r"s6: (\d+x\d+)-(\S+)-r(\d+) (\w+): throughput ([0-9.]+), VM CPU ([0-9.]+)s "
                 r"(\{[^}]*\}), per CPU-s ([0-9.]+), hogs (\w+)(.*)$")
FAILED = re.compile(r"s6: (\d+x\d+)-(\S+)-r(\d+) (\w+): NO RESULT: (.*)$")
HEAD = re.compile(r"s6: guest kernel (\S+); workloads (\S+); variants (\S+); (\d+) reps of "
                  r"(\d+) s; hogs (\d+); -cpu (\S+); load average ([0-9.]+)")


def row(line):
    """The row of one log line, or None if it is not a run's line."""
    m = ROW.match(line)
    if not m:
        e = FAILED.match(line)
        if not e:
            return None
        topo, variant, rep, w, why = e.groups()
        r = s6.no_progress_row(w, variant, f"{topo}-{variant}-r{rep}", why)
        r.update(topology=topo, rep=int(rep))
        return r
    topo, variant, rep, w, tp, cpu, split, pcs, hogs, rest = m.groups()
    r = {"topology": topo, "variant": variant, "rep": int(rep), "workload": w,
         "tag": f"{topo}-{variant}-r{rep}", "throughput": float(tp), "vm_cpu_s": float(cpu),
         "per_cpu_s": float(pcs), "hog_ops": None if hogs == "None" else int(hogs),
         "threads_cpu_s": ast.literal_eval(split), "vms": []}
    for key, field in (("policy", "policy"), ("guest IPIs", "guest_ipis")):
        m = re.search(key + r" (\{[^}]*\})", rest)
        if m:
            r[field] = ast.literal_eval(m.group(1))
    hp = re.search(r"host probe p99/max (\w+)/(\w+) us", rest)
    r["probe_p99_us"] = int(hp.group(1)) if hp and hp.group(1) != "None" else None
    r["probe_max_us"] = int(hp.group(2)) if hp and hp.group(2) != "None" else None
    return r


def rebuild(lines, command):
    head = next((HEAD.match(x) for x in lines if HEAD.match(x)), None)
    if head is None:
        raise SystemExit("no 's6: guest kernel ...' line: not the log of a bench/s6.py run")
    release, workloads, variants, reps, dur, hogs, cpu, la = head.groups()
    variants = variants.split(",")
    rows = [r for r in (row(x) for x in lines) if r is not None]
    nw = len(workloads.split(","))
    done = sorted(k for k in {r["rep"] for r in rows}
                  if all(sum(r["rep"] == k and r["variant"] == v for r in rows) == nw
                         for v in variants))
    kept = [r for r in rows if r["rep"] in done]
    return {"scenario": "s6", "reps": len(done), "duration_s": int(dur), "hogs": int(hogs),
            "cpu": cpu,
            "machine": {"guest_kernel": release, "loadavg_start": float(la)},
            "command": command,
            "note": (f"rebuilt from the run's log by bench/s6_fromlog.py: repetitions {done} of "
                     f"{reps} complete, {len(rows) - len(kept)} rows of the others left out"),
            "summary": s6.summarize(kept, variants), "runs": kept}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--command", default=None, help="the run's command line, for the JSON")
    args = ap.parse_args()
    lines = [x.strip() for x in args.log.read_text().splitlines()]
    doc = rebuild(lines, args.command or f"(from {args.log})")
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(doc["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
