#!/usr/bin/env bash
# Builds, on a machine WITHOUT a GPU, everything `scripts/gpu-check.sh` runs on the GPU machine,
# which has an NVIDIA driver but no Rust toolchain and no network, and takes at most 64 MiB a
# session:
#
#   scripts/gpu-bundle.sh [ARCHIVE...]     # default: all; see `target/gpu-bundle/*.tar.xz`
#
# One xz archive per group of variants, each under 48 MiB, each with gpu-check.sh, the
# `burn-ddp` tool (bandwidth, and `burn-ddp gpus` where there is no nvidia-smi) and a MANIFEST:
#
#   burn-ddp-gpu-check-021.tar.xz       core (NCCL tests, bandwidth), plain, fusion: Burn 0.21
#   burn-ddp-gpu-check-022.tar.xz       b022: Burn 0.22.1, kernels through LLVM
#   burn-ddp-gpu-check-022fusion.tar.xz b022-fusion: the same with fusion and autotune
#   burn-ddp-gpu-check-022cpp.tar.xz    b022-cpp: Burn 0.22.1, kernels through NVRTC
#   burn-ddp-gpu-check-023.tar.xz       b023: Burn 0.23.0-pre.1, kernels through LLVM
#   burn-ddp-gpu-check-023fusion.tar.xz b023-fusion: the same with fusion and autotune
#   burn-ddp-gpu-check-023cpp.tar.xz    b023-cpp: Burn 0.23.0-pre.1, kernels through NVRTC
#
# A Burn 0.22 or 0.23 variant is one archive: its two binaries carry LLVM statically (127 MB each,
# stripped) and compress to about 31 MiB together; two variants would pass the limit.
#
# On the GPU machine, one archive (and one variant, within 10 minutes) at a time, in that order:
#
#   mkdir b && tar -xJf burn-ddp-gpu-check-021.tar.xz -C b && b/gpu-check.sh --variant core
#
# Burn 0.22.1's and 0.23's CUDA runtimes link LLVM (the same bundle, tracel-llvm 23.1.0-4), whose
# build script would download it: the archives
# that need it build after scripts/offline-llvm.sh has put the PyPI build of LLVM in its place.
#
# CUDARC_CUDA_VERSION (default 13000: CUDA 13.0, the driver of our GPU machine) selects the CUDA
# bindings of cudarc and cubecl-cuda: never newer than the driver there, or symbols it lacks are
# looked up at run time and fail. The binaries need the glibc of this machine or newer (the
# MANIFEST records it, and gpu-check.sh checks it first).
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
LIMIT_MIB=48
OUT=target/gpu-bundle

say() { printf 'gpu-bundle: %s\n' "$*" >&2; }
need() { command -v "$1" >/dev/null 2>&1 || { say "missing tool: $1 ($2)"; exit 2; }; }
need cargo "install Rust with rustup"
need python3 "used to read cargo's build messages"
need strip "binutils"
need objdump "binutils: reads the glibc versions the binaries need"
need xz "xz-utils"

# archive -> its variants
declare -A PACKS=([021]="core plain fusion" [022]="b022" [022fusion]="b022-fusion" [022cpp]="b022-cpp"
    [023]="b023" [023fusion]="b023-fusion" [023cpp]="b023-cpp")
ORDER="021 022 022fusion 022cpp 023 023fusion 023cpp"
WANT=${*:-$ORDER}
for a in $WANT; do
    [ -n "${PACKS[$a]:-}" ] || { say "no archive '$a' (archives: $ORDER)"; exit 2; }
done

# variant -> cargo arguments, and the executables it needs (target names)
cargo_args() {
    case $1 in
        plain) echo "-p burn-ddp-burn021 --features cuda --test cuda_nccl --test ddp_equivalence --bench cuda_step" ;;
        fusion) echo "-p burn-ddp-burn021 --features fusion --test ddp_equivalence --bench cuda_step" ;;
        b02[23]*) # b022, b022-fusion, b022-cpp and the same for 0.23: burn-ddp-gradsync built for the release
            local n=${1:1:3} features=${1#b02?}
            features=${features#-}
            [ "$features" = cpp ] && features=cuda-cpp
            if [ "$n" = 022 ]; then
                echo "-p burn-ddp-gradsync --features ${features:-cuda} --test cuda --bench cuda_step"
            else
                echo "-p burn-ddp-gradsync --no-default-features --features burn-0-23,train,hold-systemstat,${features:-cuda} --test cuda --bench cuda_step"
            fi ;;
    esac
}
targets_of() {
    case $1 in
        plain) echo "cuda_nccl ddp_equivalence cuda_step" ;;
        fusion) echo "ddp_equivalence cuda_step" ;;
        b02[23]*) echo "cuda cuda_step" ;;
    esac
}

