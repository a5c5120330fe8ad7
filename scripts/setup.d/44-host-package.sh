# shellcheck shell=bash
# Sourced by scripts/setup: what scripts/package needs to build the host
# Debian package (dist/debian) and tests/package needs to install it
# (the systemd container chroot of 43-systemd-container.sh); idempotent.
apt_install debhelper dpkg-dev fakeroot
