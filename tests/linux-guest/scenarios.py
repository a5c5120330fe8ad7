"""The Linux-guest scenarios: each boots a real Linux guest with the pvsched
guest driver under QEMU TCG, with the device served by `pvsched-device`, and
checks it from the host side, from the device's own JSON view of the region
(`--dump-slots`), not from guest log lines alone.

test_guest.py runs them on the Debian 6.1 cloud kernel with the module built
on the host; test_guest_matrix.py runs main, wait and hostile on each kernel
of kernels.conf with the module DKMS installed in the kernel's suite chroot,
loaded with `modprobe`.

Each scenario takes `g`, the guest fixture (what pvsched_guest.boot.Boot
reads, with the test options: cycles, rounds, churn), and `report`, which
prints a result line; it returns the failures of every check made, so one
expensive boot shows all that is wrong with it. A boot that cannot go on
(timeout, soft lockup, a mark the guest never reached) raises
pvsched_guest.host.Failure instead. Boot.run kills QEMU and the device
process however the boot ends; the agent and pvschedd are stopped in
`finally` blocks here.
"""

import os
import re
import signal
import time

from pvsched_guest import abi
from pvsched_guest.boot import Boot
from pvsched_guest.qmp import qmp
from agent_loop import AgentLoop
from attach_loop import AttachLoop
from migrate_loop import MigrateLoop
from daemon_loop import VM_NAME as DAEMON_VM, DaemonLoop
from foreign_writer import ForeignWriter
from wait_loop import WaitLoop


def answer_go(b):
    """For a guest mark printed with init.sh's host_sync: the host has its
    view of the region for the mark (taken before hooks run)."""
    b.answer("go")


def irq_answer(b):
    """`@@ irq-traffic`: "go" once the device has seen the HARDIRQ and the
    SOFTIRQ bit each in some sample, "more" (console interrupts) until then."""
    slots = (b.snapshots.get("irq-traffic") or {}).get("slots", [])
    seen = slots and all(sum(s["cs_set"][bit] for s in slots) for bit in (1, 2))
    b.answer("go" if seen else "more")


# The marks a main-mode guest (init.sh) waits on.
MAIN_HOOKS = {"churn-start": answer_go, "each-cpu-start": answer_go,
              "irq-traffic": irq_answer, "cpu-offline": answer_go}


def check(cond, msg, failures):
    """Adds `msg` to `failures` unless `cond`; returns `cond`."""
    if not cond:
        failures.append(msg)
    return cond


def region_modes(b):
    """The region modes the driver logged it attached in."""
    return {m.group(1) for m in (re.search(r"attached: (\w+) region", l) for l in b.serial) if m}


def dmesg_clean(b, f):
    check(b.mark("dmesg-bad").get("count") == "0", f"{b.name}: guest dmesg has BUG/Oops/WARNING", f)


def main(g, report, smp):
    """`pvtest=main` over QEMU 7.2's multi-process proxy (guest region):
    attach, every slot written, the FIFO loop, irq bits, CPU hotplug, the
    load/unload cycles, dynamic IDs; and the pipe round trip without and
    with the module (reported, not asserted)."""
    b = Boot(g, f"main-smp{smp}", smp, "main", hooks=MAIN_HOOKS,
             extra_append=f"pvcycles={g.cycles} pvrounds={g.rounds}").run()
    f = assert_main(b, g.cycles)
    off, on = bench(b, "bench-off"), bench(b, "bench-on")
    ratio = f"{on / off:.3f}" if off and on else "n/a"
    sleeper = sum(s["rt_sleepers"].get(f"{abi.POLICY_FIFO}/9", 0) for s in b.final["slots"])
    report(f"{b.name}: {b.seconds:.1f}s boot-to-poweroff; pipe round trip "
           f"{off} ns without module, {on} ns with (ratio {ratio}); "
           f"{sleeper} device samples of the sleeping FIFO 9 task's report")
    return f


