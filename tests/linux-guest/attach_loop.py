"""`pvsched attach` and `pvsched detach` on a running guest whose QEMU was
started with no pvsched device at all (QEMU 11, q35, one empty PCIe root
port, the guest's module loaded with nothing to bind to).

Real parts throughout: pvschedd (BPF policy), `pvsched attach --qmp`
(starts the sandboxed device process, which reserves the VM's region and
gets its socket owned by QEMU's user; hot-plugs vfio-user-pci over QMP;
registers the vCPU threads in device-region mode; waits for the driver's
DRIVER_OK), the guest's PCIe hot-plug driver binding and unbinding the
pvsched driver, and `pvsched detach --qmp`.

Each attach must: exit 0 saying the driver attached; leave pvschedd with
the VM in device-region mode, its vCPU threads QEMU's (query-cpus-fast)
with the APIC IDs of QEMU's topology, the guest's ABI shown; and once
the guest has switched on every CPU, every slot's seq in pvschedd's
region (mapped here the way a device process gets it) must have grown:
the guest reports through the plugged device. (The policy's boosts of
the guest's FIFO 8 loop on CPU 1 are reported, not asserted: under TCG a
vCPU thread that never leaves its host CPU gives the tracepoints nothing
to act on, so their count depends on the host's load.) Each
detach must: exit 0; leave no registration, no device in QEMU
(`qom-list /machine/peripheral`), no device process, and every vCPU
thread at its baseline (read back with sched_getscheduler,
sched_getparam and getpriority). Attaching twice and detaching twice
change nothing the second time. Last, a QEMU waiting for an incoming
migration (`-incoming defer`) gets no device: attach refuses with the
reason, and nothing is registered.
"""

import json
import subprocess
import time

from pvsched_guest import abi, daemon_region
from pvsched_guest.host import Failure, attrs
from pvsched_guest.pvschedd import Pvschedd
from pvsched_guest.qmp import qmp

VM = "attach-vm"
# RT boosts up to FIFO 10; no halt or yield boosts (TCG has no KVM
# tracepoints; what boosts is the guest's request through the device).
CAPS = "allow_rt = true\nmax_rt_prio = 10\ncs_rt_prio = 1\nhalt_boost = \"none\"\n" \
       "yield_boost = \"none\"\n"


