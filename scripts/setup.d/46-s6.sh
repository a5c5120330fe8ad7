# shellcheck shell=bash
# S6 benchmark (pvsched-bench s6, python/pvsched_bench/s6.py): the guest
# workloads are Debian's own programs, installed in each guest-matrix chroot this run covers (the
# guest image of that kernel's suite, scripts/setup.d/42-guest-matrix.sh)
# and copied from there with their libraries into the guest's initramfs:
# stress-ng (CPU, TLB shootdown and membarrier stressors), rt-tests
# (hackbench) and dbench. Sourced by scripts/setup after 42; idempotent.

# shellcheck source=../lib.sh
. "$PVSCHED_ROOT/scripts/lib.sh"

pvsched_s6_workloads() {
	local name suite csuite dir
	local pkgs=(stress-ng rt-tests dbench)
	while read -r name suite _ _; do
		csuite=${suite%-backports}
		dir="$PVSCHED_CACHE/guest-matrix/chroot-$csuite"
		[ -e "$dir/.pvsched-ready" ] || continue
		[ -e "$dir/.pvsched-s6-ready" ] && continue
		log "S6: installing ${pkgs[*]} in the $csuite chroot"
		pvsched_chroot_install "$dir" "${pkgs[@]}"
		touch "$dir/.pvsched-s6-ready"
	done < <(pvsched_matrix_kernels)
}
pvsched_s6_workloads
