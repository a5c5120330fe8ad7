"""Policy on a QEMU guest in device-region mode, with pvschedd's region as BAR2.

The operator's path, end to end: pvschedd runs; `pvsched device
--transport vfio-user --daemon-region NAME` reserves VM NAME's region with
pvschedd before QEMU starts and serves that BPF array map as BAR2 (QEMU
11's vfio-user-pci mmaps it into the guest); the Linux guest driver binds
in device-region mode and writes its slots there; once the vCPU threads
exist, `pvsched qemu-attach --device-region` registers them with that
region. The BPF policy then reads the slots where the guest writes them
(no copy, no slot addresses, no bpf_probe_read_user), and the vCPU thread
of the guest CPU running a SCHED_FIFO 8 loop is boosted to SCHED_FIFO 8
and restored to its exact baseline, read back with sched_getscheduler /
sched_getparam / getpriority every millisecond (the sampler and the
checks of agent_loop.py). `pvsched vm unregister NAME` ends it; after it
every vCPU thread is at its baseline.

Host-side evidence that BAR2 is the BPF map: QEMU's own mapping of BAR2
is `anon_inode:bpf-map` in /proc/QEMU_PID/maps.
"""

import json
import os

from agent_loop import BASE_NICE, CAPS, AgentFailure, AgentLoop, Sampler
from pvsched_guest import abi
from pvsched_guest.host import Failure, attrs
from pvsched_guest.pvschedd import Pvschedd
from pvsched_guest.qmp import qmp

VM_NAME = "linux-guest"


def bpf_map_mappings(pid):
    """QEMU's mappings of BPF maps: [(start, end)]."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == "anon_inode:bpf-map":
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end))
    return out


class DaemonLoop(AgentLoop):
    """Hooks for a `pvtest=agent` boot whose device serves pvschedd's
    region (see the module docstring). Start the daemon with start_daemon()
    before the boot; device_cmd() is the device command line."""

    def __init__(self, args, boot_dir):
        super().__init__(args, boot_dir)
        self.pvschedd = Pvschedd(args.pvschedd_bin, args.pvsched_bin, self.dir,
                                 {VM_NAME: CAPS}, require_vm_file=True)
        self.socket = self.pvschedd.socket
        self.bpf_maps = []

    def pvsched(self, *argv, check=True):
        r = self.pvschedd.pvsched(*argv, timeout=30)
        if check and r.returncode != 0:
            raise AgentFailure(f"pvsched {' '.join(argv)}: rc {r.returncode}: {r.stdout.strip()}")
        return r

    def start_daemon(self):
        try:
            self.pvschedd.start()
        except Failure as e:
            raise AgentFailure(str(e)) from e

    def stop_daemon(self):
        if not self.pvschedd.stop():
            self.errors.append("pvschedd did not stop on SIGTERM")

    def device_cmd(self):
        """`pvsched device` with BAR2 = pvschedd's region for VM_NAME."""
        return [str(self.args.pvsched_bin), "device", "--daemon-region", VM_NAME,
                "--daemon-socket", str(self.socket)]

    def _attach(self, boot):
        pid = boot.qemu.pid
        snap = boot.snapshots.get("agent-wait") or {}
        if not snap.get("attached") or not snap.get("header"):
            raise AgentFailure(f"no attached region at '@@ agent-wait': {snap.get('device')}")
        self.bpf_maps = bpf_map_mappings(pid)
        cpus = qmp(boot.qmp_path, "query-cpus-fast")
        tids = [c["thread-id"] for c in sorted(cpus, key=lambda c: c["cpu-index"])]
        for t in tids:
            os.setpriority(os.PRIO_PROCESS, t, BASE_NICE)
        self.baseline = {t: attrs(t) for t in tids}
        r = self.pvsched("qemu-attach", "--qmp", str(boot.qmp_path), "--name", VM_NAME,
                         "--pid", str(pid), "--device-region", "--no-emulator")
        status = json.loads(self.pvsched("status", "--json").stdout)
        vm = next((v for v in status["vms"] if v["name"] == VM_NAME), None)
        if vm is None:
            raise AgentFailure(f"qemu-attach succeeded but pvschedd has no VM {VM_NAME}: {status}")
        got = [v["tid"] for v in vm["vcpus"]]
        if got != tids:
            raise AgentFailure(f"registered vCPU threads {got} != QMP's {tids}")
        # pc/q35 with -smp N: the APIC ID of cpu-index N is N.
        apic = list(range(len(tids)))
        self.info = {"qemu_pid": pid, "tids": tids, "apic_ids": apic, "region": vm["region"],
                     "guest_abi": vm.get("guest_abi"),
                     "bar2_bpf_maps": [hex(e - s) for s, e in self.bpf_maps],
                     "qemu_attach": r.stdout.strip()}
        self.rc = None
        self.agent = self
        self.sampler = Sampler(tids, boot.t0)
        self.sampler.start()

    # AgentLoop calls these on self.agent: the daemon registration stands in
    # for the pvsched-agent-attach process.
    def poll(self):
        return self.rc

    def stop_agent(self):
        if self.agent is None or self.rc is not None:
            return
        try:
            status = json.loads(self.pvsched("status", "--json").stdout)
            vm = next(v for v in status["vms"] if v["name"] == VM_NAME)
            self.stats = {"vcpus": vm["vcpus"], "decisions": vm["decisions"]}
            self.rc = self.pvsched("vm", "unregister", VM_NAME, check=False).returncode
        except (AgentFailure, StopIteration, ValueError, KeyError) as e:
            self.errors.append(f"reading or ending the registration: {e}")
            self.rc = -1

    def check(self, boot):
        f, summary = super().check(boot)
        f = [x.replace("pvsched-agent-attach exited with", "`pvsched vm unregister` exited with")
             for x in f]
        if not self.bpf_maps:
            f.append("daemon: QEMU has no anon_inode:bpf-map mapping: BAR2 is not pvschedd's region")
        if self.info.get("region") != "device":
            f.append(f"daemon: VM registered with region {self.info.get('region')}, not device")
        # The attached driver's ABI, as the device copied it into the header.
        want = f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"
        if self.info.get("guest_abi") != want:
            f.append(f"daemon: status shows guest ABI {self.info.get('guest_abi')!r}, "
                     f"the driver speaks {want}")
        summary = summary.replace("agent:", "daemon:", 1).replace("agent rc", "unregister rc")
        return f, summary
