"""PyTorch Gloo all-reduce, timed the way `burn-ddp bench all-reduce` times its own (and
`benches/mpi_all_reduce.py` times Open MPI's), for comparison.

Needs PyTorch (any build; only its CPU Gloo backend is used):

    torchrun --standalone --nproc-per-node 2 benches/gloo_all_reduce.py
    burn-ddp bench all-reduce --nproc 2 -b 4K -e 256M -f 4 --transport tcp,shm

Prints, per message size (4 KiB to 256 MiB, x4), the median over 5 rounds of the mean time of
back-to-back in-place float32 sum all-reduces and the bus bandwidth (busbw = algbw * 2(n-1)/n, as
nccl-tests defines it). Gloo moves bytes between ranks of one host over TCP loopback.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

TARGET_S = 1.0  # measurement time per size, as `--target-ms 1000`
ROUNDS = 5


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (so every rank runs the same loop)."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# gloo all-reduce: {world} ranks, float32 sum, in place, torch {torch.__version__}")
        print(f"# {'size (B)':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    size = 4 << 10
    while size <= 256 << 20:
        buf = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(buf)
        start = time.perf_counter()
        dist.all_reduce(buf)
        one = slowest(time.perf_counter() - start)
        iters = max(3, min(10_000, int(TARGET_S / ROUNDS / max(one, 1e-7))))
        times = []
        for _ in range(ROUNDS):
            buf.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            times.append(slowest((time.perf_counter() - start) / iters))
        # Checked on fresh data, as the Rust tool does.
        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        assert bool((buf == world * (world + 1) / 2).all()), "wrong all-reduce result"
        elapsed = statistics.median(times)
        algbw = size / elapsed / 1e9
        busbw = algbw * 2 * (world - 1) / world
        if rank == 0:
            print(f"  {size:>12} {elapsed * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}", flush=True)
        size *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
