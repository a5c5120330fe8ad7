#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from `pvsched-bench` and
`bench/s6.py` JSON results.

    python3 bench/tables.py docs/bench/s1.json docs/bench/s2.json ...

Prints, per file: the command and machine line, the latency table (median
over repetitions with min-max), the ratios, and every target with its value
and verdict. Nothing is measured here: every figure is the JSON's, but for
S6's p, which is computed from the runs the JSON holds.
"""
import json
import math
import sys


def fmt(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def cell(v, key):
    sp = v.get("spread", {}).get(key)
    if sp and sp.get("min") is not None:
        return f"{fmt(v[key])} ({fmt(sp['min'])}–{fmt(sp['max'])})"
    return fmt(v.get(key))


def latency_table(d, variants):
    # Results recorded since the bench measures CPU time also say what each
    # variant cost the host: the VMM's and the hogs' CPU-seconds and the
    # workload's events per VMM CPU-second.
    cpu = any(isinstance(d.get(n), dict) and d[n].get("vm_cpu_s") is not None for n in variants)
    head = "| variant | workload | p50 µs | p99 µs | max µs | samples | hog it/s |"
    rule = "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
    if cpu:
        head += " VMM CPU-s | hogs' CPU-s | events per VMM CPU-s |"
        rule += " ---: | ---: | ---: |"
    rows = [head, rule]
    for name in variants:
        v = d.get(name)
        if not isinstance(v, dict) or "p99_us" not in v:
            continue
        hog = v.get("hog_iterations_per_s")
        row = (f"| {name} | {v.get('workload', '')} | {cell(v, 'p50_us')} | {cell(v, 'p99_us')} | "
               f"{cell(v, 'max_us')} | {v.get('samples', '-')} | {fmt(hog, 0) if hog else '-'} |")
        if cpu:
            per = v.get("events_per_vm_cpu_s")
            row += (f" {fmt(v.get('vm_cpu_s'), 2)} | {fmt(v.get('hog_cpu_s'), 2)} | "
                    f"{fmt(per, 0) if per else '-'} |")
        rows.append(row)
    return "\n".join(rows)


def policy_line(d, variants):
    out = []
    for name in variants:
        v = d.get(name)
        if not isinstance(v, dict):
            continue
        runs = [r.get("policy") for r in v.get("runs", []) if isinstance(r.get("policy"), dict)]
        if not runs:
            continue
        dec = [r.get("decisions") for r in runs]
        thr = [r.get("throttles") for r in runs]
        boo = [r.get("boosts") for r in runs]
        out.append(f"- `{name}`: decisions per run {dec}, boosts {boo}, throttles {thr}")
    return "\n".join(out)


def targets(d):
    rows = ["| target | goal | value | limit | met |", "| --- | --- | ---: | ---: | --- |"]
    ts = d.get("targets", [])
    if isinstance(ts, dict):
        # S4 and S6 key their targets by name; the goal says the limit.
        ts = [{"name": k, "goal": t.get("target", ""), "value": t.get("value"), "limit": "",
               "met": t.get("met")} for k, t in ts.items()]
    for t in ts:
        rows.append(f"| `{t['name']}` | {t['goal']} | {fmt(t['value'], 3)} | {t['limit']} | "
                    f"{'**met**' if t['met'] else '**not met**'} |")
    return "\n".join(rows)


def sign_flip_p(logs):
    """Two-sided p of a paired comparison: the share of the 2^n ways of
    flipping the signs of the per-repetition log ratios whose sum is at
    least as far from 0 as the one measured (exact, no distribution
    assumed). With n repetitions it is never below 2 / 2^n (0.25 for 3, 0.06
    for 5); None for no repetitions or more than 16."""
    n = len(logs)
    if n == 0 or n > 16:
        return None
    obs = abs(sum(logs)) - 1e-12
    hits = sum(abs(sum(-x if mask >> i & 1 else x for i, x in enumerate(logs))) >= obs
               for mask in range(1 << n))
    return hits / (1 << n)


def paired_p(d, key, variant, figure="per_cpu_s"):
    """sign_flip_p of `variant` against the vanilla run of the same
    repetition, for S6 cell `key` ("TOPOLOGY/WORKLOAD")."""
    topo, w = key.split("/", 1)
    by = {}
    for r in d.get("runs", []):
        if r.get("topology") == topo and r.get("workload") == w and r.get(figure):
            by.setdefault(r["variant"], {})[r["rep"]] = r[figure]
    van, mine = by.get("vanilla", {}), by.get(variant, {})
    logs = [math.log(mine[k] / van[k]) for k in mine if k in van and van[k] > 0 and mine[k] > 0]
    return sign_flip_p(logs)


def s6_table(d):
    """S6: per topology and workload, each variant's paired ratios to
    vanilla (median, min-max over reps), the VMs' CPU time and pvschedd's
    boosts and boosted seconds per run."""
    rows = ["| topology / workload | variant | throughput ×vanilla | per CPU-s ×vanilla | "
            "VM CPU s | hogs kept ×vanilla | boosts, boosted s per run |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- |"]

    def pr(s, k, variant):
        x = s.get("paired_ratio", {}).get(k)
        if not x or x["median"] is None:
            # vanilla is the unit; any other variant without a figure had
            # no run that gave one (a guest that hung, say), not a ratio of 1.
            return "1" if variant == "vanilla" else "no result"
        return f"{x['median']:.2f} ({x['min']:.2f}–{x['max']:.2f})"

    probe = any((s.get("probe_p99_us") or {}).get("median") is not None
                for c in d["summary"].values() for s in c.values())
    if probe:
        # --host-probe: an ordinary host thread's wake-up p99 and max, µs.
        rows[0] += " host probe p99 / max µs |"
        rows[1] += " --- |"
    ipis = any((s.get("ipis_per_s") or {}).get("median") is not None
               for c in d["summary"].values() for s in c.values())
    if ipis:
        # The IPIs (rescheduling, function call, TLB) a guest's CPUs
        # received per second of its run, the mean over the VMs: how much
        # the workload signals other vCPUs.
        rows[0] += " guest IPIs per s |"
        rows[1] += " ---: |"
    # How likely a per-CPU-second ratio this far from 1 is by chance, from
    # the repetitions' own spread.
    rows[0] += " p per CPU-s |"
    rows[1] += " ---: |"
    for key, cell_ in d["summary"].items():
        for v, s in cell_.items():
            pol = s.get("policy")
            pol_txt = ", ".join(f"{x['boosts']}/{x['boosted_s']}" for x in pol if x) if pol else "-"
            cpu = s["vm_cpu_s"]
            line = (f"| {key} | {v} | {pr(s, 'throughput', v)} | {pr(s, 'per_cpu_s', v)} | "
                    f"{cpu['median']} ({cpu['min']}–{cpu['max']}) | {pr(s, 'hog_ops', v)} | "
                    f"{pol_txt} |")
            if probe:
                p99, mx = s.get("probe_p99_us") or {}, s.get("probe_max_us") or {}
                line += f" {p99.get('median')} / {mx.get('median')} ({mx.get('max')}) |"
            if ipis:
                ip = s.get("ipis_per_s") or {}
                line += f" {fmt(ip.get('median'), 0)} |"
            p = None if v == "vanilla" else paired_p(d, key, v)
            line += f" {'-' if p is None else f'{p:.2f}'} |"
            rows.append(line)
    return "\n".join(rows)


def main(paths):
    for p in paths:
        d = json.load(open(p))
        m = d.get("machine", {})
        if d.get("scenario") == "s6":
            print(f"### {p}\n")
            print(f"`{d.get('command')}` — {m.get('cpus')} CPUs, host kernel "
                  f"{m.get('host_kernel')}, guest {m.get('guest_kernel')}, {d['reps']} reps of "
                  f"{d['duration_s']} s, {d['hogs']} hogs, 1-min load average at start "
                  f"{m.get('loadavg_start')}\n")
            print(s6_table(d) + "\n")
            continue
        print(f"### {p}\n")
        print(f"`{d.get('command')}` — {m.get('cpus')} CPUs, kernel {m.get('kernel')}, "
              f"1-min load average at start {m.get('loadavg_at_start')}\n")
        variants = [k for k, v in d.items() if isinstance(v, dict) and "p99_us" in v]
        if variants:
            print(latency_table(d, variants) + "\n")
            pl = policy_line(d, variants)
            if pl:
                print(pl + "\n")
        for k in ("ratio_p50", "ratio_p99", "ratio_max", "vanilla_loaded_vs_idle_p99"):
            if k in d:
                print(f"- {k}: {fmt(d[k], 3)}")
        if isinstance(d.get("ratios"), dict):
            for k, v in d["ratios"].items():
                print(f"- ratios.{k}: {v}")
        print()
        print(targets(d) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
