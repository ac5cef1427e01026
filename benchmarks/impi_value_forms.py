"""Intel MPI's ``I_MPI_ADJUST_ALLREDUCE``: what the form of a value costs.

``tune --export impi`` wrote such a value, naming an algorithm for every
size range, until it wrote a JSON tuning file (``I_MPI_TUNING``), which can
also name Intel's compositions.  Intel's syntax also takes process ranges
(``<id>:<from>-<to>@<p>-<q>``).  This times Intel's default
``MPI_Allreduce`` and the same all-reduce under values of several forms
(one id; one id with ranges; several ids with and without process ranges;
the order of the entries), one launch per value, ``--rounds`` rounds
interleaved, and prints each launch's median per size: what the value's
form cost (``docs/tuning.md``).  Run::

    python benchmarks/impi_value_forms.py --ranks 4 > benchmarks/results/impi-value-forms-np4.txt

(the Intel MPI environment is ``benchmarks/vendors.py``'s, in ``.cache/vendors/impi``;
under mpiexec the script is its own probe, ``--probe``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = [8, 64, 512, 4096, 32768, 262144]
END = 2 ** 62


def values(p: int) -> list:
    """(label, value) of each form timed; "" is Intel's default."""
    three = [(10, 0, 92681), (2, 92682, 741455), (8, 741456, END)]
    return [
        ("default", ""),
        ("one id", "10"),
        ("one id, size range", "10:0-92681"),
        ("one id, size and process range", f"10:0-92681@{p}-{p}"),
        ("three ids", ";".join(f"{a}:{lo}-{hi}" for a, lo, hi in three)),
        ("three ids, process ranges", ";".join(f"{a}:{lo}-{hi}@{p}-{p}" for a, lo, hi in three)),
        ("three ids, the small sizes' last", ";".join(f"{a}:{lo}-{hi}" for a, lo, hi in
                                                     three[1:] + three[:1])),
        ("one id three times, process ranges", ";".join(f"10:{lo}-{hi}@{p}-{p}"
                                                        for _, lo, hi in three)),
    ]


def probe() -> None:
    """Under mpiexec: the median of 7 repeats of 50 calls per size, max over
    ranks, one line on rank 0."""
    import time

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    times = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        for _ in range(20):
            comm.Allreduce(x, y)
        repeats = []
        for _ in range(7):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(50):
                comm.Allreduce(x, y)
            repeats.append((time.perf_counter() - start) / 50)
        times.append(comm.allreduce(sorted(repeats)[3], op=MPI.MAX) * 1e6)
    if comm.rank == 0:
        print(" ".join(f"{t:9.1f}" for t in times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envs", default=str(ROOT / ".cache" / "vendors"))
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe()
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.vendors import environment
    from mpi_allreduce.launch import mpiexec_command, mpiexec_env, run

    bin_dir = environment("impi", Path(args.envs))
    command = mpiexec_command(args.ranks, [str(bin_dir / "python"), __file__, "--probe"],
                              mpiexec=str(bin_dir / "mpiexec"))
    print(f"# python benchmarks/impi_value_forms.py --ranks {args.ranks} --rounds {args.rounds}")
    print(f"# {args.ranks} ranks, float32 sum, MPI_Allreduce, median of 7 repeats of 50 calls "
          "(max over ranks), microseconds; one launch per line")
    print(f"# {'value':<40} " + " ".join(f"{s:>9}" for s in SIZES))
    for _ in range(args.rounds):
        for label, value in values(args.ranks):
            env = {"I_MPI_ADJUST_ALLREDUCE": value} if value else {}
            result = run(command, 120, env=mpiexec_env(120, env), cwd=str(ROOT))
            if result.returncode:
                raise SystemExit(f"{label} failed ({result.returncode}):\n{result.stdout[-2000:]}")
            line = [t for t in result.stdout.splitlines() if t.strip()
                    and all(c in "0123456789. " for c in t)][-1]
            print(f"  {label:<40} {line}", flush=True)
        print()
    print("# values:")
    for label, value in values(args.ranks):
        print(f"#   {label}: {value or '(unset)'}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
