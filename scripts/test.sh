#!/usr/bin/env bash
# The whole test suite, the README's test command: every crate's unit, integration, property,
# multi-process and end-to-end tests, and the doc tests, on every Burn release.
#   scripts/test.sh                          # everything: Burn 0.21 and 0.22, then 0.22's and 0.23's runs
#   scripts/test.sh -p burn-ddp-gradsync     # one crate (any cargo package selection)
#   scripts/test.sh -p burn-ddp-workspace    # the examples and end-to-end tests, every release
# One cargo run serves one Burn release of `burn-ddp-gradsync` (its features `burn-0-22`, the
# default, and `burn-0-23` are exclusive) and of the root package `burn-ddp-workspace` (the
# examples and end-to-end tests: `burn-0-21`, the default, `burn-0-22`, `burn-0-23`), so a
# selection that holds one of them (the default, `--workspace`, or `-p` of either) runs more than
# once: as given (the workspace: Burn 0.21's examples and line, Burn 0.22's line), then the root
# package for Burn 0.22 (`--no-default-features --features $BURN_DDP_EXAMPLES_FEATURES_022`,
# default `burn-0-22`), then both built for Burn 0.23 (`burn-ddp-gradsync` with
# $BURN_DDP_TEST_FEATURES_023, default `burn-0-23,train,hold-systemstat`; the root package with
# $BURN_DDP_EXAMPLES_FEATURES_023, default `burn-0-23`). Each run's features are those the lines'
# own tests build Burn with, so Burn is built once per release. The examples have one name on
# every release; each run builds its own before its tests run them (burn_ddp_dev::spawned).
# With cargo-nextest installed, every test binary's tests run side by side in one pool, the
# tests that time a fault or a bound first, in a phase of their own (.config/nextest.toml), then
# the doc tests (nextest runs none); without it, `cargo test`, one binary after another.
# BURN_DDP_TEST_RUNNER=cargo chooses `cargo test` even where nextest is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
select=("$@")
[ ${#select[@]} -gt 0 ] || select=(--workspace)
gradsync_023=${BURN_DDP_TEST_FEATURES_023:-burn-0-23,train,hold-systemstat}
examples_022=${BURN_DDP_EXAMPLES_FEATURES_022:-burn-0-22}
examples_023=${BURN_DDP_EXAMPLES_FEATURES_023:-burn-0-23}
runs=("${select[*]}")
locked=
for arg in "${select[@]}"; do
    [ "$arg" != --locked ] || locked=--locked
done
holds() { # holds PACKAGE: whether the selection tests PACKAGE
    case " ${select[*]} " in
    *" --workspace "* | *" -p $1 "* | *" --package $1 "*) return 0 ;;
    *) return 1 ;;
    esac
}
# `a,b/c` for package P: `P/a,b/c` (a feature of P named beside others of a dependency).
of() {
    local out= f fs
    IFS=, read -r -a fs <<<"$2"
    for f in "${fs[@]}"; do
        [[ $f == */* ]] || f="$1/$f"
        out+="${out:+,}$f"
    done
    echo "$out"
}
if holds burn-ddp-workspace; then
    runs+=("-p burn-ddp-workspace --no-default-features --features $examples_022 $locked")
fi
if holds burn-ddp-gradsync && holds burn-ddp-workspace; then
    runs+=("-p burn-ddp-gradsync -p burn-ddp-workspace --no-default-features --features $(of burn-ddp-gradsync "$gradsync_023"),$(of burn-ddp-workspace "$examples_023") $locked")
elif holds burn-ddp-gradsync; then
    runs+=("-p burn-ddp-gradsync --no-default-features --features $gradsync_023 $locked")
elif holds burn-ddp-workspace; then
    runs+=("-p burn-ddp-workspace --no-default-features --features $examples_023 $locked")
fi

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
        # What the tests' own builds use (an example not built yet, the etcd scenarios' builds).
        export BURN_DDP_TEST_RUN="${args[*]}"
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
        export BURN_DDP_TEST_RUN="${args[*]}"
        cargo test "${args[@]}" --no-fail-fast || failed=1
    done
fi
exit "$failed"
