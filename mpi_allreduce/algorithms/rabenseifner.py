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
which is why vendors choose it for long vectors.  Scratch: n/2 elements.
Operands are combined lower rank first, so it needs associativity only.
"""

from __future__ import annotations

from ..partition import block_bounds, fold, halving_steps, real_rank
from .recursive_doubling import fold_in, fold_out


class Rabenseifner:
    name = "rabenseifner"

    def __init__(self, plan):
        self.plan = plan
        self.fold = fold(plan.rank, plan.size)
        blocks = block_bounds(plan.count, self.fold.pof2)

        def span(rng):
            first, last = rng
            return blocks[first].offset, blocks[last - 1].stop

        self.steps = []
        if self.fold.newrank is not None:
            for step in halving_steps(self.fold.newrank, self.fold.pof2):
                self.steps.append((real_rank(step.peer, self.fold.rem), span(step.keep),
                                   span(step.send)))
        widest = max((hi - lo for _, (lo, hi), _ in self.steps), default=0)
        # the fold-in needs the whole vector; the halving at most half of it
        self.incoming = plan.scratch("incoming", plan.count if self.fold.partner is not None
                                     else widest)

    def __call__(self, send, buf) -> None:
        src = fold_in(self.plan, self.fold, send, buf, self.incoming)
        self._reduce_scatter(src, buf)
        self._allgather(buf)
        fold_out(self.plan, self.fold, buf)

    def _reduce_scatter(self, src, buf) -> None:
        """Each kept range lies inside the one before, so after the first step
        the rank's operand is in ``buf``; before it, in ``src``."""
        plan = self.plan
        for peer, (klo, khi), (slo, shi) in self.steps:
            incoming = self.incoming[: khi - klo]
            plan.sendrecv(src[slo:shi], peer, incoming, peer)
            if peer < plan.rank:
                plan.combine(incoming, src[klo:khi], out=buf[klo:khi])
            else:
                plan.combine(src[klo:khi], incoming, out=buf[klo:khi])
            src = buf

    def _allgather(self, buf) -> None:
        plan = self.plan
        for peer, (klo, khi), (slo, shi) in reversed(self.steps):
            plan.sendrecv(buf[klo:khi], peer, buf[slo:shi], peer)
