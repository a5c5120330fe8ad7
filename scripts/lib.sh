# Shared helpers for scripts/ and tests/steps/ (sourced, not run).

# need_real WHAT WHY: a capability the test needs is missing. With
# PVSCHED_REQUIRE_REAL=1 (CI) that is a failure; otherwise a printed skip.
need_real() {
	if [ "${PVSCHED_REQUIRE_REAL:-0}" = "1" ]; then
		printf 'FAIL: %s is required (PVSCHED_REQUIRE_REAL=1): %s\n' "$1" "$2" >&2
		exit 1
	fi
	printf 'SKIP: %s unavailable: %s\n' "$1" "$2" >&2
}
