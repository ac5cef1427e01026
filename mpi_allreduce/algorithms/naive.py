"""Naive all-reduce: every rank sends its whole vector to every other rank.

The O(p^2) baseline: each of the p ranks sends its vector to the p-1 others
(one peer after another, in rank order, a segment a message) and keeps what
it receives; then it reduces all p vectors itself, in rank order, so every
rank computes the same bits and no commutativity is needed.  Each rank
sends and receives (p-1) n elements and reduces (p-1) n: cost
(p-1)(alpha + n beta) + (p-1) n gamma, and p vectors of scratch.
"""

from __future__ import annotations

from ..partition import Block, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Copy, Recv, Reduce, Ref, Send

NAME = "naive"
COMMUTATIVE = False


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    b.need_scratch(size * count)
    _exchange(b, rank, size, count, segment_size)
    _reduce_in_rank_order(b, size, count)
    return b.schedule(NAME, rank, size, count)


def _slot(q: int, count: int, offset: int = 0, length: int = 0) -> Ref:
    """Where rank q's vector is kept: scratch slot q."""
    return Ref(SCRATCH, q * count + offset, length)


def _exchange(b: Builder, rank: int, size: int, count: int, cut: int) -> None:
    """Own vector into its slot; then with every other rank in turn, send
    ours and receive theirs into their slot."""
    if count:
        b.local(Copy(_slot(rank, count, 0, count), Ref(SEND, 0, count)))
    for q in range(size):
        if q == rank:
            continue
        for piece in segments(Block(0, count), cut):
            b.round(Send(q, Ref(SEND, piece.offset, piece.length)),
                    Recv(q, _slot(q, count, piece.offset, piece.length)))


def _reduce_in_rank_order(b: Builder, size: int, count: int) -> None:
    """result = x_0 OP x_1 OP ... OP x_{p-1}, from the slots (all sends are
    done: in place, the input may now be overwritten)."""
    if not count:
        return
    b.local(Copy(Ref(RECV, 0, count), _slot(0, count, 0, count)))
    for q in range(1, size):
        b.local(Reduce(Ref(RECV, 0, count), Ref(RECV, 0, count), _slot(q, count, 0, count)))
