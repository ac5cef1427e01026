"""Rabenseifner: reduce-scatter by recursive halving, allgather by recursive doubling.

After the fold to ``pof2`` ranks (as in recursive doubling), the vector is
cut into ``pof2`` blocks.  Halving: in step k a rank swaps half of its
current range with the peer at distance pof2/2^(k+1), keeps the half on its
own side and reduces the peer's copy of it in; after lg pof2 steps new rank
i holds block i fully reduced.  Doubling replays the steps backwards and
hands the reduced halves over, so every rank ends with every block::

    pof2 = 4, blocks b0..b3         new 0      new 1      new 2      new 3
    halving, distance 2     keep    b0 b1      b0 b1      b2 b3      b2 b3
    halving, distance 1     keep    b0         b1         b2         b3
    doubling, distance 1    gets    b1         b0         b3         b2
    doubling, distance 2    gets    b2 b3      b2 b3      b0 b1      b0 b1

Cost: 2 lg p alpha + 2 n (p-1)/p beta + n (p-1)/p gamma (plus the fold when
p is not a power of two): the ring's bandwidth with lg p latency terms,
which is why vendors choose it for long vectors.  Messages travel in
segments, so scratch is one segment at most (min(n, segment) elements).
Operands are combined lower rank first, so it needs associativity only.
"""

from __future__ import annotations

from ..partition import (
    Block,
    block_bounds,
    exchange_pairs,
    fold,
    halving_steps,
    real_rank,
    segments,
)
from .recursive_doubling import fold_in, fold_out, fold_pairs


class Rabenseifner:
    name = "rabenseifner"

    def __init__(self, plan):
        self.plan = plan
        self.fold = fold(plan.rank, plan.size)
        blocks = block_bounds(plan.count, self.fold.pof2)
        cut = plan.segment_size

        def span(rng):
            first, last = rng
            return Block(blocks[first].offset, blocks[last - 1].stop - blocks[first].offset)

        # per halving step: (peer, kept range, sent range, their messages)
        self.steps = []
        if self.fold.newrank is not None:
            for step in halving_steps(self.fold.newrank, self.fold.pof2):
                keep, send = span(step.keep), span(step.send)
                pairs = exchange_pairs(segments(send, cut), segments(keep, cut))
                self.steps.append((real_rank(step.peer, self.fold.rem), keep, send, pairs))
        self.folding = fold_pairs(self.fold, segments(Block(0, plan.count), cut))
        widest = max((keep.length for _, keep, _, _ in self.steps), default=0)
        # the fold-in moves the whole vector, the halving half of it at most:
        # both in segments
        self.incoming = plan.scratch("incoming", min(plan.count if self.folding else widest,
                                                     cut))

    def __call__(self, send, buf) -> None:
        src = fold_in(self.plan, self.fold, self.folding, send, buf, self.incoming)
        self._reduce_scatter(src, buf)
        self._allgather(buf)
        fold_out(self.plan, self.fold, buf)

    def _reduce_scatter(self, src, buf) -> None:
        """Each kept range lies inside the one before, so after the first step
        the rank's operand is in ``buf``; before it, in ``src``."""
        for peer, _, _, pairs in self.steps:
            self.plan.exchange(peer, pairs, src, buf, self.incoming)
            src = buf

    def _allgather(self, buf) -> None:
        plan = self.plan
        for peer, keep, send, _ in reversed(self.steps):
            plan.sendrecv(buf[keep.offset:keep.stop], peer, buf[send.offset:send.stop], peer)
