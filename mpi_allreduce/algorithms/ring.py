"""Ring all-reduce: reduce-scatter around the ring, then allgather around it.

The vector is cut into p blocks (uneven and empty blocks are normal); in
each of the p-1 reduce-scatter steps a rank sends one block to ``rank+1``
and receives one from ``rank-1``, adding it into its own copy; after them
rank r holds block (r+1) mod p fully reduced, and p-1 allgather steps pass
the reduced blocks on around the ring.  The step table is in
:mod:`mpi_allreduce.partition`.  Each rank sends 2(p-1)/p of the vector.

Blocks travel in segments of at most ``segment_size`` elements, so scratch
memory is one segment, O(min(n/p, segment)), never a copy of the vector.

Cost: 2(p-1) alpha + 2 n (p-1)/p beta + n (p-1)/p gamma (one message per
step; more with segments).  Block b is reduced in the order b, b+1, ...,
b-1 (mod p): a fixed order, so every rank gets the same bits, but one that
differs per block, so the ring needs a commutative op (every predefined
MPI op is).
"""

from __future__ import annotations

from itertools import zip_longest

from ..partition import (block_bounds, blocks_of, ring_allgather_steps,
                         ring_reduce_scatter_steps, segments)
from ..schedule import (RECV, SCRATCH, SEND, Builder, Copy, Recv, Reduce, Ref, Schedule, Send,
                        map_refs)

NAME = "ring"
COMMUTATIVE = True


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    ring = list(range(size))
    blocks = block_bounds(count, size)
    reduce_scatter(b, ring, rank, blocks, segment_size)
    allgather(b, ring, rank, blocks, segment_size)
    return b.schedule(NAME, rank, size, count)


def _neighbours(ring: list, index: int) -> tuple:
    """(right, left): the ranks after and before ring position ``index``."""
    q = len(ring)
    return ring[(index + 1) % q], ring[(index - 1) % q]


def reduce_scatter(b: Builder, ring: list, index: int, blocks: list, cut: int) -> None:
    """p-1 steps around ``ring`` (ranks; this rank at position ``index``);
    afterwards block (index+1) mod p is fully reduced in ``RECV``.

    Every block a rank receives in this phase is one it has not touched yet,
    so its own operand is read from ``SEND`` and the partial sum written to
    ``RECV``; the block sent in step 0 is its input, every later one was
    received (and reduced) the step before."""
    right, left = _neighbours(ring, index)
    steps = ring_reduce_scatter_steps(index, len(ring))
    if not steps:
        b.local(Copy(Ref(RECV, 0, blocks[0].length), Ref(SEND, 0, blocks[0].length)))
    outgoing = SEND
    for step in steps:
        sent, received = blocks[step.send_block], blocks[step.recv_block]
        for send, recv in zip_longest(segments(sent, cut), segments(received, cut)):
            b.round(None if send is None else Send(right, Ref(outgoing, send.offset, send.length)),
                    None if recv is None else Recv(left, Ref(SCRATCH, 0, recv.length)))
            if recv is not None and recv.length:
                b.need_scratch(recv.length)
                b.local(Reduce(Ref(RECV, recv.offset, recv.length), Ref(SCRATCH, 0, recv.length),
                               Ref(SEND, recv.offset, recv.length)))
        outgoing = RECV


def allgather(b: Builder, ring: list, index: int, blocks: list, cut: int,
              own_from_send: bool = False) -> None:
    """p-1 steps that pass every reduced block on to every rank.
    ``own_from_send``: the first step sends this rank's own block from
    ``SEND`` (where the caller's input lies, untouched by this call) rather
    than from its copy in ``RECV``, just written."""
    right, left = _neighbours(ring, index)
    for number, step in enumerate(ring_allgather_steps(index, len(ring))):
        sent, received = blocks[step.send_block], blocks[step.recv_block]
        for send, recv in zip_longest(segments(sent, cut), segments(received, cut)):
            source = None
            if send is not None:
                source = Ref(SEND, send.offset - sent.offset, send.length) \
                    if own_from_send and number == 0 else Ref(RECV, send.offset, send.length)
            b.round(None if send is None else Send(right, source),
                    None if recv is None else Recv(left, Ref(RECV, recv.offset, recv.length)))


# --- the two halves on their own: MPI's Reduce_scatter and Allgather(v) ---------

def _ring_order(blocks: list) -> list:
    """``blocks`` as the ring phases index them: after the reduce-scatter
    (and at the start of the allgather) ring position r holds entry
    (r+1) mod p, which is then rank r's own block."""
    p = len(blocks)
    return [blocks[(j - 1) % p] for j in range(p)]


def build_reduce_scatter(rank: int, size: int, counts: tuple, segment_size: int,
                         in_place: bool = False) -> Schedule:
    """MPI's Reduce_scatter: ``SEND`` holds ``sum(counts)`` elements; rank r
    ends with the reduced block r (``counts[r]`` elements) in ``RECV``.

    The ring's reduce-scatter, its partial sums kept in scratch after the
    segment (``RECV`` is only this rank's block long).  This rank's block
    is reduced once, in the last step: out of place straight into ``RECV``;
    in place (``SEND`` is ``RECV``, whose start holds block 0's input until
    the ring has read it) in scratch, then copied out.  Scratch: one segment
    plus the vector."""
    b = Builder()
    blocks = blocks_of(counts)
    reduce_scatter(b, list(range(size)), rank, _ring_order(blocks), segment_size)
    phase = b.schedule("ring", rank, size, sum(counts))
    work = max(phase.scratch, 1)  # the partial sums live after the segment
    mine = blocks[rank]

    def move(ref):
        if ref.buf != RECV:
            return ref
        if not in_place and mine.offset <= ref.offset < mine.stop:
            return Ref(RECV, ref.offset - mine.offset, ref.length)
        return Ref(SCRATCH, work + ref.offset, ref.length)

    rounds = map_refs(phase, move).rounds
    if in_place:
        rounds += ((Copy(Ref(RECV, 0, mine.length), Ref(SCRATCH, work + mine.offset,
                                                         mine.length)),),)
    return phase._replace(rounds=rounds, scratch=work + sum(counts))


def build_allgather(rank: int, size: int, counts: tuple, segment_size: int,
                    in_place: bool) -> Schedule:
    """MPI's Allgather(v): ``SEND`` holds this rank's ``counts[rank]``
    elements; every rank ends with all blocks in rank order in ``RECV``
    (in place, this rank's block is already there).  The ring's allgather."""
    b = Builder()
    blocks = blocks_of(counts)
    mine = blocks[rank]
    if not in_place:
        b.local(Copy(Ref(RECV, mine.offset, mine.length), Ref(SEND, 0, mine.length)))
    # out of place, the first step sends this rank's block from the caller's
    # input: a message whose sender just wrote it (the copy) costs several
    # times as much under Open MPI's single-copy path (benchmarks/fresh_pages.py)
    allgather(b, list(range(size)), rank, _ring_order(blocks), segment_size,
              own_from_send=not in_place)
    return b.schedule("ring", rank, size, sum(counts))
