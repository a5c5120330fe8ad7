"""The benchmarks' Python side: what runs real Linux guests (S4, S6) and
the analysers of host scheduler traces. One entry point,
`python3 -m pvsched_bench COMMAND ...` with PYTHONPATH=<repo>/python
(see __main__.py); `pvsched-bench s4|s6` runs it and computes the
reports from its raw rows.

  s4, s6         measurement: boot the guests, run the workloads, write
                 one raw row per run (no statistics: those are Rust's)
  guest/         the guest-side scripts (/bench.sh in the initramfs)
  ftrace         the tracefs text format, parsed once for every analyser
  stats          quantiles() of the analysers' samples
  stall_trace    what kept vCPU threads off a CPU
  phase_trace    where co-scheduled phases' time went (S6)
  apply_trace    decision to applied, step by step
  applier_waits  what the applier thread waited on
  phase_share    the CPU share of a thread moved between policies

The guest harness (QEMU boots, initramfs, pvschedd) is pvsched_guest's.
"""
