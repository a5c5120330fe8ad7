# shellcheck shell=bash
# Sourced by scripts/setup: a real Prometheus for tests/prometheus, which
# scrapes pvschedd's /metrics, loads dist/prometheus/pvsched.rules.yml and
# checks both with promtool (apt_install and log provided); idempotent.
#   prometheus    /usr/bin/prometheus and /usr/bin/promtool (bookworm: 2.42)
#
# The package's postinst starts its own service (init.d script, or the
# systemd unit where systemd is PID 1) on :9090 with /etc/prometheus. The
# test runs its own Prometheus on a free port and needs none, so a service
# started by this install (not one that ran before it) is stopped again:
# a machine that only builds and tests pvsched keeps no Prometheus running
# and no :9090 taken.
pvsched_prometheus() {
	if dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q 'install ok installed'; then
		return 0
	fi
	apt_install prometheus
	if [ -d /run/systemd/system ]; then
		systemctl disable --now prometheus.service >/dev/null 2>&1 || true
	elif [ -x /etc/init.d/prometheus ]; then
		/etc/init.d/prometheus stop >/dev/null 2>&1 || true
		update-rc.d prometheus disable >/dev/null 2>&1 || true
	fi
	log "prometheus $(prometheus --version 2>&1 | awk 'NR == 1 { print $3 }') installed; its service is left stopped (tests/prometheus runs its own)"
}
pvsched_prometheus
