# Shared helpers for scripts/ and the tests (sourced, not run).

# pvsched_in_chroot DIR CMD...: run CMD inside the Debian chroot DIR with
# /proc and /dev mounted in a private mount namespace (gone when CMD ends)
# and a clean environment.
pvsched_in_chroot() {
	local dir=$1
	shift
	unshare --mount --propagation private --fork -- sh -c '
		r=$1
		shift
		mount -t proc proc "$r/proc" && mount --rbind /dev "$r/dev" &&
			exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
				HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"' \
		sh "$dir" "$@"
}

# pvsched_matrix_kernels: the lines of tests/linux-guest/kernels.conf this
# run covers (NAME SUITE RELEASE CI): every kernel with
# PVSCHED_GUEST_MATRIX=all (scripts/test --guest-matrix), else the CI ones.
# The tests select the same (tests/linux-guest/conftest.py, matrix_kernels).
pvsched_matrix_kernels() {
	local conf="${PVSCHED_ROOT:?}/tests/linux-guest/kernels.conf"
	local all="${PVSCHED_GUEST_MATRIX:-}"
	awk -v all="$all" '!/^#/ && NF == 4 && (all == "all" || $4 == "yes")' "$conf"
}
