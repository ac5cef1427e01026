"""Double binary tree all-reduce: two trees, each carrying half the vector.

Tree A is the in-order binary tree over ranks 0..p-1 (the root at the
middle, each subtree a contiguous range of ranks); tree B is the same tree
over the ranks in reverse (rank p-1-i at position i).  Mirroring moves many
of tree A's interior ranks to tree B's leaves, so the two trees share the
work of forwarding (NCCL's double binary tree; Sanders, Speck and Traeff's
two-tree).  Here that is exact for some p (every rank is interior in one
tree only at p = 6) and not for others (at p = 4 and 8 two ranks are
interior in both): NCCL's shifted construction balances better, and this
one was chosen because it keeps rank order.  Each tree reduces its half up to its root and
broadcasts it back down, a segment at a time, so halves and segments
pipeline: about 2 log2(p) (alpha + s beta) + n beta + n gamma / 2 per rank
for segments of s bytes -- full bandwidth with logarithmic latency.

Every subtree covers a contiguous range of ranks, so a node combines
(lower-ranked child's range) OP (its own) OP (higher-ranked child's range):
rank order, no commutativity needed, the same bits on every rank.
"""

from __future__ import annotations

import functools

from ..partition import Block, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Copy, Recv, Reduce, Ref, Send

NAME = "double_binary_tree"
COMMUTATIVE = False


@functools.lru_cache(maxsize=64)
def inorder_tree(size: int) -> tuple:
    """(parent, children) by position of the in-order binary tree over
    positions 0..size-1 (parent -1 at the root; children in position order)."""
    parent, children = [-1] * size, [[] for _ in range(size)]
    stack = [(0, size, -1)]
    while stack:
        lo, hi, up = stack.pop()
        if lo >= hi:
            continue
        middle = (lo + hi) // 2
        parent[middle] = up
        if up >= 0:
            children[up].append(middle)
        stack += [(middle + 1, hi, middle), (lo, middle, middle)]
    for kids in children:
        kids.sort()
    return tuple(parent), tuple(tuple(k) for k in children)


def links(rank: int, size: int, mirrored: bool) -> tuple:
    """(parent rank or -1, child ranks) of ``rank`` in tree A or (mirrored) B."""
    parent, children = inorder_tree(size)

    def rank_of(pos):
        return size - 1 - pos if mirrored else pos
    pos = rank_of(rank)  # the map is its own inverse
    up = parent[pos]
    return (rank_of(up) if up >= 0 else -1), [rank_of(c) for c in children[pos]]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    half = (count + 1) // 2
    halves = [(Block(0, half), False), (Block(half, count - half), True)]
    pieces = [(segments(block, segment_size), mirrored) for block, mirrored in halves]
    steps = max(len(p) for p, _ in pieces)
    for k in range(steps):  # the two trees' segments interleaved: they pipeline
        for segs, mirrored in pieces:
            if k < len(segs):
                _reduce(b, rank, *links(rank, size, mirrored), segs[k])
    for k in range(steps):
        for segs, mirrored in pieces:
            if k < len(segs):
                _broadcast(b, *links(rank, size, mirrored), segs[k])
    return b.schedule(NAME, rank, size, count)


def _reduce(b: Builder, rank: int, up: int, kids: list, piece: Block) -> None:
    """Fold the children's partial results into this segment in rank order
    (lower child, own, higher child) and hand the result to the parent."""
    n, off = piece.length, piece.offset
    lower = [c for c in kids if c < rank]
    higher = [c for c in kids if c > rank]
    acc = SEND
    for child in lower:  # at most one: (child's range) OP own
        b.round(Recv(child, Ref(SCRATCH, 0, n)))
        b.need_scratch(n)
        if n:
            b.local(Reduce(Ref(RECV, off, n), Ref(SCRATCH, 0, n), Ref(SEND, off, n)))
        acc = RECV
    for child in higher:  # at most one: acc OP (child's range)
        b.round(Recv(child, Ref(SCRATCH, 0, n)))
        b.need_scratch(n)
        if n:
            b.local(Reduce(Ref(RECV, off, n), Ref(acc, off, n), Ref(SCRATCH, 0, n)))
        acc = RECV
    if up >= 0:
        b.round(Send(up, Ref(acc, off, n)))
    elif acc == SEND:  # a root without children (one rank)
        b.local(Copy(Ref(RECV, off, n), Ref(SEND, off, n)))


def _broadcast(b: Builder, up: int, kids: list, piece: Block) -> None:
    whole = Ref(RECV, piece.offset, piece.length)
    if up >= 0:
        b.round(Recv(up, whole))
    for child in kids:
        b.round(Send(child, whole))
