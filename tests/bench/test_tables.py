"""bench/tables.py: a result with the VMM's CPU time gets the CPU columns
(VMM and hogs' CPU-seconds, events per VMM CPU-second); an older result
without it keeps the table it always had."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def table(tmp_path, with_cpu):
    v = {"workload": "ipi", "p50_us": 50.0, "p99_us": 200.0, "max_us": 9000.0,
         "samples": 1000, "hog_iterations_per_s": 5.0e5}
    if with_cpu:
        v.update(vm_cpu_s=13.81, hog_cpu_s=6.06, events_per_vm_cpu_s=28611.0)
    d = {"scenario": "s2", "command": "pvsched-bench s2", "machine": {"cpus": 2},
         "vanilla": v, "pvsched": v}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(d))
    return subprocess.run([sys.executable, str(REPO / "bench" / "tables.py"), str(p)],
                          capture_output=True, text=True, check=True).stdout


def test_cpu_columns_only_with_cpu_time(tmp_path):
    out = table(tmp_path, True)
    assert "| VMM CPU-s | hogs' CPU-s | events per VMM CPU-s |" in out, out
    assert "| 13.81 | 6.06 | 28611 |" in out, out
    out = table(tmp_path, False)
    assert "VMM CPU-s" not in out and "| hog it/s |" in out, out


def test_sign_flip_p_is_exact():
    """The paired test of S6's tables: all n ratios on one side of 1 is the
    most extreme of the 2^n sign flips (and its mirror), so p = 2 / 2^n;
    ratios either side of 1 that cancel are as likely as any."""
    sys.path.insert(0, str(REPO / "bench"))
    import tables

    assert tables.sign_flip_p([0.1] * 5) == 2 / 32
    assert tables.sign_flip_p([0.1, 0.1, 0.1]) == 0.25
    assert tables.sign_flip_p([0.1, -0.1]) == 1.0
    assert tables.sign_flip_p([]) is None


def test_s6_table_p_pairs_each_repetition_with_its_vanilla(tmp_path):
    """S6's p column pairs each repetition with the vanilla run of the
    same repetition: 5 repetitions each 10 % below their own vanilla give
    the smallest p 5 can (0.06), though the vanillas spread twice as
    wide."""
    runs = []
    for rep, base in enumerate([80.0, 120.0, 100.0, 90.0, 110.0]):
        runs.append({"topology": "2x2", "workload": "cpu", "variant": "vanilla", "rep": rep,
                     "per_cpu_s": base})
        runs.append({"topology": "2x2", "workload": "cpu", "variant": "pvsched", "rep": rep,
                     "per_cpu_s": base * 0.9})
    s = {"median": 1.0, "min": 1.0, "max": 1.0}
    cell = {"vm_cpu_s": s, "paired_ratio": {}}
    d = {"scenario": "s6", "command": "bench/s6.py", "machine": {"cpus": 2}, "reps": 5,
         "duration_s": 10, "hogs": 2, "runs": runs,
         "summary": {"2x2/cpu": {"vanilla": dict(cell), "pvsched": dict(cell)}}}
    p = tmp_path / "s6.json"
    p.write_text(json.dumps(d))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "tables.py"), str(p)],
                         capture_output=True, text=True, check=True).stdout
    assert "p per CPU-s |" in out, out
    line = next(x for x in out.splitlines() if x.startswith("| 2x2/cpu | pvsched |"))
    assert line.endswith(" 0.06 |"), line


def test_s6_variant_without_a_result_is_not_a_ratio_of_one(tmp_path):
    """A variant none of whose runs gave a figure (its guests hung) reads
    "no result", not the vanilla's 1."""
    s = {"median": None, "min": None, "max": None}
    d = {"scenario": "s6", "command": "bench/s6.py", "machine": {"cpus": 2}, "reps": 1,
         "duration_s": 10, "hogs": 2, "runs": [],
         "summary": {"2x2/cpu": {"vanilla": {"vm_cpu_s": s, "paired_ratio": {}},
                                 "fifo1": {"vm_cpu_s": s, "paired_ratio": {}}}}}
    p = tmp_path / "s6.json"
    p.write_text(json.dumps(d))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "tables.py"), str(p)],
                         capture_output=True, text=True, check=True).stdout
    van = next(x for x in out.splitlines() if x.startswith("| 2x2/cpu | vanilla |"))
    fifo = next(x for x in out.splitlines() if x.startswith("| 2x2/cpu | fifo1 |"))
    assert van.startswith("| 2x2/cpu | vanilla | 1 | 1 |"), van
    assert fifo.startswith("| 2x2/cpu | fifo1 | no result | no result |"), fifo
