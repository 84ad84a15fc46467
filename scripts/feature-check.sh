#!/usr/bin/env bash
# Adding burn-ddp to a Burn project rebuilds none of the project's crates: for each Burn line, a
# project that depends on Burn with its default features and the Learner's (`train`, `tui`, a
# CPU backend: what Burn's own examples ask for) is resolved without and with the line, and every
# package of the first build must be in the second with the same version and the same features.
# A feature more on a crate Burn already builds (rustix's `process`, half's `default`, ...) would
# change that crate's build and so rebuild it and every crate above it, Burn's included.
#
#   scripts/feature-check.sh            # every line; exit 1 naming the packages that change
#
# Burn 0.21's project asks for Burn's `distributed` feature too: the 0.21 line's backend
# implements Burn's `DistributedBackend` trait, which only exists with it, so a 0.21 project
# without it builds Burn once more with it (the guide says to add it).
#
# Needs the crates.io index (cargo resolves the two projects; nothing is compiled).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=lines.sh
. "$root/scripts/lines.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check LINE_CRATE BURN_VERSION BURN_FEATURES
check() {
    local line=$1 burn=$2 features=$3
    for side in without with; do
        mkdir -p "$work/$line/$side/src"
        echo 'fn main() {}' >"$work/$line/$side/src/main.rs"
        {
            printf '[package]\nname = "project"\nversion = "0.1.0"\nedition = "2021"\n\n'
            printf '[dependencies]\nburn = { version = "=%s", features = [%s] }\n' \
                "$burn" "$features"
            if [ "$side" = with ]; then
                printf '%s = { path = "%s/%s" }\n' "$line" "$root" "$line"
            fi
            printf '\n[workspace]\n'
        } >"$work/$line/$side/Cargo.toml"
    done
    # The same versions on both sides: the project with the line resolves first, and the one
    # without starts from its lock file (cargo drops the packages it does not need).
    (cd "$work/$line/with" && cargo generate-lockfile --quiet)
    cp "$work/$line/with/Cargo.lock" "$work/$line/without/"
    for side in without with; do
        (cd "$work/$line/$side" &&
            cargo tree --quiet -e normal,build -f '{p}|{f}' --prefix none |
            sed 's/ (\*)$//' | grep -v '^project v' | sort -u >"../$side.txt")
    done
    local changed
    changed=$(comm -23 "$work/$line/without.txt" "$work/$line/with.txt")
    if [ -n "$changed" ]; then
        echo "feature-check: adding $line to a Burn $burn project changes how these of its packages build (package|features without it):" >&2
        printf '%s\n' "$changed" >&2
        echo "with it:" >&2
        while IFS='|' read -r pkg _; do
            grep -F "$pkg|" "$work/$line/with.txt" >&2 || echo "$pkg: not built" >&2
        done <<<"$changed"
        return 1
    fi
    printf 'feature-check: %s adds %d packages to a Burn %s project and changes none of its %d\n' \
        "$line" "$(($(wc -l <"$work/$line/with.txt") - $(wc -l <"$work/$line/without.txt")))" \
        "$burn" "$(wc -l <"$work/$line/without.txt")"
}

status=0
for line in "${burn_lines[@]}"; do
    check "$line" "$(line_release "$line")" "\"train\", \"tui\", $(line_backend "$line")" || status=1
done
exit "$status"
