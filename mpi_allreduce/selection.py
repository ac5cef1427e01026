"""Which algorithm ``auto`` runs: a decision table, and optionally live timings.

By default the choice depends only on (p, message size, whether the node is
oversubscribed) through a decision table -- the built-in one, a tuning file
(``python -m mpi_allreduce tune``) or a dict -- so the same inputs on the
same ranks give the same algorithm, hence the same bytes, on every call and
in every launch.

Live selection (``MPI_ALLREDUCE_AUTO_LIVE=1``, or ``selection="live"``) trades
that for speed, in the manner of Horovod's parameter manager: the executor
reports each call's seconds to a :class:`LiveSelector`, which now and then
runs one other candidate in place of the table's choice and moves to a
candidate that is consistently faster.  It never wraps a runner: it only
answers "which algorithm?" before a call and is told "how long" after it.
See :class:`LiveSelector` for how the ranks agree and what it costs.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from typing import Optional

import numpy as np
from mpi4py import MPI

from .config import environment, on_refresh
from .engine import wait_for
from .registry import check_name, get, in_rank_order

__all__ = ["DEFAULT_TUNING", "DecisionTable", "tuning_table", "calibration_key",
           "calibration_path", "table_source", "choose", "describe_choices",
           "check_tuning", "LiveSelector", "hierarchical_options"]

#: the built-in decision table (same format as ``python -m mpi_allreduce tune``
#: writes): for the largest listed comm_size <= p, the first row whose
#: max_bytes (None = no limit) is >= the message size names the algorithm.
#: A rule with ``"oversubscribed": true`` applies only when some node runs
#: more ranks than it has CPUs (and then wins over a rule without the key for
#: the same comm_size); ``false`` only when none does.
DEFAULT_TUNING = {
    "version": 1,
    "source": "built-in default, from `python -m mpi_allreduce tune` and benchmarks/run_targets.py "
              "on 2 to 4 ranks under the bundled Open MPI (benchmarks/results/): recursive "
              "doubling for short vectors (fewest messages); on 3+ ranks Rabenseifner for "
              "medium ones (the ring's bandwidth with 2 lg p messages), on 2 ranks for long "
              "ones too; the ring "
              "for long ones; on oversubscribed nodes the driver up to 256 KiB but "
              "recursive doubling from 512 B to 8 KiB "
              "(benchmarks/results/tuning-oversubscribed.json, benchmarks/results/bench-np4.json)",
    "rules": [
        # 2 ranks: Rabenseifner won at 8 MiB in 6 of 7 runs of
        # benchmarks/run_targets.py.  Recursive doubling at every size did
        # better under MPICH and Intel MPI with warm buffers
        # (benchmarks/results/vendors-np2.md), but sending the whole,
        # freshly written vector made one step of ResNet-50's gradients
        # 1.1-2.7x slower under Open MPI (benchmarks/fusion.py); `tune`
        # measures the table of another MPI
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


def _whole(value, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 1 << 62:
        raise ValueError(f"{what} must be a whole number from {low} to 2^62, got {value!r}")
    return value


def check_tuning(table: dict) -> dict:
    """Raise ValueError unless ``table`` is a decision table we can use
    (every field of the right type and range: a table is read from files)."""
    if not isinstance(table, dict) or not isinstance(table.get("rules"), list):
        raise ValueError("malformed decision table: expected an object with a list 'rules'")
    rules = table["rules"]
    if not rules:
        raise ValueError("decision table has no rules")
    for rule in rules:
        if not isinstance(rule, dict) or not isinstance(rule.get("table"), list) \
                or not rule["table"]:
            raise ValueError(f"malformed decision table: a rule needs comm_size and a "
                             f"non-empty list 'table', got {rule!r:.200}")
        _whole(rule.get("comm_size"), "comm_size", 1)
        if rule.get("oversubscribed") not in (None, True, False):
            raise ValueError(f"oversubscribed must be true, false or absent, "
                             f"got {rule['oversubscribed']!r}")
        for row in rule["table"]:
            if not isinstance(row, dict) or not isinstance(row.get("algorithm"), str) \
                    or "max_bytes" not in row:
                raise ValueError(f"malformed decision table: a row needs max_bytes and "
                                 f"algorithm, got {row!r:.200}")
            get(row["algorithm"])
            if row["algorithm"] == "hierarchical":
                raise ValueError("a decision table may not choose 'hierarchical'")
            if row["max_bytes"] is not None:
                _whole(row["max_bytes"], "max_bytes")
        if rule["table"][-1]["max_bytes"] is not None:
            raise ValueError(f"the last row for comm_size {rule['comm_size']} needs "
                             "max_bytes null (no upper limit)")
    return table


class DecisionTable:
    """A checked decision table, rules sorted by communicator size."""

    def __init__(self, table: dict):
        self.table = check_tuning(table)
        #: what the ranks compare to agree on a table (see Context.table)
        self.digest = zlib.crc32(json.dumps(self.table, sort_keys=True).encode())
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


#: the largest decision table file read (a real one is a few KiB)
MAX_TABLE_BYTES = 1 << 20


@functools.lru_cache(maxsize=8)
def _load(path: str) -> DecisionTable:
    """The table in ``path``: a regular file of at most :data:`MAX_TABLE_BYTES`
    holding a valid table; anything else is a ValueError naming the file."""
    try:
        if not os.path.isfile(path):
            raise ValueError("not a regular file")
        with open(path, "rb") as f:
            text = f.read(MAX_TABLE_BYTES + 1)
        if len(text) > MAX_TABLE_BYTES:
            raise ValueError(f"larger than {MAX_TABLE_BYTES} bytes")
        return DecisionTable(json.loads(text))
    except RecursionError:
        raise ValueError(f"decision table {path}: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"decision table {path}: {exc}") from None


_DEFAULT = DecisionTable(DEFAULT_TUNING)
#: the built-in table (what simulations resolve ``auto`` with: never a user's file)
BUILT_IN_TABLE = _DEFAULT


def tuning_table(tuning=None) -> DecisionTable:
    """The decision table: ``tuning`` (a dict or a JSON path), else the file
    named by ``MPI_ALLREDUCE_TUNING``, else the one ``tune`` measured for
    this MPI library, machine and ranks per node (:func:`calibration_path`),
    else :data:`DEFAULT_TUNING`."""
    if isinstance(tuning, DecisionTable):
        return tuning
    if isinstance(tuning, dict):
        return DecisionTable(tuning)
    path = tuning or environment().tuning
    if path:
        return _load(os.path.abspath(path))
    return _calibration() or _DEFAULT


def calibration_key() -> dict:
    """What a measured decision table is valid for: the MPI library (its
    version line), the machine (architecture, CPU model and count) and the
    job's ranks per node (from the launcher, else the world's size).  The
    same on every rank of a job on alike nodes, with no message."""
    import platform

    from .topology import LOCAL_SIZE_ENV

    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    local = next((v for v in map(os.environ.get, LOCAL_SIZE_ENV) if v and v.isdigit()),
                 str(MPI.COMM_WORLD.Get_size()))
    return {"mpi": MPI.Get_library_version().strip().splitlines()[0].strip(),
            "machine": f"{platform.machine()}, {model}, {os.cpu_count()} cpus",
            "ranks_per_node": int(local)}


def calibration_path(key: Optional[dict] = None) -> Optional[str]:
    """Where ``tune`` writes, and ``auto`` finds, the table measured for
    ``key`` (:func:`calibration_key`): a file named by its digest under
    ``MPI_ALLREDUCE_TUNING_DIR``; None when that is ``off``."""
    import hashlib

    directory = environment().tuning_dir
    if directory == "off":
        return None
    if directory is None:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache")
        directory = os.path.join(cache, "mpi_allreduce")
    text = json.dumps(key or calibration_key(), sort_keys=True)
    return os.path.join(directory, f"tuning-{hashlib.sha1(text.encode()).hexdigest()[:12]}.json")


@functools.lru_cache(maxsize=1)
def _calibration() -> Optional[DecisionTable]:
    """The measured table for this MPI, machine and ranks per node, if
    ``tune`` wrote one (looked for once; :func:`~mpi_allreduce.config.refresh`
    looks again)."""
    path = calibration_path()
    return _load(path) if path and os.path.exists(path) else None


on_refresh(_calibration.cache_clear)
on_refresh(_load.cache_clear)  # a file rewritten since is read again


def table_source(tuning=None) -> str:
    """Where ``auto``'s table comes from, in words (for ``info``)."""
    if tuning or environment().tuning:
        return f"the file {tuning or environment().tuning}"
    if _calibration() is not None:
        return f"measured by tune for this MPI, machine and ranks per node: {calibration_path()}"
    path = calibration_path()
    return "built-in" + (f" (no {path}: `tune` writes it)" if path else
                         " (MPI_ALLREDUCE_TUNING_DIR=off)")


