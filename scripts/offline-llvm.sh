#!/usr/bin/env bash
# Makes Burn 0.22.1's CUDA runtime build without network: installs the LLVM that cubecl-llvm
# links from PyPI, where tracel-llvm-bundler would download it from GitHub.
#
#   scripts/offline-llvm.sh          # idempotent; prints the LLVM prefix it made or found
#
# Why: cubecl 0.11.3 (`cuda`) -> cubecl-cuda -> cubecl-llvm (not optional) -> the build
# dependency tracel-llvm-bundler 23.1.0-4, whose build script downloads `linux-x64.tar.xz`
# unless `<prefix>/.tracel-llvm-installed` exists, with
# <prefix> = ${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4. cubecl-llvm's
# build script then runs `<prefix>/bin/llvm-config --link-static` for the headers, the flags
# and the static libraries, and compiles its C++ shims against them.
#
# A static LLVM 23 with NVPTX is on PyPI: `mlc-llvm-static` (the X86 backend, headers, static
# zlib/zstd and a Python `llvm-config`) plus `mlc-llvm-static-extra-targets` (every other
# backend, NVPTX among them; `mlc-llvm-static[all]`). This script installs both (pinned, and
# hash-checked on x86_64 Linux) into <prefix>/mlc, links <prefix>/{bin,include,lib} to them and
# creates the marker, atomically: an interrupted run leaves no marker, and the next one starts
# over. A prefix that already has the marker (ours, or tracel's real bundle) is left alone.
#
# Needs python3 with pip and access to PyPI (about 92 MB of wheels, 400 MB installed).
set -euo pipefail

VERSION=23.1.1.post0
BUNDLE=tracel-llvm-23.1.0-4

say() { printf 'offline-llvm: %s\n' "$*" >&2; }

data_home=${XDG_DATA_HOME:-}
# `dirs::data_local_dir` (what the bundler asks) ignores a relative XDG_DATA_HOME.
if [ -z "$data_home" ] || [ "${data_home#/}" = "$data_home" ]; then
    [ -n "${HOME:-}" ] || { say "neither XDG_DATA_HOME nor HOME is set: cannot place the LLVM prefix"; exit 2; }
    data_home=$HOME/.local/share
fi
prefix=$data_home/tracel/$BUNDLE
marker=$prefix/.tracel-llvm-installed

if [ -e "$marker" ]; then
    if [ -x "$prefix/bin/llvm-config" ] && "$prefix/bin/llvm-config" --version >/dev/null 2>&1; then
        echo "$prefix"
        exit 0
    fi
    say "$marker exists but $prefix/bin/llvm-config does not run: remove $prefix and run this again"
    exit 1
fi

command -v python3 >/dev/null 2>&1 || { say "python3 is missing (it installs LLVM from PyPI, and runs its llvm-config)"; exit 2; }
python3 -m pip --version >/dev/null 2>&1 || { say "python3 has no pip: install it (Debian: python3-pip)"; exit 2; }

mkdir -p "$(dirname "$prefix")"
stage=$(mktemp -d "$prefix.partial.XXXXXX")
chmod 755 "$stage"
trap 'rm -rf "$stage"' EXIT

reqs=$stage/requirements.txt
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64)
        cat >"$reqs" <<EOF
mlc-llvm-static==$VERSION --hash=sha256:dcfec888abfaa418be77d41af585805f31463584cf9c90582992c00f392c1ac5
mlc-llvm-static-extra-targets==$VERSION --hash=sha256:c36e834d9a4e9cf9759f27fece65711ece7a2fc2b5a96dbb15d66f5e9e787929
EOF
        hashes=--require-hashes
        ;;
    *)
        printf 'mlc-llvm-static==%s\nmlc-llvm-static-extra-targets==%s\n' "$VERSION" "$VERSION" >"$reqs"
        hashes=
        ;;
esac

say "installing LLVM $VERSION (static, all targets) from PyPI into $prefix"
# shellcheck disable=SC2086 # $hashes is one flag or none
python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --root-user-action=ignore $hashes --target "$stage/mlc" -r "$reqs"
sdk=mlc/mlc_llvm_static/static
for d in bin include lib; do
    [ -d "$stage/$sdk/$d" ] || { say "the wheel has no $sdk/$d: its layout changed"; exit 1; }
    ln -s "$sdk/$d" "$stage/$d"
done
"$stage/bin/llvm-config" --link-static --libs nvptx >/dev/null \
    || { say "the installed LLVM has no NVPTX backend (mlc-llvm-static-extra-targets missing?)"; exit 1; }
rm -f "$reqs"

# The marker last, then one rename: the prefix exists complete or not at all.
touch "$stage/.tracel-llvm-installed"
rm -rf "$prefix"
mv "$stage" "$prefix"
trap - EXIT
say "LLVM $("$prefix/bin/llvm-config" --version) ready; Burn 0.22's CUDA runtime now builds offline"
echo "$prefix"