def vfio(g, report, region):
    """`pvtest=main` over vfio-user (QEMU 11, vfio-user-pci) in `region`
    mode: device (BAR2 mmapped by QEMU from the device's fd; with a churn
    that must cross no socket) or guest."""
    append = f"pvcycles={g.cycles} pvrounds={g.rounds} pvregion={region}"
    if region == "device":
        append += f" pvchurn={g.churn}"
    b = Boot(g, f"vfio-{region}-smp2", 2, "main", extra_append=append,
             transport="vfio-user", hooks=MAIN_HOOKS).run()
    f = assert_main(b, g.cycles)
    modes = region_modes(b)
    check(modes == {region}, f"{b.name}: driver attached in {modes or 'no'} region mode, "
          f"expected {region}", f)
    extra = ""
    if region == "device":
        churn_f, extra = assert_no_messages_during_churn(b)
        f += churn_f
        extra = "; " + extra
    report(f"{b.name}: {b.seconds:.1f}s boot-to-poweroff over vfio-user ({region} region){extra}")
    return f


def assert_main(b, cycles):
    f = []
    final = b.final
    dev = final["device"]
    probe = b.snapshots.get("probe") or {}
    b.mark("done")
    # 1. handshake reached DRIVER_OK (host view), once per successful insmod.
    check(any(s & abi.STATUS_DRIVER_OK for s in dev["statuses_seen"]),
          f"{b.name}: device never saw DRIVER_OK (statuses {dev['statuses_seen']})", f)
    check(probe.get("attached") and probe["device"]["status"] & abi.STATUS_DRIVER_OK,
          f"{b.name}: region not attached at '@@ probe'", f)
    expected_gen = 2 + cycles + 3
    check(dev["generation"] == expected_gen,
          f"{b.name}: GENERATION {dev['generation']}, expected {expected_gen} "
          f"(one DRIVER_OK per insmod)", f)
    # 2. rmmod resets the device; reload works.
    check(dev["status"] == 0 and not final["attached"],
          f"{b.name}: after the last rmmod STATUS is {dev['status']:#x}, attached={final['attached']}", f)
    check(dev["resets_seen"] >= expected_gen,
          f"{b.name}: {dev['resets_seen']} resets seen, expected >= {expected_gen}", f)
    check(not dev["errors_seen"], f"{b.name}: device refused something: errors {dev['errors_seen']}", f)
    # 3. every slot is written as the guest schedules: between the two
    #    views the guest ran context switches pinned to each CPU in turn
    #    (init.sh waits for the host's first view before it starts).
    slots = final["slots"]
    check(len(slots) == b.smp, f"{b.name}: {len(slots)} slots, expected {b.smp}", f)
    a, z = b.snapshots.get("each-cpu-start"), b.snapshots.get("each-cpu-end")
    if check(a and z and len(a["slots"]) == len(z["slots"]) == b.smp,
             f"{b.name}: no device view of every slot at each-cpu-start/each-cpu-end", f):
        for i, (s0, s1) in enumerate(zip(a["slots"], z["slots"])):
            check(s1["updates"] > s0["updates"],
                  f"{b.name}: slot {i} updates did not grow while every CPU context-switched "
                  f"({s0['updates']} -> {s1['updates']})", f)
    check("switch-failed" not in b.marks, f"{b.name}: {b.marks.get('switch-failed')}", f)
    # 4. FIFO 8 loop: seen on the slot of the CPU running it, and only there.
    cpu = int(b.mark("fifo-start")["cpu"])
    idx = next((i for i, s in enumerate(slots) if s["apic_id"] == cpu), None)
    check(idx is not None, f"{b.name}: no slot with APIC ID {cpu}", f)
    if idx is not None:
        key = f"{abi.POLICY_FIFO}/8/0"
        check(slots[idx]["seen"].get(key, 0) > 0,
              f"{b.name}: slot {idx} (cpu {cpu}) never showed FIFO prio 8: {slots[idx]['seen']}", f)
        others = [i for i, s in enumerate(slots) if i != idx and s["seen"].get(key, 0) > 0]
        check(not others, f"{b.name}: FIFO prio 8 showed on other slots {others}", f)
    # 4b. An RT task that sleeps between short runs (FIFO 9, 0.1 ms every
    #     10 ms): its CPU, idle in between, reports it as the RT sleeper
    #     (TASK_F_RT_SLEEPER with its policy and priority), only there.
    if idx is not None:
        ran_on = int(b.mark("rt-sleeper-start")["cpu"])
        check(ran_on == cpu, f"{b.name}: the RT sleeper ran on cpu {ran_on}, expected {cpu}", f)
        key = f"{abi.POLICY_FIFO}/9"
        check(slots[idx]["rt_sleepers"].get(key, 0) > 0,
              f"{b.name}: slot {idx} (cpu {cpu}) never reported the FIFO 9 task sleeping: "
              f"{slots[idx]['rt_sleepers']}", f)
        others = [i for i, s in enumerate(slots) if i != idx and s["rt_sleepers"]]
        check(not others, f"{b.name}: RT sleepers reported on other slots {others}", f)
    # 5. irq bits toggle (set in some samples, clear in others); the guest
    #    makes console interrupts until the host saw both (irq_answer).
    hard = sum(s["cs_set"][1] for s in slots)
    soft = sum(s["cs_set"][2] for s in slots)
    samples = sum(s["samples"] - s["failed_samples"] for s in slots)
    rounds = b.mark("irq-traffic-done").get("rounds")
    check(0 < hard < samples, f"{b.name}: HARDIRQ bit never toggled ({hard}/{samples} samples, "
          f"{rounds} rounds of console interrupts)", f)
    check(0 < soft < samples, f"{b.name}: SOFTIRQ bit never toggled ({soft}/{samples} samples, "
          f"{rounds} rounds of console interrupts)", f)
    # 6. CPU hotplug: the offline CPU's slot is neutral (the guest keeps
    #    the CPU offline until the host has this view), and written again
    #    by the CPU's online callback once it is back.
    off_snap = b.snapshots.get("cpu-offline") or {}
    on_snap = b.snapshots.get("cpu-online") or {}
    if idx is not None and off_snap.get("slots") and on_snap.get("slots"):
        s_off = off_snap["slots"][idx]
        check((s_off["policy"], s_off["rt_prio"], s_off["kern_cs"]) == (0, 0, 0),
              f"{b.name}: slot {idx} of offline cpu {cpu} not neutral: {s_off}", f)
        check(on_snap["slots"][idx]["updates"] > s_off["updates"],
              f"{b.name}: slot {idx} not written after cpu {cpu} came back online", f)
    else:
        check(False, f"{b.name}: no device view at '@@ cpu-offline'/'@@ cpu-online'", f)
    check(b.mark("cpu-offline").get("slot") == "-1", f"{b.name}: offline cpu still has a slot", f)
    check(b.mark("cpu-online").get("slot") == str(idx), f"{b.name}: cpu {cpu} did not re-attach", f)
    # 7. guest-side facts (supplementary): reloads bound, dmesg clean.
    cyc = b.mark("cycles")
    check(cyc.get("bound_ok") == str(cycles), f"{b.name}: only {cyc} load/unload cycles bound", f)
    check(b.mark("probe").get("bound") == "1", f"{b.name}: driver not bound after insmod", f)
    check(b.mark("reinsmod").get("bound") == "1", f"{b.name}: second insmod did not bind", f)
    # 8. vendor IDs go through the PCI core's dynamic IDs (init.sh
    #    new_id_check): the ABI's pair is refused as already matched, another
    #    pair is added (a second write is refused as a duplicate) and
    #    removed, and the device stays bound.
    nid = b.mark("new-id")
    check(nid == {"abi_refused": "1", "added": "1", "dup_refused": "1", "removed": "1",
                  "bound": "1"}, f"{b.name}: new_id/remove_id: {nid}", f)
    if "pvload=modprobe" in getattr(b.args, "load_append", ""):
        # The modprobe.d alias and install line of docs/guest-driver.md,
        # loaded by modalias as udev does (init.sh vendor_load).
        vl = b.mark("vendor-load")
        check(vl == {"rc": "0", "dynamic_id": "1", "bound": "1"},
              f"{b.name}: modprobe by a vendor's modalias with the documented "
              f"modprobe.d lines: {vl}", f)
    dmesg_clean(b, f)
    return f


