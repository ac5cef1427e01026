"""Rabenseifner: reduce-scatter by recursive halving, allgather by recursive doubling.

After the fold to ``pof2`` ranks (as in recursive doubling), the vector is
cut into ``pof2`` blocks.  Halving: in step k a rank swaps half of its
current range with the peer at distance 2^k, keeps the half on its own
side and reduces the peer's copy of it in; after lg pof2 steps new rank i
holds block bit_reversed(i) fully reduced.  Doubling replays the steps
backwards and hands the reduced halves over, so every rank ends with every
block::

    pof2 = 4, blocks b0..b3         new 0      new 1      new 2      new 3
    halving, distance 1     keep    b0 b1      b2 b3      b0 b1      b2 b3
    halving, distance 2     keep    b0         b2         b1         b3
    doubling, distance 2    gets    b1         b3         b0         b2
    doubling, distance 1    gets    b2 b3      b0 b1      b2 b3      b0 b1

The distance doubles (1 first, as in MPICH), so after each halving step a
rank holds the reduction over a run of consecutive ranks: operands meet in
rank order, lower first, and a non-commutative op gets MPI's result.

Cost: 2 lg p alpha + 2 n (p-1)/p beta + n (p-1)/p gamma (plus the fold when
p is not a power of two): the ring's bandwidth with lg p latency terms,
which is why vendors choose it for long vectors.  Messages travel in
segments, so scratch is one segment at most (min(n, segment) elements).
"""

from __future__ import annotations

from ..partition import Block, exchange_pairs, fold, halving_steps, real_rank, segments
from ..schedule import RECV, Builder, Recv, Ref, Send, exchange
from .phases import Phases, allreduce
from .recursive_doubling import fold_in, fold_out

NAME = "rabenseifner"
COMMUTATIVE = False


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    return allreduce(NAME, phases(rank, size), rank, size, count, segment_size)


def phases(rank: int, size: int, options=None) -> Phases:
    """The fold, halving and doubling of ``rank``, apart
    (:mod:`~mpi_allreduce.algorithms.phases`: ``reduce_scatter`` and
    ``allgather`` run them alone)."""
    role = fold(rank, size)
    return Phases(role, role.pof2,
                  fold_in=lambda b, pieces: fold_in(b, rank, role, pieces),
                  fold_out=lambda b, count: fold_out(b, role, count),
                  plan=lambda blocks: _halving(role, blocks),
                  reduce_scatter=lambda b, steps, src, cut: reduce_scatter(b, rank, steps, src,
                                                                           cut),
                  allgather=lambda b, steps: allgather(b, steps),
                  kept=lambda steps: steps[-1][1])


def _halving(role, blocks: list) -> list:
    """(peer, kept range, sent range) per halving step."""
    def span(rng):
        first, last = rng
        return Block(blocks[first].offset, blocks[last - 1].stop - blocks[first].offset)

    return [(real_rank(step.peer, role.rem), span(step.keep), span(step.send))
            for step in halving_steps(role.newrank, role.pof2)]


def reduce_scatter(b: Builder, rank: int, steps: list, src: int, cut: int) -> None:
    """The halving steps, ``(peer, kept range, sent range)`` each (also
    Bine's, on its own peers and ranges).  Each kept range lies inside the
    one before, so after the first step this rank's operand is in ``RECV``;
    before it, in ``src``."""
    for peer, keep, send in steps:
        exchange(b, rank, peer, exchange_pairs(segments(send, cut), segments(keep, cut)),
                 src, RECV)
        src = RECV


def allgather(b: Builder, steps: list) -> None:
    """The steps backwards: each hands its kept range over, whole."""
    for peer, keep, send in reversed(steps):
        b.round(Send(peer, Ref(RECV, keep.offset, keep.length)),
                Recv(peer, Ref(RECV, send.offset, send.length)))
