"""Launch after launch, does one rank placement make one machine state?

On 4 ranks oversubscribed on this machine's 2 cores, the vendors' tables
(``vendors.py --ranks 4``) saw every arm's launches fall into a fast and a
slow state at 256 KiB and 2 MiB.  This alternates launches left to the
operating system's placement (``free``) and launches bound to cores
(``bound``: Open MPI ``--bind-to core:overload-allowed --map-by core``,
MPICH ``-bind-to core``) under each MPI wheel's environment that
``vendors.py`` makes, each launch one ``bench`` of the vendor's default
and two of ours at two sizes, and prints every launch's times in the order
they ran: a state that follows the placement shows in one column, one that
comes and goes with time shows in consecutive rows of both.  Run::

    python benchmarks/launch_states.py --mpis openmpi,mpich --launches 6 \\
        > benchmarks/results/launch-states-np4.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mpi_allreduce.launch import mpiexec_env, run  # noqa: E402
from vendors import WHEELS, environment  # noqa: E402

#: how each MPI's launcher binds ranks to cores, several to a core
BOUND = {"openmpi": ["--oversubscribe", "--bind-to", "core:overload-allowed", "--map-by", "core"],
         "mpich": ["-bind-to", "core"]}
FREE = {"openmpi": ["--oversubscribe"], "mpich": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpis", default="openmpi,mpich")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--launches", type=int, default=6, help="of each placement")
    parser.add_argument("--sizes", default="256K:2M", help="MIN:MAX, factor 8")
    parser.add_argument("--envs", default=str(ROOT / ".cache" / "vendors"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    args = parser.parse_args()
    low, high = args.sizes.split(":")
    print(f"$ python benchmarks/launch_states.py --mpis {args.mpis} --ranks {args.ranks} "
          f"--launches {args.launches} --sizes {args.sizes}")
    print("# us per call (medians of 3 interleaved repeats of 20 calls); launches in the "
          "order they ran, free and bound alternating")
    for name in args.mpis.split(","):
        if name not in BOUND:
            raise SystemExit(f"{name}: no binding known (choices: {', '.join(BOUND)})")
        bin_dir = environment(name, Path(args.envs))
        header = None
        for k in range(args.launches):
            for placement, flags in (("free", FREE[name]), ("bound", BOUND[name])):
                with tempfile.TemporaryDirectory() as where:
                    out = Path(where) / "bench.json"
                    command = [str(bin_dir / "mpiexec"), "-n", str(args.ranks), *flags,
                               str(bin_dir / "python"), "-m", "mpi_allreduce", "bench", "-b",
                               low, "-e", high, "-f", "8", "-n", "20", "-w", "10", "-r", "3",
                               "-a", "ring,recursive_doubling", "--quiet", "--json", str(out)]
                    result = run(command, args.timeout, env=mpiexec_env(args.timeout),
                                 cwd=str(ROOT))
                    if result.returncode:
                        raise SystemExit(f"{name} {placement} failed ({result.returncode}):\n"
                                         f"{result.stdout[-2000:]}")
                    data = json.loads(out.read_text())
                rows = data["results"] if isinstance(data, dict) else data
                cells = {(r["algorithm"], r["size"]): r["time_avg_us"] for r in rows}
                if header is None:
                    header = sorted(cells, key=lambda c: (c[1], c[0]))
                    print(f"# {name} ({WHEELS[name][0]} wheel), {args.ranks} ranks")
                    print(f"{'launch':>8} {'placement':>9} " + " ".join(
                        f"{a[:12] + '@' + str(s // 1024) + 'K':>22}" for a, s in header))
                print(f"{k + 1:>8} {placement:>9} " + " ".join(
                    f"{cells[c]:>22.1f}" for c in header), flush=True)


if __name__ == "__main__":
    main()
