// SPDX-License-Identifier: GPL-2.0
/*
 * pvsched guest driver: tells the host, per vCPU, what this guest is doing.
 *
 * The driver negotiates a shared region with the pvsched PCI device
 * (include/pvsched_abi.h, docs/abi.md) and then, from tracepoint probes,
 * writes into the slot of the CPU it runs on:
 *
 *   sched_switch                 policy, nice and rt_prio of the next task,
 *                                and whether it is a kernel thread or the
 *                                idle task (flags, with PVSCHED_F_TASK_FLAGS);
 *                                going idle after a user RT task that
 *                                sleeps, that task (PVSCHED_TASK_F_RT_SLEEPER)
 *   irq_handler_entry/exit       PVSCHED_CS_HARDIRQ
 *   softirq_entry/exit           PVSCHED_CS_SOFTIRQ
 *   csd_queue_cpu                wait_on: this CPU queued a synchronous
 *                                cross-CPU call and spins until it is done
 *   csd_function_exit            ...and that call is done (Linux >= 6.3)
 *   contention_begin/end         wait_on = PVSCHED_WAIT_ANY: this CPU spins
 *                                on a contended spinlock, rwlock or mutex
 *                                owner (Linux >= 5.19, PVSCHED_F_LOCK_WAIT)
 *   sched_waking                 wakes: this CPU woke a task that last ran
 *                                on another CPU (PVSCHED_F_SYNC_COUNTS, with
 *                                waits: the waits wait_on reported)
 *
 * Slot writes follow the ABI's sequence protocol (seq odd, fields, seq even),
 * are per CPU, take no lock and never touch a device register, so the hot
 * path causes no VM exit. The tracepoints are not exported to modules; they
 * are found with for_each_kernel_tracepoint() (GPL-only). Each probe's
 * prototype is checked at build time against the kernel's own declaration
 * of its tracepoint (PVSCHED_TP), so a kernel that changes a tracepoint's
 * arguments fails to build the module instead of calling a probe wrongly.
 *
 * wait_on is the one field another CPU writes: the CPU that runs a
 * synchronous call clears the waiter's wait_on when the call is done (the
 * waiter itself spins with no tracepoint to mark the end). With wait_on
 * reporting on, every slot write therefore claims the slot's seq with a
 * compare-and-swap; without it (kernels before 6.3 have no csd tracepoints,
 * or report_wait=0) the owner CPU is the only writer and plain stores do.
 *
 * Not reported: PVSCHED_CS_NMI (no NMI tracepoint) and PVSCHED_CS_PREEMPT_OFF
 * (CONFIG_PREEMPTIRQ_TRACEPOINTS is off in distribution kernels); see
 * docs/guest-driver.md.
 */

#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/cpuhotplug.h>
#include <linux/debugfs.h>
#include <linux/gfp.h>
#include <linux/io.h>
#include <linux/module.h>
#include <linux/mm.h>
#include <linux/pci.h>
#include <linux/percpu.h>
#include <linux/sched.h>
#include <linux/sched/clock.h>
#include <linux/seq_file.h>
#include <linux/smp.h>
#include <linux/string.h>
#include <linux/stringify.h>
#include <linux/tracepoint.h>
#include <linux/workqueue.h>
#include <asm/smp.h>
#ifdef CONFIG_X86
#include <asm/apicdef.h>
#endif

/*
 * The tracepoints' declarations, for check_trace_callback_type_<name>()
 * only (PVSCHED_TP). Without CREATE_TRACE_POINTS these headers define no
 * tracepoint; nothing here references the unexported __tracepoint_<name>.
 */
#include <trace/events/irq.h>
#include <trace/events/sched.h>
/*
 * The csd tracepoints came with their header (Linux 6.3): a kernel without
 * the header has neither, and the wait_on probes are left out. Testing for
 * the header rather than for a version also covers a kernel that backports
 * them.
 */
#if __has_include(<trace/events/csd.h>)
#include <trace/events/csd.h>
#define PVSCHED_CSD_TRACEPOINTS 1
#else
#define PVSCHED_CSD_TRACEPOINTS 0
#endif

/*
 * The lock contention tracepoints came with Linux 5.19, in a header that
 * existed before them, so the test is the version.
 */
#include <linux/version.h>
#if LINUX_VERSION_CODE >= KERNEL_VERSION(5, 19, 0)
#include <trace/events/lock.h>
#define PVSCHED_LOCK_TRACEPOINTS 1
#else
#define PVSCHED_LOCK_TRACEPOINTS 0
#endif

#include "pvsched_abi.h"

static bool use_device_region = true;
module_param(use_device_region, bool, 0444);
MODULE_PARM_DESC(use_device_region,
		 "Use the device region (BAR2) when offered (default: 1)");

static bool report_sched = true;
module_param(report_sched, bool, 0444);
MODULE_PARM_DESC(report_sched,
		 "Report policy/nice/rt_prio from sched_switch (default: 1)");

static bool report_irq = true;
module_param(report_irq, bool, 0444);
MODULE_PARM_DESC(report_irq,
		 "Report hardirq and softirq sections (default: 1)");

static bool report_wait = true;
module_param(report_wait, bool, 0444);
MODULE_PARM_DESC(report_wait,
		 "Report wait_on, the CPU a synchronous cross-CPU call waits for, when the kernel has csd tracepoints (Linux >= 6.3) and the device honours it (default: 1)");

static bool report_lock = true;
module_param(report_lock, bool, 0444);
MODULE_PARM_DESC(report_lock,
		 "Report a CPU spinning on a contended lock (wait_on = any) from the lock contention tracepoints (Linux >= 5.19), when the device honours it (default: 1)");

static bool report_sync = true;
module_param(report_sync, bool, 0444);
MODULE_PARM_DESC(report_sync,
		 "Count the wake-ups of tasks that last ran on another CPU and the waits for another CPU, for the host's co-scheduling, when the device reads them (default: 1)");

static uint health_ms = 1000;
module_param(health_ms, uint, 0444);
MODULE_PARM_DESC(health_ms,
		 "Read the device's STATUS every this many ms and stop reporting once the device is lost (0: never; default: 1000)");

