"""reduce_scatter and allgather against the vendor's, side by side.

Per size (bytes of the whole vector per rank; float32; block forms), in
interleaved repeats, the slowest rank's mean over ``--iters`` calls, median
of ``--repeats``: ``mar.reduce_scatter`` vs ``MPI.Reduce_scatter_block``
(SUM) and ``mar.allgather`` vs ``MPI.Allgather``.  Every result is checked.
Run::

    mpiexec -n 2 python benchmarks/halves.py > benchmarks/results/halves-np2.txt
"""

from __future__ import annotations

import argparse
import platform
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.tools.bench import batch_mean_us, human, parse_size
from mpi_allreduce.tools.verify import mpi_library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-s", "--sizes", default="1K,64K,1M,16M")
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        print(f"# reduce_scatter and allgather, float32, {p} ranks; {args.repeats} repeats of "
              f"{args.iters} calls (median of the slowest rank's mean); {mpi_library()}; "
              f"{platform.node()}")
        print(f"# {'vector':>8} {'collective':>15} {'ours us':>10} {'mpi us':>10} {'ours/mpi':>9}")
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        block = max(1, nbytes // 4 // p)
        full = np.full(block * p, rank + 1, np.float32)
        part = np.empty(block, np.float32)
        gathered = np.empty(block * p, np.float32)
        calls = {
            "reduce_scatter": (lambda: mar.reduce_scatter(full, part, MPI.SUM, comm=comm),
                               lambda: comm.Reduce_scatter_block(full, part, MPI.SUM)),
            "allgather": (lambda: mar.allgather(part, gathered, comm=comm),
                          lambda: comm.Allgather(part, gathered)),
        }
        for name, (ours, vendor) in calls.items():
            times = {"ours": [], "mpi": []}
            for repeat in range(args.repeats):
                pair = [("ours", ours), ("mpi", vendor)]
                for label, call in (pair if repeat % 2 == 0 else pair[::-1]):
                    times[label].append(batch_mean_us(comm, call, args.iters, 2))
            ours(); assert np.all(part == p * (p + 1) / 2) if name == "reduce_scatter" else \
                np.array_equal(gathered, np.repeat(part[:1], block * p))
            if rank == 0:
                t_ours, t_mpi = median(times["ours"]), median(times["mpi"])
                print(f"  {human(nbytes):>8} {name:>15} {t_ours:10.1f} {t_mpi:10.1f} "
                      f"{t_ours / t_mpi:9.2f}")
    comm.Free()


if __name__ == "__main__":
    main()
