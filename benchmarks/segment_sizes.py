#!/usr/bin/env python3
"""Which segment size: every algorithm at several ``segment_size`` values, side by side.

    mpiexec -n P python benchmarks/segment_sizes.py [--sizes 2M 8M 32M]
        [--segments 256K 1M 4M whole] [--repeats 9]

Every message that carries data to be reduced travels in segments of at
most ``segment_size`` elements, each reduced as it arrives (``whole``: one
message per step, the vector or the ring's block as it is).  Smaller
segments keep what is reduced in cache and the scratch small; larger ones
pay fewer per-message costs.  For each vector size, every (algorithm,
segment) pair runs on the same buffers, all interleaved ``--repeats``
times (mean of a batch of calls, maximum over the ranks, median over the
repeats); times are printed relative to the 1 MiB default.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.api import DEFAULT_SEGMENT_BYTES
from mpi_allreduce.tools.bench import batch_mean_us, parse_size
from mpi_allreduce.tools.verify import mpi_library

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "driver")
WHOLE = "whole"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["2M", "8M", "32M"])
    parser.add_argument("--segments", nargs="+", default=["256K", "1M", "4M", WHOLE])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    segments = [None if s == WHOLE else parse_size(s) for s in args.segments]
    if DEFAULT_SEGMENT_BYTES not in segments:
        segments.insert(0, DEFAULT_SEGMENT_BYTES)
    if comm.rank == 0:
        print(f"# {comm.size} ranks, float32 SUM, {mpi_library()}")
        print(f"# time relative to {DEFAULT_SEGMENT_BYTES >> 10} KiB segments, "
              f"medians of {args.repeats} interleaved repeats")
        labels = [WHOLE if s is None else f"{s >> 10}K" for s in segments]
        print(f"{'size(B)':>10} {'algorithm':>18} " + " ".join(f"{x:>7}" for x in labels)
              + "   1M time(us)")
    for nbytes in map(parse_size, args.sizes):
        count = nbytes // 4
        send = np.random.default_rng(comm.rank).random(count, dtype=np.float32)
        recv = np.empty_like(send)
        calls = {}
        for name in ALGORITHMS:
            for seg in segments:
                elements = count if seg is None else seg // 4  # whole: one segment
                calls[name, seg] = (lambda name=name, elements=max(1, elements):
                                    mar.allreduce(send, recv, algorithm=name,
                                                  segment_size=elements))
        iters = max(3, min(100, (32 << 20) // nbytes))
        times = {key: [] for key in calls}
        for _ in range(args.repeats):
            for key, call in calls.items():
                times[key].append(batch_mean_us(comm, call, iters, warmup=1))
        if comm.rank == 0:
            for name in ALGORITHMS:
                ref = np.median(times[name, DEFAULT_SEGMENT_BYTES])
                ratios = " ".join(f"{np.median(times[name, s]) / ref:7.2f}" for s in segments)
                print(f"{nbytes:>10} {name:>18} {ratios}   {ref:10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
