"""The pvsched guest driver in a real Debian 6.1 guest (the cloud kernel;
the module built on the host, insmod) under QEMU TCG, the device served by
pvsched-device: over QEMU 7.2's multi-process proxy (x-pci-proxy-dev,
guest-region mode), and over vfio-user under QEMU 11 (vfio-user-pci) in
device- and guest-region mode. Assertions are made on the host, from the
device's view of the region (scenarios.py says what each boot checks).

- main, -smp 2 and 4: handshake, slots, FIFO loop, irq bits, CPU hotplug,
  20 load/unload cycles, dynamic IDs; the pipe round trip without and with
  the module (reported);
- vfio-device, vfio-guest: the same over vfio-user; in device-region mode a
  churn of slot updates crosses no socket;
- agent: pvsched-agent-attach on QEMU's vCPU threads boosts the one running
  the guest's FIFO 8 loop, and restores it;
- vfio-daemon: the same with pvschedd's region map as BAR2;
- foreign: that region's header and host halves rewritten with garbage by
  another host process while the driver is bound and reloaded;
- vfio-kill, vfio-unplug: the device SIGKILLed, or device_del'd over QMP,
  while the driver is bound;
- negative: wrong MAGIC, wrong version, a region the device refuses.

The wait_on and hostile-header boots, and main with the module that DKMS
installed, run on each kernel of the matrix (test_guest_matrix.py).
"""

import pytest

import scenarios


@pytest.mark.parametrize("smp", [2, 4], ids=["smp2", "smp4"])
def test_main(guest, report, smp):
    failures = scenarios.main(guest, report, smp)
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("qemu11")
@pytest.mark.parametrize("region", ["device", "guest"])
def test_vfio(guest, report, region):
    failures = scenarios.vfio(guest, report, region)
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("root")
def test_agent(guest, report):
    failures = scenarios.agent(guest, report)
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("root", "qemu11")
def test_vfio_daemon(guest, report):
    failures = scenarios.daemon(guest, report)
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("root", "qemu11")
def test_foreign_header(guest, report):
    failures = scenarios.foreign(guest, report)
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("qemu11")
@pytest.mark.parametrize("how", ["kill", "unplug"])
def test_vfio_loss(guest, report, how):
    failures = scenarios.loss(guest, report, how)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("fault", ["wrong-magic", "wrong-version", "refuse-region"])
def test_negative(guest, report, fault):
    failures = scenarios.negative(guest, report, fault)
    assert not failures, "\n".join(failures)
