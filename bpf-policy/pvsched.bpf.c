/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pvsched host policy (CO-RE). One compilation unit split by concern:
 *   intf.h        BPF <-> userspace records (mirrored in pvsched-agent)
 *   maps.bpf.h    maps
 *   slot.bpf.h    region slot read (guest half) / publish (host half)
 *   budget.bpf.h  boost choice, caps, max boost, throttle, budget, decisions
 *   ipi.bpf.h     IPI pairs and the directed-yield slot
 *   policy.bpf.h  per-event state machine
 *   cosched.bpf.h a co-scheduled phase yields to host wake-ups
 *   switch.bpf.c  sched_switch, sched_wakeup
 *   kvm.bpf.c     kvm_vcpu_wakeup, kvm_userspace_exit
 *   ipi.bpf.c     kvm_apic_ipi
 *   reeval.bpf.c  timer, KICK and synthetic events (BPF_PROG_TEST_RUN)
 * Built by crates/pvsched-agent/build.rs with clang -target bpf -O2 -g -mcpu=v3.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#define PVSCHED_ABI_NO_TYPES
#include "pvsched_abi.h"
#include "intf.h"

#ifndef BPF_F_MMAPABLE
#define BPF_F_MMAPABLE (1U << 10)
#endif
#ifndef barrier
#define barrier() asm volatile("" ::: "memory")
#endif
#ifndef READ_ONCE
#define READ_ONCE(x) (*(volatile typeof(x) *)&(x))
#endif
#ifndef WRITE_ONCE
#define WRITE_ONCE(x, val) ((*(volatile typeof(x) *)&(x)) = (val))
#endif
/* A full memory barrier, store-to-load included: BPF's value-returning
 * atomics are fully ordered (a locked instruction on x86), and a
 * compare-and-swap of 0 with 0 changes nothing. `word` is a __u32 in a map
 * value. Two CPUs that each store, fence, then load the other's store
 * cannot both miss it. */
#define full_fence(word) ((void)__sync_val_compare_and_swap(&(word), 0, 0))

char LICENSE[] SEC("license") = "GPL";

#include "maps.bpf.h"
#include "slot.bpf.h"
#include "budget.bpf.h"
#include "ipi.bpf.h"
#include "policy.bpf.h"
#include "cosched.bpf.h"

#include "switch.bpf.c"
#include "kvm.bpf.c"
#include "ipi.bpf.c"
#include "reeval.bpf.c"
