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

/* Per-vCPU state, key = gid (vm_id << PVS_GID_SHIFT | slot index). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PVS_MAX_TIDS);
	__type(key, __u32);
	__type(value, struct pvs_vcpu);
} vcpus SEC(".maps");

/* vCPU thread id -> gid. Only registered threads are ever acted on. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, PVS_MAX_TIDS);
	__type(key, __u32);
	__type(value, __u32);
} tids SEC(".maps");

/* Prefilter for the scheduler tracepoints, which fire for every thread on
 * the host: element tid & (PVS_TID_HINTS - 1) counts the registered threads
 * whose tid falls there (the agent keeps it). Zero means "not registered"
 * after one inlined array load, with no hash lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, PVS_TID_HINTS);
	__type(key, __u32);
	__type(value, __u32);
} tid_hint SEC(".maps");

/* (vm_id << 32 | APIC ID) -> slot index. */
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

static __always_inline struct pvs_vcpu *vcpu_by_index(__u32 vm_id, __u32 index)
{
	__u32 gid = gid_of(vm_id, index);

	return bpf_map_lookup_elem(&vcpus, &gid);
}

#endif