def assert_no_messages_during_churn(b):
    """Device-region mode: the guest's slot updates cross no socket. The
    only messages are the driver's health check, one STATUS read per
    second (health_ms), whatever the update rate."""
    f = []
    start, end = b.snapshots.get("churn-start"), b.snapshots.get("churn-end")
    if not check(start and end, f"{b.name}: no device view at churn-start/churn-end", f):
        return f, "no churn view"
    before, after = start["device"]["messages"], end["device"]["messages"]
    msgs = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    msgs = {k: v for k, v in msgs.items() if v}
    reads = msgs.pop("region_read", 0)
    # The device's own clock between the two views: the messages counted
    # are those between them, however late the host read either.
    seconds = (end["elapsed_ms"] - start["elapsed_ms"]) / 1000
    updates = sum(s["updates"] for s in end["slots"]) - sum(s["updates"] for s in start["slots"])
    check(not msgs, f"{b.name}: vfio-user messages during the churn: {msgs}", f)
    check(reads <= seconds + 2, f"{b.name}: {reads} register reads in a {seconds:.1f}s churn "
          f"(the health check makes one a second)", f)
    check(updates >= 100_000, f"{b.name}: only {updates} slot updates during the churn", f)
    return f, (f"{updates} slot updates during the {seconds:.1f}s churn, {reads} vfio-user "
               f"messages (the driver's 1/s STATUS health check), none per update")


