"""The BPF policy's records and constants (bpf-policy/intf.h) for Python harnesses.

Generated from the list that checks the C header against its Rust
mirror, by
    crates/pvsched-policy/tests/integration/intf_layout.rs (python_policy_is_generated_from_this_list)
Do not edit: that test fails when this file is stale, and
PVSCHED_BLESS=1 rewrites it.
"""

MAX_VMS = 64
MAX_VCPUS_PER_VM = 64
MAX_EMULATORS = 4
TID_HINTS = 4096
THREADS_PER_VM = 68
APIC_FAST = 256
PROG_SWITCH = 0
PROG_WAKEUP = 1
PROG_VCPU_WAKEUP = 2
PROG_USER_EXIT = 3
PROG_IPI = 4
PROG_MAX = 5
REGION_STRIDE = 16384
GID_SHIFT = 10
GID_ALL = 4294967295
NOW_CLOCK = 0
MODE_NONE = 0
MODE_DEVICE = 1
MODE_GUEST = 2
KICK_OFF = 0
KICK_ON = 1
KICK_AUTO = 2
ST_UNKNOWN = 0
ST_RUNNING = 1
ST_PREEMPTED = 2
ST_HALTED = 3
ST_WOKEN = 4
EV_SWITCH_OUT = 1
EV_SWITCH_IN = 2
EV_WAKEUP = 3
EV_VCPU_WAKEUP = 4
EV_IPI = 5
EV_USER_EXIT = 6
EV_TICK = 7
EV_EXIT = 8
EV_KICK = 9
EV_PHASE_ON = 10
EV_MAX = 11
R_NONE = 0
R_CS = 1
R_RT_TASK = 2
R_NICE_TASK = 3
R_HALT = 4
R_YIELD = 5
R_MAX_BOOST = 6
R_BUDGET = 7
R_THROTTLED = 8
R_EXITED = 9
R_VM_BUDGET = 10
R_HOST_WAKE = 11
R_HOST_DONE = 12
R_HOST_YIELD = 13
PHASE_FREE = 0
PHASE_ON = 1
PHASE_OFF = 2
PHASE_YIELDED = 3
COSCHED_RT_PRIO = 1
MAX_CPUS = 1024
CPU_WAITERS = 4
CPU_YIELDS = 4
HOST_HOLD_NS = 6000000

SIZEOF = {
    "pvs_caps": 96,
    "pvs_cpu": 72,
    "pvs_decision": 48,
    "pvs_stats": 216,
    "pvs_tid_hint": 16,
    "pvs_vcpu": 248,
    "pvs_vm": 144,
}

OFFSETOF = {
    "pvs_caps": {
        "allow_rt": 0,
        "max_rt_prio": 4,
        "nice_floor": 8,
        "cs_rt_prio": 12,
        "halt_kind": 16,
        "halt_prio": 20,
        "yield_kind": 24,
        "yield_prio": 28,
        "max_boost_ns": 32,
        "throttle_ns": 40,
        "budget_ns": 48,
        "window_ns": 56,
        "ipi_window_ns": 64,
        "halt_hold_ns": 72,
        "halt_always": 80,
        "kick_pairs": 84,
        "vm_budget_ns": 88,
    },
    "pvs_cpu": {
        "run_key": 0,
        "yield_keys": 4,
        "wait_tid": 20,
        "pad0": 36,
        "wait_at": 40,
    },
    "pvs_decision": {
        "ts": 0,
        "tid": 8,
        "gid": 12,
        "kind": 16,
        "prio": 20,
        "reason": 24,
        "event": 28,
        "throttled_until": 32,
        "waits_on": 40,
        "pad0": 44,
    },
    "pvs_stats": {
        "events": 0,
        "decisions": 88,
        "dropped": 96,
        "boosts": 104,
        "unboosts": 112,
        "throttles": 120,
        "ipi_pairs": 128,
        "slot_hits": 136,
        "torn_reads": 144,
        "read_errors": 152,
        "publish_busy": 160,
        "full_runs": 168,
        "phase_yields": 208,
    },
    "pvs_tid_hint": {
        "count": 0,
        "tid": 4,
        "key": 8,
        "pad0": 12,
    },
    "pvs_vcpu": {
        "tid": 0,
        "vm_id": 4,
        "index": 8,
        "state": 12,
        "slot_addr": 16,
        "req_kind": 24,
        "req_prio": 28,
        "req_reason": 32,
        "wait_on": 36,
        "boost": 40,
        "boost_prio": 44,
        "boost_reason": 48,
        "throttled": 52,
        "acct_ns": 56,
        "cont_ns": 64,
        "window_start": 72,
        "budget_used": 80,
        "throttled_until": 88,
        "ls_until": 96,
        "last_ipi_target": 104,
        "yield_slot": 108,
        "last_ipi_ns": 112,
        "yield_boosting": 120,
        "fence": 124,
        "yield_mask": 128,
        "boosts": 136,
        "throttles": 144,
        "boosted_ns": 152,
        "ipis": 160,
        "slot_hits": 168,
        "guest_idle": 176,
        "last_kick_target": 180,
        "last_kick_ns": 184,
        "ls_prio": 192,
        "phase": 196,
        "sync_halts": 200,
        "sib_wakes": 208,
        "sync_wait_ns": 216,
        "sync_since": 224,
        "host_hold_until": 232,
        "wait_on_off": 240,
        "pad1": 244,
    },
    "pvs_vm": {
        "active": 0,
        "nr_vcpus": 4,
        "mode": 8,
        "wait_on_enabled": 12,
        "caps": 16,
        "nr_emulators": 112,
        "lock_wait_enabled": 116,
        "ls_until": 120,
        "window_start": 128,
        "budget_used": 136,
    },
}
