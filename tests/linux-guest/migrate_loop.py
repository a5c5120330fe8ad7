"""`pvsched migrate`: live migration of a guest with the pvsched device,
QEMU 11 to QEMU 11 on this host (two QEMU processes, the state over a
unix socket), with real pvschedd, the real device processes and the
guest's own driver.

The guest (`pvtest=report`) loads its module and then switches on every
CPU every 0.2 s until powered off; nothing is read from its console, so
it runs the same on whichever QEMU holds it. The source QEMU is started
with no device and given one by `pvsched attach`; each destination is
started with `-incoming unix:PATH` and no device.

Three migrations in a row (each destination the next source), each
must: exit 0; leave pvschedd with the VM registered for the destination
QEMU (its vCPU threads, as its QMP lists them; the VM file's caps;
device-region mode; the guest's ABI, so the guest's driver bound the
device plugged into the destination); every slot's seq growing in
pvschedd's region (the guest runs on the destination and reports
through its new device); the source QEMU in `postmigrate`, its vCPU
threads at their baseline and no device process left for it. Then one
migration that fails midway (the destination has a different RAM size,
so it cannot load the stream): exit 1 saying so, and the source as it
was: registered with its own threads, the device plugged, the guest's
ABI shown and its slots moving.
"""

import subprocess
import time

from attach_loop import CAPS
from pvsched_guest import abi, daemon_region
from pvsched_guest.host import Failure, attrs
from pvsched_guest.pvschedd import Pvschedd
from pvsched_guest.qmp import qmp

VM = "mig-vm"
MEM_MIB = 256
# Liveness bounds (not timing assertions).
QMP_READY_S = 20.0
REPORTING_S = 30.0


