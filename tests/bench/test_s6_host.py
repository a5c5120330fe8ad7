"""S6's record of the host itself: where its CPU went over a window
(/proc/stat) and what a wake-up and a change cost it (host-costs)."""

import json
import os
import stat
from types import SimpleNamespace

from pvsched_bench import s6


def test_host_cpu_is_seconds_per_field_over_the_window():
    hz = os.sysconf("SC_CLK_TCK")
    t0 = [0] * len(s6.HOST_CPU_FIELDS)
    t1 = [hz * (i + 1) for i in range(len(s6.HOST_CPU_FIELDS))]
    c = s6.host_cpu_s(t0, t1)
    assert list(c) == list(s6.HOST_CPU_FIELDS)
    assert (c["user"], c["idle"], c["steal"]) == (1.0, 4.0, 8.0)
    # This host's own counters read and only grow.
    a = s6.host_cpu_ticks()
    b = s6.host_cpu_ticks()
    assert len(a) == len(s6.HOST_CPU_FIELDS)
    assert all(y >= x for x, y in zip(a, b))


def _fake_bench(tmp_path, body):
    p = tmp_path / "pvsched-bench"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_host_costs_keeps_the_medians_and_survives_a_failure(tmp_path):
    assert s6.host_costs(SimpleNamespace(host_costs_bin=None)) is None
    report = {k: {"n": 1, "median": float(i), "min": float(i), "max": float(i)}
              for i, k in enumerate(s6.HOST_COSTS)}
    report["timer_sleep_us"]["median"] = None
    ok = _fake_bench(tmp_path, f"echo 'host costs' >&2\ncat <<'X'\n{json.dumps(report)}\nX\n")
    got = s6.host_costs(SimpleNamespace(host_costs_bin=ok))
    assert got == {k: float(i) for i, k in enumerate(s6.HOST_COSTS) if k != "timer_sleep_us"}
    bad = _fake_bench(tmp_path, "echo 'needs root' >&2\nexit 9\n")
    assert s6.host_costs(SimpleNamespace(host_costs_bin=bad)) is None