/* Per-CPU view of this CPU's slot and what we last reported in it. */
struct pvsched_cpu {
	struct pvsched_slot_guest *slot; /* NULL while not attached/online */
	u32 slot_index;
	u32 kern_cs;
	u32 policy;
	s32 nice;
	u32 rt_prio;
	u32 task_flags; /* PVSCHED_TASK_F_*, with PVSCHED_F_TASK_FLAGS */
	u32 hardirq_depth;
	/*
	 * The synchronous call this CPU waits for: set by this CPU when it
	 * queues the call, cleared by the CPU that runs it.
	 */
	u32 wait_on; /* slot index + 1, PVSCHED_WAIT_NONE or _ANY */
	call_single_data_t *wait_csd;
	/*
	 * Contended spinlocks this CPU is spinning on, nested (task, softirq,
	 * hardirq, NMI each have their own), and whether its task spins on a
	 * mutex's owner. While either holds, wait_on is PVSCHED_WAIT_ANY.
	 */
	u32 lock_depth;
	bool mutex_spin;
	/* Counters, shown in debugfs. Written by this CPU only. */
	u64 updates;
	u64 switches;
	u64 irqs;
	u64 softirqs;
	u64 waits;     /* synchronous calls queued to a CPU with a slot */
	u64 wait_ends; /* waits of other CPUs this CPU ended */
	u64 lock_waits; /* contended lock spins reported */
	u64 rt_sleepers; /* idle entries reported with their RT sleeper */
	u64 wakes;	 /* wake-ups of a task that last ran on another CPU */
	/* local_clock() when the RT sleeper reported now last ran. */
	u64 rt_sleeper_ns;
};

/*
 * How long an idle CPU keeps reporting the user RT task it ran last: the
 * host's default latency hold (halt_hold_us, 1 s). A task that runs again
 * sooner renews it; one that went elsewhere or changed its policy stops
 * counting at the first interrupt this CPU takes once that time is over.
 */
#define PVSCHED_RT_SLEEPER_NS NSEC_PER_SEC

static DEFINE_PER_CPU(struct pvsched_cpu, pvsched_pcpu);

struct pvsched_dev {
	struct pci_dev *pdev;
	void __iomem *regs;
	void *region;
	size_t region_size;
	bool device_region;
	u32 nr_vcpus;
	u32 generation;
	u64 features;
	int cpuhp_state;
	bool wait_on; /* PVSCHED_F_WAIT_ON negotiated */
	bool lock_wait; /* PVSCHED_F_LOCK_WAIT negotiated */
	bool sync_counts; /* PVSCHED_F_SYNC_COUNTS negotiated */
	struct dentry *debugfs;
	/*
	 * Validated at DRIVER_OK and never read from the region again: the
	 * host can rewrite the header at any time.
	 */
	u32 slots_off;
	u32 *apic_ids; /* nr_vcpus entries, a copy of the APIC table */
	struct delayed_work health; /* STATUS check, every health_ms */
	bool lost;		    /* the device went away; reporting stopped */
	bool gone;		    /* ...and its registers read all ones */
};

/* One device per guest: the hooks are global. */
static struct pvsched_dev *pvsched_active;

/* Slot writers claim seq with a compare-and-swap (wait_on reporting on). */
static bool pvsched_claiming;

/*
 * PVSCHED_F_TASK_FLAGS negotiated: slots say whether the running task is a
 * kernel thread. A host then knows that an RT task is the kernel's own
 * (the stopper every CPU runs for the soft-lockup watchdog, IRQ threads)
 * and not the guest's latency-sensitive work, and that a CPU runs its idle
 * task (a halted vCPU woken by a sibling was sent an IPI, not a vCPU that
 * waited for the VMM). Otherwise flags stay 0.
 */
static bool pvsched_task_flags;

/*
 * PVSCHED_F_SYNC_COUNTS negotiated: every slot update also writes this
 * CPU's wakes and waits. The host co-schedules a VM's vCPUs only while
 * these show that its tasks hand work to, or wait for, other vCPUs: a
 * batch guest, whose tasks each keep to their CPU, gains nothing from it.
 */
static bool pvsched_sync_counts;

/* How long a slot writer waits for another writer to finish its update. */
#define PVSCHED_CLAIM_SPINS 4096

/* A tracepoint the driver hooks; entries are made by PVSCHED_TP. */
struct pvsched_tp {
	const char *name;
	void *probe;
	bool checked; /* the probe's prototype was checked: see PVSCHED_TP */
	struct tracepoint *tp;
	bool registered;
};

static const char *const pvsched_err_names[] = {
	[PVSCHED_ERR_NONE] = "none",
	[PVSCHED_ERR_BAD_SEQUENCE] = "bad status sequence",
	[PVSCHED_ERR_FEATURES_UNSUPPORTED] = "features unsupported",
	[PVSCHED_ERR_NO_REGION_MODE] = "no region mode selected",
	[PVSCHED_ERR_VERSION_MISMATCH] = "version mismatch",
	[PVSCHED_ERR_REGION_ZERO_SIZE] = "region size is zero",
	[PVSCHED_ERR_REGION_UNALIGNED] = "region not page aligned",
	[PVSCHED_ERR_REGION_WRAPS] = "region wraps",
	[PVSCHED_ERR_REGION_OUTSIDE_RAM] = "region outside guest RAM",
	[PVSCHED_ERR_REGION_TOO_SMALL] = "region too small",
	[PVSCHED_ERR_REGION_CHANGED] = "region changed after DRIVER_OK",
	[PVSCHED_ERR_REGION_UNMAPPED] = "device region not mapped",
	[PVSCHED_ERR_REGION_UNAVAILABLE] = "device region unavailable",
	[PVSCHED_ERR_DEVICE_FAILED] = "device back end failed",
};

static const char *pvsched_err_name(u32 err)
{
	if (err < ARRAY_SIZE(pvsched_err_names) && pvsched_err_names[err])
		return pvsched_err_names[err];
	return "unknown error";
}

/* ---------------------------------------------------------------------- */
/* Slot writes (hot path)                                                  */
/* ---------------------------------------------------------------------- */

/*
 * Make @slot's seq odd for an update and return the odd value, or 0 when
 * it could not within PVSCHED_CLAIM_SPINS tries (another CPU's update held
 * it, or the host keeps rewriting seq: the bound keeps a hostile host from
 * holding this CPU here with interrupts off). Only used while
 * pvsched_claiming: then a CPU ending another CPU's wait writes that CPU's
 * slot too. The compare-and-swap orders like a full barrier.
 */
static u32 notrace pvsched_claim(struct pvsched_slot_guest *slot)
{
	unsigned int tries;
	u32 seq = READ_ONCE(slot->seq);
	u32 old;

	for (tries = 0; tries < PVSCHED_CLAIM_SPINS; tries++) {
		if (!(seq & 1)) {
			old = cmpxchg(&slot->seq, seq, seq + 1);
			if (old == seq)
				return seq + 1;
			seq = old;
			continue;
		}
		cpu_relax();
		seq = READ_ONCE(slot->seq);
	}
	return 0;
}

/*
 * Publish this CPU's state into its slot. Interrupts are disabled so that an
 * interrupt hook cannot start a nested update while seq is odd.
 */
