#!/usr/bin/env python3
"""Regenerate benchmarks/results/: our algorithms against the vendor MPI_Allreduce.

    python benchmarks/run_targets.py [--ranks 2 4] [--maxbytes 16M] [--repeats 21] [--iters 300]

For each rank count (4 ranks on this 2-core machine are oversubscribed and
not pinned):
  1. one ``bench`` run with every algorithm, ``auto`` and ``mpi``
     (MPI.Allreduce), float32 SUM, 8 B .. 16 MiB, medians of interleaved
     repeats (the algorithms in a shuffled order each repeat), results
     checked (-c), scratch measured (--memory);
  2. under Open MPI, one run per forced vendor algorithm
     (coll_tuned_use_dynamic_rules=1, coll_tuned_allreduce_algorithm = 3
     recursive doubling, 4 ring, 6 rabenseifner), labelled mpi:<name>;
  3. a PNG of all of it, and summary-np<N>.md with the targets computed from
     run 1 alone (ratios side by side in one run): the ratio of the medians
     over repeats decides; "paired" is the median of the ratios taken
     repeat by repeat, which drift over the run does not move, with their
     quartiles; a verdict whose paired quartiles lie on both sides of the
     threshold is marked "within noise".

Run 1 sweeps every power of two from 8 B (``-f 2``), so the targets for
"1 MiB and more" are judged at every such size up to --maxbytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mpi_allreduce.launch import find_mpiexec, mpiexec_flavor, run_mpi  # noqa: E402
from mpi_allreduce.selection import choose  # noqa: E402
from mpi_allreduce.tools.bench import paired_ratios  # noqa: E402

VENDOR_FORCED = {3: "recursive_doubling", 4: "ring", 6: "rabenseifner"}


def bench(ranks, out: Path, args, extra, env=None, timeout=2400):
    cmd = [sys.executable, "-m", "mpi_allreduce", "bench", "-b", "8", "-e", args.maxbytes,
           "-f", "2", "-n", str(args.iters), "-w", "10", "-r", str(args.repeats), "--quiet",
           "--json", str(out)] + extra
    result = run_mpi(ranks, cmd, timeout=timeout, env_extra=env)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{result.stdout[-4000:]}")
    return result.stdout


def paired(numerator: dict, denominator: dict) -> tuple[float, float, float]:
    """Quartiles (q1, median, q3) of the ratio taken repeat by repeat (each
    repeat runs every algorithm at that size side by side)."""
    middle, q1, q3 = paired_ratios(numerator["repeats_avg_us"], denominator["repeats_avg_us"])
    return q1, middle, q3


def verdict(name: str, size: int, ratio: float, spread: tuple, limit: float) -> tuple:
    """(target, size, met, ratio, paired quartiles, clear): ``clear`` when the
    paired quartiles lie on the verdict's side of ``limit``."""
    met = ratio <= limit
    clear = spread[2] <= limit if met else spread[0] > limit
    return name, size, met, ratio, spread, clear


def summary(path: Path, ranks: int) -> str:
    doc = json.loads(path.read_text())
    rows = doc["results"]
    sizes = sorted({r["size"] for r in rows})
    ours = [r for r in rows if r["algorithm"] not in ("mpi", "auto")]
    lines = [f"## {ranks} ranks: targets (float32 SUM, from one run: {path.name})", "",
             "| size (B) | mpi (us) | best of ours | best (us) | best/mpi | paired | auto picks "
             "| auto (us) | auto/best | paired |",
             "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    verdicts = []
    for size in sizes:
        at = {r["algorithm"]: r for r in rows if r["size"] == size}
        best = min((r for r in ours if r["size"] == size), key=lambda r: r["time_avg_us"])
        mpi, auto = at["mpi"]["time_avg_us"], at["auto"]["time_avg_us"]
        b = best["time_avg_us"]
        picks = at["auto"].get("runs") or choose(size, ranks)
        if at["auto"].get("moves"):
            picks += f" ({at['auto']['moves']} moves)"
        vs_mpi, vs_best = paired(best, at["mpi"]), paired(at["auto"], best)
        lines.append(f"| {size} | {mpi:.1f} | {best['algorithm']} | {b:.1f} | {b / mpi:.2f} | "
                     f"{vs_mpi[1]:.2f} | {picks} | {auto:.1f} | {auto / b:.2f} | "
                     f"{vs_best[1]:.2f} |")
        if size >= 1 << 20:
            verdicts.append(verdict("best of ours <= vendor", size, b / mpi, vs_mpi, 1.0))
        verdicts.append(verdict("auto within 10% of best of ours", size, auto / b, vs_best,
                                1.10))
        if size == 8:
            verdicts.append(verdict("8 B auto <= 3x vendor", size, auto / mpi,
                                    paired(at["auto"], at["mpi"]), 3.0))
    met = sum(v[2] for v in verdicts)
    lines += ["", f"Targets met: {met} of {len(verdicts)}.  \"met\" is decided by the ratio of "
              "the medians; \"paired q1–q3\" are the quartiles of the same ratio taken repeat "
              "by repeat, and a verdict is \"within noise\" when they lie on both sides of "
              "the threshold.", "",
              "| target | size (B) | met | ratio | paired q1–q3 | |", "|---|---:|---|---:|---|---|"]
    lines += [f"| {name} | {size} | {'yes' if ok else '**no**'} | {ratio:.2f} | "
              f"{spread[0]:.2f}–{spread[2]:.2f} | {'' if clear else 'within noise'} |"
              for name, size, ok, ratio, spread, clear in verdicts]
    biggest = max(sizes)
    lines += ["", f"Scratch held by each plan at {biggest} B ({biggest // ranks} B = n/p), and "
              "bytes allocated during a steady-state call (tracemalloc):", "",
              "| algorithm | scratch (B) | scratch / (n/p) | steady-state allocation (B) |",
              "|---|---:|---:|---:|"]
    for r in rows:
        if r["size"] == biggest and r.get("scratch_bytes") is not None:
            lines.append(f"| {r['algorithm']} | {r['scratch_bytes']} | "
                         f"{r['scratch_bytes'] / (biggest / ranks):.2f} | {r['steady_alloc_bytes']} |")
    wrong = sum(r["wrong"] or 0 for r in rows)
    lines += ["", f"#wrong over all rows: {wrong}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--maxbytes", default="16M")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--iters", type=int, default=300,
                        help="timed iterations per size and repeat (fewer above 1 MiB)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    openmpi = mpiexec_flavor(find_mpiexec() or "mpiexec") == "openmpi"
    for ranks in args.ranks:
        main_json = out / f"bench-np{ranks}.json"
        table = bench(ranks, main_json, args, ["-c", "--memory"])
        (out / f"bench-np{ranks}.txt").write_text(table)
        inputs = [main_json]
        if openmpi:
            for number, name in VENDOR_FORCED.items():
                path = out / f"vendor-{name}-np{ranks}.json"
                bench(ranks, path, args, ["-a", "mpi", "--label-vendor", f"mpi:{name}"],
                      env={"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                           "OMPI_MCA_coll_tuned_allreduce_algorithm": str(number)})
                inputs.append(path)
        from mpi_allreduce.tools.plot import plot

        plot([str(p) for p in inputs], str(out / f"bench-np{ranks}.png"),
             f"float32 SUM, {ranks} ranks on 2 cores"
             f"{' (oversubscribed, not pinned)' if ranks > 2 else ''}; grey/black: MPI_Allreduce")
        (out / f"summary-np{ranks}.md").write_text(summary(main_json, ranks))
        print((out / f"summary-np{ranks}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
