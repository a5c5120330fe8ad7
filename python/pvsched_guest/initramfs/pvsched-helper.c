// SPDX-License-Identifier: GPL-2.0
/*
 * Static guest-side helper for the Linux guest test (busybox has no chrt).
 *
 *   pvsched-helper spin SECONDS PRIO CPU   SCHED_FIFO PRIO busy loop on CPU
 *   pvsched-helper periodic SECONDS PRIO CPU
 *                                          SCHED_FIFO PRIO task on CPU that runs
 *                                          ~0.1 ms every 10 ms and sleeps in
 *                                          between (the CPU idles after an RT
 *                                          task that slept: the driver's RT
 *                                          sleeper report)
 *   pvsched-helper pingpong ROUNDS CPU     two processes on CPU bounce a byte
 *                                          through pipes; prints ns/round trip
 *   pvsched-helper membarrier SECONDS FROM TO
 *                                          a thread spins on CPU TO while the
 *                                          caller, on CPU FROM, issues private
 *                                          expedited membarriers: each one is a
 *                                          synchronous cross-CPU call FROM -> TO
 *                                          (the guest driver's wait_on)
 *   pvsched-helper lock SECONDS CPU CPU    a thread on each CPU writes 4 KiB to
 *                                          one non-blocking pipe and reads it
 *                                          back, again and again: both take the
 *                                          pipe's mutex, and a waiter spins on
 *                                          its running owner (the guest
 *                                          driver's lock waits)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int pin(int cpu)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	if (sched_setaffinity(0, sizeof(set), &set)) {
		perror("sched_setaffinity");
		return -1;
	}
	return 0;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The caller on CPU `cpu` at SCHED_FIFO `prio`. */
static int fifo_on(int cpu, int prio)
{
	struct sched_param sp = { .sched_priority = prio };

	if (pin(cpu))
		return -1;
	if (sched_setscheduler(0, SCHED_FIFO, &sp)) {
		perror("sched_setscheduler");
		return -1;
	}
	return 0;
}

static int spin(double secs, int prio, int cpu)
{
	volatile unsigned long n = 0;
	double end;

	if (fifo_on(cpu, prio))
		return 1;
	end = now() + secs;
	while (now() < end)
		n++;
	printf("spin done cpu=%d prio=%d iterations=%lu\n", cpu, prio, n);
	return 0;
}

static int periodic(double secs, int prio, int cpu)
{
	struct timespec next;
	volatile unsigned long n = 0;
	double end, busy;
	long cycles = 0;

	if (fifo_on(cpu, prio))
		return 1;
	clock_gettime(CLOCK_MONOTONIC, &next);
	end = now() + secs;
	while (now() < end) {
		busy = now() + 1e-4;
		while (now() < busy)
			n++;
		next.tv_nsec += 10 * 1000 * 1000;
		if (next.tv_nsec >= 1000 * 1000 * 1000) {
			next.tv_nsec -= 1000 * 1000 * 1000;
			next.tv_sec++;
		}
		if (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL)) {
			perror("clock_nanosleep");
			return 1;
		}
		cycles++;
	}
	printf("periodic done cpu=%d prio=%d cycles=%ld\n", cpu, prio, cycles);
	return 0;
}

static int pingpong(long rounds, int cpu)
{
	int a[2], b[2];
	double t0, t1;
	char c = 0;
	pid_t pid;
	long i;

	if (pipe(a) || pipe(b) || pin(cpu)) {
		perror("setup");
		return 1;
	}
	pid = fork();
	if (pid < 0) {
		perror("fork");
		return 1;
	}
	if (pid == 0) {
		for (i = 0; i < rounds; i++) {
			if (read(a[0], &c, 1) != 1 || write(b[1], &c, 1) != 1)
				_exit(1);
		}
		_exit(0);
	}
	t0 = now();
	for (i = 0; i < rounds; i++) {
		if (write(a[1], &c, 1) != 1 || read(b[0], &c, 1) != 1) {
			perror("pingpong");
			return 1;
		}
	}
	t1 = now();
	waitpid(pid, NULL, 0);
	printf("ns_per_round_trip=%.0f rounds=%ld\n", (t1 - t0) * 1e9 / rounds,
	       rounds);
	return 0;
}