static void notrace pvsched_publish(struct pvsched_cpu *pc)
{
	struct pvsched_slot_guest *slot;
	unsigned long flags;
	u32 seq = 0;

	local_irq_save(flags);
	slot = READ_ONCE(pc->slot);
	if (slot) {
		if (READ_ONCE(pvsched_claiming))
			seq = pvsched_claim(slot);
		if (!seq) {
			/*
			 * The owner's update goes ahead even if the seq
			 * stayed odd (a host wrote it, or a remote clear
			 * stalled): the slot is a hint, the host retries
			 * torn reads, and wait_on is re-read below.
			 */
			seq = READ_ONCE(slot->seq) | 1;
			WRITE_ONCE(slot->seq, seq);
		}
		smp_wmb();
		WRITE_ONCE(slot->kern_cs, pc->kern_cs);
		WRITE_ONCE(slot->policy, pc->policy);
		WRITE_ONCE(slot->nice, pc->nice);
		WRITE_ONCE(slot->rt_prio, pc->rt_prio);
		WRITE_ONCE(slot->flags, pc->task_flags);
		WRITE_ONCE(slot->wait_on, READ_ONCE(pc->wait_on));
		WRITE_ONCE(slot->updates, slot->updates + 1);
		if (READ_ONCE(pvsched_sync_counts))
			WRITE_ONCE(slot->waits, pc->waits + pc->lock_waits);
		smp_wmb();
		WRITE_ONCE(slot->seq, seq + 1);
		pc->updates++;
	}
	local_irq_restore(flags);
}

static void pvsched_task_state(struct pvsched_cpu *pc,
			       const struct task_struct *p)
{
	u32 policy = p->policy;

	pc->policy = policy;
	pc->task_flags = 0;
	if (READ_ONCE(pvsched_task_flags)) {
		if (p->flags & PF_KTHREAD)
			pc->task_flags |= PVSCHED_TASK_F_KTHREAD;
		if (is_idle_task(p))
			pc->task_flags |= PVSCHED_TASK_F_IDLE;
	}
	if (policy == SCHED_FIFO || policy == SCHED_RR) {
		pc->rt_prio = p->rt_priority;
		pc->nice = 0;
	} else {
		pc->rt_prio = 0;
		pc->nice = task_nice(p);
	}
}

/*
 * This CPU goes idle after @prev, which went to sleep: if @prev is a user
 * RT task, report it instead of the idle task, with
 * PVSCHED_TASK_F_RT_SLEEPER. A periodic RT task (cyclictest, a control
 * loop) runs for microseconds between long sleeps; the host reads a slot
 * when the vCPU's thread is switched, which is nearly always when the
 * guest is idle, and would otherwise rarely see the task and let the
 * vCPU's latency hold lapse while the task still waits for its next
 * wake-up here.
 */
static void pvsched_rt_sleeper(struct pvsched_cpu *pc,
			       const struct task_struct *prev,
			       unsigned int prev_state)
{
	u32 policy = prev->policy;

	if (prev_state == TASK_RUNNING || (prev->flags & (PF_KTHREAD | PF_EXITING)))
		return;
	if (policy != SCHED_FIFO && policy != SCHED_RR &&
	    policy != SCHED_DEADLINE)
		return;
	pc->policy = policy;
	pc->nice = 0;
	pc->rt_prio = policy == SCHED_DEADLINE ? 0 : prev->rt_priority;
	pc->task_flags = PVSCHED_TASK_F_IDLE | PVSCHED_TASK_F_RT_SLEEPER;
	pc->rt_sleeper_ns = local_clock();
	pc->rt_sleepers++;
}

static void notrace pvsched_sched_switch(void *data, bool preempt,
					 struct task_struct *prev,
					 struct task_struct *next,
					 unsigned int prev_state)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	pc->switches++;
	pvsched_task_state(pc, next);
	if (is_idle_task(next) && READ_ONCE(pvsched_task_flags))
		pvsched_rt_sleeper(pc, prev, prev_state);
	pvsched_publish(pc);
}

static void notrace pvsched_irq_entry(void *data, int irq,
				      struct irqaction *action)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	pc->irqs++;
	if (pc->hardirq_depth++ == 0) {
		pc->kern_cs |= PVSCHED_CS_HARDIRQ;
		/* An RT sleeper that has not run for long no longer counts. */
		if ((pc->task_flags & PVSCHED_TASK_F_RT_SLEEPER) &&
		    local_clock() - pc->rt_sleeper_ns > PVSCHED_RT_SLEEPER_NS)
			pvsched_task_state(pc, current);
		pvsched_publish(pc);
	}
}

static void notrace pvsched_irq_exit(void *data, int irq,
				     struct irqaction *action, int ret)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	/* Tolerate an exit without entry (probe registered in between). */
	if (pc->hardirq_depth == 0)
		return;
	if (--pc->hardirq_depth == 0) {
		pc->kern_cs &= ~PVSCHED_CS_HARDIRQ;
		pvsched_publish(pc);
	}
}

static void notrace pvsched_softirq_entry(void *data, unsigned int vec_nr)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	pc->softirqs++;
	pc->kern_cs |= PVSCHED_CS_SOFTIRQ;
	pvsched_publish(pc);
}

static void notrace pvsched_softirq_exit(void *data, unsigned int vec_nr)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	pc->kern_cs &= ~PVSCHED_CS_SOFTIRQ;
	pvsched_publish(pc);
}

#if PVSCHED_CSD_TRACEPOINTS
static bool pvsched_csd_sync(const call_single_data_t *csd)
{
	return csd && (READ_ONCE(csd->node.u_flags) & CSD_FLAG_TYPE_MASK) ==
			      CSD_TYPE_SYNC;
}

/*
 * csd_queue_cpu runs on the CPU that queues a call for @cpu, before the
 * call is visible to @cpu. A synchronous call means this CPU now spins
 * until @cpu has run it: say so in wait_on.
 */
static void notrace pvsched_csd_queue(void *data, unsigned int cpu,
				      unsigned long callsite,
				      smp_call_func_t func,
				      call_single_data_t *csd)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);
	const struct pvsched_cpu *target;

	if (!pvsched_csd_sync(csd) || cpu >= nr_cpu_ids)
		return;
	target = per_cpu_ptr(&pvsched_pcpu, cpu);
	if (!READ_ONCE(target->slot))
		return;
	pc->waits++;
	WRITE_ONCE(pc->wait_csd, csd);
	WRITE_ONCE(pc->wait_on, READ_ONCE(target->slot_index) + 1);
	pvsched_publish(pc);
}

/*
 * Clear @pc's wait_on in its slot from another CPU. @pc->wait_on is
 * already NONE: if the owner claims the slot first it writes NONE itself,
 * and if the claim fails the owner's next update writes it.
 */
