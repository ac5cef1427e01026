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

``--export openmpi|mpich|impi -o FILE`` writes the vendor's own tuning file
instead (:mod:`mpi_allreduce.vendor`): the vendor's algorithms, each forced
in turn, are timed beside its default (or read from ``bench
--vendor-algorithms`` JSON files with ``--from``, for a library that takes
its control at start-up only: an algorithm timed in several launches counts
with the median of them, and replaces the library's own choice only where
its upper quartile lies below the default's lower quartile), the fastest per size is chosen as above
(5% tolerance, the library's own choice kept where the file can say so and
it is within it), and the file is written once every rank holds the same
text, with the environment that puts it in force printed.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics

from .arguments import unwritable
from .bench import bench, is_vendor, load_results, metadata, vendor_forcings
from .. import vendor
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


#: how much slower than the fastest a vendor algorithm may be and still win a size (5%)
VENDOR_TOLERANCE = 0.05


def vendor_winners(library, timings: list[tuple[int, str, float]], ranks: int):
    """[(size, ``mpi`` or ``mpi:<name>``, time)] -> [(size, winner label)]:
    :func:`pick_winners` at :data:`VENDOR_TOLERANCE` among what the file may
    name at each size, the library's own choice (``mpi``) kept at a size
    where it is within that of the fastest and the file can name it."""
    default_allowed = library.own_choice_in_file
    timings = [t for t in timings if (t[1] == vendor.VENDOR and default_allowed) or
               (t[1] != vendor.VENDOR and library.usable(t[1].split(":", 1)[1], t[0], ranks))]
    winners = pick_winners(timings, tolerance=VENDOR_TOLERANCE)
    if default_allowed:
        at = {}
        for size, name, time in timings:
            at.setdefault(size, {})[name] = time
        winners = [(size, vendor.VENDOR if at[size].get(vendor.VENDOR, float("inf"))
                    <= min(at[size].values()) * (1 + VENDOR_TOLERANCE) else name)
                   for size, name in winners]
    return winners


def vendor_choices(library, winners: list[tuple[int, str]]) -> list:
    """[(size, winner label)] -> [(from bytes, Algorithm or None)]: the rows
    of :func:`decision_rows` (a boundary between two measured sizes at their
    geometric mean, neighbours with the same winner merged), each from the
    byte after the row before it."""
    names = {a.label: a for a in library.algorithms()}
    rows = decision_rows(winners)
    starts = [0] + [row["max_bytes"] + 1 for row in rows[:-1]]
    return [(start, None if row["algorithm"] == vendor.VENDOR else names[row["algorithm"]])
            for start, row in zip(starts, rows)]


def export(comm, library, path: str, sizes, iters: int, repeats: int, sources) -> int:
    """Measure the vendor's algorithms (or read ``sources``, bench JSON files)
    and write ``library``'s tuning file to ``path``.  Collective."""
    p = comm.Get_size()
    if sources:
        results, metas = load_results(sources)
        for meta, source in zip(metas, sources):
            if vendor.identify(meta["mpi_library"]).key != library.key:
                raise SystemExit(f"tune --export {library.key}: {source} was measured under "
                                 f"{meta['mpi_library'].splitlines()[0]}")
            if meta["ranks"] != p and p > 1:
                raise SystemExit(f"tune --export: {source} was measured on {meta['ranks']} "
                                 f"ranks, this run has {p}")
        p = metas[0]["ranks"]
        # (one algorithm timed in several launches: the median of them)
        times: dict = {}
        for r in results:
            if is_vendor(r["algorithm"]) and not r.get("in_place") \
                    and r["algorithm"] != vendor.TUNED_LABEL:
                times.setdefault((r["size"], r["algorithm"]), []).append(r["time_avg_us"])
        default = {size: ts for (size, name), ts in times.items() if name == vendor.VENDOR}

        def clearly_faster(size, ts) -> bool:
            """Over launches of their own, an algorithm replaces the library's
            choice only where its upper quartile is below the default's lower
            (where the file can keep that choice at all)."""
            own = default.get(size, [])
            if not library.own_choice_in_file or len(ts) < 2 or len(own) < 2:
                return True
            return statistics.quantiles(ts, n=4, method="inclusive")[2] < \
                statistics.quantiles(own, n=4, method="inclusive")[0]
        timings = [(size, name, statistics.median(ts)) for (size, name), ts in times.items()
                   if name == vendor.VENDOR or clearly_faster(size, ts)]
    else:
        with vendor_forcings(comm, library, library.algorithms()) as forcings:
            results = bench(comm, sizes, [vendor.VENDOR] + list(forcings), iters=iters,
                            warmup=2, repeats=repeats, progress=comm.Get_rank() == 0,
                            forcings=forcings)
        timings = [(r.size, r.algorithm, r.time_avg_us) for r in results]
    known = {a.label for a in library.algorithms()} | {vendor.VENDOR}
    timings = [t for t in timings if t[1] in known]
    if not timings:
        raise SystemExit("tune --export: no timings of the vendor's algorithms to choose from")
    winners = vendor_winners(library, timings, p)
    text = library.export(vendor_choices(library, winners), p)
    library.read(text)  # (what we write, the library's parser takes)
    texts = comm.allgather(text)
    if any(t != text for t in texts):
        raise SystemExit("tune --export: the ranks measured different winners; nothing written")
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            f.write(text)
        for size, label in winners:
            print(f"  {size:>12} B: {label}")
        print(f"wrote {path} ({library.title}, {p} ranks); to use it, set:")
        for key, value in library.tuned_env(path).items():
            print(f"  export {key}={shlex.quote(value)}")
    comm.Barrier()
    return 0