def negative(g, report, fault):
    """`pvsched-device --fault FAULT`: the probe must be refused and the
    device left reset."""
    b = Boot(g, f"neg-{fault}", 2, "negative", fault=fault).run()
    f = []
    dev = b.final["device"]
    b.mark("done")
    check(b.mark("neg-insmod").get("bound") == "0", f"{b.name}: driver bound despite {fault}", f)
    check(dev["generation"] == 0 and not any(s & abi.STATUS_DRIVER_OK for s in dev["statuses_seen"]),
          f"{b.name}: device reached DRIVER_OK despite {fault}", f)
    check(dev["status"] == 0, f"{b.name}: device left in STATUS {dev['status']:#x}, not reset", f)
    if fault in ("wrong-magic", "wrong-version"):
        # The driver refuses before acknowledging the device.
        check(set(dev["statuses_seen"]) <= {0},
              f"{b.name}: driver went on after {fault}: statuses {dev['statuses_seen']}", f)
    else:
        check(abi.ERR_REGION_OUTSIDE_RAM in dev["errors_seen"],
              f"{b.name}: device did not refuse the region: errors {dev['errors_seen']}", f)
        check(any(s & abi.STATUS_FAILED for s in dev["statuses_seen"]),
              f"{b.name}: STATUS never FAILED: {dev['statuses_seen']}", f)
    want = {"wrong-magic": "wrong MAGIC", "wrong-version": "version mismatch",
            "refuse-region": "region outside guest RAM"}[fault]
    check(any(want in l for l in b.serial), f"{b.name}: guest log does not name '{want}'", f)
    dmesg_clean(b, f)
    report(f"{b.name}: {b.seconds:.1f}s, probe refused")
    return f


