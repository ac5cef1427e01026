#!/usr/bin/env python3
"""The cost model's check on this machine: ``model`` in several launches.

    python benchmarks/model_check.py [--ranks 2,4] [--launches 3] [--iters 100]

Each launch is a fresh ``mpiexec -n P python -m mpi_allreduce model`` (the
machine's state differs between launches: see docs/tuning.md), writing
``benchmarks/results/model-npP-L.txt`` and ``.json``.  Then it prints, and
writes to ``benchmarks/results/model-check.md``, per launch the share of
(algorithm, size) points predicted within 25% and how often the model
picked the measured fastest algorithm.  The emulated hosts' check is
``sudo python benchmarks/emulated_hosts.py model``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def launch(ranks: int, index: int, iters: int, timeout: int) -> dict:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
    stem = RESULTS / f"model-np{ranks}-{index}"
    cmd = [mpiexec, "--timeout", str(timeout), "-n", str(ranks)]
    cmd += ["--oversubscribe"] if ranks > (os.cpu_count() or 1) else []
    cmd += [sys.executable, "-m", "mpi_allreduce", "model", "-n", str(iters),
            "--json", str(stem.with_suffix(".json"))]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
    stem.with_suffix(".txt").write_text(f"$ {' '.join(cmd[:1] + cmd[3:])}\n" + out.stdout
                                        + out.stderr[-2000:])
    if out.returncode:
        raise SystemExit(f"launch {index} on {ranks} ranks failed:\n{out.stderr[-2000:]}")
    data = json.loads(stem.with_suffix(".json").read_text())
    rows = data["rows"]
    return {"ranks": ranks, "launch": index, "within": sum(r["within"] for r in rows),
            "points": len(rows), "picked": data["picked"], "sizes": data["sizes"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args()
    lines = ["| ranks | launch | within ±25% | picked the fastest |", "|---|---|---|---|"]
    for ranks in (int(r) for r in args.ranks.split(",")):
        for index in range(1, args.launches + 1):
            r = launch(ranks, index, args.iters, args.timeout)
            share = f"{r['within']} of {r['points']} ({r['within'] / r['points']:.0%})"
            lines.append(f"| {ranks} | {index} | {share} | {r['picked']} of {r['sizes']} sizes |")
            print(lines[-1], flush=True)
    text = ("# The cost model's check on this machine\n\n"
            f"`python benchmarks/model_check.py --ranks {args.ranks} --launches {args.launches} "
            f"--iters {args.iters}`; per launch `model-np<ranks>-<launch>.txt/json`.\n\n"
            + "\n".join(lines) + "\n")
    (RESULTS / "model-check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
