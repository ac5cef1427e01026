"""Recursive doubling: lg p exchanges of the whole vector.

For p a power of two, in step k rank r swaps its vector with ``r ^ 2^k``
and both combine the two (lower rank's operand first, so both compute the
same bits).  For other p the extra ranks fold in first and out last
(MPICH and Open MPI do the same)::

    p = 6, pof2 = 4, rem = 2      ranks 0..3 fold in pairs; 4, 5 go straight on

    fold in     0 -> 1      2 -> 3                      (1, 3, 4, 5 -> new 0..3)
    mask 1      1 <-> 3     4 <-> 5                     (new 0<->1, 2<->3)
    mask 2      1 <-> 4     3 <-> 5                     (new 0<->2, 1<->3)
    fold out    1 -> 0      3 -> 2

Cost: lg p (alpha + n beta + n gamma), plus 2 (alpha + n beta) + n gamma
when p is not a power of two.  Latency-optimal for short vectors, moves the
whole vector every step.  A vector longer than one segment travels in
segments, so the incoming copy (the scratch) is one segment at most.  The
operand order is fixed by rank, so it needs an associative op but not a
commutative one.
"""

from __future__ import annotations

from ..partition import Block, doubling_peers, exchange_pairs, fold, real_rank, segments
from ..schedule import RECV, SEND, Builder, Recv, Ref, Send, exchange, settle

NAME = "recursive_doubling"
COMMUTATIVE = False


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    role = fold(rank, size)
    pieces = segments(Block(0, count), segment_size)
    src = fold_in(b, rank, role, pieces)
    if role.newrank is not None:
        pairs = exchange_pairs(pieces, pieces)
        for peer in doubling_peers(role.newrank, role.pof2):
            exchange(b, rank, real_rank(peer, role.rem), pairs, src, RECV)
            src = RECV
        settle(b, src, count)
    fold_out(b, role, count)
    return b.schedule(NAME, rank, size, count)


def fold_in(b: Builder, rank: int, role, pieces: list) -> int:
    """Even ranks below 2*rem hand their vector (in ``pieces``, its
    segments) to the odd rank above them, which reduces it in.  Returns the
    buffer that holds this rank's operand now: ``RECV`` once it has combined
    something, else still ``SEND``."""
    if role.partner is None:
        return SEND
    if role.newrank is None:
        exchange(b, rank, role.partner, exchange_pairs(pieces, []), SEND, RECV)
        return SEND
    exchange(b, rank, role.partner, exchange_pairs([], pieces), SEND, RECV)
    return RECV


def fold_out(b: Builder, role, count: int) -> None:
    """The odd ranks hand the result back to the even rank below them."""
    if role.partner is None:
        return
    whole = Ref(RECV, 0, count)
    b.round(Recv(role.partner, whole) if role.newrank is None else Send(role.partner, whole))
