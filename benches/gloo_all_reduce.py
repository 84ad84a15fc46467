"""PyTorch Gloo all-reduce, timed the way `burn-ddp bench all-reduce` times its own, for comparison.

Needs PyTorch (any build; only its CPU Gloo backend is used):

    torchrun --standalone --nproc-per-node 2 benches/gloo_all_reduce.py
    cargo run --release -p burn-ddp-comm -- bench all-reduce -b 1K -e 64M -f 8

Prints, per message size, the mean time of back-to-back in-place float32 sum all-reduces and the
bus bandwidth (busbw = algbw * 2(n-1)/n, as nccl-tests defines it).
"""

import os
import time

import torch
import torch.distributed as dist

TARGET_S = 0.4  # measurement time per size, as the Rust tool's --target-ms default


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# gloo all-reduce: {world} ranks, float32 sum, torch {torch.__version__}")
        print(f"# {'size (B)':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    size = 1 << 10
    while size <= 64 << 20:
        buf = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(buf)
        # Calibrate the iteration count on rank 0 and share it, so every rank runs the same loop.
        start = time.perf_counter()
        dist.all_reduce(buf)
        one = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.broadcast(one, 0)
        iters = max(3, min(10_000, int(TARGET_S / max(one.item(), 1e-7))))
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        elapsed = (time.perf_counter() - start) / iters
        algbw = size / elapsed / 1e9
        busbw = algbw * 2 * (world - 1) / world
        if rank == 0:
            print(f"  {size:>12} {elapsed * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}", flush=True)
        size *= 8
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
