# shellcheck shell=bash
# pvschedd under a real systemd (crates/pvsched-daemon/tests/integration/systemd.rs):
# PID 1 on these machines is not systemd, so the test boots one with
# systemd-nspawn in a minimal Debian bookworm chroot that has systemd as
# its init and nothing else ($PVSCHED_CACHE/systemd-bookworm). The test
# binds pvschedd, the unit and its fake VMMs in; the chroot itself is
# never written to (it boots with --volatile=overlay). The package tests
# (tests/package) install pvsched into an overlay over it and run a real
# QEMU there, so it also has Debian's qemu-system-x86 (no recommends).
# Sourced by scripts/setup (apt_install and log provided); idempotent.

apt_install systemd-container debootstrap
# shellcheck source=../lib.sh
. "$PVSCHED_ROOT/scripts/lib.sh"

pvsched_systemd_chroot() {
	local dir="$PVSCHED_CACHE/systemd-bookworm"
	local mirror="${PVSCHED_MIRROR:-http://deb.debian.org/debian}"
	[ -e "$dir/.pvsched-ready" ] && return 0
	rm -rf "$dir"
	mkdir -p "$(dirname "$dir")"
	log "systemd container: debootstrap bookworm (minbase + systemd) into $dir"
	# systemd-sysv makes /sbin/init systemd; dbus lets systemctl and
	# machinectl talk to the manager the usual way.
	if ! debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,procps \
		bookworm "$dir" "$mirror" >"$dir.log" 2>&1; then
		log "debootstrap failed; its log: $dir.log"
		return 1
	fi
	# Boot fast and quietly: no getty on the container's console, nothing
	# that waits for a network or a clock.
	local u
	for u in getty@tty1.service console-getty.service systemd-timesyncd.service \
		systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer \
		e2scrub_all.timer fstrim.timer; do
		ln -sf /dev/null "$dir/etc/systemd/system/$u"
	done
	echo pvsched-systemd >"$dir/etc/hostname"
	touch "$dir/.pvsched-ready"
}

# QEMU for the package upgrade test's VM, in a chroot made before it was
# needed as well as in a new one.
pvsched_systemd_chroot_qemu() {
	local dir="$PVSCHED_CACHE/systemd-bookworm"
	[ -e "$dir/.pvsched-qemu" ] && return 0
	log "systemd container: qemu-system-x86 into $dir"
	if ! pvsched_in_chroot "$dir" sh -c 'apt-get update -qq &&
		apt-get install -y -qq --no-install-recommends qemu-system-x86 && apt-get clean' \
		>"$dir.qemu.log" 2>&1; then
		log "installing qemu-system-x86 in $dir failed; its log: $dir.qemu.log"
		return 1
	fi
	touch "$dir/.pvsched-qemu"
}
pvsched_systemd_chroot
pvsched_systemd_chroot_qemu
