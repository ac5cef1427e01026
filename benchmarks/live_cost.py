"""What live selection costs from the first call on, against the table alone.

For each size, each repeat makes two fresh communicators (``Dup``: a new
context, so a new selector and new plans; the context itself is made before
the clock starts) and times, on the same buffers,
``--calls`` back-to-back calls of ``auto`` from its very first call: once
with ``selection="table"``, once with ``selection="live"`` (the order of the
two alternates by repeat).  Each rank times the whole loop; the slowest
rank's time counts.  Reported: the median over repeats of live/table taken
per repeat, with quartiles, and what live selection ran at the end.  Run::

    mpiexec -n 2 python benchmarks/live_cost.py > benchmarks/results/live-cost-np2.txt
"""

from __future__ import annotations

import argparse
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.context import context_for, release
from mpi_allreduce.tools.bench import paired_ratios, parse_size
from mpi_allreduce.tools.verify import mpi_library


def loop_seconds(comm, send, recv, selection: str, calls: int):
    """Seconds for ``calls`` calls on a fresh communicator, and what ``auto``
    ran at the end (live: the selector's choice and its moves)."""
    fresh = comm.Dup()
    context_for(fresh)  # its private Dup and topology: the same for both, not timed
    fresh.Barrier()
    start = MPI.Wtime()
    for _ in range(calls):
        mar.allreduce(send, recv, comm=fresh, selection=selection)
    seconds = fresh.allreduce(MPI.Wtime() - start, op=MPI.MAX)
    ran = None
    if selection == "live":
        selector, = context_for(fresh).selectors.values()
        probes = sum(n for name, n in selector._counts.items() if name != selector.current)
        ran = (selector.current, selector.moves, probes)
    release(fresh)
    fresh.Free()
    return seconds, ran


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-s", "--sizes", default="64K,1M,8M")
    parser.add_argument("-c", "--calls", default="300,3000")
    parser.add_argument("-r", "--repeats", type=int, default=11)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if rank == 0:
        print(f"# live selection / table alone, from the first call; {comm.Get_size()} ranks; "
              f"{args.repeats} repeats; {mpi_library().split(',')[0]}")
        print(f"{'size':>8} {'calls':>6} {'table ms':>9} {'live ms':>9} {'live/table':>10} "
              f"{'q1-q3':>13}  live ran at the end (moves, probe calls)")
    for text in args.sizes.split(","):
        count = max(1, parse_size(text) // 4)
        send = np.random.default_rng(rank).random(count, dtype=np.float32)
        recv = np.empty_like(send)
        for calls in map(int, args.calls.split(",")):
            table, live, ran = [], [], None
            for repeat in range(args.repeats):
                order = ("table", "live") if repeat % 2 == 0 else ("live", "table")
                got = {}
                for selection in order:
                    got[selection] = loop_seconds(comm, send, recv, selection, calls)
                table.append(got["table"][0])
                live.append(got["live"][0])
                ran = got["live"][1]
            if rank == 0:
                ratio, q1, q3 = paired_ratios(live, table)
                print(f"{text:>8} {calls:>6} {median(table) * 1e3:9.2f} {median(live) * 1e3:9.2f} "
                      f"{ratio:10.3f} {q1:6.3f}-{q3:<6.3f}  {ran[0]} ({ran[1]}, {ran[2]})",
                      flush=True)


if __name__ == "__main__":
    main()
