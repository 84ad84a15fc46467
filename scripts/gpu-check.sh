#!/usr/bin/env bash
# GPU checks of burn-ddp's CUDA layer, from a clean checkout, offline once the crates are fetched.
#   scripts/gpu-check.sh            # writes docs/gpu-verification.md
#
# 1. NCCL at world size 1: every collective on every dtype, against the host transport
# 2. 2 processes sharing one GPU through the host-staged transport: the decorator's equivalence
#    tests on Autodiff<Ddp<Cuda>>
# 3. the zero-copy device path (GradTransport::Nccl) at world size 1: the same equivalence tests
# 4. the decorator's step overhead on CUDA vs plain Autodiff<Cuda> (benches/cuda_step.rs)
# 5. burn-ddp bench all-reduce over NCCL (1 rank: one GPU) and over the host transport (2 ranks)
# On a machine without a GPU it stops at the first step, saying what is missing.
set -uo pipefail
cd "$(dirname "$0")/.."

REPORT=docs/gpu-verification.md
LOG=$(mktemp -d)
status=0

die() { printf 'gpu-check: %s\n' "$*" >&2; exit 2; }

# --- what this machine has ---------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
    die "no GPU here: nvidia-smi is not installed (no NVIDIA driver). Run this on a machine with an NVIDIA GPU and its driver."
fi
if ! nvidia-smi -L >"$LOG/gpus" 2>&1 || ! grep -q '^GPU ' "$LOG/gpus"; then
    die "no GPU here: nvidia-smi lists none ($(head -1 "$LOG/gpus"))."
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
    echo "gpu-check: warning: libcuda.so is not in the loader cache; relying on LD_LIBRARY_PATH" >&2
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
    found=$(ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnccl\.so\.2$' | head -1)
    if [ -z "$found" ]; then
        found=$(find / -name 'libnccl.so.2' -not -path '*/proc/*' 2>/dev/null | head -1)
    fi
    if [ -n "$found" ] && [ ! -e "$(dirname "$found")/libnccl.so" ]; then
        # cudarc loads libnccl.so; give it one without touching the system.
        mkdir -p target/nccl-link && ln -sf "$found" target/nccl-link/libnccl.so
        export LD_LIBRARY_PATH="$PWD/target/nccl-link${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "gpu-check: linked $found as target/nccl-link/libnccl.so" >&2
    fi
fi

GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
DATE=$(date -u +%Y-%m-%d)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

run() { # name, command...
    local name=$1; shift
    printf '\n==== %s ====\n' "$name"
    if "$@" >"$LOG/$name.log" 2>&1; then
        echo "PASS"; printf '| %s | pass |\n' "$name" >>"$LOG/table"
    else
        echo "FAIL (see the report)"; printf '| %s | **FAIL** |\n' "$name" >>"$LOG/table"; status=1
    fi
    tail -40 "$LOG/$name.log"
}

export BURN_DDP_COLLECTIVE_TIMEOUT=${BURN_DDP_COLLECTIVE_TIMEOUT:-120}
run build sh -c 'cargo build --release --features cuda --tests && cargo build --release -p burn-ddp --features cuda --bin burn-ddp'
run nccl-world-1 cargo test --release --features cuda --test cuda_nccl -- --nocapture --test-threads 1
run host-staged-2-processes-one-gpu env BURN_DDP_GRAD_TRANSPORT=host BURN_DDP_TEST_WORLDS=2,3 \
    cargo test --release --features cuda --test ddp_equivalence -- --nocapture
run zero-copy-nccl-world-1 env BURN_DDP_GRAD_TRANSPORT=nccl BURN_DDP_TEST_WORLDS=1 \
    cargo test --release --features cuda --test ddp_equivalence -- --nocapture \
    --skip an_unused_parameter --skip mismatched_models
run step-overhead cargo bench --features cuda --bench cuda_step -- --rounds 5
run bench-all-reduce-nccl target/release/burn-ddp bench all-reduce --nproc 1 --transport nccl --min-bytes 1M --max-bytes 1G
run bench-all-reduce-host-2-ranks target/release/burn-ddp bench all-reduce --nproc 2 --min-bytes 1M --max-bytes 64M

{
    echo "# GPU verification"
    echo
    echo "Written by \`scripts/gpu-check.sh\` on $DATE (UTC), commit $COMMIT."
    echo
    echo "Device: $GPU"
    echo
    echo "| check | result |"
    echo "|---|---|"
    cat "$LOG/table"
    for f in "$LOG"/*.log; do
        echo
        echo "## $(basename "$f" .log)"
        echo
        echo '```'
        tail -60 "$f"
        echo '```'
    done
} >"$REPORT"
echo
echo "report: $REPORT"
exit $status
