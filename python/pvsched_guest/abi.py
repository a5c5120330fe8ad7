"""The pvsched ABI (include/pvsched_abi.h) for Python harnesses.

Generated from the list that checks the C header against its Rust
mirror, by
    crates/pvsched-abi/tests/c_layout.rs (python_abi_is_generated_from_this_list)
Do not edit: that test fails when this file is stale, and
PVSCHED_BLESS=1 rewrites it.
"""

ABI_MAJOR = 1
ABI_MINOR = 6
ABI_VERSION = 65542
PCI_VENDOR_ID = 20566
PCI_DEVICE_ID = 23630
PCI_SUBSYS_VENDOR_ID = 20566
PCI_SUBSYS_ID = 1
PCI_REVISION = 1
PCI_CLASS = 557056
REG_BAR = 0
REG_BAR_SIZE = 4096
REGION_BAR = 2
REG_MAGIC = 0
REG_VERSION = 4
REG_DEV_FEATURES_LO = 8
REG_DEV_FEATURES_HI = 12
REG_DRV_FEATURES_LO = 16
REG_DRV_FEATURES_HI = 20
REG_NR_VCPUS = 24
REG_SLOT_SIZE = 28
REG_STATUS = 32
REG_ERROR = 36
REG_SHM_GPA_LO = 40
REG_SHM_GPA_HI = 44
REG_SHM_SIZE = 48
REG_REGION_SIZE = 52
REG_KICK = 56
REG_GENERATION = 60
REG_DRIVER_VERSION = 64
REG_END = 68
MAGIC = 1129535056
F_DEVICE_REGION = 1
F_GUEST_REGION = 2
F_WAIT_ON = 4
F_KICK = 8
F_TASK_FLAGS = 16
F_LOCK_WAIT = 32
F_SYNC_COUNTS = 64
F_ALL = 127
STATUS_RESET = 0
STATUS_ACKNOWLEDGE = 1
STATUS_DRIVER = 2
STATUS_DRIVER_OK = 4
STATUS_FEATURES_OK = 8
STATUS_DEVICE_NEEDS_RESET = 64
STATUS_FAILED = 128
ERR_NONE = 0
ERR_BAD_SEQUENCE = 1
ERR_FEATURES_UNSUPPORTED = 2
ERR_NO_REGION_MODE = 3
ERR_VERSION_MISMATCH = 4
ERR_REGION_ZERO_SIZE = 5
ERR_REGION_UNALIGNED = 6
ERR_REGION_WRAPS = 7
ERR_REGION_OUTSIDE_RAM = 8
ERR_REGION_TOO_SMALL = 9
ERR_REGION_CHANGED = 10
ERR_REGION_UNMAPPED = 11
ERR_REGION_UNAVAILABLE = 12
ERR_DEVICE_FAILED = 13
ERR_MAX = 13
REGION_MAGIC = 1381193296
MAX_VCPUS = 1024
CACHELINE = 64
PAGE_SIZE = 4096
SLOT_SIZE = 128
HEADER_SIZE = 64
APIC_TABLE_OFFSET = 64
HOST_F_POLICY_ACTIVE = 1
CS_NMI = 1
CS_HARDIRQ = 2
CS_SOFTIRQ = 4
CS_PREEMPT_OFF = 8
CS_ALL = 15
TASK_F_KTHREAD = 1
TASK_F_IDLE = 2
TASK_F_RT_SLEEPER = 4
TASK_F_ALL = 7
POLICY_NORMAL = 0
POLICY_FIFO = 1
POLICY_RR = 2
POLICY_BATCH = 3
POLICY_IDLE = 5
POLICY_DEADLINE = 6
NICE_MIN = -20
NICE_MAX = 19
RT_PRIO_MAX = 99
WAIT_NONE = 0
WAIT_ANY = 4294967295
VCPU_UNKNOWN = 0
VCPU_RUNNING = 1
VCPU_PREEMPTED = 2
VCPU_HALTED = 3
BOOST_NONE = 0
BOOST_NICE = 1
BOOST_RT = 2

SIZEOF = {
    "pvsched_region_header": 64,
    "pvsched_slot": 128,
    "pvsched_slot_guest": 64,
    "pvsched_slot_host": 64,
}

OFFSETOF = {
    "pvsched_region_header": {
        "magic": 0,
        "version": 4,
        "nr_vcpus": 8,
        "slot_size": 12,
        "header_size": 16,
        "apic_table_offset": 20,
        "slots_offset": 24,
        "generation": 28,
        "host_flags": 32,
        "driver_features_lo": 36,
        "driver_features_hi": 40,
        "driver_version": 44,
        "reserved": 48,
    },
    "pvsched_slot": {
        "guest": 0,
        "host": 64,
    },
    "pvsched_slot_guest": {
        "seq": 0,
        "kern_cs": 4,
        "policy": 8,
        "nice": 12,
        "rt_prio": 16,
        "wait_on": 20,
        "flags": 24,
        "reserved0": 28,
        "updates": 32,
        "wakes": 40,
        "waits": 48,
        "reserved": 56,
    },
    "pvsched_slot_host": {
        "seq": 0,
        "vcpu_state": 4,
        "boost": 8,
        "boost_prio": 12,
        "throttled": 16,
        "yield_target": 20,
        "boosts": 24,
        "throttles": 32,
        "boosted_ns": 40,
        "reserved": 48,
    },
}
