#!/bin/sh
# Generates vmlinux.h (kernel types for CO-RE) from the running kernel's BTF.
# Usage: gen-vmlinux.sh OUT [BTF]. Called by crates/pvsched-agent/build.rs.
set -eu
out=$1
btf=${2:-/sys/kernel/btf/vmlinux}
bpftool=$(command -v bpftool || echo /usr/sbin/bpftool)
"$bpftool" btf dump file "$btf" format c >"$out.tmp"
mv "$out.tmp" "$out"
