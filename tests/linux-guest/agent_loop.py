"""Policy agent in the loop: pvsched-agent-attach on QEMU's vCPU threads.

With `pvsched-agent-attach` attached to QEMU's vCPU threads (QMP
`query-cpus-fast` thread ids) in guest-region mode, the vCPU thread of the
guest CPU running a SCHED_FIFO 8 busy loop is boosted to SCHED_FIFO 8
(read back with sched_getscheduler/sched_getparam/getpriority, i.e. the
kernel's own view, sampled every millisecond) and returns to its exact
baseline (SCHED_OTHER, nice 2) after the loop ends; after the agent is
stopped every vCPU thread is at its baseline.

The slot addresses are QEMU virtual addresses of the guest region, found
in QEMU's memfd RAM (pvsched_guest.region).
"""

import json
import os
import signal
import subprocess
import threading
import time

from pvsched_guest import abi
from pvsched_guest.host import Failure, attrs
from pvsched_guest.region import guest_vcpus

BASE_NICE = 2
BOOST_PRIO = 8
CAPS = """# pvsched caps for the Linux-guest agent test: RT boosts up to FIFO 10 (the
# guest's FIFO 8 task is granted FIFO 8), defaults for the throttle/budget.
allow_rt = true
max_rt_prio = 10
cs_rt_prio = 1
halt_boost = "none"
yield_boost = "none"
"""
# Bounds (harness pacing, not performance claims).
AGENT_READY_S = 20.0
# How long the host waits, at the end of the guest's idle period, for the
# busy vCPU thread to be seen back at its baseline (it is then reported
# with the time it took; only never coming back fails).
BACK_WAIT_S = 30.0


class AgentFailure(Failure):
    pass


def fmt(a):
    policy, prio, nice = a
    name = {os.SCHED_OTHER: "OTHER", os.SCHED_FIFO: "FIFO", os.SCHED_RR: "RR"}.get(policy, policy)
    return f"{name}/{prio}/nice{nice}"


