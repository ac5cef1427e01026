"""Driver all-reduce: everything to one root, reduced there in rank order, and back.

::

    step        rank 0 (root)                 rank i > 0
    gather i    recv x_i; acc = acc OP x_i    send x_i to 0     (i = 1 .. p-1)
    return i    send acc to i                 recv acc from 0

Cost (alpha-beta-gamma): 2(p-1)(alpha + n beta) + (p-1) n gamma, all of it
serialised at the root.  The classic baseline; needs no commutativity.
The vector is gathered in segments, each reduced as it arrives, so the
root's scratch is one segment.
"""

from __future__ import annotations

from ..partition import Block, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Recv, Reduce, Ref, Send, settle

NAME = "driver"
COMMUTATIVE = False
ROOT = 0


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    pieces = segments(Block(0, count), segment_size)
    if rank == ROOT:
        _gather_reduce(b, size, pieces)
    else:
        for piece in pieces:
            b.round(Send(ROOT, Ref(SEND, piece.offset, piece.length)))
    _return(b, rank, size, count)
    return b.schedule(NAME, rank, size, count)


def _gather_reduce(b: Builder, size: int, pieces: list) -> None:
    """The root receives every rank's vector a segment at a time and folds
    it into the result in rank order: acc = x_0 OP x_1 OP ... OP x_{p-1}."""
    acc = SEND
    for source in range(1, size):
        for piece in pieces:
            b.round(Recv(source, Ref(SCRATCH, 0, piece.length)))
            b.need_scratch(piece.length)
            if piece.length:
                b.local(Reduce(Ref(RECV, piece.offset, piece.length),
                               Ref(acc, piece.offset, piece.length),
                               Ref(SCRATCH, 0, piece.length)))
        acc = RECV
    settle(b, acc, pieces[-1].stop)


def _return(b: Builder, rank: int, size: int, count: int) -> None:
    whole = Ref(RECV, 0, count)
    if rank != ROOT:
        b.round(Recv(ROOT, whole))
        return
    for dest in range(1, size):
        b.round(Send(dest, whole))
