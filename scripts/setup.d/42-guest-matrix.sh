# shellcheck shell=bash
# The guest driver's kernel matrix: for each kernel of
# tests/linux-guest/kernels.conf this run covers (pvsched_matrix_kernels in
# scripts/lib.sh: the CI ones, or all with PVSCHED_GUEST_MATRIX=all), a
# minimal Debian chroot of its suite (debootstrap) with gcc, dkms, kmod,
# debhelper and dh-dkms, the kernel's headers installed in it, as on a guest
# image, and the kernel image's vmlinuz in $PVSCHED_CACHE/guest-matrix/NAME/.
# tests/linux-guest/test_guest_matrix.py builds and installs the driver
# there with DKMS. The host's own apt state is not touched (beyond debootstrap).
# Sourced by scripts/setup; idempotent.

# shellcheck source=../lib.sh
. "$PVSCHED_ROOT/scripts/lib.sh"
apt_install debootstrap

PVSCHED_MIRROR="${PVSCHED_MIRROR:-http://deb.debian.org/debian}"
PVSCHED_SECURITY_MIRROR="${PVSCHED_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

# pvsched_chroot SUITE: $PVSCHED_CACHE/guest-matrix/chroot-SUITE, made once.
pvsched_chroot() {
	local suite=$1
	local dir="$PVSCHED_CACHE/guest-matrix/chroot-$suite"
	[ -e "$dir/.pvsched-ready" ] && return 0
	rm -rf "$dir"
	mkdir -p "$(dirname "$dir")"
	log "guest matrix: debootstrap $suite (minbase) into $dir"
	if ! debootstrap --variant=minbase "$suite" "$dir" "$PVSCHED_MIRROR" >"$dir.log" 2>&1; then
		log "debootstrap $suite failed; its log: $dir.log"
		return 1
	fi
	# As a guest image has them: the point release, its updates and the
	# security archive (where the newest kernel ABI often is first), and
	# backports after bookworm.
	{
		echo "deb $PVSCHED_MIRROR $suite main"
		echo "deb $PVSCHED_MIRROR $suite-updates main"
		echo "deb $PVSCHED_SECURITY_MIRROR $suite-security main"
		[ "$suite" = bookworm ] || echo "deb $PVSCHED_MIRROR $suite-backports main"
	} >"$dir/etc/apt/sources.list"
	# Nothing installed in the chroot may start a service, and installing a
	# kernel builds no initramfs (the tests boot their own).
	printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
	chmod +x "$dir/usr/sbin/policy-rc.d"
	mkdir -p "$dir/etc/initramfs-tools"
	printf 'update_initramfs=no\n' >"$dir/etc/initramfs-tools/update-initramfs.conf"
	local pkgs=(build-essential dkms kmod debhelper fakeroot xz-utils)
	# bookworm's dkms carries dh_dkms itself; later suites split it out.
	[ "$suite" = bookworm ] || pkgs+=(dh-dkms)
	pvsched_in_chroot "$dir" apt-get update -qq
	log "guest matrix: installing ${pkgs[*]} in the $suite chroot"
	pvsched_chroot_install "$dir" "${pkgs[@]}"
	touch "$dir/.pvsched-ready"
}

# pvsched_resolve_release CHROOT RELEASE: RELEASE if the chroot's suite
# offers its headers, else the newest release of the same MAJOR.MINOR and
# flavour that it offers.
pvsched_resolve_release() {
	local dir=$1 rel=$2
	if pvsched_in_chroot "$dir" apt-cache show "linux-headers-$rel" >/dev/null 2>&1; then
		echo "$rel"
		return 0
	fi
	local majmin flavour
	majmin=$(echo "$rel" | cut -d. -f1,2)
	case "$rel" in
	*-cloud-amd64) flavour=cloud-amd64 ;;
	*-rt-amd64) flavour=rt-amd64 ;;
	*) flavour=amd64 ;;
	esac
	pvsched_in_chroot "$dir" apt-cache pkgnames "linux-headers-$majmin" |
		sed -n 's/^linux-headers-//p' | grep -E "^${majmin//./\\.}[.0-9]*[-+].*-${flavour}\$" |
		{ if [ "$flavour" = amd64 ]; then grep -vE -- '-(cloud|rt)-amd64$'; else cat; fi; } |
		sort -V | tail -n 1
}

pvsched_matrix_fetch() {
	local name suite rel ci
	while read -r name suite rel ci; do
		local csuite=${suite%-backports}
		local dir="$PVSCHED_CACHE/guest-matrix/chroot-$csuite"
		local out="$PVSCHED_CACHE/guest-matrix/$name"
		# build is a link to the headers, which only resolves inside the
		# chroot when it is absolute (bookworm's): -L, not -e.
		if [ -s "$out/release" ] && [ -s "$out/vmlinuz" ] &&
			[ -L "$dir/lib/modules/$(cat "$out/release")/build" ] &&
			[ -e "$dir/lib/modules/$(cat "$out/release")/modules.dep" ]; then
			continue
		fi
		pvsched_chroot "$csuite"
		local got
		got=$(pvsched_resolve_release "$dir" "$rel")
		if [ -z "$got" ]; then
			log "guest matrix: $suite offers no linux-headers for $rel or its MAJOR.MINOR"
			return 1
		fi
		[ "$got" = "$rel" ] || log "guest matrix: $name: $rel is no longer offered; using $got"
		# The chroot is a guest image with this kernel installed (image and
		# headers): DKMS skips depmod for a kernel whose modules.dep is
		# missing, and modprobe needs it. The test boots its own initramfs,
		# so the chroot makes none.
		log "guest matrix: $name: installing linux-image-$got and linux-headers-$got"
		local img=linux-image-$got
		pvsched_in_chroot "$dir" apt-cache show "$img" >/dev/null 2>&1 || img=$img-unsigned
		# A backports kernel takes what it needs from backports (linux-base).
		local target=()
		[ "$suite" = "$csuite" ] || target=(-t "$suite")
		pvsched_chroot_install "$dir" "${target[@]}" "$img" "linux-headers-$got"
		mkdir -p "$out"
		local v
		for v in "$dir/boot/vmlinuz-$got" "$dir/usr/lib/modules/$got/vmlinuz"; do
			[ -s "$v" ] && cp "$v" "$out/vmlinuz" && break
		done
		if [ ! -s "$out/vmlinuz" ]; then
			log "guest matrix: $img installed no vmlinuz in /boot or /usr/lib/modules/$got"
			return 1
		fi
		printf '%s\n' "$got" >"$out/release"
		printf '%s\n' "$csuite" >"$out/suite"
	done < <(pvsched_matrix_kernels)
}
pvsched_matrix_fetch
