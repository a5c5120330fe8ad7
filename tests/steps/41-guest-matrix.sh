#!/usr/bin/env bash
# The guest driver on the kernels guest images ship
# (tests/linux-guest/kernels.conf; the CI kernels in every run, all of them
# with `scripts/test --guest-matrix`). For each suite chroot that
# scripts/setup.d/42-guest-matrix.sh prepared (a minimal Debian with the
# kernels' headers, as on a guest image):
#   1. `make dkms-src`, then `dkms add`, `dkms build` and `dkms install` for
#      each kernel; its make.log must hold no warning (a compile error, e.g. a
#      probe whose prototype does not match the kernel's tracepoint, fails
#      `dkms build` itself); modinfo's alias and depmod's modules.alias must
#      be the ABI's IDs; then `dkms remove`.
#   2. `apt install ./pvsched-dkms_*.deb`: its postinst builds and installs
#      the module with DKMS; `dkms status` must say installed for each
#      kernel. The package is built once, by `make deb` (dpkg-buildpackage,
#      dh-dkms) in the first chroot that has dh-dkms (trixie; bookworm's dkms
#      has no dh-sequence-dkms), and the same .deb goes to every suite.
# Then each kernel boots under QEMU TCG with the module apt/DKMS installed,
# loaded by modprobe (tests/linux-guest/run.py --kernel NAME): the main e2e
# assertions with 20 load/unload cycles, wait_on with the policy in the
# loop, and the hostile-header probes.
set -euo pipefail
root="${PVSCHED_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}"
cache="${PVSCHED_CACHE:-$root/.cache}"
export PVSCHED_ROOT="$root"
# shellcheck source=../../scripts/lib.sh
. "$root/scripts/lib.sh"

if [ "$(id -u)" != 0 ]; then
	need_real "root" "DKMS runs in chroots (run as root)"
	exit 0
fi
for tool in qemu-system-x86_64 unshare readelf; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		need_real "$tool" "install it with scripts/setup"
		exit 0
	fi
done
mapfile -t kernels < <(pvsched_matrix_kernels)
version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"/\1/p' "$root/guest-driver/dkms.conf")
# The module alias udev loads the driver by: the ABI's IDs (a vendor's own
# are added through new_id at run time, docs/guest-driver.md).
abi_id() { sed -n "s/^#define $1 0x\([0-9a-fA-F]*\)$/\1/p" "$root/include/pvsched_abi.h"; }
abi_alias=$(printf 'pci:v%08Xd%08Xsv*sd*bc*sc*i*' "0x$(abi_id PVSCHED_PCI_VENDOR_ID)" \
	"0x$(abi_id PVSCHED_PCI_DEVICE_ID)")
log() { printf 'guest-matrix: %s\n' "$*"; }

# The suites, each with its kernels' releases.
declare -A suite_rels
for line in "${kernels[@]}"; do
	read -r name suite _ _ <<<"$line"
	if [ ! -s "$cache/guest-matrix/$name/release" ]; then
		need_real "kernel $name" "not in $cache/guest-matrix (run scripts/setup)"
		exit 0
	fi
	csuite=$(cat "$cache/guest-matrix/$name/suite")
	suite_rels[$csuite]+=" $(cat "$cache/guest-matrix/$name/release")"
done

deb="$cache/guest-matrix/deb/pvsched-dkms_${version}_all.deb"
rm -f "$deb"
for csuite in "${!suite_rels[@]}"; do
	ch="$cache/guest-matrix/chroot-$csuite"
	rels=${suite_rels[$csuite]}
	# A clean slate: no pvsched package, DKMS tree or source left by an
	# earlier run.
	pvsched_in_chroot "$ch" sh -c "apt-get purge -y -qq pvsched-dkms >/dev/null 2>&1;
		dkms remove -m pvsched -v $version --all >/dev/null 2>&1;
		rm -rf /usr/src/pvsched-$version /var/lib/dkms/pvsched /tmp/pvsched-src /tmp/pvsched-deb
		for r in $rels; do rm -f /lib/modules/\$r/updates/dkms/pvsched.ko*; done; true"
	mkdir -p "$ch/tmp/pvsched-src"
	cp -r "$root/guest-driver" "$root/include" "$ch/tmp/pvsched-src/"
	rm -rf "$ch/tmp/pvsched-src/guest-driver/deb"
	if [ ! -s "$deb" ] && pvsched_in_chroot "$ch" dpkg -s dh-dkms >/dev/null 2>&1; then
		log "$csuite: make deb"
		pvsched_in_chroot "$ch" make -s -C /tmp/pvsched-src/guest-driver deb DEB_OUT=/tmp/pvsched-deb \
			>"$ch/tmp/pvsched-deb.log" 2>&1 || {
			cat "$ch/tmp/pvsched-deb.log" >&2
			echo "FAIL: building pvsched-dkms_${version}_all.deb failed" >&2
			exit 1
		}
		mkdir -p "$(dirname "$deb")"
		cp "$ch/tmp/pvsched-deb/pvsched-dkms_${version}_all.deb" "$deb"
		dpkg-deb --info "$deb" | grep -E '^ (Package|Version|Depends):'
	fi