def loss(g, report, how):
    """The device goes away while the driver is bound, over vfio-user:
    `kill` SIGKILLs the device process mid-run, `unplug` asks QEMU to
    device_del it (PCIe root port, the guest's hotplug driver unbinds)."""
    acted = {}

    def act(b):
        b.dump_live = False
        if how == "kill":
            b.dev.kill()
            acted["exit"] = b.dev.wait(timeout=10)
        else:
            acted["qmp"] = qmp(b.qmp_path, "device_del", {"id": "pvs0"})
        acted["at"] = time.monotonic() - b.t0
        b.answer("go")

    b = Boot(g, f"vfio-{how}-smp2", 2, "loss", hooks={"loss-wait": act},
             transport="vfio-user", hotplug=(how == "unplug"))
    b.run()
    f = []
    b.mark("done")
    check(b.mark("probe").get("bound") == "1", f"{b.name}: driver did not bind", f)
    after = b.mark("loss-after")
    lost_lines = [l for l in b.serial if "device lost (status" in l]
    status = None
    if lost_lines:
        m = re.search(r"device lost \(status (0x[0-9a-f]+)\)", lost_lines[0])
        status = int(m.group(1), 16) if m else None
    if how == "kill":
        check(acted.get("exit") == -signal.SIGKILL, f"{b.name}: device exit {acted.get('exit')}", f)
        check(after.get("bound") == "1" and after.get("lost") == "1",
              f"{b.name}: after the kill the driver is bound={after.get('bound')} "
              f"lost={after.get('lost')}, expected bound and lost", f)
        # QEMU answers reads of a dead vfio-user server with all ones (which
        # include DEVICE_NEEDS_RESET); a VMM that knows may set the bit alone.
        check(status is not None and (status == 0xFFFFFFFF or status & abi.STATUS_DEVICE_NEEDS_RESET),
              f"{b.name}: driver log names no lost STATUS (lines: {lost_lines})", f)
        check(any("detached from a lost device" in l for l in b.serial),
              f"{b.name}: rmmod did not detach from the lost device", f)
    else:
        check(after.get("bound") == "0", f"{b.name}: still bound after device_del", f)
        check(any("detached, device reset" in l for l in b.serial),
              f"{b.name}: no clean detach in the guest log", f)
        check(not lost_lines, f"{b.name}: an unplug was reported as a lost device", f)
    rm = b.mark("loss-rmmod")
    check(rm.get("rc") == "0" and rm.get("bound") == "0", f"{b.name}: rmmod {rm}", f)
    dmesg_clean(b, f)
    what = (f"device SIGKILLed at {acted.get('at', 0):.1f}s, driver saw STATUS "
            f"{status:#x}" if how == "kill" and status is not None else
            f"device_del at {acted.get('at', 0):.1f}s")
    report(f"{b.name}: {b.seconds:.1f}s; {what}; guest done at {b.marks['done'][0]:.1f}s, QEMU "
           f"exited {b.exit_s:.1f}s later; guest went on {after.get('waited_ms')} ms later with "
           f"bound={after.get('bound')}, rmmod rc={rm.get('rc')}, no oops")
    return f


HOSTILE_REFUSALS = {
    # init.sh mark -> what the driver's refusal must name
    "slots-outside": "outside the",
    "apic-duplicate": "in slots 0 and 1",
    "apic-range": "is out of range",
    "nr-vcpus": "vCPUs of 128 bytes (NR_VCPUS 2)",
}


def hostile(g, report):
    """The device corrupts the region header after DRIVER_OK (--fault
    hostile-header): the first four probes are refused, each naming what is
    wrong; the fifth header is rewritten with garbage after the driver
    validated it, and the driver goes on with what it validated."""
    b = Boot(g, "hostile-smp2", 2, "hostile", fault="hostile-header",
             hooks={"hostile-rewrite": answer_go}).run()
    f = []
    b.mark("done")
    for what, text in HOSTILE_REFUSALS.items():
        m = b.mark(f"hostile-{what}")
        # The module loads (rc 0) whether or not a device binds.
        check(m.get("bound") == "0",
              f"{b.name}: probe with a hostile header ({what}) not refused: {m}", f)
        check(any("pvsched" in l and text in l for l in b.serial),
              f"{b.name}: guest log does not name the {what} refusal ('{text}')", f)
    # Each kernel line shows twice (console, and finish's dmesg dump); its
    # timestamp makes each refusal distinct.
    refused = len({l for l in b.serial if "device wrote an invalid region header" in l})
    check(refused == len(HOSTILE_REFUSALS),
          f"{b.name}: {refused} probes refused for the header, expected {len(HOSTILE_REFUSALS)}", f)
    check(b.mark("hostile-rewrite").get("bound") == "1", f"{b.name}: fifth probe did not bind", f)
    after = b.mark("hostile-after")
    check(after.get("bound") == "1" and after.get("slot") == "1",
          f"{b.name}: after the header rewrite and a CPU hotplug: {after}", f)
    s0, s1 = b.snapshots.get("hostile-rewrite"), b.snapshots.get("hostile-after")
    if check(s0 and s1, f"{b.name}: no device view at hostile-rewrite/hostile-after", f):
        check(s1["header"] and s1["header"][2] == 0xFFFFFFFF,
              f"{b.name}: the device did not rewrite the header (header now {s1['header']})", f)
        for i in range(2):
            u0, u1 = s0["slots"][i]["updates"], s1["slots"][i]["updates"]
            check(u1 > u0, f"{b.name}: slot {i} not written after the rewrite ({u0} -> {u1})", f)
    dev = b.final["device"]
    check(dev["generation"] == 5, f"{b.name}: GENERATION {dev['generation']}, expected 5 "
          f"(five DRIVER_OKs)", f)
    check(dev["status"] == 0, f"{b.name}: device left in STATUS {dev['status']:#x}", f)
    rm = b.mark("rmmod")
    check(rm.get("rc") == "0" and rm.get("bound") == "0", f"{b.name}: rmmod {rm}", f)
    dmesg_clean(b, f)
    nr = f"{s1['header'][2]:#x}" if s1 and s1.get("header") else "?"
    report(f"{b.name}: {b.seconds:.1f}s; {refused} hostile headers refused "
           f"({', '.join(HOSTILE_REFUSALS)}), each named in the guest log; the 5th rewritten with "
           f"garbage after validation (device header now nr_vcpus {nr}), the driver still writes "
           f"both slots at the validated offsets through a CPU hotplug, rmmod rc={rm.get('rc')}, "
           f"no oops")
    return f