def hist(states):
    counts = {}
    for a in states:
        counts[fmt(a)] = counts.get(fmt(a), 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


class Sampler(threading.Thread):
    """Reads every vCPU thread's attributes every millisecond."""

    def __init__(self, tids, t0):
        super().__init__(daemon=True)
        self.tids, self.t0 = tids, t0
        self.samples = {t: [] for t in tids}
        self.stop = threading.Event()
        self.errors = 0

    def run(self):
        while not self.stop.is_set():
            now = time.monotonic() - self.t0
            for t in self.tids:
                try:
                    self.samples[t].append((now, attrs(t)))
                except OSError:
                    self.errors += 1
            time.sleep(0.001)


class AgentLoop:
    """Hooks for a `pvtest=agent` boot (see init.sh)."""

    caps = CAPS

    def __init__(self, args, boot_dir):
        self.args, self.dir = args, boot_dir
        self.agent = None
        self.sampler = None
        self.info = {}
        self.errors = []
        self.stats = None
        self.rc = None
        self.after_stop = {}

    def hooks(self):
        return {"agent-wait": self.on_wait, "idle-end": self.on_idle_end}

    def on_wait(self, boot):
        try:
            self._attach(boot)
        except (Failure, OSError, ValueError, KeyError, TypeError) as e:
            self.errors.append(f"attaching the agent failed: {e}")
        boot.answer("go")

    def _attach(self, boot):
        pid, hva, gpa, tids, apic, addrs = guest_vcpus(boot, "agent-wait")
        for t in tids:
            os.setpriority(os.PRIO_PROCESS, t, BASE_NICE)
        self.baseline = {t: attrs(t) for t in tids}
        caps = self.dir / "caps.toml"
        caps.write_text(self.caps)
        self.stats_path = self.dir / "agent-stats.json"
        self.trace_path = self.dir / "agent-trace.jsonl"
        for p in (self.stats_path, self.trace_path):
            if p.exists():
                p.unlink()
        self.agent_log = self.dir / "agent.log"
        cmd = [str(self.args.agent_bin), "--pid", str(pid),
               "--tids", ",".join(map(str, tids)), "--apic-ids", ",".join(map(str, apic)),
               "--slot-addrs", ",".join(hex(a) for a in addrs),
               "--caps", str(caps), "--stats-json", str(self.stats_path),
               "--trace", str(self.trace_path)]
        self.info = {"qemu_pid": pid, "region_gpa": hex(gpa), "region_hva": hex(hva),
                     "tids": tids, "apic_ids": apic, "slot_addrs": [hex(a) for a in addrs],
                     "cmd": " ".join(cmd)}
        # A thread that is not QEMU's (the harness itself) is refused, exit 2.
        bad = [str(self.args.agent_bin), "--pid", str(pid), "--tids", str(os.getpid()),
               "--apic-ids", "0", "--slot-addrs", hex(addrs[0])]
        r = subprocess.run(bad, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=30)
        self.info["foreign_tid"] = f"rc {r.returncode}: {r.stdout.strip()}"
        if r.returncode != 2 or "not a thread of process" not in r.stdout:
            self.errors.append(f"agent accepted or mishandled a foreign TID: {self.info['foreign_tid']}")
        with open(self.agent_log, "w") as logf:
            self.agent = subprocess.Popen(cmd, stdout=logf, stderr=logf,
                                          env={**os.environ, "RUST_LOG": "warn"})
        boot.cleanups.append(self.stop_agent)
        deadline = time.monotonic() + AGENT_READY_S
        while "ready" not in self.agent_log.read_text():
            if self.agent.poll() is not None:
                raise AgentFailure(f"pvsched-agent-attach exited with {self.agent.returncode}: "
                                   f"{self.agent_log.read_text().strip()}")
            if time.monotonic() > deadline:
                raise AgentFailure("pvsched-agent-attach not ready in time")
            time.sleep(0.05)
        self.sampler = Sampler(tids, boot.t0)
        self.sampler.start()

    def on_idle_end(self, boot):
        # The guest waits for the answer (init.sh, host_sync): QEMU and its
        # vCPU threads are gone once it goes on to rmmod and power off, and
        # the threads' state after the agent stopped is read here.
        try:
            self._end(boot)
        finally:
            boot.answer("go")

    def _end(self, boot):
        if self.sampler:
            # Sample until the busy thread was seen back at its baseline
            # after the loop (or BACK_WAIT_S): how soon it gets there on a
            # loaded host is reported, not asserted.
            busy, base = self.busy_thread(boot)
            t_end = boot.marks["fifo-end"][0] if "fifo-end" in boot.marks else None
            deadline = time.monotonic() + BACK_WAIT_S
            while busy is not None and t_end is not None and time.monotonic() < deadline:
                if any(t > t_end and a == base for t, a in list(self.sampler.samples[busy])):
                    break
                time.sleep(0.05)
            self.sampler.stop.set()
            self.sampler.join()
        self.stop_agent()
        if self.rc is not None:
            self.after_stop = {t: attrs(t) for t in self.baseline}

    def stop_agent(self):
        if self.agent is None or self.rc is not None:
            return
        self.agent.send_signal(signal.SIGTERM)
        try:
            self.rc = self.agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.rc = self.agent.wait()
            self.errors.append("pvsched-agent-attach did not stop on SIGTERM")
        try:
            self.stats = json.loads(self.stats_path.read_text())
        except (OSError, ValueError) as e:
            self.errors.append(f"no stats JSON from the agent: {e}")

    def busy_thread(self, boot):
        """(tid, baseline) of the vCPU thread of the guest CPU that runs the
        FIFO loop, or (None, None) before that is known."""
        if "fifo-start" not in boot.marks:  # a wait boot has no FIFO loop
            return None, None
        try:
            cpu = int(boot.marks["fifo-start"][1]["cpu"])
            busy = self.info["tids"][self.info["apic_ids"].index(cpu)]
            return busy, self.baseline[busy]
        except (KeyError, ValueError, AttributeError):
            return None, None

    def check(self, boot):
        """Failures (list of strings) and a one-line summary."""
        f = list(self.errors)
        if f or self.sampler is None:
            return f or ["agent never attached"], "agent: not attached"
        cpu = int(boot.mark("fifo-start")["cpu"])
        t_start = boot.marks["fifo-start"][0]
        t_end = boot.marks["fifo-end"][0]
        apic = self.info["apic_ids"]
        if cpu not in apic:
            return [f"agent: no slot for cpu {cpu}"], "agent: bad cpu"
        busy = self.info["tids"][apic.index(cpu)]
        base = self.baseline[busy]
        boosted = (abi.POLICY_FIFO, BOOST_PRIO, BASE_NICE)
        if base != (os.SCHED_OTHER, 0, BASE_NICE):
            f.append(f"agent: baseline of {busy} is {base}, not SCHED_OTHER nice {BASE_NICE}")
        s = self.sampler.samples[busy]
        during = [a for t, a in s if t_start <= t <= t_end]
        n_boost = sum(1 for a in during if a == boosted)
        after = [(t, a) for t, a in s if t > t_end]
        back = next((t for t, a in after if a == base), None)
        # Boosts that begin after the thread was back at its baseline. One
        # can be a boost decided just before the loop ended and applied
        # just after; a policy that keeps boosting the idle vCPU shows a
        # boost every throttle period of the idle seconds.
        late, prev = 0, None
        for t, a in after:
            if back is not None and t > back and a == boosted and prev != boosted:
                late += 1
            prev = a
        other = {}
        for t in self.info["tids"]:
            if t != busy:
                other[t] = sum(1 for _, a in self.sampler.samples[t] if a == boosted)
        if not n_boost:
            states = sorted({a for a in during})
            f.append(f"agent: vCPU thread {busy} (cpu {cpu}) never at SCHED_FIFO {BOOST_PRIO} "
                     f"in {len(during)} samples during the guest's FIFO {BOOST_PRIO} loop "
                     f"(states seen {states})")
        if back is None:
            f.append(f"agent: vCPU thread {busy} never back at baseline {base} after the "
                     f"loop's end (sampled {BACK_WAIT_S:.0f}s past the guest's idle period)")
        if late > 1:
            f.append(f"agent: vCPU thread {busy} boosted to FIFO {BOOST_PRIO} {late} times "
                     f"after it was back at its baseline while the guest idled")
        if any(other.values()):
            f.append(f"agent: other vCPU threads at FIFO {BOOST_PRIO}: {other}")
        if self.rc != 0:
            f.append(f"agent: pvsched-agent-attach exited with {self.rc}")
        if self.after_stop != self.baseline:
            f.append(f"agent: after the agent stopped {self.after_stop} != baseline {self.baseline}")
        vs = (self.stats or {}).get("vcpus", [])
        idx = apic.index(cpu)
        if not vs or vs[idx].get("boosts_applied", 0) == 0:
            f.append(f"agent: stats show no applied boost on slot {idx}: {self.stats}")
        last = max((t for t, a in s if a == boosted), default=None)
        summary = (f"agent: cpu {cpu} vCPU thread {busy} (baseline {fmt(base)}): "
                   f"{n_boost}/{len(during)} samples at SCHED_FIFO {BOOST_PRIO} during the "
                   f"loop ({hist(during)}); after it {hist([a for _, a in after])}; last "
                   f"FIFO {BOOST_PRIO} sample {(last - t_end) * 1000 if last else float('nan'):+.0f} "
                   f"ms from the loop's end mark, baseline first seen "
                   f"{(back - t_end) * 1000 if back is not None else float('nan'):+.0f} ms; "
                   f"other vCPUs at FIFO {BOOST_PRIO}: {sum(other.values())}; after stop "
                   f"{[fmt(a) for a in self.after_stop.values()]}; agent rc {self.rc}; stats "
                   f"{json.dumps(self.stats, separators=(',', ':'))}")
        return f, summary
