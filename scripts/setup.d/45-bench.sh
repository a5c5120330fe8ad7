# shellcheck shell=bash
# S4 benchmark (pvsched-bench s4, python/pvsched_bench/s4.py): cyclictest
# from Debian's rt-tests, run on the host and copied with its shared libraries into the guest's
# initramfs, and stress-ng to load the host. Sourced by scripts/setup
# (apt_install provided); idempotent.

apt_install rt-tests stress-ng
