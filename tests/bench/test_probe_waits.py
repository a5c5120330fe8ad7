"""probe-waits' parts that need no run: finding the workload's window and
the probe in a trace, and the sums per variant."""

from pvsched_bench.probe_waits import KINDS, ProbeWaitsError, kind, per_variant, window_and_probe

import pytest

TRACE = """\
# tracer: nop
         python3-10    [001] ...1.   100.000000: tracing_mark_write: s6 start 2x2-pvsched-r0 tlb
          <idle>-0     [000] d.h2.   100.001000: sched_wakeup: comm=cyclictest pid=41 prio=120 target_cpu=000
          <idle>-0     [000] d.h2.   100.002000: sched_wakeup: comm=cyclictest pid=41 prio=120 target_cpu=000
          <idle>-0     [000] d.h2.   100.003000: sched_wakeup: comm=cyclictest pid=40 prio=120 target_cpu=000
         python3-10    [001] ...1.   120.000000: tracing_mark_write: s6 end 2x2-pvsched-r0 tlb
"""


def test_the_window_and_the_probe_thread_woken_most(tmp_path):
    t = tmp_path / "t.trace"
    t.write_text(TRACE)
    assert window_and_probe(t) == (100.0, 120.0, 41)
    t.write_text(TRACE.replace("s6 end", "s6 ended?"))
    with pytest.raises(ProbeWaitsError, match="no 's6 start'/'s6 end'"):
        window_and_probe(t)


def test_what_the_probe_waited_behind_is_summed_by_kind():
    assert kind("CPU #/TCG", 98) == "vcpu_rt"
    assert kind("CPU #/KVM", 139) == "vcpu_nice19"
    assert kind("CPU #/TCG", 120) == "vcpu_fair"
    assert kind("stress-ng-cpu", 120) == "host_fair"
    run = {"variant": "pvsched", "host_probe": {"p99_us": 900},
           "waits": {"n": 2, "wait_ms": 5.0,
                     "ran": [{"comm": "CPU #/TCG", "prio": 139, "ms": 3.0, "waits": 2},
                             {"comm": "stress-ng-cpu", "prio": 120, "ms": 1.5, "waits": 1}]}}
    other = dict(run, host_probe={"p99_us": 700})
    s = per_variant([run, other])["pvsched"]
    assert (s["runs"], s["probe_p99_us"], s["waits_n"], s["wait_ms"]) == (2, [900, 700], 4, 10.0)
    assert list(s["behind_ms"]) == KINDS
    assert (s["behind_ms"]["vcpu_nice19"], s["behind_ms"]["host_fair"]) == (6.0, 3.0)
    assert s["ran"][0] == {"comm": "CPU #/TCG", "prio": 139, "ms": 6.0, "waits": 4}
