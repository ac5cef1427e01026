"""Algorithm names -> schedule builders.

Adding an algorithm: one module in ``algorithms/`` and its line in
``algorithms.FLAT``; tests, the simulator, the cost model, ``verify`` and
the benchmark loop over this table.  What sets an algorithm apart from
the others is said here too, by name (:data:`NOT_CANDIDATES`,
:data:`INNER_CANDIDATES`); everything else derives its list from these.
"""

from __future__ import annotations

import functools

from .algorithms import FLAT, hierarchical, phases as _phases, ring as _ring
from .schedule import Schedule

__all__ = ["ALGORITHMS", "FLAT_ALGORITHMS", "NOT_CANDIDATES", "INNER_CANDIDATES", "ORDERED",
           "SHORT_CANDIDATES", "HALVES", "candidates", "in_rank_order", "get", "builder",
           "check_name", "schedule", "halves"]

#: the flat algorithms, with hierarchical (composed above them) after the first three
_ALGORITHMS = dict(list(FLAT.items())[:3] + [(hierarchical.NAME, hierarchical)]
                   + list(FLAT.items())[3:])


def _flat(*names: str) -> tuple:
    """``names``, each a registered flat algorithm (a list here naming
    another fails at import, not where the list is used)."""
    unknown = [name for name in names if name not in FLAT]
    if unknown:
        raise ValueError(f"unknown flat algorithm(s) {', '.join(map(repr, unknown))}; the flat "
                         f"ones are {', '.join(FLAT)}")
    return names


#: algorithms run by name only, not candidates of ``auto``, ``tune`` or live
#: selection: the O(p^2) baseline, and the double binary tree, which the
#: cost model predicts fastest nowhere from 2 to 65536 ranks
#: (docs/cost-model.md).  The binomial tree is a candidate: the model has it
#: fastest for short vectors on thousands of ranks with many a node, where
#: recursive doubling's steps across nodes queue every rank of a node on
#: its port; ``tune`` measures it, and a table it writes may choose it.
#: An algorithm whose module sets ``CANDIDATE_UP_TO`` (bytes) is a
#: candidate up to that size only (:func:`candidates`): allgather-then-reduce
#: moves p-1 vectors a rank, for vectors of a few bytes.
NOT_CANDIDATES = _flat("naive", "double_binary_tree")

#: the leaders' algorithms the cost model weighs for ``hierarchical`` when
#: no ``inner`` is named (``tools/model.py``'s ``best_flat``,
#: ``tools/scale.py``'s hierarchical form): one of each pattern -- the ring,
#: exchanges at doubling distances, halving then doubling -- as the
#: leaders are one a node, every message across.  A live call's leaders
#: run the decision table's choice instead (``selection.hierarchical_options``).
INNER_CANDIDATES = _flat("ring", "recursive_doubling", "rabenseifner")

#: the names ``algorithm=`` accepts besides "auto"
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)

#: the largest vector (bytes) each algorithm that is a candidate for short
#: vectors only is one for (its module's ``CANDIDATE_UP_TO``)
SHORT_CANDIDATES: dict = {a: FLAT[a].CANDIDATE_UP_TO for a in FLAT
                          if hasattr(FLAT[a], "CANDIDATE_UP_TO")}

#: the flat algorithms ``auto`` may choose and ``tune`` measures at every
#: size (:func:`candidates` adds those for short vectors);
#: ``hierarchical`` is chosen by name, for its node layout
FLAT_ALGORITHMS: tuple[str, ...] = tuple(
    a for a in ALGORITHMS if a not in (hierarchical.NAME,) + NOT_CANDIDATES
    and a not in SHORT_CANDIDATES)


#: the algorithms that combine operands in rank order: a non-commutative op
#: gets exactly MPI's result from them (and only them)
ORDERED: tuple[str, ...] = tuple(a for a in ALGORITHMS if not _ALGORITHMS[a].COMMUTATIVE)


#: the algorithms ``reduce_scatter`` and ``allgather`` run (``algorithm=``):
#: the ring's halves, and each bandwidth-optimal algorithm whose module
#: offers its ``phases`` apart (:mod:`mpi_allreduce.algorithms.phases`)
HALVES: tuple[str, ...] = ("ring",) + tuple(a for a in FLAT if hasattr(FLAT[a], "phases"))


def candidates(nbytes: int) -> tuple[str, ...]:
    """The flat algorithms ``tune`` measures, and live selection tries, on
    vectors of ``nbytes`` bytes: :data:`FLAT_ALGORITHMS` and those of
    :data:`SHORT_CANDIDATES` whose limit ``nbytes`` is within."""
    return FLAT_ALGORITHMS + tuple(a for a, limit in SHORT_CANDIDATES.items()
                                   if nbytes <= limit)


def in_rank_order(name: str) -> str:
    """``auto``'s choice ``name`` for a non-commutative op: itself if it
    combines in rank order, else Rabenseifner (the ring's bandwidth term,
    2 lg p messages, operands in rank order)."""
    return name if name in ORDERED else "rabenseifner"


def get(name: str):
    """The algorithm's module (``NAME``, ``COMMUTATIVE``, ``build``)."""
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; choose one of: auto, {', '.join(ALGORITHMS)}"
        ) from None


def builder(name: str):
    """``build(rank, size, count, segment_size, options)`` of algorithm ``name``."""
    return get(name).build


def check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a string, got {type(name).__name__}")
    if name != "auto":
        get(name)
    return name


@functools.lru_cache(maxsize=256)
def schedule(name: str, rank: int, size: int, count: int, segment_size: int,
             options: tuple = ()) -> Schedule:
    """Rank ``rank``'s schedule of algorithm ``name`` (options as sorted
    ``(key, value)`` pairs), built once for the process."""
    return builder(name)(rank, size, count, segment_size, dict(options))


@functools.lru_cache(maxsize=64)
def halves(what: str, name: str, rank: int, size: int, counts: tuple, segment_size: int,
           in_place: bool, options: tuple = ()) -> Schedule:
    """Rank ``rank``'s schedule of ``what`` ("reduce_scatter" or
    "allgather") on algorithm ``name`` (one of :data:`HALVES`), MPI's
    blocks ``counts`` in rank order, built once for the process."""
    if name == "ring":
        build = _ring.build_reduce_scatter if what == "reduce_scatter" else _ring.build_allgather
        return build(rank, size, counts, segment_size, in_place)
    if name not in HALVES:
        raise ValueError(f"{what} runs one of {', '.join(HALVES)}, not {name!r}")
    module, settings = FLAT[name], dict(options)
    compose = _phases.reduce_scatter if what == "reduce_scatter" else _phases.allgather
    return compose(name, lambda r: module.phases(r, size, settings), rank, size, counts,
                   segment_size, in_place)
