"""The tracefs text format, once for every analyser: a record's line is
`COMM-TID [CPU] FLAGS TIMESTAMP: EVENT: FIELDS`, a system call's
`... TIMESTAMP: sys_NAME(ARGS)` (syscalls/sys_enter_*), and
bench/trace-run.sh records with `trace_clock` mono, so TIMESTAMP is
CLOCK_MONOTONIC seconds."""

import re

# A record up to its event: who, where, when.
PREFIX = r"^\s*(?P<task>.+?)-(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>[\d.]+):\s+"
# A whole record: the event's name, then its fields after ": ", or a
# system call's arguments after "(".
LINE = re.compile(PREFIX + r"(?P<ev>\w+)(?::\s+|\(| )(?P<rest>.*)$")


def records(path):
    """The LINE match of every record of the trace file at `path`, in file
    order (lines that are not records, such as the header, are skipped)."""
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                yield m


def fields(rest):
    """{name: value} of a record's `name=value` fields."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S+)", rest))
