"""``python -m mpi_allreduce tune``: measure, and write the decision table ``auto`` uses.

For the running communicator size, every flat algorithm is timed at each
message size (medians of interleaved repeats); the fastest wins the size,
neighbouring sizes with the same winner merge into one row, and a boundary
between two measured sizes sits at their geometric mean.  Timings on a
shared machine are noisy, so any algorithm within ``tolerance`` (10%) of
the fastest may win a size, and the table is the one with the fewest rows
that keeps every size within it (:func:`pick_winners`): it does not flip
between algorithms that are equally fast.

With no ``-o`` the table goes where ``auto`` finds it by itself: the file of
:func:`~mpi_allreduce.selection.calibration_path`, one per MPI library,
machine and ranks per node, merged with the rules already there for other
communicator sizes.  A file named with ``-o`` is loaded with
``allreduce(..., tuning=path)`` or ``MPI_ALLREDUCE_TUNING=path``.
"""

from __future__ import annotations

import json
import math
import os

from .arguments import unwritable
from .bench import bench, metadata
from ..context import context_for
from ..registry import candidates
from ..selection import calibration_key, calibration_path, check_tuning


def decision_rows(winners: list[tuple[int, str]]) -> list[dict]:
    """[(size, fastest algorithm)] sorted by size -> rows with max_bytes."""
    rows = []
    for i, (size, name) in enumerate(winners):
        if rows and rows[-1]["algorithm"] == name:
            rows[-1]["max_bytes"] = None
        else:
            rows.append({"max_bytes": None, "algorithm": name})
        if i + 1 < len(winners):
            rows[-1]["max_bytes"] = int(math.sqrt(size * winners[i + 1][0]))
    rows[-1]["max_bytes"] = None
    return rows


def pick_winners(timings: list[tuple[int, str, float]], tolerance: float = 0.1):
    """[(size, algorithm, time)] -> [(size, winner)].

    Every size gets an algorithm within ``tolerance`` of its fastest there;
    among those, the previous size's while it qualifies, else the one that
    qualifies for the most sizes from here on (ties: the faster here).  This
    greedy cover gives the fewest rows of any table within the tolerance, so
    a noisy win at one size does not make a row of its own."""
    sizes = sorted({t[0] for t in timings})
    at = {size: {} for size in sizes}
    for size, name, time in timings:
        at[size][name] = time
    fit = [{name for name, time in at[size].items() if time <= min(at[size].values())
            * (1 + tolerance)} for size in sizes]

    def reach(name: str, i: int) -> int:
        j = i
        while j < len(sizes) and name in fit[j]:
            j += 1
        return j

    winners: list[tuple[int, str]] = []
    current = None
    for i, size in enumerate(sizes):
        if current not in fit[i]:
            current = max(sorted(fit[i]), key=lambda name: (reach(name, i), -at[size][name]))
        winners.append((size, current))
    return winners


def existing_table(path: str):
    """The decision table already in ``path``, to merge with (None where
    there is no file); ValueError for a file that is not one."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the decision table {path}: {exc}") from None
    try:
        check_tuning(table)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return table


def tune(comm, sizes, iters: int, repeats: int, output, merge: bool) -> int:
    """Measure on ``comm`` and write the table to ``output`` (None: the
    calibration file ``auto`` finds, merged).  Collective.

    Every rank first checks, with no message, that the table can be
    written (and the one to merge with read): a run does not measure for
    minutes to fail at the end."""
    key = None
    if output is None:
        key = calibration_key()
        output, merge = calibration_path(key), True
        if output is None:
            raise SystemExit("MPI_ALLREDUCE_TUNING_DIR=off: name the output file with -o")
    why = unwritable(output, make_parents=key is not None)
    if why:
        raise SystemExit(f"tune: cannot write {output}: {why}")
    if merge:
        try:
            existing_table(output)
        except ValueError as exc:
            raise SystemExit(f"tune: cannot merge: {exc}") from None
    # each size with every candidate for it (those for short vectors only
    # where they are), interleaved as bench interleaves
    groups: dict = {}
    for nbytes in sizes:
        groups.setdefault(candidates(nbytes), []).append(nbytes)
    results = [r for names, group in groups.items()
               for r in bench(comm, group, list(names), iters=iters, warmup=2, repeats=repeats,
                              progress=comm.Get_rank() == 0)]
    p = comm.Get_size()
    winners = pick_winners([(r.size, r.algorithm, r.time_avg_us) for r in results])
    rule = {"comm_size": p, "table": decision_rows(winners),
            "measured": [{"size": s, "fastest": a} for s, a in winners]}
    if context_for(comm).oversubscribed:
        rule["oversubscribed"] = True  # measured so: applies only when oversubscribed again
    which = (p, rule.get("oversubscribed"))
    meta = metadata(comm, "python -m mpi_allreduce tune", iters, 2, repeats)
    if comm.Get_rank() == 0:
        table = {"version": 1, "source": "python -m mpi_allreduce tune", "rules": []}
        if merge:
            table = existing_table(output) or table
        if key is not None:
            table["key"] = key
            os.makedirs(os.path.dirname(output), exist_ok=True)
        table["rules"] = [r for r in table["rules"]
                          if (int(r["comm_size"]), r.get("oversubscribed")) != which] + [rule]
        table["rules"].sort(key=lambda r: int(r["comm_size"]))
        table.setdefault("meta", {})[str(p)] = meta
        check_tuning(table)
        with open(output, "w") as f:
            json.dump(table, f, indent=1)
        print(f"comm size {p}:")
        for row in rule["table"]:
            limit = "no limit" if row["max_bytes"] is None else f"<= {row['max_bytes']} B"
            print(f"  {limit:>16}: {row['algorithm']}")
        print(f"wrote {output}")
        if key is not None:
            print("auto reads it by itself under this MPI library, on this kind of machine, "
                  f"with {key['ranks_per_node']} rank(s) per node")
    comm.Barrier()  # the file is whole before any rank goes on (and may read it)
    return 0
