"""Another host process writing into a VM's device region (BAR2 in
device-region mode): the pvschedd region map, got the way root's device
process gets it (`{"op":"reserve"}` on pvschedd's socket, the map's fd
over SCM_RIGHTS) and mapped here, in the test process. What it writes is
garbage over the region header and over every slot's host half, once on
`corrupt()` and then every millisecond until `stop()`: what the guest
driver must survive from a host it does not trust."""

import mmap
import os
import struct
import threading

from pvsched_guest import abi
from pvsched_guest.daemon_region import reserve

HEADER = abi.OFFSETOF["pvsched_region_header"]


class ForeignWriter:
    """Maps VM `name`'s region from pvschedd at `sock_path`."""

    def __init__(self, sock_path, name):
        fd, self.length = reserve(sock_path, name)
        try:
            self.map = mmap.mmap(fd, self.length, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.header = None
        self.writes = 0
        self._stop = threading.Event()
        self._thread = None

    def u32(self, field):
        return struct.unpack_from("<I", self.map, HEADER[field])[0]

    def _garbage(self):
        # The header as the device wrote it is kept (for the slots' place);
        # everything in it becomes all ones (nr_vcpus 0xffffffff, offsets
        # far outside the region, a wrong magic), and every host half too.
        self.map[0:abi.HEADER_SIZE] = b"\xff" * abi.HEADER_SIZE
        nr, slots = self.header["nr_vcpus"], self.header["slots_offset"]
        for i in range(nr):
            host = slots + i * abi.SLOT_SIZE + abi.SLOT_SIZE // 2
            if host + abi.SLOT_SIZE // 2 <= self.length:
                self.map[host:host + abi.SLOT_SIZE // 2] = b"\xff" * (abi.SLOT_SIZE // 2)
        self.writes += 1

    def corrupt(self):
        """Writes the garbage once, then every millisecond until stop()."""
        self.header = {f: self.u32(f) for f in ("magic", "nr_vcpus", "slots_offset")}
        self._garbage()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.001):
            self._garbage()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.map.close()
