# shellcheck shell=bash
# BPF host policy: clang/LLVM 19 to compile the CO-RE C policy in
# crates/pvsched-agent/build.rs, libbpf headers (bpf_helpers.h, bpf_tracing.h,
# bpf_core_read.h) and bpftool (vmlinux.h generation, `bpftool prog show` for
# run-time statistics). Sourced by scripts/setup; idempotent.

apt_install clang-19 llvm-19 libbpf-dev bpftool