static void notrace pvsched_end_wait(struct pvsched_cpu *pc)
{
	struct pvsched_slot_guest *slot;
	unsigned long flags;
	u32 seq;

	local_irq_save(flags);
	slot = READ_ONCE(pc->slot);
	if (slot) {
		seq = pvsched_claim(slot);
		if (seq) {
			WRITE_ONCE(slot->wait_on, PVSCHED_WAIT_NONE);
			WRITE_ONCE(slot->updates, slot->updates + 1);
			smp_wmb();
			WRITE_ONCE(slot->seq, seq + 1);
		}
	}
	local_irq_restore(flags);
}

/*
 * csd_function_exit runs on the CPU that ran the call; a synchronous
 * caller is released right after it (csd_unlock). Find the CPU waiting
 * for this csd (one pointer compare per online CPU, for synchronous calls
 * only) and end its wait.
 */
static void notrace pvsched_csd_exit(void *data, smp_call_func_t func,
				     call_single_data_t *csd)
{
	unsigned int cpu;

	if (!pvsched_csd_sync(csd))
		return;
	for_each_online_cpu(cpu) {
		struct pvsched_cpu *pc = per_cpu_ptr(&pvsched_pcpu, cpu);

		if (READ_ONCE(pc->wait_csd) != csd)
			continue;
		WRITE_ONCE(pc->wait_csd, NULL);
		WRITE_ONCE(pc->wait_on, PVSCHED_WAIT_NONE);
		this_cpu_inc(pvsched_pcpu.wait_ends);
		pvsched_end_wait(pc);
		return;
	}
}
#endif /* PVSCHED_CSD_TRACEPOINTS */

#if PVSCHED_LOCK_TRACEPOINTS
/* wait_on follows this CPU's lock spins, unless a precise wait holds it. */
static void notrace pvsched_lock_update(struct pvsched_cpu *pc)
{
	bool spins = pc->lock_depth || pc->mutex_spin;
	u32 w = READ_ONCE(pc->wait_on);

	if (spins && w == PVSCHED_WAIT_NONE) {
		pc->lock_waits++;
		WRITE_ONCE(pc->wait_on, PVSCHED_WAIT_ANY);
		pvsched_publish(pc);
	} else if (!spins && w == PVSCHED_WAIT_ANY) {
		WRITE_ONCE(pc->wait_on, PVSCHED_WAIT_NONE);
		pvsched_publish(pc);
	}
}

/*
 * contention_begin: a spinlock or rwlock waiter (LCB_F_SPIN alone, or with
 * READ/WRITE) spins until the matching contention_end, and each context
 * nests its own. A mutex waiter first spins on the owner (LCB_F_MUTEX |
 * LCB_F_SPIN), and says LCB_F_MUTEX alone when it goes to sleep instead;
 * one contention_end ends either. The holder is not known here (a queued
 * spinlock has no owner field): the host picks one of this VM's preempted
 * vCPUs. Sleeping waits (rwsem, percpu-rwsem, rtmutex) cost the host
 * nothing and are not reported.
 */
static void notrace pvsched_lock_begin(void *data, void *lock,
				       unsigned int flags)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	/* An NMI could land inside this CPU's own slot update. */
	if (in_nmi() || (flags & (LCB_F_RT | LCB_F_PERCPU)))
		return;
	if (flags & LCB_F_MUTEX)
		pc->mutex_spin = flags & LCB_F_SPIN;
	else if (flags & LCB_F_SPIN)
		pc->lock_depth++;
	else
		return;
	pvsched_lock_update(pc);
}

/*
 * contention_end: the innermost wait ended. A spinlock in an interrupt
 * nests inside a task's mutex spin, never the other way round.
 */
static void notrace pvsched_lock_end(void *data, void *lock, int ret)
{
	struct pvsched_cpu *pc = this_cpu_ptr(&pvsched_pcpu);

	if (in_nmi())
		return;
	if (pc->lock_depth)
		pc->lock_depth--;
	else if (pc->mutex_spin)
		pc->mutex_spin = false;
	else
		return;
	pvsched_lock_update(pc);
}
#endif /* PVSCHED_LOCK_TRACEPOINTS */

/*
 * sched_waking runs on the waking CPU before the wakee's CPU is chosen: a
 * task that last ran elsewhere is work handed across CPUs (a message, a
 * lock released, I/O completed). The count goes to the slot at once, not
 * at the next slot update: a CPU that runs one busy task makes no update
 * for seconds, and a count that then arrived all at once would read as a
 * burst of hand-overs. One u64 store, outside the seq protocol (the host
 * reads it as a hint); interrupts off, so that a wake-up from an interrupt
 * cannot store its count between this one's increment and store and have
 * it overwritten with a lower one (try_to_wake_up() mostly calls this with
 * them off already).
 */
static void notrace pvsched_waking(void *data, struct task_struct *p)
{
	struct pvsched_slot_guest *slot;
	struct pvsched_cpu *pc;
	unsigned long flags;

	if (task_cpu(p) == raw_smp_processor_id())
		return;
	local_irq_save(flags);
	pc = this_cpu_ptr(&pvsched_pcpu);
	pc->wakes++;
	slot = READ_ONCE(pc->slot);
	if (slot && READ_ONCE(pvsched_sync_counts))
		WRITE_ONCE(slot->wakes, pc->wakes);
	local_irq_restore(flags);
}

/*
 * PVSCHED_TP(name, probe): the pvsched_tps entry of tracepoint @name.
 *
 * The probe is registered through a void pointer (the tracepoint is found
 * by name: register_trace_<name>() would need the unexported
 * __tracepoint_<name>), so nothing checks its type there. The header that
 * declares a tracepoint also declares check_trace_callback_type_<name>(),
 * an empty static inline whose argument is a probe of exactly the
 * tracepoint's prototype (the kernel's trace event code checks its own
 * probes with it). Calling it inside sizeof, which is never evaluated (no
 * code, no symbol reference), makes the compiler check @probe against the
 * kernel's declaration; kernels build with -Werror=incompatible-pointer-types,
 * so a mismatch fails the build. ->checked, always true, only gives the
 * check a place in the initializer.
 */
