"""reduce_scatter and allgather on each algorithm that has them, beside the vendor's.

Per size (bytes of the whole vector per rank; float32; block forms), in
interleaved repeats (the order of the calls shuffled the same way on every
rank, another order each repeat), the slowest rank's mean over ``--iters``
calls, median of ``--repeats``: ``mar.reduce_scatter`` on each algorithm of
``registry.HALVES`` vs ``MPI.Reduce_scatter_block`` (SUM) and
``mar.allgather`` vs ``MPI.Allgather``.  Every result is checked element by
element after the timing (``#wrong``: wrong elements over every rank).  Run::

    mpiexec -n 2 python benchmarks/halves.py -r 7 > benchmarks/results/halves-np2.txt
    mpiexec -n 4 --oversubscribe python benchmarks/halves.py -r 7 \
        > benchmarks/results/halves-np4.txt
"""

from __future__ import annotations

import argparse
import platform
import random
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import registry
from mpi_allreduce.tools.bench import batch_mean_us, human, parse_size
from mpi_allreduce.tools.verify import mpi_library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-s", "--sizes", default="1K,64K,1M,16M")
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("-a", "--algorithms", default=",".join(registry.HALVES),
                        help="comma-separated, of: %(default)s")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    for name in algorithms:
        if name not in registry.HALVES:
            parser.error(f"{name!r} has no halves; choose of {', '.join(registry.HALVES)}")
    comm = MPI.COMM_WORLD.Dup()
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        print(f"# reduce_scatter and allgather, float32, {p} ranks; {args.repeats} shuffled "
              f"repeats of {args.iters} calls (median of the slowest rank's mean); "
              f"{mpi_library()}; {platform.node()}")
        print(f"# {'vector':>8} {'collective':>15} {'algorithm':>16} {'ours us':>10} "
              f"{'mpi us':>10} {'ours/mpi':>9} {'#wrong':>7}")
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        block = max(1, nbytes // 4 // p)
        # small integers: every sum exact in float32, whatever the order
        full = (np.arange(block * p) % 1024 + rank).astype(np.float32)
        want_part = (np.arange(block * p) % 1024 * p + p * (p - 1) // 2)[
            rank * block:(rank + 1) * block].astype(np.float32)
        mine = (np.arange(block) + rank * block).astype(np.float32)
        want_all = np.arange(block * p, dtype=np.float32)
        part = np.empty(block, np.float32)
        gathered = np.empty(block * p, np.float32)
        collectives = {
            "reduce_scatter": (
                {a: (lambda a=a: mar.reduce_scatter(full, part, MPI.SUM, comm=comm,
                                                    algorithm=a)) for a in algorithms},
                lambda: comm.Reduce_scatter_block(full, part, MPI.SUM), part, want_part),
            "allgather": (
                {a: (lambda a=a: mar.allgather(mine, gathered, comm=comm, algorithm=a))
                 for a in algorithms},
                lambda: comm.Allgather(mine, gathered), gathered, want_all),
        }
        for what, (ours, vendor, out, want) in collectives.items():
            calls = dict(ours, mpi=vendor)
            times = {label: [] for label in calls}
            order = random.Random(nbytes)
            for _ in range(args.repeats):
                labels = list(calls)
                order.shuffle(labels)
                for label in labels:
                    times[label].append(batch_mean_us(comm, calls[label], args.iters, 2))
            t_mpi = median(times["mpi"])
            for name in algorithms:
                out[:] = np.nan
                ours[name]()
                wrong = comm.allreduce(int(np.count_nonzero(out != want)))
                if rank == 0:
                    t = median(times[name])
                    print(f"  {human(nbytes):>8} {what:>15} {name:>16} {t:10.1f} {t_mpi:10.1f} "
                          f"{t / t_mpi:9.2f} {wrong:7d}")
    comm.Free()


if __name__ == "__main__":
    main()
