"""Algorithm names -> classes, and the ``auto`` choice.

Adding an algorithm: one module in ``algorithms/`` and one line in
``_ALGORITHMS``; tests, ``verify`` and the benchmark loop over this table.
"""

from __future__ import annotations

import functools
import json
import os

from .config import environment

from .algorithms.driver import Driver
from .algorithms.hierarchical import Hierarchical
from .algorithms.rabenseifner import Rabenseifner
from .algorithms.recursive_doubling import RecursiveDoubling
from .algorithms.ring import Ring
from .algorithms.ring_pipelined import PipelinedRing

__all__ = ["ALGORITHMS", "get", "build", "choose", "describe_choices", "resolve"]

_ALGORITHMS = {
    cls.name: cls
    for cls in (Driver, Ring, RecursiveDoubling, Hierarchical, PipelinedRing, Rabenseifner)
}

#: the names ``algorithm=`` accepts besides "auto"
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)

#: the flat algorithms: what ``auto`` tries on its first calls of a shape
#: (see trial.py) and ``tune`` measures; ``hierarchical`` is chosen by name,
#: for its node layout
FLAT_ALGORITHMS: tuple[str, ...] = tuple(a for a in ALGORITHMS if a != "hierarchical")

#: the built-in decision table (same format as ``python -m mpi_allreduce tune``
#: writes): for the largest listed comm_size <= p, the first row whose
#: max_bytes (None = no limit) is >= the message size names the algorithm.
#: A rule with ``"oversubscribed": true`` applies only when some node runs
#: more ranks than it has CPUs (and then wins over a rule without the key for
#: the same comm_size); ``false`` only when none does.
DEFAULT_TUNING = {
    "version": 1,
    "source": "built-in default, from `python -m mpi_allreduce tune` and benchmarks/run_targets.py "
              "on 2 to 4 ranks (benchmarks/results/): recursive doubling for short vectors "
              "(fewest messages); on 3+ ranks Rabenseifner for medium ones (the ring's "
              "bandwidth with 2 lg p messages), on 2 ranks for long ones too; the ring "
              "for long ones; on oversubscribed nodes the driver up to 256 KiB but "
              "recursive doubling from 512 B to 8 KiB "
              "(benchmarks/results/tuning-oversubscribed.json, benchmarks/results/bench-np4.json)",
    "rules": [
        # 2 ranks: Rabenseifner won at 8 MiB in 6 of 7 runs of
        # benchmarks/run_targets.py, measured when it still sent whole halves
        # (one rendezvous per step) and the ring 1 MiB segments; both travel
        # in segments now, and auto's trial checks the choice on the day
        {"comm_size": 1, "table": [
            {"max_bytes": 1 << 20, "algorithm": "recursive_doubling"},
            {"max_bytes": None, "algorithm": "rabenseifner"},
        ]},
        {"comm_size": 3, "table": [
            {"max_bytes": 64 * 1024, "algorithm": "recursive_doubling"},
            {"max_bytes": 1 << 20, "algorithm": "rabenseifner"},
            {"max_bytes": None, "algorithm": "ring"},
        ]},
        # more ranks than CPUs: a blocked rank must wait until its peer is
        # scheduled, so the fewest rendezvous win -- the driver's eager sends
        # to the root complete without one (tuned on 3 and 4 ranks on 2 cores);
        # but recursive doubling's lg p exchanges were fastest at 2 KiB in all
        # 6 runs of benchmarks/run_targets.py on 4 ranks before this row, at
        # 8 KiB in 4 and at 512 B in 3 (the driver in the others)
        {"comm_size": 3, "oversubscribed": True, "table": [
            {"max_bytes": 256, "algorithm": "driver"},
            {"max_bytes": 8 * 1024, "algorithm": "recursive_doubling"},
            {"max_bytes": 256 * 1024, "algorithm": "driver"},
            {"max_bytes": 1 << 20, "algorithm": "rabenseifner"},
            {"max_bytes": None, "algorithm": "ring"},
        ]},
    ],
}


def get(name: str):
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; choose one of: auto, {', '.join(ALGORITHMS)}"
        ) from None


