"""What a reproducible sum costs against the plain sum, side by side.

Per size and dtype, three calls on the same buffers in interleaved repeats
(a shuffled order per repeat, the same on every rank), each batch the
slowest rank's mean after a warm-up:

* ``plain``: ``allreduce(x, op="sum")`` (``auto``);
* ``reproducible``: ``allreduce(x, op="sum", reproducible=True)``, its
  passes over memory numba's fused loops where numba is installed;
* ``numpy passes``: the same with ``MPI_ALLREDUCE_KERNELS=numpy`` (the
  same bytes; "-" where numba is missing, as the first column is then this);
* ``wire``: the reproducible sum's two all-reduces alone, as plain calls on
  arrays of their shapes (a MAX of int16 exponents, a SUM of int64 slices):
  what it costs on the wire, without its passes over memory;
* ``vendor``: ``MPI.Allreduce`` of the MPI library.

Ratios to ``plain`` are taken per repeat (median, q1-q3).  It also
reports whether the plain sum's bytes differ between the ring and
recursive doubling on this data (they do from 3 ranks on: the problem
the reproducible sum solves) and that the reproducible ones do not.  Run::

    mpiexec -n 4 --oversubscribe python benchmarks/reproducible.py > benchmarks/results/reproducible-np4.txt
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
from statistics import median

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config
from mpi_allreduce.reproducible import slices_for
from mpi_allreduce.tools.bench import batch_mean_us, paired_ratios, repeat_order
from mpi_allreduce.tools.verify import mpi_library

SIZES = [8, 1024, 64 * 1024, 1 << 20, 16 << 20]


def use_kernels(choice: str) -> None:
    """The reproducible sum's passes from now on (``MPI_ALLREDUCE_KERNELS``)."""
    os.environ[config.KERNELS_ENV] = choice
    config.refresh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-r", "--repeats", type=int, default=9)
    parser.add_argument("-d", "--dtypes", default="float64,float32")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    rank, p = comm.Get_rank(), comm.Get_size()
    fused = importlib.util.find_spec("numba") is not None
    if rank == 0:
        passes = f"numba {importlib.metadata.version('numba')}" if fused else "numpy (no numba)"
        print(f"# reproducible sum against the plain sum, {p} ranks; {args.repeats} interleaved "
              f"repeats; passes: {passes}; {mpi_library()}; {platform.node()}, "
              f"{platform.machine()}")
        print(f"# {'dtype':>8} {'bytes':>10} {'plain us':>10} {'repro us':>10} {'x plain':>8} "
              f"{'q1-q3':>14} {'numpy us':>9} {'x plain':>8} {'wire us':>9} {'x plain':>8} "
              f"{'vendor us':>10}  "
              f"plain bytes differ ring/rd | repro differ")
    for dtype in args.dtypes.split(","):
        for nbytes in SIZES:
            count = max(1, nbytes // np.dtype(dtype).itemsize)
            rng = np.random.default_rng([rank, count])
            x = (rng.normal(size=count) * 10.0 ** rng.integers(-6, 6, count)).astype(dtype)
            out = np.empty_like(x)
            e, e_all = np.ones(count, np.int16), np.empty(count, np.int16)
            parts = np.ones(count * slices_for(dtype), np.int64)
            total = np.empty_like(parts)

            def wire():
                mar.allreduce(e, e_all, "max", comm=comm)
                mar.allreduce(parts, total, comm=comm)
            calls = {
                "plain": lambda: mar.allreduce(x, out, comm=comm),
                "reproducible": lambda: mar.allreduce(x, out, comm=comm, reproducible=True),
                "wire": wire,
                "vendor": lambda: comm.Allreduce(x, out, MPI.SUM),
            }
            if fused:
                calls["numpy passes"] = calls["reproducible"]
            iters = max(3, min(2000, (64 << 20) // (nbytes * 8)))
            times = {name: [] for name in calls}
            for repeat in range(args.repeats):
                for name in repeat_order(list(calls), nbytes, repeat):
                    use_kernels("numpy" if name == "numpy passes" else "auto")
                    times[name].append(batch_mean_us(comm, calls[name], iters,
                                                     max(1, iters // 10)))
            plain = {mar.allreduce(x, comm=comm, algorithm=a).tobytes()
                     for a in ("ring", "recursive_doubling")}
            repro = {mar.allreduce(x, comm=comm, algorithm=a, reproducible=True).tobytes()
                     for a in ("ring", "recursive_doubling")}
            if rank == 0:
                ratio, q1, q3 = paired_ratios(times["reproducible"], times["plain"])
                numpy_us, numpy_ratio = ("-", "-") if not fused else (
                    f"{median(times['numpy passes']):.1f}",
                    f"{paired_ratios(times['numpy passes'], times['plain'])[0]:.2f}")
                wire_ratio = paired_ratios(times["wire"], times["plain"])[0]
                print(f"  {dtype:>8} {count * np.dtype(dtype).itemsize:10d} "
                      f"{median(times['plain']):10.1f} {median(times['reproducible']):10.1f} "
                      f"{ratio:8.2f} {q1:6.2f} - {q3:<6.2f} {numpy_us:>9} {numpy_ratio:>8} "
                      f"{median(times['wire']):9.1f} {wire_ratio:8.2f} "
                      f"{median(times['vendor']):10.1f}  "
                      f"{'yes' if len(plain) > 1 else 'no':>25} | "
                      f"{'yes' if len(repro) > 1 else 'no'}")
    comm.Free()


if __name__ == "__main__":
    main()
