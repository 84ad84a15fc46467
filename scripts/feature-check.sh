#!/usr/bin/env bash
# Adding burn-ddp to a Burn project rebuilds none of the project's crates, whatever Burn features
# the project chose. For each Burn line and each feature set below, a project that depends on
# Burn is resolved afresh (every dependency at its newest release) without and with the line;
# every package of the first build must be in the second with the same version and the same
# features. A feature more on a crate Burn already builds (rustix's `termios`, time's
# `local-offset`, Burn's `tui`, ...) would change that crate's build and so rebuild it and every
# crate above it, Burn's included. Then the project with the line is compiled (`cargo check`), so
# that a dependency release that breaks such a project shows here too.
#
# The sets (Burn's features; the line with its default features, and with its `tui` feature in
# the `+tui` sets):
#   defaults       Burn's default features, `train` and a CPU backend (Burn's Learner examples)
#   defaults+tui   the same with `tui` (Burn's dashboard)
#   bare           `default-features = false` with `std`, `train` and a CPU backend (Burn's
#                  custom-training-loop examples)
#   bare+tui       the same with `tui`
# Burn 0.21's projects ask for Burn's `distributed` feature too: the 0.21 line's backend
# implements Burn's `DistributedBackend` trait, which only exists with it, so a 0.21 project
# without it builds Burn once more with it (the guide says to add it). They have no `bare` sets:
# burn-backend 0.21.0's `distributed` feature compiles `use cubecl::device::DeviceId;`
# (src/backend/distributed/ops.rs, line 1) without turning on its `cubecl` feature, so a Burn 0.21
# project with `default-features = false` and `distributed` does not compile until some crate
# turns `burn-backend/cubecl` on (the 0.21 line does, and so changes it).
#
# Then, compiled, three projects burn-ddp must refuse with its own error naming the fix: no
# release feature, two releases (Burn 0.21 beside the default 0.22), and `ndarray` on Burn 0.23.
#
#   scripts/feature-check.sh                  # every line and set; exit 1 naming what changes
#   scripts/feature-check.sh --resolve-only   # the comparison alone, nothing compiled
#
# FEATURE_CHECK_TARGET: the compiled projects' target folder (default `target/feature-check`;
# CI gives the user-project check's, in its cache, so each run recompiles only what a new
# release changed). Needs the crates.io index and the crates' sources (cargo fetches them).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=lines.sh
. "$root/scripts/lines.sh"
compile=1
case ${1:-} in
--resolve-only) compile=0 ;;
"") ;;
*)
    echo "usage: scripts/feature-check.sh [--resolve-only]" >&2
    exit 2
    ;;
esac
target=${FEATURE_CHECK_TARGET:-$root/target/feature-check}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# line_sets LINE: the feature sets that apply to LINE's release (above).
line_sets() {
    case $1 in
    burn-0-21) echo defaults defaults+tui ;;
    *) echo defaults defaults+tui bare bare+tui ;;
    esac
}

