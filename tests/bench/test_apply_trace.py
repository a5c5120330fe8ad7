"""pvsched_bench apply-trace on a synthetic trace: one decision is followed
through the irq_work, the applier's wake-up and switch-in and its
sched_setattr; a record never applied is not counted."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Decision at 100.000000 s (mono) for tid 0x1f4 = 500.
TRACE = """\
# tracer: nop
          vcpu 0-500     [000] d.h1. 100.000010: irq_work_entry: vector=246
          vcpu 0-500     [000] d.h2. 100.000012: sched_waking: comm=pvsched-apply pid=42 prio=1 target_cpu=001
  bench-hog busy -21     [001] d..2. 100.000020: sched_switch: prev_comm=bench-hog busy  prev_pid=21 prev_prio=120 prev_state=R ==> next_comm=pvsched-apply next_pid=42 next_prio=1
   pvsched-apply-42      [001] ..... 100.000030: sys_sched_setattr(pid: 0x1f4, uattr: 0x7f0000000000, flags: 0)
   pvsched-apply-42      [001] ..... 100.000033: sys_sched_setattr -> 0x0
"""


def test_steps_of_one_decision(tmp_path):
    t = tmp_path / "t.trace"
    t.write_text(TRACE)
    d = tmp_path / "d.jsonl"
    d.write_text(json.dumps({"ts": 100_000_000_000, "tid": 500}) + "\n"
                 + json.dumps({"ts": 100_000_050_000, "tid": 501}) + "\n")
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "apply-trace", str(t), str(d), "--json"],
                         capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    assert (r["records"], r["applied"], r["applier_tid"]) == (2, 1, 42), r
    us = {k: v["p50"] for k, v in r["us_after_decision"].items() if v}
    assert us == {"irq_work": 10.0, "waking": 12.0, "on_cpu": 20.0, "setattr": 30.0, "applied": 33.0}, us
    assert r["woken_on_the_irq_work_cpu"] == 0, r
