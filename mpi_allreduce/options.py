"""A call's options: one frozen value, checked and resolved once.

Every entry point -- ``allreduce``, ``iallreduce``, ``allreduce_init``,
``reduce_scatter`` and ``allgather`` (blocking and not), the drop-in
``Comm``, ``Fusion`` and the torch backend's ``configure`` -- takes the same
keywords and turns them into an :class:`Options` by the one function
:func:`options`: unknown names raise ``TypeError``, bad values
``ValueError``/``TypeError``, and what is left unset is read from the
environment (:mod:`~mpi_allreduce.config`) there and then.  A call made
from an ``Options`` never reads a keyword or a setting again; kept calls,
``Comm``, ``Fusion`` and the torch backend hold theirs.

Which options a kind of call uses is said here too (:data:`APPLIES`): an
option given to a call it does not apply to is an error, never silently
dropped; ``Comm`` and the torch backend pass each call the ones that apply
to it (:func:`keywords_for`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import numpy as np

from . import registry, selection as _selection
from .config import environment

__all__ = ["Options", "options", "keywords_for", "algorithms_taking", "NAMES", "APPLIES",
           "SELECTIONS", "DEFAULT_SEGMENT_BYTES"]

#: default segment: the most one message carries when its data is to be
#: reduced, and so the scratch of every algorithm
DEFAULT_SEGMENT_BYTES = 1 << 20

#: the ways ``auto`` chooses (``selection=``, ``MPI_ALLREDUCE_SELECTION``)
SELECTIONS = ("table", "live")

#: the algorithms whose choice a decision table (``tuning=``) shapes
_TABLE_USERS = ("auto", "hierarchical")


@dataclass(frozen=True)
class Options:
    """Every option of a call, resolved (see :func:`options` for each one's
    meaning and default).

    ============== =========================================================
    algorithm      ``auto`` or a registered name
    check          exchange the call's spec first (``check=True``)
    segment_size   elements per message at most, as given (None: by bytes)
    segment_bytes  the environment's segment in bytes (when not given)
    ranks_per_node hierarchical: emulated node size (None: shared memory)
    inner          hierarchical: the leaders' algorithm (None otherwise)
    radix          recursive_multiplying, knomial: the group size k (None:
                   the algorithm's default, 4)
    row_size       torus: ranks in a row of the grid (None: the divisor of
                   p nearest sqrt(p))
    tuning         None, a table file's absolute path, or a DecisionTable
                   (auto and hierarchical only; None otherwise)
    selection      ``table`` or ``live``
    reproducible   reproducible float sums
    ============== =========================================================
    """

    algorithm: str = "auto"
    check: bool = False
    segment_size: Optional[int] = None
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    ranks_per_node: Optional[int] = None
    inner: Optional[str] = None
    radix: Optional[int] = None
    row_size: Optional[int] = None
    tuning: Any = None
    selection: str = "table"
    reproducible: bool = False

    def segment(self, dtype) -> int:
        """Elements per message at most for elements of ``dtype``."""
        if self.segment_size is not None:
            return self.segment_size
        return max(1, self.segment_bytes // np.dtype(dtype).itemsize)

    def but(self, **changes) -> "Options":
        """These options with some replaced (already resolved values)."""
        return replace(self, **changes)


#: every keyword an entry point takes, in the order of allreduce's signature
NAMES = ("algorithm", "check", "segment_size", "ranks_per_node", "inner", "radix", "row_size",
         "tuning", "selection", "reproducible")

#: the options each kind of call uses ("request": non-blocking and
#: persistent all-reduces, which choose by the decision table and take
#: ``reproducible`` only where it changes nothing, see
#: :func:`~mpi_allreduce.iallreduce`; "halves": reduce_scatter and
#: allgather, which run the ring's halves or another algorithm's of
#: ``registry.HALVES``)
APPLIES = {
    "allreduce": NAMES,
    "request": tuple(name for name in NAMES if name != "selection"),
    "halves": ("algorithm", "check", "segment_size", "radix"),
}

#: the options only some algorithms use: given with another, they are refused
#: (an algorithm module names the options it takes in ``OPTIONS``)
_ALGORITHMS_OF = {"inner": ("hierarchical",), "ranks_per_node": ("hierarchical",),
                  "tuning": _TABLE_USERS,
                  **{name: tuple(a for a in registry.ALGORITHMS
                                 if name in getattr(registry.get(a), "OPTIONS", ()))
                     for name in ("radix", "row_size")}}


def algorithms_taking(name: str) -> tuple:
    """The algorithms that take option ``name``, one of those only some
    algorithms take (``inner``, ``ranks_per_node``, ``radix``, ``row_size``,
    ``tuning``)."""
    return _ALGORITHMS_OF[name]


#: values of an option that ask for nothing a kind of call could miss
_NEUTRAL = {"algorithm": ("auto", "ring"), "reproducible": (False,), "selection": ("table",)}

assert {f.name for f in fields(Options)} == set(NAMES) | {"segment_bytes"}


def options(kind: str = "allreduce", **keywords) -> Options:
    """The :class:`Options` of a call of ``kind`` (a key of :data:`APPLIES`)
    from its keywords; None or absent: the environment's setting.

    ``TypeError`` for a name no call takes, or one that does not apply to
    ``kind`` (say which kinds it applies to); ``ValueError``/``TypeError``
    for a bad value -- the same on every rank, before any message."""
    unknown = [name for name in keywords if name not in NAMES]
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; the options are "
                        f"{', '.join(NAMES)}")
    allowed = APPLIES[kind]
    misplaced = [name for name, value in keywords.items()
                 if name not in allowed and value is not None
                 and not any(value is v or value == v for v in _NEUTRAL.get(name, ()))]
    if misplaced:
        what = {"request": "iallreduce and allreduce_init (and Fusion) choose by the decision "
                           "table: they take", "halves": "reduce_scatter and allgather take"}[kind]
        raise TypeError(f"no {', '.join(misplaced)} option here: {what} "
                        f"{', '.join(allowed)}")
    env = environment()
    algorithm = registry.check_name(keywords.get("algorithm") or "auto")
    if kind == "halves":
        algorithm = "ring" if algorithm == "auto" else algorithm
        if algorithm not in registry.HALVES:
            raise ValueError(f"reduce_scatter and allgather run one of "
                             f"{', '.join(registry.HALVES)}, not {algorithm!r}")
    for name, users in _ALGORITHMS_OF.items():
        if keywords.get(name) is not None and algorithm not in users:
            raise TypeError(f"{name} is an option of {' and '.join(users)}, not of algorithm "
                            f"{algorithm!r}")
    if keywords.get("selection") not in (None, "table") and algorithm != "auto":
        raise TypeError(f"selection is how auto chooses; algorithm {algorithm!r} is named")
    check = _flag("check", keywords.get("check"))
    segment_size = _segment_size(keywords.get("segment_size"))
    inner, ranks_per_node = keywords.get("inner"), keywords.get("ranks_per_node")
    try:
        if algorithm == "hierarchical":
            inner = _selection.inner_setting(inner)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"inner: {exc}") from None
    if algorithm == "hierarchical":
        ranks_per_node = ranks_per_node_setting(ranks_per_node)
    radix = _whole("radix", keywords.get("radix"), 2)
    row_size = _whole("row_size", keywords.get("row_size"), 1)
    tuning = _tuning_argument(keywords.get("tuning"))
    selection = keywords.get("selection") or env.selection or "table"
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    if kind == "request":
        selection = "table"  # (live selection times blocking calls)
    return Options(algorithm=algorithm, check=env.check if check is None else bool(check),
                   segment_size=segment_size,
                   segment_bytes=env.segment_bytes or DEFAULT_SEGMENT_BYTES,
                   ranks_per_node=ranks_per_node, inner=inner, radix=radix, row_size=row_size,
                   tuning=tuning, selection=selection,
                   reproducible=_flag("reproducible", keywords.get("reproducible")) or False)


def _flag(name: str, value) -> Optional[bool]:
    """A yes-or-no option: True, False (numpy's too) or None; anything else
    (a string "no" is true in Python) is refused."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    raise TypeError(f"{name} must be True, False or None, got {value!r}")


def keywords_for(given: dict, kind: str, algorithm: Optional[str] = None) -> dict:
    """Of the keywords ``given`` once (to ``Comm``, ``configure``, a tool's
    command line), those that apply to calls of ``kind`` -- and, where
    ``algorithm`` is named, to that algorithm: what such a wrapper passes
    each call (``--ranks-per-node`` goes to ``verify``'s hierarchical runs)."""
    if kind == "halves" and given.get("algorithm") not in registry.HALVES:
        # (an all-reduce algorithm with no halves of its own: they run the ring)
        given = {name: value for name, value in given.items() if name != "algorithm"}
        algorithm = algorithm or "ring"
    return {name: value for name, value in given.items() if name in APPLIES[kind]
            and (algorithm is None or algorithm in _ALGORITHMS_OF.get(name, (algorithm,)))}


def _whole(name: str, value, least: int) -> Optional[int]:
    """An integer option of at least ``least`` (None: unset); whether a
    group of p ranks can use it (a row size must divide p) the algorithm
    checks where p is known, the same on every rank."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    return int(value)


def _segment_size(value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"segment_size must be a positive integer, got {value!r}")
    return int(value)


def ranks_per_node_setting(value):
    """The node-size override: the argument, else the environment, else None."""
    if value is None:
        value = environment().ranks_per_node
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {value!r}")
    return value


def _tuning_argument(tuning):
    """``tuning`` as the planner takes it: None (the default table), a
    file's absolute path (both read and agreed by the ranks on first use:
    :meth:`~mpi_allreduce.context.Context.table`), or a checked
    :class:`~mpi_allreduce.selection.DecisionTable` (a dict the caller
    passes: what it makes ``auto`` choose is in the call's fingerprint)."""
    if tuning is None or isinstance(tuning, _selection.DecisionTable):
        return tuning
    if isinstance(tuning, dict):
        return _selection.DecisionTable(tuning)
    if isinstance(tuning, (str, os.PathLike)):
        return os.path.abspath(os.fspath(tuning))
    raise TypeError(f"tuning must be a dict, a DecisionTable or a file's path, got "
                    f"{type(tuning).__name__}")
