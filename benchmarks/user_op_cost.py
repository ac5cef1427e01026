"""What sheltering a user-defined ``MPI.Op`` from signal handlers costs.

The Python function of a user-defined ``MPI.Op`` runs inside
``MPI_Reduce_local``, where mpi4py cannot raise; the library runs each such
call on a thread of its own while the main thread waits
(:func:`mpi_allreduce.threads.sheltered`), so a signal handler's interrupt
lands in the wait instead.  Side by side in one run, the same all-reduce
(``--algorithm``, float64, an add written as a user ``MPI.Op``) in
interleaved repeats (a shuffled order per repeat, the same on every rank),
each batch ``--iters`` calls after a warm-up, the slowest rank's mean:

* ``sheltered``: as shipped;
* ``in place``: the function run on the main thread (the library before the
  shelter, where an interrupt inside it ended the job);
* ``SUM``: the predefined op, for scale.

Switched with :func:`mpi_allreduce.config.refresh` (plans rebuilt in the
warm-up).  Ratios to ``in place`` are taken per repeat.  Run::

    mpiexec -n 2 python benchmarks/user_op_cost.py > benchmarks/results/user-op-cost-np2.txt
"""

from __future__ import annotations

import argparse
import platform
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config, ops, threads
from mpi_allreduce.tools.bench import batch_mean_us, paired_ratios, repeat_order
from mpi_allreduce.tools.verify import mpi_library


def _add(inbuf, inoutbuf, datatype):
    np.add(np.frombuffer(inbuf, np.float64), np.frombuffer(inoutbuf, np.float64),
           out=np.frombuffer(inoutbuf, np.float64))


def _in_place(function, *args):
    return function(*args)


CONFIGS = ("sheltered", "in place", "SUM")


def use(name: str) -> None:
    ops.sheltered = _in_place if name == "in place" else threads.sheltered
    config.refresh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--iters", type=int, default=500)
    parser.add_argument("-r", "--repeats", type=int, default=11)
    parser.add_argument("-a", "--algorithm", default="recursive_doubling")
    parser.add_argument("-b", "--bytes", default="64,65536",
                        help="comma-separated sizes in bytes (default 64,65536)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    p, rank = comm.Get_size(), comm.Get_rank()
    add = MPI.Op.Create(_add, commute=True)
    lines = []
    for nbytes in [int(b) for b in args.bytes.split(",")]:
        send = np.full(nbytes // 8, rank + 1.0)
        recv = np.empty_like(send)
        times = {name: [] for name in CONFIGS}
        for repeat in range(args.repeats):
            for name in repeat_order(list(CONFIGS), nbytes, repeat):
                use(name)
                op = MPI.SUM if name == "SUM" else add

                def call():
                    mar.allreduce(send, recv, op, comm=comm, algorithm=args.algorithm)
                times[name].append(batch_mean_us(comm, call, args.iters, 50))
                if not np.all(recv == p * (p + 1) / 2):
                    raise SystemExit(f"wrong result: {name}, {nbytes} B")
        for name in CONFIGS:
            ratio, q1, q3 = paired_ratios(times[name], times["in place"])
            lines.append(f"  {nbytes:>8} {name:>10} {median(times[name]):10.2f} {ratio:9.3f} "
                         f"{q1:9.3f} - {q3:<8.3f}")
    use("sheltered")
    if rank == 0:
        print(f"# float64 add as a user MPI.Op, {args.algorithm}, {p} ranks; {args.repeats} "
              f"repeats of {args.iters} calls; {mpi_library()}; {platform.node()}")
        print(f"# {'bytes':>8} {'config':>10} {'median us':>10} {'x in place':>9} "
              f"{'q1-q3 (per repeat)':>20}")
        print("\n".join(lines))
    add.Free()
    comm.Free()


if __name__ == "__main__":
    main()
