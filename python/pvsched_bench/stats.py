"""Order statistics of the trace analysers' samples (the benchmarks'
repetition statistics are computed in Rust, by `pvsched-bench`)."""


def quantiles(xs, scale=1.0):
    """{"n", "p50", "p90", "p99", "max", "sum"} of the samples `xs`, each
    divided by `scale` (1e3: ns to µs) and rounded to 0.1 (the sum to
    0.01), or None without samples. A quantile is the sample at rank
    int(n * q) of the sorted samples (the nearest rank at or above it)."""
    xs = sorted(xs)
    if not xs:
        return None
    n = len(xs)

    def at(q):
        return round(xs[min(n - 1, int(n * q))] / scale, 1)
    return {"n": n, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99),
            "max": round(xs[-1] / scale, 1), "sum": round(sum(xs) / scale, 2)}