#: the leaders' algorithm of ``hierarchical`` unless named: the decision
#: table's choice for the leaders' count and the vector's size
DEFAULT_INNER = "auto"


def inner_setting(value) -> str:
    """The leaders' algorithm: the argument, else ``MPI_ALLREDUCE_INNER``,
    else :data:`DEFAULT_INNER` (``auto`` still to resolve)."""
    value = check_name(value or environment().inner or DEFAULT_INNER)
    if value == "hierarchical":
        raise ValueError("inner algorithm of 'hierarchical' cannot be 'hierarchical'")
    return value


def hierarchical_options(nodes: tuple, inner: Optional[str], nbytes: int, tuning=None,
                         oversubscribed: bool = False, commutative: bool = True) -> tuple:
    """``hierarchical``'s options, resolved in this one place: the node of
    every rank and the leaders' algorithm (``auto``: the decision table's
    choice for the leaders' count; one that keeps rank order for a
    non-commutative op)."""
    from .algorithms.hierarchical import layout

    inner = inner_setting(inner)
    if inner == "auto":
        leaders = len(layout(nodes)[1])
        inner = tuning_table(tuning).choose(nbytes, leaders, oversubscribed)
    if not commutative:
        inner = in_rank_order(inner)
    return (("inner", inner), ("nodes", tuple(nodes)))


