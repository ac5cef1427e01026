"""Tree all-reduce: a binomial reduce to rank 0, then a binomial broadcast.

::

    reduce (p = 8)                      broadcast: the same edges, downwards
    r0 <- r1, r0 <- r2, r0 <- r4        r0 -> r4, r0 -> r2, r0 -> r1
    r2 <- r3, r4 <- r5, r4 <- r6        r4 -> r6, r4 -> r5, r2 -> r3
    r6 <- r7                            r6 -> r7

Rank r's children are r + 2^k for every k below the lowest set bit of r
(every k for rank 0) while r + 2^k < p; its parent is r minus that bit.
After its children 0..k-1, rank r holds ranks [r, r + 2^k) reduced; child
r + 2^k brings [r + 2^k, r + 2^(k+1)), so every element is combined in
rank order and the tree needs no commutativity.

The vector travels in segments and every rank works segment by segment,
so a long vector pipelines down the tree: cost about
2 log2(p) (alpha + s beta) + 2 n beta + n gamma (s the segment) against the
ring's 2(p-1) alpha + 2n (p-1)/p beta: fewer messages, more bytes per link.
"""

from __future__ import annotations

from ..partition import Block, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Copy, Recv, Reduce, Ref, Send

NAME = "tree"
COMMUTATIVE = False


def children(rank: int, size: int) -> list:
    """Rank r's children in the binomial tree, nearest first."""
    out, bit = [], 1
    while rank + bit < size and not rank & bit:
        out.append(rank + bit)
        bit <<= 1
    return out


def parent(rank: int) -> int:
    """Rank r's parent (r minus its lowest set bit); -1 for the root."""
    return rank - (rank & -rank) if rank else -1


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    pieces = segments(Block(0, count), segment_size)
    for piece in pieces:
        _reduce(b, rank, size, piece)
    for piece in pieces:
        _broadcast(b, rank, size, piece)
    return b.schedule(NAME, rank, size, count)


def _reduce(b: Builder, rank: int, size: int, piece: Block) -> None:
    """Receive each child's partial result for this segment and fold it in
    (lower ranks first); hand the result to the parent."""
    n, acc = piece.length, SEND
    for child in children(rank, size):
        b.round(Recv(child, Ref(SCRATCH, 0, n)))
        b.need_scratch(n)
        if n:
            b.local(Reduce(Ref(RECV, piece.offset, n), Ref(acc, piece.offset, n),
                           Ref(SCRATCH, 0, n)))
        acc = RECV
    if rank:
        b.round(Send(parent(rank), Ref(acc, piece.offset, n)))
    elif acc == SEND:  # one rank: the input is the result
        b.local(Copy(Ref(RECV, piece.offset, n), Ref(SEND, piece.offset, n)))


def _broadcast(b: Builder, rank: int, size: int, piece: Block) -> None:
    """Take the result from the parent, pass it to the children (farthest,
    i.e. largest subtree, first)."""
    whole = Ref(RECV, piece.offset, piece.length)
    if rank:
        b.round(Recv(parent(rank), whole))
    for child in reversed(children(rank, size)):
        b.round(Send(child, whole))
