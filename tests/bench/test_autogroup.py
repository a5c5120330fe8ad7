"""The benchmarks' autogroup switch (pvsched_guest.bench.Autogroup) on the
real host: `off` and `on` are in force inside the run (the sysctl read
back) and the host's own value is back afterwards, `host` touches
nothing, and an unknown mode is refused."""

import os

import pytest

from pvsched_guest.bench import AUTOGROUP, Autogroup


@pytest.fixture
def switch(need_real):
    if os.geteuid() != 0:
        need_real("root", "the autogroup switch is a sysctl")
    if not AUTOGROUP.exists():
        need_real(str(AUTOGROUP), "the host kernel has no CONFIG_SCHED_AUTOGROUP")
    return AUTOGROUP.read_text().strip()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_mode_in_force_then_restored(switch, mode):
    with Autogroup(mode) as ag:
        assert ag.state == mode
        assert AUTOGROUP.read_text().strip() == ("0" if mode == "off" else "1")
    assert AUTOGROUP.read_text().strip() == switch


def test_host_leaves_it_alone(switch):
    with Autogroup("host") as ag:
        assert AUTOGROUP.read_text().strip() == switch
        assert ag.state == ("off" if switch == "0" else "on")
    assert AUTOGROUP.read_text().strip() == switch


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="one of off, on, host"):
        Autogroup("maybe")
