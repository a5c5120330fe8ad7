#!/usr/bin/env bash
# The pvsched guest driver in a real Debian 6.1 guest under QEMU 7.2
# TCG, with the device served by pvsched-device over QEMU's multi-process
# proxy; and the same guest under QEMU 11 over vfio-user, in device-
# and guest-region mode. Builds the module (cloud kernel; PREEMPT_RT build-test), boots
# -smp 2 and -smp 4 plus three negative boots, asserts from the host side;
# one more -smp 2 boot with pvsched-agent-attach on QEMU's vCPU threads, and
# one over vfio-user with pvschedd's region map as BAR2 (vfio-daemon), and
# two where the device goes away while the driver is bound: SIGKILLed
# (vfio-kill) and device_del'd over QMP (vfio-unplug).
set -euo pipefail
root="${PVSCHED_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
cache="${PVSCHED_CACHE:-$root/.cache}"
# shellcheck source=../../scripts/lib.sh
. "$root/scripts/lib.sh"

for tool in qemu-system-x86_64 busybox cpio gcc make python3; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		need_real "$tool" "install it with scripts/setup (scripts/setup.d/40-linux-guest.sh)"
		exit 0
	fi
done
# The kernel ABI scripts/setup fetched (6.1.0-56 unless Debian dropped it).
if [ -z "${PVSCHED_GUEST_KABI:-}" ] && [ -s "$cache/linux-guest/kabi" ]; then
	PVSCHED_GUEST_KABI=$(cat "$cache/linux-guest/kabi")
fi
export PVSCHED_GUEST_KABI="${PVSCHED_GUEST_KABI:-6.1.0-56}"
if [ ! -e "$cache/linux-guest/root/boot/vmlinuz-${PVSCHED_GUEST_KABI}-cloud-amd64" ]; then
	need_real "Debian guest kernel" "not in $cache/linux-guest (run scripts/setup)"
	exit 0
fi

cd "$root"
cargo build --locked --release -p pvsched-transport --bin pvsched-device \
	-p pvsched-agent --bin pvsched-agent-attach -p pvsched --bin pvsched \
	-p pvsched-daemon --bin pvschedd
target="${CARGO_TARGET_DIR:-$root/target}"
# The agent-in-the-loop boot loads BPF and changes QEMU's vCPU threads'
# scheduling: it needs root.
scenarios=main,negative,agent,vfio-device,vfio-guest,vfio-daemon,vfio-kill,vfio-unplug
agent=(--agent-bin "$target/release/pvsched-agent-attach")
if [ "$(id -u)" != 0 ]; then
	need_real "root" "the agent-in-the-loop boot loads BPF (run as root)"
	scenarios=${scenarios/,agent/}
	scenarios=${scenarios/,vfio-daemon/}
fi
# QEMU >= 10.1 for the vfio-user boots (scripts/setup.d/41-qemu11.sh).
if [ ! -x "$cache/qemu11/qemu-system-x86_64" ]; then
	need_real "QEMU >= 10.1" "not in $cache/qemu11 (run scripts/setup)"
	scenarios=$(echo "$scenarios" | tr , '\n' | grep -v '^vfio-' | paste -sd, -)
fi
timeout 900 python3 tests/linux-guest/run.py \
	--cache "$cache" --device-bin "$target/release/pvsched-device" "${agent[@]}" \
	--scenarios "$scenarios" "$@"
