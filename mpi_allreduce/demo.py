"""The main job: ``python -m mpi_allreduce.demo [-n 4]``.

Runs ``verify`` on N ranks, then a short side-by-side timing of every
algorithm and ``MPI.Allreduce``, each under ``mpiexec`` with a time limit.
This process itself never initialises MPI (it only launches mpiexec).
"""

from __future__ import annotations

import argparse
import sys

from .launch import find_mpiexec, run_mpi


#: (what it shows, the tool's arguments): the main job's steps
STEPS = (
    ("verify: every algorithm against MPI.Allreduce", ["verify"]),
    ("bench: float32 sum, 8 B to 16 MiB, side by side with MPI.Allreduce",
     ["bench", "-b", "8", "-e", "16M", "-f", "8", "-n", "10", "-w", "3", "-c", "--quiet"]),
)


def typed(ranks: int = 4, timeout: int = 900) -> list[str]:
    """The steps as a user types them (the README lists these; a test checks
    that it does): Open MPI's ``mpiexec`` with the time limit the demo sets."""
    return [f"mpiexec -n {ranks} --oversubscribe --timeout {timeout} python -m mpi_allreduce "
            + " ".join(cmd) for _, cmd in STEPS]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpi_allreduce.demo", description=__doc__)
    parser.add_argument("-n", "--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mpiexec")
    args = parser.parse_args(argv)
    if find_mpiexec() is None:
        print("no mpiexec found: pip install 'mpi_allreduce[mpi]' or load your MPI module",
              file=sys.stderr)
        return 2
    for (title, cmd), line in zip(STEPS, typed(args.ranks, args.timeout)):
        print(f"\n== {line}\n   ({title})", flush=True)
        result = run_mpi(args.ranks, [sys.executable, "-m", "mpi_allreduce"] + cmd,
                         timeout=args.timeout)
        print(result.stdout, end="", flush=True)
        if result.returncode != 0:
            print(f"failed with exit status {result.returncode}", file=sys.stderr)
            return result.returncode or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
