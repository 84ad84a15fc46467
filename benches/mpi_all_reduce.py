"""Open MPI all-reduce (`MPI_Allreduce` through mpi4py), timed the way `burn-ddp bench all-reduce`
times its own, for comparison with the shared-memory transport.

Needs Debian's `openmpi-bin` and `python3-mpi4py` (with `python3-numpy`):

    mpirun -np 2 python3 benches/mpi_all_reduce.py            # add --allow-run-as-root as root
    burn-ddp bench all-reduce --nproc 2 -b 4K -e 256M -f 4 --transport tcp,shm

Prints, per message size (4 KiB to 256 MiB, x4), the median over 5 rounds of the mean time of
back-to-back in-place float32 sum all-reduces and the bus bandwidth (busbw = algbw * 2(n-1)/n, as
nccl-tests defines it). Open MPI picks its own transport between ranks of one host (the `vader`
shared-memory BTL, with single-copy CMA for large messages when the kernel allows it).
"""

import statistics
import time

import numpy as np
from mpi4py import MPI

TARGET_S = 1.0  # measurement time per size, as `--target-ms 1000`
ROUNDS = 5


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        name = MPI.Get_library_version().splitlines()[0]
        print(f"# mpi all-reduce: {world} ranks, float32 sum, in place, {name}")
        print(f"# {'size (B)':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    size = 4 << 10
    while size <= 256 << 20:
        buf = np.ones(size // 4, dtype=np.float32)
        for _ in range(3):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        # The slowest rank's estimate decides the iterations, the same on every rank.
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        one = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        iters = max(3, min(10_000, int(TARGET_S / ROUNDS / max(one, 1e-7))))
        times = []
        for _ in range(ROUNDS):
            buf[:] = rank + 1
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            times.append(comm.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX))
        # Checked on fresh data, as the Rust tool does.
        buf[:] = rank + 1
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        assert np.all(buf == world * (world + 1) / 2), "wrong all-reduce result"
        elapsed = statistics.median(times)
        algbw = size / elapsed / 1e9
        busbw = algbw * 2 * (world - 1) / world
        if rank == 0:
            print(f"  {size:>12} {elapsed * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}", flush=True)
        size *= 4


if __name__ == "__main__":
    main()
