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

from ..partition import (
    block_bounds,
    ring_allgather_steps,
    ring_reduce_scatter_steps,
    segments,
)


class Ring:
    name = "ring"

    def __init__(self, plan):
        self.plan = plan
        size, rank = plan.size, plan.rank
        self.right = (rank + 1) % size
        self.left = (rank - 1) % size
        blocks = block_bounds(plan.count, size)
        cut = plan.segment_size
        # per step: (segments to send, segments to receive)
        self.rs_schedule = [
            (segments(blocks[s.send_block], cut), segments(blocks[s.recv_block], cut))
            for s in ring_reduce_scatter_steps(rank, size)
        ]
        self.ag_schedule = [
            (segments(blocks[s.send_block], cut), segments(blocks[s.recv_block], cut))
            for s in ring_allgather_steps(rank, size)
        ]
        longest = max((b.length for b in blocks), default=0)
        self.incoming = plan.scratch("incoming", min(longest, cut))

    def __call__(self, send, buf) -> None:
        reduce_scatter(self, send, buf)
        allgather(self, buf)


def reduce_scatter(ring: Ring, src, buf) -> None:
    """p-1 steps; afterwards this rank's block (rank+1) mod p is fully reduced.

    Every block a rank receives in this phase is one it has not touched yet,
    so the rank's own operand is read from ``src`` (its input) and the
    partial sum written to ``buf``; the block sent in step 0 is the rank's
    own input, every later one was received (and reduced) the step before.
    """
    plan, incoming = ring.plan, ring.incoming
    if not ring.rs_schedule and src is not buf:
        plan.backend.copy(buf, src)  # a ring of one
    outgoing = src
    for send_segs, recv_segs in ring.rs_schedule:
        for send, recv in zip_longest(send_segs, recv_segs):
            into = incoming[: recv.length] if recv is not None else None
            plan.sendrecv(
                outgoing[send.offset:send.stop] if send is not None else None, ring.right,
                into, ring.left,
            )
            if recv is not None and recv.length:
                plan.combine(into, src[recv.offset:recv.stop], out=buf[recv.offset:recv.stop])
        outgoing = buf


def allgather(ring: Ring, buf) -> None:
    """p-1 steps that pass every reduced block on to every rank."""
    plan = ring.plan
    for send_segs, recv_segs in ring.ag_schedule:
        for send, recv in zip_longest(send_segs, recv_segs):
            plan.sendrecv(
                buf[send.offset:send.stop] if send is not None else None, ring.right,
                buf[recv.offset:recv.stop] if recv is not None else None, ring.left,
            )
