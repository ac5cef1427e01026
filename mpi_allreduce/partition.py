"""Pure index maths for the all-reduce algorithms: no MPI, no arrays.

Vocabulary (used the same way in every algorithm module):

block
    One of ``p`` contiguous pieces of the vector, one per rank of the
    communicator.  ``count`` elements split as evenly as possible: the first
    ``count % p`` blocks hold one element more.  Blocks may be empty.
segment
    A piece of a block, at most ``segment_size`` elements, the unit that one
    message carries (and that a pipelined ring overlaps with the reduction).
step
    One round of messages; in a step every rank posts exactly one
    send-receive, even when its part of the message is empty.
peer
    The rank a step exchanges with.

The ring (p = 4), reduce-scatter then allgather.  In step ``s`` rank ``r``
sends block ``(r - s) mod p`` to ``r + 1`` and receives block
``(r - s - 1) mod p`` from ``r - 1``::

        +----> r0 ----> r1 ----> r2 ----> r3 ----+
        |                                        |
        +----------------------------------------+

    step   r0 sends  r1 sends  r2 sends  r3 sends
    RS 0      b0        b1        b2        b3
    RS 1      b3        b0        b1        b2
    RS 2      b2        b3        b0        b1      -> r owns block (r+1) mod p
    AG 0      b1        b2        b3        b0
    AG 1      b0        b1        b2        b3
    AG 2      b3        b0        b1        b2

Recursive doubling with the fold for ``p`` not a power of two (MPICH's
scheme): ``rem = p - pof2``; among the first ``2*rem`` ranks every even rank
hands its vector to the odd rank above it and sits out; the remaining
``pof2`` ranks get a new rank ``0..pof2-1`` and exchange with
``newrank ^ mask`` for ``mask = 1, 2, 4, ...``; then every odd rank hands the
result back to the even rank below it.
"""

from __future__ import annotations

import functools

from itertools import zip_longest
from typing import NamedTuple, Optional

__all__ = [
    "Block",
    "block_bounds",
    "blocks_of",
    "block_of",
    "ring_reduce_scatter_steps",
    "ring_allgather_steps",
    "ring_owned_block",
    "segments",
    "exchange_pairs",
    "pow2_floor",
    "Fold",
    "fold",
    "doubling_peers",
    "halving_steps",
    "HalvingStep",
]


class Block(NamedTuple):
    """Element range ``[offset, offset + length)`` of one block."""

    offset: int
    length: int

    @property
    def stop(self) -> int:
        return self.offset + self.length


