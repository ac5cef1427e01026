"""Driver all-reduce: everything to one root, reduced there in rank order, and back.

::

    step        rank 0 (root)                 rank i > 0
    gather i    recv x_i; acc = acc OP x_i    send x_i to 0     (i = 1 .. p-1)
    return i    send acc to i                 recv acc from 0

Cost (alpha-beta-gamma): 2(p-1)(alpha + n beta) + (p-1) n gamma, all of it
serialised at the root.  The classic baseline; needs no commutativity.
"""

from __future__ import annotations

ROOT = 0


class Driver:
    name = "driver"

    def __init__(self, plan):
        self.plan = plan
        self.incoming = plan.scratch("incoming", plan.count) if plan.rank == ROOT else None

    def __call__(self, send, buf) -> None:
        self._gather_reduce(send, buf)
        self._return(buf)

    def _gather_reduce(self, send, buf) -> None:
        plan = self.plan
        if plan.rank != ROOT:
            plan.sendrecv(send, ROOT, None, ROOT)
            return
        acc = send
        for source in range(1, plan.size):
            plan.sendrecv(None, source, self.incoming, source)
            plan.combine(acc, self.incoming, out=buf)
            acc = buf

    def _return(self, buf) -> None:
        plan = self.plan
        if plan.rank != ROOT:
            plan.sendrecv(None, ROOT, buf, ROOT)
            return
        for dest in range(1, plan.size):
            plan.sendrecv(buf, dest, None, dest)
