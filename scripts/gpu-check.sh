#!/usr/bin/env bash
# GPU checks of burn-ddp's CUDA layer. Runs from the unpacked bundle that `scripts/gpu-bundle.sh`
# builds on a machine without a GPU; needs no Rust toolchain and no network here, only an NVIDIA
# GPU with its driver, the CUDA headers and libnvrtc (the toolkit: cubecl compiles Burn's kernels
# at run time), and NCCL's libnccl.so.2 (a system package or pip's nvidia-nccl-cu1x wheel).
#
#   gpu-check.sh [--variant plain|fusion|all] [--report FILE] [--budget SECONDS]
#
# Per Burn build (`plain`: Burn's Cuda without fusion; `fusion`: with fusion and autotune):
#   1. nccl-world-1: NCCL at world size 1, every collective on every dtype vs the host transport
#   2. host-staged-2-and-3-processes: the decorator's equivalence tests on Autodiff<Ddp<Cuda>>,
#      2 and 3 processes sharing the GPU, gradients host-staged (NCCL refuses two ranks per GPU)
#   3. zero-copy-world-1: the same tests at world size 1 on the zero-copy NCCL device path
#   4. step-overhead: the decorator's step time vs plain Autodiff<Cuda> (benches/cuda_step.rs)
# Then, once: burn-ddp bench all-reduce over NCCL (1 rank) and over the host transport (2 ranks).
#
# Writes a dated report (default: ./gpu-verification.md; commit it as docs/gpu-verification.md).
# Every step has a time limit, and the whole check stops starting steps when --budget (default
# 840 s) is spent, so it ends within 15 minutes. Exit status: 0 all passed, 1 a step failed or
# was not run, 2 the machine lacks something (one line per missing piece).
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
VARIANTS="plain fusion"
REPORT=$PWD/gpu-verification.md
BUDGET=840
while [ $# -gt 0 ]; do
    case $1 in
        --variant) case ${2:-} in plain | fusion) VARIANTS=$2 ;; all) VARIANTS="plain fusion" ;;
                       *) echo "gpu-check: --variant takes plain, fusion or all" >&2; exit 2 ;; esac
                   shift 2 ;;
        --report) REPORT=${2:?--report needs a file}; shift 2 ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
        -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

missing=0
lack() { printf 'gpu-check: missing: %s\n' "$*" >&2; missing=$((missing + 1)); }

# --- a GPU at all: without one, nothing else matters --------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: no GPU here: nvidia-smi is not installed (no NVIDIA driver). Run this on a machine with an NVIDIA GPU and its driver." >&2
    exit 2
fi
GPUS=$(nvidia-smi -L 2>&1)
if ! grep -q '^GPU ' <<<"$GPUS"; then
    echo "gpu-check: no GPU here: nvidia-smi lists none ($(head -1 <<<"$GPUS"))." >&2
    exit 2
fi

# --- the bundle --------------------------------------------------------------------------
for v in $VARIANTS; do
    for b in cuda_nccl ddp_equivalence cuda_step; do
        [ -x "$HERE/bin/$v/$b" ] || lack "bundle binary bin/$v/$b: run this script from the unpacked archive of scripts/gpu-bundle.sh (built on any machine with Rust; no GPU needed there)"
    done
done
[ -x "$HERE/bin/burn-ddp" ] || lack "bundle binary bin/burn-ddp: run this script from the unpacked archive of scripts/gpu-bundle.sh"

# --- libraries and headers ---------------------------------------------------------------
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/burn-ddp-gpu-check.XXXXXX")
LIBS=$SCRATCH/lib
mkdir -p "$LIBS" "$SCRATCH/logs"
add_lib_dir() { case ":${LD_LIBRARY_PATH:-}:" in *":$1:"*) ;; *) LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac; }

