#!/usr/bin/env bash
# The crates a user depends on can go to crates.io: each packages (`cargo package`, without the
# verify build, which would compile Burn for each), and every file its library compiles is
# inside its package (Cargo packages a package's directory alone, so a `#[path]` or `include!`
# that reaches another package's files fails the verify build, and the publish). The second
# check reads rustc's dep-info of the libraries' last build in the target folder (the files
# each compilation read), so run it after a build of the workspace (CI's test build).
#
#   scripts/package-check.sh [TARGET_DIR]   # default: $CARGO_TARGET_DIR, else target
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-${CARGO_TARGET_DIR:-target}}

# The packages a user's build depends on, in the order they would be published.
packages=(burn-ddp-macros burn-ddp-comm burn-ddp-cubecl burn-ddp-burn021 burn-ddp-gradsync burn-ddp)
# Packages known to compile files of another package, and why: the check fails if one of them
# no longer does (remove it here then), or if any other package starts to. None today.
reaching=()

selection=()
for p in "${packages[@]}"; do selection+=(-p "$p"); done
cargo package "${selection[@]}" --no-verify --allow-dirty --locked

tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
cargo metadata --no-deps --format-version 1 --locked >"$tmp"
python3 scripts/package_check.py "$tmp" "$target" "${packages[*]}" "${reaching[*]}"