# Builds one variant's test and bench binaries into $2/bin/<variant>/ (core's into bin/).
build_variant() { # variant, stage
    local variant=$1 stage=$2 json
    [ "$variant" = core ] && return 0 # built with `plain` (same features)
    case $variant in b02[23]*) scripts/offline-llvm.sh >/dev/null ;; esac
    say "building $variant ($(cargo_args "$variant"), CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION)"
    json=$OUT/$variant.json
    # shellcheck disable=SC2046 # the arguments are words
    cargo build --release --locked $(cargo_args "$variant") \
        --message-format=json-render-diagnostics >"$json"
    mkdir -p "$stage/bin/$variant"
    python3 - "$json" "$stage/bin/$variant" $(targets_of "$variant") <<'PY'
import json, shutil, sys
messages, dest, wanted = sys.argv[1], sys.argv[2], set(sys.argv[3:])
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
    if [ "$variant" = plain ]; then
        mv "$stage/bin/plain/cuda_nccl" "$stage/bin/cuda_nccl"
    fi
}

say "building the bandwidth tool (burn-ddp)"
cargo build --release --locked -p burn-ddp-comm --features cuda,cli --bin burn-ddp

mkdir -p "$OUT"
for a in $WANT; do
    stage=$OUT/stage-$a
    archive=$OUT/burn-ddp-gpu-check-$a.tar.xz
    rm -rf "$stage" "$archive"
    mkdir -p "$stage/bin"
    for v in ${PACKS[$a]}; do
        build_variant "$v" "$stage"
    done
    cp target/release/burn-ddp "$stage/bin/burn-ddp"
    find "$stage/bin" -type f -exec strip {} +
    cp scripts/gpu-check.sh "$stage/gpu-check.sh"
    chmod +x "$stage/gpu-check.sh"
    symbols=$(find "$stage/bin" -type f -exec objdump -T {} + 2>/dev/null)
    glibc=$(grep -oE 'GLIBC_[0-9]+\.[0-9]+(\.[0-9]+)?' <<<"$symbols" | sed 's/GLIBC_//' | sort -uV | tail -1 || true)
    # LLVM (the Burn 0.22 and 0.23 archives) is C++: libstdc++ is linked dynamically.
    glibcxx=$(grep -oE 'GLIBCXX_[0-9]+\.[0-9]+(\.[0-9]+)*' <<<"$symbols" | sed 's/GLIBCXX_//' | sort -uV | tail -1 || true)
    {
        echo "archive=$a"
        echo "variants=${PACKS[$a]}"
        echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+uncommitted')"
        echo "built=$(date -u +%Y-%m-%dT%H:%MZ)"
        echo "cuda_bindings=$CUDARC_CUDA_VERSION"
        echo "glibc=$glibc"
        echo "glibcxx=$glibcxx"
        echo "build_os=$( (. /etc/os-release && echo "$PRETTY_NAME") 2>/dev/null || uname -sr)"
        echo "rustc=$(rustc --version)"
    } >"$stage/MANIFEST"
    # One LZMA2 block with a dictionary as large as the tar: the binaries of a group share most
    # of their bytes (Burn, cubecl, LLVM), which a dictionary smaller than one binary would store
    # once per binary.
    bytes=$(du -sb "$stage" | cut -f1)
    dict=64
    while [ $((dict << 20)) -lt "$bytes" ] && [ $dict -lt 1024 ]; do dict=$((dict * 2)); done
    say "compressing archive $a ($((bytes >> 20)) MiB unpacked, dictionary $dict MiB)"
    tar -C "$stage" -cf - . | xz -T1 "--lzma2=preset=6,dict=${dict}MiB" >"$archive"
    ls -l "$stage"/bin/* >&2
    size=$(stat -c %s "$archive")
    if [ "$size" -gt $((LIMIT_MIB << 20)) ]; then
        say "archive $a has $((size >> 20)) MiB, over the $LIMIT_MIB MiB limit (the GPU machine takes at most 64 MiB a session with the repository)"
        exit 1
    fi
    say "wrote $archive ($((size >> 10)) KiB; needs glibc $glibc${glibcxx:+ and libstdc++ with GLIBCXX_$glibcxx} or newer)"
    echo "$archive"
done