# Python environments' site-packages (pip's nvidia-* wheels put libraries under nvidia/*/lib).
site_dirs() {
    local py
    for py in python3 /opt/*/.venv/bin/python3 /opt/conda/bin/python3 /usr/local/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        "$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null
    done | grep '^/' | sort -u
}

# The first file named $1 in: the loader cache, LD_LIBRARY_PATH, the extra dirs given, Python
# environments' nvidia/*/lib, and finally a search of /usr, /opt and /root.
find_lib() {
    local name=$1; shift
    local hit d
    hit=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n { print $NF; exit }')
    [ -n "$hit" ] && { echo "$hit"; return 0; }
    local IFS_OLD=$IFS; IFS=:
    for d in ${LD_LIBRARY_PATH:-}; do [ -e "$d/$name" ] && { echo "$d/$name"; IFS=$IFS_OLD; return 0; }; done
    IFS=$IFS_OLD
    for d in "$@"; do [ -e "$d/$name" ] && { echo "$d/$name"; return 0; }; done
    while read -r d; do
        for hit in "$d"/nvidia/*/lib/"$name" "$d"/nvidia/*/*/lib/"$name"; do
            [ -e "$hit" ] && { echo "$hit"; return 0; }
        done
    done < <(site_dirs)
    hit=$(find /usr /opt /root -name "$name" \( -type f -o -type l \) 2>/dev/null | head -1)
    [ -n "$hit" ] && { echo "$hit"; return 0; }
    return 1
}

# The CUDA toolkit root whose include/ holds the headers cubecl's kernels include.
CUDA_ROOT=
for c in "${CUDA_PATH:-}" "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12* /opt/cuda \
    "$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/bin/nvcc)")")"; do
    [ -n "$c" ] && [ -f "$c/include/cuda_runtime.h" ] && [ -f "$c/include/cuda_fp16.h" ] && { CUDA_ROOT=$c; break; }
done
if [ -z "$CUDA_ROOT" ]; then
    lack "CUDA headers (include/cuda_runtime.h, cuda_fp16.h): cubecl compiles Burn's kernels with NVRTC against them. Install the CUDA toolkit or set CUDA_PATH to its root"
else
    export CUDA_PATH=$CUDA_ROOT
fi

# libcuda.so.1 (the driver).
if cuda_lib=$(find_lib libcuda.so.1 /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib64 /usr/lib/x86_64-linux-gnu); then
    add_lib_dir "$(dirname "$cuda_lib")"
else
    lack "libcuda.so.1 (the NVIDIA driver's library): the driver is installed without it, or the container lacks GPU access"
fi

# libnvrtc (cudarc loads libnvrtc.so or libnvrtc.so.<major>; its builtins sit beside it).
nvrtc=
for name in libnvrtc.so libnvrtc.so.13 libnvrtc.so.12; do
    nvrtc=$(find_lib "$name" ${CUDA_ROOT:+"$CUDA_ROOT/lib64" "$CUDA_ROOT/targets/x86_64-linux/lib" "$CUDA_ROOT/lib"}) && break
done
if [ -z "$nvrtc" ]; then
    lack "libnvrtc.so (NVRTC, part of the CUDA toolkit or pip's nvidia-cuda-nvrtc): cubecl compiles every kernel with it"
else
    add_lib_dir "$(dirname "$nvrtc")"
    ln -sf "$nvrtc" "$LIBS/libnvrtc.so"
fi

# libnccl: cudarc opens libnccl.so (or .so.<cuda major>); NCCL packages and pip's wheel ship
# libnccl.so.2. Link it under the name cudarc looks for, in a scratch dir, without touching the
# system.
if nccl=$(find_lib libnccl.so.2); then
    add_lib_dir "$(dirname "$nccl")"
    ln -sf "$nccl" "$LIBS/libnccl.so"
else
    lack "libnccl.so.2 (NCCL): install NCCL (apt: libnccl2) or pip install nvidia-nccl-cu13, or put its directory on LD_LIBRARY_PATH"
fi
add_lib_dir "$LIBS"
export LD_LIBRARY_PATH

if [ "$missing" -gt 0 ]; then
    echo "gpu-check: $missing piece(s) missing (above); nothing was run." >&2
    rm -rf "$SCRATCH"
    exit 2
