"""pvsched_bench stall-trace on a synthetic trace: the wait of a boosted vCPU
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
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "1 vCPU wait(s) over 1000 µs", out
    assert "vcpu 0/11 woken at prio 98, waited 3.01 ms, switched in on CPU 1" in lines[1], out
    assert "bench-hog busy /21 prio 120" in lines[1], out
    assert "reschedule IPI taken at +3.00 ms" in lines[1], out
    assert lines[1].endswith("cause stolen"), out
    # Neither CPU recorded anything from the last wake-up to the IPI.
    assert lines[2:4] == ["what ran where they waited, summed over 1 wait(s) (3.0 ms):",
                          "  bench-hog busy  prio 120: 3.0 ms in 1 wait(s)"], out
    assert lines[4:] == ["1 interval(s) over 1000 µs with no event on any CPU",
                         "100.000020 all CPUs silent 2.98 ms"], out


def test_threads_by_tid_and_json(tmp_path):
    """--tids picks threads whatever their name and labels them; --json
    gives each wait's cause and the count per cause."""
    t = tmp_path / "t.trace"
    # The same wait, but the CPU records its timer ticks meanwhile: it was
    # running, a fair task kept the FIFO thread off it.
    ticks = "".join(f"  bench-hog busy -21  [001] d.h1. {100.0005 + i * 0.0005:.6f}: "
                    f"local_timer_entry: vector=236\n" for i in range(5))
    # In time order, as tracefs writes it.
    lines = (TRACE.replace("vcpu 0", "CPU 0/TCG") + ticks).splitlines()
    t.write_text("\n".join([lines[0]] + sorted(lines[1:], key=lambda x: float(
        x.split("]")[1].split()[1].rstrip(":")))) + "\n")
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t),
                          "--tids", "11=vcpu0,12=vcpu1", "--json"],
                         capture_output=True, text=True, check=True).stdout
    import json
    doc = json.loads(out)
    assert [w["label"] for w in doc["waits"]] == ["vcpu0"], doc
    w = doc["waits"][0]
    assert w["thread"] == "CPU 0/TCG" and w["prio"] == 98 and w["cpu"] == 1, w
    assert w["cause"] == "behind-fair", w
    assert w["ran"][0]["comm"] == "bench-hog busy " and w["ran"][0]["prio"] == 120, w
    assert doc["causes"] == {"behind-fair": 1}, doc
    assert doc["host_gaps"] == [], doc  # CPU 1 ticked throughout
    # What it waited behind, by kind of thread (digits out of the name).
    assert doc["ran"][0]["comm"] == "bench-hog busy " and doc["ran"][0]["waits"] == 1, doc
    assert doc["ran"][0]["ms"] == w["ran"][0]["ms"], doc
    short = json.loads(subprocess.run(
        [sys.executable, "-m", "pvsched_bench", "stall-trace", str(t), "--tids", "11=vcpu0",
         "--json", "--summary"], capture_output=True, text=True, check=True).stdout)
    assert "waits" not in short and short["n"] == 1, short
    assert short["wait_ms"] == w["wait_ms"] and short["ran"] == doc["ran"], short


def test_a_window_keeps_what_overlaps_it(tmp_path):
    """--from/--to (a benchmark's measured time) drop the waits and host
    gaps outside the window: the wait of 100.000010-100.003010 and the gap
    from 100.000020 are in a window that ends at 100.001 and out of one
    that starts at 100.004."""
    import json
    t = tmp_path / "t.trace"
    t.write_text(TRACE)
    script = "-m", "pvsched_bench", "stall-trace"

    def window(lo, hi):
        out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t), "--json", "--from", lo, "--to", hi],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    inside = window("99.0", "100.001")
    assert inside["causes"] == {"stolen": 1} and len(inside["host_gaps"]) == 1, inside
    after = window("100.004", "101.0")
    assert after["waits"] == [] and after["causes"] == {} and after["host_gaps"] == [], after


def _windows(tmp_path, trace, windows):
    import json
    t = tmp_path / "w.trace"
    t.write_text(trace)
    w = tmp_path / "w.json"
    w.write_text(json.dumps(windows))
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t),
                          "--windows", str(w), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _ticks(cpu, start, n, step=0.0005):
    return "".join(f"  bench-hog busy -21  [00{cpu}] d.h1. {start + i * step:.6f}: "
                   f"local_timer_entry: vector=236\n" for i in range(n))


def _sorted(text):
    lines = text.splitlines()
    return "\n".join([lines[0]] + sorted(lines[1:], key=lambda x: float(
        x.split("]")[1].split()[1].rstrip(":")))) + "\n"


