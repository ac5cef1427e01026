"""The main job: ``python -m mpi_allreduce.demo [-n 4]``.

Runs ``verify`` on N ranks, then a short side-by-side timing of every
algorithm and ``MPI.Allreduce``, each under ``mpiexec`` with a time limit.
This process itself never initialises MPI (it only launches mpiexec).
"""

from __future__ import annotations

import argparse
import sys

from .launch import find_mpiexec, run_mpi


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpi_allreduce.demo", description=__doc__)
    parser.add_argument("-n", "--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mpiexec")
    args = parser.parse_args(argv)
    if find_mpiexec() is None:
        print("no mpiexec found: pip install 'mpi_allreduce[mpi]' or load your MPI module",
              file=sys.stderr)
        return 2
    steps = [
        ("verify: every algorithm against MPI.Allreduce",
         ["verify"]),
        ("bench: float32 sum, 8 B to 16 MiB, side by side with MPI.Allreduce",
         ["bench", "-b", "8", "-e", "16M", "-f", "8", "-n", "10", "-w", "3", "-c", "--quiet"]),
    ]
    for title, cmd in steps:
        print(f"\n== mpiexec -n {args.ranks} python -m mpi_allreduce {' '.join(cmd)}\n   ({title})",
              flush=True)
        result = run_mpi(args.ranks, [sys.executable, "-m", "mpi_allreduce"] + cmd,
                         timeout=args.timeout)
        print(result.stdout, end="", flush=True)
        if result.returncode != 0:
            print(f"failed with exit status {result.returncode}", file=sys.stderr)
            return result.returncode or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
