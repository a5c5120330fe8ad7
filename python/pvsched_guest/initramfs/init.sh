#!/bin/busybox sh
# /init of the pvsched Linux-guest test initramfs. Prints "@@ <event>"
# markers on the serial console; the host harness (pytest) asserts on the
# device's view of the region, and uses these lines only to pace itself and
# as supplementary evidence. Mode from the kernel command line:
#   pvtest=main      attach, schedule, FIFO loop, irqs, 20 load/unload cycles
#   pvtest=negative  probe must fail (the device misbehaves on purpose)
#   pvtest=agent     FIFO 8 loop on CPU 1 with the host policy agent attached
#   pvtest=bench     sources /bench.sh (pvsched_bench/guest/s4.sh or s6.sh,
#                    added by the S4 and S6 benchmarks), then finishes
#   pvtest=loss      the host takes the device away while the driver is bound
#                    (kills the device process, or device_del), then reports
#                    whether the driver noticed, goes on, and rmmod works
#   pvtest=wait      like agent, but CPU 0 makes synchronous cross-CPU calls
#                    to CPU 1 (membarrier) instead of the FIFO loop: wait_on
#   pvtest=hostile   the device corrupts the region header (--fault
#                    hostile-header): four probes refused, the fifth binds and
#                    has its header overwritten after validation
#   pvtest=upgrade   release N's module (/pvsched-prev.ko) runs, then the
#                    installed N+1 replaces it as after a package upgrade
#   pvtest=attach    no device at boot: the host hot-plugs it (`pvsched
#                    attach`) and unplugs it (`pvsched detach`) again and
#                    again while the module stays loaded; once bound, every
#                    CPU switches and CPU 1 runs a FIFO 8 loop for 1 s
#   pvtest=report    no device at boot, no console answers: the module
#                    loaded, then every CPU switches every 0.2 s until the
#                    guest is powered off (a device plugged later sees every
#                    slot written); "@@ report bound=N" at each change
#   pvtest=foreign   BAR2 is pvschedd's region (vfio-user, --daemon-region);
#                    another host process maps the same region and writes
#                    garbage over its header and the host halves, once
#                    bound and then without pause through three reloads
# and: pvregion=guest loads the module with use_device_region=0; pvchurn=N
# runs N pipe round trips (2N context switches, so about 2N slot updates)
# between "@@ churn-start" and "@@ churn-end" right after the first probe;
# pvload=modprobe loads the module with kmod's modprobe from
# /lib/modules/$(uname -r) (a DKMS-installed tree) instead of insmod.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t debugfs debugfs /sys/kernel/debug
# A quiet boot's console shows warnings from here on, and with them a soft
# lockup's registers and backtraces (logged at the default level, which
# "quiet" hides); info lines stay off it.
if grep -qw quiet /proc/cmdline; then
	echo 5 > /proc/sys/kernel/printk
fi

