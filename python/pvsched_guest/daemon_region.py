"""A VM's device region as pvschedd holds it (device-region mode: the BPF
array map the guest's BAR2 maps), read from the host the way a device
process gets it: a `{"op":"reserve"}` request on pvschedd's socket, the
map's fd over SCM_RIGHTS (root only). Offsets come from `abi`."""

import array
import json
import mmap
import os
import socket
import struct

from . import abi


def reserve(sock_path, name):
    """(fd, length) of VM `name`'s region from pvschedd at `sock_path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(str(sock_path))
        s.send(json.dumps({"op": "reserve", "name": name}).encode())
        fds = array.array("i")
        msg, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_LEN(4 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        reply = json.loads(msg)
        if reply.get("reply") != "reserved" or not fds:
            raise RuntimeError(f"reserve {name}: {reply}")
        return fds[0], reply["region_len"]
    finally:
        s.close()


def view(sock_path, name):
    """VM `name`'s region: its header, APIC ID table and each slot's
    guest half (the u32 fields)."""
    fd, length = reserve(sock_path, name)
    try:
        m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        hdr = {k: struct.unpack_from("<I", m, o)[0]
               for k, o in abi.OFFSETOF["pvsched_region_header"].items() if k != "reserved"}
        nr = min(hdr["nr_vcpus"], 64)
        apic = [struct.unpack_from("<I", m, hdr["apic_table_offset"] + 4 * i)[0]
                for i in range(nr)]
        slots = []
        for i in range(nr):
            base = hdr["slots_offset"] + i * abi.SLOT_SIZE
            slots.append({k: struct.unpack_from("<I", m, base + o)[0]
                          for k, o in abi.OFFSETOF["pvsched_slot_guest"].items() if o < 32})
    finally:
        m.close()
    return {"header": hdr, "apic_ids": apic, "slots": slots}


def seqs(sock_path, name):
    """Each slot's guest seq in VM `name`'s region."""
    return [sl["seq"] for sl in view(sock_path, name)["slots"]]
