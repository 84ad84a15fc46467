#!/usr/bin/env bash
# The whole test suite, the README's test command: every crate's unit, integration, property,
# multi-process and end-to-end tests, and the doc tests.
#   scripts/test.sh                  # the workspace
#   scripts/test.sh -p burn-ddp-burn022   # one crate (any cargo package selection)
# With cargo-nextest installed, every test binary's tests run side by side in one pool
# (.config/nextest.toml: the tests that time a fault or a bound run alone), then the doc tests
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
    cargo nextest run "${select[@]}" --no-fail-fast --test-threads "$threads"
    cargo test "${select[@]}" --doc
else
    [ "${BURN_DDP_TEST_RUNNER:-}" = cargo ] || echo "test.sh: cargo-nextest is not installed; cargo test runs the binaries one after another" >&2
    cargo test "${select[@]}" --no-fail-fast
fi