def upgrade(g, report, old, new):
    """`pvtest=upgrade`: the guest runs release `old`'s module (packed as
    /pvsched-prev.ko by Matrix.upgrade_guest), then, as after its package is upgraded to
    `new` (DKMS installed it in the module tree g packs), rmmod and
    modprobe: the new module must negotiate with the device again (a new
    DRIVER_OK, generation one higher) and write every slot."""
    b = Boot(g, "upgrade-smp2", 2, "upgrade",
             hooks={k: answer_go for k in ("upgrade-old", "upgrade-new", "upgrade-written")}).run()
    f = []
    b.mark("done")
    o, rm, n = b.mark("upgrade-old"), b.mark("upgrade-rmmod"), b.mark("upgrade-new")
    check(o == {"rc": "0", "bound": "1", "version": old},
          f"{b.name}: release {old}'s module: {o}", f)
    check(rm == {"rc": "0", "bound": "0"}, f"{b.name}: rmmod of release {old}: {rm}", f)
    check(n == {"rc": "0", "bound": "1", "version": new},
          f"{b.name}: modprobe after the upgrade to {new}: {n}", f)
    s0, s1, s2 = (b.snapshots.get(k) for k in ("upgrade-old", "upgrade-new", "upgrade-written"))
    gens = "?"
    if check(s0 and s1 and s2, f"{b.name}: no device view at upgrade-old/-new/-written", f):
        for s, v in ((s0, old), (s1, new)):
            check(s["attached"] and s["device"]["status"] & abi.STATUS_DRIVER_OK,
                  f"{b.name}: release {v}'s driver did not reach DRIVER_OK", f)
        g0, g1 = s0["device"]["generation"], s1["device"]["generation"]
        gens = f"{g0} -> {g1}"
        check(g1 == g0 + 1, f"{b.name}: GENERATION {gens} across the upgrade, expected +1", f)
        # The guest switched on every CPU between the two views, with only
        # release `new`'s module loaded.
        for i in range(2):
            u1, u2 = s1["slots"][i]["updates"], s2["slots"][i]["updates"]
            check(u2 > u1, f"{b.name}: slot {i} not written by release {new} ({u1} -> {u2})", f)
    check(b.mark("upgrade-written").get("bound") == "1",
          f"{b.name}: release {new} unbound while switching", f)
    check(not b.final["device"]["errors_seen"],
          f"{b.name}: device refused something: {b.final['device']['errors_seen']}", f)
    final_rm = b.mark("rmmod")
    check(final_rm.get("rc") == "0" and final_rm.get("bound") == "0",
          f"{b.name}: rmmod of release {new}: {final_rm}", f)
    dmesg_clean(b, f)
    report(f"{b.name}: {b.seconds:.1f}s; release {old}'s module bound, rmmod, release {new} "
           f"(DKMS) modprobed and bound, DRIVER_OK again (generation {gens}), both slots "
           f"written, no oops")
    return f