def test_windows_say_where_the_sampled_thread_was(tmp_path):
    """--windows: a sample in which vcpu 0 was queued is its wait's cause
    (stolen: its CPU recorded nothing, not even the reschedule IPI; with
    the CPU ticking, behind the fair task that ran there); on a CPU
    afterwards, running (with ticks) or running-silent (without); a thread
    the trace never shows is untraced."""
    ticking = _sorted(TRACE + _ticks(1, 100.0005, 5))
    after = _sorted(TRACE + _ticks(1, 100.0035, 6))
    w = {"label": "vcpu 0", "from": 100.0, "to": 100.0031}
    running = {"label": "vcpu 0", "from": 100.0035, "to": 100.0059}
    # The other CPU ticks on after it: the trace goes on, CPU 1 is silent.
    later = TRACE + _ticks(0, 100.006, 1)
    doc = _windows(tmp_path, later, [w, running, {"label": "vcpu 7", "from": 100.0, "to": 100.1}])
    causes = [x["cause"] for x in doc["windows"]]
    assert causes == ["queued-stolen", "running-silent", "untraced"], doc
    first = doc["windows"][0]
    assert first["queued_ms"] == 3.01 and first["silent_ms"] == 3.0 and first["ms"] == 3.1, first
    doc = _windows(tmp_path, ticking, [w])
    assert doc["windows"][0]["cause"] == "queued-behind-fair", doc
    doc = _windows(tmp_path, after, [running])
    assert doc["windows"][0]["cause"] == "running" and doc["windows"][0]["run_ms"] == 2.4, doc
    assert doc["causes"] == {"running": 1}, doc


def test_windows_get_their_threads_boost_from_the_decisions(tmp_path):
    """--decisions: the boost a window's thread had when it began, from
    the last decision record of that thread before it: boosted, throttled
    (none, throttled_until ahead), none (before any record, or after the
    throttle ended)."""
    import json
    t = tmp_path / "w.trace"
    t.write_text(TRACE)
    recs = [{"ts": 99_000_000_000, "tid": 11, "kind": 1, "throttled_until": 0},
            {"ts": 100_000_001_000, "tid": 11, "kind": 0, "throttled_until": 100_002_000_000},
            {"ts": 99_500_000_000, "tid": 12, "kind": 0, "throttled_until": 0}]
    d = tmp_path / "d.jsonl"
    d.write_text("".join(json.dumps(r) + "\n" for r in recs) + "not json\n")
    windows = [{"label": "vcpu 0", "tid": 11, "from": 99.5, "to": 99.6},
               {"label": "vcpu 0", "tid": 11, "from": 100.0, "to": 100.0031},
               {"label": "vcpu 0", "tid": 11, "from": 100.0005, "to": 100.0031},
               {"label": "vcpu 0", "tid": 11, "from": 100.0025, "to": 100.0031},
               {"label": "vcpu 1", "tid": 12, "from": 100.0, "to": 100.001},
               {"label": "vcpu 1", "tid": 13, "from": 100.0, "to": 100.001}]
    w = tmp_path / "w.json"
    w.write_text(json.dumps(windows))
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t),
                          "--windows", str(w), "--decisions", str(d), "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert [x["boost"] for x in doc["windows"]] == [
        "boosted", "boosted", "throttled", "none", "none", "none"], doc
    assert doc["boost"] == {"boosted": 2, "throttled": 1, "none": 3}, doc
    assert doc["cause_boost"]["queued-stolen/throttled"] == 1, doc


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


def test_the_cpu_it_was_queued_on_is_the_one_examined(tmp_path):
    """A FIFO thread woken onto a CPU that then records nothing, pulled by
    the other CPU after 4 ms: the silent CPU is what kept it waiting."""
    t = tmp_path / "t.trace"
    t.write_text("""\
# tracer: nop
  qemu-main-10        [000] d..3. 200.000000: sched_wakeup: comm=CPU 0/TCG pid=11 prio=98 target_cpu=001
  hog-21              [001] d..2. 200.000100: sched_switch: prev_comm=hog prev_pid=21 prev_prio=120 prev_state=R ==> next_comm=hog next_pid=22 next_prio=120
  hog-23              [000] d.h1. 200.001000: local_timer_entry: vector=236
  hog-23              [000] d.h1. 200.002000: local_timer_entry: vector=236
  hog-23              [000] d.h1. 200.003000: local_timer_entry: vector=236
  hog-23              [000] d..2. 200.004000: sched_migrate_task: comm=CPU 0/TCG pid=11 prio=98 orig_cpu=1 dest_cpu=0
  hog-23              [000] d..2. 200.004010: sched_switch: prev_comm=hog prev_pid=23 prev_prio=120 prev_state=R ==> next_comm=CPU 0/TCG next_pid=11 next_prio=98
""")
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t),
                          "--tids", "11=vcpu0", "--json"],
                         capture_output=True, text=True, check=True).stdout
    import json
    w = json.loads(out)["waits"][0]
    assert (w["cpu"], w["queued_cpu"], w["cause"]) == (0, 1, "stolen"), w
    assert w["queued_ms"] == 4.0 and w["wait_ms"] == 4.01, w


