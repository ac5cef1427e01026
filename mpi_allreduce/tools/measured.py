"""Predictions set beside measured times of real machines (no MPI).

``python -m mpi_allreduce simulate --params MACHINE.json --measured
TABLE.csv`` reads a machine description (a ``model --json`` file's
``params``, and a ``network``: :mod:`mpi_allreduce.network`) and a table
of measured all-reduce times, one row per measurement::

    algorithm,nodes,ranks_per_node,bytes,microseconds,source

(more columns may follow; ``groups`` is read where there is one, the
others are ignored).  Every row whose ``algorithm`` is one of ours is
simulated (timing only, no data) on ``nodes * ranks_per_node`` ranks
(``block`` unless the description's ``placement`` says ``round_robin``)
on the machine's first nodes, or, where the row gives ``groups``, on
nodes spread over that many groups (Dragonfly groups, fat-tree leaves:
the job's nodes cut into that many runs of consecutive nodes, each run
from the start of its own group; as a job that spans that many groups
is placed),
and printed with its prediction and ``predicted / measured``; then, per
algorithm and over all, the share of rows within 25%.  A row naming an
algorithm we do not have (a vendor's default, say) is listed as not
modelled, and one whose simulation would pass ``max_messages`` messages as
not simulated, each with its count in the summary.

``--fit-on ALGORITHMS`` fits the machine's ``alpha_inter``, ``beta_inter``
and ``gamma`` to those algorithms' rows first (least squares on the
relative error, each parameter 0 or more, or no lower than the
description's ``floors`` say: the documented link's seconds per byte for
``beta_inter``) and predicts the other algorithms' rows with the result; the fitted rows are printed but left
out of the summary: a prediction is never judged on the rows it was fitted
on.  The fit uses the simulation's time as the linear function of the
three parameters that it is on a fixed critical path (each part timed
alone), and the predictions are then simulated with the fitted machine
(which can take another path).  Fit on algorithms whose bytes sent and
reduced differ in ratio (ring and recursive doubling, say): on one whose
every step sends and reduces the same bytes, ``beta_inter`` and ``gamma``
cannot be told apart.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import numpy as np

from .. import registry
from ..network import PLACEMENTS, placement, traffic
from ..simulate import Machine, execute, footprint, schedules

__all__ = ["Row", "read_rows", "describe", "fit", "check", "summary", "report", "write_json",
           "spread", "COLUMNS", "WITHIN", "FITTED", "MAX_MESSAGES"]

#: the columns a table of measured times has, in this order
COLUMNS = ("algorithm", "nodes", "ranks_per_node", "bytes", "microseconds", "source")
#: a prediction "within" the measurement: ``|predicted / measured - 1|`` at most this
WITHIN = 0.25
#: rows whose simulation would post more messages are not simulated
#: (about 15 us of this machine each: a million is some 15 s)
MAX_MESSAGES = 1_000_000


@dataclass
class Row:
    """One measured time, and what the check made of it."""

    algorithm: str
    nodes: int
    ranks_per_node: int
    bytes: int
    microseconds: float
    source: str
    line: int = 0
    groups: Optional[int] = None  # the groups of the network its nodes spread over
    predicted: Optional[float] = None  # microseconds
    status: str = ""  # "", "fitted", "not modelled", "not simulated"
    traffic: dict = field(default_factory=dict)

    @property
    def ratio(self) -> Optional[float]:
        return None if self.predicted is None else self.predicted / self.microseconds


def read_rows(path) -> list:
    """The rows of a CSV of measured times (header :data:`COLUMNS`, then
    any more).  A missing column or a value that is no number where one
    is needed is a ValueError naming the line."""
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as f:  # (a byte-order mark is no column)
        reader = csv.reader(f)
        header = None
        for fields_ in reader:
            if not fields_ or fields_[0].lstrip().startswith("#"):
                continue  # (blank lines and comments)
            if header is None:
                header = [name.strip() for name in fields_]
                missing = [c for c in COLUMNS if c not in header]
                if missing:
                    raise ValueError(f"{path}: no column {', '.join(missing)} (the columns: "
                                     f"{','.join(COLUMNS)})")
                continue
            number = reader.line_num
            record = dict(zip(header, fields_))
            try:
                row = Row(record["algorithm"].strip(), int(record["nodes"]),
                          int(record["ranks_per_node"]), int(record["bytes"]),
                          float(record["microseconds"]), record["source"].strip(), number,
                          int(record["groups"]) if (record.get("groups") or "").strip()
                          else None)
            except (TypeError, ValueError, AttributeError, KeyError) as exc:  # (a short row)
                raise ValueError(f"{path}, line {number}: {exc!r}") from None
            if row.nodes < 1 or row.ranks_per_node < 1 or row.bytes < 0 or \
                    not (row.microseconds > 0 and math.isfinite(row.microseconds)) or (
                    row.groups is not None and not 1 <= row.groups <= row.nodes):
                raise ValueError(f"{path}, line {number}: nodes and ranks_per_node from 1, "
                                 "bytes from 0, microseconds above 0 (finite), groups from 1 "
                                 "to the nodes")
            rows.append(row)
    return rows


def describe(path) -> tuple:
    """(the :class:`~mpi_allreduce.simulate.Machine`, the description's
    other keys: ``name``, ``sources``, ``placement``, ``floors``, ...).
    A ``placement`` other than those of
    :data:`~mpi_allreduce.network.PLACEMENTS`, or ``floors`` other than
    fitted parameters with seconds of 0 or more, is a ValueError."""
    with open(path) as f:
        description = json.load(f)
    machine = Machine.described(description, path)
    meta = {k: v for k, v in description.items() if k not in ("params", "network")}
    if meta.get("placement", "block") not in PLACEMENTS:
        raise ValueError(f"{path}: placement {meta['placement']!r}: one of "
                         f"{', '.join(PLACEMENTS)}")
    floors = meta.get("floors", {})
    if not isinstance(floors, dict) or any(
            name not in FITTED or isinstance(value, bool) or not isinstance(value, (int, float))
            or not value >= 0 for name, value in floors.items()):
        raise ValueError(f"{path}: floors {floors!r}: an object naming some of "
                         f"{', '.join(FITTED)}, each seconds (per byte) of 0 or more")
    return machine, meta


def _group_size(network) -> Optional[int]:
    """Nodes of one group of ``network`` (a Dragonfly group, a fat tree's
    leaf); None where it has none."""
    if network is None:
        return None
    if network.topology == "dragonfly":
        return network.routers * network.router_nodes
    if network.topology == "fat_tree":
        return network.leaf_nodes
    return None


def spread(nodes: int, groups: int, group_size: int) -> tuple:
    """``nodes`` nodes cut into ``groups`` runs of consecutive nodes (the
    first runs one longer where they do not divide), run g from the first
    node of group g: every node's number."""
    out = []
    for g in range(groups):
        length = nodes // groups + (g < nodes % groups)
        if length > group_size:
            raise ValueError(f"{nodes} nodes over {groups} groups of {group_size}: "
                             f"{length} in one group")
        out.extend(g * group_size + i for i in range(length))
    return tuple(out)