def choose(nbytes: int, size: int, tuning=None, oversubscribed: bool = False) -> str:
    """The algorithm ``auto`` runs for a vector of ``nbytes`` on ``size`` ranks."""
    return tuning_table(tuning).choose(nbytes, size, oversubscribed)


def describe_choices(size: int, oversubscribed: bool = False, tuning=None) -> str:
    """What ``auto`` runs on ``size`` ranks, e.g. ``driver <= 256 B, ring above``."""
    rows = tuning_table(tuning).rows_for(size, oversubscribed)
    return ", ".join(name if limit is None and i == 0 else
                     f"{name} above" if limit is None else f"{name} <= {limit} B"
                     for i, (limit, name) in enumerate(rows))


class LiveSelector:
    """``auto`` with live timings, for one call shape on one communicator.

    Every rank makes the same calls in the same order, so every rank counts
    the same calls: decisions are taken only at *sync* calls, the first
    call at or past ``first_sync * 2^k`` (64, 128, 256, ...), and there the ranks agree on
    the timings with one small ``Allreduce`` (each rank's sums; the slowest
    rank's are used).  Between two syncs the current algorithm runs, except
    that right after a sync one *probe* call may run a candidate, chosen in
    turn.  A probe is allowed only while the time spent in probes, plus one
    more call at ``PROBE_GUESS`` times the current mean (plus, for a
    candidate not run yet, the first call's time: its plan is built then),
    stays within ``budget`` (5%) of the time of all calls so far: so
    exploring costs at most about 5% from the first calls on, and nothing in
    the first ``first_sync`` calls.  A candidate replaces the current algorithm when
    its mean over at least ``min_probes`` probes is ``margin`` faster.
    """

    PROBE_GUESS = 3.0
    #: the share of the time probes may take
    BUDGET = 0.05

    def __init__(self, comm, table_choice: str, candidates, budget: Optional[float] = None,
                 first_sync: int = 64, margin: float = 0.1, min_probes: int = 2, context=None):
        budget = self.BUDGET if budget is None else budget
        self.comm, self.context = comm, context
        self.current = table_choice
        self.candidates = [c for c in candidates if c != table_choice]
        self.budget, self.margin, self.min_probes = budget, margin, min_probes
        self.next_sync = first_sync
        self.calls = 0
        #: the caller's counts (planner.runner): calls made of this shape,
        #: calls told to the selector, the next call that times, probes or
        #: follows a move -- per selector, never per pair of arrays, so
        #: ranks that bind one shape to different arrays sync at one call
        self.made = self.counted = 0
        self.due = 1
        self.moves = 0
        self._turn = 0
        #: the candidate the next call probes once agreed (None for the current algorithm)
        self.probe = None
        #: local sums since the start: [seconds, calls] per algorithm, and probe seconds
        self._seconds = {name: 0.0 for name in [table_choice, *self.candidates]}
        self._counts = dict.fromkeys(self._seconds, 0)
        self.probe_seconds = 0.0
        #: the current algorithm's calls since the last sync (folded in there)
        self._current_seconds, self._current_calls = 0.0, 0
        #: the first call's seconds: what a candidate's first call (its plan
        #: built and bound) is guessed to cost
        self._first = None

    def choose(self) -> str:
        """The algorithm of the next call."""
        return self.probe or self.current

    def tick(self, seconds: float, calls: int = 1) -> None:
        """A call of the current algorithm took ``seconds`` on this rank and
        stands for ``calls`` calls (the caller may time one call in a few)."""
        if self._first is None:
            self._first = seconds
        self._current_seconds += seconds * calls
        self._current_calls += calls
        self.calls += calls
        if self.calls >= self.next_sync:
            self._sync()

    def observe(self, name: str, seconds: float) -> None:
        """The call just made ran ``name`` and took ``seconds`` on this rank
        (a probe's time includes building its plan on first use)."""
        if name == self.current:
            self.tick(seconds)
            return
        self.probe = None
        self._seconds[name] += seconds
        self._counts[name] += 1
        self.probe_seconds += seconds
        self.calls += 1
        if self.calls >= self.next_sync:
            self._sync()

    def _sync(self) -> None:
        while self.next_sync <= self.calls:
            self.next_sync *= 2
        self._seconds[self.current] += self._current_seconds
        self._counts[self.current] += self._current_calls
        self._current_seconds, self._current_calls = 0.0, 0
        names = list(self._seconds)
        mine = np.array([self._seconds[n] for n in names] + [self.probe_seconds,
                                                             self._first or 0.0])
        worst = np.empty_like(mine)
        what = "live selection's agreement on its timings (an MPI_Iallreduce)"
        if self.context is not None:
            self.context.collective("live", lambda: self.comm.Iallreduce(mine, worst, MPI.MAX),
                                    what)
        else:
            wait_for([self.comm.Iallreduce(mine, worst, MPI.MAX)], what)
        seconds = dict(zip(names, worst[:-2]))
        probe_seconds, first, total = worst[-2], worst[-1], float(worst[:-2].sum())
        mean = {n: seconds[n] / self._counts[n] for n in names if self._counts[n]}
        best = min((n for n in self.candidates if self._counts[n] >= self.min_probes
                    and n in mean), key=mean.get, default=None)
        if best is not None and mean[best] < (1 - self.margin) * mean[self.current]:
            self.candidates[self.candidates.index(best)] = self.current
            self.current = best
            self.moves += 1
        if not self.candidates:
            return
        candidate = self.candidates[self._turn % len(self.candidates)]
        guess = self.PROBE_GUESS * mean.get(self.current, 0.0)
        if not self._counts[candidate]:  # its first call builds its plan
            guess += first
        if probe_seconds + guess <= self.budget * total:
            self.probe = candidate
            self._turn += 1