# check LINE SET
check() {
    local line=$1 set=$2 burn defaults features ours=""
    burn=$(line_release "$line")
    case $set in
    defaults*) defaults=true features="\"train\"" ;;
    bare*) defaults=false features="\"std\", \"train\"" ;;
    esac
    case $set in
    *+tui) features="$features, \"tui\"" ours=tui ;;
    esac
    # Burn 0.22's bare sets on Flex, the backend of Burn 0.22's custom-loop examples; every
    # other set on the line's CPU backend (lines.sh).
    case $line-$set in
    burn-0-22-bare*) features="$features, \"flex\"" ;;
    *) features="$features, $(line_backend "$line")" ;;
    esac
    local dir=$work/$line-$set
    for side in without with; do
        mkdir -p "$dir/$side/src"
        {
            printf '[package]\nname = "project"\nversion = "0.1.0"\nedition = "2021"\npublish = false\n\n'
            printf '[dependencies]\nburn = { version = "=%s", default-features = %s, features = [%s] }\n' \
                "$burn" "$defaults" "$features"
            if [ "$side" = with ]; then
                line_dependency "$line" "$root" "$ours"
            fi
            printf '\n[workspace]\n'
        } >"$dir/$side/Cargo.toml"
    done
    echo 'fn main() {}' >"$dir/without/src/main.rs"
    line_main "$line" >"$dir/with/src/main.rs"
    # The same versions on both sides: the project with the line resolves first, and the one
    # without starts from its lock file (cargo drops the packages it does not need).
    (cd "$dir/with" && cargo generate-lockfile --quiet)
    cp "$dir/with/Cargo.lock" "$dir/without/"
    for side in without with; do
        (cd "$dir/$side" &&
            cargo tree --quiet -e normal,build -f '{p}|{f}' --prefix none |
            sed 's/ (\*)$//' | grep -v '^project v' | sort -u >"../$side.txt")
    done
    local what="a Burn $burn project (default-features = $defaults, [$features])" changed
    local ddp="burn-ddp ($line${ours:+, $ours})"
    changed=$(comm -23 "$dir/without.txt" "$dir/with.txt")
    if [ -n "$changed" ]; then
        echo "feature-check: adding $ddp to $what changes how these of its packages build (package|features without it):" >&2
        printf '%s\n' "$changed" >&2
        echo "with it:" >&2
        while IFS='|' read -r pkg _; do
            grep -F "$pkg|" "$dir/with.txt" >&2 || echo "$pkg: not built" >&2
        done <<<"$changed"
        return 1
    fi
    local added=$(($(wc -l <"$dir/with.txt") - $(wc -l <"$dir/without.txt")))
    local kept
    kept=$(wc -l <"$dir/without.txt")
    if [ "$compile" = 0 ]; then
        printf 'feature-check: %s adds %d packages to %s and changes none of its %d\n' \
            "$ddp" "$added" "$what" "$kept"
        return 0
    fi
    local start=$SECONDS
    if ! (cd "$dir/with" && cargo check --quiet --target-dir "$target") >"$dir/check.log" 2>&1; then
        {
            printf 'feature-check: %s with %s does NOT compile (every dependency at its newest release):\n' \
                "$what" "$ddp"
            compile_errors "$dir/check.log"
            grep -q '^error' "$dir/check.log" || tail -30 "$dir/check.log"
            echo "feature-check: scripts/user-project-check.sh $line names the dependency release that broke such a build, when one did."
        } >&2
        return 1
    fi
    printf 'feature-check: %s adds %d packages to %s, changes none of its %d, and compiles (%d s)\n' \
        "$ddp" "$added" "$what" "$kept" "$((SECONDS - start))"
}

# refused LINE DEPENDENCY EXPECTED WHAT: the `with` project of LINE's `defaults` set (checked
# above, so its Burn is compiled already), its `burn-ddp` line replaced by DEPENDENCY, must fail
# to compile with an error that contains EXPECTED: burn-ddp's refusal of a wrong choice of release
# or feature, with the line to write.
refused() {
    local line=$1 dependency=$2 expected=$3 what=$4 dir=$work/refused-$RANDOM start=$SECONDS
    cp -r "$work/$line-defaults/with" "$dir"
    python3 - "$dir/Cargo.toml" "$dependency" <<'PY'
import sys
path, dependency = sys.argv[1], sys.argv[2]
lines = [dependency if l.startswith("burn-ddp = ") else l for l in open(path).read().split("\n")]
open(path, "w").write("\n".join(lines))
PY
    if (cd "$dir" && cargo check --quiet --target-dir "$target") >"$dir/check.log" 2>&1; then
        echo "feature-check: $what compiled; burn-ddp must refuse it" >&2
        return 1
    fi
    if ! grep -qF "$expected" "$dir/check.log"; then
        {
            echo "feature-check: $what failed, but not with burn-ddp's error (\"$expected\"):"
            compile_errors "$dir/check.log"
        } >&2
        return 1
    fi
    printf 'feature-check: %s is refused, naming the fix (%d s)\n' "$what" "$((SECONDS - start))"
}

status=0
for line in "${burn_lines[@]}"; do
    for set in $(line_sets "$line"); do
        check "$line" "$set" || status=1
    done
done
if [ "$compile" = 1 ] && [ "$status" = 0 ]; then
    refused burn-0-22 "burn-ddp = { path = \"$root/burn-ddp\", default-features = false, features = [\"train\"] }" \
        "burn-ddp: no Burn release is chosen" "burn-ddp without a release feature" || status=1
    refused burn-0-22 "burn-ddp = { path = \"$root/burn-ddp\", features = [\"burn-0-21\"] }" \
        "feature \`burn-0-21\` is on beside \`burn-0-22\` or \`burn-0-23\`" \
        "burn-ddp with burn-0-21 beside its default burn-0-22" || status=1
    refused burn-0-23 "burn-ddp = { path = \"$root/burn-ddp\", default-features = false, features = [\"burn-0-23\", \"train\", \"ndarray\"] }" \
        "Burn 0.23 has no NdArray backend" "burn-ddp with burn-0-23 and ndarray" || status=1
fi
exit "$status"
