/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR MIT */
/*
 * pvsched guest/host ABI, version 1 (PVSCHED_ABI_MINOR below).
 *
 * This header is the single C definition of the ABI. It is used by the Linux
 * guest driver (guest-driver/), by the BPF policy (bpf-policy/) and, through
 * a layout test, it is checked field by field against the Rust mirror in
 * crates/pvsched-abi. docs/abi.md is the prose specification.
 *
 * Every multi-byte value is little endian. Every reserved field is written as
 * zero and ignored when read.
 *
 * Define PVSCHED_ABI_NO_TYPES before including to provide __u8/__u16/__u32/
 * __u64/__s32 yourself (BPF programs that include vmlinux.h do this).
 */
#ifndef _UAPI_PVSCHED_ABI_H
#define _UAPI_PVSCHED_ABI_H

#ifndef PVSCHED_ABI_NO_TYPES
#include <linux/types.h>
#endif

/* ------------------------------------------------------------------------ */
/* Versioning                                                                */
/* ------------------------------------------------------------------------ */

/*
 * VERSION register and region header value: (major << 16) | minor.
 * A major mismatch is refused at DRIVER_OK (PVSCHED_ERR_VERSION_MISMATCH).
 * Minor additions are announced by feature bits; old drivers ignore them.
 */
#define PVSCHED_ABI_MAJOR 1
#define PVSCHED_ABI_MINOR 6
#define PVSCHED_ABI_VERSION ((PVSCHED_ABI_MAJOR << 16) | PVSCHED_ABI_MINOR)
#define PVSCHED_VERSION_MAJOR(v) (((v) >> 16) & 0xffff)
#define PVSCHED_VERSION_MINOR(v) ((v) & 0xffff)

/* ------------------------------------------------------------------------ */
/* PCI identity                                                              */
/* ------------------------------------------------------------------------ */

/*
 * Default IDs. 0x5056 ("PV") is not a vendor ID the PCI-SIG assigned to this
 * project (it has none); it is a default for development and tests. Anyone
 * shipping the device sets their own vendor's IDs in the device configuration
 * and loads the driver with matching module parameters (docs/abi.md).
 */
#define PVSCHED_PCI_VENDOR_ID 0x5056
#define PVSCHED_PCI_DEVICE_ID 0x5c4e
#define PVSCHED_PCI_SUBSYS_VENDOR_ID 0x5056
#define PVSCHED_PCI_SUBSYS_ID 0x0001
#define PVSCHED_PCI_REVISION 0x01
/* Base class 0x08 (system peripheral), subclass 0x80 (other). */
#define PVSCHED_PCI_CLASS 0x088000

/* BAR0: register file. 32-bit non-prefetchable MMIO. */
#define PVSCHED_REG_BAR 0
#define PVSCHED_REG_BAR_SIZE 0x1000
/* BAR2: the device region (only with PVSCHED_F_DEVICE_REGION). 32-bit, prefetchable. */
#define PVSCHED_REGION_BAR 2

/* ------------------------------------------------------------------------ */
/* BAR0 register map (all registers 32 bits wide, 32-bit aligned access)    */
/* ------------------------------------------------------------------------ */

