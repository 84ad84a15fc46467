#!/usr/bin/env bash
# Builds, on a machine WITHOUT a GPU, everything `scripts/gpu-check.sh` runs on the GPU machine,
# which has an NVIDIA driver but no Rust toolchain and no network:
#
#   scripts/gpu-bundle.sh            # -> target/gpu-bundle/burn-ddp-gpu-check.tar.xz (< 48 MiB)
#
# Then, on the GPU machine (copy the archive there):
#
#   mkdir bundle && tar -xJf burn-ddp-gpu-check.tar.xz -C bundle && bundle/gpu-check.sh
#
# The archive holds release binaries of every CUDA test and benchmark the check runs, once per
# Burn build (`plain`: Burn's Cuda without fusion; `fusion`: with fusion and autotune, what
# `burn = { features = ["cuda"] }` gives users), stripped, plus `burn-ddp` (bandwidth tool),
# gpu-check.sh and a manifest.
#
# CUDARC_CUDA_VERSION (default 13000: CUDA 13.0, the driver of our GPU machine) selects the CUDA
# bindings of cudarc and cubecl-cuda: never newer than the driver there, or symbols it lacks are
# looked up at run time and fail.
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
LIMIT_MIB=48
OUT=target/gpu-bundle
STAGE=$OUT/stage
ARCHIVE=$OUT/burn-ddp-gpu-check.tar.xz

say() { printf 'gpu-bundle: %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || { say "missing tool: $1 ($2)"; exit 2; }; }
need cargo "install Rust with rustup"
need python3 "used to read cargo's build messages"
need strip "binutils"
need xz "xz-utils"

rm -rf "$STAGE" "$ARCHIVE"
mkdir -p "$STAGE/bin"

# Builds the CUDA test and bench binaries of one Burn build into $STAGE/bin/<variant>/.
build_variant() { # variant, cargo features
    local variant=$1 features=$2
    say "building the $variant binaries (features: $features, CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION)"
    mkdir -p "$STAGE/bin/$variant"
    cargo build --release --locked --features "$features" \
        --test cuda_nccl --test ddp_equivalence --bench cuda_step \
        --message-format=json-render-diagnostics >"$OUT/$variant.json"
    python3 - "$OUT/$variant.json" "$STAGE/bin/$variant" <<'PY'
import json, shutil, sys
messages, dest = sys.argv[1], sys.argv[2]
wanted = {"cuda_nccl", "ddp_equivalence", "cuda_step"}
found = {}
for line in open(messages):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        name = m["target"]["name"]
        if name in wanted:
            found[name] = m["executable"]
missing = wanted - found.keys()
if missing:
    sys.exit(f"gpu-bundle: cargo built no executable for {sorted(missing)}")
for name, exe in found.items():
    shutil.copy(exe, f"{dest}/{name}")
PY
}

build_variant plain burn-ddp-workspace/cuda
build_variant fusion burn-ddp-workspace/fusion
say "building the bandwidth tool (burn-ddp)"
cargo build --release --locked -p burn-ddp-comm --features cuda,cli --bin burn-ddp
cp target/release/burn-ddp "$STAGE/bin/burn-ddp"

strip "$STAGE"/bin/*/* "$STAGE/bin/burn-ddp"
cp scripts/gpu-check.sh "$STAGE/gpu-check.sh"
chmod +x "$STAGE/gpu-check.sh"
{
    echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+uncommitted')"
    echo "built=$(date -u +%Y-%m-%dT%H:%MZ)"
    echo "cuda_bindings=$CUDARC_CUDA_VERSION"
    echo "rustc=$(rustc --version)"
} >"$STAGE/MANIFEST"

tar -C "$STAGE" -cf - . | xz -9 -T0 >"$ARCHIVE"
bytes=$(stat -c %s "$ARCHIVE")
ls -l "$STAGE"/bin/* >&2
if [ "$bytes" -gt $((LIMIT_MIB << 20)) ]; then
    say "the archive has $((bytes >> 20)) MiB, over the $LIMIT_MIB MiB limit (the GPU machine takes at most 64 MiB with the repository)"
    exit 1
fi
say "wrote $ARCHIVE ($((bytes >> 10)) KiB)"
echo "$ARCHIVE"
