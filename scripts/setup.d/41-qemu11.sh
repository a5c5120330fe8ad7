# shellcheck shell=bash
# QEMU >= 10.1 with the upstream vfio-user-pci client, for the
# Linux-guest test over vfio-user. Debian's QEMU 11.1 (trixie-backports)
# does not install on bookworm (it needs trixie's libc), but runs uninstalled:
# its debs and their library dependencies are downloaded with a private apt
# state (the system's apt sources and QEMU 7.2 are never touched) and
# unpacked into $PVSCHED_CACHE/qemu11/root. Run it with
# $PVSCHED_CACHE/qemu11/qemu-system-x86_64 (a wrapper written here).
# Sourced by scripts/setup; idempotent.

pvsched_qemu11_fetch() {
	local dir="$PVSCHED_CACHE/qemu11"
	# The tested build; if trixie-backports drops it, the newest >= 10.1
	# there is used and recorded in $dir/version.
	local want="${PVSCHED_QEMU11_VERSION:-1:11.1.3+ds-1~bpo13+1}"
	if [ -x "$dir/qemu-system-x86_64" ] && [ -s "$dir/version" ]; then
		return 0
	fi
	local apt="$dir/apt"
	mkdir -p "$apt/state/lists/partial" "$apt/cache/archives/partial" "$dir/root"
	cat >"$apt/sources.list" <<-'SRC'
		deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
		deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie-backports main
	SRC
	local opts=(-o "Dir::State=$apt/state" -o "Dir::Cache=$apt/cache"
		-o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
		-o "Dir::State::status=/dev/null" -o "APT::Default-Release=trixie-backports"
		-o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
	log "qemu11: apt-get update (private state in $apt)"
	apt-get "${opts[@]}" -qq update
	local version="$want"
	if ! apt-cache "${opts[@]}" madison qemu-system-x86 | grep -qF "| $want |"; then
		version=$(apt-cache "${opts[@]}" madison qemu-system-x86 | awk -F'|' '{gsub(/ /,"",$2); print $2}' |
			while read -r v; do
				if dpkg --compare-versions "$v" ge 1:10.1; then echo "$v"; fi
			done | sort -V | tail -n 1)
		if [ -z "$version" ]; then
			log "qemu11: no qemu-system-x86 >= 10.1 in trixie/trixie-backports"
			return 1
		fi
		log "qemu11: $want is no longer offered; using $version"
	fi
	log "qemu11: downloading qemu-system-x86 $version and its libraries"
	DEBIAN_FRONTEND=noninteractive apt-get "${opts[@]}" -qq -y --no-install-recommends \
		install --download-only "qemu-system-x86=$version" "qemu-system-data=$version" \
		"qemu-system-common=$version" seabios ipxe-qemu >/dev/null
	local d
	for d in "$apt"/cache/archives/*.deb; do
		local stamp="$dir/root/.$(basename "$d").unpacked"
		[ -e "$stamp" ] && continue
		dpkg-deb -x "$d" "$dir/root"
		touch "$stamp"
	done
	cat >"$dir/qemu-system-x86_64" <<-'WRAP'
		#!/bin/sh
		# QEMU 11 from trixie-backports, unpacked by scripts/setup.d/41-qemu11.sh,
		# run with its own dynamic loader and libraries.
		r="$(cd "$(dirname "$0")" && pwd)/root"
		exec "$r/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$r/usr/lib/x86_64-linux-gnu" \
			"$r/usr/bin/qemu-system-x86_64" -L "$r/usr/share/qemu" -L "$r/usr/share/seabios" "$@"
	WRAP
	chmod +x "$dir/qemu-system-x86_64"
	"$dir/qemu-system-x86_64" --version | head -n 1 >&2
	printf '%s\n' "$version" >"$dir/version"
	rm -rf "$apt/cache/archives"/*.deb
}
pvsched_qemu11_fetch