fi
echo "gpu-check: CUDA_PATH=$CUDA_PATH" >&2
echo "gpu-check: libcuda $cuda_lib, libnvrtc $nvrtc, libnccl $nccl (linked as libnccl.so in $LIBS)" >&2

# --- the steps -----------------------------------------------------------------------------
START=$(date +%s)
status=0
TABLE=$SCRATCH/table
: >"$TABLE"
export BURN_DDP_COLLECTIVE_TIMEOUT=${BURN_DDP_COLLECTIVE_TIMEOUT:-120}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}

run() { # name, limit in seconds, command...
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    printf '\n==== %s ====\n' "$name"
    if [ "$left" -lt 30 ]; then
        echo "NOT RUN: the check's time budget is spent"
        printf '| %s | not run (time budget spent) | |\n' "$name" >>"$TABLE"
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$(date +%s) rc
    timeout --kill-after=10 "$limit" "$@" >"$SCRATCH/logs/$name.log" 2>&1
    rc=$?
    local took=$(($(date +%s) - t0))
    if [ $rc -eq 0 ]; then
        echo "PASS (${took} s)"
        printf '| %s | pass | %s s |\n' "$name" "$took" >>"$TABLE"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "TIMED OUT after ${limit} s"
        printf '| %s | **timed out** (limit %s s) | %s s |\n' "$name" "$limit" "$took" >>"$TABLE"
        status=1
    else
        echo "FAIL, exit $rc (${took} s)"
        printf '| %s | **FAIL** (exit %s) | %s s |\n' "$name" "$rc" "$took" >>"$TABLE"
        status=1
    fi
    tail -40 "$SCRATCH/logs/$name.log"
}

BIN=$HERE/bin
for v in $VARIANTS; do
    run "$v-nccl-world-1" 120 "$BIN/$v/cuda_nccl" --test-threads 1
    run "$v-host-staged-2-and-3-processes" 300 env BURN_DDP_GRAD_TRANSPORT=host BURN_DDP_TEST_WORLDS=2,3 \
        "$BIN/$v/ddp_equivalence" --test-threads 1
    run "$v-zero-copy-world-1" 240 env BURN_DDP_GRAD_TRANSPORT=nccl BURN_DDP_TEST_WORLDS=1 \
        "$BIN/$v/ddp_equivalence" --test-threads 1 --skip an_unused_parameter --skip mismatched_models
    run "$v-step-overhead" 180 "$BIN/$v/cuda_step" --rounds 3
done
run bench-all-reduce-nccl 120 "$BIN/burn-ddp" bench all-reduce --nproc 1 --transport nccl --min-bytes 1M --max-bytes 1G
run bench-all-reduce-host-2-ranks 120 "$BIN/burn-ddp" bench all-reduce --nproc 2 --min-bytes 1M --max-bytes 64M

# --- the report ------------------------------------------------------------------------------
{
    echo "# GPU verification"
    echo
    echo "Written by \`scripts/gpu-check.sh\` on $(date -u +%Y-%m-%d) (UTC), variants: $VARIANTS; $(($(date +%s) - START)) s."
    echo
    echo "Bundle: $(tr '\n' ' ' <"$HERE/MANIFEST" 2>/dev/null || echo 'no MANIFEST')"
    echo
    echo "Device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
    echo
    echo "Libraries: CUDA_PATH=$CUDA_PATH; libcuda $cuda_lib; libnvrtc $nvrtc; libnccl $nccl"
    echo
    echo "| check | result | time |"
    echo "|---|---|---|"
    cat "$TABLE"
    for f in "$SCRATCH"/logs/*.log; do
        [ -e "$f" ] || continue
        echo
        echo "## $(basename "$f" .log)"
        echo
        echo '```'
        tail -60 "$f"
        echo '```'
    done
} >"$REPORT"
rm -rf "$SCRATCH"
echo
echo "report: $REPORT"
exit $status
