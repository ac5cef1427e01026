"""Predictions of the simulator's network model against published measurements.

    python benchmarks/published/check.py [--only lumi,...]

For each machine description here (lumi, leonardo, marenostrum5: the
machine's documentation; fugaku-<shape>: a job's torus) it runs

    python -m mpi_allreduce simulate --params NAME.json --measured NAME.csv -d int32 \
        --fit-on recursive_doubling,rabenseifner --json ...

and keeps its output in benchmarks/results/published/NAME.txt (and .json):
alpha_inter, beta_inter and gamma fitted on recursive doubling's and
Rabenseifner's rows, every other algorithm's rows predicted and judged.
Fugaku's jobs each had a torus of their own shape and only some ran
recursive doubling and Rabenseifner on one interface: the machine is
fitted once, on the 4x4x4 job's rows, and that fitted machine predicts
every other shape's rows (recursive doubling's and Rabenseifner's
included, there).  Then it writes summary.md: per table, the rows judged,
the share within 25% and the median ratio, per algorithm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "published"
FIT_ON = "recursive_doubling,rabenseifner"
TABLES = ("lumi", "leonardo", "marenostrum5", "fugaku-4x4x4", "fugaku-2x2x2", "fugaku-8x8x8",
          "fugaku-64x64", "fugaku-32x256")
#: Fugaku's shapes are predicted with the machine fitted on this one
FUGAKU_FIT = "fugaku-4x4x4"


def run(name: str, params: Path, fit: bool) -> dict:
    root = HERE.parent.parent  # (the commands run there: paths relative to it)
    within = params.is_relative_to(root)
    command = [sys.executable, "-m", "mpi_allreduce", "simulate",
               "--params", str(params.relative_to(root) if within else params),
               "--measured", str((HERE / f"{name}.csv").relative_to(root)), "-d", "int32",
               "--json", str((OUT / f"{name}.json").relative_to(root))] + (
                   ["--fit-on", FIT_ON] if fit else [])
    shown = ["python", "-m", "mpi_allreduce"] + command[3:]
    if not within:
        shown[shown.index("--params") + 1] = f"({name}.json with {FUGAKU_FIT}'s fit)"
    print("$", " ".join(shown), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=root)
    if done.returncode:
        raise SystemExit(f"{name}: {done.stderr[-3000:]}")
    (OUT / f"{name}.txt").write_text(done.stdout)
    return json.loads((OUT / f"{name}.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(TABLES),
                        help="comma-separated tables (default: all; summary.md keeps the "
                             "others' results from their earlier runs)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in filter(None, args.only.split(",")):
        if name.startswith("fugaku") and name != FUGAKU_FIT:
            fitted = json.loads((OUT / f"{FUGAKU_FIT}.json").read_text())
            description = json.loads((HERE / f"{name}.json").read_text())
            description["params"] = fitted["params"]
            description["fitted_on"] = f"{FUGAKU_FIT}'s rows of {FIT_ON}"
            with tempfile.TemporaryDirectory() as tmp:
                params = Path(tmp) / f"{name}.json"
                params.write_text(json.dumps(description))
                results[name] = run(name, params, fit=False)
        else:
            results[name] = run(name, HERE / f"{name}.json", fit=True)
    lines = ["# Predictions against published measurements",
             "",
             "Made by `python benchmarks/published/check.py` (the simulator only, no MPI; "
             "tables and machine descriptions in benchmarks/published/). Rows judged: not "
             "fitted on, simulated. Within: |predicted / measured - 1| <= 25%.",
             "",
             "| table | algorithm | judged | within 25% | share | median ratio |",
             "|---|---|---|---|---|---|"]
    # (every table's latest results, those of an earlier --only run too)
    for name in TABLES:
        made = OUT / f"{name}.json"
        if name not in results and not made.exists():
            continue
        result = results.get(name) or json.loads(made.read_text())
        for entry in result["summary"]:
            if not entry["judged"]:
                continue
            share = entry["within"] / entry["judged"]
            lines.append(f"| {name} | {entry['algorithm']} | {entry['judged']} | "
                         f"{entry['within']} | {share:.0%} | {entry['median_ratio']:.2f} |")
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
