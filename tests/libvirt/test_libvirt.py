"""The libvirt hook under a real libvirtd (Debian's 9.0, scripts/setup.d/48-libvirt.sh).

A real pvschedd (root, BPF) with its own socket, state and caps
directories under the test's directory and a `[max]` (max_rt_prio = 5);
a real libvirtd, started here by hand (PID 1 is not systemd on these
machines) in a private mount namespace whose /etc/libvirt is a copy of
the host's with only the shipped hook (dist/libvirt/qemu.d/pvsched as
/etc/libvirt/hooks/qemu.d/pvsched) and whose /etc/pvsched holds the hook's
settings (libvirt runs hooks with a scrubbed environment): nothing of the
host's /etc changes, and both vanish with libvirtd. libvirtd defines and
starts domains on QEMU 11.1 (TCG, 2 vCPUs, 64 MiB, no disk: SeaBIOS finds
nothing to boot and idles) with the pvsched device (`pvsched device
--transport vfio-user`, sandboxed, device-region mode) passed through
`<qemu:commandline>` as `-device vfio-user-pci`, and pvsched's
`<metadata>`:

    <pvsched:vm xmlns:pvsched="https://pvsched.dev/xmlns/libvirt/1" region="device">
      <pvsched:caps max_rt_prio="3" halt_boost="nice"/>
    </pvsched:vm>

The test shows that the hook registers the domain when libvirt has
started it, with its vCPU threads from libvirt's own monitor (the same as
`virsh qemu-monitor-command DOMAIN query-cpus-fast` and libvirt's status
XML say), with the metadata's caps and BAR2 backed by pvschedd's region;
that it is unregistered when the domain is destroyed (SIGTERM then SIGKILL
by libvirt), destroyed gracefully (SIGTERM only) and when QEMU is
SIGKILLed behind libvirt's back (pvschedd watches QEMU's pidfd), over
start/destroy cycles; that caps above pvschedd's [max] are refused (the
domain runs, unregistered) and a domain without the metadata is left
alone. The guest has no OS, so no driver asks for a boost, and under TCG no KVM
tracepoint fires for QEMU's vCPU threads: the guest is never boosted, and
the test checks that every vCPU thread stays at its baseline while
registered (sampled with sched_getscheduler/getparam/getpriority).

Two things of this host are worked around, in libvirtd's namespace only:
QEMU 11 runs uninstalled (scripts/setup.d/41-qemu11.sh), so its emulator
wrapper here gives it a module directory of its own (qemu11_modules), and
/dev/kvm is hidden from this libvirtd (QEMU cannot use this host's KVM,
and libvirt would probe every QEMU again at each start; see
Env.start_libvirtd), which takes libvirt's per-domain /dev namespace
(`namespaces = []`).

Run alone (as root, after scripts/setup):

    /usr/bin/python3 -B -m pytest -v tests/libvirt

Every wait is bounded (a liveness bound, not a timing assertion); every
domain, libvirtd, device process and pvschedd started here is stopped in
a finalizer, and gets SIGKILL if pytest itself dies.
"""

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from pvsched_guest import abi, daemon_region
from pvsched_guest.host import attrs, die_with_parent, kill
from pvsched_guest.host import wait_for as host_wait_for
from pvsched_guest.kernel import build_initramfs, build_module, guest_kabi, kernel_tree
from pvsched_guest.pvschedd import device_pids

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "dist" / "libvirt" / "qemu.d" / "pvsched"
NS = "https://pvsched.dev/xmlns/libvirt/1"
URI = "qemu:///system"
LIBVIRT_RUN = Path("/run/libvirt/qemu")
LIBVIRT_SOCK = Path("/run/libvirt/libvirt-sock")
# QEMU 7.2's modules, which QEMU 11 would otherwise find and crash on.
SYSTEM_QEMU_MODULES = Path("/usr/lib/x86_64-linux-gnu/qemu")
VCPUS = 2
MAX_RT_PRIO = 5  # pvschedd.toml [max]
CAPS = {"max_rt_prio": 3, "halt_boost": "nice"}  # the domain's <pvsched:caps>
CYCLES = 3
# Liveness bound of every wait (not a timing assertion).
WAIT_S = 40
SAMPLES = 50  # scheduling attributes read per vCPU thread per cycle
SAMPLE_GAP_S = 0.01
SCHED_OTHER = 0


def wait_for(what, probe, procs=(), timeout=WAIT_S, interval=0.05):
    """host.wait_for with this test's bound and polling interval."""
    return host_wait_for(what, probe, procs, timeout, interval)


