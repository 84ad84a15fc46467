#!/usr/bin/env bash
# A new user's first build: for each Burn release, a project made as a new user makes one (Burn
# with its default features and those Burn's own examples turn on, `burn-ddp` by path with that
# release's feature as the README writes it, no lock file, so every dependency at its newest
# release) is resolved afresh and compiled with
# `cargo check`. The workspace's own builds use its Cargo.lock and cannot see a new release of a
# dependency that breaks a user's build (systemstat 0.2.8 broke burn-train 0.21.0, 0.22.1 and
# 0.23.0-pre.1: see `systemstat` in the root Cargo.toml); this does.
#
#   scripts/user-project-check.sh            # every release
#   scripts/user-project-check.sh burn-0-22  # some: burn-0-21, burn-0-22, burn-0-23
#
# When a project does not compile, the script names the crates that failed, and finds the
# dependency release that broke them: each crate the errors name (`systemstat::…`, or a file of
# `systemstat-0.2.8/`) is held below the release that was resolved, and the project is checked
# again; the first that mends it is named with the fix. Exit 1 then, 0 when every project
# compiles.
#
# USER_PROJECT_TARGET: the projects' target folder (default `target/user-project`, shared by the
# lines, kept across runs: a second run recompiles only what a new release changed).
# Needs the crates.io index and the crates' sources (cargo fetches them).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=lines.sh
. "$root/scripts/lines.sh"
target=${USER_PROJECT_TARGET:-$root/target/user-project}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# What Burn's own examples turn on beyond its defaults: the Learner and its dashboard (`train`,
# `tui`), its system metrics (`metrics`: burn-train's `sys-metrics`, already among burn-train's
# defaults), data sets and the vision ones (`dataset`, `vision`, as `examples/mnist`), and a CPU
# backend.
common='"std", "train", "tui", "metrics", "dataset", "vision"'

# write_manifest DIR LINE BURN_VERSION FEATURES [HOLD_CRATE HOLD_BELOW HOLD_FLOOR]
write_manifest() {
    local dir=$1 line=$2 burn=$3 features=$4
    {
        printf '[package]\nname = "user-project-%s"\nversion = "0.1.0"\nedition = "2021"\npublish = false\n\n' "$line"
        printf '[dependencies]\nburn = { version = "=%s", features = [%s] }\n' "$burn" "$features"
        line_dependency "$line" "$root"
        if [ $# -gt 4 ]; then
            # A version constraint that is never compiled (no target matches `cfg(any())`)
            # but that the resolver honours, as the line's own `systemstat` one.
            printf '\n[target.%s.dependencies]\n%s = ">=%s, <%s"\n' "'cfg(any())'" "$5" "$7" "$6"
        fi
        printf '\n[workspace]\n'
    } >"$dir/Cargo.toml"
}

# resolve_and_check DIR LOG: a fresh resolve (newest releases), then `cargo check`.
resolve_and_check() {
    local dir=$1 log=$2
    rm -f "$dir/Cargo.lock"
    (cd "$dir" && cargo generate-lockfile --quiet && cargo check --quiet --target-dir "$target") >"$log" 2>&1
}

lock_tool() { python3 "$root/scripts/user_project_lock.py" "$@"; }

# check LINE BURN_VERSION BACKEND_FEATURES
check() {
    local line=$1 burn=$2 backend=$3
    local dir=$work/$line
    mkdir -p "$dir/src"
    line_main "$line" >"$dir/src/main.rs"
    write_manifest "$dir" "$line" "$burn" "$common, $backend"
    local start=$SECONDS
    if resolve_and_check "$dir" "$work/$line.log"; then
        printf 'user-project-check: a fresh Burn %s project (features %s, %s) with %s compiles (%d packages at their newest releases, %d s)\n' \
            "$burn" "$common" "$backend" "$line" "$(grep -c '^name = ' "$dir/Cargo.lock")" \
            "$((SECONDS - start))"
        return 0
    fi
    {
        printf '\nuser-project-check: a fresh Burn %s project (features %s, %s) with %s does NOT compile.\n' \
            "$burn" "$common" "$backend" "$line"
        echo "The errors (cargo check, every dependency at its newest release):"
        compile_errors "$work/$line.log"
    } >&2
    local failed
    failed=$(grep -o 'could not compile `[^`]*`' "$work/$line.log" | sort -u | tr -d '`' |
        sed 's/could not compile //' | paste -sd, - || true)
    # Which new release broke it: hold each crate the errors name below its resolved release.
    local suspect version floor mended
    while read -r suspect version floor; do
        echo "user-project-check: checking again with $suspect held below $version ..." >&2
        write_manifest "$dir" "$line" "$burn" "$common, $backend" "$suspect" "$version" "$floor"
        if resolve_and_check "$dir" "$work/$line.retry.log"; then
            mended=$(lock_tool version "$dir/Cargo.lock" "$suspect" "$version")
            cat >&2 <<EOF
user-project-check: CAUSE: $suspect $version, its newest release, breaks ${failed:-the build}; with $suspect $mended the project compiles.
user-project-check: FIX: hold $suspect below $version for users, with a constraint that compiles nothing: in the root
  Cargo.toml's [workspace.dependencies], $suspect = ">=$floor, <$version", named under each line's
  [target.'cfg(any())'.dependencies] behind a default feature (as systemstat is, by hold-systemstat),
  with the upstream cause; lift it once a fixed release exists. A user's own project mends itself
  with: cargo update -p $suspect@$version --precise $mended
EOF
            return 1
        fi
    done < <(lock_tool suspects "$dir/Cargo.lock" "$work/$line.log" | head -5)
    {
        echo "user-project-check: no single crate named by the errors mends it when held below its newest release."
        echo "user-project-check: crates that failed: ${failed:-none named (see the log below)}; packages this fresh resolve holds at a version the workspace's Cargo.lock does not:"
        lock_tool newer "$dir/Cargo.lock" "$root/Cargo.lock"
        # The errors are above; without any, the log's end says what went wrong.
        grep -q '^error' "$work/$line.log" || {
            echo "The end of the log:"
            tail -30 "$work/$line.log"
        }
    } >&2
    return 1
}

lines=("$@")
[ ${#lines[@]} -gt 0 ] || lines=("${burn_lines[@]}")
for line in "${lines[@]}"; do
    line_release "$line" >/dev/null || {
        echo "user-project-check: unknown release '$line' (${burn_lines[*]})" >&2
        exit 2
    }
done
status=0
for line in "${lines[@]}"; do
    check "$line" "$(line_release "$line")" "$(line_backend "$line")" || status=1
done
exit "$status"