mode=main
pin=1
cycles=20
rounds=20000
modargs=
churn=0
loader=insmod
for w in $(cat /proc/cmdline); do
	case "$w" in
	pvtest=*) mode=${w#pvtest=} ;;
	pvcycles=*) cycles=${w#pvcycles=} ;;
	pvrounds=*) rounds=${w#pvrounds=} ;;
	pvpin=*) pin=${w#pvpin=} ;;
	pvregion=guest) modargs=use_device_region=0 ;;
	pvchurn=*) churn=${w#pvchurn=} ;;
	pvload=*) loader=${w#pvload=} ;;
	esac
done
ncpu=$(nproc)

# Under QEMU TCG a vCPU can go on executing a stale translation of kernel
# text that another vCPU has just patched (when the write lands while it is
# translating that code). The kernel patches live text through an INT3: a
# vCPU left with a stale INT3 traps, finds no INT3 in memory, returns to the
# same instruction (kprobe_int3_handler: "the breakpoint was removed") and
# traps again, forever. In code that runs with interrupts off (sched_switch
# in __schedule) it then never answers the patching CPU's sync IPI, and
# insmod or rmmod spins in smp_call_function_many_cond until the soft-lockup
# watchdog fires (seen here in both, and in a boot with all CPUs stuck).
# Adding or removing a tracepoint probe patches text whenever the tracepoint
# goes between 0, 1 and 2 probes (its static key; its static call, direct to
# a single probe and to the iterator otherwise). So each hooked event is
# enabled in two trace instances (tracing_on=0: nothing is recorded) and the
# module only ever takes a tracepoint from 2 probes to 3 and back, which
# swaps the probe array and patches nothing. The patching those two need is
# done with the other CPUs offline, where no vCPU can race it. pvpin=0 turns
# this off. Not needed on hardware or KVM. $pinned counts the events enabled
# (two per hooked tracepoint this kernel has; the host checks it).
pinned=0
pin_events() {
	t=/sys/kernel/tracing
	mount -t tracefs tracefs $t
	c=1
	while [ $c -lt "$ncpu" ]; do
		echo 0 > "/sys/devices/system/cpu/cpu$c/online"
		c=$((c + 1))
	done
	mkdir $t/instances/pvpin
	for d in $t $t/instances/pvpin; do
		echo 0 > $d/tracing_on
		echo 4 > $d/buffer_size_kb
		for e in sched/sched_switch sched/sched_waking \
			irq/irq_handler_entry irq/irq_handler_exit \
			irq/softirq_entry irq/softirq_exit \
			csd/csd_queue_cpu csd/csd_function_exit \
			lock/contention_begin lock/contention_end; do
			[ -e "$d/events/$e/enable" ] || continue
			echo 1 > "$d/events/$e/enable" && pinned=$((pinned + 1))
		done
	done
	c=1
	while [ $c -lt "$ncpu" ]; do
		echo 1 > "/sys/devices/system/cpu/cpu$c/online"
		c=$((c + 1))
	done
}
if [ "$pin" = 1 ] && [ "$mode" != bench ]; then
	pin_events
fi
echo "@@ boot mode=$mode cpus=$ncpu pin=$pin pinned=$pinned kernel=$(uname -r) loader=$loader"

# load: the module, by insmod of /pvsched.ko or, with pvload=modprobe, by
# modprobe from the module tree (the harness packs /lib/modules/VERSION with
# the DKMS-built pvsched and kmod's modprobe).
load() {
	if [ "$loader" = modprobe ]; then
		/usr/sbin/modprobe pvsched $modargs
	else
		insmod /pvsched.ko $modargs
	fi
}

stat_of() {
	awk -v k="$1" '$1 == k { print $2 }' /sys/kernel/debug/pvsched/stats 2>/dev/null
}

# column_sum NAME: column NAME of the driver's per-CPU counter table,
# summed over CPUs.
column_sum() {
	awk -v k="$1" '$1 == "cpu" && $2 == "slot" {
		for (i = 1; i <= NF; i++) if ($i == k) c = i
		next
	}
	c && $1 ~ /^[0-9]+$/ { n += $c }
	END { print n + 0 }' /sys/kernel/debug/pvsched/stats
}

# slot_of CPU: the slot debugfs shows for CPU (-1 while it has none).
slot_of() {
	awk -v c="$1" '$1 == c && NF >= 6 { print $2 }' /sys/kernel/debug/pvsched/stats
}

bound() {
	ls /sys/bus/pci/drivers/pvsched/ 2>/dev/null | grep -c '^0000:'
}

# A device with a vendor's own IDs is bound through the PCI core's dynamic
# IDs (docs/guest-driver.md). The test device has the ABI's IDs, fixed, so
# nothing here binds by another ID; 5056:5c4f stands for a vendor's pair
# (no device has it). new_id refuses a pair the driver already matches, so
# a refused second write shows the first one added it.
new_id_check() {
	d=/sys/bus/pci/drivers/pvsched
	abi=0 added=0 dup=0 removed=0
	echo 5056 5c4e > $d/new_id 2>/dev/null || abi=1
	echo 5056 5c4f > $d/new_id && added=1
	echo 5056 5c4f > $d/new_id 2>/dev/null || dup=1
	echo 5056 5c4f > $d/remove_id && removed=1
	echo "@@ new-id abi_refused=$abi added=$added dup_refused=$dup removed=$removed bound=$(bound)"
}

