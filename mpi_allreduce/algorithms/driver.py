"""Driver all-reduce: everything to one root, reduced there in rank order, and back.

::

    step        rank 0 (root)                 rank i > 0
    gather i    recv x_i; acc = acc OP x_i    send x_i to 0     (i = 1 .. p-1)
    return i    send acc to i                 recv acc from 0

Cost (alpha-beta-gamma): 2(p-1)(alpha + n beta) + (p-1) n gamma, all of it
serialised at the root.  The classic baseline; needs no commutativity.
A vector longer than one segment is gathered in segments, each reduced as
it arrives, so the root's scratch is one segment.
"""

from __future__ import annotations

from ..partition import Block, exchange_pairs, segments

ROOT = 0


class Driver:
    name = "driver"

    def __init__(self, plan):
        self.plan = plan
        pieces = segments(Block(0, plan.count), plan.segment_size)
        # a vector of one segment travels whole, without views (the latency
        # path); a longer one segment by segment, reduced as it arrives
        self.pairs = None
        if len(pieces) > 1:
            self.pairs = exchange_pairs([], pieces) if plan.rank == ROOT else \
                exchange_pairs(pieces, [])
        self.incoming = None
        if plan.rank == ROOT:
            self.incoming = plan.scratch("incoming", min(plan.count, plan.segment_size))

    def __call__(self, send, buf) -> None:
        self._gather_reduce(send, buf)
        self._return(buf)

    def _gather_reduce(self, send, buf) -> None:
        plan, pairs = self.plan, self.pairs
        if plan.rank != ROOT:
            if pairs is None:
                plan.sendrecv(send, ROOT, None, ROOT)
            else:
                plan.exchange(ROOT, pairs, send, buf, None)
            return
        acc = send
        for source in range(1, plan.size):
            if pairs is None:
                plan.sendrecv(None, source, self.incoming, source)
                plan.combine(acc, self.incoming, out=buf)
            else:
                plan.exchange(source, pairs, acc, buf, self.incoming)
            acc = buf

    def _return(self, buf) -> None:
        plan = self.plan
        if plan.rank != ROOT:
            plan.sendrecv(None, ROOT, buf, ROOT)
            return
        for dest in range(1, plan.size):
            plan.sendrecv(buf, dest, None, dest)
