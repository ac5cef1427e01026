"""Bine, bandwidth-optimal: Bine reduce-scatter, then Bine allgather, on permuted blocks.

De Sensi, Pasqualoni, Piarulli, Bonato, Ba, Turisini, Domke, Hoefler,
"Bine Trees: Enhancing Collective Operations by Optimizing Communication
Locality", SC 2025 (the authors' ``allreduce_bine_bdw_remap`` in the PICO
suite's libbine).  The vector is cut into ``pof2`` blocks.  In step s of
the reduce-scatter rank r exchanges with ``pi(r, s)`` = r + rho(s) (r
even) or r - rho(s) (r odd), rho = 1, -1, 3, -5, 11, ...  (distance
doubling, :mod:`mpi_allreduce.negabinary`), sends one half of the range it
still holds and reduces the peer's copy of the other half into its own:
2^(lg p - s - 1) blocks each way.  The blocks a rank sends are those the
butterfly routes via its peer (Swing's ``reach`` sets); Bine puts them
next to each other by giving rank r the block at position ``nu(r)``, the
bit-reversed Gray code of r's negabinary digits, so every message is one
contiguous range and the halving is recursive halving on positions (the
upper half goes to the rank of the pair whose ``nu`` is larger)::

    p = 8                  r0    r1    r2    r3    r4    r5    r6    r7
    nu(r), its block        0     4     6     1     3     7     5     2
    s = 0 peer (rho =  1)  r1    r0    r3    r2    r5    r4    r7    r6
          keeps           0-3   4-7   4-7   0-3   0-3   4-7   4-7   0-3
    s = 1 peer (rho = -1)  r7    r2    r1    r4    r3    r6    r5    r0
          keeps           0-1   4-5   6-7   0-1   2-3   6-7   4-5   2-3
    s = 2 peer (rho =  3)  r3    r6    r5    r0    r7    r2    r1    r4
          keeps            0     4     6     1     3     7     5     2

The allgather replays the steps backwards (distance halving) and hands
each kept range over, so every rank ends with every block.  Each block is
reduced on one rank and copied from there, so every rank gets the same
bits.

For p not a power of two, as Bine's latency-optimal code and recursive
doubling do (the authors' bandwidth-optimal code takes powers of two
only): MPICH's fold (:func:`~mpi_allreduce.partition.fold`), the butterfly
among the ``pof2`` new ranks, the result handed back.

Cost: 2 lg p alpha + 2 n (p-1)/p beta + n (p-1)/p gamma (plus the fold):
Rabenseifner's.  Messages that carry data to be reduced travel in
segments, so scratch is one segment at most.  Operands meet out of rank
order: the op must be commutative.
"""

from __future__ import annotations

from ..negabinary import halving
from ..partition import Block, block_bounds, fold, real_rank
from .phases import Phases, allreduce
from .rabenseifner import allgather, reduce_scatter
from .recursive_doubling import fold_in, fold_out

NAME = "bine_bandwidth"
COMMUTATIVE = True

__all__ = ["NAME", "COMMUTATIVE", "build", "phases", "steps"]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    """Rank ``rank``'s schedule: MPICH's fold, Bine reduce-scatter and allgather, the fold back."""
    return allreduce(NAME, phases(rank, size), rank, size, count, segment_size)


def phases(rank: int, size: int, options=None) -> Phases:
    """The fold and Bine's halving and doubling of ``rank``, apart
    (:mod:`~mpi_allreduce.algorithms.phases`): Rabenseifner's phases on
    Bine's peers and ranges."""
    role = fold(rank, size)
    return Phases(role, role.pof2,
                  fold_in=lambda b, pieces: fold_in(b, rank, role, pieces),
                  fold_out=lambda b, count: fold_out(b, role, count),
                  plan=lambda blocks: _steps(role.newrank, role.pof2, blocks,
                                             lambda new: real_rank(new, role.rem)),
                  reduce_scatter=lambda b, steps, src, cut: reduce_scatter(b, rank, steps, src,
                                                                           cut),
                  allgather=lambda b, steps: allgather(b, steps),
                  kept=lambda steps: steps[-1][1])


def steps(newrank: int, pof2: int, count: int, real) -> list:
    """``(peer, kept, sent)`` per reduce-scatter step: the peer's rank in
    the communicator (``real`` maps new ranks) and the element ranges of
    the kept and sent halves, ``count`` elements cut into ``pof2`` blocks."""
    return _steps(newrank, pof2, block_bounds(count, pof2), real)


def _steps(newrank: int, pof2: int, blocks: list, real) -> list:
    def span(positions):
        first, stop = positions
        return Block(blocks[first].offset, blocks[stop - 1].stop - blocks[first].offset)

    return [(real(peer), span(kept), span(sent)) for peer, kept, sent in halving(newrank, pof2)]
