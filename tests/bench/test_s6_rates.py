"""pvsched_bench s6's rates from the tools' own output: stress-ng's
real-time bogo ops/s from its YAML (not ops over the loop's time),
hackbench's messages over the sum of its invocations' Time:, dbench's
MB/s with its operation count."""

from pvsched_bench import s6

YAML = """---
metrics:
    - stressor: cpu
      bogo-ops: 3088
      bogo-ops-per-second-usr-sys-time: 2589.255094
      bogo-ops-per-second-real-time: 1544.008099
      wall-clock-time: 1.999990
      user-time: 1.192621
"""


def test_stress_ng_rate_is_its_own_real_time_rate():
    assert s6.stress_ng_metrics(YAML, "cpu") == {"ops": 3088, "rate": 1544.008099,
                                                 "wall_s": 1.99999}
    assert s6.stress_ng_metrics(YAML, "membarrier") is None
    assert s6.throughput("cpu", YAML.splitlines()) == (1544.008099, 3088)


def test_hackbench_rate_is_messages_over_its_own_time():
    out = ["Running in process mode with 2 groups using 40 file descriptors each",
           "Time: 0.100", "Time: 0.300"]
    rate, iters = s6.throughput("hackbench", out)
    assert iters == 2 and rate == 2 * s6.HACKBENCH_MESSAGES / 0.4


def test_dbench_rate_and_operations():
    out = [" Operation      Count    AvgLat    MaxLat", " NTCreateX       1000     0.1   1.0",
           " Close            500     0.1   1.0", "Throughput 12.5 MB/sec  4 clients"]
    assert s6.throughput("dbench", out) == (12.5, 1500)
