#!/usr/bin/env bash
# The whole test suite, the README's test command: every crate's unit, integration, property,
# multi-process and end-to-end tests, and the doc tests, on every Burn release.
#   scripts/test.sh                          # everything, one cargo run per Burn release
#   scripts/test.sh -p burn-ddp-gradsync     # one crate (its runs: Burn 0.22 and 0.23)
#   scripts/test.sh -p burn-ddp-workspace    # the examples and end-to-end tests, every release
#   scripts/test.sh --print-runs [ARGS]      # the cargo arguments of each run, one per line
# Other arguments (`--locked`) go to every run. One cargo run builds one Burn release of
# `burn-ddp-gradsync` (features `burn-0-22`, the default, or `burn-0-23`), of `burn-ddp` and of
# the root package `burn-ddp-workspace` (the examples and end-to-end tests: `burn-0-21`, the
# default, `burn-0-22`, `burn-0-23`), and cargo unifies the features of every crate a run builds,
# so each release has a run of its own, which builds that release's Burn once:
#   Burn 0.21: the workspace but `burn-ddp-gradsync` and `burn-ddp` (the 0.21 line, the core, the
#              root package with its default release), with $BURN_DDP_TEST_FEATURES_021;
#   Burn 0.22: `burn-ddp-gradsync`, `burn-ddp` and the root package, the first two with
#              $BURN_DDP_TEST_FEATURES_022 (default `burn-0-22,train,hold-systemstat`), the root
#              package with $BURN_DDP_EXAMPLES_FEATURES_022 (default `burn-0-22`);
#   Burn 0.23: `burn-ddp-gradsync` and the root package, with $BURN_DDP_TEST_FEATURES_023
#              (default `burn-0-23,train,hold-systemstat`) and $BURN_DDP_EXAMPLES_FEATURES_023
#              (default `burn-0-23`).
# With `-p`, each run keeps the packages named that it holds, and a run that holds none is left
# out. The examples have one name on every release; each run builds its own before its tests run
# them (burn_ddp_dev::spawned).
# With cargo-nextest installed, every test binary's tests run side by side in one pool, the
# tests that time a fault or a bound first, in a phase of their own (.config/nextest.toml), then
# the doc tests (nextest runs none); without it, `cargo test`, one binary after another.
# BURN_DDP_TEST_RUNNER=cargo chooses `cargo test` even where nextest is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
print=
picked=()
rest=()
while [ $# -gt 0 ]; do
    case "$1" in
    --print-runs) print=1 ;;
    -p | --package)
        picked+=("${2:?$1 needs a package}")
        shift
        ;;
    --workspace) ;;
    *) rest+=("$1") ;;
    esac
    shift
done
features_021=${BURN_DDP_TEST_FEATURES_021:-}
features_022=${BURN_DDP_TEST_FEATURES_022:-burn-0-22,train,hold-systemstat}
features_023=${BURN_DDP_TEST_FEATURES_023:-burn-0-23,train,hold-systemstat}
examples_022=${BURN_DDP_EXAMPLES_FEATURES_022:-burn-0-22}
examples_023=${BURN_DDP_EXAMPLES_FEATURES_023:-burn-0-23}
# `a,b/c` for package P: `P/a,b/c` (P's features beside those of a dependency).
of() {
    local out= f fs
    IFS=, read -r -a fs <<<"$2"
    for f in "${fs[@]}"; do
        [[ $f == */* ]] || f="$1/$f"
        out+="${out:+,}$f"
    done
    echo "$out"
}
# chosen PACKAGE...: those of the packages named with -p (all of them without -p).
chosen() {
    local p q
    for p in "$@"; do
        if [ ${#picked[@]} -eq 0 ]; then
            echo "$p"
        else
            for q in "${picked[@]}"; do [ "$p" != "$q" ] || echo "$p"; done
        fi
    done
}
# release_run LIST_OF "PACKAGE=FEATURES": the run of those packages chosen, with their features.
release_run() {
    local pair pkg run= feats=
    for pair in "$@"; do
        pkg=${pair%%=*}
        [ -n "$(chosen "$pkg")" ] || continue
        run+=" -p $pkg"
        feats+="${feats:+,}$(of "$pkg" "${pair#*=}")"
    done
    [ -z "$run" ] || echo "$run --no-default-features --features $feats"
}
runs=()
if [ ${#picked[@]} -eq 0 ]; then
    runs+=("--workspace --exclude burn-ddp-gradsync --exclude burn-ddp${features_021:+ --features $features_021}")
else
    own=()
    for p in "${picked[@]}"; do
        case "$p" in burn-ddp-gradsync | burn-ddp) ;; *) own+=("-p $p") ;; esac
    done
    [ ${#own[@]} -eq 0 ] || runs+=("${own[*]}${features_021:+ --features $features_021}")
fi
run=$(release_run "burn-ddp-gradsync=$features_022" "burn-ddp=$features_022" "burn-ddp-workspace=$examples_022")
[ -z "$run" ] || runs+=("$run")
run=$(release_run "burn-ddp-gradsync=$features_023" "burn-ddp-workspace=$examples_023")
[ -z "$run" ] || runs+=("$run")
for i in "${!runs[@]}"; do
    runs[i]="${runs[i]# }${rest[*]:+ ${rest[*]}}"
done
if [ -n "$print" ]; then
    printf '%s\n' "${runs[@]}"
    exit 0
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