#define PVSCHED_REG_MAGIC 0x00		/* RO  PVSCHED_MAGIC */
#define PVSCHED_REG_VERSION 0x04	/* RO  PVSCHED_ABI_VERSION of the device */
#define PVSCHED_REG_DEV_FEATURES_LO 0x08 /* RO  device features, bits 0..31 */
#define PVSCHED_REG_DEV_FEATURES_HI 0x0c /* RO  device features, bits 32..63 */
#define PVSCHED_REG_DRV_FEATURES_LO 0x10 /* RW  driver features, bits 0..31 */
#define PVSCHED_REG_DRV_FEATURES_HI 0x14 /* RW  driver features, bits 32..63 */
#define PVSCHED_REG_NR_VCPUS 0x18	/* RO  number of slots in the region */
#define PVSCHED_REG_SLOT_SIZE 0x1c	/* RO  PVSCHED_SLOT_SIZE */
#define PVSCHED_REG_STATUS 0x20		/* RW  PVSCHED_STATUS_*; write 0 = reset */
#define PVSCHED_REG_ERROR 0x24		/* RO  PVSCHED_ERR_* of the last refusal */
#define PVSCHED_REG_SHM_GPA_LO 0x28	/* RW  guest region GPA, bits 0..31 */
#define PVSCHED_REG_SHM_GPA_HI 0x2c	/* RW  guest region GPA, bits 32..63 */
#define PVSCHED_REG_SHM_SIZE 0x30	/* RW  guest region size in bytes */
#define PVSCHED_REG_REGION_SIZE 0x34	/* RO  bytes the layout needs (pvsched_region_size) */
#define PVSCHED_REG_KICK 0x38		/* WO  doorbell; value = slot index */
#define PVSCHED_REG_GENERATION 0x3c	/* RO  incremented at each successful DRIVER_OK */
#define PVSCHED_REG_DRIVER_VERSION 0x40 /* RW  PVSCHED_ABI_VERSION the driver speaks */
#define PVSCHED_REG_END 0x44		/* first offset past the defined registers */

#define PVSCHED_MAGIC 0x43535650	/* "PVSC" as little-endian bytes */

/* ------------------------------------------------------------------------ */
/* Features (64 bits, split in LO/HI registers)                              */
/* ------------------------------------------------------------------------ */

#define PVSCHED_F_DEVICE_REGION (1ULL << 0) /* region is BAR2 */
#define PVSCHED_F_GUEST_REGION (1ULL << 1)  /* region is guest RAM at SHM_GPA */
#define PVSCHED_F_WAIT_ON (1ULL << 2)	    /* host honours slot.wait_on */
#define PVSCHED_F_KICK (1ULL << 3)	    /* KICK register is wired to the policy */
#define PVSCHED_F_TASK_FLAGS (1ULL << 4)    /* slot.flags describes the running task (1.1) */
#define PVSCHED_F_LOCK_WAIT (1ULL << 5)	    /* slot.wait_on may be PVSCHED_WAIT_ANY (1.2) */
#define PVSCHED_F_SYNC_COUNTS (1ULL << 6)   /* slot.wakes and slot.waits count (1.5) */
#define PVSCHED_F_ALL                                                   \
	(PVSCHED_F_DEVICE_REGION | PVSCHED_F_GUEST_REGION | PVSCHED_F_WAIT_ON | \
	 PVSCHED_F_KICK | PVSCHED_F_TASK_FLAGS | PVSCHED_F_LOCK_WAIT |       \
	 PVSCHED_F_SYNC_COUNTS)

/* ------------------------------------------------------------------------ */
/* STATUS (virtio device status bits and values)                             */
/* ------------------------------------------------------------------------ */

#define PVSCHED_STATUS_RESET 0x00
#define PVSCHED_STATUS_ACKNOWLEDGE 0x01
#define PVSCHED_STATUS_DRIVER 0x02
#define PVSCHED_STATUS_DRIVER_OK 0x04
#define PVSCHED_STATUS_FEATURES_OK 0x08
#define PVSCHED_STATUS_DEVICE_NEEDS_RESET 0x40
#define PVSCHED_STATUS_FAILED 0x80

/* ------------------------------------------------------------------------ */
/* ERROR codes (why the device refused; cleared by reset)                    */
/* ------------------------------------------------------------------------ */

#define PVSCHED_ERR_NONE 0
#define PVSCHED_ERR_BAD_SEQUENCE 1	    /* status bit set out of order */
#define PVSCHED_ERR_FEATURES_UNSUPPORTED 2  /* driver asked for a bit not offered */
#define PVSCHED_ERR_NO_REGION_MODE 3	    /* not exactly one region mode selected */
#define PVSCHED_ERR_VERSION_MISMATCH 4	    /* DRIVER_VERSION major != device major */
#define PVSCHED_ERR_REGION_ZERO_SIZE 5	    /* SHM_SIZE is 0 */
#define PVSCHED_ERR_REGION_UNALIGNED 6	    /* GPA or size not 4 KiB aligned */
#define PVSCHED_ERR_REGION_WRAPS 7	    /* GPA + size overflows 64 bits */
#define PVSCHED_ERR_REGION_OUTSIDE_RAM 8    /* not wholly inside one RAM range */
#define PVSCHED_ERR_REGION_TOO_SMALL 9	    /* size < REGION_SIZE */
#define PVSCHED_ERR_REGION_CHANGED 10	    /* SHM_* written after DRIVER_OK */
#define PVSCHED_ERR_REGION_UNMAPPED 11	    /* device region: BAR2 not decoded */
#define PVSCHED_ERR_REGION_UNAVAILABLE 12   /* device region: no backing memory */
#define PVSCHED_ERR_DEVICE_FAILED 13	    /* device back end gone; reset to retry */
#define PVSCHED_ERR_MAX 13