#define PVSCHED_TP(_name, _probe)					\
	{								\
		.name = #_name,						\
		.probe = _probe,					\
		.checked = sizeof((check_trace_callback_type_##_name(_probe), 0)), \
	}

static struct pvsched_tp pvsched_tps[] = {
	PVSCHED_TP(sched_switch, pvsched_sched_switch),
	PVSCHED_TP(irq_handler_entry, pvsched_irq_entry),
	PVSCHED_TP(irq_handler_exit, pvsched_irq_exit),
	PVSCHED_TP(softirq_entry, pvsched_softirq_entry),
	PVSCHED_TP(softirq_exit, pvsched_softirq_exit),
	PVSCHED_TP(sched_waking, pvsched_waking),
#if PVSCHED_CSD_TRACEPOINTS
	/*
	 * The exit probe goes in first: a wait set once csd_queue_cpu's probe
	 * is in is always ended by it (and the CPU hotplug teardown clears
	 * every wait_on at unload).
	 */
	PVSCHED_TP(csd_function_exit, pvsched_csd_exit),
	PVSCHED_TP(csd_queue_cpu, pvsched_csd_queue),
#endif
#if PVSCHED_LOCK_TRACEPOINTS
	/* The end probe first, as for csd. */
	PVSCHED_TP(contention_end, pvsched_lock_end),
	PVSCHED_TP(contention_begin, pvsched_lock_begin),
#endif
};

/* @t is one of the tracepoints whose names start with @prefix. */
static bool pvsched_tp_in(const struct pvsched_tp *t, const char *prefix)
{
	return !strncmp(t->name, prefix, strlen(prefix));
}

static bool pvsched_tp_wanted(const struct pvsched_tp *t,
			      const struct pvsched_dev *pd)
{
	if (!strcmp(t->name, "sched_switch"))
		return report_sched;
	if (!strcmp(t->name, "sched_waking"))
		return pd->sync_counts;
	if (pvsched_tp_in(t, "csd_"))
		return pd->wait_on;
	if (pvsched_tp_in(t, "contention_"))
		return pd->lock_wait;
	return report_irq;
}

static void pvsched_tp_lookup(struct tracepoint *tp, void *priv)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(pvsched_tps); i++)
		if (!strcmp(tp->name, pvsched_tps[i].name))
			pvsched_tps[i].tp = tp;
}

static void pvsched_tp_unregister(void)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(pvsched_tps); i++) {
		if (!pvsched_tps[i].registered)
			continue;
		tracepoint_probe_unregister(pvsched_tps[i].tp,
					    pvsched_tps[i].probe, NULL);
		pvsched_tps[i].registered = false;
	}
	/* No probe runs (or still reads a slot) after this returns. */
	tracepoint_synchronize_unregister();
}

/* Find the tracepoints this kernel has (before the feature negotiation). */
static void pvsched_tp_find(void)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(pvsched_tps); i++)
		pvsched_tps[i].tp = NULL;
	for_each_kernel_tracepoint(pvsched_tp_lookup, NULL);
}

/*
 * Every tracepoint of a group (names starting with @prefix) exists: the csd
 * pair (Linux >= 6.3) for wait_on, the lock contention pair (>= 5.19) for
 * lock waits. @built is false when the module was built without the
 * group's probes (no <trace/events/csd.h>, or a kernel before 5.19); built
 * with them, it still finds the tracepoints at run time, as every other.
 */
static bool pvsched_have_all(const char *prefix, bool built)
{
	size_t i;

	if (!built)
		return false;
	for (i = 0; i < ARRAY_SIZE(pvsched_tps); i++)
		if (pvsched_tp_in(&pvsched_tps[i], prefix) && !pvsched_tps[i].tp)
			return false;
	return true;
}

static int pvsched_tp_register(struct pvsched_dev *pd)
{
	struct device *dev = &pd->pdev->dev;
	size_t i;
	int ret;

	for (i = 0; i < ARRAY_SIZE(pvsched_tps); i++) {
		struct pvsched_tp *t = &pvsched_tps[i];

		if (!pvsched_tp_wanted(t, pd))
			continue;
		if (!t->tp) {
			dev_warn(dev, "tracepoint %s not found, not reported\n",
				 t->name);
			continue;
		}
		ret = tracepoint_probe_register(t->tp, t->probe, NULL);
		if (ret) {
			dev_err(dev, "cannot register on tracepoint %s: %d\n",
				t->name, ret);
			pvsched_tp_unregister();
			return ret;
		}
		t->registered = true;
	}
	return 0;
}

/* ---------------------------------------------------------------------- */
/* CPU hotplug: attach each online CPU to the slot of its APIC ID          */
/* ---------------------------------------------------------------------- */

static u32 pvsched_cpu_apicid(unsigned int cpu)
{
#ifdef CONFIG_X86
	return per_cpu(x86_cpu_to_apicid, cpu);
#else
	return cpu;
#endif
}

static int pvsched_find_slot(struct pvsched_dev *pd, u32 apicid, u32 *index)
{
	u32 i;

	for (i = 0; i < pd->nr_vcpus; i++) {
		if (pd->apic_ids[i] == apicid) {
			*index = i;
			return 0;
		}
	}
	return -ENOENT;
}

static int pvsched_cpu_online(unsigned int cpu)
{
	struct pvsched_dev *pd = READ_ONCE(pvsched_active);
	struct pvsched_cpu *pc = per_cpu_ptr(&pvsched_pcpu, cpu);
	u32 apicid = pvsched_cpu_apicid(cpu);
	struct pvsched_slot_guest *slot;
	unsigned long flags;
	u32 index;

	if (!pd)
		return 0;
	if (pvsched_find_slot(pd, apicid, &index)) {
		pr_warn("cpu%u: APIC ID %u has no slot, not reported\n", cpu,
			apicid);
		return 0;
	}
	pc->slot_index = index;
	pc->kern_cs = 0;
	pc->hardirq_depth = 0;
	pc->lock_depth = 0;
	pc->mutex_spin = false;
	WRITE_ONCE(pc->wait_csd, NULL);
	WRITE_ONCE(pc->wait_on, PVSCHED_WAIT_NONE);
	pvsched_task_state(pc, current);
	slot = pd->region + pd->slots_off + (size_t)index * PVSCHED_SLOT_SIZE;
	/*
	 * The slot takes this CPU's count as it is now (the counters run
	 * from module load): a host sees it grow from here, not jump by what
	 * was counted before the slot was there.
	 */
	local_irq_save(flags);
	if (READ_ONCE(pvsched_sync_counts))
		WRITE_ONCE(slot->wakes, pc->wakes);
	WRITE_ONCE(pc->slot, slot);
	local_irq_restore(flags);
	pvsched_publish(pc);
	return 0;
}

static int pvsched_cpu_offline(unsigned int cpu)
{
	struct pvsched_cpu *pc = per_cpu_ptr(&pvsched_pcpu, cpu);

	/* Leave the slot saying "nothing to boost", then detach it. */
	pc->kern_cs = 0;
	pc->hardirq_depth = 0;
	pc->policy = PVSCHED_POLICY_NORMAL;
	pc->nice = 0;
	pc->rt_prio = 0;
	pc->task_flags = 0;
	pc->lock_depth = 0;
	pc->mutex_spin = false;
	WRITE_ONCE(pc->wait_csd, NULL);
	WRITE_ONCE(pc->wait_on, PVSCHED_WAIT_NONE);
	pvsched_publish(pc);
	WRITE_ONCE(pc->slot, NULL);
	return 0;
}

/* ---------------------------------------------------------------------- */
/* debugfs                                                                 */
/* ---------------------------------------------------------------------- */

