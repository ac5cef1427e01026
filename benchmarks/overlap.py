"""Overlap: a non-blocking all-reduce while the caller is busy elsewhere.

Side by side in one run, ours (``mar.iallreduce``) and the vendor's
(``MPI.Iallreduce``), float32 SUM, per size (default 1 to 64 MiB):

* ``t_comm``: start, then wait at once (the call alone);
* ``t_other``: a sleep as long as that call's ``t_comm`` (it stands for GPU
  compute: it holds no core);
* ``t_total``: start, sleep ``t_other``, wait;
* overlap = (t_comm + t_other - t_total) / min(t_comm, t_other): 100% when
  the call is hidden entirely behind the other work, 0% when it waits.

Each time is the slowest rank's, the median of ``--repeats`` interleaved
repeats.  Run::

    mpiexec -n 2 python benchmarks/overlap.py --json benchmarks/results/overlap-np2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.progress import thread_progress
from mpi_allreduce.tools.bench import human, parse_size
from mpi_allreduce.tools.verify import mpi_library


def slowest(comm, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-s", "--sizes", default="1M,4M,16M,64M", help="bytes per rank")
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = []
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        count = nbytes // 4
        send = np.full(count, rank + 1, np.float32)
        recv = np.empty_like(send)
        starts = {
            "ours": lambda: mar.iallreduce(send, recv, MPI.SUM, comm=comm),
            "mpi": lambda: comm.Iallreduce(send, recv, MPI.SUM),
        }
        times = {name: {"comm": [], "total": []} for name in starts}
        for name, start in starts.items():  # warm-up: plans, first-touch pages
            start().wait()
        for repeat in range(args.repeats):
            for name in (list(starts) if repeat % 2 == 0 else list(reversed(starts))):
                start = starts[name]
                comm.Barrier()
                t0 = time.perf_counter()
                start().wait()
                t_comm = slowest(comm, time.perf_counter() - t0)
                comm.Barrier()
                t0 = time.perf_counter()
                request = start()
                time.sleep(t_comm)
                request.wait()
                t_total = slowest(comm, time.perf_counter() - t0)
                times[name]["comm"].append(t_comm)
                times[name]["total"].append(t_total)
        assert np.all(recv == size * (size + 1) / 2), "wrong result"
        for name, t in times.items():
            t_comm, t_total = median(t["comm"]), median(t["total"])
            t_other = t_comm
            overlap = (t_comm + t_other - t_total) / min(t_comm, t_other)
            rows.append({"bytes": nbytes, "impl": name, "t_comm_ms": t_comm * 1e3,
                         "t_other_ms": t_other * 1e3, "t_total_ms": t_total * 1e3,
                         "overlap_pct": 100 * overlap})

    if rank == 0:
        mode = "progress thread" if thread_progress() else "caller progress (test/wait)"
        print(f"# overlap on {size} ranks, float32 SUM; {args.repeats} repeats (median); "
              f"ours: {mode}; {mpi_library()}; {platform.node()}")
        print(f"# {'size':>8} {'impl':>5} {'t_comm ms':>10} {'t_other ms':>10} "
              f"{'t_total ms':>10} {'overlap':>8}")
        for row in rows:
            print(f"  {human(row['bytes']):>8} {row['impl']:>5} {row['t_comm_ms']:10.2f} "
                  f"{row['t_other_ms']:10.2f} {row['t_total_ms']:10.2f} "
                  f"{row['overlap_pct']:7.0f}%")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": f"mpiexec -n {size} python benchmarks/overlap.py",
                           "ranks": size, "repeats": args.repeats, "progress": mode,
                           "mpi": mpi_library(), "host": platform.node(), "rows": rows},
                          f, indent=1)
    comm.Free()


if __name__ == "__main__":
    main()
