#!/usr/bin/env bash
# Rehearses scripts/gpu-check.sh without a GPU, on stand-ins for the machines it must cope with
# (run by .ci/run; a failed expectation exits 1):
#
#   scripts/rehearse-gpu-check.sh BURN_DDP    # BURN_DDP: a burn-ddp binary built with `cuda,cli`
#
# The stand-ins: a libcuda.so.1 compiled here that shows one GPU (CUDA 13.0) and nothing else,
# found through LD_LIBRARY_PATH, with no nvidia-smi; NCCL only in a Python environment that is
# not activated; NVRTC and the headers only in pip's nvidia/cu13 layout; a bundle that needs a
# newer glibc or libstdc++ than the machine's; no driver at all. The bundle's test binaries are stand-ins
# that print what they were given, so this checks the script's discovery, skipping and report,
# not CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."

BURN_DDP=${1:?usage: scripts/rehearse-gpu-check.sh path/to/burn-ddp (built with --features cuda,cli)}
[ -x "$BURN_DDP" ] || { echo "rehearse: $BURN_DDP is not an executable" >&2; exit 2; }
command -v cc >/dev/null 2>&1 || { echo "rehearse: needs a C compiler (cc) for the stand-in libcuda" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/burn-ddp-rehearse.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
failures=0
fail() { printf 'rehearse: FAILED: %s\n' "$*" >&2; failures=$((failures + 1)); }

# The stand-in driver: one GPU, CUDA 13.0.
mkdir -p "$WORK/driver"
cat >"$WORK/driver/libcuda.c" <<'EOF'
#include <string.h>
typedef int CUresult;
typedef int CUdevice;
CUresult cuInit(unsigned flags) { (void)flags; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) { (void)d; strncpy(name, "Stand-in GPU", len); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { (void)d; *bytes = (size_t)80 << 30; return 0; }
EOF
cc -shared -fPIC -o "$WORK/driver/libcuda.so.1" "$WORK/driver/libcuda.c"

# An unpacked bundle holding every variant, outside the repository.
B=$WORK/bundle
mkdir -p "$B/bin"
cp scripts/gpu-check.sh "$B/gpu-check.sh"
cp "$BURN_DDP" "$B/bin/burn-ddp"
standin() {
    mkdir -p "$(dirname "$1")"
    printf '#!/bin/sh\necho "stand-in %s: CUDA_PATH=${CUDA_PATH:-} LD_LIBRARY_PATH=$LD_LIBRARY_PATH"\n' "$(basename "$1")" >"$1"
    chmod +x "$1"
}
standin "$B/bin/cuda_nccl"
for v in plain fusion; do standin "$B/bin/$v/ddp_equivalence"; standin "$B/bin/$v/cuda_step"; done
for v in b022 b022-fusion b022-cpp b023 b023-fusion b023-cpp; do
    standin "$B/bin/$v/cuda"
    standin "$B/bin/$v/cuda_step"
done
glibc=$( (getconf GNU_LIBC_VERSION 2>/dev/null || ldd --version | sed -n 1p) | grep -oE '[0-9]+\.[0-9]+' | tail -1)
printf 'archive=rehearsal\nglibc=%s\nbuild_os=this machine\ncommit=rehearsal\n' "$glibc" >"$B/MANIFEST"

# A home with Python environments that nobody activated.
site=python3.12/site-packages/nvidia
home_with() { # name, pieces... (nccl, cu13): a fresh HOME holding them in ~/.venv
    local h=$WORK/home-$1 p
    shift
    mkdir -p "$h"
    for p in "$@"; do
        case $p in
            nccl) mkdir -p "$h/.venv/lib/$site/nccl/lib" && : >"$h/.venv/lib/$site/nccl/lib/libnccl.so.2" ;;
            cu13) mkdir -p "$h/.venv/lib/$site/cu13/include" "$h/.venv/lib/$site/cu13/lib"
                  : >"$h/.venv/lib/$site/cu13/include/cuda_runtime.h"
                  : >"$h/.venv/lib/$site/cu13/include/cuda_fp16.h"
                  : >"$h/.venv/lib/$site/cu13/lib/libnvrtc.so.13" ;;
        esac
    done
    echo "$h"
}

# check NAME EXPECTED_EXIT HOME LD_LIBRARY_PATH [gpu-check args...]: runs the bundle's script
# with a clean environment (no nvidia-smi on PATH, no CUDA_PATH, nothing activated).
check() {
    local name=$1 want=$2 home=$3 ldpath=$4 rc
    shift 4
    mkdir -p "$WORK/run-$name"
    set +e
    (cd "$WORK/run-$name" && env -i PATH=/usr/bin:/bin HOME="$home" LD_LIBRARY_PATH="$ldpath" TMPDIR="$WORK" \
        "$B/gpu-check.sh" --report "$WORK/run-$name/report.md" "$@") >"$WORK/$name.out" 2>&1
    rc=$?
    set -e
    OUT=$(cat "$WORK/$name.out")
    REPORT=$(cat "$WORK/run-$name/report.md" 2>/dev/null || true)
    printf '\n---- %s (exit %s) ----\n%s\n' "$name" "$rc" "$OUT"
    [ "$rc" = "$want" ] || fail "$name: exit $rc, expected $want"
}
expect_out() { grep -qF -- "$2" <<<"$OUT" || fail "$1: no line with '$2'"; }
expect_report() { grep -qF -- "$2" <<<"$REPORT" || fail "$1: the report has no '$2'"; }

