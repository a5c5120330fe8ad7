"""Which failed boots the Linux-guest harness boots again (up to
EARLY_OOPS_BOOTS times): only a kernel oops on an INT3 before init printed
its first mark (QEMU TCG's stale breakpoint, before any pvsched code is in
the guest). An oops after init started, or any other early oops, fails
the boot."""

from pvsched_guest.boot import Boot

OOPS = "[    1.026031] Oops: int3: 0000 [#1] SMP NOPTI"


def boot_with(serial, marks):
    b = Boot.__new__(Boot)  # the console and marks alone, no QEMU
    b.serial, b.marks = serial, marks
    return b


def test_only_an_int3_oops_before_init_is_booted_again():
    assert boot_with(["[    0.0] Linux version 7.3", OOPS], {}).early_int3_oops()
    assert not boot_with([OOPS], {"boot": (0.9, {})}).early_int3_oops()
    assert not boot_with(["[    1.0] Oops: general protection fault"], {}).early_int3_oops()
    assert not boot_with(["[    1.0] Kernel panic - not syncing"], {}).early_int3_oops()
