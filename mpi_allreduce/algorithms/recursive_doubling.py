"""Recursive doubling: lg p exchanges of the whole vector.

For p a power of two, in step k rank r swaps its vector with ``r ^ 2^k``
and both combine the two (lower rank's operand first, so both compute the
same bits).  For other p the extra ranks fold in first and out last
(MPICH and Open MPI do the same)::

    p = 6, pof2 = 4, rem = 2      ranks 0..3 fold in pairs; 4, 5 go straight on

    fold in     0 -> 1      2 -> 3                      (1, 3, 4, 5 -> new 0..3)
    mask 1      1 <-> 3     4 <-> 5                     (new 0<->1, 2<->3)
    mask 2      1 <-> 4     3 <-> 5                     (new 0<->2, 1<->3)
    fold out    1 -> 0      3 -> 2

Cost: lg p (alpha + n beta + n gamma), plus 2 (alpha + n beta) + n gamma
when p is not a power of two.  Latency-optimal for short vectors, moves the
whole vector every step.  A vector longer than one segment travels in
segments, so the incoming copy (the scratch) is one segment at most.  The
operand order is fixed by rank, so it needs an associative op but not a
commutative one.
"""

from __future__ import annotations

from ..partition import Block, doubling_peers, exchange_pairs, fold, real_rank, segments


class RecursiveDoubling:
    name = "recursive_doubling"

    def __init__(self, plan):
        self.plan = plan
        self.fold = fold(plan.rank, plan.size)
        if self.fold.newrank is None:
            self.peers = []
        else:
            self.peers = [real_rank(p, self.fold.rem)
                          for p in doubling_peers(self.fold.newrank, self.fold.pof2)]
        pieces = segments(Block(0, plan.count), plan.segment_size)
        self.folding = fold_pairs(self.fold, pieces)
        self.incoming = plan.scratch("incoming", min(plan.count, plan.segment_size))
        if len(pieces) == 1:
            # a vector of one segment is exchanged whole, without views
            self._exchange = whole_vector_steps(plan, self.peers, self.incoming)
        else:
            self._exchange = segmented_steps(plan, self.peers, exchange_pairs(pieces, pieces),
                                             self.incoming)
        #: the call: without a fold, the steps themselves (the latency path:
        #: one closure, no attribute look-ups); else the fold around them
        self.run = self._exchange if self.fold.partner is None else self._folded

    def __call__(self, send, buf) -> None:
        self.run(send, buf)

    def _folded(self, send, buf) -> None:
        src = fold_in(self.plan, self.fold, self.folding, send, buf, self.incoming)
        self._exchange(src, buf)
        fold_out(self.plan, self.fold, buf)


def whole_vector_steps(plan, peers, incoming):
    """The exchange steps for a vector of one segment, as one function of
    ``(src, buf)``: ``src`` holds this rank's operand until the first step
    writes ``buf``; each step swaps the whole vector with its peer."""
    sendrecv, combine = plan.sendrecv, plan.combine
    steps = [(peer, peer < plan.rank) for peer in peers]

    def exchange(src, buf) -> None:
        for peer, lower in steps:
            sendrecv(src, peer, incoming, peer)
            if lower:
                combine(incoming, src, out=buf)
            else:
                combine(src, incoming, out=buf)
            src = buf
    return exchange


def segmented_steps(plan, peers, pairs, incoming):
    """The same for a longer vector: each step a segment at a time."""

    def exchange(src, buf) -> None:
        for peer in peers:
            plan.exchange(peer, pairs, src, buf, incoming)
            src = buf
    return exchange


def fold_pairs(role, pieces: list) -> list:
    """The fold-in's messages for ``Plan.exchange``: the vector in
    ``pieces`` (its segments), sent by the even rank that sits out, kept by
    its partner."""
    if role.partner is None:
        return []
    if role.newrank is None:
        return exchange_pairs(pieces, [])
    return exchange_pairs([], pieces)


def fold_in(plan, role, pairs, send, buf, incoming):
    """Even ranks below 2*rem hand their vector to the odd rank above them.

    Returns where this rank's operand now is: ``buf`` once it has combined
    something, else still ``send``.
    """
    if role.partner is None:
        return send
    plan.exchange(role.partner, pairs, send, buf, incoming)
    return send if role.newrank is None else buf


def fold_out(plan, role, buf) -> None:
    """The odd ranks hand the result back to the even rank below them."""
    if role.partner is None:
        return
    if role.newrank is None:
        plan.sendrecv(None, role.partner, buf, role.partner)
    else:
        plan.sendrecv(buf, role.partner, None, role.partner)
