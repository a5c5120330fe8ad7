"""wait_on from a real Linux guest, and the policy's directed-yield decision
naming the waited-on vCPU.

A `pvtest=wait` boot: once the driver is bound, pvsched-agent-attach is
attached to QEMU's vCPU threads (as in agent_loop.py) with caps that give a
directed-yield target SCHED_FIFO YIELD_PRIO; then guest CPU 0 makes
synchronous cross-CPU calls to CPU 1 for 3 s (private expedited membarrier
while a thread of the same process spins on CPU 1). The guest driver sets
CPU 0's `wait_on` to CPU 1's slot when it queues each call (csd_queue_cpu)
and CPU 1 clears it when the call is done (csd_function_exit).

Host-side evidence, none of it from guest log lines:
- the device's samples of CPU 0's slot show wait_on naming CPU 1's slot and
  none (set and cleared) during the loop;
- the policy's decision trace has YIELD decisions boosting CPU 1's vCPU
  thread (the waited-on vCPU) to SCHED_FIFO YIELD_PRIO during the loop, and
  the agent's stats count directed-yield slot hits on CPU 0;
- CPU 1's vCPU thread, read back with sched_getscheduler/sched_getparam
  every millisecond, is seen at SCHED_FIFO YIELD_PRIO during the loop, and
  every thread is back at its baseline after the agent stops.

On a kernel without the csd tracepoints (before 6.3) the driver must say it
does not report wait_on, the slot must never name a vCPU, and the policy
must make no YIELD decision.

Then guest CPUs 0 and 1 contend for one pipe's mutex for 3 s (each writes 4
KiB and reads it back, non-blocking): a waiter spins on the running owner,
which the driver reports from lock:contention_begin/end (Linux >= 5.19) as
wait_on = WAIT_ANY. The driver must say it reports lock waits and count
some during the loop, and the device's samples of the two slots (every
500 us) must catch wait_on = any: each spin on the pipe's mutex is short,
but there are some 100 000 of them per second. The policy's answer to a
lock wait needs a preempted vCPU, which this idle host does not make: the
differential test and S6 cover it.
"""

import json
import re

from agent_loop import BASE_NICE, AgentLoop, fmt, hist
from pvsched_guest import abi, policy

YIELD_PRIO = 3
CAPS = f"""# pvsched caps for the Linux-guest wait_on test: a directed-yield target
# gets SCHED_FIFO {YIELD_PRIO}; no halt boost (TCG has no KVM halts anyway).
allow_rt = true
max_rt_prio = 10
cs_rt_prio = 1
halt_boost = "none"
yield_boost = "rt"
yield_prio = {YIELD_PRIO}
wait_on = true
# Lock waits (wait_on = any) are checked in the guest's slot, not in the
# policy: off here, so every YIELD decision comes from a csd wait_on.
lock_wait = false
"""


def kernel_at_least(release, version):
    """Kernel `release` ("7.3.4+deb13-cloud-amd64") is `version` (major,
    minor) or newer."""
    m = re.match(r"(\d+)\.(\d+)", release or "")
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= version


def has_csd(release):
    """The csd tracepoints exist from Linux 6.3 on."""
    return kernel_at_least(release, (6, 3))


def has_lock_tracepoints(release):
    """lock:contention_begin/end exist from Linux 5.19 on."""
    return kernel_at_least(release, (5, 19))


