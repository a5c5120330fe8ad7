# shellcheck shell=bash
# Sourced by scripts/setup: what pvschedd's tests need on the host
# (apt_install provided); idempotent.
#   systemd       systemd-analyze verifies dist/systemd/pvschedd.service
#   bsdutils      logger, used by the libvirt hook dist/libvirt/qemu.d/pvsched
#   qemu-system-x86  pvsched qemu-attach is tested on a real QEMU (also 40-linux-guest)
apt_install systemd bsdutils qemu-system-x86
