# shellcheck shell=bash
# pvschedd under a real systemd (crates/pvsched-daemon/tests/integration/systemd.rs):
# PID 1 on these machines is not systemd, so the test boots one with
# systemd-nspawn in a minimal Debian bookworm chroot that has systemd as
# its init and nothing else ($PVSCHED_CACHE/systemd-bookworm). The test
# binds pvschedd, the unit and its fake VMMs in; the chroot itself is
# never written to (it boots with --volatile=overlay).
# Sourced by scripts/setup (apt_install and log provided); idempotent.

apt_install systemd-container debootstrap

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
pvsched_systemd_chroot