/* ------------------------------------------------------------------------ */
/* Region layout                                                             */
/* ------------------------------------------------------------------------ */

#define PVSCHED_REGION_MAGIC 0x52535650 /* "PVSR" as little-endian bytes */
#define PVSCHED_MAX_VCPUS 1024
#define PVSCHED_CACHELINE 64
#define PVSCHED_PAGE_SIZE 4096
#define PVSCHED_SLOT_SIZE 128
#define PVSCHED_HEADER_SIZE 64
/* The APIC-ID table starts right after the header. */
#define PVSCHED_APIC_TABLE_OFFSET PVSCHED_HEADER_SIZE

/* Region header, written by the device at DRIVER_OK; read-only for the guest. */
struct pvsched_region_header {
	__u32 magic;		 /* PVSCHED_REGION_MAGIC */
	__u32 version;		 /* PVSCHED_ABI_VERSION */
	__u32 nr_vcpus;		 /* slots in this region */
	__u32 slot_size;	 /* PVSCHED_SLOT_SIZE */
	__u32 header_size;	 /* PVSCHED_HEADER_SIZE */
	__u32 apic_table_offset; /* byte offset of __u32 apic_id[nr_vcpus] */
	__u32 slots_offset;	 /* byte offset of slot 0 (64-byte aligned) */
	__u32 generation;	 /* == GENERATION register at attach */
	__u32 host_flags;	 /* PVSCHED_HOST_F_* */
	__u32 driver_features_lo; /* features the driver set at FEATURES_OK (1.3) */
	__u32 driver_features_hi;
	__u32 driver_version;	 /* DRIVER_VERSION the driver wrote (1.6) */
	__u32 reserved[4];
};

/* header.host_flags */
#define PVSCHED_HOST_F_POLICY_ACTIVE (1U << 0) /* a host policy reads the slots */

/* Guest half of a slot: kern_cs bits. */
#define PVSCHED_CS_NMI (1U << 0)
#define PVSCHED_CS_HARDIRQ (1U << 1)
#define PVSCHED_CS_SOFTIRQ (1U << 2)
#define PVSCHED_CS_PREEMPT_OFF (1U << 3)
#define PVSCHED_CS_ALL \
	(PVSCHED_CS_NMI | PVSCHED_CS_HARDIRQ | PVSCHED_CS_SOFTIRQ | PVSCHED_CS_PREEMPT_OFF)

/* Guest half: policy values (Linux SCHED_* numbering). */
#define PVSCHED_POLICY_NORMAL 0
#define PVSCHED_POLICY_FIFO 1
#define PVSCHED_POLICY_RR 2
#define PVSCHED_POLICY_BATCH 3
#define PVSCHED_POLICY_IDLE 5
#define PVSCHED_POLICY_DEADLINE 6

#define PVSCHED_NICE_MIN (-20)
#define PVSCHED_NICE_MAX 19
#define PVSCHED_RT_PRIO_MAX 99

/* Guest half: flags bits (with PVSCHED_F_TASK_FLAGS; 0 otherwise). */
#define PVSCHED_TASK_F_KTHREAD (1U << 0) /* the running task is a kernel thread */
#define PVSCHED_TASK_F_IDLE (1U << 1)	 /* the CPU runs its idle task (1.2) */
/* With TASK_F_IDLE: policy, nice and rt_prio are those of the user RT task
 * this CPU ran last, asleep until it runs here again (1.4). */