done
if [ ! -s "$deb" ]; then
	echo "FAIL: no chroot of ${!suite_rels[*]} has dh-dkms to build the .deb (scripts/setup installs it in trixie's)" >&2
	exit 1
fi

for csuite in "${!suite_rels[@]}"; do
	ch="$cache/guest-matrix/chroot-$csuite"
	rels=${suite_rels[$csuite]}
	log "$csuite: make dkms-src; dkms add, build, install for$rels"
	pvsched_in_chroot "$ch" make -s -C /tmp/pvsched-src/guest-driver dkms-src \
		DKMS_DIR="/usr/src/pvsched-$version"
	pvsched_in_chroot "$ch" dkms add -m pvsched -v "$version"
	for r in $rels; do
		built=1
		pvsched_in_chroot "$ch" dkms build -m pvsched -v "$version" -k "$r" || built=0
		# dkms 3.2 keeps the build log per kernel; 3.0 (bookworm) in build/.
		mklog="$ch/var/lib/dkms/pvsched/$version/$r/x86_64/log/make.log"
		[ -s "$mklog" ] || mklog="$ch/var/lib/dkms/pvsched/$version/build/make.log"
		if [ ! -s "$mklog" ]; then
			echo "FAIL: no DKMS make.log for $r" >&2
			exit 1
		fi
		# A compile error (e.g. a probe whose prototype is not its
		# tracepoint's in this kernel) fails dkms build: show it.
		if [ "$built" = 0 ]; then
			grep -E 'error:|note:' "$mklog" | head -n 20 >&2 || tail -n 30 "$mklog" >&2
			echo "FAIL: dkms build of pvsched for $r failed (see $mklog)" >&2
			exit 1
		fi
		if grep -E 'warning:|error:' "$mklog"; then
			echo "FAIL: building pvsched against $r warned (see $mklog)" >&2
			exit 1
		fi
		pvsched_in_chroot "$ch" dkms install -m pvsched -v "$version" -k "$r"
		pvsched_in_chroot "$ch" modinfo -k "$r" -F vermagic pvsched | grep -q "^$r " || {
			echo "FAIL: modinfo -k $r pvsched does not show vermagic $r" >&2
			exit 1
		}
		got=$(pvsched_in_chroot "$ch" modinfo -k "$r" -F alias pvsched)
		if [ "$got" != "$abi_alias" ] ||
			! grep -qxF "alias $abi_alias pvsched" "$ch/lib/modules/$r/modules.alias"; then
			echo "FAIL: pvsched for $r: alias '$got' and modules.alias, expected '$abi_alias'" >&2
			exit 1
		fi
	done
	pvsched_in_chroot "$ch" dkms status -m pvsched
	pvsched_in_chroot "$ch" dkms remove -m pvsched -v "$version" --all
	rm -rf "$ch/usr/src/pvsched-$version"

	log "$csuite: apt install ./pvsched-dkms_${version}_all.deb"
	cp "$deb" "$ch/tmp/"
	pvsched_in_chroot "$ch" apt-get install -y -qq "/tmp/pvsched-dkms_${version}_all.deb" |
		grep -v '^(Reading database'
	for r in $rels; do
		if ! pvsched_in_chroot "$ch" dkms status -m pvsched -v "$version" -k "$r" | grep -q installed; then
			pvsched_in_chroot "$ch" dkms status
			echo "FAIL: after apt install, DKMS did not install pvsched for $r" >&2
			exit 1
		fi
	done
	pvsched_in_chroot "$ch" dkms status -m pvsched
done

cd "$root"
cargo build --locked --release -p pvsched-transport --bin pvsched-device \
	-p pvsched-agent --bin pvsched-agent-attach
target="${CARGO_TARGET_DIR:-$root/target}"
for line in "${kernels[@]}"; do
	read -r name _ _ _ <<<"$line"
	log "booting $name"
	timeout 900 python3 tests/linux-guest/run.py --cache "$cache" \
		--device-bin "$target/release/pvsched-device" \
		--agent-bin "$target/release/pvsched-agent-attach" \
		--kernel "$name" --smp 2 --scenarios main,wait,hostile "$@"
done