# vendor_load: load the module as udev would for a device with a vendor's
# IDs, with the modprobe.d file docs/guest-driver.md gives: by modalias,
# with kmod's modprobe (pvload=modprobe only; busybox's ignores install
# lines). The device binds through the id table; checked is that kmod took
# the alias and ran the install line, which added the pair as a dynamic ID.
vendor_load() {
	mkdir -p /etc/modprobe.d /sbin
	[ -e /sbin/modprobe ] || ln -s /usr/sbin/modprobe /sbin/modprobe
	cat > /etc/modprobe.d/pvsched-ids.conf <<'EOF'
alias pci:v00005056d00005C4Fsv*sd*bc*sc*i* pvsched
install pvsched /sbin/modprobe --ignore-install pvsched $CMDLINE_OPTS && echo 5056 5c4f > /sys/bus/pci/drivers/pvsched/new_id
EOF
	/sbin/modprobe pci:v00005056d00005C4Fsv00005056sd00000001bc08sc80i00
	rc=$?
	dup=0
	echo 5056 5c4f > /sys/bus/pci/drivers/pvsched/new_id 2>/dev/null || dup=1
	rm /etc/modprobe.d/pvsched-ids.conf
	echo "@@ vendor-load rc=$rc dynamic_id=$dup bound=$(bound)"
	return $rc
}

# host_sync KEY [FIELDS]: print "@@ KEY FIELDS", then wait for the host's
# answer on the console (in $answer). The host answers once it holds the
# device's view of the region for that mark, so the view is from before
# whatever the guest does next: a check on what happened between two marks
# then depends on what the guest did, not on how fast the host looked.
host_sync() {
	echo "@@ $*"
	answer=
	read -t 120 -r answer
}

# switch_each_cpu: context switches on every CPU in turn (a pipe ping-pong
# pinned to it, two switches per round trip), so every CPU writes its slot.
# An idle CPU may otherwise go a long while without a switch or an
# interrupt hook. All CPUs must be online.
switch_each_cpu() {
	c=0
	while [ $c -lt "$ncpu" ]; do
		/pvsched-helper pingpong 50 "$c" >/dev/null || echo "@@ switch-failed cpu=$c"
		c=$((c + 1))
	done
}

# hotplug_last: every CPU switches, the last CPU ($last) goes offline and
# online again, and every CPU switches once more (the driver must find its
# slot for a CPU that came back).
hotplug_last() {
	switch_each_cpu
	last=$((ncpu - 1))
	echo 0 > "/sys/devices/system/cpu/cpu$last/online"
	echo 1 > "/sys/devices/system/cpu/cpu$last/online"
	switch_each_cpu
}

# bench_serve RUN: the benchmarks' command loop (pvtest=bench; /bench.sh
# calls it). Prints "@@ bench-wait" and reads one command line from the
# host: "run ARGS..." calls RUN ARGS...; "stats" prints the driver's
# debugfs counters between "@@ stats-begin" and "@@ stats-end"; anything
# else, or no command within 15 minutes, ends the loop.
bench_serve() {
	while :; do
		echo "@@ bench-wait"
		if ! read -t 900 -r cmd args; then
			echo "@@ bench-timeout"
			break
		fi
		case "$cmd" in
		run)
			# shellcheck disable=SC2086 # the host's words, split on purpose
			"$1" $args
			;;
		stats)
			echo "@@ stats-begin"
			cat /sys/kernel/debug/pvsched/stats
			echo "@@ stats-end"
			;;
		*)
			break
			;;
		esac
	done
}

finish() {
	bad=$(dmesg | grep -cE 'BUG|Oops|WARNING|KASAN|Call Trace')
	echo "@@ dmesg-bad count=$bad"
	dmesg | grep -E 'pvsched|BUG|Oops|WARNING|KASAN' | tail -n 40
	echo "@@ done"
	poweroff -f
}

if [ "$mode" = negative ]; then
	load
	echo "@@ neg-insmod rc=$? bound=$(bound)"
	dmesg | grep pvsched
	rmmod pvsched
	echo "@@ neg-rmmod rc=$?"
	finish
fi

if [ "$mode" = bench ] && [ -f /bench.sh ]; then
	. /bench.sh
	finish
fi

if [ "$mode" = loss ]; then
	# After "@@ loss-wait" the host kills the device process or unplugs the
	# device (QMP device_del) and answers "go". The guest must keep
	# running: the driver notices within health_ms (1 s) or is unbound.
	load
	echo "@@ probe bound=$(bound)"
	/pvsched-helper pingpong 500 0 >/dev/null
	echo "@@ loss-wait"
	read -t 120 -r answer
	echo "@@ loss-go answer=$answer"
	i=0
	while [ $i -lt 40 ]; do
		dmesg | grep -qE 'pvsched.*(device lost|detached)' && break
		sleep 0.5
		i=$((i + 1))
	done
	/pvsched-helper pingpong 2000 0 >/dev/null
	lost=$(stat_of lost)
	echo "@@ loss-after bound=$(bound) lost=${lost:-none} waited_ms=$((i * 500))"
	dmesg | grep -E 'pvsched' | tail -n 5
	rmmod pvsched
	echo "@@ loss-rmmod rc=$? bound=$(bound)"
	finish
