"""2D torus all-reduce: a ring along each row, a ring down each column, a ring back.

Horovod's torus all-reduce (``NCCLTorusAllreduce`` in
``horovod/common/ops/nccl_operations.cc``: reduce-scatter among a node's
ranks, all-reduce across nodes, allgather among the node's ranks), on any
ranks: the p ranks form a grid of ``Y`` rows of ``X`` consecutive ranks
(``X`` is the option ``row_size``).  A *row* is ranks ``y X .. y X + X-1``,
a *column* the ranks with the same position ``c = rank mod X`` in their
rows::

    p = 6, X = 3         column 0   column 1   column 2
    row 0                r0         r1         r2
    row 1                r3         r4         r5

    phase                 along           each rank holds afterwards
    1 reduce-scatter      its row (ring)  block (c+1) mod X of X, summed over its row
    2 all-reduce          its column      that block, summed over every rank
                          (ring, on the block only)
    3 allgather           its row (ring)  every block

Phases 1 and 3 are the ring's own (:func:`~.ring.reduce_scatter`,
:func:`~.ring.allgather` on the row's ranks); phase 2 is the ring
all-reduce's schedule built for the Y ranks of the column on the block's
elements and moved onto them (:func:`~mpi_allreduce.schedule.remap`, in
place on the result).  Each rank sends 2 n (p-1)/p elements, as in the
ring, in 2(X-1) + 2(Y-1) steps instead of 2(p-1).  With rows of one node's
ranks (``row_size`` = ranks per node) only phase 2 crosses nodes, and it
carries n/X of the vector.

``options``: ``row_size``, X.  It must divide p (a ValueError names the
divisors otherwise, the same on every rank: it depends on p and the
option alone).  Unset: the divisor of p nearest sqrt(p)
(:func:`default_row_size`).  X = 1 (one column) and X = p (one row) are
the ring all-reduce itself, and so is every prime p unless X is named
(its divisors are 1 and p; the default is 1).

Cost: 2(X-1+Y-1) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma.  The
blocks are combined in an order that differs per block (the ring's), so
the algorithm needs a commutative op.  Scratch: one segment, as the ring.
"""

from __future__ import annotations

import math

from ..partition import block_bounds, ring_owned_block
from ..schedule import RECV, SEND, Builder, Ref, Schedule, remap, settle
from . import ring
from .ring import allgather, reduce_scatter

NAME = "torus"
COMMUTATIVE = True

__all__ = ["NAME", "COMMUTATIVE", "OPTIONS", "resolve", "build", "default_row_size",
           "row_size_for", "grid"]

#: the call's options it takes (:mod:`mpi_allreduce.options`)
OPTIONS = ("row_size",)


def resolve(size: int, row_size=None) -> tuple:
    """The builder's options for ``size`` ranks, resolved as a call's spec
    carries them: the row size (:func:`row_size_for`: a ValueError where a
    named one does not divide ``size``)."""
    return (("row_size", row_size_for(size, row_size)),)


def default_row_size(size: int) -> int:
    """The divisor of ``size`` nearest sqrt(size) (no two are equally near
    unless size is a square, whose root is the divisor)."""
    root = math.sqrt(size)
    return min((d for d in range(1, size + 1) if size % d == 0), key=lambda d: abs(d - root))


def row_size_for(size: int, row_size=None) -> int:
    """The row size of a grid of ``size`` ranks: ``row_size`` where named
    (it must divide ``size``), else :func:`default_row_size`."""
    if row_size is None:
        return default_row_size(size)
    if isinstance(row_size, bool) or not isinstance(row_size, int) or row_size < 1:
        raise ValueError(f"row_size must be a positive integer, got {row_size!r}")
    if size % row_size:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"torus: row_size {row_size} does not divide the {size} ranks into "
                         f"rows; choose one of {', '.join(map(str, divisors))}")
    return row_size


def grid(rank: int, size: int, row_size: int) -> tuple[list, list]:
    """(the ranks of ``rank``'s row, the ranks of its column), in order."""
    start, position = rank - rank % row_size, rank % row_size
    return (list(range(start, start + row_size)), list(range(position, size, row_size)))


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    x = row_size_for(size, (options or {}).get("row_size"))
    row, column = grid(rank, size, x)
    position, below = rank % x, column.index(rank)
    blocks = block_bounds(count, x)
    b = Builder()
    if x > 1:
        reduce_scatter(b, row, position, blocks, segment_size)
    block = blocks[ring_owned_block(position, x)]
    if len(column) > 1:
        _column_allreduce(b, column, below, block, segment_size, in_place=x > 1)
    elif x == 1:
        settle(b, SEND, count)  # (one rank)
    if x > 1:
        allgather(b, row, position, blocks, segment_size)
    return b.schedule(NAME, rank, size, count)


def _column_allreduce(b: Builder, column: list, index: int, block, cut: int,
                      in_place: bool) -> None:
    """The ring all-reduce of elements ``block`` among the column's ranks:
    in place on the result after the row's reduce-scatter (``in_place``),
    else (rows of one rank) from the input to the result."""
    part = ring.build(index, len(column), block.length, cut)
    moved = remap(part, column, {SEND: RECV} if in_place else None)
    b.extend(_shifted(moved, block.offset))


def _shifted(schedule: Schedule, offset: int) -> Schedule:
    """``schedule`` acting on elements ``offset ..`` of the input and the
    result (its scratch stays where it is)."""
    if not offset:
        return schedule

    def move(ref: Ref) -> Ref:
        return ref if ref.buf not in (SEND, RECV) else ref._replace(offset=ref.offset + offset)

    def moved(action):
        fields = tuple(move(f) if isinstance(f, Ref) else f for f in action)
        return type(action)(*fields)

    return schedule._replace(rounds=tuple(tuple(moved(a) for a in r) for r in schedule.rounds))
