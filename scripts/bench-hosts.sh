#!/usr/bin/env bash
# The all-reduce of a job of two "hosts" (Linux network namespaces on a bridge, made here and
# removed at exit) with NPROC ranks each, over the flat TCP ring and in two levels (shared memory
# inside each host, a ring per local index across hosts), in interleaved rounds of one run.
#
#   scripts/bench-hosts.sh BURN_DDP [NPROC] [BENCH_ARGS...]
#
# BURN_DDP: the tool, built with `cargo build --release -p burn-ddp-comm --bin burn-ddp
# --features cli`. NPROC: ranks per host (default 2). BENCH_ARGS: more `burn-ddp bench
# all-reduce` options (default: -b 256K -e 256M -f 4). Run as root (namespaces). Rank 0's table
# is printed; "tcp" is the flat ring, "shm" the two levels.
set -euo pipefail

BIN=$(realpath "${1:?usage: scripts/bench-hosts.sh BURN_DDP [NPROC] [BENCH_ARGS...]}")
NPROC=${2:-2}
shift $(($# < 2 ? $# : 2))
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(-b 256K -e 256M -f 4)

P="bddp-bench-$$"
DIR=$(mktemp -d)
cleanup() {
    for i in 0 1; do
        for pid in $(ip netns pids "$P-n$i" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$P-n$i" 2>/dev/null || true
    done
    ip netns del "$P-sw" 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT

ip netns add "$P-sw"
ip -n "$P-sw" link add br0 type bridge
ip -n "$P-sw" link set br0 up
for i in 0 1; do
    ip netns add "$P-n$i"
    ip -n "$P-n$i" link add eth0 type veth peer name "p$i" netns "$P-sw"
    ip -n "$P-sw" link set "p$i" master br0 up
    ip -n "$P-n$i" link set lo up
    ip -n "$P-n$i" addr add "10.79.0.$((i + 1))/24" dev eth0
    ip -n "$P-n$i" link set eth0 up
done

pids=()
for i in 0 1; do
    ip netns exec "$P-n$i" "$BIN" run --nnodes 2 --nproc-per-node "$NPROC" --node-rank "$i" \
        --master-addr 10.79.0.1 --master-port 29500 --rdzv-id bench-hosts -- \
        "$BIN" bench all-reduce --transport tcp,shm "${ARGS[@]}" >"$DIR/node$i.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if [ "$status" -ne 0 ]; then
    cat "$DIR/node0.log" "$DIR/node1.log" >&2
    exit 1
fi
sed 's/^\[rank 0\] //' "$DIR/node0.log" | grep -v '^\[rank'
