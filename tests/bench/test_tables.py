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
