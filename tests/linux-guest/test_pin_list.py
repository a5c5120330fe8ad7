"""init.sh pins every tracepoint the guest driver hooks.

Under QEMU TCG, adding or removing a tracepoint's first probe patches
kernel text, which a vCPU can race into a lockup (init.sh, pin_events).
init.sh therefore enables each hooked event in two trace instances before
the module loads, so that loading and unloading it patches nothing. A
tracepoint added to the driver's table (PVSCHED_TP in pvsched.c) without
its event in that list brings the lockup back, in a fraction of the boots
only: this reads both files and needs no guest.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "guest-driver" / "pvsched.c"
INIT = REPO / "python" / "pvsched_guest" / "initramfs" / "init.sh"


def hooked_tracepoints() -> set[str]:
    """The tracepoint names of the driver's pvsched_tps table."""
    src = DRIVER.read_text()
    table = re.search(r"pvsched_tps\[\] = \{(.*?)\n\};", src, re.S)
    assert table, f"no pvsched_tps table in {DRIVER}"
    return set(re.findall(r"PVSCHED_TP\((\w+),", table.group(1)))


def pinned_events() -> set[str]:
    """The event names (without their system) pin_events enables."""
    src = INIT.read_text()
    body = re.search(r"pin_events\(\) \{(.*?)\n\}", src, re.S)
    assert body, f"no pin_events() in {INIT}"
    loop = re.search(r"for e in (.*?); do", body.group(1), re.S)
    assert loop, "pin_events() has no 'for e in ...' list"
    words = loop.group(1).replace("\\\n", " ").split()
    return {w.split("/", 1)[1] for w in words if "/" in w}


def test_every_hooked_tracepoint_is_pinned():
    hooked = hooked_tracepoints()
    assert len(hooked) >= 8, f"parsed too few tracepoints from {DRIVER}: {hooked}"
    missing = hooked - pinned_events()
    assert not missing, (f"init.sh pin_events does not enable {sorted(missing)}: loading the "
                         "module would patch their text under TCG")
