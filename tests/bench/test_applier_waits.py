"""bench/trace-run.sh --applier and pvsched_bench applier-waits: on a synthetic
trace the applier's runs, a wait for a CPU and a lock wait are measured; on
a real tracefs only the thread named pvsched-apply is recorded and a lock
it waited 30 ms for is found."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TRACE = """\
# tracer: nop
  hog-21              [001] d..2. 50.000000: sched_switch: prev_comm=hog prev_pid=21 prev_prio=120 prev_state=R ==> next_comm=pvsched-apply next_pid=7 next_prio=0
  pvsched-apply-7     [001] ..... 50.000010: sys_enter: NR 202 (55d0c0, 86, 0, 0, 0, 0)
  pvsched-apply-7     [001] d..2. 50.000012: sched_switch: prev_comm=pvsched-apply prev_pid=7 prev_prio=0 prev_state=S ==> next_comm=hog next_pid=21 next_prio=120
  hog-21              [001] d..2. 50.004012: sched_switch: prev_comm=hog prev_pid=21 prev_prio=120 prev_state=R ==> next_comm=pvsched-apply next_pid=7 next_prio=0
  pvsched-apply-7     [001] ..... 50.004020: sys_exit: NR 202 = 0
  pvsched-apply-7     [001] d..2. 50.004030: sched_switch: prev_comm=pvsched-apply prev_pid=7 prev_prio=0 prev_state=R+ ==> next_comm=migration/1 next_pid=19 next_prio=0
  migration/1-19      [001] d..2. 50.004530: sched_switch: prev_comm=migration/1 prev_pid=19 prev_prio=0 prev_state=S ==> next_comm=pvsched-apply next_pid=7 next_prio=0
  pvsched-apply-7     [001] d..2. 50.004540: sched_switch: prev_comm=pvsched-apply prev_pid=7 prev_prio=0 prev_state=S ==> next_comm=hog next_pid=21 next_prio=120
"""


def waits(path):
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "applier-waits", str(path), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_runs_cpu_waits_and_lock_waits(tmp_path):
    t = tmp_path / "a.trace"
    t.write_text(TRACE)
    r = waits(t)
    assert r["applier_tids"] == [7], r
    # 12 µs, then 18 µs, then 10 µs on the CPU.
    assert r["runs_us"]["n"] == 3 and r["runs_us"]["max"] == 18.0, r
    # Preempted (state R+) for 500 µs.
    assert r["preempted_wait_us"]["n"] == 1 and r["preempted_wait_us"]["max"] == 500.0, r
    # op 0x86 = FUTEX_LOCK_PI | FUTEX_PRIVATE_FLAG, 4.01 ms.
    assert r["futex_by_op_us"] == {"LOCK_PI": {"n": 1, "p50": 4010.0, "p90": 4010.0,
                                               "p99": 4010.0, "max": 4010.0, "sum": 4010.0}}, r
    assert (r["lock_waits_over_1ms"], r["lock_waits_over_2ms"]) == (1, 1), r


def test_a_switch_in_the_trace_lacks_is_put_back(tmp_path):
    """Some hosts never record a switch out of an idle task: the applier's
    own record after it slept proves it ran from that CPU's last record."""
    lines = TRACE.splitlines()
    # Drop the switch in after the 4 ms lock wait; idle on CPU 1 took its
    # timer tick 3 µs before the applier's sys_exit.
    lines[4] = ("          <idle>-0     [001] d.h1. 50.004017: local_timer_entry: vector=236")
    t = tmp_path / "a.trace"
    t.write_text("\n".join(lines) + "\n")
    r = waits(t)
    assert r["idle_switch_ins"] == 1, r
    # 12 µs, then 13 µs (from the tick), then 10 µs.
    assert r["runs_us"]["n"] == 3 and r["runs_us"]["max"] == 13.0, r


CHILD = r"""
import threading, time
lock = threading.Lock()
lock.acquire()
def applier():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write("pvsched-apply")
    for _ in range(5):
        time.sleep(0.002)
    with lock:
        pass
    print(threading.get_native_id())
t = threading.Thread(target=applier)
t.start()
time.sleep(0.2)
lock.release()
t.join()
"""


def test_trace_run_applier_records_only_the_applier(tmp_path, need_real):
    if os.geteuid() != 0:
        need_real("root", "tracefs instances need root")
    out = tmp_path / "t"
    r = subprocess.run([str(REPO / "bench" / "trace-run.sh"), "--applier", str(out), "--",
                        sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tid = int((tmp_path / "t.json").read_text())
    assert all(line.endswith(" 0") for line in r.stdout.splitlines() if "overrun" in line), r.stdout
    trace = (tmp_path / "t.trace").read_text(errors="replace")
    # Every switch and system call recorded is the applier's own.
    for line in trace.splitlines():
        if "sched_switch:" in line:
            assert "pvsched-apply" in line, line
        elif "sys_enter:" in line or "sys_exit:" in line:
            assert f"-{tid} " in line, line
    w = waits(tmp_path / "t.trace")
    assert w["applier_tids"] == [tid], w
    # Its first run began before it took the name, so counts vary; the run
    # after the lock wait (switched in, then out as it exits) is always there.
    assert w["runs_us"]["n"] >= 1, w
    # The main thread held the lock for about 0.2 s.
    assert w["lock_waits_over_2ms"] >= 1, w
    assert max(f["ms"] for f in w["slow_futex"]) >= 100, w
    left = [d for d in os.listdir("/sys/kernel/tracing/instances") if d.startswith("pvsched-stalls-")]
    assert left == [], left