class WaitLoop(AgentLoop):
    """Hooks and checks for a `pvtest=wait` boot (see the module docstring)."""

    caps = CAPS

    def read_trace(self):
        out = []
        try:
            for line in self.trace_path.read_text().splitlines():
                if line.strip():
                    out.append(json.loads(line))
        except (OSError, ValueError) as e:
            self.errors.append(f"reading the decision trace: {e}")
        return out

    def check(self, boot):
        f = list(self.errors)
        if f or self.sampler is None:
            return f or ["agent never attached"], "wait: agent not attached"
        release = boot.mark("boot").get("kernel", "")
        expect = has_csd(release)
        apic = self.info["apic_ids"]
        tids = self.info["tids"]
        start, end = boot.marks["wait-start"][0], boot.marks["wait-end"][0]
        src, dst = apic.index(0), apic.index(1)
        src_tid, dst_tid = tids[src], tids[dst]
        # 1. The slot (device's samples between the two marks).
        a, b = boot.snapshots.get("wait-start"), boot.snapshots.get("wait-end")
        if not (a and b):
            return f + ["wait: no device view at wait-start/wait-end"], "wait: no view"
        before, after = a["slots"][src]["waits"], b["slots"][src]["waits"]
        waits = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        named = waits.get(str(dst), 0)
        # "lock": a lock wait (wait_on = any) of the helper's own syscalls.
        others = {k: v for k, v in waits.items() if k not in ("none", "lock", str(dst)) and v}
        # 2. The policy's decisions during the loop (CLOCK_MONOTONIC ns).
        t0 = boot.t0
        lo, hi = (t0 + start) * 1e9, (t0 + end) * 1e9
        trace = self.read_trace()
        yields = [d for d in trace if d["reason"] == policy.R_YIELD]
        to_dst = [d for d in yields if d["tid"] == dst_tid and lo <= d["ts"] <= hi
                  and d["kind"] == abi.BOOST_RT and d["prio"] == YIELD_PRIO]
        # Outside the loop the guest may make synchronous calls the other way
        # (CPU 1 waiting on CPU 0: a TLB shootdown as the helper exits).
        elsewhere = [d for d in yields if d["tid"] != dst_tid and lo <= d["ts"] <= hi]
        vs = (self.stats or {}).get("vcpus", [])
        hits = vs[src].get("slot_hits", 0) if len(vs) > src else 0
        # 3. The kernel's view of the target's thread.
        boosted = (abi.POLICY_FIFO, YIELD_PRIO, BASE_NICE)
        during = [s for t, s in self.sampler.samples[dst_tid] if start <= t <= end]
        n_boost = sum(1 for s in during if s == boosted)
        membarriers = boot.mark("wait-end").get("membarriers", "?")
        driver_wait = boot.mark("probe").get("wait_on")
        if expect:
            if driver_wait != "1":
                f.append(f"wait: driver reports wait_on={driver_wait} on {release} (csd "
                         f"tracepoints exist from 6.3)")
            if not named or not waits.get("none", 0):
                f.append(f"wait: slot {src} (cpu 0) wait_on samples during the loop {waits}: "
                         f"expected both slot {dst} and none (set and cleared)")
            if others:
                f.append(f"wait: slot {src} named other slots {others}")
            if not to_dst:
                f.append(f"wait: no YIELD decision boosting cpu 1's vCPU thread {dst_tid} to "
                         f"FIFO {YIELD_PRIO} during the loop ({len(yields)} YIELD decisions "
                         f"in all)")
            # CPU 1's own kernel may now and then wait on CPU 0 (a timer or
            # TLB call of its own): such decisions are few, not none.
            if len(elsewhere) * 10 > len(to_dst):
                f.append(f"wait: {len(elsewhere)} YIELD decisions during the loop for threads "
                         f"other than {dst_tid}, against {len(to_dst)} for it: {elsewhere[:3]}")
            if not hits:
                f.append(f"wait: agent stats show no directed-yield slot hit on slot {src}")
            if not n_boost:
                f.append(f"wait: cpu 1's vCPU thread {dst_tid} never at FIFO {YIELD_PRIO} "
                         f"during the loop ({hist(during)})")
        else:
            if driver_wait != "0":
                f.append(f"wait: driver reports wait_on={driver_wait} on {release}, which has "
                         f"no csd tracepoints")
            if named or others:
                f.append(f"wait: slot {src} named a vCPU on {release}: {waits}")
            if yields:
                f.append(f"wait: {len(yields)} YIELD decisions on {release} without wait_on")
        lock_f, lock_summary = self.check_locks(boot, release)
        f += lock_f
        if self.rc != 0:
            f.append(f"wait: pvsched-agent-attach exited with {self.rc}")
        if self.after_stop != self.baseline:
            f.append(f"wait: after the agent stopped {self.after_stop} != baseline "
                     f"{self.baseline}")
        first = min((d["ts"] for d in to_dst), default=None)
        summary = (f"wait: {release}: driver wait_on={driver_wait}; {membarriers} membarriers "
                   f"cpu 0 -> cpu 1; slot {src} wait_on samples during the loop {waits}; "
                   f"{len(to_dst)} YIELD decisions boosting cpu 1's vCPU thread {dst_tid} "
                   f"(the waited-on vCPU, slot {dst}) to FIFO {YIELD_PRIO}, "
                   f"{len(elsewhere)} YIELD decisions for other threads during the loop, "
                   f"{len(yields) - len(to_dst) - len(elsewhere)} outside it"
                   + (f", the first {(first - lo) / 1e6:.0f} ms into the loop" if first else "")
                   + f"; slot {src} slot_hits {hits}; thread {dst_tid} samples during the "
                   f"loop: {hist(during)}; sender {src_tid}: "
                   f"{hist([s for t, s in self.sampler.samples[src_tid] if start <= t <= end])}; "
                   f"after stop {[fmt(x) for x in self.after_stop.values()]}; agent rc {self.rc}"
                   f"; {lock_summary}")
        return f, summary

    def check_locks(self, boot, release):
        """The lock loop: (failures, summary)."""
        f = []
        driver = boot.mark("probe").get("lock_wait")
        end = boot.mark("lock-end")
        try:
            waits = int(end.get("lock_waits", ""))
        except ValueError:
            return [f"lock: no lock_waits count at lock-end ({end})"], "lock: no count"
        a, b = boot.snapshots.get("lock-start"), boot.snapshots.get("lock-end")
        samples = None
        if a and b:
            samples = [b["slots"][i]["waits"].get("lock", 0) - a["slots"][i]["waits"].get("lock", 0)
                       for i in range(min(len(a["slots"]), len(b["slots"])))]
        # The counts co-scheduling reads (ABI 1.5): every kernel has
        # sched_waking, so the driver negotiates them, and the pipe's
        # hand-overs between CPUs 0 and 1 (a task woken that last ran on
        # the other CPU) and the lock waits show in the slots' bytes.
        sync = boot.mark("probe").get("sync_counts")
        grew = None
        if a and b:
            grew = [(b["slots"][i]["wakes"] - a["slots"][i]["wakes"],
                     b["slots"][i]["sync_waits"] - a["slots"][i]["sync_waits"])
                    for i in range(min(len(a["slots"]), len(b["slots"])))]
        if sync != "1":
            f.append(f"sync: driver reports sync_counts={sync} on {release}")
        elif not grew or not any(w > 0 for w, _ in grew):
            f.append(f"sync: no slot's wakes grew during the pipe loop ({grew})")
        elif has_lock_tracepoints(release) and not any(w > 0 for _, w in grew):
            f.append(f"sync: no slot's waits grew during the lock loop ({grew})")
        if has_lock_tracepoints(release):
            if driver != "1":
                f.append(f"lock: driver reports lock_wait={driver} on {release} (the lock "
                         f"contention tracepoints exist from 5.19)")
            if waits <= 0:
                f.append(f"lock: the driver counted no lock waits in 3 s of pipe-mutex "
                         f"contention ({end})")
            if not samples or not any(samples):
                f.append(f"lock: the device's samples never saw wait_on = any during the "
                         f"loop ({samples})")
        elif driver != "0" or waits:
            f.append(f"lock: driver reports lock_wait={driver}, {waits} waits on {release}")
        return f, (f"lock: driver lock_wait={driver}; {end.get('rounds', '?')} pipe rounds on "
                   f"cpus 0,1; {waits} lock waits; device samples of wait_on = any per slot "
                   f"during the loop {samples}; sync_counts={sync}, (wakes, waits) per slot "
                   f"during the loop {grew}")
