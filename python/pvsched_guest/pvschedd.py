"""A real pvschedd for one test, and the `pvsched` command line against
it: its configuration, VM caps files, socket and log in the test's
directory; the device processes `pvsched attach` starts in DIR/dev."""

import json
import os
import subprocess
import time

from .host import Failure

# Liveness bound of its start (not a timing assertion).
READY_S = 20.0


class Pvschedd:
    def __init__(self, pvschedd_bin, pvsched_bin, d, vm_files, require_vm_file=False):
        """`vm_files`: {VM name: caps TOML} written to DIR/vms."""
        self.bin, self.pvsched_bin, self.dir = pvschedd_bin, pvsched_bin, d
        self.socket = d / "pvschedd.sock"
        self.device_dir = d / "dev"
        self.log = d / "pvschedd.log"
        self.vm_files, self.require_vm_file = vm_files, require_vm_file
        self.proc = None

    def pvsched(self, *argv, timeout=600):
        """`pvsched ARGV` against this pvschedd: CompletedProcess, standard
        error in its stdout."""
        env = {**os.environ, "PVSCHED_SOCKET": str(self.socket),
               "PVSCHED_DEVICE_DIR": str(self.device_dir)}
        return subprocess.run([str(self.pvsched_bin), *map(str, argv)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)

    def start(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        vms = self.dir / "vms"
        vms.mkdir(exist_ok=True)
        for name, caps in self.vm_files.items():
            (vms / f"{name}.toml").write_text(caps)
        cfg = self.dir / "pvschedd.toml"
        cfg.write_text(f'socket = "{self.socket}"\nsocket_group = ""\nvm_dir = "{vms}"\n'
                       f'metrics_listen = ""\n'
                       f'require_vm_file = {"true" if self.require_vm_file else "false"}\n')
        self.socket.unlink(missing_ok=True)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([str(self.bin), "--config", str(cfg)], stdout=f,
                                         stderr=f, env={**os.environ, "RUST_LOG": "info"})
        deadline = time.monotonic() + READY_S
        while self.pvsched("status", timeout=30).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise Failure(f"pvschedd did not come up: {self.log.read_text()}")
            time.sleep(0.1)

    def stop(self):
        """Stops it (SIGTERM); False if it had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return True
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False

    def vm(self, name):
        """VM `name` in `pvsched status --json`, or None."""
        status = json.loads(self.pvsched("status", "--json", timeout=30).stdout)
        return next((v for v in status["vms"] if v["name"] == name), None)

    def device_pids(self, name):
        """Running `pvsched device` processes serving VM `name`'s socket."""
        return device_pids(self.device_dir, name)


def device_pids(device_dir, name=None):
    """Running `pvsched device` processes serving VM `name`'s socket in
    `device_dir` (DIR/NAME.sock), or, without `name`, any socket there."""
    def serves(arg):
        if name is not None:
            return arg == str(device_dir / f"{name}.sock").encode()
        return arg.startswith(f"{device_dir}/".encode())
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"device" in argv and any(serves(a) for a in argv):
            out.append(int(p))
    return out
