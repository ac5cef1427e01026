"""``python -m mpi_allreduce tune``: measure, and write the decision table ``auto`` uses.

For the running communicator size, every flat algorithm is timed at each
message size (medians of interleaved repeats); the fastest wins the size,
neighbouring sizes with the same winner merge into one row, and a boundary
between two measured sizes sits at their geometric mean.  Timings on a
shared machine are noisy, so an algorithm within ``tolerance`` (5%) of the
fastest that already won the previous size keeps winning: the table does
not flip between two algorithms that are equally fast.  Load the file
with ``allreduce(..., tuning=path)`` or ``MPI_ALLREDUCE_TUNING=path``.
"""

from __future__ import annotations

import json
import math
import os

from .bench import bench, metadata
from ..context import context_for
from ..registry import FLAT_ALGORITHMS
from ..selection import check_tuning


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


def pick_winners(timings: list[tuple[int, str, float]], tolerance: float = 0.05):
    """[(size, algorithm, time)] -> [(size, winner)], sticking with the previous
    size's winner while it is within ``tolerance`` of the fastest."""
    winners: list[tuple[int, str]] = []
    for size in sorted({t[0] for t in timings}):
        at = {name: time for s, name, time in timings if s == size}
        best = min(at, key=at.get)
        previous = winners[-1][1] if winners else None
        if previous in at and at[previous] <= at[best] * (1 + tolerance):
            best = previous
        winners.append((size, best))
    return winners


def tune(comm, sizes, iters: int, repeats: int, output: str, merge: bool) -> int:
    results = bench(comm, sizes, list(FLAT_ALGORITHMS), iters=iters, warmup=2, repeats=repeats,
                    progress=comm.Get_rank() == 0)
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
        if merge and os.path.exists(output):
            with open(output) as f:
                table = json.load(f)
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
    return 0
