"""Make the pictures the README and the docs show, with the package's own commands.

* ``python -m mpi_allreduce draw``: the ring, recursive doubling,
  hierarchical, double binary tree, Swing, Bine, recursive multiplying,
  k-nomial and 2D torus all-reduce, round by round (and the ring as an
  animated GIF);
* a real traced run next to its prediction: ``bench --trace`` of the ring
  at 64 KiB on 4 ranks under ``mpiexec``, ``simulate --trace`` of the same
  call on the machine ``model`` fitted here
  (``benchmarks/results/model-np4-1.json``), and ``report --against``
  drawing the last real call beside the predicted one.

Run from the repository root (the traced run needs ``mpiexec``; it is
skipped with ``--no-mpi``)::

    python docs/make_pictures.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "_static"
sys.path.insert(0, str(ROOT))

#: (algorithm, ranks, extra arguments) of the pictures
PICTURES = (
    ("ring", 4, []),
    ("recursive_doubling", 8, []),
    ("hierarchical", 6, ["--ranks-per-node", "3"]),
    ("double_binary_tree", 6, []),
    ("swing_bandwidth", 8, []),
    ("bine_bandwidth", 8, []),
    ("recursive_multiplying", 9, ["--radix", "3"]),
    ("knomial", 9, ["--radix", "3"]),
    ("torus", 6, ["--row-size", "3"]),
)


def package(*args: str) -> None:
    command = [sys.executable, "-m", "mpi_allreduce", *args]
    print("$", " ".join(["python", "-m", "mpi_allreduce", *args]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-mpi", action="store_true", help="the drawings only")
    args = parser.parse_args()
    (OUT / "draw").mkdir(parents=True, exist_ok=True)
    for algorithm, size, extra in PICTURES:
        package("draw", "-a", algorithm, "-p", str(size), *extra,
                "-o", str((OUT / "draw" / f"{algorithm}-p{size}.png").relative_to(ROOT)))
    package("draw", "-a", "ring", "-p", "4", "-o", "docs/_static/draw/ring-p4.gif")
    if args.no_mpi:
        return
    from mpi_allreduce.launch import run_mpi

    trace_dir = OUT / "trace"
    trace_dir.mkdir(parents=True, exist_ok=True)
    bench = [sys.executable, "-m", "mpi_allreduce", "bench", "-a", "ring", "-b", "64K",
             "-e", "64K", "-n", "5", "-w", "2", "--quiet", "--trace",
             str(trace_dir.relative_to(ROOT))]
    print("$ mpiexec -n 4 " + " ".join(["python"] + bench[1:]), flush=True)
    result = run_mpi(4, bench, timeout=600, cwd=str(ROOT))
    if result.returncode:
        raise SystemExit(result.stdout[-3000:])
    (trace_dir / "trace.json").replace(trace_dir / "ring-np4-64k.json")
    package("simulate", "-a", "ring", "-p", "4", "--count", "16384", "--params",
            "benchmarks/results/model-np4-1.json", "--trace",
            "docs/_static/trace/ring-np4-64k-simulated.json")
    package("report", "docs/_static/trace/ring-np4-64k.json", "--against",
            "docs/_static/trace/ring-np4-64k-simulated.json",
            "-o", "docs/_static/trace/ring-np4-64k-report.png")


if __name__ == "__main__":
    main()
