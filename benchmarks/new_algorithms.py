"""The algorithms of 2024-2026 against our earlier best and the vendor, side by side.

Swing, Bine, recursive multiplying, k-nomial, the 2D torus and
allgather-then-reduce win on real networks by where their messages go
(hop distances on a torus, bytes on a Dragonfly's global links).  On one
machine every message crosses the same shared memory, so their gains
cannot show here: this benchmark says where each stands, on this machine,
against the best of the algorithms we had before them and against the
vendor's ``MPI.Allreduce``, measured in the same launch (one ``bench`` per
rank count: every algorithm and the vendor on the same buffers, in a
shuffled order per repeat, medians, ``#wrong`` counted).  The network's
side is the simulator's (``python -m mpi_allreduce simulate``).

Per rank count it writes ``PREFIX-np<N>.json`` (bench's own results) and
one table over all of them, ``PREFIX.md``.  Run::

    python benchmarks/new_algorithms.py --out benchmarks/results/new-algorithms

(2, 4 and 8 ranks, 8 B to 2 MiB; a few minutes here.)
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpi_allreduce.launch import run_mpi  # noqa: E402
from mpi_allreduce.registry import ALGORITHMS, FLAT_ALGORITHMS  # noqa: E402
from mpi_allreduce.tools.bench import load_results  # noqa: E402

#: the algorithms this benchmark is about (those of them registered)
NEW = ("swing_latency", "swing_bandwidth", "bine_latency", "bine_bandwidth",
       "recursive_multiplying", "knomial", "torus", "allgather_reduce")


def algorithms() -> tuple[list, list]:
    """(the new ones, the earlier candidates of ``auto``), from the registry."""
    new = [a for a in NEW if a in ALGORITHMS]
    old = [a for a in FLAT_ALGORITHMS if a not in NEW]
    return new, old


def measure(ranks: int, args, new: list, old: list) -> tuple:
    out = f"{args.out}-np{ranks}.json"
    tool = ["bench", "-a", ",".join(new + old), "-b", args.minbytes, "-e", args.maxbytes,
            "-f", str(args.stepfactor), "-n", str(args.iters), "-r", str(args.repeats), "-c",
            "--quiet", "--json", out]
    result = run_mpi(ranks, [sys.executable, "-m", "mpi_allreduce"] + tool, timeout=args.timeout,
                     cwd=str(ROOT))
    if result.returncode:
        raise SystemExit(f"{ranks} ranks failed ({result.returncode}):\n{result.stdout[-3000:]}")
    results, metas = load_results([out])
    return results, metas[0]


def table(runs: dict, new: list) -> str:
    """Per rank count and size: the vendor, our earlier best, each new
    algorithm's time over that best, the best new one over the vendor."""
    head = ["ranks", "size (B)", "vendor (us)", "earlier best (us)", "earlier best"] \
        + [f"{a}/earlier" for a in new] + ["best new", "best new/vendor", "#wrong"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for ranks, (results, _) in runs.items():
        by_size, wrong = defaultdict(dict), defaultdict(int)
        for r in results:
            by_size[r["size"]][r["algorithm"]] = r["time_avg_us"]
            wrong[r["size"]] += int(r.get("wrong") or 0)
        for size in sorted(by_size):
            times = by_size[size]
            vendor = times["mpi"]
            earlier = {a: t for a, t in times.items() if a not in new and a != "mpi"}
            best_old = min(earlier, key=earlier.get)
            ours = {a: times[a] for a in new if a in times}
            best_new = min(ours, key=ours.get)
            lines.append("| " + " | ".join(
                [str(ranks), str(size), f"{vendor:.1f}", f"{earlier[best_old]:.1f}", best_old]
                + [f"{ours[a] / earlier[best_old]:.2f}" if a in ours else "-" for a in new]
                + [best_new, f"{ours[best_new] / vendor:.2f}", str(wrong[size])]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts")
    parser.add_argument("-b", "--minbytes", default="8")
    parser.add_argument("-e", "--maxbytes", default="4M")
    parser.add_argument("-f", "--stepfactor", type=int, default=8)
    parser.add_argument("-n", "--iters", type=int, default=200)
    parser.add_argument("-r", "--repeats", type=int, default=11)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", default="benchmarks/results/new-algorithms")
    args = parser.parse_args()
    new, old = algorithms()
    if not new:
        raise SystemExit("none of the algorithms of this benchmark is registered")
    runs = {}
    for ranks in (int(r) for r in args.ranks.split(",")):
        print(f"# {ranks} ranks ...", flush=True)
        runs[ranks] = measure(ranks, args, new, old)
    meta = next(iter(runs.values()))[1]
    text = "\n".join([
        "# The algorithms of 2024-2026 on this machine",
        "",
        f"Produced by `python benchmarks/new_algorithms.py --ranks {args.ranks} -b "
        f"{args.minbytes} -e {args.maxbytes} -f {args.stepfactor} -n {args.iters} -r "
        f"{args.repeats} --out {args.out}` on {meta.get('machine') or platform.machine()}; "
        "ranks beyond the cores oversubscribed; "
        f"{meta['mpi_library'].splitlines()[0]}.",
        "",
        "One `bench` launch per rank count: every algorithm below and the vendor's "
        "`MPI.Allreduce` on the same buffers, in a shuffled order per repeat, the median of "
        f"{args.repeats} repeats of {args.iters} calls (fewer above 1 MiB), the slowest rank's "
        "time; float32 sum, out of place. `earlier best`: the fastest of the algorithms `auto` "
        f"chose among before these ({', '.join(old)}); `X/earlier`: X's time over it (below 1: "
        "X is faster here). `#wrong`: wrong elements over every row of that size.",
        "",
        "One machine: every message crosses the same shared memory, so a schedule's "
        "advantage in where its messages go (hop distance on a torus, global links of a "
        "Dragonfly) cannot show here; what shows is each schedule's count of rounds and "
        "bytes. Their gains on networks are the simulator's to show.",
        "",
        table(runs, new),
        "",
    ])
    Path(f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
