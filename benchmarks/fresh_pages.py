#!/usr/bin/env python3
"""Why ``auto`` measures: the cost of sending data the sender has just written.

    mpiexec -n 2 python benchmarks/fresh_pages.py [--bytes 1M] [--runs 15]

Two ranks exchange one block with ``Sendrecv``, three ways, each timed as the
mean of 30 calls (maximum over the ranks), repeated ``--runs`` times with
new buffers:

  untouched   the block is not written between sends (what a benchmark
              that reuses its input does: recursive doubling's exchange)
  fresh       the sender writes the block just before each send (what the
              ring's allgather does: it sends the block it just reduced)
  write only  the write alone, no message

On some runs of the machine in benchmarks/README.md, ``fresh`` costs several
times ``untouched`` + ``write only``; on others it does not.  A decision
table measured on one day cannot know which kind of day it is.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

from mpi_allreduce.tools.bench import batch_mean_us, parse_size
from mpi_allreduce.tools.verify import mpi_library


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=parse_size, default=parse_size("1M"))
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("run on exactly 2 ranks")
    peer = 1 - comm.Get_rank()
    count = args.bytes // 4
    rows = []
    for _ in range(args.runs):
        block, into = np.ones(count, np.float32), np.empty(count, np.float32)

        def untouched():
            comm.Sendrecv(block, peer, 0, into, peer, 0)

        def fresh():
            block[...] = 1.0
            comm.Sendrecv(block, peer, 0, into, peer, 0)

        def write_only():
            block[...] = 1.0

        rows.append([batch_mean_us(comm, f, iters=30, warmup=3)
                     for f in (untouched, fresh, write_only)])
    if comm.Get_rank() == 0:
        print(f"# {args.bytes} B per message, 2 ranks, {mpi_library()}")
        print(f"{'run':>4} {'untouched':>10} {'fresh':>10} {'write only':>11} {'fresh/(untouched+write)':>24}")
        for i, (u, f, w) in enumerate(rows):
            print(f"{i:>4} {u:>10.1f} {f:>10.1f} {w:>11.1f} {f / (u + w):>24.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