static int pvsched_stats_show(struct seq_file *m, void *v)
{
	struct pvsched_dev *pd = m->private;
	unsigned int cpu;

	seq_printf(m, "mode %s\nnr_vcpus %u\ngeneration %u\nfeatures 0x%llx\nlost %d\nwait_on %d\nlock_wait %d\nsync_counts %d\n",
		   pd->device_region ? "device" : "guest", pd->nr_vcpus,
		   pd->generation, pd->features, READ_ONCE(pd->lost),
		   pd->wait_on, pd->lock_wait, pd->sync_counts);
	seq_puts(m, "cpu slot updates switches irqs softirqs waits wait_ends lock_waits rt_sleepers wakes\n");
	for_each_possible_cpu(cpu) {
		const struct pvsched_cpu *pc = per_cpu_ptr(&pvsched_pcpu, cpu);
		bool attached = READ_ONCE(pc->slot);

		seq_printf(m, "%u %d %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", cpu,
			   attached ? (int)pc->slot_index : -1,
			   READ_ONCE(pc->updates), READ_ONCE(pc->switches),
			   READ_ONCE(pc->irqs), READ_ONCE(pc->softirqs),
			   READ_ONCE(pc->waits), READ_ONCE(pc->wait_ends),
			   READ_ONCE(pc->lock_waits), READ_ONCE(pc->rt_sleepers),
			   READ_ONCE(pc->wakes));
	}
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(pvsched_stats);

/* ---------------------------------------------------------------------- */
/* Handshake                                                               */
/* ---------------------------------------------------------------------- */

static u32 pvsched_rd(struct pvsched_dev *pd, u32 reg)
{
	return ioread32(pd->regs + reg);
}

static void pvsched_wr(struct pvsched_dev *pd, u32 reg, u32 val)
{
	iowrite32(val, pd->regs + reg);
}

static void pvsched_reset(struct pvsched_dev *pd)
{
	pvsched_wr(pd, PVSCHED_REG_STATUS, PVSCHED_STATUS_RESET);
}

/* Set a status bit; -EIO with the device's reason if it refused. */
static int pvsched_set_status(struct pvsched_dev *pd, u32 bit, const char *what)
{
	struct device *dev = &pd->pdev->dev;
	u32 status = pvsched_rd(pd, PVSCHED_REG_STATUS);
	u32 err;

	pvsched_wr(pd, PVSCHED_REG_STATUS, status | bit);
	status = pvsched_rd(pd, PVSCHED_REG_STATUS);
	if ((status & bit) &&
	    !(status & (PVSCHED_STATUS_FAILED |
			PVSCHED_STATUS_DEVICE_NEEDS_RESET)))
		return 0;
	err = pvsched_rd(pd, PVSCHED_REG_ERROR);
	dev_err(dev, "device refused %s: error %u (%s), status 0x%x\n", what,
		err, pvsched_err_name(err), status);
	return -EIO;
}

static void pvsched_free_pages(void *data)
{
	struct pvsched_dev *pd = data;

	free_pages_exact(pd->region, pd->region_size);
}

static int pvsched_map_device_region(struct pvsched_dev *pd, u32 need)
{
	struct pci_dev *pdev = pd->pdev;
	resource_size_t start = pci_resource_start(pdev, PVSCHED_REGION_BAR);
	resource_size_t len = pci_resource_len(pdev, PVSCHED_REGION_BAR);
	/* Map what the layout needs, however large the host made the BAR. */
	size_t map = PAGE_ALIGN(need);
	void *va;

	if (!start || len < map ||
	    !(pci_resource_flags(pdev, PVSCHED_REGION_BAR) & IORESOURCE_MEM))
		return -ENODEV;
	if (!devm_request_mem_region(&pdev->dev, start, map, KBUILD_MODNAME))
		return -EBUSY;
	va = devm_memremap(&pdev->dev, start, map, MEMREMAP_WB);
	if (IS_ERR(va))
		return PTR_ERR(va);
	pd->region = va;
	pd->region_size = map;
	return 0;
}

static int pvsched_alloc_guest_region(struct pvsched_dev *pd, u32 need)
{
	phys_addr_t pa;

	pd->region_size = PAGE_ALIGN(need);
	pd->region = alloc_pages_exact(pd->region_size, GFP_KERNEL | __GFP_ZERO);
	if (!pd->region)
		return -ENOMEM;
	if (devm_add_action_or_reset(&pd->pdev->dev, pvsched_free_pages, pd)) {
		pd->region = NULL;
		return -ENOMEM;
	}
	pa = virt_to_phys(pd->region);
	pvsched_wr(pd, PVSCHED_REG_SHM_GPA_LO, lower_32_bits(pa));
	pvsched_wr(pd, PVSCHED_REG_SHM_GPA_HI, upper_32_bits(pa));
	pvsched_wr(pd, PVSCHED_REG_SHM_SIZE, pd->region_size);
	return 0;
}

/*
 * Check what the device wrote into the region header at DRIVER_OK. Every
 * field is read once; the offsets and a copy of the APIC table are kept in
 * pd and the header is never read again (the host may change it at any
 * time). Says which check failed.
 */
static int pvsched_check_header(struct pvsched_dev *pd)
{
	const struct pvsched_region_header *hdr = pd->region;
	struct device *dev = &pd->pdev->dev;
	u32 magic = READ_ONCE(hdr->magic);
	u32 version = READ_ONCE(hdr->version);
	u32 nr = READ_ONCE(hdr->nr_vcpus);
	u32 slot_size = READ_ONCE(hdr->slot_size);
	u32 apic_off = READ_ONCE(hdr->apic_table_offset);
	u32 slots_off = READ_ONCE(hdr->slots_offset);
	u64 table_end = (u64)apic_off + 4ULL * pd->nr_vcpus;
	u64 slots_end = (u64)slots_off + (u64)PVSCHED_SLOT_SIZE * pd->nr_vcpus;
	const u32 *table;
	u32 i, j;

	if (magic != PVSCHED_REGION_MAGIC ||
	    PVSCHED_VERSION_MAJOR(version) != PVSCHED_ABI_MAJOR) {
		dev_err(dev, "region header: magic 0x%08x version 0x%08x\n",
			magic, version);
		return -EINVAL;
	}
	if (nr != pd->nr_vcpus || slot_size != PVSCHED_SLOT_SIZE) {
		dev_err(dev, "region header: %u vCPUs of %u bytes (NR_VCPUS %u)\n",
			nr, slot_size, pd->nr_vcpus);
		return -EINVAL;
	}
	if (apic_off % 4 || table_end > pd->region_size ||
	    slots_end > pd->region_size || slots_off % PVSCHED_CACHELINE) {
		dev_err(dev, "region header: APIC table at %u, slots at %u outside the %zu-byte region\n",
			apic_off, slots_off, pd->region_size);
		return -EINVAL;
	}
	pd->apic_ids = devm_kcalloc(dev, pd->nr_vcpus, sizeof(u32), GFP_KERNEL);
	if (!pd->apic_ids)
		return -ENOMEM;
	table = pd->region + apic_off;
	for (i = 0; i < pd->nr_vcpus; i++) {
		pd->apic_ids[i] = READ_ONCE(table[i]);
#ifdef CONFIG_X86
		if (pd->apic_ids[i] >= MAX_LOCAL_APIC) {
			dev_err(dev, "region header: APIC ID %u in slot %u is out of range (max %u)\n",
				pd->apic_ids[i], i, MAX_LOCAL_APIC - 1);
			return -EINVAL;
		}
#endif
		for (j = 0; j < i; j++) {
			if (pd->apic_ids[j] == pd->apic_ids[i]) {
				dev_err(dev, "region header: APIC ID %u in slots %u and %u\n",
					pd->apic_ids[i], j, i);
				return -EINVAL;
			}
		}
	}
	pd->slots_off = slots_off;
	return 0;
}

static int pvsched_handshake(struct pvsched_dev *pd)
{
	struct device *dev = &pd->pdev->dev;
	u32 magic, version, need, slot_size;
	u64 offered, wanted;
	bool dev_region;
	int ret;

	pvsched_reset(pd);

	magic = pvsched_rd(pd, PVSCHED_REG_MAGIC);
	if (magic != PVSCHED_MAGIC) {
		dev_err(dev, "wrong MAGIC 0x%08x (expected 0x%08x), not a pvsched device\n",
			magic, PVSCHED_MAGIC);
		return -ENODEV;
	}
	version = pvsched_rd(pd, PVSCHED_REG_VERSION);
	if (PVSCHED_VERSION_MAJOR(version) != PVSCHED_ABI_MAJOR) {
		dev_err(dev, "device ABI %u.%u, driver speaks major %u: version mismatch\n",
			PVSCHED_VERSION_MAJOR(version),
			PVSCHED_VERSION_MINOR(version), PVSCHED_ABI_MAJOR);
		return -ENODEV;
	}
	pvsched_wr(pd, PVSCHED_REG_DRIVER_VERSION, PVSCHED_ABI_VERSION);

	ret = pvsched_set_status(pd, PVSCHED_STATUS_ACKNOWLEDGE, "ACKNOWLEDGE");
	if (ret)
		return ret;
	ret = pvsched_set_status(pd, PVSCHED_STATUS_DRIVER, "DRIVER");
	if (ret)
		return ret;

	offered = pvsched_rd(pd, PVSCHED_REG_DEV_FEATURES_LO) |
		  (u64)pvsched_rd(pd, PVSCHED_REG_DEV_FEATURES_HI) << 32;
	slot_size = pvsched_rd(pd, PVSCHED_REG_SLOT_SIZE);
	pd->nr_vcpus = pvsched_rd(pd, PVSCHED_REG_NR_VCPUS);
	need = pvsched_rd(pd, PVSCHED_REG_REGION_SIZE);
	/*
	 * All three come from the host: the region size is bounded by the
	 * largest layout the ABI allows, so a hostile REGION_SIZE cannot make
	 * the driver allocate (guest region) or map (device region) more.
	 */
	if (slot_size != PVSCHED_SLOT_SIZE || !pd->nr_vcpus ||
	    pd->nr_vcpus > PVSCHED_MAX_VCPUS ||
	    need < pvsched_region_size(pd->nr_vcpus) ||
	    need > PAGE_ALIGN(pvsched_region_size(PVSCHED_MAX_VCPUS))) {
		dev_err(dev, "bad geometry: slot size %u, %u vCPUs, region %u bytes\n",
			slot_size, pd->nr_vcpus, need);
		return -ENODEV;
	}

	dev_region = use_device_region && (offered & PVSCHED_F_DEVICE_REGION) &&
		     pci_resource_len(pd->pdev, PVSCHED_REGION_BAR) >= need;
	if (!dev_region && !(offered & PVSCHED_F_GUEST_REGION)) {
		dev_err(dev, "no usable region mode (device offers 0x%llx)\n",
			offered);
		return -ENODEV;
	}
	wanted = dev_region ? PVSCHED_F_DEVICE_REGION : PVSCHED_F_GUEST_REGION;
	wanted |= offered & (PVSCHED_F_KICK | PVSCHED_F_TASK_FLAGS);
	pvsched_tp_find();
	if (report_wait && (offered & PVSCHED_F_WAIT_ON)) {
		if (pvsched_have_all("csd_", PVSCHED_CSD_TRACEPOINTS))
			wanted |= PVSCHED_F_WAIT_ON;
		else
			dev_info(dev, "wait_on not reported: this kernel has no csd tracepoints (Linux < 6.3)\n");
	}
	pd->wait_on = wanted & PVSCHED_F_WAIT_ON;
	if (report_lock && (offered & PVSCHED_F_LOCK_WAIT)) {
		if (pvsched_have_all("contention_", PVSCHED_LOCK_TRACEPOINTS))
			wanted |= PVSCHED_F_LOCK_WAIT;
		else
			dev_info(dev, "lock waits not reported: this kernel has no lock contention tracepoints (Linux < 5.19)\n");
	}
	pd->lock_wait = wanted & PVSCHED_F_LOCK_WAIT;
	if (report_sync && (offered & PVSCHED_F_SYNC_COUNTS) &&
	    pvsched_have_all("sched_waking", true))
		wanted |= PVSCHED_F_SYNC_COUNTS;
	pd->sync_counts = wanted & PVSCHED_F_SYNC_COUNTS;
	pd->features = wanted;
	pvsched_wr(pd, PVSCHED_REG_DRV_FEATURES_LO, lower_32_bits(wanted));
	pvsched_wr(pd, PVSCHED_REG_DRV_FEATURES_HI, upper_32_bits(wanted));
	ret = pvsched_set_status(pd, PVSCHED_STATUS_FEATURES_OK, "FEATURES_OK");
	if (ret)
		return ret;

	if (dev_region) {
		ret = pvsched_map_device_region(pd, need);
		if (ret) {
			dev_err(dev, "cannot map device region (BAR%d): %d\n",
				PVSCHED_REGION_BAR, ret);
			return ret;
		}
	} else {
		ret = pvsched_alloc_guest_region(pd, need);
		if (ret)
			return ret;
	}
	pd->device_region = dev_region;

	ret = pvsched_set_status(pd, PVSCHED_STATUS_DRIVER_OK, "DRIVER_OK");
	if (ret)
		return ret;
	if (pvsched_check_header(pd)) {
		dev_err(dev, "device wrote an invalid region header\n");
		return -EPROTO;
	}
	pd->generation = pvsched_rd(pd, PVSCHED_REG_GENERATION);
	return 0;
}

/* ---------------------------------------------------------------------- */
/* PCI driver                                                              */
/* ---------------------------------------------------------------------- */

static void pvsched_detach(struct pvsched_dev *pd)
{
	pvsched_tp_unregister();
	WRITE_ONCE(pvsched_claiming, false);
	WRITE_ONCE(pvsched_task_flags, false);
	WRITE_ONCE(pvsched_sync_counts, false);
	if (pd->cpuhp_state > 0)
		cpuhp_remove_state(pd->cpuhp_state);
	pd->cpuhp_state = 0;
}

/*
 * The device is lost when STATUS reads all ones (it vanished: a dead
 * vfio-user server, a surprise removal) or says DEVICE_NEEDS_RESET or
 * FAILED (its back end died and the VMM says so).
 */
static bool pvsched_status_lost(u32 status)
{
	return status == ~0u ||
	       (status & (PVSCHED_STATUS_DEVICE_NEEDS_RESET | PVSCHED_STATUS_FAILED));
}

/*
 * Nothing on the hot path touches a register, so this is how the driver
 * learns the device is gone: it then stops reporting (nobody reads the slots
 * any more) and says once what to do. The region stays mapped until remove.
 */
static void pvsched_health(struct work_struct *work)
{
	struct pvsched_dev *pd = container_of(to_delayed_work(work),
					      struct pvsched_dev, health);
	u32 status = pvsched_rd(pd, PVSCHED_REG_STATUS);

	if (!pvsched_status_lost(status)) {
		schedule_delayed_work(&pd->health, msecs_to_jiffies(health_ms));
		return;
	}
	WRITE_ONCE(pd->lost, true);
	pd->gone = status == ~0u;
	pvsched_detach(pd);
	dev_err(&pd->pdev->dev,
		"device lost (status 0x%x): stopped reporting; once the host has restarted the device, unbind and bind the driver (or rmmod and insmod pvsched)\n",
		status);
}

static int pvsched_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct device *dev = &pdev->dev;
	struct pvsched_dev *pd;
	int ret;

	if (READ_ONCE(pvsched_active)) {
		dev_err(dev, "only one pvsched device per guest is supported\n");
		return -EBUSY;
	}

	pd = devm_kzalloc(dev, sizeof(*pd), GFP_KERNEL);
	if (!pd)
		return -ENOMEM;
	pd->pdev = pdev;

	ret = pcim_enable_device(pdev);
	if (ret)
		return ret;
	if (pci_resource_len(pdev, PVSCHED_REG_BAR) < PVSCHED_REG_BAR_SIZE) {
		dev_err(dev, "BAR%d too small\n", PVSCHED_REG_BAR);
		return -ENODEV;
	}
	ret = pcim_iomap_regions(pdev, BIT(PVSCHED_REG_BAR), KBUILD_MODNAME);
	if (ret)
		return ret;
	pd->regs = pcim_iomap_table(pdev)[PVSCHED_REG_BAR];
	pci_set_drvdata(pdev, pd);

	ret = pvsched_handshake(pd);
	if (ret)
		goto err_reset;

	WRITE_ONCE(pvsched_active, pd);
	WRITE_ONCE(pvsched_task_flags, pd->features & PVSCHED_F_TASK_FLAGS);
	WRITE_ONCE(pvsched_sync_counts, pd->features & PVSCHED_F_SYNC_COUNTS);
	ret = cpuhp_setup_state(CPUHP_AP_ONLINE_DYN, "pvsched:online",
				pvsched_cpu_online, pvsched_cpu_offline);
	if (ret < 0)
		goto err_active;
	pd->cpuhp_state = ret;

	WRITE_ONCE(pvsched_claiming, pd->wait_on);
	ret = pvsched_tp_register(pd);
	if (ret)
		goto err_detach;

	pd->debugfs = debugfs_create_dir(KBUILD_MODNAME, NULL);
	debugfs_create_file("stats", 0444, pd->debugfs, pd, &pvsched_stats_fops);

	INIT_DELAYED_WORK(&pd->health, pvsched_health);
	if (health_ms)
		schedule_delayed_work(&pd->health, msecs_to_jiffies(health_ms));

	dev_info(dev, "attached: %s region, %u vCPU slots, generation %u, features 0x%llx\n",
		 pd->device_region ? "device" : "guest", pd->nr_vcpus,
		 pd->generation, pd->features);
	return 0;

err_detach:
	pvsched_detach(pd);
err_active:
	WRITE_ONCE(pvsched_active, NULL);
err_reset:
	/* The device forgets the region before devm frees its pages. */
	pvsched_reset(pd);
	return ret;
}

