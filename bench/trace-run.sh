#!/bin/sh
# Records, in a tracefs instance of its own (mono clock, 32 MiB per CPU
# unless PVSCHED_TRACE_BUFFER_KB says otherwise),
# the scheduler's switches, wake-ups and migrations, the local timer,
# reschedule, function-call and irq_work interrupts and sched_setattr calls
# while COMMAND runs; writes COMMAND's stdout to OUT.json and the trace to
# OUT.trace, then prints the per-CPU overrun counts (0: nothing lost). As
# root. `python3 -m pvsched_bench stall-trace OUT.trace` (PYTHONPATH=python)
# names what kept vCPU threads waiting; `apply-trace OUT.trace DECISIONS`
# where the agent's decision -> applied time goes (run COMMAND with `--trace DECISIONS`).
# PVSCHED_TRACE_EXTRA adds events (e.g. "raw_syscalls/sys_enter
# raw_syscalls/sys_exit": every system call, a much larger trace);
# PVSCHED_TRACE_BUFFER_KB sets the buffer per CPU (default 32768: enough for
# 20 s of S1; a host running stress-ng --fork fills it in a few seconds).
#
#   bench/trace-run.sh OUT -- pvsched run --duration 20s --hogs 4 --json
#
# With --applier first, only pvsched's applier thread (comm "pvsched-apply",
# in pvschedd or any embedding process) is recorded: its context switches
# and every system call it enters and leaves, plus the local timer
# interrupt on every CPU (to tell a CPU the hypervisor stopped from one that
# ran something); 64 MiB per CPU by default. Small enough to run beside a
# whole S4 or S6 run; `applier-waits OUT.trace` says how long the
# applier ran, waited on a lock and waited for a CPU.
#
#   bench/trace-run.sh --applier OUT -- target/release/pvsched-bench s4 --kernels 6.1-cloud \
#       --variants pvsched --reps 4 --duration 20 --no-idle --json -
set -eu
applier=
[ "$1" = --applier ] && { applier=1; shift; }
out=$1; shift; [ "$1" = -- ] && shift
t=/sys/kernel/tracing
[ -d $t/events ] || mount -t tracefs nodev $t
i=$t/instances/pvsched-stalls-$$
mkdir $i
trap 'echo 0 > $i/tracing_on; rmdir $i' EXIT
echo mono > $i/trace_clock
if [ -n "$applier" ]; then
	echo "${PVSCHED_TRACE_BUFFER_KB:-65536}" > $i/buffer_size_kb
	echo 'prev_comm == "pvsched-apply" || next_comm == "pvsched-apply"' \
		> $i/events/sched/sched_switch/filter
	for e in sys_enter sys_exit; do
		echo 'comm == "pvsched-apply"' > $i/events/raw_syscalls/$e/filter
	done
	events="sched/sched_switch raw_syscalls/sys_enter raw_syscalls/sys_exit irq_vectors/local_timer_entry"
else
	echo "${PVSCHED_TRACE_BUFFER_KB:-32768}" > $i/buffer_size_kb
	events="sched/sched_switch sched/sched_wakeup sched/sched_waking sched/sched_migrate_task irq_vectors/local_timer_entry irq_vectors/reschedule_entry irq_vectors/call_function_single_entry irq_vectors/irq_work_entry syscalls/sys_enter_sched_setattr syscalls/sys_exit_sched_setattr ${PVSCHED_TRACE_EXTRA:-}"
fi
for e in $events; do [ -d $i/events/$e ] && echo 1 > $i/events/$e/enable; done
echo 1 > $i/tracing_on
# A command that marks its own steps in the trace (pvsched-bench s6: each
# workload run's start and end) writes them to this instance's marker.
PVSCHED_TRACE_MARKER=$i/trace_marker "$@" > $out.json
echo 0 > $i/tracing_on
cat $i/trace > $out.trace
cat $i/per_cpu/cpu*/stats | grep -i overrun
