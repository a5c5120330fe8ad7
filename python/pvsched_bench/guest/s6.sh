# Guest side of the S6 benchmark (pvsched_bench/s6.py): sourced by the
# test initramfs's /init (pvsched_guest/initramfs/init.sh) in `pvtest=bench`
# mode, which then prints "@@ done" and powers off.
#
# Loads the pvsched module (the DKMS-built one, by modprobe; not with
# pvload=none: the `none` variant, which has no device either), then serves
# commands the host writes on the console, one per "@@ bench-wait"
# (bench_serve, init.sh):
#   run WORKLOAD DURATION_S [MIN_ITERS]
#       runs WORKLOAD (below) on every CPU for about DURATION_S seconds
#       (hackbench: and at least MIN_ITERS invocations) and
#       prints "@@ result w=WORKLOAD rc=RC secs=ELAPSED iters=N
#       ipi_res=N ipi_cal=N ipi_tlb=N" (the IPIs below, received), with the
#       tool's own output between "@@ out-begin" and "@@ out-end"
#   stats   the driver's debugfs counters between "@@ stats-begin" and
#           "@@ stats-end"
#   quit    (or anything else, or no command within 15 minutes): unload.
#
# Workloads (Debian's programs, from the kernel's suite chroot):
#   cpu         stress-ng --cpu N --cpu-method int64: compute-bound, almost
#               no synchronisation (the control that must not regress)
#   tlb         stress-ng --tlb-shootdown N: mprotect/munmap of memory the
#               other CPUs' threads touch (TLB-shootdown IPIs)
#   membarrier  stress-ng --membarrier N: membarrier(2) expedited (IPIs)
#   hackbench   hackbench -g 2 -f 10 -l 10 (sockets, 2 groups of 20
#               processes, 2000 messages) again and again until the
#               duration has passed and it ran MIN_ITERS times: each
#               invocation's own `Time:` is printed, so that the host rates
#               the messages by hackbench's timing, not the loop's
#   dbench      dbench -t DURATION 2N on tmpfs (VFS and its locks)
# N is the number of online CPUs.

# stress-ng needs /dev/shm; dbench writes its files under /tmp/dbench.
mkdir -p /dev/shm /tmp/dbench
mount -t tmpfs tmpfs /dev/shm
if [ "$loader" != none ]; then
	load
fi
echo "@@ probe bound=$(bound)"
echo 1 >/proc/sys/kernel/sched_schedstats 2>/dev/null || true

uptime_s() {
	read -r up _ </proc/uptime
	echo "$up"
}

# The guest's interprocessor interrupts so far, summed over its CPUs, as
# "res=N cal=N tlb=N": rescheduling (a wake-up on another CPU), function
# call (smp_call_function*, which TLB flushes use) and TLB shootdowns
# received. What a workload asks of IPIs is what co-scheduling can speed up.
# Then "rwk=N csw=N": wake-ups of a task by another CPU than its own
# (/proc/schedstat's ttwu_count - ttwu_local, summed; schedstats are on for
# the run) and context switches (/proc/stat ctxt): how much the workload's
# tasks hand work to each other across vCPUs.
ipis() {
	awk '$1 == "RES:" || $1 == "CAL:" || $1 == "TLB:" {
		s = 0
		for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++)
			s += $i
		printf "%s=%d ", tolower(substr($1, 1, 3)), s
	}' /proc/interrupts
	awk '$1 ~ /^cpu[0-9]+$/ { s += $6 - $7 } END { printf "rwk=%d ", s }' /proc/schedstat
	awk '$1 == "ctxt" { printf "csw=%d ", $2 }' /proc/stat
}

# The difference of two ipis() readings, in the same form.
ipis_delta() {
	echo "$1 $2" | awk '{
		for (i = 1; i <= NF; i++) {
			split($i, kv, "=")
			if (kv[1] in a)
				printf "ipi_%s=%d ", kv[1], kv[2] - a[kv[1]]
			else
				a[kv[1]] = kv[2]
		}
	}'
}

# Elapsed seconds between two /proc/uptime readings (two decimals).
elapsed() {
	awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'
}

run_workload() {
	w=$1
	dur=$2
	min_iters=${3:-1}
	iters=1
	case "$w" in
	cpu | batch | tlb | membarrier)
		case "$w" in
		cpu) opt="--cpu $ncpu --cpu-method int64" ;;
		batch) opt="--cpu $((3 * ncpu)) --cpu-method int64" ;;
		tlb) opt="--tlb-shootdown $ncpu" ;;
		membarrier) opt="--membarrier $ncpu" ;;
		esac
		# shellcheck disable=SC2086
		/usr/bin/stress-ng $opt -t "$dur" --metrics-brief -Y /tmp/out.yaml >/tmp/out.log 2>&1
		rc=$?
		cat /tmp/out.yaml /tmp/out.log
		;;
	hackbench)
		end=$(awk -v a="$(uptime_s)" -v d="$dur" 'BEGIN { print a + d }')
		iters=0
		rc=0
		: >/tmp/out.log
		while [ "$iters" -lt "$min_iters" ] ||
			awk -v now="$(uptime_s)" -v end="$end" 'BEGIN { exit !(now < end) }'; do
			/usr/bin/hackbench -g 2 -f 10 -l 10 >>/tmp/out.log 2>&1 || {
				rc=$?
				break
			}
			iters=$((iters + 1))
		done
		grep -E '^Time:' /tmp/out.log
		[ "$rc" = 0 ] || tail -n 5 /tmp/out.log
		;;
	dbench)
		rm -rf /tmp/dbench/*
		/usr/bin/dbench -c /usr/share/dbench/client.txt -D /tmp/dbench -t "$dur" \
			$((2 * ncpu)) >/tmp/out.log 2>&1
		rc=$?
		grep -E '^Throughput|Operation|^ *[A-Z][A-Za-z]+ +[0-9]' /tmp/out.log | tail -n 20
		[ "$rc" = 0 ] || tail -n 5 /tmp/out.log
		rm -rf /tmp/dbench/*
		;;
	*)
		echo "unknown workload $w"
		rc=2
		;;
	esac
}

# run WORKLOAD DURATION_S [MIN_ITERS]
run_measured() {
	t0=$(uptime_s)
	i0=$(ipis)
	echo "@@ out-begin w=$1"
	run_workload "$1" "$2" "$3"
	echo "@@ out-end w=$1"
	t1=$(uptime_s)
	i1=$(ipis)
	echo "@@ result w=$1 rc=$rc secs=$(elapsed "$t0" "$t1") iters=$iters $(ipis_delta "$i0" "$i1")"
}

bench_serve run_measured
if [ "$loader" != none ]; then
	rmmod pvsched
	echo "@@ rmmod rc=$? bound=$(bound)"
fi