static void pvsched_remove(struct pci_dev *pdev)
{
	struct pvsched_dev *pd = pci_get_drvdata(pdev);

	cancel_delayed_work_sync(&pd->health);
	debugfs_remove_recursive(pd->debugfs);
	pvsched_detach(pd);
	WRITE_ONCE(pvsched_active, NULL);
	if (pd->gone) {
		dev_info(&pdev->dev, "detached from a lost device\n");
		return;
	}
	pvsched_reset(pd);
	dev_info(&pdev->dev, "detached, device reset\n");
}

/*
 * The ABI's IDs. MODULE_DEVICE_TABLE makes them the module's alias, which
 * is what udev loads the module by, so IDs given at load time could never
 * get a device with other IDs autoloaded. A device shipped with a vendor's
 * own IDs is bound through the PCI core's dynamic IDs instead: echo VENDOR
 * DEVICE > /sys/bus/pci/drivers/pvsched/new_id, made persistent with a
 * modprobe.d alias and install line (docs/guest-driver.md, "Vendor IDs").
 */
static const struct pci_device_id pvsched_ids[] = {
	{ PCI_DEVICE(PVSCHED_PCI_VENDOR_ID, PVSCHED_PCI_DEVICE_ID) },
	{ }
};
MODULE_DEVICE_TABLE(pci, pvsched_ids);

static struct pci_driver pvsched_driver = {
	.name = KBUILD_MODNAME,
	.id_table = pvsched_ids,
	.probe = pvsched_probe,
	.remove = pvsched_remove,
};
module_pci_driver(pvsched_driver);

MODULE_DESCRIPTION("pvsched paravirtual scheduling hints (guest driver)");
MODULE_AUTHOR("pvsched developers");
MODULE_LICENSE("GPL");
MODULE_VERSION("1.2.0");
/* The ABI this driver speaks (`modinfo pvsched`): a device of the same
 * major accepts it; a newer minor's features stay off. */
MODULE_INFO(abi, __stringify(PVSCHED_ABI_MAJOR) "." __stringify(PVSCHED_ABI_MINOR));
