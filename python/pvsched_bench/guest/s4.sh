# Guest side of the S4 benchmark (pvsched_bench/s4.py): sourced by the
# test initramfs's /init (pvsched_guest/initramfs/init.sh) in `pvtest=bench`
# mode, which then prints "@@ done" and powers off.
#
# Loads the pvsched module (the DKMS-built one, by modprobe), then serves
# commands the host writes on the console, one per "@@ bench-wait"
# (bench_serve, init.sh):
#   run INTERVAL_US DURATION_S HIST_BUCKETS [THREADS [BREAK_US]]
#       cyclictest --mlockall -q -p 8 --policy=rr -i INTERVAL_US for
#       DURATION_S seconds with a 1 us histogram of HIST_BUCKETS buckets;
#       its --json result is printed between "@@ cyc-json-begin" and
#       "@@ cyc-end". BREAK_US (0: none) stops it at the first latency
#       over BREAK_US (cyclictest -b) and prints "@@ cyc-break value=US"
#       as soon as cyclictest exits: at once after a break in the run, so
#       the host knows when that stall ended (s4 --break-us).
#   stats   the driver's debugfs counters between "@@ stats-begin" and
#           "@@ stats-end".
#   quit    (or anything else, or no command within 15 minutes): unload.

# cyclictest needs POSIX shared memory (shm_open); devtmpfs has no /dev/shm.
mkdir -p /dev/shm
mount -t tmpfs tmpfs /dev/shm
load
echo "@@ probe bound=$(bound)"

# run INTERVAL_US DURATION_S HIST_BUCKETS [THREADS [BREAK_US]]
run_cyclictest() {
	interval=$1
	dur=$2
	hist=$3
	threads=${4:-1}
	brk=${5:-0}
	echo "@@ cyc-start interval=$interval dur=$dur"
	rm -f /tmp/cyc.json
	set -- --mlockall -q -p 8 --policy=rr -i "$interval" -D "$dur" \
		-t "$threads" -h "$hist" --histfile=/dev/null --json=/tmp/cyc.json
	if [ "$brk" != 0 ]; then
		set -- "$@" -b "$brk"
	fi
	/usr/bin/cyclictest "$@" >/tmp/cyc.out 2>&1
	rc=$?
	value=$(sed -n 's/^# Break value: *//p' /tmp/cyc.out)
	if [ -n "$value" ]; then
		echo "@@ cyc-break value=$value"
	fi
	echo "@@ cyc-json-begin rc=$rc"
	cat /tmp/cyc.json 2>/dev/null
	echo "@@ cyc-end rc=$rc"
	if [ "$rc" != 0 ]; then
		tail -n 5 /tmp/cyc.out
	fi
}

bench_serve run_cyclictest
rmmod pvsched
echo "@@ rmmod rc=$? bound=$(bound)"
