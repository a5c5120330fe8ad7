"""One QEMU boot with its pvsched-device peer: the device process and QEMU
(TCG) are started and always stopped, the serial console is read for the
guest's `@@ KEY k=v...` marks, the device's slot dump is read at each mark
(its view of the region), and hooks answer the guest on its console."""

import json
import os
import re
import select
import socket
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .host import Failure, die_with_parent, kill
from .qmp import qmp

# sizeof(sockaddr_un.sun_path): a socket path and its NUL must fit (the
# device binds under a shorter temporary name beside it, so the path's own
# length is what counts).
SUN_PATH_MAX = 108

# Hooked tracepoints every tested kernel (6.1 and later) has: sched_switch,
# sched_waking, irq_handler_entry and _exit, softirq_entry and _exit, and the
# lock contention_begin and _end (Linux 5.19); init.sh enables each in two
# instances. tests/linux-guest/test_pin_list.py checks that init.sh pins
# every tracepoint the driver hooks.
PINNED_MIN = 8
# Seconds of serial output kept after a guest soft lockup is reported.
LOCKUP_REPORT_S = 15
# How many times a boot that oopsed on a stale INT3 before init ran is
# booted again: a fresh-clone CI run of 2026-11-27 had two such boots of
# the same 7.3 guest in a row, which one more boot did not cover.
EARLY_OOPS_BOOTS = 3


def log(msg):
    print(f"linux-guest: {msg}", flush=True)


