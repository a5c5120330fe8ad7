#!/usr/bin/env bash
# Checks that the patch series in third_party/vfio_user/patches/ is exactly
# what changed the vendored crate: takes the pristine vfio_user 0.1.7 sources
# from git history (commit a7b0950, which vendored them unmodified), applies
# every patch in order with `git apply` (no fuzz), and fails unless the result
# is byte for byte third_party/vfio_user/src as checked out.
#
# Needs git and tar, and the repository's history: a shallow clone fetches
# it (network), or the check is skipped saying why. No root; takes about a
# second.
#
#   third_party/vfio_user/check-patches.sh
set -euo pipefail

pristine=a7b0950
crate_path=third_party/vfio_user
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# scripts/test runs this as root, maybe in a checkout another user owns;
# git refuses such a repository unless told it is safe. It is the one whose
# scripts are running, so it is trusted already.
git_root() { git -c safe.directory="$root" -C "$root" "$@"; }

if ! git_root cat-file -e "$pristine^{commit}" 2>/dev/null &&
	[ "$(git_root rev-parse --is-shallow-repository)" = true ]; then
	# A shallow clone lacks the pristine commit: fetch the history once.
	git_root fetch --quiet --unshallow 2>/dev/null || true
fi
if ! git_root cat-file -e "$pristine^{commit}" 2>/dev/null; then
	if [ "$(git_root rev-parse --is-shallow-repository)" = true ]; then
		# Nothing to compare against, through no fault of the tree.
		echo "check-patches: SKIP: this shallow clone lacks commit $pristine (pristine" \
			"vfio_user 0.1.7) and its history could not be fetched" >&2
		exit 0
	fi
	echo "check-patches: commit $pristine (pristine vfio_user 0.1.7) is not in this repository" >&2
	exit 1
fi

shopt -s nullglob
patches=("$here"/patches/[0-9][0-9][0-9][0-9]-*.patch)
shopt -u nullglob
if [ ${#patches[@]} -eq 0 ]; then
	echo "check-patches: no patches in $here/patches" >&2
	exit 1
fi
# Numbered 0001, 0002, ... without gaps or duplicates: the order is the
# series'.
n=0
for p in "${patches[@]}"; do
	n=$((n + 1))
	want=$(printf '%04d' "$n")
	name=$(basename "$p")
	if [ "${name%%-*}" != "$want" ]; then
		echo "check-patches: $name: expected patch number $want" >&2
		exit 1
	fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git_root archive "$pristine" "$crate_path/src" | tar -x -C "$tmp"
work=$tmp/$crate_path
# A repository of its own, so that `git apply` takes the patches' paths
# (a/src/...) relative to the crate root wherever $tmp is.
git -C "$work" init -q

for p in "${patches[@]}"; do
	if ! git -C "$work" apply --whitespace=nowarn "$p"; then
		echo "check-patches: $(basename "$p") does not apply on top of the patches before it" >&2
		exit 1
	fi
done

if ! diff -r "$work/src" "$root/$crate_path/src" >"$tmp/diff"; then
	echo "check-patches: the series applied to $pristine does not give $crate_path/src:" >&2
	head -n 60 "$tmp/diff" >&2
	echo "check-patches: see $crate_path/PATCHES.md (every change to src/ goes through the series)" >&2
	exit 1
fi
echo "check-patches: ${#patches[@]} patches applied to $pristine give $crate_path/src exactly"