def loop_boot(g, loop, name, mode, **boot_kw):
    """A 2-vCPU boot driven by `loop`'s hooks (agent_loop.py and its kin),
    whose agent is stopped however the boot ends."""
    b = Boot(g, name, 2, mode, hooks=loop.hooks(), **boot_kw)
    try:
        b.run()
    finally:
        loop.stop_agent()
    return b


def agent(g, report):
    """pvsched-agent-attach on QEMU's vCPU threads, guest region over the
    multi-process proxy (agent_loop.py)."""
    name = "agent-smp2"
    loop = AgentLoop(g, g.out / name)
    b = loop_boot(g, loop, name, "agent")
    f, summary = loop.check(b)
    report(f"{b.name}: {b.seconds:.1f}s; {summary}")
    report(f"{b.name}: attach {loop.info}")
    return f


def daemon(g, report):
    """Policy on a QEMU guest in device-region mode: BAR2 is pvschedd's
    region map (daemon_loop.py); pvschedd is stopped however the boot
    ends."""
    name = "vfio-daemon-smp2"
    loop = DaemonLoop(g, g.out / name)
    loop.start_daemon()
    try:
        b = loop_boot(g, loop, name, "agent", transport="vfio-user",
                      device_cmd=loop.device_cmd())
    finally:
        loop.stop_daemon()
    f, summary = loop.check(b)
    modes = region_modes(b)
    check(modes == {"device"}, f"{b.name}: driver attached in {modes or 'no'} region mode, "
          f"expected device", f)
    report(f"{b.name}: {b.seconds:.1f}s; {summary}")
    report(f"{b.name}: attach {loop.info}")
    return f


def foreign(g, report):
    """BAR2 is pvschedd's region (device-region mode over vfio-user, as
    `daemon`); once the driver is bound, another host process (this one,
    holding the region as root's device process does) writes garbage over
    the region header and every slot's host half, and rewrites it every
    millisecond through a CPU hotplug and three reloads. The driver keeps
    writing its slots where it validated them, each probe under the
    rewrites binds or is refused naming a header check, and nothing oopses:
    the driver reads the header once per probe and the host halves never."""
    name = "foreign-smp2"
    loop = DaemonLoop(g, g.out / name)
    loop.start_daemon()
    writer = {}

    def bound(b):
        writer["w"] = ForeignWriter(loop.socket, DAEMON_VM)
        writer["w"].corrupt()
        b.answer("go")

    def stop(b):
        if "w" in writer:
            writer["w"].stop()
        b.answer("go")

    try:
        b = Boot(g, name, 2, "foreign", transport="vfio-user", device_cmd=loop.device_cmd(),
                 hooks={"foreign-bound": bound, "foreign-after": answer_go,
                        "foreign-stop": stop}).run()
    finally:
        if "w" in writer:
            writer["w"].stop()
        loop.stop_daemon()
    f = []
    w = writer.get("w")
    check(w is not None and w.header["magic"] != 0xFFFFFFFF,
          f"{b.name}: no valid header to corrupt at foreign-bound", f)
    check(b.mark("foreign-bound").get("bound") == "1", f"{b.name}: driver did not bind", f)
    check(region_modes(b) == {"device"}, f"{b.name}: not in device-region mode", f)
    after = b.mark("foreign-after")
    check(after.get("bound") == "1" and after.get("slot") == "1",
          f"{b.name}: after the rewrites and a CPU hotplug: {after}", f)
    s0, s1 = b.snapshots.get("foreign-bound"), b.snapshots.get("foreign-after")
    if check(s0 and s1, f"{b.name}: no device view at foreign-bound/foreign-after", f):
        for i in range(2):
            u0, u1 = s0["slots"][i]["updates"], s1["slots"][i]["updates"]
            check(u1 > u0, f"{b.name}: slot {i} not written after the rewrites ({u0} -> {u1})", f)
    outcomes = [b.mark(f"foreign-reload-{i}").get("bound") for i in (1, 2, 3)]
    check(all(o in ("0", "1") for o in outcomes), f"{b.name}: reloads {outcomes}", f)
    refused = len({l for l in b.serial if "device wrote an invalid region header" in l})
    check(refused == outcomes.count("0"),
          f"{b.name}: {outcomes.count('0')} reloads unbound, {refused} refused for the header", f)
    rm = b.mark("rmmod")
    check(rm.get("rc") == "0" and rm.get("bound") == "0", f"{b.name}: rmmod {rm}", f)
    dmesg_clean(b, f)
    report(f"{b.name}: {b.seconds:.1f}s; another process rewrote the header and host halves "
           f"{w.writes if w else 0} times; slots written at their validated offsets through a "
           f"CPU hotplug; reloads under the rewrites: {outcomes.count('1')} bound, "
           f"{refused} refused naming the header; rmmod rc={rm.get('rc')}, no oops")
    return f