SLEEPS = """\
# tracer: nop
       CPU 0/TCG-11    [000] ..... 200.000000: sys_futex(uaddr: 0x7f00000010, op: 0x80, val: 2, utime: 0, uaddr2: 0, val3: 0)
       CPU 0/TCG-11    [000] d..2. 200.000010: sched_switch: prev_comm=CPU 0/TCG prev_pid=11 prev_prio=98 prev_state=S ==> next_comm=bench-hog next_pid=21 next_prio=120
       CPU 1/TCG-12    [001] ..... 200.004000: sys_futex(uaddr: 0x7f00000010, op: 0x81, val: 1, utime: 0, uaddr2: 0, val3: 0)
       CPU 1/TCG-12    [001] d..3. 200.004010: sched_wakeup: comm=CPU 0/TCG pid=11 prio=98 target_cpu=000
       bench-hog-21    [000] d..2. 200.004020: sched_switch: prev_comm=bench-hog prev_pid=21 prev_prio=120 prev_state=R ==> next_comm=CPU 0/TCG next_pid=11 next_prio=98
       CPU 0/TCG-11    [000] d..2. 200.004100: sched_switch: prev_comm=CPU 0/TCG prev_pid=11 prev_prio=98 prev_state=S ==> next_comm=bench-hog next_pid=21 next_prio=120
       main-10         [001] d..3. 200.004300: sched_wakeup: comm=CPU 0/TCG pid=11 prio=98 target_cpu=000
"""


def test_sleeps_name_the_futex_and_the_waker(tmp_path):
    """--sleeps: a vCPU thread that blocked on a futex word until a sibling
    woke it is listed with that word and the sibling; the wake (FUTEX_WAKE)
    is not taken for a wait, and a block shorter than --over-us is left out."""
    t = tmp_path / "t.trace"
    t.write_text(SLEEPS)
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t),
                          "--sleeps", "--tids", "10=main,11=vcpu0,12=vcpu1", "--json"],
                         capture_output=True, text=True, check=True).stdout
    import json
    doc = json.loads(out)
    assert [(s["label"], s["ms"], s["futex"], s["waker"]) for s in doc["sleeps"]] == [
        ("vcpu0", 4.0, "0x7f00000010", "vcpu1")], doc
    assert doc["by"] == [{"thread": "vcpu0", "waker": "vcpu1", "futex": "0x7f00000010",
                          "count": 1, "longest_ms": 4.0}], doc


def test_overlapping_keeps_what_touches_the_window():
    from pvsched_bench import stall_trace
    items = [{"at": 1.0, "ms": 5.0}, {"at": 1.010, "ms": 100.0}, {"at": 1.2, "ms": 1.0}]
    # [1.004, 1.1]: the first ended before it, the last began after it.
    assert stall_trace.overlapping(items, 1.006, 1.1, "ms") == [items[1]]
    assert stall_trace.overlapping(items, 1.0, 1.2, "ms") == items


# CPU 1 goes idle; vcpu 0 is woken onto it and runs, but (as on this
# project's CI hosts) the kernel records no switch out of CPU 1's idle task:
# only the IPI idle took and vcpu 0's own records show it ran.
IDLE = """\
# tracer: nop
  bench-hog busy -21  [001] d..2. 100.000000: sched_switch: prev_comm=bench-hog busy  prev_pid=21 prev_prio=120 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
  pvsched-inject-17   [000] d..3. 100.001000: sched_wakeup: comm=vcpu 0 pid=11 prio=98 target_cpu=001
          <idle>-0    [001] d.h1. 100.001050: reschedule_entry: vector=253
         vcpu 0-11    [001] d.h1. 100.002500: local_timer_entry: vector=236
         vcpu 0-11    [001] d.h1. 100.004000: local_timer_entry: vector=236
         vcpu 0-11    [001] d..2. 100.006000: sched_switch: prev_comm=vcpu 0 prev_pid=11 prev_prio=98 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
"""


def test_a_switch_out_of_idle_the_trace_lacks_is_put_back(tmp_path):
    """The switch in is put at the last record idle made on that CPU: the
    thread ran from 100.00105, it did not wait 3 ms queued."""
    doc = _windows(tmp_path, IDLE, [{"label": "vcpu 0", "from": 100.0011, "to": 100.0059}])
    assert doc["idle_switch_ins"] == 1, doc
    w = doc["windows"][0]
    assert w["cause"] == "running" and w["run_ms"] == 4.8 and w["queued_ms"] == 0, w
    t = tmp_path / "i.trace"
    t.write_text(IDLE)
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "stall-trace", str(t),
                          "--json"], capture_output=True, text=True, check=True).stdout
    import json
    doc = json.loads(out)
    assert doc["waits"] == [] and doc["idle_switch_ins"] == 1, doc
