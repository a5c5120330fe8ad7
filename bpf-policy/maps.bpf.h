/* SPDX-License-Identifier: GPL-2.0 */
/* pvsched BPF policy: maps shared by every program (one definition). */
#ifndef PVSCHED_MAPS_BPF_H
#define PVSCHED_MAPS_BPF_H

/* Per-VM configuration, key = vm_id. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PVS_MAX_VMS);
	__type(key, __u32);
	__type(value, struct pvs_vm);
} vms SEC(".maps");

/* Per-thread state (vCPUs, then emulator threads), key = vcpu_key(): an
 * array, so every lookup is inlined (no hash, no call). Elements of threads
 * that are not registered are all zeros and no event reaches them (the
 * `tids`/`tid_hint` lookups and an inactive VM turn them away). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	/* The agent reads every thread's boost each tick from a mapping of
	 * the array, with no system call. */
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, PVS_MAX_TIDS);
	__type(key, __u32);
	__type(value, struct pvs_vcpu);
} vcpus SEC(".maps");

/* vCPU thread id -> gid, for every registered thread. Only registered
 * threads are ever acted on. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PVS_MAX_TIDS);
	__type(key, __u32);
	__type(value, __u32);
} tids SEC(".maps");

/* Prefilter for the scheduler tracepoints, which fire for every thread on
 * the host, and cache of `tids` (struct pvs_tid_hint, kept by the agent): a
 * zero count means "not registered" after one inlined array load; a
 * registered thread alone in its element is found with no hash lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PVS_TID_HINTS);
	__type(key, __u32);
	__type(value, struct pvs_tid_hint);
} tid_hint SEC(".maps");

/* Element vm_id * PVS_APIC_FAST + APIC ID: slot index + 1 (0 = none), for
 * APIC IDs below PVS_APIC_FAST (every VMM numbers its vCPUs from 0), looked
 * up with no hash. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PVS_MAX_VMS * PVS_APIC_FAST);
	__type(key, __u32);
	__type(value, __u32);
} apic_fast SEC(".maps");

/* (vm_id << 32 | APIC ID) -> slot index, for APIC IDs from PVS_APIC_FAST. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PVS_MAX_TIDS);
	__type(key, __u64);
	__type(value, __u32);
} apics SEC(".maps");

/* Device-region mode: each VM's region (header, APIC table, slots) is its
 * own one-element mmapable array; element vm_id of `regions` holds it. The
 * agent creates the inner map at registration, mmaps it (offset 0) and hands
 * its fd only to that VM's VMM, which registers the mapping as BAR2's
 * memslot: no VMM can see another VM's region. */
struct pvs_region_map {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	/* Sizes, not BTF types: a 16 KiB value type would only be a
	 * forward declaration in the object's BTF. */
	__uint(key_size, sizeof(__u32));
	__uint(value_size, PVS_REGION_STRIDE);
};
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, PVS_MAX_VMS);
	__type(key, __u32);
	__array(values, struct pvs_region_map);
} regions SEC(".maps");

/* What runs on each CPU and which phased vCPU left it for a host thread
 * (struct pvs_cpu), key = CPU number: a wakeup on one CPU reads the entry of
 * the CPU its task was placed on. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PVS_MAX_CPUS);
	__type(key, __u32);
	__type(value, struct pvs_cpu);
} cpus SEC(".maps");

/* Decisions for the agent's applier. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} decisions SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pvs_stats);
} stats SEC(".maps");

static __always_inline struct pvs_stats *stats_get(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&stats, &zero);
}

/* Program `prog` (PVS_PROG_*) took its full path. */
static __always_inline void count_full(__u32 prog)
{
	struct pvs_stats *s = stats_get();

	if (s && prog < PVS_PROG_MAX)
		s->full_runs[prog]++;
}

#define STAT_INC(field)                                  \
	do {                                             \
		struct pvs_stats *__s = stats_get();     \
		if (__s)                                 \
			__s->field++;                    \
	} while (0)