@functools.lru_cache(maxsize=4)
def block_bounds(count: int, parts: int) -> tuple:
    """Split ``count`` elements into ``parts`` contiguous blocks (a tuple
    of :class:`Block`).

    The first ``count % parts`` blocks get one element more; blocks may be
    empty when ``count < parts``.  The last few answers are kept (every
    rank of a simulation asks the same one: building p schedules would
    otherwise cost p^2).
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    q, r = divmod(count, parts)
    blocks = []
    offset = 0
    for i in range(parts):
        length = q + (1 if i < r else 0)
        blocks.append(Block(offset, length))
        offset += length
    return tuple(blocks)


def blocks_of(counts) -> list[Block]:
    """The blocks of a vector cut into ``counts`` (in order, contiguous)."""
    blocks, offset = [], 0
    for c in counts:
        blocks.append(Block(offset, c))
        offset += c
    return blocks


def block_of(index: int, count: int, parts: int) -> int:
    """Which block of :func:`block_bounds` holds element ``index``."""
    if not 0 <= index < count:
        raise ValueError(f"index {index} outside [0, {count})")
    q, r = divmod(count, parts)
    big = r * (q + 1)
    if index < big:
        return index // (q + 1)
    return r + (index - big) // q


class RingStep(NamedTuple):
    send_block: int
    recv_block: int


def ring_reduce_scatter_steps(rank: int, size: int) -> list[RingStep]:
    """Blocks rank ``rank`` sends to ``rank+1`` and receives from ``rank-1``.

    After the ``size - 1`` steps rank ``r`` holds the full reduction of block
    :func:`ring_owned_block` ``(r, size)``.
    """
    return [RingStep((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]


def ring_allgather_steps(rank: int, size: int) -> list[RingStep]:
    """Allgather schedule that starts from the block a rank owns after the
    reduce-scatter and ends with every block everywhere."""
    return [RingStep((rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1)]


def ring_owned_block(rank: int, size: int) -> int:
    """The block that rank ``rank`` holds fully reduced after the reduce-scatter."""
    return (rank + 1) % size


def segments(block: Block, segment_size: int) -> list[Block]:
    """Cut a block into segments of at most ``segment_size`` elements.

    An empty block still yields one empty segment, so that every rank posts
    the same number of messages in every step.
    """
    if segment_size < 1:
        raise ValueError(f"segment_size must be >= 1, got {segment_size}")
    if block.length <= segment_size:
        return [block]
    return [
        Block(off, min(segment_size, block.stop - off))
        for off in range(block.offset, block.stop, segment_size)
    ]


def exchange_pairs(sent: list[Block], kept: list[Block]) -> list[tuple]:
    """The messages of one step with one peer, as slices: ``(sent, kept,
    into)`` per message, where ``sent`` is the range this rank sends,
    ``kept`` the range whose peer copy it receives and combines (None when
    it receives nothing, or nothing but an empty message) and ``into`` the
    part of the incoming scratch that copy lands in (None: no receive).
    The i-th segment sent pairs with the i-th kept; either list may be the
    shorter (or empty: a step that only sends, or only receives)."""
    pairs = []
    for send, keep in zip_longest(sent, kept):
        pairs.append((
            None if send is None else slice(send.offset, send.stop),
            None if keep is None or not keep.length else slice(keep.offset, keep.stop),
            None if keep is None else slice(0, keep.length),
        ))
    return pairs


def pow2_floor(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


class Fold(NamedTuple):
    """A rank's part in the fold for non-power-of-two sizes.

    ``newrank`` is its rank among the ``pof2`` ranks that take part in the
    power-of-two phase, or None if it sits out; ``partner`` is the rank it
    exchanges with during fold-in and fold-out (None if it has none).
    """

    pof2: int
    rem: int
    newrank: Optional[int]
    partner: Optional[int]


def fold(rank: int, size: int) -> Fold:
    """Role of ``rank`` in the fold of ``size`` ranks down to a power of two."""
    pof2 = pow2_floor(size)
    rem = size - pof2
    if rank < 2 * rem:
        if rank % 2 == 0:
            return Fold(pof2, rem, None, rank + 1)
        return Fold(pof2, rem, rank // 2, rank - 1)
    return Fold(pof2, rem, rank - rem, None)


def real_rank(newrank: int, rem: int) -> int:
    """Inverse of the fold's renumbering: the real rank of ``newrank``."""
    return 2 * newrank + 1 if newrank < rem else newrank + rem


def doubling_peers(newrank: int, pof2: int) -> list[int]:
    """New ranks that ``newrank`` exchanges with, for mask = 1, 2, 4, ..."""
    peers = []
    mask = 1
    while mask < pof2:
        peers.append(newrank ^ mask)
        mask <<= 1
    return peers


class HalvingStep(NamedTuple):
    """One step of recursive halving (Rabenseifner's reduce-scatter).

    The rank keeps the element range ``keep`` and sends ``send`` to ``peer``
    (a new rank); both ranges are unions of consecutive blocks of the
    ``pof2``-way block split, given as ``(first_block, last_block_exclusive)``.
    """

    peer: int
    keep: tuple[int, int]
    send: tuple[int, int]


def halving_steps(newrank: int, pof2: int) -> list[HalvingStep]:
    """Recursive-halving schedule over ``pof2`` blocks, by distance doubling
    (peer at distance 1 first, as MPICH does): after step k a rank's range
    holds the reduction over its 2^(k+1) consecutive ranks, so operands meet
    in rank order and a non-commutative op gets MPI's result.

    After the steps ``newrank`` keeps exactly block ``bit_reversed(newrank)``.
    The allgather by recursive doubling replays these steps in reverse
    order with ``keep`` and ``send`` swapped.
    """
    steps = []
    lo, hi = 0, pof2
    dist = 1
    while dist < pof2:
        peer = newrank ^ dist
        mid = lo + (hi - lo) // 2
        if newrank < peer:
            keep, send = (lo, mid), (mid, hi)
        else:
            keep, send = (mid, hi), (lo, mid)
        steps.append(HalvingStep(peer, keep, send))
        lo, hi = keep
        dist *= 2
    return steps