def virsh(*args, check=True, timeout=60):
    r = subprocess.run(["virsh", "-q", "-c", URI, *map(str, args)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and r.returncode != 0:
        pytest.fail(f"virsh {' '.join(map(str, args))} failed ({r.returncode}): {r.stdout}")
    return r.stdout.strip()


def libvirt_answers():
    """Whether a libvirtd serves /run/libvirt/libvirt-sock."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(LIBVIRT_SOCK))
            return True
        except OSError:
            return False


def qemu11_modules(cache, moddir):
    """A module directory for QEMU 11: its own modules, and an empty file
    for every module name only QEMU 7.2 has. QEMU looks for a module in
    $QEMU_MODULE_DIR, then in its built-in directory, the host's QEMU 7.2
    ones: loading one of those (libvirt's capability probe lists every QOM
    type, which loads every module) aborts QEMU 11. An empty file stops the
    search with a harmless 'file too short'."""
    own = cache / "qemu11" / "root" / "usr" / "lib" / "x86_64-linux-gnu" / "qemu"
    moddir.mkdir(parents=True, exist_ok=True)
    for f in moddir.iterdir():
        f.unlink()
    names = {p.name for p in own.glob("*.so")}
    for n in names:
        (moddir / n).symlink_to(own / n)
    for p in SYSTEM_QEMU_MODULES.glob("*.so"):
        if p.name not in names:
            (moddir / p.name).write_bytes(b"")


def write_if_changed(path, text, mode):
    """Writes `text` only if it differs: libvirt keeps an emulator's
    probed capabilities while the file is unchanged."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    path.chmod(mode)


def domain_xml(name, emulator, vfio_sock=None, metadata=None, guest=None, root_port=False):
    """A 2-vCPU, diskless q35 domain on QEMU 11 (TCG) with guest RAM in a
    shared memfd (the vfio-user device maps it), the pvsched device at
    vfio_sock and `metadata` in <metadata>; 64 MiB and no OS (SeaBIOS
    idles), or with `guest` (its vmlinuz, initrd and kernel command line)
    256 MiB and that Linux guest, its console in a file. `root_port`: an
    empty PCIe root port, where `pvsched attach` hot-plugs the device.
    <acpi/>: without it libvirt 9.0 passes -no-acpi, which QEMU 11 no
    longer has."""
    meta = f"<metadata>{metadata}</metadata>" if metadata else ""
    cmdline = ""
    if vfio_sock:
        dev = json.dumps({"driver": "vfio-user-pci", "id": "pvs0",
                          "socket": {"path": str(vfio_sock), "type": "unix"}},
                         separators=(",", ":")).replace('"', "&quot;")
        cmdline = (f"<qemu:commandline><qemu:arg value='-device'/>"
                   f"<qemu:arg value='{dev}'/></qemu:commandline>")
    boot, mem, serial = "<bios rebootTimeout='-1'/>", 64, ""
    if guest is not None:
        boot = (f"<kernel>{guest.vmlinuz}</kernel><initrd>{guest.initrd}</initrd>"
                f"<cmdline>{guest.append}</cmdline>")
        mem = 256
        serial = (f"<serial type='file'><source path='{guest.console(name)}'/>"
                  f"<target port='0'/></serial>")
    port = "<controller type='pci' index='1' model='pcie-root-port'/>" if root_port else ""
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{name}</name>
  {meta}
  <memory unit='MiB'>{mem}</memory>
  <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>
  <vcpu>{VCPUS}</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type>{boot}</os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <devices>
    <emulator>{emulator}</emulator>
    <controller type='usb' model='none'/>
    {port}
    {serial}
    <memballoon model='none'/>
  </devices>
  {cmdline}
</domain>
"""


# A flavor with a caps file in the hook's flavor directory.
NOVA_FLAVOR, NOVA_FLAVOR_RT = "rt.small", 3


def nova_metadata(flavor, extra_specs=None):
    """What Nova's libvirt driver writes into a domain's <metadata>; with
    `extra_specs`, as Nova 32.0 (2025.2) and later write them, in
    <nova:flavor> (nova/virt/libvirt/config.py,
    LibvirtConfigGuestMetaNovaFlavorExtraSpecs)."""
    specs = ""
    if extra_specs is not None:
        specs = "<nova:extraSpecs>" + "".join(
            f'<nova:extraSpec name="{k}">{v}</nova:extraSpec>' for k, v in extra_specs.items()
        ) + "</nova:extraSpecs>"
    return ('<nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1">'
            '<nova:name>web</nova:name>'
            f'<nova:flavor name="{flavor}" id="7"><nova:memory>256</nova:memory>'
            f'<nova:vcpus>{VCPUS}</nova:vcpus>{specs}</nova:flavor>'
            '</nova:instance>')


def pvsched_metadata(caps, region="device"):
    kv = " ".join(f'{k}="{v}"' for k, v in caps.items())
    attr = f' region="{region}"' if region else ""
    return (f'<pvsched:vm xmlns:pvsched="{NS}"{attr}>'
            f"<pvsched:caps {kv}/></pvsched:vm>")


class Env:
    """pvschedd, libvirtd and what the domains need; `cleanup()` stops all."""

    def __init__(self, d, bins, cache):
        self.dir, self.bins, self.cache = d, bins, cache
        self.sock = d / "pvschedd.sock"
        self.hook_log = d / "hook.log"
        self.logs = {n: d / f"{n}.log" for n in ("pvschedd", "libvirtd")}
        self.daemon = self.libvirtd = None
        self.devices = []
        self.domains = []
        self.made_etc_pvsched = False
        self.qemu_uid = pwd.getpwnam("libvirt-qemu")
        # The device processes `pvsched attach` starts: their sockets
        # (QEMU, as libvirt-qemu, must reach them), pid files and logs.
        self.device_dir = d / "dev"
        self.env = {**os.environ, "PVSCHED_SOCKET": str(self.sock)}

    def procs(self):
        return [(n, p, self.logs[n]) for n, p in (("pvschedd", self.daemon),
                                                   ("libvirtd", self.libvirtd)) if p]

    def pvsched(self, *args, check=True):
        r = subprocess.run([str(self.bins.pvsched), *map(str, args)], env=self.env, timeout=30,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if check and r.returncode != 0:
            pytest.fail(f"pvsched {' '.join(map(str, args))}: rc {r.returncode}: {r.stdout}")
        return r

    def vms(self):
        return json.loads(self.pvsched("status", "--json").stdout)["vms"]

    def vm(self, name):
        return next((v for v in self.vms() if v["name"] == name), None)

    def start_pvschedd(self):
        (self.dir / "vms").mkdir(exist_ok=True)
        (self.dir / "run").mkdir(exist_ok=True)
        cfg = self.dir / "pvschedd.toml"
        cfg.write_text(f'socket = "{self.sock}"\nruntime_dir = "{self.dir / "run"}"\n'
                       f'socket_group = ""\nvm_dir = "{self.dir / "vms"}"\n'
                       f'metrics_listen = ""\n\n[max]\nmax_rt_prio = {MAX_RT_PRIO}\n')
        with open(self.logs["pvschedd"], "a") as f:
            self.daemon = subprocess.Popen([str(self.bins.pvschedd), "--config", str(cfg)],
                                           stdout=f, stderr=subprocess.STDOUT,
                                           preexec_fn=die_with_parent,
                                           env={**os.environ, "RUST_LOG": "info"})

        def ready():
            if self.daemon.poll() == 6:
                pytest.fail(f"pvschedd: the BPF policy did not load:\n"
                            f"{self.logs['pvschedd'].read_text()}")
            return self.pvsched("status", check=False).returncode == 0
        wait_for("pvschedd's socket", ready, self.procs())

    def stop_pvschedd(self):
        kill(self.daemon)
        assert self.daemon.returncode == 0, f"pvschedd's exit on SIGTERM: {self.daemon.returncode}"
        self.daemon = None

    def restart_libvirtd(self):
        """libvirtd stopped (SIGTERM: its domains keep running) and started
        again: it reconnects to them, and runs the hook's "reconnect"."""
        kill(self.libvirtd)
        self.libvirtd = None
        self.launch_libvirtd()

    def start_libvirtd(self):
        etc = self.dir / "etc-libvirt"
        shutil.copytree("/etc/libvirt", etc, symlinks=True)
        # Only the shipped hook; no default network to autostart; QEMU's
        # output to a file (no virtlogd to start).
        shutil.rmtree(etc / "hooks", ignore_errors=True)
        (etc / "hooks" / "qemu.d").mkdir(parents=True)
        shutil.copy(HOOK, etc / "hooks" / "qemu.d" / "pvsched")
        (etc / "hooks" / "qemu.d" / "pvsched").chmod(0o755)
        shutil.rmtree(etc / "qemu" / "networks" / "autostart", ignore_errors=True)
        # namespaces = []: QEMU sees this libvirtd's /dev (with the file
        # over /dev/kvm below, which libvirt cannot move into a private
        # /dev of the domain's).
        (etc / "qemu.conf").write_text('stdio_handler = "file"\nnamespaces = []\n')
        etc_pvsched = self.dir / "etc-pvsched"
        etc_pvsched.mkdir()
        # Caps per Nova flavor, where the hook looks by default.
        (etc_pvsched / "flavors").mkdir()
        (etc_pvsched / "flavors" / f"{NOVA_FLAVOR}.toml").write_text(
            f"max_rt_prio = {NOVA_FLAVOR_RT}\n")
        (etc_pvsched / "libvirt-hook.conf").write_text(
            f"# tests/libvirt: this pvschedd and pvsched\nPVSCHED_SOCKET={self.sock}\n"
            f"PVSCHED_BIN={self.bins.pvsched}\nPVSCHED_HOOK_LOG={self.hook_log}\n"
            f"PVSCHED_DEVICE_DIR={self.device_dir}\n")
        conf = self.dir / "libvirtd.conf"
        conf.write_text('log_outputs = "3:stderr"\n')
        if not Path("/etc/pvsched").exists():
            # A mount point for the bind mount below (removed again).
            os.mkdir("/etc/pvsched", 0o755)
            self.made_etc_pvsched = True
        # No /dev/kvm for this libvirtd: the domains run on TCG (QEMU cannot
        # run a guest on this host's KVM), and libvirt-qemu may not open
        # /dev/kvm here while libvirt's capability probe finds KVM anyway,
        # so every libvirtd start and every define would probe each QEMU
        # again (seconds each: "KVM was enabled when probing ..., but it is
        # not available now"). A file no one but root may open, over it:
        # QEMU finds no KVM, and the probed capabilities stay valid.
        nokvm = self.dir / "no-kvm"
        nokvm.write_bytes(b"")
        nokvm.chmod(0)
        script = ('mount --bind "$1" /etc/libvirt && mount --bind "$2" /etc/pvsched && '
                  '{ [ ! -e /dev/kvm ] || mount --bind "$3" /dev/kvm; } && exec libvirtd -f "$4"')
        self.libvirtd_argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                              script, "sh", str(etc), str(etc_pvsched), str(nokvm), str(conf)]
        self.launch_libvirtd()

    def launch_libvirtd(self):
        with open(self.logs["libvirtd"], "a") as f:
            self.libvirtd = subprocess.Popen(self.libvirtd_argv, stdout=f,
                                             stderr=subprocess.STDOUT,
                                             preexec_fn=die_with_parent, cwd=self.dir)
        wait_for("libvirtd answering", lambda: subprocess.run(
            ["virsh", "-c", URI, "version"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, timeout=30).returncode == 0, self.procs())

    def emulator(self):
        """QEMU 11 for libvirt: the setup's wrapper with a module directory
        of its own (qemu11_modules). Kept under the cache at a fixed path,
        readable by libvirt-qemu, so libvirt probes it once."""
        d = self.cache / "libvirt"
        d.mkdir(exist_ok=True)
        d.chmod(0o755)
        qemu11_modules(self.cache, d / "qemu11-modules")
        w = d / "qemu-system-x86_64"
        write_if_changed(w, f"#!/bin/sh\n# QEMU 11 as libvirt's <emulator> (tests/libvirt)\n"
                            f"QEMU_MODULE_DIR={d / 'qemu11-modules'} "
                            f"exec {self.cache / 'qemu11' / 'qemu-system-x86_64'} \"$@\"\n", 0o755)
        return w

    def start_device(self, name, region):
        """The sandboxed pvsched device for domain `name` on a vfio-user
        socket QEMU (user libvirt-qemu) may connect to; it serves one QEMU
        and exits when that QEMU goes."""
        vfio = self.dir / f"{name}.vfio"
        if vfio.exists():
            vfio.unlink()
        cmd = [str(self.bins.pvsched), "device", "--transport", "vfio-user", "--socket",
               str(vfio), "--vcpus", str(VCPUS)]
        if region:
            cmd += ["--daemon-region", name, "--daemon-socket", str(self.sock)]
        log = self.dir / f"{name}-device.log"
        with open(log, "a") as f:
            dev = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                   preexec_fn=die_with_parent,
                                   env={**os.environ, "RUST_LOG": "warn"})
        self.devices.append(dev)
        wait_for(f"{name}'s device listening", vfio.exists, [("device", dev, log)])
        os.chown(vfio, self.qemu_uid.pw_uid, self.qemu_uid.pw_gid)
        return vfio

    def define(self, name, xml):
        path = self.dir / f"{name}.xml"
        path.write_text(xml)
        self.domains.append(name)
        virsh("define", path)

    def hook_lines(self, name):
        text = self.hook_log.read_text() if self.hook_log.exists() else ""
        return [line for line in text.splitlines() if line.startswith(f"{name}:")
                or f" {name}:" in line]

    def cleanup(self):
        errors = []
        for name in self.domains:
            if self.libvirtd and self.libvirtd.poll() is None:
                virsh("destroy", name, check=False)
                virsh("undefine", name, check=False)
        if self.libvirtd is not None:
            kill(self.libvirtd)
        for name in self.domains:
            # A QEMU libvirt left behind (libvirtd died first): ours by
            # its command line only.
            pid = qemu_pid(name)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
            except OSError:
                cmdline = b""
            if f"guest={name},".encode() in cmdline:
                errors.append(f"QEMU {pid} of {name} outlived libvirtd; killed")
                os.kill(pid, 9)
            for f in (LIBVIRT_RUN / f"{name}.pid", LIBVIRT_RUN / f"{name}.xml",
                      Path("/var/log/libvirt/qemu") / f"{name}.log"):
                if f.exists() and (f.suffix == ".log" or not pid_alive(qemu_pid(name))):
                    f.unlink()
        for dev in self.devices:
            kill(dev)
        # Device processes `pvsched attach` started and no QEMU ended.
        for pid in device_pids(self.device_dir):
            errors.append(f"device process {pid} outlived its domain; killed")
            os.kill(pid, 9)
        if self.daemon is not None:
            kill(self.daemon)
            if self.daemon.returncode != 0:
                errors.append(f"pvschedd's exit on SIGTERM: {self.daemon.returncode}")
        if self.made_etc_pvsched:
            os.rmdir("/etc/pvsched")
        return errors


def qemu_pid(name):
    try:
        return int((LIBVIRT_RUN / f"{name}.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid):
    return pid is not None and Path(f"/proc/{pid}").exists()


def status_xml_vcpu_tids(name):
    """The vCPU thread ids libvirt's status XML records, by vCPU id."""
    root = ET.parse(LIBVIRT_RUN / f"{name}.xml").getroot()
    vcpus = root.findall("./vcpus/vcpu")
    return [int(v.get("pid")) for v in sorted(vcpus, key=lambda v: int(v.get("id")))]


def monitor_tids(name):
    """vCPU thread ids from libvirt's monitor, by CPU index."""
    out = virsh("qemu-monitor-command", name, '{"execute":"query-cpus-fast"}')
    cpus = json.loads(out)["return"]
    return [c["thread-id"] for c in sorted(cpus, key=lambda c: c["cpu-index"])]


@pytest.fixture(scope="module")
def env(need_real, cache, request, release_bins):
    if os.geteuid() != 0:
        need_real("root", "libvirtd, BPF and RT scheduling need root (run as root)")
    for tool in ("libvirtd", "virsh", "unshare"):
        if shutil.which(tool) is None:
            need_real(tool, "install libvirt with scripts/setup (scripts/setup.d/48-libvirt.sh)")
    try:
        pwd.getpwnam("libvirt-qemu")
    except KeyError:
        need_real("the libvirt-qemu user", "libvirt-daemon-system creates it (scripts/setup)")
    if not (cache / "qemu11" / "qemu-system-x86_64").exists():
        need_real("QEMU >= 10.1", f"not in {cache}/qemu11 (run scripts/setup)")
    if libvirt_answers():
        need_real("a libvirtd of this test's own",
                  f"another libvirtd serves {LIBVIRT_SOCK}; stop it first")
    bins = SimpleNamespace(pvschedd=release_bins.pvschedd, pvsched=release_bins.pvsched)
    # Not pytest's tmp_path: libvirt-qemu must reach the device sockets.
    d = Path(tempfile.mkdtemp(prefix="pvsched-libvirt-"))
    d.chmod(0o755)
    e = Env(d, bins, cache)
    failed_before = request.session.testsfailed
    t0 = time.monotonic()
    try:
        e.start_pvschedd()
        e.start_libvirtd()
        e.emulator_path = e.emulator()
        print(f"pvschedd and libvirtd up in {time.monotonic() - t0:.1f}s ({d})")
        yield e
    finally:
        errors = e.cleanup()
        print(f"libvirt tests, set-up to clean-up: {time.monotonic() - t0:.1f}s")
        if request.session.testsfailed == failed_before and not errors:
            shutil.rmtree(d, ignore_errors=True)
        else:
            print(f"logs kept in {d}")
        assert not errors, errors


@pytest.fixture(scope="module")
def lv_guest(env, cache, need_real):
    """A Linux guest for libvirt: the Debian 6.1 cloud kernel and an
    initramfs with this tree's module (built here against its headers)
    whose init loads the module with no device and switches on every CPU
    until powered off (`pvtest=report`); in the test's directory, which
    libvirt-qemu can read."""
    try:
        vmlinuz, trees = kernel_tree(cache, guest_kabi(cache))
    except FileNotFoundError as e:
        need_real("the Debian guest kernel", f"{e}")
    d = env.dir / "guest"
    ko, _ = build_module(REPO, trees["cloud"], d / "build")
    initrd = build_initramfs(ko, d)
    shutil.copy(vmlinuz, d / "vmlinuz")
    for p in (d, d / "vmlinuz", initrd):
        p.chmod(0o755 if p.is_dir() else 0o644)

    def console(name):
        # Made here, writable by QEMU (libvirt-qemu).
        c = d / f"{name}.console"
        c.touch()
        c.chmod(0o666)
        return c
    return SimpleNamespace(vmlinuz=d / "vmlinuz", initrd=initrd, console=console,
                           append="console=ttyS0 panic=-1 quiet pvtest=report")


def check_baseline(tids, samples):
    """Reads each vCPU thread's (policy, priority, nice) `samples` times;
    each must be its baseline, SCHED_OTHER nice 0 (QEMU under libvirt):
    the guest has no OS, so no driver asks for a boost, and under TCG no
    KVM tracepoint fires for these threads (no halt or yield boost)."""
    for _ in range(samples):
        for t in tids:
            got = attrs(t)
            assert got == (SCHED_OTHER, 0, 0), \
                f"vCPU thread {t} at (policy, priority, nice) {got}, not its baseline"
        time.sleep(SAMPLE_GAP_S)


def test_hook_registers_each_start_until_qemu_is_gone(env):
    """Start, check, stop: `virsh destroy`, `virsh destroy --graceful`,
    `virsh destroy`, then SIGKILL of QEMU behind libvirt's back."""
    name = "pvsched-lv-cycle"
    t0 = time.monotonic()
    env.define(name, domain_xml(name, env.emulator_path, env.dir / f"{name}.vfio",
                                pvsched_metadata(CAPS)))
    stops = ["destroy", "destroy --graceful", "destroy", "SIGKILL"]
    assert len(stops) == CYCLES + 1
    report = []
    for cycle, stop in enumerate(stops):
        env.start_device(name, region=True)
        ts = time.monotonic()
        virsh("start", name)
        start_s = time.monotonic() - ts
        pid = qemu_pid(name)
        assert pid_alive(pid), f"no QEMU pid for {name} in {LIBVIRT_RUN}"
        vm = wait_for(f"{name} (QEMU {pid}) registered by the hook",
                      lambda: (v := env.vm(name)) and v["pid"] == pid and v, env.procs())
        reg_s = time.monotonic() - ts
        tids = [v["tid"] for v in vm["vcpus"]]
        # The threads pvschedd holds are the ones libvirt's monitor and
        # libvirt's status XML name, and QEMU's own vCPU threads.
        assert tids == monitor_tids(name), (tids, monitor_tids(name))
        assert tids == status_xml_vcpu_tids(name), (tids, status_xml_vcpu_tids(name))
        assert len(tids) == VCPUS
        for i, t in enumerate(tids):
            comm = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            assert comm == f"CPU {i}/TCG", (t, comm)
        assert [e["tid"] for e in vm["emulators"]] == [pid], vm["emulators"]
        # The metadata's caps reached pvschedd, and BAR2 is its region map.
        assert vm["caps_source"] == "client", vm
        assert {k: vm["caps"][k] for k in CAPS} == CAPS, vm["caps"]
        assert vm["region"] == "device", vm
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "anon_inode:bpf-map" in maps, "BAR2 is not pvschedd's region map"
        said = [line for line in env.hook_lines(name) if f"QEMU pid {pid}," in line]
        assert said and "from libvirt's monitor" in said[0], env.hook_lines(name)
        check_baseline(tids, SAMPLES)
        # Stop it.
        ts = time.monotonic()
        if stop == "SIGKILL":
            os.kill(pid, 9)
            wait_for(f"libvirt seeing {name}'s QEMU gone",
                     lambda: virsh("domstate", name) == "shut off", env.procs())
            assert virsh("domstate", "--reason", name) == "shut off (crashed)"
        else:
            virsh(*stop.split(), name)
            assert virsh("domstate", name) == "shut off"
        assert not pid_alive(pid), f"QEMU {pid} still there after {stop}"
        wait_for(f"{name} unregistered after {stop}", lambda: env.vms() == [], env.procs())
        report.append(f"cycle {cycle}: `virsh start` {start_s:.1f}s, registered "
                      f"+{reg_s - start_s:.2f}s after it returned, QEMU {pid}, vCPU threads "
                      f"{tids} (= query-cpus-fast = status XML), {SAMPLES * VCPUS} samples at "
                      f"baseline; {stop}: unregistered {time.monotonic() - ts:.1f}s later")
    print("\n".join(report))
    print(f"cycles: {time.monotonic() - t0:.1f}s")
    log = env.logs["pvschedd"].read_text()
    assert log.count(f"registered vm={name}") == len(stops), log
    assert log.count("its VMM exited: unregistering vm=" + name) == len(stops), log
    assert "refused" not in log, log


def test_only_opted_in_domains_within_max_are_registered(env):
    """A domain whose metadata asks for more than [max] runs, refused by
    pvschedd, until the operator registers it by hand with caps of their
    own; one without pvsched's metadata is not even looked at."""
    over, plain = "pvsched-lv-over", "pvsched-lv-plain"
    caps = {"max_rt_prio": MAX_RT_PRIO + 4}
    env.define(over, domain_xml(over, env.emulator_path, env.dir / f"{over}.vfio",
                                pvsched_metadata(caps, region="none")))
    env.define(plain, domain_xml(plain, env.emulator_path))
    virsh("start", plain)
    # The hook returned before `virsh start` did, having started nothing.
    assert env.hook_lines(plain) == []
    assert env.vm(plain) is None
    env.start_device(over, region=False)
    virsh("start", over)
    said = wait_for(f"the hook's qemu-attach refusing {over}",
                    lambda: [line for line in env.hook_lines(over)
                             if "operator maximum" in line], env.procs())
    print(f"hook log: {said[0]}")
    assert re.search(r"max_rt_prio is above the operator maximum .*max_rt_prio = "
                     f"{MAX_RT_PRIO}", said[0]), said
    assert env.vms() == [], "nothing registered"
    assert virsh("domstate", over) == "running"
    assert env.hook_lines(plain) == []
    # The operator registers it by hand with caps of their own: the pid
    # from libvirt's pid file, the region mode from `virsh dumpxml`.
    caps_file = env.dir / "over.toml"
    caps_file.write_text("max_rt_prio = 2\n")
    r = env.pvsched("qemu-attach", "--libvirt", over, "--policy-file", caps_file)
    pid = qemu_pid(over)
    assert f"{over}: QEMU pid {pid}, {VCPUS} vCPU thread(s)" in r.stdout, r.stdout
    vm = env.vm(over)
    assert [v["tid"] for v in vm["vcpus"]] == monitor_tids(over), vm
    assert (vm["region"], vm["caps_source"], vm["caps"]["max_rt_prio"]) == ("none", "client", 2)
    print(f"by hand: {r.stdout.strip()}")
    for d in (over, plain):
        virsh("destroy", d)
    wait_for(f"{over} unregistered", lambda: env.vms() == [], env.procs())
    # Nova's domains: the flavor in Nova's own metadata picks the caps file
    # (/etc/pvsched/flavors/FLAVOR.toml); another flavor is left alone.
    nova, other = "instance-0000abcd", "instance-0000abce"
    env.define(nova, domain_xml(nova, env.emulator_path, metadata=nova_metadata(NOVA_FLAVOR)))
    env.define(other, domain_xml(other, env.emulator_path, metadata=nova_metadata("m1.small")))
    virsh("start", other)
    virsh("start", nova)
    vm = wait_for(f"{nova} registered by its flavor", lambda: env.vm(nova), env.procs())
    assert [v["tid"] for v in vm["vcpus"]] == monitor_tids(nova), vm
    assert (vm["region"], vm["caps_source"], vm["caps"]["max_rt_prio"]) == \
        ("none", "client", NOVA_FLAVOR_RT), vm
    assert env.vm(other) is None
    said = wait_for(f"the hook on {other}", lambda: env.hook_lines(other), env.procs())
    assert "no pvsched:* extra spec in its Nova flavor" in said[0], said
    print(f"nova: {env.hook_lines(nova)[0]}; {said[0]}")
    for d in (nova, other):
        virsh("destroy", d)
    wait_for(f"{nova} unregistered", lambda: env.vms() == [], env.procs())


def test_hook_attaches_the_device_a_nova_flavor_asks_for(env, lv_guest):
    """A domain as Nova starts it, with no device on its command line: its
    flavor's extra specs (pvsched:max_rt_prio=3, written by Nova into
    <nova:flavor>) opt it in, and the hook's `pvsched attach` starts the
    device process, hot-plugs it into the domain's empty PCIe root port
    and registers the VM in device-region mode with those caps. The Linux
    guest's driver binds the plugged device (its ABI shows in pvschedd's
    status) and its slots move in pvschedd's region. `virsh destroy` ends
    the registration and the device process."""
    name = "instance-0000beef"
    specs = {"hw:cpu_policy": "shared", "pvsched:max_rt_prio": "3"}
    env.define(name, domain_xml(name, env.emulator_path, guest=lv_guest, root_port=True,
                                metadata=nova_metadata("rt.hints", specs)))
    t0 = time.monotonic()
    virsh("start", name)
    pid = qemu_pid(name)
    vm = wait_for(f"{name} registered by the hook",
                  lambda: (v := env.vm(name)) and v["pid"] == pid and v, env.procs())
    reg_s = time.monotonic() - t0
    assert (vm["region"], vm["caps_source"], vm["caps"]["max_rt_prio"]) == \
        ("device", "client", 3), vm
    assert [v["tid"] for v in vm["vcpus"]] == monitor_tids(name), vm
    said = env.hook_lines(name)
    assert any("hot-plugged" in line for line in said), said
    plugged = json.loads(virsh("qemu-monitor-command", name,
                               '{"execute":"qom-list","arguments":{"path":"/machine/peripheral"}}'))
    types = {c["name"]: c["type"] for c in plugged["return"]}
    assert types.get("pvsched0") == "child<vfio-user-pci>", types
    assert "anon_inode:bpf-map" in Path(f"/proc/{pid}/maps").read_text(), \
        "BAR2 is not pvschedd's region map"
    assert len(device_pids(env.device_dir, name)) == 1
    want_abi = f"{abi.ABI_MAJOR}.{abi.ABI_MINOR}"
    vm = wait_for(f"{name}'s guest driver attached",
                  lambda: (v := env.vm(name)) and v.get("guest_abi") == want_abi and v,
                  env.procs(), timeout=120)
    abi_s = time.monotonic() - t0
    a = daemon_region.seqs(env.sock, name)
    b = wait_for("every slot written again",
                 lambda: (x := daemon_region.seqs(env.sock, name)) and all(
                     q > p for p, q in zip(a, x)) and x, env.procs())
    virsh("destroy", name)
    wait_for(f"{name} unregistered", lambda: env.vm(name) is None, env.procs())
    wait_for(f"{name}'s device process gone", lambda: not device_pids(env.device_dir, name),
             env.procs())
    print(f"nova extra specs: registered {reg_s:.1f}s after `virsh start`, guest ABI "
          f"{vm['guest_abi']} at {abi_s:.1f}s, slots' seq {a} -> {b}; hook: {said[0]}")


def test_reconnect_attaches_a_domain_started_while_pvschedd_was_down(env):
    """A domain that opted in started while pvschedd was down: the hook's
    attach fails and says so. Once pvschedd runs again, a restart of
    libvirtd (which reconnects to its running domains and runs the hook's
    "reconnect") attaches it: device plugged, registered."""
    name = "pvsched-lv-reconnect"
    env.stop_pvschedd()
    env.define(name, domain_xml(name, env.emulator_path, root_port=True,
                                metadata=pvsched_metadata(CAPS, region=None)))
    try:
        virsh("start", name)
        said = wait_for(f"the hook failing on {name}", lambda: env.hook_lines(name), env.procs())
        assert any("pvschedd" in line for line in said), said
    finally:
        env.start_pvschedd()
    assert env.vm(name) is None
    pid = qemu_pid(name)
    env.restart_libvirtd()
    vm = wait_for(f"{name} attached on reconnect",
                  lambda: (v := env.vm(name)) and v["pid"] == pid and v, env.procs())
    assert (vm["region"], vm["caps_source"]) == ("device", "client"), vm
    assert {k: vm["caps"][k] for k in CAPS} == CAPS, vm["caps"]
    lines = env.hook_lines(name)
    assert any("hot-plugged" in line for line in lines), lines
    virsh("destroy", name)
    wait_for(f"{name} unregistered", lambda: env.vm(name) is None, env.procs())
    print(f"reconnect: {said[0]} | then {lines[-1]}")
