"""pvsched_bench phase-trace on a synthetic trace: two co-scheduled phases of a
2-vCPU VM, found from the agent's sched_setattr calls and the priority the
threads show next; the time both vCPUs ran in them, their first run, what
ran while one was queued, and the vCPU time that fell outside the phases."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def setattr_(ts, pid):
    return (f"  pvsched-apply-30  [000] ..... {ts}: "
            f"sys_sched_setattr(pid: {pid:#x}, uattr: 0x7ffd1000, flags: 0)")


def switch(ts, cpu, prev, pprio, pstate, nxt, nprio):
    names = {11: "CPU 0/TCG", 12: "CPU 1/TCG", 21: "bench-hog", 22: "bench-hog"}
    return (f"  {names[prev]}-{prev}  [{cpu:03d}] d..2. {ts}: sched_switch: "
            f"prev_comm={names[prev]} prev_pid={prev} prev_prio={pprio} prev_state={pstate} ==> "
            f"next_comm={names[nxt]} next_pid={nxt} next_prio={nprio}")


TRACE = "\n".join([
    "# tracer: nop",
    # Phase 1, 100.000-100.005: both vCPUs put at FIFO 1 (prio 98).
    setattr_("100.000000", 11), setattr_("100.000005", 12),
    switch("100.000020", 0, 21, 120, "R", 11, 98),
    switch("100.000040", 1, 22, 120, "R", 12, 98),
    # vCPU 1 halts for ~1 ms, is woken, queued 10 µs behind the hog.
    switch("100.002040", 1, 12, 98, "S", 22, 120),
    "  CPU 0/TCG-11  [000] d..3. 100.003000: sched_wakeup: comm=CPU 1/TCG pid=12 prio=98 "
    "target_cpu=001",
    switch("100.003010", 1, 22, 120, "R", 12, 98),
    # The phase ends: both to nice 19 (prio 139).
    setattr_("100.005000", 11), setattr_("100.005004", 12),
    switch("100.005020", 0, 11, 139, "R", 21, 120),
    switch("100.005030", 1, 12, 139, "R", 22, 120),
    # vCPU 0 runs 1 ms alone off its phase.
    switch("100.008000", 0, 21, 120, "R", 11, 139),
    switch("100.009000", 0, 11, 139, "R", 21, 120),
    # Phase 2, 100.020-100.025.
    setattr_("100.020000", 11), setattr_("100.020003", 12),
    switch("100.020020", 0, 21, 120, "R", 11, 98),
    switch("100.020030", 1, 22, 120, "R", 12, 98),
    setattr_("100.025000", 11), setattr_("100.025004", 12),
    switch("100.025020", 0, 11, 139, "R", 21, 120),
    switch("100.025030", 1, 12, 139, "R", 22, 120),
]) + "\n"


def test_two_phases_of_a_vm(tmp_path):
    t = tmp_path / "t.trace"
    t.write_text(TRACE)
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "phase-trace", str(t),
                          "--json"], capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert list(doc) == ["CPU 0/TCG(11),CPU 1/TCG(12)"], doc
    v = doc["CPU 0/TCG(11),CPU 1/TCG(12)"]
    assert v["phases"] == 2 and v["phase_ms_median"] == 5.0, v
    # Both ran 3.99 + 4.97 of the 10 ms; one alone 0.99 + 0.01.
    assert v["all_running"] == 0.896 and v["some_running"] == 0.1, v
    assert v["none_running"] == 0.004, v
    assert v["last_first_run_ms_median"] == 0.035, v
    # CPU time of other threads (summed over CPUs) while a vCPU of the
    # phase was runnable off a CPU: 10 µs at the wake-up; 20 µs on both
    # CPUs and 10 on one at the start of phase 2 (both left runnable).
    assert v["instead_share"] == {"bench-hog": 0.006}, v
    assert v["last_first_run_ms_p90"] == 0.04, v
    # Off the phases: vCPU 0's 1 ms alone and the 20 + 30 µs each took to
    # leave the CPU after the first phase ended.
    assert v["vcpu_s_off_phase"] == 0.001 and v["vcpu_s_in_phase"] == 0.019, v
    assert v["off_phase_run_ms_p50"] == 0.03 and v["off_phase_run_ms_p90"] == 1.0, v
    # Per second of the 25 ms from the first phase to the last: 50 µs
    # past the first phase's end, and vCPU 0's 1 ms: taken off its CPU at
    # that end, runnable, picked again in the off part.
    assert v["off_phase_ms_per_s_by_start"] == {"back_after_phase_end": 40.0,
                                                 "past_phase_end": 2.0}, v


def mark(ts, text):
    return f"          python3-40  [001] ..... {ts}: tracing_mark_write: {text}"


def test_together_in_a_marked_run(tmp_path):
    """The share of a VM's vCPU time with both its vCPUs on a CPU, inside
    the workload run pvsched_bench s6 marked, for the VM it named."""
    t = tmp_path / "t.trace"
    t.write_text(TRACE.replace("# tracer: nop\n", "# tracer: nop\n" + "\n".join([
        mark("99.999000", "s6 vm s6-1x2-x-r0-vm0 11,12"),
        mark("100.000000", "s6 start 1x2-x-r0 hackbench")]) + "\n")
                 + mark("100.010000", "s6 end 1x2-x-r0 hackbench") + "\n")
    out = subprocess.run([sys.executable, "-m", "pvsched_bench", "phase-trace", str(t),
                          "--json"], capture_output=True, text=True, check=True).stdout
    v = json.loads(out)["CPU 0/TCG(11),CPU 1/TCG(12)"]
    # In 100.000-100.010: vCPU 0 on a CPU 5.0 + 1.0 ms, vCPU 1 2.0 + 2.02;
    # both at once 2.0 + 2.01 ms, i.e. 8.02 of the 10.02 vCPU-ms.
    assert v["together"] == [{"run": "1x2-x-r0 hackbench", "vcpu_s": 0.01,
                              "together_share": 0.8004}], v