class MigrateLoop:
    def __init__(self, args, work):
        self.args, self.dir = args, work
        self.dir.mkdir(parents=True, exist_ok=True)
        self.daemon = Pvschedd(args.pvschedd_bin, args.pvsched_bin, work, {VM: CAPS})
        self.socket = self.daemon.socket
        self.pvsched = self.daemon.pvsched
        self.qemus = []
        self.results = []

    def start_daemon(self):
        self.daemon.start()

    def stop(self):
        for q in self.qemus:
            if q.poll() is None:
                q.kill()
                q.wait()
        self.daemon.stop()

    def qemu(self, n, incoming=None, mem_mib=MEM_MIB):
        """QEMU n (TCG, 2 vCPUs, memfd RAM, an empty PCIe root port, no
        device), the guest running `pvtest=report`; with `incoming`, the
        destination of a migration from that URI."""
        q = self.dir / f"qmp-{n}.sock"
        q.unlink(missing_ok=True)
        append = f"console=ttyS0 quiet pvtest=report {getattr(self.args, 'load_append', '')}"
        cmd = [str(self.args.qemu11), "-name", f"{VM}-{n},debug-threads=on", "-nodefaults",
               "-display", "none", "-machine", "q35,memory-backend=mem",
               "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", f"{mem_mib}M",
               "-object", f"memory-backend-memfd,id=mem,size={mem_mib}M,share=on",
               "-kernel", str(self.args.vmlinuz), "-initrd", str(self.args.initrd),
               "-append", append.strip(), "-serial", f"file:{self.dir / f'console-{n}.log'}",
               "-device", "pcie-root-port,id=rp1,bus=pcie.0,chassis=1",
               "-qmp", f"unix:{q},server=on,wait=off", "-no-reboot"]
        if incoming:
            cmd += ["-incoming", incoming]
        log = open(self.dir / f"qemu-{n}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=log)
        self.qemus.append(p)
        deadline = time.monotonic() + QMP_READY_S
        while not q.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise Failure(f"QEMU {n} did not open its QMP socket: "
                              f"{(self.dir / f'qemu-{n}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        p.qmp = q
        return p

    def vm(self):
        return self.daemon.vm(VM)

    def tids(self, q):
        cpus = sorted(qmp(q.qmp, "query-cpus-fast"), key=lambda c: c["cpu-index"])
        return [c["thread-id"] for c in cpus]

    def reporting(self, what):
        """Every slot's seq grows in pvschedd's region (bounded wait)."""
        a = daemon_region.seqs(self.socket, VM)
        deadline = time.monotonic() + REPORTING_S
        while True:
            b = daemon_region.seqs(self.socket, VM)
            if len(a) == len(b) and a and all(y > x for x, y in zip(a, b)):
                return [y - x for x, y in zip(a, b)]
            if time.monotonic() > deadline:
                raise Failure(f"{what}: the slots' seq went {a} -> {b} in {REPORTING_S:.0f} s")
            time.sleep(0.2)

    def device_pids(self):
        return self.daemon.device_pids(VM)

    def registered_for(self, q, what):
        vm = self.vm()
        want = {"pid": q.pid, "tids": self.tids(q), "region": "device",
                "guest_abi": f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}", "caps_source": "file"}
        got = None if vm is None else {
            "pid": vm["pid"], "tids": [v["tid"] for v in vm["vcpus"]], "region": vm["region"],
            "guest_abi": vm.get("guest_abi"), "caps_source": vm["caps_source"]}
        if got != want:
            raise Failure(f"{what}: pvschedd has {got}, expected {want}")
        plugged = {c["name"]: c["type"] for c in
                   qmp(q.qmp, "qom-list", {"path": "/machine/peripheral"})}
        if plugged.get("pvsched0") != "child<vfio-user-pci>":
            raise Failure(f"{what}: QEMU {q.pid} has no pvsched0: {plugged}")

    def run(self, migrations=3):
        src = self.qemu(0)
        # Each QEMU's thread attributes before pvsched first touches them:
        # read while the policy runs, a thread may be boosted at that
        # instant, and that is no baseline.
        baselines = {src.pid: {t: attrs(t) for t in self.tids(src)}}
        r = self.pvsched("attach", "--qmp", src.qmp, "--name", VM, "--pid", src.pid,
                         "--supervisor", "child", "--wait-driver", "120s")
        if r.returncode != 0:
            raise Failure(f"attach to the source: rc {r.returncode}: {r.stdout.strip()}")
        self.registered_for(src, "attached")
        self.reporting("attached")
        for n in range(1, migrations + 1):
            uri = f"unix:{self.dir / f'mig-{n}.sock'}"
            (self.dir / f"mig-{n}.sock").unlink(missing_ok=True)
            dst = self.qemu(n, incoming=uri)
            baselines[dst.pid] = {t: attrs(t) for t in self.tids(dst)}
            src_tids = self.tids(src)
            baseline = baselines[src.pid]
            t0 = time.monotonic()
            r = self.pvsched("migrate", "--qmp", src.qmp, "--name", VM, "--pid", src.pid,
                             "--to-qmp", dst.qmp, "--to-pid", dst.pid, "--uri", uri,
                             "--supervisor", "child", "--wait-driver", "120s")
            secs = time.monotonic() - t0
            if r.returncode != 0 or "migrated from" not in r.stdout:
                raise Failure(f"migration {n}: rc {r.returncode}: {r.stdout.strip()}")
            what = f"migration {n}"
            self.registered_for(dst, what)
            state = qmp(src.qmp, "query-status")["status"]
            off = {t: attrs(t) for t in src_tids if attrs(t) != baseline[t]}
            if state != "postmigrate" or off or len(self.device_pids()) != 1:
                raise Failure(f"{what}: source in {state!r}, threads off their baseline {off}, "
                              f"device processes {self.device_pids()} (one expected: the "
                              f"destination's)")
            grew = self.reporting(what)
            self.results.append({"n": n, "secs": round(secs, 1), "seq": grew,
                                 "said": next(l for l in r.stdout.splitlines()
                                              if "migrated from" in l)})
            src.kill()
            src.wait()
            src = dst
        # A migration that fails midway: the destination cannot load a
        # stream of another RAM size.
        n = migrations + 1
        uri = f"unix:{self.dir / f'mig-{n}.sock'}"
        (self.dir / f"mig-{n}.sock").unlink(missing_ok=True)
        bad = self.qemu(n, incoming=uri, mem_mib=MEM_MIB // 2)
        r = self.pvsched("migrate", "--qmp", src.qmp, "--name", VM, "--pid", src.pid,
                         "--to-qmp", bad.qmp, "--to-pid", bad.pid, "--uri", uri,
                         "--supervisor", "child", "--wait-driver", "120s")
        if r.returncode != 1 or "attached again" not in r.stdout:
            raise Failure(f"failing migration: rc {r.returncode}: {r.stdout.strip()}")
        state = qmp(src.qmp, "query-status")["status"]
        if state != "running":
            raise Failure(f"failing migration: the source is {state!r}, not running")
        self.registered_for(src, "failing migration")
        grew = self.reporting("failing migration")
        self.aborted = {"said": r.stdout.strip().splitlines()[-1], "seq": grew}
        r = self.pvsched("detach", "--qmp", src.qmp, "--name", VM, "--pid", src.pid)
        if r.returncode != 0:
            raise Failure(f"detach at the end: rc {r.returncode}: {r.stdout.strip()}")
