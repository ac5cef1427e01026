"""Bine, latency-optimal: the Bine butterfly, lg p exchanges of the whole vector.

De Sensi, Pasqualoni, Piarulli, Bonato, Ba, Turisini, Domke, Hoefler,
"Bine Trees: Enhancing Collective Operations by Optimizing Communication
Locality", SC 2025.  A Bine (binomial negabinary) butterfly pairs rank r
in the step of ``rho(s)`` with ``pi(r, s)``: r + rho(s) if r is even,
r - rho(s) if odd (mod pof2), rho(s) the negabinary number of s+1 ones
(1, -1, 3, -5, 11, ...; :mod:`mpi_allreduce.negabinary`).  On a ring of
ranks laid out group by group (a Dragonfly group, a fat-tree subtree) the
peers stay nearer than recursive doubling's ``r ^ 2^s``, so less of the
traffic crosses the global links.  Both partners send their whole vector
and combine the two, lower rank's operand first.

The butterfly is distance-halving (``s = lg p - 1`` first, ``s = 0``
last): the same exchanges as the distance-doubling order, at the same
cost, but then every rank combines the same partial results in the same
tree and gets the same bits (in the doubling order the trees differ from
p = 8 on; see :mod:`~mpi_allreduce.algorithms.swing_latency`)::

    p = 8         r0    r1    r2    r3    r4    r5    r6    r7
    rho =  3      r3    r6    r5    r0    r7    r2    r1    r4
    rho = -1      r7    r2    r1    r4    r3    r6    r5    r0
    rho =  1      r1    r0    r3    r2    r5    r4    r7    r6

For p not a power of two, as the authors' code (``allreduce_bine_lat`` in
the PICO suite's libbine) and recursive doubling: MPICH's fold
(:func:`~mpi_allreduce.partition.fold`; the even rank of each of the first
``2 rem`` pairs hands its vector to the odd one and takes the result back
last), the butterfly among the new ranks ``0 .. pof2-1``.  Swing's fold
differs (:mod:`~mpi_allreduce.algorithms.swing_latency`): that, and this
one's pairs being found among the new ranks, are the only differences from
``swing_latency``; at a power of two the two run the same schedule.

Cost: lg p (alpha + n beta + n gamma), plus 2 (alpha + n beta) + n gamma
when p is not a power of two.  Segments keep scratch at one segment.
Operands meet out of rank order: the op must be commutative.
"""

from __future__ import annotations

from ..partition import Block, fold, real_rank, segments
from ..schedule import Builder, settle
from .recursive_doubling import fold_in, fold_out
from .swing_latency import butterfly

NAME = "bine_latency"
COMMUTATIVE = True

__all__ = ["NAME", "COMMUTATIVE", "build"]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    """Rank ``rank``'s schedule: MPICH's fold, the Bine butterfly, the fold back."""
    b = Builder()
    role = fold(rank, size)
    pieces = segments(Block(0, count), segment_size)
    src = fold_in(b, rank, role, pieces)
    if role.newrank is not None:
        src = butterfly(b, rank, role.newrank, role.pof2,
                        lambda new: real_rank(new, role.rem), pieces, src)
        settle(b, src, count)
    fold_out(b, role, count)
    return b.schedule(NAME, rank, size, count)
