"""Memory over many torch groups: ``new_group`` / ``all_reduce`` (one
blocking, one async whose future completes through the library's
completion callbacks) / ``destroy_process_group``, ``--cycles`` times, the
resident set size (from ``/proc/self/statm``) and the library's live
contexts printed every ``--every`` cycles, per rank.  Run::

    mpiexec -n 2 python benchmarks/torch_groups.py > benchmarks/results/torch-groups-np2.txt
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpi_allreduce import context
from mpi_allreduce import torch as backend  # noqa: F401 - registers the backend
from mpi_allreduce.tools.verify import mpi_library


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=10000)
    parser.add_argument("--every", type=int, default=1000)
    args = parser.parse_args()
    dist.init_process_group("mpi_allreduce")
    p, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for cycle in range(1, args.cycles + 1):
        group = dist.new_group(list(range(p)))
        t, u = torch.ones(2), torch.ones(3)
        dist.all_reduce(t, group=group)
        future = dist.all_reduce(u, group=group, async_op=True).get_future()
        future.wait()
        if t.tolist() != [float(p)] * 2 or u.tolist() != [float(p)] * 3:
            raise SystemExit(f"rank {rank}: a wrong sum at cycle {cycle}")
        dist.destroy_process_group(group)
        if cycle % args.every == 0 or cycle == 1:
            rows.append((cycle, rss_mib(), len(context._LIVE)))
    everyone = MPI.COMM_WORLD.gather(rows, root=0)
    if rank == 0:
        print(f"# torch {torch.__version__}: new_group / all_reduce (blocking and async, "
              f"future waited) / destroy_process_group, {args.cycles} cycles on {p} ranks; "
              f"{mpi_library()}; {platform.node()}")
        print("# cycle " + " ".join(f"{f'rank {r} RSS MiB':>16} {'contexts':>8}"
                                    for r in range(p)))
        for k, (cycle, *_) in enumerate(rows):
            cells = " ".join(f"{mine[k][1]:16.1f} {mine[k][2]:8d}" for mine in everyone)
            print(f"{cycle:7d} {cells}")
        first = [mine[1][1] for mine in everyone]  # (after the first --every cycles)
        last = [mine[-1][1] for mine in everyone]
        print("# RSS from cycle " + f"{rows[1][0]} to {rows[-1][0]}: "
              + ", ".join(f"rank {r} {b - a:+.1f} MiB" for r, (a, b) in enumerate(zip(first,
                                                                                      last))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
