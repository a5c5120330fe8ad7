"""The guest region inside QEMU: found in QEMU's memfd RAM mapping
(`/memfd:mem (deleted)` in /proc/PID/maps; for `-machine pc` with 512M, GPA
g maps to memfd offset g) by its header, which the device wrote at
DRIVER_OK and which the device's dump reports (magic, version, nr_vcpus,
generation), at a page-aligned address. Offsets come from `abi`."""

import struct
from typing import NamedTuple

from . import abi
from .host import Failure
from .qmp import qmp

HEADER = abi.OFFSETOF["pvsched_region_header"]
# The header fields a region is recognised by, all u32 and laid out from
# offset 0 with no other field between them.
_KEY = ("magic", "version", "nr_vcpus", "slot_size", "header_size", "apic_table_offset")
_KEY_LEN = max(HEADER[f] for f in _KEY) + 4
assert sorted(HEADER[f] for f in _KEY) == list(range(0, _KEY_LEN, 4)), HEADER


def memfd_maps(pid):
    """QEMU's mappings of the memfd RAM: (start, end, file offset)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip().startswith("/memfd:mem"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16)))
    return out


def _key(magic, version, nr):
    values = {"magic": magic, "version": version, "nr_vcpus": nr, "slot_size": abi.SLOT_SIZE,
              "header_size": abi.HEADER_SIZE, "apic_table_offset": abi.APIC_TABLE_OFFSET}
    buf = bytearray(_KEY_LEN)
    for f in _KEY:
        struct.pack_into("<I", buf, HEADER[f], values[f])
    return bytes(buf)


def find_region(pid, header):
    """(QEMU virtual address, GPA) of the region whose header the device
    dumped (magic, version, nr_vcpus, generation): a page-aligned match of
    those, the slot size, header size and APIC table offset."""
    magic, version, nr, gen = header
    want = _key(magic, version, nr)
    gen_at = HEADER["generation"]
    found = []
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for start, end, off in memfd_maps(pid):
            chunk = 16 << 20
            for base in range(start, end, chunk):
                mem.seek(base)
                data = mem.read(min(chunk, end - base))
                i = data.find(want)
                while i >= 0:
                    if i % abi.PAGE_SIZE == 0 and i + gen_at + 4 <= len(data) and \
                            struct.unpack_from("<I", data, i + gen_at)[0] == gen:
                        found.append((base + i, off + (base - start) + i))
                    i = data.find(want, i + 1)
    # The same RAM may be mapped twice; the GPAs must agree.
    gpas = {g for _, g in found}
    if len(gpas) != 1:
        raise Failure(f"guest region header {header} found at {len(gpas)} GPAs: {found}")
    return found[0]


def read_u32s(pid, addr, n):
    """`n` u32 values at QEMU virtual address `addr`."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return list(struct.unpack(f"<{n}I", mem.read(4 * n)))


class GuestVcpus(NamedTuple):
    """What an agent attaches to: QEMU's vCPU threads and their slots."""
    pid: int
    hva: int
    gpa: int
    tids: list
    apic_ids: list
    slot_addrs: list


def guest_vcpus(boot, mark):
    """The vCPU threads (QMP `query-cpus-fast`) of `boot`'s QEMU and the
    addresses of their slots, in the region the device reported at
    `@@ mark`; the region's APIC table is checked against the device's
    view."""
    snap = boot.snapshots.get(mark) or {}
    if not snap.get("attached") or not snap.get("header"):
        raise Failure(f"no attached region at '@@ {mark}': {snap.get('device')}")
    pid = boot.qemu.pid
    tid_of_cpu = {c["cpu-index"]: c["thread-id"] for c in qmp(boot.qmp_path, "query-cpus-fast")}
    hva, gpa = find_region(pid, snap["header"])
    nr = snap["header"][2]
    slots_off = read_u32s(pid, hva + HEADER["slots_offset"], 1)[0]
    apic = read_u32s(pid, hva + abi.APIC_TABLE_OFFSET, nr)
    dump_apic = [s["apic_id"] for s in snap["slots"]]
    if apic != dump_apic:
        raise Failure(f"APIC table read through QEMU {apic} != device view {dump_apic}")
    # pc machine: the APIC ID of cpu-index N is N.
    tids = [tid_of_cpu[a] for a in apic]
    addrs = [hva + slots_off + abi.SLOT_SIZE * i for i in range(nr)]
    return GuestVcpus(pid, hva, gpa, tids, apic, addrs)
