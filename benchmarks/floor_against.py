"""The latency floor of this checkout against an earlier commit's, launch by launch.

Two versions of the library cannot share a process, so this alternates
launches: ``benchmarks/floor.py`` (8 B, 2 ranks) from a git worktree of
``--base`` and from this checkout, ``--launches`` times each, and prints
every launch's ratios to the floor side by side, then the medians over the
launches.  Each launch's ratios are measured side by side within it (the
floor is in every launch), so they are comparable across launches even
when the machine's speed drifts.  Run::

    python benchmarks/floor_against.py --base d0a04ac > benchmarks/results/floor-against-np2.txt
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpi_allreduce.launch import run_mpi  # noqa: E402


def launch(tree: Path, ranks: int) -> dict:
    """{call: ratio to the floor} of one floor.py launch from ``tree``."""
    result = run_mpi(ranks, [sys.executable, str(tree / "benchmarks" / "floor.py")],
                     timeout=600, cwd=str(tree), env_extra={"PYTHONPATH": str(tree)})
    if result.returncode:
        raise SystemExit(f"floor.py failed in {tree}:\n{result.stdout[-3000:]}")
    rows = re.findall(r"^\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+ - [\d.]+", result.stdout, re.M)
    return {name: float(ratio) for name, _, ratio in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("-n", "--ranks", type=int, default=2)
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-f", "--detach", str(base), args.base],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            runs = {"base": [], "head": []}
            for _ in range(args.launches):
                runs["base"].append(launch(base, args.ranks))
                runs["head"].append(launch(ROOT, args.ranks))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)
    calls = list(runs["head"][0])
    print(f"# 8 B float32 SUM on {args.ranks} ranks, benchmarks/floor.py per launch "
          f"(31 repeats of 2000 calls); base {args.base} and this checkout {head} "
          f"alternated {args.launches} times; {os.uname().nodename}")
    print("# ratio to the floor measured in each launch (median over its repeats)")
    print(f"# {'call':>20} " + " ".join(f"{'base':>6} {'head':>6}" for _ in runs["base"])
          + f"   {'median base':>11} {'median head':>11} {'head/base':>9}")
    for call in calls:
        if call not in runs["base"][0]:  # a call the base does not time
            pairs = " ".join(f"{'-':>6} {h[call]:6.2f}" for h in runs["head"])
            mh = median(h[call] for h in runs["head"])
            print(f"  {call:>20} {pairs}   {'-':>11} {mh:11.2f} {'-':>9}")
            continue
        pairs = " ".join(f"{b[call]:6.2f} {h[call]:6.2f}" for b, h in zip(runs["base"],
                                                                        runs["head"]))
        mb = median(b[call] for b in runs["base"])
        mh = median(h[call] for h in runs["head"])
        print(f"  {call:>20} {pairs}   {mb:11.2f} {mh:11.2f} {mh / mb:9.3f}")


if __name__ == "__main__":
    main()