static volatile int spinner_stop;
/* 0 while the spinner starts, 1 once it spins on its CPU, -1 if it could
 * not be pinned there. */
static volatile int spinner_ready;

static void *spinner(void *arg)
{
	if (pin(*(int *)arg)) {
		spinner_ready = -1;
		return NULL;
	}
	spinner_ready = 1;
	while (!spinner_stop)
		;
	return NULL;
}

static long membarrier(int cmd)
{
	return syscall(__NR_membarrier, cmd, 0, 0);
}

static int membarrier_loop(double secs, int from, int to)
{
	pthread_t t;
	double end;
	long n = 0;

	if (pin(from))
		return 1;
	if (membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED)) {
		perror("membarrier register");
		return 1;
	}
	if (pthread_create(&t, NULL, spinner, &to)) {
		perror("pthread_create");
		return 1;
	}
	while (!spinner_ready)
		sched_yield();
	if (spinner_ready < 0) {
		pthread_join(t, NULL);
		return 1;
	}
	end = now() + secs;
	while (now() < end) {
		if (membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)) {
			perror("membarrier");
			break;
		}
		n++;
	}
	spinner_stop = 1;
	pthread_join(t, NULL);
	printf("membarriers=%ld from=%d to=%d\n", n, from, to);
	return 0;
}

struct locker {
	int cpu;
	int fd[2];
	double end;
	long rounds;
	int failed;
};

static void *locker(void *arg)
{
	struct locker *l = arg;
	char buf[4096];

	memset(buf, 0x5a, sizeof(buf));
	if (pin(l->cpu)) {
		l->failed = 1;
		return NULL;
	}
	while (now() < l->end) {
		/* A full or empty pipe is EAGAIN: the mutex was taken anyway. */
		if (write(l->fd[1], buf, sizeof(buf)) < 0 && errno != EAGAIN)
			break;
		if (read(l->fd[0], buf, sizeof(buf)) < 0 && errno != EAGAIN)
			break;
		l->rounds++;
	}
	return NULL;
}

static int lock_loop(double secs, int cpu0, int cpu1)
{
	struct locker l[2] = { { .cpu = cpu0 }, { .cpu = cpu1 } };
	pthread_t t[2];
	int fd[2], i;

	if (pipe2(fd, O_NONBLOCK)) {
		perror("pipe2");
		return 1;
	}
	for (i = 0; i < 2; i++) {
		l[i].fd[0] = fd[0];
		l[i].fd[1] = fd[1];
		l[i].end = now() + secs;
		if (pthread_create(&t[i], NULL, locker, &l[i])) {
			perror("pthread_create");
			return 1;
		}
	}
	for (i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	if (l[0].failed || l[1].failed)
		return 1;
	printf("rounds=%ld,%ld cpus=%d,%d\n", l[0].rounds, l[1].rounds, cpu0,
	       cpu1);
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc == 5 && !strcmp(argv[1], "spin"))
		return spin(atof(argv[2]), atoi(argv[3]), atoi(argv[4]));
	if (argc == 5 && !strcmp(argv[1], "periodic"))
		return periodic(atof(argv[2]), atoi(argv[3]), atoi(argv[4]));
	if (argc == 4 && !strcmp(argv[1], "pingpong"))
		return pingpong(atol(argv[2]), atoi(argv[3]));
	if (argc == 5 && !strcmp(argv[1], "membarrier"))
		return membarrier_loop(atof(argv[2]), atoi(argv[3]),
				       atoi(argv[4]));
	if (argc == 5 && !strcmp(argv[1], "lock"))
		return lock_loop(atof(argv[2]), atoi(argv[3]), atoi(argv[4]));
	fprintf(stderr,
		"usage: %s spin SECONDS PRIO CPU | periodic SECONDS PRIO CPU | pingpong ROUNDS CPU | membarrier SECONDS FROM TO | lock SECONDS CPU CPU\n",
		argv[0]);
	return 2;
}
