"""Pipelined ring: the ring's steps, with segments in flight while others reduce.

Within a reduce-scatter step the block is cut into segments; while segment
k is being reduced into the vector, segment k+1 is already on the wire
(received into the other half of a two-segment scratch)::

    round        k=0        k=1                  k=2                  ...  after
    messages     seg 0      seg 1                seg 2
    local                   reduce seg 0         reduce seg 1              reduce seg S-1

The allgather moves no data through the CPU's arithmetic; it keeps two
segments in flight.  Scratch: two segments, O(segment), however long the
vector.  Cost as the ring, with the reduction hidden behind the transfer
when segments are long enough: 2(p-1) S alpha + 2 n (p-1)/p beta
+ (n/p)/S gamma for S segments per block.  Needs a commutative op, as the ring.
"""

from __future__ import annotations

from itertools import zip_longest

from ..partition import block_bounds, ring_allgather_steps, ring_reduce_scatter_steps, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Copy, Recv, Reduce, Ref, Send

NAME = "ring_pipelined"
COMMUTATIVE = True


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    b = Builder()
    blocks = block_bounds(count, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    _reduce_scatter(b, rank, size, blocks, segment_size, right, left)
    _allgather(b, rank, size, blocks, segment_size, right, left)
    return b.schedule(NAME, rank, size, count)


def _reduce_scatter(b, rank, size, blocks, cut, right, left) -> None:
    steps = ring_reduce_scatter_steps(rank, size)
    if not steps:
        b.local(Copy(Ref(RECV, 0, blocks[0].length), Ref(SEND, 0, blocks[0].length)))
    width = min(max((blk.length for blk in blocks), default=0), cut)
    outgoing = SEND
    for step in steps:
        pairs = list(zip_longest(segments(blocks[step.send_block], cut),
                                 segments(blocks[step.recv_block], cut)))
        previous = None  # the segment that arrived the round before, and its half
        for k, (send, recv) in enumerate(pairs):
            half = (k % 2) * width
            b.round(None if send is None else Send(right, Ref(outgoing, send.offset, send.length)),
                    None if recv is None else Recv(left, Ref(SCRATCH, half, recv.length)),
                    None if previous is None else _reduce(*previous))
            previous = None if recv is None or not recv.length else (recv, half)
            if recv is not None:
                b.need_scratch(half + recv.length)
        if previous is not None:
            b.local(_reduce(*previous))
        outgoing = RECV


def _reduce(recv, half) -> Reduce:
    return Reduce(Ref(RECV, recv.offset, recv.length), Ref(SCRATCH, half, recv.length),
                  Ref(SEND, recv.offset, recv.length))


def _allgather(b, rank, size, blocks, cut, right, left) -> None:
    for step in ring_allgather_steps(rank, size):
        pairs = list(zip_longest(segments(blocks[step.send_block], cut),
                                 segments(blocks[step.recv_block], cut)))
        for k in range(0, len(pairs), 2):  # two segments in flight
            actions = []
            for send, recv in pairs[k:k + 2]:
                actions.append(None if send is None else
                               Send(right, Ref(RECV, send.offset, send.length)))
                actions.append(None if recv is None else
                               Recv(left, Ref(RECV, recv.offset, recv.length)))
            b.round(*actions)