def _nodes_for(network, row: Row, how: str) -> tuple:
    """The node of every rank of ``row`` on ``network`` (a ValueError where
    they do not fit on it)."""
    size = row.nodes * row.ranks_per_node
    nodes = placement(how, size, row.ranks_per_node, None)
    group_size = _group_size(network)
    if row.groups is not None and group_size is not None:
        where = spread(row.nodes, row.groups, group_size)
        nodes = tuple(where[node] for node in nodes)
    return placement(nodes, size, row.ranks_per_node, network)


def _simulated(machines: list, row: Row, how: str, itemsize: int) -> list:
    """(microseconds, bytes per link) of ``row`` simulated on each of
    ``machines``, which differ in their parameters alone (its schedules
    built, and its ranks placed, once)."""
    size = row.nodes * row.ranks_per_node
    count = max(1, -(-row.bytes // itemsize))
    scheds = schedules(row.algorithm, size, count, count)
    nodes = _nodes_for(machines[0].network, row, how)
    out = []
    for machine in machines:
        link_bytes: dict = {}
        finish = execute(scheds, [None] * size, machine.placed(nodes),
                         itemsize=itemsize, label=f"{row.algorithm}, p={size}",
                         link_bytes=link_bytes)
        out.append((max(finish, default=0.0) * 1e6, link_bytes))
    return out


def _messages(row: Row, itemsize: int) -> int:
    size = row.nodes * row.ranks_per_node
    count = max(1, -(-row.bytes // itemsize))
    return footprint(row.algorithm, size, count, count).messages


def _triage(machine: Machine, rows: list, how: str, itemsize: int, max_messages: int) -> None:
    for row in rows:
        if row.algorithm not in registry.ALGORITHMS or row.algorithm == "hierarchical":
            row.status = "not modelled"
            continue
        try:
            _nodes_for(machine.network, row, how)
        except ValueError as exc:  # (more nodes than the machine has, say)
            row.status = f"not placed: {exc}"
            continue
        if _messages(row, itemsize) > max_messages:
            row.status = "not simulated"


#: the parameters :func:`fit` fits, in the order of its linear model
FITTED = ("alpha_inter", "beta_inter", "gamma")


def fit(machine: Machine, rows: list, how: str = "block", itemsize: int = 4,
        floors: Optional[dict] = None) -> Machine:
    """``machine`` with :data:`FITTED` fitted to ``rows`` (see the module
    docstring), each at least its value in ``floors`` (a description's
    ``floors``: ``beta_inter`` no lower than the documented link's seconds
    per byte, say -- no fit makes a link faster than it is) or 0.  Needs
    at least as many rows as parameters."""
    floors = dict(floors or {})
    unknown = sorted(set(floors) - set(FITTED))
    if unknown:
        raise ValueError(f"floors: {unknown} are not fitted (the fitted: {', '.join(FITTED)})")
    if machine.curve_inter is not None:
        raise ValueError("the machine's time across nodes is a measured curve (curve_inter): "
                         "alpha_inter and beta_inter do not enter it, so they cannot be fitted")
    if len(rows) < len(FITTED):
        raise ValueError(f"fitting {', '.join(FITTED)} needs {len(FITTED)} rows or more, "
                         f"and there are {len(rows)}")
    zero = replace(machine, **{name: 0.0 for name in FITTED})
    # (1 us, or 1 us per byte: times in us)
    units = [zero] + [replace(zero, **{name: 1e-6}) for name in FITTED]
    times = np.array([[t for t, _ in _simulated(units, row, how, itemsize)] for row in rows])
    base = times[:, 0]
    columns = [times[:, i + 1] - base for i in range(len(FITTED))]
    measured = np.array([row.microseconds for row in rows])
    design = np.stack(columns, axis=1) / measured[:, None]
    least = np.array([floors.get(name, 0.0) * 1e6 for name in FITTED])
    target = 1.0 - base / measured - design @ least  # (fitted: what each adds to its floor)
    best, best_error = np.zeros(len(FITTED)), math.inf
    # least squares with every parameter 0 or more: the best of the fits
    # on each subset of the parameters whose values all come out so
    for k in range(1, len(FITTED) + 1):
        for subset in itertools.combinations(range(len(FITTED)), k):
            values, *_ = np.linalg.lstsq(design[:, subset], target, rcond=None)
            if (values < 0).any():
                continue
            error = float(np.sum((design[:, subset] @ values - target) ** 2))
            if error < best_error:
                best_error, best = error, np.zeros(len(FITTED))
                best[list(subset)] = values
    return replace(machine, **{name: float(value) * 1e-6
                               for name, value in zip(FITTED, best + least)})


def check(machine: Machine, rows: list, fit_on: tuple = (), how: str = "block",
          dtype: str = "int32", max_messages: int = MAX_MESSAGES,
          floors: Optional[dict] = None) -> Machine:
    """Predict every row (filling in ``predicted``, ``status`` and
    ``traffic``); the machine the predictions ran on (fitted on the rows
    of the algorithms ``fit_on`` names, where it names any)."""
    itemsize = np.dtype(dtype).itemsize
    _triage(machine, rows, how, itemsize, max_messages)
    if fit_on:
        fitted = [row for row in rows if row.algorithm in fit_on and not row.status]
        machine = fit(machine, fitted, how, itemsize, floors)
        for row in fitted:
            row.status = "fitted"
    for row in rows:
        if row.status in ("", "fitted"):
            [(row.predicted, link_bytes)] = _simulated([machine], row, how, itemsize)
            row.traffic = traffic(link_bytes)
    return machine


def summary(rows: list) -> list:
    """Per algorithm and over all (``"all"``), of the rows judged (not
    fitted, not left out): ``(algorithm, judged, within 25%, median ratio,
    not modelled, not simulated or not placed)``."""
    out = []
    names = sorted({row.algorithm for row in rows})
    for name in names + ["all"]:
        mine = [row for row in rows if name in ("all", row.algorithm)]
        judged = [row.ratio for row in mine if not row.status]
        within = sum(abs(r - 1) <= WITHIN for r in judged)
        out.append((name, len(judged), within,
                    float(np.median(judged)) if judged else None,
                    sum(row.status == "not modelled" for row in mine),
                    sum(row.status.startswith(("not simulated", "not placed"))
                        for row in mine)))
    return out


def report(rows: list, machine: Machine, header: str = "") -> str:
    """The rows and the summary as text (``simulate --measured``'s output)."""
    lines = [header] if header else []
    lines.append("# parameters: " + ", ".join(
        f"{k} = {v:.3g}" for k, v in machine.parameters().items() if isinstance(v, float) and v))
    if machine.network is not None:
        network = machine.network
        lines.append("# network: " + ", ".join(
            f"{f} = {getattr(network, f)}" for f in network.__dataclass_fields__
            if getattr(network, f) != network.__dataclass_fields__[f].default))
    lines.append(f"{'algorithm':>20} {'nodes':>6} {'rpn':>4} {'bytes':>11} {'measured us':>13} "
                 f"{'predicted us':>13} {'ratio':>7} {'global B':>11} {'hottest link':>22}  note")
    for row in rows:
        predicted = "-" if row.predicted is None else f"{row.predicted:.2f}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        hottest = row.traffic.get("hottest", ("", 0))[0] if row.traffic else ""
        global_bytes = row.traffic.get("global", "") if row.traffic else ""
        lines.append(f"{row.algorithm:>20} {row.nodes:>6} {row.ranks_per_node:>4} "
                     f"{row.bytes:>11} {row.microseconds:>13.2f} {predicted:>13} {ratio:>7} "
                     f"{global_bytes:>11} {hottest:>22}  {row.status}")
    lines.append(f"# within {WITHIN:.0%}: rows judged (not fitted on, simulated)")
    lines.append(f"{'algorithm':>20} {'judged':>7} {'within':>7} {'share':>7} "
                 f"{'median ratio':>13} {'not modelled':>13} {'not simulated':>14}")
    # (not simulated: too many messages to simulate here, or not placed)
    for name, judged, within, median, unmodelled, unsimulated in summary(rows):
        share = f"{within / judged:.0%}" if judged else "-"
        median_text = "-" if median is None else f"{median:.2f}"
        lines.append(f"{name:>20} {judged:>7} {within:>7} {share:>7} {median_text:>13} "
                     f"{unmodelled:>13} {unsimulated:>14}")
    return "\n".join(lines)


def write_json(path, rows: list, machine: Machine, meta: dict) -> None:
    """The rows, the summary and the machine they ran on as JSON: a
    machine description (``params``, ``network``, ``meta``'s keys) that
    ``--params`` reads back, with ``rows`` and ``summary`` besides."""
    out = dict(meta, params=machine.parameters())
    if machine.network is not None:
        out["network"] = {k: v for k, v in asdict(machine.network).items()
                          if v != type(machine.network).__dataclass_fields__[k].default}
    out["rows"] = [{"algorithm": r.algorithm, "nodes": r.nodes, "ranks_per_node": r.ranks_per_node,
                    "bytes": r.bytes, "groups": r.groups, "measured_us": r.microseconds,
                    "predicted_us": r.predicted, "ratio": r.ratio, "status": r.status,
                    "global_bytes": r.traffic.get("global"),
                    "hottest_link": list(r.traffic["hottest"]) if r.traffic else None,
                    "line": r.line} for r in rows]  # (the table's row: its source is there)
    out["summary"] = [dict(zip(("algorithm", "judged", "within", "median_ratio", "not_modelled",
                                "not_simulated"), entry)) for entry in summary(rows)]
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