fi

if [ "$mode" = upgrade ]; then
	# A guest running release N's module when its package is upgraded to
	# N+1 (DKMS installed N+1 in the module tree): rmmod, then modprobe
	# loads N+1, which must negotiate with the device again.
	insmod /pvsched-prev.ko $modargs
	rc=$?
	switch_each_cpu
	host_sync upgrade-old rc=$rc bound=$(bound) version=$(cat /sys/module/pvsched/version)
	rmmod pvsched
	echo "@@ upgrade-rmmod rc=$? bound=$(bound)"
	load
	host_sync upgrade-new rc=$? bound=$(bound) version=$(cat /sys/module/pvsched/version)
	# Every CPU switches: the new module's slots must move from the
	# host's view at upgrade-new to the one at upgrade-written.
	switch_each_cpu
	host_sync upgrade-written bound=$(bound)
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
	finish
fi

if [ "$mode" = report ]; then
	# For a host that plugs the device on its own (the libvirt hook), with
	# nothing read from the console.
	load
	was=x
	while :; do
		now=$(bound)
		if [ "$now" != "$was" ]; then
			echo "@@ report bound=$now"
			was=$now
		fi
		switch_each_cpu
		sleep 0.2
	done
fi

if [ "$mode" = attach ]; then
	# The host answers "bound" after each attach, "unbound" after each
	# detach, anything else to end; the guest waits (at most 60 s) for
	# the PCI core to bind or unbind the driver, which the hot-plug
	# driver does on its own.
	load
	host_sync attach-loaded rc=$? bound=$(bound)
	while [ "$answer" = bound ] || [ "$answer" = unbound ]; do
		want=0
		[ "$answer" = bound ] && want=1
		n=0
		while [ "$(bound)" != $want ] && [ $n -lt 600 ]; do
			sleep 0.1
			n=$((n + 1))
		done
		if [ "$(bound)" = 1 ]; then
			switch_each_cpu
			/pvsched-helper spin 1 8 1
		fi
		host_sync attach-state want=$want bound=$(bound) waited_ms=$((n * 100))
	done
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
	finish
fi

if [ "$mode" = foreign ]; then
	load
	host_sync foreign-bound rc=$? bound=$(bound)
	# The host has rewritten the header and keeps rewriting it: the
	# driver writes its slots where it validated them, through a hotplug.
	hotplug_last
	host_sync foreign-after bound=$(bound) slot=$(slot_of "$last")
	# Probes under the rewrites: each binds (the header read whole
	# between two rewrites) or is refused naming the check; nothing else.
	for i in 1 2 3; do
		rmmod pvsched
		load
		echo "@@ foreign-reload-$i rc=$? bound=$(bound)"
		switch_each_cpu
	done
	host_sync foreign-stop
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
	finish
fi

if [ "$mode" = hostile ]; then
	# The device overwrites the header it wrote at each DRIVER_OK: offsets
	# outside the region, an APIC ID twice, an APIC ID out of range, a
	# vCPU count unlike NR_VCPUS; each probe must be refused, naming it.
	for what in slots-outside apic-duplicate apic-range nr-vcpus; do
		load
		echo "@@ hostile-$what rc=$? bound=$(bound)"
		rmmod pvsched
	done
	# The fifth header is valid while the driver checks it and garbage
	# right after: the driver must go on with what it validated.
	load
	host_sync hostile-rewrite rc=$? bound=$(bound)
	hotplug_last
	echo "@@ hostile-after bound=$(bound) slot=$(slot_of "$last")"
	cat /sys/kernel/debug/pvsched/stats
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
	finish
fi

