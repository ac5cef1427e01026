"""Allgather, then reduce locally: every rank gathers every vector and combines all p.

Open MPI's ``coll/tuned`` all-reduce algorithm 7, "allgather_reduce"
(``ompi_coll_base_allreduce_intra_allgather_reduce`` in
``ompi/mca/coll/base/coll_base_allreduce.c``): trade bandwidth for
latency on tiny vectors.  The allgather here is Bruck's, which takes
ceil(lg p) rounds for any p: in round ``j`` (distance ``d = 2^j``) a rank
sends the first ``min(d, p-d)`` vectors it holds to rank ``r - d`` and
receives as many from rank ``r + d`` (mod p), after them; its scratch
holds the vectors of ranks ``r, r+1, ..., r-1`` (mod p) in that order::

    p = 5, rank 0       holds (slots 0..4 = ranks 0, 1, 2, 3, 4)
    round 0 (d = 1)     r0        <- r1               to r4
    round 1 (d = 2)     r0 r1     <- r2 r3            to r3
    round 2 (d = 4)     r0 .. r3  <- r4               to r1

Then each rank combines x_0 OP x_1 OP ... OP x_{p-1}, in rank order (Open
MPI folds them in the other order), so every rank computes the same bits
and a non-commutative op gets MPI's result.

Cost: ceil(lg p) alpha + (p-1) n beta + (p-1) n gamma: the fewest rounds
of any all-reduce for every p (recursive doubling needs two more for p not
a power of two) and p-1 times the ring's bytes, so it only pays for a few
bytes: it is a candidate of ``tune`` and ``auto`` for vectors of at most
:data:`CANDIDATE_UP_TO` bytes only (``registry.candidates``).

Scratch is what bounds it: p vectors.  The vector is taken a *piece* at a
time, ``max(1, segment_size // p)`` elements, so the p copies of a piece
fit in one segment (p elements at least, when a segment is shorter than
p); a vector longer than a piece takes ceil(lg p) rounds per piece.
"""

from __future__ import annotations

from ..partition import Block, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Copy, Recv, Reduce, Ref, Send, settle

NAME = "allgather_reduce"
COMMUTATIVE = False

#: the longest vector (bytes) ``tune`` measures it at and live selection
#: tries it on: past a few KiB its p-1 vectors a rank cannot win, and
#: measuring it up to 64 MiB would cost ``tune`` p-1 times the ring's bytes
CANDIDATE_UP_TO = 4096

__all__ = ["NAME", "COMMUTATIVE", "CANDIDATE_UP_TO", "build", "piece_size", "bruck_rounds"]


def piece_size(size: int, segment_size: int) -> int:
    """Elements of the vector gathered at a time: p of them fit in a segment."""
    return max(1, segment_size // size)


def bruck_rounds(rank: int, size: int) -> list[tuple[int, int, int, int]]:
    """``(send_to, receive_from, slots, first)`` per round of Bruck's
    allgather: send slots ``0 .. slots-1`` to ``send_to``, receive slots
    ``first .. first+slots-1`` from ``receive_from``."""
    out = []
    distance = 1
    while distance < size:
        n = min(distance, size - distance)
        out.append(((rank - distance) % size, (rank + distance) % size, n, distance))
        distance *= 2
    return out


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    if size == 1:
        settle(b, SEND, count)
        return b.schedule(NAME, rank, size, count)
    for piece in segments(Block(0, count), piece_size(size, segment_size)):
        _allgather(b, rank, size, piece)
        _reduce_in_rank_order(b, rank, size, piece)
    return b.schedule(NAME, rank, size, count)


def _slots(i: int, n: int, piece) -> Ref:
    """Slots ``i .. i+n-1`` of the scratch (a slot is one piece long)."""
    return Ref(SCRATCH, i * piece.length, n * piece.length)


def _allgather(b: Builder, rank: int, size: int, piece) -> None:
    """This piece of every rank's vector into the slots, rank ``rank + i``'s
    into slot i: this rank's own first, then Bruck's rounds."""
    b.need_scratch(size * piece.length)
    if piece.length:
        b.local(Copy(_slots(0, 1, piece), Ref(SEND, piece.offset, piece.length)))
    for send_to, receive_from, n, first in bruck_rounds(rank, size):
        b.round(Recv(receive_from, _slots(first, n, piece)), Send(send_to, _slots(0, n, piece)))


def _reduce_in_rank_order(b: Builder, rank: int, size: int, piece) -> None:
    """result = x_0 OP x_1 OP ... OP x_{p-1} for this piece, from the slots
    (rank q's in slot (q - rank) mod p)."""
    if not piece.length:
        return
    out = Ref(RECV, piece.offset, piece.length)

    def slot(q):
        return _slots((q - rank) % size, 1, piece)
    b.local(Reduce(out, slot(0), slot(1)))
    for q in range(2, size):
        b.local(Reduce(out, out, slot(q)))
