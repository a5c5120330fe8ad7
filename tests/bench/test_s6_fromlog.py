"""bench/s6_fromlog.py: an S6 run's log lines become the rows its JSON
would have held (a failed run a row with its error), and a repetition
some variant did not finish is left out."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOG = """\
s6: guest kernel 7.3.4+deb13-cloud-amd64; workloads cpu; variants vanilla,pvsched; 3 reps of 10 s; hogs 2; -cpu max; load average 0.83
s6: autogroup off
s6: 2x2-vanilla-r0 cpu: throughput 300.0, VM CPU 15.0s {'vcpus': 14.8, 'main': 0.2, 'other': 0.0}, per CPU-s 20.0, hogs 10000, guest IPIs {'res': 1, 'cal': 2, 'tlb': 3}, beside {'devices': 0.4}, host probe p99/max 1500/9000 us
s6: 2x2-pvsched-r0 cpu: throughput 330.0, VM CPU 15.0s {'vcpus': 14.8, 'main': 0.2, 'other': 0.0}, per CPU-s 22.0, hogs 9000, policy {'boosts': 4, 'throttles': 0, 'boosted_s': 0.01, 'phase_changes': 0}, beside {'devices': 0.4, 'pvschedd': 0.1}, host probe p99/max None/950000 us
s6: 2x2-vanilla-r1 cpu: throughput 300.0, VM CPU 15.0s {'vcpus': 14.8, 'main': 0.2, 'other': 0.0}, per CPU-s 20.0, hogs 10000, beside {'devices': 0.4}
s6: 2x2-pvsched-r1 cpu: NO RESULT: s6-2x2-pvsched-r1-vm0: no '@@ bench-wait' within 130s
s6: 2x2-vanilla-r2 cpu: throughput 310.0, VM CPU 15.0s {'vcpus': 14.8, 'main': 0.2, 'other': 0.0}, per CPU-s 20.7, hogs 10000, beside {'devices': 0.4}
s6: FAIL: the boot ended
"""


def test_rows_from_the_log(tmp_path):
    log, out = tmp_path / "run.log", tmp_path / "run.json"
    log.write_text(LOG)
    subprocess.run([sys.executable, str(REPO / "bench" / "s6_fromlog.py"), str(log), str(out),
                    "--command", "bench/s6.py --reps 3"], check=True, capture_output=True)
    doc = json.loads(out.read_text())
    assert doc["reps"] == 2 and doc["command"] == "bench/s6.py --reps 3"
    assert "repetitions [0, 1] of 3 complete, 1 rows" in doc["note"], doc["note"]
    runs = {(r["variant"], r["rep"]): r for r in doc["runs"]}
    assert set(runs) == {("vanilla", 0), ("pvsched", 0), ("vanilla", 1), ("pvsched", 1)}
    pv = runs[("pvsched", 0)]
    assert (pv["throughput"], pv["per_cpu_s"], pv["hog_ops"]) == (330.0, 22.0, 9000)
    assert pv["policy"]["boosts"] == 4
    assert (pv["probe_p99_us"], pv["probe_max_us"]) == (None, 950000)
    assert runs[("vanilla", 0)]["guest_ipis"] == {"res": 1, "cal": 2, "tlb": 3}
    assert runs[("pvsched", 1)]["error"].startswith("s6-2x2-pvsched-r1-vm0: no '@@ bench-wait'")
    assert doc["summary"]["2x2/cpu"]["pvsched"]["paired_ratio"]["per_cpu_s"]["median"] == 1.1
