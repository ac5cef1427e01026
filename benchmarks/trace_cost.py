"""What recording a trace adds to a call: ``MPI_ALLREDUCE_TRACE`` on against off.

Side by side in one run, on the same processes and buffers, in interleaved
batches (which of the two goes first alternates by repeat): a blocking
all-reduce (``-a``, default ring and recursive doubling) with tracing off
and on, at each size.  Each batch is ``--iters`` back-to-back calls after a
warm-up, timed as one (the slowest rank's mean); the medians over the
repeats are reported with the ratio on/off taken repeat by repeat.  The
recorded events are dropped after each batch (a batch of fewer events than
``trace.CHUNK_EVENTS`` seldom writes them to its file: ``--iters 3000``
includes the writing).  (What tracing costs when off -- no step is added to
a call -- is measured against the commit before tracing by
``benchmarks/floor_against.py``.)  Run::

    mpiexec -n 2 python benchmarks/trace_cost.py > benchmarks/results/trace-cost-np2.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config, trace
from mpi_allreduce.tools.bench import batch_mean_us, paired_ratios, parse_size
from mpi_allreduce.tools.verify import mpi_library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-s", "--sizes", default="8,64K,1M", help="bytes per rank")
    parser.add_argument("-a", "--algorithms", default="ring,recursive_doubling")
    parser.add_argument("-n", "--iters", type=int, default=300)
    parser.add_argument("-w", "--warmup", type=int, default=30)
    parser.add_argument("-r", "--repeats", type=int, default=11)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    directory = comm.bcast(tempfile.mkdtemp(prefix="trace-cost-") if comm.Get_rank() == 0
                           else None)
    if comm.Get_rank() == 0:
        print(f"# {' '.join(['benchmarks/trace_cost.py'] + os.sys.argv[1:])}: {comm.Get_size()} "
              f"ranks, {mpi_library()}, {platform.node()}, Python {platform.python_version()}")
        print(f"# batches of {args.iters} blocking float32 sum calls after {args.warmup}, "
              f"{args.repeats} repeats alternating off/on; us per call (median), on/off "
              f"ratio per repeat: median [q1, q3]")
        print(f"{'size':>8} {'algorithm':>20} {'off us':>9} {'on us':>9} {'on/off':>8} "
              f"{'q1':>6} {'q3':>6} {'events/call':>12}")

    def mode(on: bool) -> None:
        if on:
            os.environ[config.TRACE_ENV] = directory
        else:
            os.environ.pop(config.TRACE_ENV, None)
        config.refresh()

    for text in args.sizes.split(","):
        nbytes = parse_size(text)
        send = np.ones(max(1, nbytes // 4), dtype=np.float32)
        recv = np.empty_like(send)
        for algorithm in args.algorithms.split(","):
            times = {False: [], True: []}
            events = 0

            def call():
                mar.allreduce(send, recv, algorithm=algorithm, comm=comm)
            for repeat in range(args.repeats):
                for on in ((False, True) if repeat % 2 == 0 else (True, False)):
                    mode(on)
                    iters = args.iters if nbytes < (1 << 20) else max(10, args.iters // 10)
                    times[on].append(batch_mean_us(comm, call, iters, args.warmup))
                    if on:
                        taken = trace.tracer().take()
                        events = sum(e["ph"] == "X" for e in taken) / (iters + args.warmup)
            ratio, q1, q3 = paired_ratios(times[True], times[False])
            if comm.Get_rank() == 0:
                print(f"{nbytes:>8} {algorithm:>20} {median(times[False]):>9.2f} "
                      f"{median(times[True]):>9.2f} {ratio:>8.3f} {q1:>6.3f} {q3:>6.3f} "
                      f"{events:>12.1f}", flush=True)
    mode(False)
    comm.Free()


if __name__ == "__main__":
    main()