if [ "$mode" = wait ]; then
	# The host attaches the policy after DRIVER_OK and answers "go"; then
	# CPU 0 makes synchronous calls to CPU 1 (membarrier) for 3 s, then
	# CPUs 0 and 1 contend for one pipe's mutex for 3 s (lock waits).
	load
	echo "@@ probe bound=$(bound) wait_on=$(stat_of wait_on) lock_wait=$(stat_of lock_wait) sync_counts=$(stat_of sync_counts)"
	echo "@@ agent-wait"
	read -t 120 -r answer
	echo "@@ agent-go answer=$answer"
	sleep 1
	echo "@@ wait-start from=0 to=1"
	out=$(/pvsched-helper membarrier 3 0 1)
	echo "@@ wait-end $out"
	n0=$(column_sum lock_waits)
	echo "@@ lock-start"
	out=$(/pvsched-helper lock 3 0 1)
	echo "@@ lock-end $out lock_waits=$(($(column_sum lock_waits) - n0))"
	cat /sys/kernel/debug/pvsched/stats
	sleep 2
	host_sync idle-end
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
	finish
fi

if [ "$mode" = agent ]; then
	# The host attaches pvsched-agent-attach to QEMU's vCPU threads after
	# DRIVER_OK and answers "go" on the console; then a FIFO 8 busy loop on
	# CPU 1, then idle while the host checks the vCPU thread went back to
	# its baseline.
	load
	echo "@@ probe bound=$(bound)"
	echo "@@ agent-wait"
	read -t 120 -r answer
	echo "@@ agent-go answer=$answer"
	sleep 1
	echo "@@ fifo-start cpu=1"
	/pvsched-helper spin 3 8 1
	echo "@@ fifo-end cpu=1"
	sleep 3
	host_sync idle-end
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
	finish
fi

load
echo "@@ probe bound=$(bound)"
cat /sys/kernel/debug/pvsched/stats
new_id_check
if [ "$churn" -gt 0 ]; then
	host_sync churn-start rounds=$churn
	/pvsched-helper pingpong "$churn" 0 >/dev/null
	echo "@@ churn-end"
fi
host_sync each-cpu-start
switch_each_cpu
echo "@@ each-cpu-end cpus=$ncpu"

# Hard and soft interrupts: lines written to the console go out through the
# UART's transmit interrupt, the host's answer comes in through its receive
# interrupt. The device sees a kern_cs bit only if one of its samples lands
# while the bit is set, so the host answers "more" until it has seen both
# bits, and "go" then (at most 20 rounds of 40 lines).
r=0
while [ $r -lt 20 ]; do
	i=0
	while [ $i -lt 40 ]; do
		echo "irq traffic line $i ........................................"
		i=$((i + 1))
	done
	r=$((r + 1))
	host_sync irq-traffic round=$r
	[ "$answer" = more ] || break
done
echo "@@ irq-traffic-done rounds=$r"

last=$((ncpu - 1))
echo "@@ fifo-start cpu=$last"
/pvsched-helper spin 3 8 "$last"
echo "@@ fifo-end cpu=$last"
# An RT task that sleeps between short runs: its CPU idles in between and
# reports it (TASK_F_RT_SLEEPER).
echo "@@ rt-sleeper-start cpu=$last"
/pvsched-helper periodic 2 9 "$last"
echo "@@ rt-sleeper-end cpu=$last"
cat /sys/kernel/debug/pvsched/stats

# CPU hotplug with the module loaded: the CPU's slot is left neutral while
# it is offline and re-attached when it comes back.
echo 0 > "/sys/devices/system/cpu/cpu$last/online"
host_sync cpu-offline cpu=$last slot=$(slot_of "$last")
echo 1 > "/sys/devices/system/cpu/cpu$last/online"
echo "@@ cpu-online cpu=$last slot=$(slot_of "$last")"

rmmod pvsched
echo "@@ rmmod rc=$? bound=$(bound)"
sleep 1
if [ "$loader" = modprobe ]; then
	vendor_load
else
	load
fi
echo "@@ reinsmod rc=$? bound=$(bound)"

i=0
ok=0
while [ $i -lt "$cycles" ]; do
	rmmod pvsched || break
	load || break
	[ "$(bound)" = 1 ] && ok=$((ok + 1))
	i=$((i + 1))
done
echo "@@ cycles done=$i bound_ok=$ok"

# Hook cost: the same context-switch workload (pipe ping-pong, both ends on
# CPU 0) without and with the module, interleaved three times.
for r in 1 2 3; do
	rmmod pvsched
	echo "@@ bench-off-$r $(/pvsched-helper pingpong "$rounds" 0)"
	load
	echo "@@ bench-on-$r $(/pvsched-helper pingpong "$rounds" 0)"
done
rmmod pvsched
echo "@@ final-rmmod rc=$?"
finish
