"""Pipelined ring: the ring's steps, with segments in flight while others reduce.

Within a reduce-scatter step the block is cut into segments; while segment
k is being reduced into the vector, segment k+1 is already on the wire
(Isend/Irecv into the other half of a two-segment scratch)::

    time ->      post k=0 | post k=1, reduce k=0 | post k=2, reduce k=1 | ... | reduce k=S-1

The allgather moves no data through the CPU's arithmetic, so it simply
keeps two segments in flight.  Scratch: two segments, O(segment), however
long the vector.  Cost as the ring, with the reduction hidden behind the
transfer when segments are long enough: 2(p-1) S alpha + 2 n (p-1)/p beta
+ (n/p)/S gamma for S segments per block.
"""

from __future__ import annotations

from .ring import Ring


def _view(buf, seg):
    return None if seg is None else buf[seg.offset:seg.stop]


def _at(segs, k):
    return segs[k] if k < len(segs) else None


class PipelinedRing(Ring):
    name = "ring_pipelined"

    def __init__(self, plan):
        super().__init__(plan)
        width = self.incoming.shape[0]
        both = plan.scratch("incoming", 2 * width)  # grows the ring's one-segment scratch
        self.incoming = None  # and lets the smaller one go
        self.halves = (both[:width], both[width:])

    def __call__(self, send, buf) -> None:
        self._reduce_scatter(send, buf)
        self._allgather(buf)

    def _reduce_scatter(self, src, buf) -> None:
        """As :func:`ring.reduce_scatter`: own operands come from ``src``."""
        plan = self.plan
        outgoing = src
        for send_segs, recv_segs in self.rs_schedule:
            n = max(len(send_segs), len(recv_segs))

            def start(k):
                recv = _at(recv_segs, k)
                into = None if recv is None else self.halves[k % 2][:recv.length]
                return plan.post(_view(outgoing, _at(send_segs, k)), self.right, into,
                                 self.left, slot=k % 2)

            pending = start(0)
            for k in range(n):
                pending.wait()
                if k + 1 < n:
                    pending = start(k + 1)
                recv = _at(recv_segs, k)
                if recv is not None and recv.length:
                    plan.combine(self.halves[k % 2][:recv.length], src[recv.offset:recv.stop],
                                 out=buf[recv.offset:recv.stop])
            outgoing = buf

    def _allgather(self, buf) -> None:
        plan = self.plan
        for send_segs, recv_segs in self.ag_schedule:
            n = max(len(send_segs), len(recv_segs))
            pending = [None, None]
            for k in range(n):
                if pending[k % 2] is not None:
                    pending[k % 2].wait()
                pending[k % 2] = plan.post(_view(buf, _at(send_segs, k)), self.right,
                                           _view(buf, _at(recv_segs, k)), self.left, slot=k % 2)
            for p in pending:
                if p is not None:
                    p.wait()
