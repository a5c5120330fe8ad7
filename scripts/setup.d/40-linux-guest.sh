# shellcheck shell=bash
# Linux guest end-to-end tests: Debian's pytest, which runs them
# (/usr/bin/python3 -m pytest tests), QEMU 7.2 (multi-process proxy),
# busybox-static + cpio for the initramfs, and the Debian 6.1 guest kernel
# with matching headers (downloaded into the cache and unpacked, never
# installed). Sourced by scripts/setup; idempotent.

apt_install python3-pytest qemu-system-x86 busybox-static cpio kmod

pvsched_guest_fetch() {
	local dir="$PVSCHED_CACHE/linux-guest"
	# The tested kernel ABI is 6.1.0-56. Debian's mirrors keep only recent
	# 6.1 builds: when that one is gone, take the newest 6.1 cloud image that
	# apt still offers, and record the choice for the tests (tests/linux-guest).
	local abi="${PVSCHED_GUEST_KABI:-}"
	if [ -z "$abi" ] && [ -s "$dir/kabi" ]; then
		abi=$(cat "$dir/kabi")
	fi
	if [ -z "$abi" ]; then
		abi=6.1.0-56
		if [ "$apt_updated" -eq 0 ]; then
			apt-get update -qq
			apt_updated=1
		fi
		if ! apt-cache show "linux-image-${abi}-cloud-amd64-unsigned" >/dev/null 2>&1; then
			local newest
			newest=$(apt-cache pkgnames linux-image-6.1.0- 2>/dev/null |
				sed -n 's/^linux-image-\(6\.1\.0-[0-9]*\)-cloud-amd64-unsigned$/\1/p' |
				sort -t- -k2 -n | tail -n 1)
			if [ -z "$newest" ]; then
				log "no linux-image-6.1.0-*-cloud-amd64-unsigned in apt: cannot fetch the guest kernel"
				return 1
			fi
			log "guest kernel $abi is no longer offered; using $newest"
			abi=$newest
		fi
	fi
	mkdir -p "$dir"
	printf '%s\n' "$abi" >"$dir/kabi"
	local pkgs=(
		"linux-image-${abi}-cloud-amd64-unsigned"
		"linux-headers-${abi}-cloud-amd64"
		"linux-headers-${abi}-common"
		"linux-headers-${abi}-rt-amd64"
		"linux-headers-${abi}-common-rt"
		"linux-kbuild-6.1"
	)
	mkdir -p "$dir/debs" "$dir/root"
	local p
	for p in "${pkgs[@]}"; do
		if ! ls "$dir/debs/${p}_"*.deb >/dev/null 2>&1; then
			if [ "$apt_updated" -eq 0 ]; then
				apt-get update -qq
				apt_updated=1
			fi
			log "apt-get download $p"
			(cd "$dir/debs" && apt-get download -qq -o APT::Sandbox::User=root "$p")
		fi
	done
	local d
	for d in "$dir"/debs/*.deb; do
		local stamp="$dir/root/.$(basename "$d").unpacked"
		[ -e "$stamp" ] && continue
		dpkg-deb -x "$d" "$dir/root"
		touch "$stamp"
	done
}
pvsched_guest_fetch
