#!/usr/bin/env bash
# The whole test suite, the README's test command: every crate's unit, integration, property,
# multi-process and end-to-end tests, and the doc tests.
#   scripts/test.sh                  # the workspace
#   scripts/test.sh -p burn-ddp-burn022   # one crate (any cargo package selection)
# With cargo-nextest installed, every test binary's tests run side by side in one pool, the
# tests that time a fault or a bound first, in a phase of their own (.config/nextest.toml), then
# the doc tests
# (nextest runs none); without it, `cargo test`, one binary after another. BURN_DDP_TEST_RUNNER=cargo
# chooses `cargo test` even where nextest is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
select=("$@")
[ ${#select[@]} -gt 0 ] || select=(--workspace)
if [ "${BURN_DDP_TEST_RUNNER:-}" != cargo ] && cargo nextest --version >/dev/null 2>&1; then
    # Three slots per CPU (.config/nextest.toml says how tests take them); NEXTEST_TEST_THREADS
    # chooses another count.
    threads=${NEXTEST_TEST_THREADS:-$((3 * $(nproc)))}
    # Two phases over one build: the tests whose verdict depends on time side by side with
    # each other and nothing else (the `timed` profile), then every other test. A failure in
    # the first does not keep the second from running; the script fails if either failed.
    timed=$(sed -n "/^\[profile\.timed\]/,/^\[/ s/^default-filter = '\(.*\)'\$/\1/p" .config/nextest.toml)
    if [ -z "$timed" ]; then
        echo "test.sh: .config/nextest.toml has no [profile.timed] default-filter" >&2
        exit 1
    fi
    failed=0
    cargo nextest run "${select[@]}" --profile timed --no-fail-fast --no-tests pass \
        --test-threads "$threads" || failed=1
    cargo nextest run "${select[@]}" --no-fail-fast --no-tests pass --test-threads "$threads" \
        -E "not ($timed)" || failed=1
    cargo test "${select[@]}" --doc || failed=1
    exit "$failed"
else
    [ "${BURN_DDP_TEST_RUNNER:-}" = cargo ] || echo "test.sh: cargo-nextest is not installed; cargo test runs the binaries one after another" >&2
    cargo test "${select[@]}" --no-fail-fast
fi
