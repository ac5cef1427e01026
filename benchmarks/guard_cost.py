"""What the always-on guards cost at 8 B: the tag fingerprint and the watchdog.

Side by side in one run, recursive doubling on 8 B (float32 SUM), the same
buffers, in interleaved repeats (a shuffled order per repeat, the same on
every rank), each batch ``--iters`` calls after a warm-up, the slowest
rank's mean:

* ``bare``: one fixed tag, watchdog off (the library before the guards);
* ``tags``: tags from the call's fingerprint, watchdog off;
* ``default``: tags and the watchdog (abort after 600 s: a monitor thread
  samples a call counter), as shipped.

Each configuration is switched with :func:`mpi_allreduce.config.refresh`
(its plans and kept calls are rebuilt in the warm-up).  Ratios to ``bare``
are taken per repeat.  Run::

    mpiexec -n 2 python benchmarks/guard_cost.py > benchmarks/results/guard-cost-np2.txt
"""

from __future__ import annotations

import argparse
import os
import platform
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config, executor
from mpi_allreduce.tools.bench import batch_mean_us, paired_ratios, repeat_order
from mpi_allreduce.tools.verify import mpi_library

CONFIGS = {"bare": (False, "0"), "tags": (True, "0"), "default": (True, None)}


def use(name: str) -> None:
    guard, watchdog = CONFIGS[name]
    executor.TAG_GUARD = guard
    if watchdog is None:
        os.environ.pop(config.WATCHDOG_ENV, None)
    else:
        os.environ[config.WATCHDOG_ENV] = watchdog
    config.refresh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--iters", type=int, default=2000)
    parser.add_argument("-r", "--repeats", type=int, default=21)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    send = np.full(2, comm.Get_rank() + 1, np.float32)
    recv = np.empty_like(send)

    def call():
        mar.allreduce(send, recv, MPI.SUM, comm=comm, algorithm="recursive_doubling")

    names = list(CONFIGS)
    times = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in repeat_order(names, 8, repeat):
            use(name)
            times[name].append(batch_mean_us(comm, call, args.iters, 200))
    assert np.all(recv == comm.Get_size() * (comm.Get_size() + 1) / 2)
    if comm.Get_rank() == 0:
        print(f"# 8 B float32 SUM, recursive doubling, {comm.Get_size()} ranks; {args.repeats} "
              f"repeats of {args.iters} calls; {mpi_library()}; {platform.node()}")
        print(f"# {'config':>8} {'median us':>10} {'x bare':>7} {'q1-q3 (per repeat)':>20}")
        for name in names:
            ratio, q1, q3 = paired_ratios(times[name], times["bare"])
            print(f"  {name:>8} {median(times[name]):10.2f} {ratio:7.3f} "
                  f"{q1:9.3f} - {q3:<8.3f}")
    comm.Free()


if __name__ == "__main__":
    main()