def wait(g, report):
    """wait_on from the guest and the policy's directed yield (wait_loop.py)."""
    name = "wait-smp2"
    loop = WaitLoop(g, g.out / (name + g.tag))
    b = loop_boot(g, loop, name, "wait")
    f, summary = loop.check(b)
    dmesg_clean(b, f)
    report(f"{b.name}: {b.seconds:.1f}s; {summary}")
    return f


def attach(g, report, cycles=5, smp="2", apic_ids=(0, 1)):
    """`pvsched attach` / `pvsched detach` `cycles` times on a running
    guest started with no device (attach_loop.py), QEMU's `-smp SMP`
    giving the vCPUs `apic_ids`."""
    name = f"attach-smp{smp.split(',')[0]}"
    loop = AttachLoop(g, g.out / (name + "-host" + g.tag), cycles, list(apic_ids))
    loop.start_daemon()
    b = Boot(g, name, smp, "attach", hooks=loop.hooks(), transport="none", hotplug=True)
    try:
        b.run()
    finally:
        loop.stop_daemon()
        for pid in loop.device_pids():
            os.kill(pid, signal.SIGKILL)
    f = list(loop.errors)
    check(len(loop.results) == cycles and "detach_s" in loop.results[-1],
          f"{b.name}: {len(loop.results)} of {cycles} attach/detach cycles done", f)
    check(loop.incoming_said is not None, f"{b.name}: the incoming-migration case did not run", f)
    rm = b.mark("rmmod")
    check(rm.get("rc") == "0", f"{b.name}: rmmod {rm}", f)
    dmesg_clean(b, f)
    per = "; ".join(f"{r['cycle']}: attach {r.get('attach_s')} s, slots' seq "
                    f"+{r.get('slot_updates')}, {r.get('boosts')} boosts, "
                    f"detach {r.get('detach_s')} s, unbound in {r.get('unbound_ms')} ms"
                    for r in loop.results)
    again = loop.results[0].get("again", "") if loop.results else ""
    report(f"{b.name}: {b.seconds:.1f}s; -smp {smp}; {cycles} cycle(s) of attach/detach with "
           f"QEMU 11 and pvschedd, device APIC IDs "
           f"{loop.results[0].get('apic') if loop.results else '?'}: {per}; "
           f"attach again: {again!r}; to an incoming QEMU: {loop.incoming_said!r}")
    return f


def migrate(g, report, migrations=3):
    """`pvsched migrate` of a running guest with the device, QEMU 11 to
    QEMU 11, `migrations` times, then one that fails (migrate_loop.py)."""
    loop = MigrateLoop(g, g.out / ("migrate" + g.tag))
    t0 = time.monotonic()
    loop.start_daemon()
    try:
        loop.run(migrations)
    finally:
        loop.stop()
    per = "; ".join(f"{r['n']}: {r['secs']} s, slots' seq +{r['seq']} on the destination"
                    for r in loop.results)
    report(f"migrate{g.tag}: {time.monotonic() - t0:.1f}s; {migrations} live migrations, QEMU "
           f"11 to QEMU 11: {per}; e.g. {loop.results[0]['said']!r}; a failing one: "
           f"{loop.aborted['said']!r}, the source's slots' seq +{loop.aborted['seq']}")
    return []


def bench(b, key):
    """Median ns per pipe round trip over the interleaved runs `key-1..3`."""
    vals = sorted(float(m[1]["ns_per_round_trip"]) for k, m in b.marks.items()
                  if k.startswith(key + "-") and "ns_per_round_trip" in m[1])
    return vals[len(vals) // 2] if vals else None