# 1. The driver's library but no nvidia-smi, and nothing else: the GPU is found through
#    libcuda; every step that needs NCCL, NVRTC or the headers is skipped and says why; the host
#    bandwidth step runs.
check driver-only 1 "$(home_with bare)" "$WORK/driver" --variant core,plain,b022
expect_out driver-only "GPU 0: Stand-in GPU, 81920 MiB"
expect_out driver-only "missing: libnccl.so.2 (NCCL)"
expect_out driver-only "missing: libnvrtc.so (NVRTC"
expect_report driver-only "| core-nccl-world-1 | not run: libnccl.so.2 (NCCL) missing |"
expect_report driver-only "| plain-host-staged-2-and-3-processes | not run: libnvrtc.so (NVRTC, in the CUDA toolkit or pip's nvidia-cuda-nvrtc) missing; CUDA headers (include/cuda_runtime.h, cuda_fp16.h) missing |"
expect_report driver-only "| core-bench-all-reduce-host-2-ranks | pass |"
expect_report driver-only "(from libcuda; no nvidia-smi)"

# 2. NCCL only in a Python environment nobody activated: found, linked as libnccl.so; the NCCL
#    steps of variants that need nothing else run.
h=$(home_with venv-nccl nccl)
check venv-nccl 1 "$h" "$WORK/driver" --variant core,b022,b023-fusion
expect_out venv-nccl "libnccl $h/.venv/lib/$site/nccl/lib/libnccl.so.2"
expect_report venv-nccl "| core-nccl-world-1 | pass |"
expect_report venv-nccl "| b022-nccl-world-1 | pass |"
expect_report venv-nccl "| b022-step-overhead | pass |"
expect_report venv-nccl "| b023-fusion-nccl-world-1 | pass |"
expect_report venv-nccl "| b023-fusion-step-overhead | pass |"

# 3. pip's nvidia/cu13 layout, no system toolkit: headers and NVRTC from there, every step runs.
h=$(home_with cu13 nccl cu13)
check cu13 0 "$h" "$WORK/driver" --variant plain,b022-cpp,b023-cpp
expect_out cu13 "CUDA_PATH=$h/.venv/lib/$site/cu13"
expect_out cu13 "libnvrtc $h/.venv/lib/$site/cu13/lib/libnvrtc.so.13"
expect_report cu13 "| plain-zero-copy-world-1 | pass |"
expect_report cu13 "| plain-exit-of-a-failed-join-under-"
expect_report cu13 "| b022-cpp-nccl-world-1 | pass |"
expect_report cu13 "| b023-cpp-step-overhead | pass |"

# 4. Paths given on the command line win over the search.
mkdir -p "$WORK/given/nccl" "$WORK/given/include"
: >"$WORK/given/nccl/libnccl.so.2"
: >"$WORK/given/include/cuda_runtime.h"
: >"$WORK/given/include/cuda_fp16.h"
check given 1 "$(home_with given cu13)" "$WORK/driver" --variant core,plain \
    --nccl "$WORK/given/nccl" --cuda-include "$WORK/given/include"
expect_out given "libnccl $WORK/given/nccl/libnccl.so.2"
expect_report given "| plain-zero-copy-world-1 | pass |"
check given-wrong 1 "$(home_with given-wrong)" "$WORK/driver" --variant core --nccl "$WORK/nowhere"
expect_out given-wrong "--nccl $WORK/nowhere is neither that file nor a directory holding it"

# 5. A machine with an older glibc than the bundle needs: one line, before anything else.
sed -i 's/^glibc=.*/glibc=9.99/' "$B/MANIFEST"
check old-glibc 2 "$(home_with old-glibc nccl cu13)" "$WORK/driver"
expect_out old-glibc "cannot run here: this machine's glibc is $glibc, the bundle's binaries need 9.99 or newer"
[ "$(wc -l <<<"$OUT")" = 1 ] || fail "old-glibc: more than one line"
sed -i "s/^glibc=.*/glibc=$glibc/" "$B/MANIFEST"

# 5b. A libstdc++ older than LLVM's C++ needs (the Burn 0.22 archives): one line too.
echo "glibcxx=9.9.99" >>"$B/MANIFEST"
check old-libstdcxx 2 "$(home_with old-libstdcxx nccl cu13)" "$WORK/driver"
expect_out old-libstdcxx "is older than the bundle's binaries need (GLIBCXX_9.9.99"
[ "$(wc -l <<<"$OUT")" = 1 ] || fail "old-libstdcxx: more than one line"
sed -i '/^glibcxx=/d' "$B/MANIFEST"

# 6. No driver at all: "no GPU here", at once.
check no-driver 2 "$(home_with no-driver nccl cu13)" ""
expect_out no-driver "gpu-check: no GPU here: neither nvidia-smi nor the driver's libcuda.so.1 was found"

# 7. A variant the bundle does not hold: named, with what it holds.
rm -r "$B/bin/b022-cpp"
check not-held 2 "$(home_with not-held nccl cu13)" "$WORK/driver" --variant b022-cpp
expect_out not-held "variant b022-cpp: this bundle does not hold its binaries"

if [ "$failures" -gt 0 ]; then
    echo "rehearse: $failures expectation(s) failed" >&2
    exit 1
fi
echo
echo "rehearse: every stand-in machine behaved as expected"
