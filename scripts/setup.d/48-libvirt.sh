# shellcheck shell=bash
# Sourced by scripts/setup: Debian's libvirt (9.0 on bookworm), for the
# test in which a real libvirtd starts a domain with the pvsched device and
# runs the libvirt hook dist/libvirt/qemu.d/pvsched (tests/libvirt;
# apt_install and log provided); idempotent.
#   libvirt-daemon-system  libvirtd, its QEMU driver, Debian's
#                          /etc/libvirt/qemu.conf and the libvirt-qemu user
#                          QEMU runs as (libvirtd refuses to start its QEMU
#                          driver without that user). Its services are not
#                          started here: PID 1 is not systemd on these
#                          machines, and the test starts its own libvirtd.
#   libvirt-clients        virsh: the test, and the hook's
#                          `pvsched qemu-attach --libvirt`
apt_install libvirt-daemon-system libvirt-clients
