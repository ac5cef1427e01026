"""The latency floor: an 8-byte all-reduce against the least it can cost in Python.

Side by side in one run, in interleaved batches (the order shuffled per
repeat, the same on every rank), on the same buffers:

* ``floor``: one mpi4py ``Sendrecv`` of the vector with the peer plus one
  numpy add per call -- what a 2-rank all-reduce cannot do without
  (on more ranks, the peer is rank XOR 1 and the floor is one such step);
* ``mpi``: the vendor's ``MPI.Allreduce``;
* ``nb_floor``: the floor's exchange as a non-blocking call would make it
  (``Irecv``, ``Isend``, ``Waitall``, the add): the least a repeated
  ``iallreduce`` + ``wait`` can cost in Python, whatever the library does;
* every algorithm of ours named in ``-a`` (default: recursive doubling and
  the reproducible ``auto``);
* ``persistent``: ``allreduce_init`` once, then ``start()`` and ``wait()``
  per call (the fastest way to repeat a call; algorithm ``auto``);
* ``iallreduce``: ``iallreduce(...).wait()`` per call on the same arrays (a
  repeated non-blocking call runs its kept bound call; algorithm ``auto``),
  also given as a ratio to the blocking ``auto`` call of the same repeats.

Each batch is ``--iters`` back-to-back calls after a warm-up, timed as one
(the slowest rank's mean); the median over ``--repeats`` batches is
reported, with each ratio to the floor taken per repeat (median and
quartiles).  Run::

    mpiexec -n 2 python benchmarks/floor.py --json benchmarks/results/floor-np2.json
"""

from __future__ import annotations

import argparse
import json
import platform
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.tools.bench import batch_mean_us, paired_ratios, parse_size, repeat_order
from mpi_allreduce.tools.verify import mpi_library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-s", "--size", default="8", help="bytes per rank (default 8)")
    parser.add_argument("-n", "--iters", type=int, default=2000)
    parser.add_argument("-w", "--warmup", type=int, default=200)
    parser.add_argument("-r", "--repeats", type=int, default=31)
    parser.add_argument("-a", "--algorithms", default="recursive_doubling,auto")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    count = max(1, parse_size(args.size) // 4)
    send = np.full(count, rank + 1, dtype=np.float32)
    recv = np.empty_like(send)
    incoming = np.empty_like(send)
    peer = rank ^ 1 if (rank ^ 1) < size else MPI.PROC_NULL
    sendrecv, add, f32 = comm.Sendrecv, np.add, MPI.FLOAT

    def floor():
        sendrecv([send, f32], peer, 0, [incoming, f32], peer, 0)
        add(send, incoming, recv)

    def vendor():
        comm.Allreduce([send, f32], [recv, f32], MPI.SUM)

    irecv, isend, waitall = comm.Irecv, comm.Isend, MPI.Request.Waitall

    def nb_floor():
        waitall([irecv([incoming, f32], peer, 0), isend([send, f32], peer, 0)])
        add(send, incoming, recv)

    calls = {"floor": floor, "mpi": vendor, "nb_floor": nb_floor}
    for name in args.algorithms.split(","):
        calls[name] = (lambda name: lambda: mar.allreduce(send, recv, MPI.SUM, comm=comm,
                                                          algorithm=name))(name)
    request = mar.allreduce_init(send, recv, MPI.SUM, comm=comm)
    start, wait = request.start, request.wait

    def persistent():
        start()
        wait()

    calls["persistent"] = persistent

    def nonblocking():
        mar.iallreduce(send, recv, MPI.SUM, comm=comm).wait()

    calls["iallreduce"] = nonblocking
    names = list(calls)
    per_repeat = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in repeat_order(names, count * 4, repeat):
            per_repeat[name].append(batch_mean_us(comm, calls[name], args.iters, args.warmup))

    if rank == 0:
        rows = []
        print(f"# {count * 4} B float32 SUM on {size} ranks; {args.repeats} repeats of "
              f"{args.iters} calls; {mpi_library()}; {platform.node()}")
        print(f"# {'call':>20} {'median us':>10} {'x floor':>8} {'q1-q3 (per repeat)':>20}")
        for name in names:
            ratio, q1, q3 = paired_ratios(per_repeat[name], per_repeat["floor"])
            row = {"call": name, "median_us": median(per_repeat[name]),
                   "ratio_to_floor": ratio, "ratio_q1": q1, "ratio_q3": q3,
                   "repeats_us": per_repeat[name]}
            rows.append(row)
            print(f"  {name:>20} {row['median_us']:10.2f} {row['ratio_to_floor']:8.2f} "
                  f"{q1:9.2f} - {q3:<8.2f}")
        if "auto" in per_repeat:
            ratio, q1, q3 = paired_ratios(per_repeat["iallreduce"], per_repeat["auto"])
            print(f"# iallreduce + wait / blocking auto: {ratio:.2f} (per repeat q1-q3 "
                  f"{q1:.2f} - {q3:.2f})")
            ratio, q1, q3 = paired_ratios(per_repeat["nb_floor"], per_repeat["floor"])
            print(f"# non-blocking floor / floor: {ratio:.2f} (per repeat q1-q3 "
                  f"{q1:.2f} - {q3:.2f}); iallreduce + wait / non-blocking floor: "
                  f"{paired_ratios(per_repeat['iallreduce'], per_repeat['nb_floor'])[0]:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": "mpiexec -n %d python benchmarks/floor.py" % size,
                           "bytes": count * 4, "ranks": size, "iters": args.iters,
                           "repeats": args.repeats, "mpi": mpi_library(),
                           "host": platform.node(), "machine": platform.machine(),
                           "results": rows}, f, indent=1)
    request.free()
    comm.Free()


if __name__ == "__main__":
    main()