def check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a string, got {type(name).__name__}")
    if name != "auto":
        get(name)
    return name


def check_tuning(table: dict) -> dict:
    """Raise ValueError unless ``table`` is a decision table we can use."""
    try:
        rules = table["rules"]
        for rule in rules:
            int(rule["comm_size"])
            if rule.get("oversubscribed") not in (None, True, False):
                raise ValueError(f"oversubscribed must be true, false or absent, "
                                 f"got {rule['oversubscribed']!r}")
            for row in rule["table"]:
                get(row["algorithm"])
                if row["algorithm"] == "hierarchical":
                    raise ValueError("a decision table may not choose 'hierarchical'")
                if row["max_bytes"] is not None:
                    int(row["max_bytes"])
            if rule["table"][-1]["max_bytes"] is not None:
                raise ValueError(f"the last row for comm_size {rule['comm_size']} needs "
                                 "max_bytes null (no upper limit)")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed decision table: {exc!r}") from None
    if not rules:
        raise ValueError("decision table has no rules")
    return table


class DecisionTable:
    """A checked decision table, rules sorted by communicator size."""

    def __init__(self, table: dict):
        self.table = check_tuning(table)
        # (comm_size, oversubscribed or None, rows); for one comm_size the
        # rule without the key sorts first, so a matching specific one wins
        self.rules = sorted(
            ((int(rule["comm_size"]), rule.get("oversubscribed"),
              [(None if row["max_bytes"] is None else int(row["max_bytes"]), row["algorithm"])
               for row in rule["table"]])
             for rule in table["rules"]),
            key=lambda rule: (rule[0], rule[1] is not None),
        )

    def rows_for(self, size: int, oversubscribed: bool = False) -> list:
        """[(max_bytes or None, algorithm)] that apply on ``size`` ranks."""
        rows = self.rules[0][2]
        for comm_size, only_when, candidate in self.rules:
            if comm_size <= size and only_when in (None, oversubscribed):
                rows = candidate
        return rows

    def choose(self, nbytes: int, size: int, oversubscribed: bool = False) -> str:
        rows = self.rows_for(size, oversubscribed)
        for max_bytes, name in rows:
            if max_bytes is None or nbytes <= max_bytes:
                return name
        return rows[-1][1]


@functools.lru_cache(maxsize=8)
def _load(path: str) -> DecisionTable:
    with open(path) as f:
        return DecisionTable(json.load(f))


_DEFAULT = DecisionTable(DEFAULT_TUNING)


def tuning_table(tuning=None) -> DecisionTable:
    """The decision table: ``tuning`` (a dict or a JSON path), else the file
    named by ``MPI_ALLREDUCE_TUNING``, else :data:`DEFAULT_TUNING`."""
    if isinstance(tuning, DecisionTable):
        return tuning
    if isinstance(tuning, dict):
        return DecisionTable(tuning)
    path = tuning or environment().tuning
    return _load(os.path.abspath(path)) if path else _DEFAULT


def choose(nbytes: int, size: int, tuning=None, oversubscribed: bool = False) -> str:
    """The algorithm ``auto`` runs for a vector of ``nbytes`` on ``size`` ranks."""
    return tuning_table(tuning).choose(nbytes, size, oversubscribed)


def describe_choices(size: int, oversubscribed: bool = False, tuning=None) -> str:
    """What ``auto`` runs on ``size`` ranks, e.g. ``driver <= 256 B, ring above``."""
    rows = tuning_table(tuning).rows_for(size, oversubscribed)
    return ", ".join(name if limit is None and i == 0 else
                     f"{name} above" if limit is None else f"{name} <= {limit} B"
                     for i, (limit, name) in enumerate(rows))


def resolve(name: str, nbytes: int, size: int, tuning=None, oversubscribed: bool = False) -> str:
    return choose(nbytes, size, tuning, oversubscribed) if name == "auto" else name


def build(plan, name: str):
    """An algorithm instance for ``plan`` (``auto`` resolved by the built-in table)."""
    name = resolve(name, plan.count * plan.dtype.itemsize, plan.size,
                   oversubscribed=plan.context.oversubscribed)
    return get(name)(plan)
