"""`python3 -m pvsched_bench COMMAND [ARGS...]` (PYTHONPATH=<repo>/python):
the one entry point of the package. COMMAND is one of

  s4             S4: cyclictest in Linux guests under QEMU TCG, raw rows
  s6             S6: throughput of Linux guests under overcommit, raw rows
  stall-trace    name what kept vCPU threads off a CPU in a trace
  phase-trace    where S6's co-scheduled phases' time went in a trace
  apply-trace    decision to applied, step by step, in a trace
  applier-waits  what pvsched's applier thread waited on in a trace
  phase-share    the CPU share of a thread moved between policies
  probe-waits    what the host probe's slow wake-ups waited behind, traced

`python3 -m pvsched_bench COMMAND --help` says more. s4 and s6 are
normally run by `pvsched-bench s4|s6`, which computes their reports.
"""

import importlib
import sys

COMMANDS = {"s4": "s4", "s6": "s6", "stall-trace": "stall_trace",
            "phase-trace": "phase_trace", "apply-trace": "apply_trace",
            "applier-waits": "applier_waits", "phase-share": "phase_share",
            "probe-waits": "probe_waits"}


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if len(argv) >= 2 and argv[1] in ("-h", "--help") else 2
    name = argv[1]
    module = importlib.import_module(f"pvsched_bench.{COMMANDS[name]}")
    # argparse names the program after argv[0].
    sys.argv = [f"pvsched_bench {name}", *argv[2:]]
    if hasattr(module, "entry"):
        return module.entry()
    return module.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