class AttachLoop:
    def __init__(self, args, work, cycles, apic_ids):
        self.args, self.dir, self.cycles = args, work, cycles
        # The APIC IDs QEMU's topology gives the vCPUs, in cpu-index order.
        self.apic_ids = apic_ids
        # The VM's caps file, as an operator writes it.
        self.daemon = Pvschedd(args.pvschedd_bin, args.pvsched_bin, work, {VM: CAPS})
        self.socket = self.daemon.socket
        self.pvsched = self.daemon.pvsched
        self.errors = []
        self.done = 0          # attach/detach steps taken
        self.results = []      # one dict per cycle
        self.baseline = None
        self.tids = None
        self.boosts = 0
        self.seqs = []
        self.incoming_said = None

    def start_daemon(self):
        self.daemon.start()

    def stop_daemon(self):
        if not self.daemon.stop():
            self.errors.append("pvschedd did not stop on SIGTERM")

    def vm(self):
        return self.daemon.vm(VM)

    def device_pids(self):
        return self.daemon.device_pids(VM)

    def target(self, boot):
        return ["--qmp", str(boot.qmp_path), "--name", VM, "--pid", str(boot.qemu.pid)]

    def peripherals(self, boot):
        return {c["name"]: c["type"] for c in
                qmp(boot.qmp_path, "qom-list", {"path": "/machine/peripheral"})}

    def hooks(self):
        return {"attach-loaded": self.step, "attach-state": self.step}

    def step(self, boot):
        """At each guest mark: check what the guest saw of the last step,
        then take the next one and tell the guest which."""
        try:
            if self.done:
                self.check_guest(boot)
            if self.done >= 2 * self.cycles:
                self.incoming(boot)
                boot.answer("end")
                return
            if self.done % 2 == 0:
                self.attach(boot)
                boot.answer("bound")
            else:
                self.detach(boot)
                boot.answer("unbound")
            self.done += 1
        except (Failure, OSError, ValueError, KeyError, TypeError, StopIteration,
                subprocess.TimeoutExpired) as e:
            self.errors.append(f"step {self.done}: {e}")
            boot.answer("end")

    def attach(self, boot):
        cycle = self.done // 2 + 1
        cpus = sorted(qmp(boot.qmp_path, "query-cpus-fast"), key=lambda c: c["cpu-index"])
        tids = [c["thread-id"] for c in cpus]
        if self.baseline is None:
            self.tids = tids
            self.baseline = {t: attrs(t) for t in tids}
        t0 = time.monotonic()
        r = self.pvsched("attach", *self.target(boot),
                         "--supervisor", "child", "--wait-driver", "60s", "--no-emulator")
        secs = time.monotonic() - t0
        if r.returncode != 0 or "the guest driver attached" not in r.stdout:
            raise Failure(f"attach {cycle}: rc {r.returncode}: {r.stdout.strip()}")
        vm = self.vm()
        if vm is None:
            raise Failure(f"attach {cycle}: pvschedd has no VM {VM}")
        got = {"region": vm["region"], "tids": [v["tid"] for v in vm["vcpus"]],
               "guest_abi": vm.get("guest_abi")}
        want = {"region": "device", "tids": tids, "guest_abi": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"}
        if got != want:
            raise Failure(f"attach {cycle}: pvschedd has {got}, expected {want}")
        if self.peripherals(boot).get("pvsched0") != "child<vfio-user-pci>":
            raise Failure(f"attach {cycle}: QEMU has no pvsched0: {self.peripherals(boot)}")
        table = self.region_view()["apic_ids"]
        if table != self.apic_ids:
            raise Failure(f"attach {cycle}: the device's APIC ID table is {table}, QEMU's "
                          f"topology gives {self.apic_ids}")
        res = {"cycle": cycle, "attach_s": round(secs, 1), "apic": table}
        if cycle == 1:
            again = self.pvsched("attach", *self.target(boot),
                                 "--supervisor", "child", "--wait-driver", "0s")
            if again.returncode != 0 or "already attached" not in again.stdout:
                raise Failure(f"a second attach: rc {again.returncode}: {again.stdout.strip()}")
            res["again"] = again.stdout.strip()
        self.results.append(res)
        self.boosts = sum(v.get("boosts", 0) for v in vm["vcpus"])
        self.seqs = [sl["seq"] for sl in self.region_view()["slots"]]

    def check_guest(self, boot):
        fields = boot.marks["attach-state"][1] if "attach-state" in boot.marks else {}
        want = "1" if self.done % 2 == 1 else "0"
        if fields.get("bound") != want:
            raise Failure(f"step {self.done}: the guest's driver is bound={fields.get('bound')} "
                          f"(waited {fields.get('waited_ms')} ms), expected {want}")
        res = self.results[-1]
        if want == "1":
            vm = self.vm()
            res["boosts"] = sum(v.get("boosts", 0) for v in vm["vcpus"]) - self.boosts
            seqs = [sl["seq"] for sl in self.region_view()["slots"]]
            res["slot_updates"] = [b - a for a, b in zip(self.seqs, seqs)]
            if len(seqs) != len(self.seqs) or not all(b > a for a, b in zip(self.seqs, seqs)):
                raise Failure(f"attach {res['cycle']}: after every CPU switched, the slots' seq "
                              f"went {self.seqs} -> {seqs} in pvschedd's region")
        else:
            res["unbound_ms"] = int(fields.get("waited_ms", -1))

    def incoming(self, boot):
        """A QEMU waiting for an incoming migration gets no device (its
        device set must stay the source's): attach refuses, saying why,
        and registers nothing."""
        qmp_path = self.dir / "incoming.qmp"
        # A socket an earlier run left would be "there" before QEMU listens.
        qmp_path.unlink(missing_ok=True)
        q = subprocess.Popen([str(self.args.qemu11), "-nodefaults", "-display", "none",
                              "-machine", "q35", "-accel", "tcg", "-smp", "1", "-m", "64M",
                              "-device", "pcie-root-port,id=rp0,bus=pcie.0,chassis=1",
                              "-incoming", "defer", "-qmp", f"unix:{qmp_path},server=on,wait=off"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not qmp_path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            r = self.pvsched("attach", "--qmp", str(qmp_path), "--name", "incoming-vm",
                             "--pid", str(q.pid), "--supervisor", "child")
            status = json.loads(self.pvsched("status", "--json").stdout)
            names = [v["name"] for v in status["vms"]]
            if r.returncode != 1 or "incoming migration" not in r.stdout or \
                    "incoming-vm" in names:
                raise Failure(f"attach to an incoming QEMU: rc {r.returncode}: "
                              f"{r.stdout.strip()}; registered {names}")
            self.incoming_said = r.stdout.strip()
        finally:
            q.kill()
            q.wait()

    def region_view(self):
        """The region's header and each slot's guest half, as pvschedd holds
        it."""
        return daemon_region.view(self.socket, VM)

    def detach(self, boot):
        cycle = self.done // 2 + 1
        t0 = time.monotonic()
        r = self.pvsched("detach", *self.target(boot))
        secs = time.monotonic() - t0
        if r.returncode != 0 or "device pvsched0 unplugged" not in r.stdout:
            raise Failure(f"detach {cycle}: rc {r.returncode}: {r.stdout.strip()}")
        left = {"registered": self.vm() is not None,
                "plugged": "pvsched0" in self.peripherals(boot)}
        # The device process ends once QEMU lets go of it.
        deadline = time.monotonic() + 10
        while self.device_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        left["device_pids"] = self.device_pids()
        off = {t: attrs(t) for t in self.tids if attrs(t) != self.baseline[t]}
        if left != {"registered": False, "plugged": False, "device_pids": []} or off:
            raise Failure(f"detach {cycle}: left {left}, threads off their baseline {off}")
        res = self.results[-1]
        res["detach_s"] = round(secs, 1)
        if cycle == 1:
            again = self.pvsched("detach", *self.target(boot))
            if again.returncode != 0 or "nothing attached" not in again.stdout:
                raise Failure(f"a second detach: rc {again.returncode}: {again.stdout.strip()}")