def read_dump(path, newer_than=None, timeout=10.0, alive=None):
    """Reads the device's slot dump. With `newer_than` (a time.time() value),
    waits for a dump the device wrote after that moment: the dump is
    rewritten in place every ~100 ms (a half-written one fails to parse and
    is read again), its mtime is its last write time, and a dump read right
    at a console mark could predate the state the mark announces. Once
    `alive()` is false the device process has exited: its last dump, written
    at disconnect, is its final view and is returned as it is (no newer one
    can come; the mtime of a write just after `newer_than` can even read
    earlier, the kernel stamps files with its coarse clock)."""
    deadline = time.monotonic() + timeout
    while True:
        exited = alive is not None and not alive()
        try:
            p = Path(path)
            if newer_than is None or exited or p.stat().st_mtime > newer_than:
                return json.loads(p.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


class Boot:
    """One QEMU boot with its pvsched-device peer (transport "vfio-user" or
    "mpqemu"), or with no device at all (transport "none": QEMU 11, q35,
    the guest as a host without pvsched would run it).

    `args` (the script's argparse namespace) gives device_bin, vmlinuz,
    initrd, out (boot directories go in out/NAME), timeout (s per boot),
    kernel_log, verbose, qemu11 (QEMU 11 for vfio-user) and, optionally, tag
    (appended to NAME), load_append (more kernel command line) and cpu
    (QEMU's -cpu model, default "max")."""

    def __init__(self, args, name, smp, mode, fault=None, extra_append="", hooks=None,
                 transport="mpqemu", device_cmd=None, hotplug=False, mem_mib=512):
        # A matrix kernel's boots are told apart by its name: main-smp2@7.3-cloud.
        name += getattr(args, "tag", "")
        self.args, self.name, self.smp, self.mode, self.fault = args, name, smp, mode, fault
        self.transport = transport
        self.mem_mib = mem_mib
        # A PCIe root port (hot-pluggable): vfio-user puts the device behind
        # it; with no device, it stays empty for one plugged later.
        self.hotplug = hotplug
        self.dev = None
        # False once a hook took the device away: no fresh dump will come,
        # so marks after that get no snapshot (rather than a 10 s wait each).
        self.dump_live = True
        # The device program (default: --device-bin); its arguments follow.
        self.device_cmd = device_cmd or [str(args.device_bin)]
        self.extra_append = extra_append
        # mark -> callable(boot), run when the guest prints that mark; with
        # hooks QEMU gets a QMP socket and a stdin pipe the hooks can answer on.
        self.hooks = hooks or {}
        self.cleanups = []
        self.short_dir = None  # socket_path's directory, once needed
        self.qemu = None
        self.qmp_path = None
        self.dir = args.out / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dump = self.dir / "slots.json"
        self.serial = []
        self.marks = {}
        self.qemu_rc = None
        self.snapshots = {}
        # The console lines of the boots that oopsed before init ran
        # (early_int3_oops) and were booted again, oldest first.
        self.booted_again = []

    def socket_path(self, name):
        """Where the boot's unix socket `name` lives: in its work dir, or,
        when that path would not fit a unix socket address (108 bytes with
        its NUL; a deep --out or pytest's tmp_path), in a short private
        directory under /tmp, removed when the boot ends."""
        path = self.dir / name
        if len(os.fsencode(path)) < SUN_PATH_MAX:
            return path
        if self.short_dir is None:
            self.short_dir = Path(tempfile.mkdtemp(prefix="pvs-"))
            self.cleanups.append(self.remove_short_dir)
        return self.short_dir / name

    def remove_short_dir(self):
        if self.short_dir is not None:
            shutil.rmtree(self.short_dir, ignore_errors=True)
            self.short_dir = None

    def run(self):
        if self.dump.exists():
            self.dump.unlink()
        qsock, dsock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        qfd, dfd = qsock.fileno(), dsock.fileno()
        os.set_inheritable(qfd, True)
        os.set_inheritable(dfd, True)
        vfio_sock = self.socket_path("vfio-user.sock")
        if self.transport == "none":
            dev_cmd, device_arg = None, None
            qemu_bin, machine = str(self.args.qemu11), "q35"
        elif self.transport == "vfio-user":
            if vfio_sock.exists():
                vfio_sock.unlink()
            dev_cmd = self.device_cmd + ["--transport", "vfio-user", "--socket", str(vfio_sock)]
            qemu_bin, machine = str(self.args.qemu11), "q35"
            vfio_dev = {"driver": "vfio-user-pci", "id": "pvs0",
                        "socket": {"path": str(vfio_sock), "type": "unix"}}
            if self.hotplug:
                vfio_dev["bus"] = "rp0"
            device_arg = json.dumps(vfio_dev, separators=(",", ":"))
        else:
            dev_cmd = self.device_cmd + ["--transport", "mpqemu", "--fd", str(dfd)]
            qemu_bin, machine = "qemu-system-x86_64", "pc"
            device_arg = f"x-pci-proxy-dev,id=pvs0,fd={qfd}"
        if dev_cmd is not None:
            dev_cmd += ["--vcpus", str(self.smp), "--dump-slots", str(self.dump)]
            if self.fault:
                dev_cmd += ["--fault", self.fault]
        verbosity = "loglevel=7" if self.args.kernel_log else "quiet"
        # A soft lockup report shows every CPU's backtrace: the CPU that
        # is stuck is often waiting for another one.
        append = (f"console=ttyS0 panic=-1 {verbosity} softlockup_all_cpu_backtrace=1 "
                  f"pvtest={self.mode} {getattr(self.args, 'load_append', '')} "
                  f"{self.extra_append}").strip()
        qemu_cmd = [
            qemu_bin, "-name", f"pvs-{self.name},debug-threads=on", "-nodefaults",
            "-display", "none", "-machine", f"{machine},memory-backend=mem",
            "-accel", "tcg,thread=multi", "-cpu", getattr(self.args, "cpu", "max"),
            "-smp", str(self.smp),
            "-m", f"{self.mem_mib}M",
            "-object", f"memory-backend-memfd,id=mem,size={self.mem_mib}M,share=on",
            "-kernel", str(self.args.vmlinuz), "-initrd", str(self.args.initrd),
            "-append", append, "-serial", "stdio", "-no-reboot",
        ]
        if self.hotplug:
            # An empty PCIe root port: where a device can be hot-plugged.
            qemu_cmd += ["-device", "pcie-root-port,id=rp0,bus=pcie.0,chassis=1"]
        if device_arg is not None:
            qemu_cmd += ["-device", device_arg]
        # QMP for the hooks, and for the vCPU registers of a boot that
        # hangs (cpus_at_timeout).
        self.qmp_path = self.socket_path("qmp.sock")
        if self.qmp_path.exists():
            self.qmp_path.unlink()
        qemu_cmd += ["-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
        dev = qemu = None
        devlog = open(self.dir / "device.log", "w")
        t0 = self.t0 = time.monotonic()
        try:
            if dev_cmd is not None:
                dev = subprocess.Popen(dev_cmd, pass_fds=[dfd], stdout=devlog, stderr=devlog,
                                       preexec_fn=die_with_parent,
                                       env={**os.environ, "RUST_LOG": "warn"})
                self.dev = dev
            else:
                # No device: no slot dumps to wait for at the marks.
                self.dump_live = False
            if self.transport == "vfio-user":
                # The path appears once the device listens (bind + rename).
                deadline = time.monotonic() + 10
                while not vfio_sock.exists():
                    if dev.poll() is not None or time.monotonic() > deadline:
                        raise Failure(f"{self.name}: pvsched-device never listened on "
                                      f"{vfio_sock} (see {self.dir}/device.log)")
                    time.sleep(0.02)
            stdin = subprocess.PIPE if self.hooks else subprocess.DEVNULL
            qemu = subprocess.Popen(qemu_cmd, pass_fds=[qfd], stdin=stdin, preexec_fn=die_with_parent,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.qemu = qemu
            qsock.close()
            dsock.close()
            with open(self.dir / "serial.log", "w") as self.serial_file:
                self._read_serial(qemu, t0)
            t_done = time.monotonic()
            try:
                self.qemu_rc = qemu.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: QEMU still running 30 s after the guest's poweroff; killed")
            self.exit_s = time.monotonic() - t_done
            kill(qemu)
            try:
                if dev is not None:
                    dev.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            for c in self.cleanups:
                c()
            kill(qemu)
            kill(dev)
            devlog.close()
            qsock.close()
            dsock.close()
        self.seconds = time.monotonic() - t0
        if self.early_int3_oops() and len(self.booted_again) < EARLY_OOPS_BOOTS:
            first = self.dir / f"serial-oops-{len(self.booted_again) + 1}.log"
            (self.dir / "serial.log").replace(first)
            oops = next(l for l in self.serial if "Oops: int3" in l).strip()
            self.booted_again.append(oops)
            log(f"{self.name}: the guest kernel oopsed before init ran ({oops}; console in "
                f"{first}): QEMU TCG ran a stale INT3 while the kernel patched its text, "
                f"before any pvsched code was in the guest; booting it again "
                f"({len(self.booted_again)} of at most {EARLY_OOPS_BOOTS})")
            self.serial, self.marks, self.snapshots = [], {}, {}
            self.qemu_rc, self.dump_live = None, True
            return self.run()
        boot = self.marks.get("boot", (0, {}))[1]
        if boot.get("pin") == "1" and boot.get("mode") != "bench" and \
                int(boot.get("pinned", 0)) < 2 * PINNED_MIN:
            # Without the pin every load and unload patches kernel text,
            # which QEMU TCG can turn into a lockup (init.sh, pin_events).
            raise Failure(f"{self.name}: the hooked tracepoints were not pinned in two trace "
                          f"instances ({boot})")
        if self.transport == "none":
            # No device, so no dump of its state to read.
            self.final = None
            return self
        self.final = read_dump(self.dump)
        if self.final is None:
            raise Failure(f"{self.name}: the device wrote no dump (see {self.dir}/device.log)")
        return self

    def _read_serial(self, qemu, t0):
        buf = b""
        fd = qemu.stdout.fileno()
        deadline = t0 + self.args.timeout
        lockup = None
        while True:
            left = deadline - time.monotonic()
            if lockup is not None and left <= 0:
                raise GuestLockup(lockup)
            if left <= 0:
                raise Failure(f"{self.name}: timed out after {self.args.timeout}s "
                              f"(last serial lines: {self.serial[-5:]}; "
                              f"{self.cpus_at_timeout()})")
            r, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not r:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                if lockup is not None:
                    raise GuestLockup(lockup)
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode("utf-8", "replace").rstrip("\r")
                self.serial.append(text)
                self.serial_file.write(text + "\n")
                if "watchdog: BUG: soft lockup" in text and lockup is None:
                    # Keep reading for LOCKUP_REPORT_S: the report's
                    # registers and backtrace (and the other CPUs', with
                    # softlockup_all_cpu_backtrace) follow the first line.
                    lockup = (f"{self.name}: guest soft lockup after "
                              f"{time.monotonic() - t0:.0f}s: {text.strip()} "
                              f"(report in {self.dir}/serial.log)")
                    log(f"{lockup}; reading the report for {LOCKUP_REPORT_S}s")
                    deadline = min(deadline, time.monotonic() + LOCKUP_REPORT_S)
                self.serial_file.flush()
                if self.args.verbose:
                    print(f"[{self.name}] {text}", flush=True)
                m = re.match(r"^@@ (\S+)(.*)$", text)
                if m:
                    key = m.group(1)
                    fields = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
                    self.marks[key] = (time.monotonic() - t0, fields)
                    seen_at = time.time()
                    if self.dump_live:
                        self.snapshots[key] = read_dump(
                            self.dump, newer_than=seen_at,
                            alive=lambda: self.dev.poll() is None)
                    if key in self.hooks:
                        self.hooks[key](self)
                    if key == "done":
                        if lockup is not None:
                            raise GuestLockup(lockup)
                        return

    def early_int3_oops(self):
        """Whether the kernel oopsed on an INT3 before init printed its
        first mark: QEMU TCG executing a stale breakpoint while the kernel
        patches its text (GuestLockup's cause), at a time no pvsched code
        is in the guest (init loads the module after `@@ boot`) and no hook
        has run. Anything later, or any other oops, fails the boot."""
        return not self.marks and any("Oops: int3" in l for l in self.serial)

    def cpus_at_timeout(self):
        """Writes every vCPU's registers (QMP, HMP `info registers -a`) to
        cpus.txt: a guest can hang with no watchdog report at all (every
        vCPU stuck), and RIP/RFLAGS then say where."""
        path = self.dir / "cpus.txt"
        try:
            text = qmp(self.qmp_path, "human-monitor-command",
                       {"command-line": "info registers -a"})
        except (OSError, ValueError, Failure) as e:
            return f"no vCPU registers: {e}"
        path.write_text(text)
        rips = re.findall(r"RIP=([0-9a-f]+) RFL=([0-9a-f]+)", text)
        return f"vCPU RIP/RFL {rips}, registers in {path}"

    def answer(self, line="go"):
        """Sends a line to the guest's console (init.sh waits with `read`)."""
        self.qemu.stdin.write((line + "\n").encode())
        self.qemu.stdin.flush()

    def mark(self, key):
        if key not in self.marks:
            raise Failure(f"{self.name}: guest never reached '@@ {key}' (see {self.dir}/serial.log)"
                          f"{self.why_ended()}")
        return self.marks[key][1]

    def why_ended(self):
        """What the console said last, for a guest that ended early: with
        panic=-1 and -no-reboot a panic, a triple fault or an oops in the
        idle task ends QEMU at once, and a CI run keeps only the failure's
        message, not serial.log."""
        if not self.serial:
            return ""
        alarms = [l for l in self.serial if re.search(
            r"Kernel panic|Oops|BUG:|int3|general protection|Call Trace|RIP:", l)]
        shown = (alarms[:12] + ["..."] if alarms else []) + self.serial[-12:]
        last = max((t for t, _ in self.marks.values()), default=0.0)
        return (f"; QEMU exit status {self.qemu_rc}, last mark at {last:.1f}s; console:\n  "
                + "\n  ".join(l[:200] for l in shown))


class GuestLockup(Failure):
    """The guest reported a soft lockup: it will not recover before the
    timeout. The boot fails with the report (every CPU's backtrace) in its
    serial.log; it is not booted again, so a lockup the test causes is never
    hidden. The one cause seen here, QEMU TCG running a stale INT3 while the
    kernel patches its text, is kept out of the test's load/unload cycles
    (init.sh, pin_events)."""