#define PVSCHED_TASK_F_RT_SLEEPER (1U << 2)
#define PVSCHED_TASK_F_ALL \
	(PVSCHED_TASK_F_KTHREAD | PVSCHED_TASK_F_IDLE | PVSCHED_TASK_F_RT_SLEEPER)

/* wait_on: slot index + 1 of the vCPU this vCPU waits for; 0 = not waiting. */
#define PVSCHED_WAIT_NONE 0
/*
 * wait_on, with PVSCHED_F_LOCK_WAIT (1.2): this vCPU spins on a contended
 * lock; the holder is some other vCPU of this VM, which one is not known.
 */
#define PVSCHED_WAIT_ANY 0xffffffffU

/* Guest-written half: one cache line, only the guest writes it. */
struct pvsched_slot_guest {
	__u32 seq;	/* odd while the guest writes; see docs/abi.md */
	__u32 kern_cs;	/* PVSCHED_CS_* */
	__u32 policy;	/* PVSCHED_POLICY_* of the running task */
	__s32 nice;	/* -20..19 (SCHED_NORMAL/BATCH/IDLE) */
	__u32 rt_prio;	/* 1..99 (FIFO/RR), else 0 */
	__u32 wait_on;	/* slot index + 1, PVSCHED_WAIT_NONE or _ANY */
	__u32 flags;	/* PVSCHED_TASK_F_* with F_TASK_FLAGS, else 0 */
	__u32 reserved0;
	__u64 updates;	/* number of completed updates (informational) */
	/* With F_SYNC_COUNTS (1.5), counters since the driver attached, each
	 * written by this vCPU alone, as single stores that may fall outside
	 * an update's seq (a host reads them as hints): */
	__u64 wakes;	/* wake-ups of a task that last ran on another vCPU */
	__u64 waits;	/* waits for another vCPU: wait_on set (calls, lock spins) */
	__u32 reserved[2];
};

/* Host half: vcpu_state values. */
#define PVSCHED_VCPU_UNKNOWN 0
#define PVSCHED_VCPU_RUNNING 1
#define PVSCHED_VCPU_PREEMPTED 2
#define PVSCHED_VCPU_HALTED 3

/* Host half: boost values. */
#define PVSCHED_BOOST_NONE 0
#define PVSCHED_BOOST_NICE 1
#define PVSCHED_BOOST_RT 2

/* Host-written half: one cache line, only the host writes it. */
struct pvsched_slot_host {
	__u32 seq;	    /* same protocol as the guest half, host as writer */
	__u32 vcpu_state;   /* PVSCHED_VCPU_* */
	__u32 boost;	    /* PVSCHED_BOOST_* currently applied */
	__s32 boost_prio;   /* RT priority, or nice value, of the boost */
	__u32 throttled;    /* 1 while the vCPU is throttled */
	__u32 yield_target; /* directed-yield slot: slot index + 1, or 0 */
	__u64 boosts;	    /* boosts applied since attach */
	__u64 throttles;    /* throttles since attach */
	__u64 boosted_ns;   /* total time spent boosted */
	__u32 reserved[4];
};

/* A per-vCPU slot: two cache lines, one per writer. */
struct pvsched_slot {
	struct pvsched_slot_guest guest;
	struct pvsched_slot_host host;
};

/* Byte offset of slot 0 for a region of nr_vcpus slots. */
static inline __u32 pvsched_slots_offset(__u32 nr_vcpus)
{
	__u32 end = PVSCHED_APIC_TABLE_OFFSET + 4 * nr_vcpus;

	return (end + PVSCHED_CACHELINE - 1) & ~(__u32)(PVSCHED_CACHELINE - 1);
}

/* Bytes a region of nr_vcpus slots needs (REGION_SIZE register). */
static inline __u32 pvsched_region_size(__u32 nr_vcpus)
{
	__u32 end = pvsched_slots_offset(nr_vcpus) + PVSCHED_SLOT_SIZE * nr_vcpus;

	return (end + PVSCHED_PAGE_SIZE - 1) & ~(__u32)(PVSCHED_PAGE_SIZE - 1);
}

#endif /* _UAPI_PVSCHED_ABI_H */
