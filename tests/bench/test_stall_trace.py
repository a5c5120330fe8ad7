"""bench/stall_trace.py on a synthetic trace: the wait of a boosted vCPU
thread woken onto a CPU busy with a hog is named, with what ran there and
when that CPU took the reschedule IPI; a short wait is not listed."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TRACE = """\
# tracer: nop
  pvsched-inject-17   [000] d..3. 100.000000: sched_wakeup: comm=vcpu 0 pid=11 prio=98 target_cpu=001
  pvsched-inject-17   [000] d..3. 100.000010: sched_wakeup: comm=vcpu 1 pid=12 prio=98 target_cpu=000
  pvsched-inject-17   [000] d..2. 100.000020: sched_switch: prev_comm=pvsched-inject prev_pid=17 prev_prio=120 prev_state=R ==> next_comm=vcpu 1 next_pid=12 next_prio=98
  bench-hog busy -21  [001] d.h1. 100.003000: reschedule_entry: vector=253
  bench-hog busy -21  [001] d..2. 100.003010: sched_switch: prev_comm=bench-hog busy  prev_pid=21 prev_prio=120 prev_state=R ==> next_comm=vcpu 0 next_pid=11 next_prio=98
"""


def test_a_late_reschedule_ipi_is_named(tmp_path):
    t = tmp_path / "t.trace"
    t.write_text(TRACE)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "stall_trace.py"), str(t)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "1 vCPU wait(s) over 1000 µs", out
    assert "vcpu 0/11 woken at prio 98, waited 3.01 ms, switched in on CPU 1" in lines[1], out
    assert "bench-hog busy /21 prio 120" in lines[1], out
    assert "reschedule IPI taken at +3.00 ms" in lines[1], out


def test_trace_run_records_a_command(tmp_path, need_real):
    """bench/trace-run.sh on a real tracefs: the command's output and the
    scheduler's events are captured, nothing is lost, and its tracefs
    instance is gone afterwards."""
    import os
    if os.geteuid() != 0:
        need_real("root", "tracefs instances need root")
    out = tmp_path / "t"
    r = subprocess.run([str(REPO / "bench" / "trace-run.sh"), str(out), "--",
                        "sh", "-c", "sleep 0.05; echo '{\"ok\": 1}'"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "t.json").read_text().strip() == '{"ok": 1}'
    trace = (tmp_path / "t.trace").read_text(errors="replace")
    assert "sched_switch:" in trace and "sched_wakeup:" in trace
    assert all(line.endswith(" 0") for line in r.stdout.splitlines() if "overrun" in line), r.stdout
    left = [d for d in os.listdir("/sys/kernel/tracing/instances") if d.startswith("pvsched-stalls-")]
    assert left == [], left
