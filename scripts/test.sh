#!/usr/bin/env bash
# The whole test suite, the README's test command: every crate's unit, integration, property,
# multi-process and end-to-end tests, and the doc tests, on every Burn release.
#   scripts/test.sh                       # everything: Burn 0.21 and 0.22, then Burn 0.23
#   scripts/test.sh -p burn-ddp-gradsync  # one crate (any cargo package selection)
# One cargo run serves one Burn release of `burn-ddp-gradsync` (its features `burn-0-22`, the
# default, and `burn-0-23` are exclusive), so a selection that holds it (the default, or
# `--workspace`, or `-p burn-ddp-gradsync`) runs twice: as given (the workspace: Burn 0.21's line
# and Burn 0.22's), then `-p burn-ddp-gradsync --no-default-features --features
# $BURN_DDP_TEST_FEATURES_023` (default `burn-0-23,train,hold-systemstat`: Burn 0.23's).
# With cargo-nextest installed, every test binary's tests run side by side in one pool, the
# tests that time a fault or a bound first, in a phase of their own (.config/nextest.toml), then
# the doc tests (nextest runs none); without it, `cargo test`, one binary after another.
# BURN_DDP_TEST_RUNNER=cargo chooses `cargo test` even where nextest is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
select=("$@")
[ ${#select[@]} -gt 0 ] || select=(--workspace)
export BURN_DDP_TEST_FEATURES_023=${BURN_DDP_TEST_FEATURES_023:-burn-0-23,train,hold-systemstat}
runs=("${select[*]}")
locked=
for arg in "${select[@]}"; do
    [ "$arg" != --locked ] || locked=--locked
done
case " ${select[*]} " in
*" --workspace "* | *" -p burn-ddp-gradsync "* | *" --package burn-ddp-gradsync "*)
    runs+=("-p burn-ddp-gradsync --no-default-features --features $BURN_DDP_TEST_FEATURES_023 $locked")
    ;;
esac

failed=0
if [ "${BURN_DDP_TEST_RUNNER:-}" != cargo ] && cargo nextest --version >/dev/null 2>&1; then
    # Three slots per CPU (.config/nextest.toml says how tests take them); NEXTEST_TEST_THREADS
    # chooses another count.
    threads=${NEXTEST_TEST_THREADS:-$((3 * $(nproc)))}
    # Two phases over one build per run: the tests whose verdict depends on time side by side
    # with each other and nothing else (the `timed` profile), then every other test. A failure
    # in the first does not keep the second from running; the script fails if either failed.
    timed=$(sed -n "/^\[profile\.timed\]/,/^\[/ s/^default-filter = '\(.*\)'\$/\1/p" .config/nextest.toml)
    if [ -z "$timed" ]; then
        echo "test.sh: .config/nextest.toml has no [profile.timed] default-filter" >&2
        exit 1
    fi
    for run in "${runs[@]}"; do
        read -r -a args <<<"$run"
        echo "test.sh: cargo nextest run ${args[*]}" >&2
        cargo nextest run "${args[@]}" --profile timed --no-fail-fast --no-tests pass \
            --test-threads "$threads" || failed=1
        cargo nextest run "${args[@]}" --no-fail-fast --no-tests pass --test-threads "$threads" \
            -E "not ($timed)" || failed=1
        cargo test "${args[@]}" --doc --no-fail-fast || failed=1
    done
else
    [ "${BURN_DDP_TEST_RUNNER:-}" = cargo ] || echo "test.sh: cargo-nextest is not installed; cargo test runs the binaries one after another" >&2
    for run in "${runs[@]}"; do
        read -r -a args <<<"$run"
        cargo test "${args[@]}" --no-fail-fast || failed=1
    done
fi
exit "$failed"