static __always_inline __u32 gid_of(__u32 vm_id, __u32 index)
{
	return (vm_id << PVS_GID_SHIFT) | index;
}

/*
 * Low word of the features the VM's driver negotiated, from the header of
 * its device region (ABI 1.3). 0 when unknown: a 1.2 device, a region not
 * attached, or guest-region mode, where the header is readable only in a
 * vCPU thread's own context. The guest can overwrite it, so it selects
 * only between behaviours the VM's caps allow.
 */
static __always_inline __u32 driver_features(__u32 vm_id, const struct pvs_vm *vm)
{
	__u32 key = vm_id, zero = 0;
	struct pvsched_region_header *h;
	void *inner;

	if (vm->mode != PVS_MODE_DEVICE)
		return 0;
	inner = bpf_map_lookup_elem(&regions, &key);
	if (!inner)
		return 0;
	h = bpf_map_lookup_elem(inner, &zero);
	return h ? READ_ONCE(h->driver_features_lo) : 0;
}

/*
 * Whether VM `vm_id` pairs kicks (caps.kick_pairs): always, or (auto) when
 * its guest negotiated a region but not F_WAIT_ON. Such a guest (Linux <
 * 6.3 has no csd tracepoints) cannot say whom a synchronous call waits
 * for, so a kick is the host's only sign of the pair.
 */
static __always_inline int kick_pairs_vm(__u32 vm_id, const struct pvs_vm *vm)
{
	__u32 f;

	if (vm->caps.kick_pairs == PVS_KICK_ON)
		return 1;
	if (vm->caps.kick_pairs != PVS_KICK_AUTO)
		return 0;
	f = driver_features(vm_id, vm);
	return (f & (PVSCHED_F_DEVICE_REGION | PVSCHED_F_GUEST_REGION)) &&
	       !(f & PVSCHED_F_WAIT_ON);
}

/*
 * The sched_wakeup program's gate for the waker's KICK event, in two steps
 * from the cheapest: kick_vm() gives VM `vm_id` if it may pair kicks at all
 * (one map lookup: "off" ends here), then kick_sender_counts() says, for a
 * waker `s` of that VM, whether its kick can count. With "auto" only a
 * boosted sender's kick counts (kick_record()): an unboosted one's wake-ups
 * (every hand-over between a batch guest's vCPU threads) skip the whole
 * event and the region lookups kick_pairs_vm() makes, as with "off"; the
 * waker's own next event charges and re-reads its slot as it would anyway.
 */
static __always_inline struct pvs_vm *kick_vm(__u32 vm_id)
{
	struct pvs_vm *vm = bpf_map_lookup_elem(&vms, &vm_id);

	return vm && vm->caps.kick_pairs != PVS_KICK_OFF ? vm : NULL;
}

static __always_inline int kick_sender_counts(const struct pvs_vcpu *s, const struct pvs_vm *vm)
{
	if (vm->caps.kick_pairs == PVS_KICK_AUTO && READ_ONCE(s->boost) == PVSCHED_BOOST_NONE)
		return 0;
	return kick_pairs_vm(s->vm_id, vm);
}

/* The `vcpus` key of thread `index` of VM `vm_id` (both in range). */
static __always_inline __u32 vcpu_key(__u32 vm_id, __u32 index)
{
	return vm_id * PVS_THREADS_PER_VM + index;
}

/* Thread `index` of VM `vm_id`, or NULL when either is out of range. */
static __always_inline struct pvs_vcpu *vcpu_by_index(__u32 vm_id, __u32 index)
{
	__u32 key;

	if (vm_id >= PVS_MAX_VMS || index >= PVS_THREADS_PER_VM)
		return NULL;
	key = vcpu_key(vm_id, index);
	return bpf_map_lookup_elem(&vcpus, &key);
}

static __always_inline struct pvs_vcpu *vcpu_by_gid(__u32 gid)
{
	return vcpu_by_index(gid >> PVS_GID_SHIFT, gid & ((1U << PVS_GID_SHIFT) - 1));
}

#endif
