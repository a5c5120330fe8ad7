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

# pvsched_chroot_install DIR APT-ARGS...: apt-get install APT-ARGS in the
# chroot DIR, its output appended to DIR.log. A failed install (an
# interrupted dpkg, a truncated download) is repaired and retried once;
# if that fails too, the log's tail and the free space go to stderr so a
# CI run shows why without the cache. Used by scripts/setup.d only.
pvsched_chroot_install() {
	local dir=$1
	shift
	local cmd=(apt-get install -y -qq --no-install-recommends
		-o Dpkg::Options::=--force-confold "$@")
	pvsched_in_chroot "$dir" "${cmd[@]}" >>"$dir.log" 2>&1 && return 0
	printf 'setup: installing %s in %s failed; repairing dpkg and retrying once\n' \
		"$*" "$dir" >&2
	pvsched_in_chroot "$dir" sh -c 'dpkg --configure -a; apt-get clean; apt-get update -qq' \
		>>"$dir.log" 2>&1 || true
	pvsched_in_chroot "$dir" "${cmd[@]}" >>"$dir.log" 2>&1 && return 0
	printf 'setup: installing %s in %s failed again; the end of %s:\n' \
		"$*" "$dir" "$dir.log" >&2
	tail -n 40 "$dir.log" >&2
	df -h "$dir" >&2
	return 1
}
