"""Recursive multiplying: log_k p exchanges of the whole vector in groups of k.

Recursive doubling with radix ``k`` (MPICH's
``src/mpi/coll/allreduce/allreduce_intra_recursive_multiplying.c``): in
step ``s`` a rank sends its whole vector to the ``k - 1`` other members of
its group -- the ranks that differ from it only in base-``k`` digit ``s``
(:mod:`mpi_allreduce.radix`) -- receives theirs, and combines all ``k`` in
the group's order, so the members end the step with the same bits::

    p = 9, k = 3      step 0 (distance 1)       step 1 (distance 3)
    rank 0            <-> 1, 2                  <-> 3, 6
    rank 4            <-> 3, 5                  <-> 1, 7
    rank 8            <-> 6, 7                  <-> 2, 5

For p not a power of k, MPICH's fold: with ``pofk`` the largest power of
``k`` not above p, every rank ``r >= pofk`` first hands its vector to
``r mod pofk`` (at most ``k - 1`` land on one rank, all at once) and gets
the result back from it at the end::

    p = 11, k = 3, pofk = 9    fold in: 9 -> 0, 10 -> 1;  steps among 0..8;
                               fold out: 0 -> 9, 1 -> 10

The fold combines rank 9's vector with rank 0's before rank 0 meets ranks
1 and 2: operands out of rank order, so the algorithm needs a commutative
op (MPICH asserts one for p not a power of k).  A radix above p is lowered
to p (one step with every other rank, as MPICH's recursive exchange does;
MPICH's recursive multiplying would fold every rank onto rank 0 instead).

Cost, with P = pofk: log_k P steps of (k-1) messages of the whole vector,
(k-1) n gamma of reduction each: log_k P (alpha + (k-1) n beta + (k-1) n
gamma) if the k-1 messages of a step go out at once (they share the rank's
link, so on one link it is (k-1) alpha), plus alpha + n beta + (k-1) n
gamma in and alpha + (k-1) n beta out for the fold.  Fewer steps than
recursive doubling (log_k p against lg p) for more bytes a step: radix 2
is recursive doubling itself (without its pairwise fold).  Vectors travel
in segments; the k-1 incoming copies of one segment are the scratch:
(k-1) min(n, segment) elements.

``options``: ``radix``, k (default :data:`DEFAULT_RADIX`).
"""

from __future__ import annotations

from ..partition import Block, segments
from ..radix import group, multiplying_fold, radix_for, steps
from ..schedule import RECV, SCRATCH, SEND, Builder, Recv, Reduce, Ref, Send, settle

NAME = "recursive_multiplying"
COMMUTATIVE = True

#: the radix when the call names none (MPICH's default for
#: MPIR_CVAR_ALLREDUCE_RECURSIVE_MULTIPLYING_KVAL is 2; 4 makes the
#: algorithm differ from recursive doubling)
DEFAULT_RADIX = 4

#: the call's options it takes (:mod:`mpi_allreduce.options`)
OPTIONS = ("radix",)


def resolve(size: int, radix=None) -> tuple:
    """The builder's options for ``size`` ranks, resolved as a call's spec
    carries them: the radix it runs with (:func:`~mpi_allreduce.radix.radix_for`)."""
    return (("radix", radix_for(radix or DEFAULT_RADIX, size)),)


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    k = radix_for(int((options or {}).get("radix") or DEFAULT_RADIX), size)
    b = Builder()
    role = multiplying_fold(rank, size, k)
    pieces = segments(Block(0, count), segment_size)
    src = _fold_in(b, rank, role, pieces)
    if role.newrank is not None:
        src = _exchanges(b, rank, role.pofk, k, pieces, src)
        settle(b, src, count)
    fold_out(b, role, count)
    return b.schedule(NAME, rank, size, count)


def _fold_in(b: Builder, rank: int, role, pieces: list) -> int:
    """A rank beyond pofk sends its vector, a segment a round, to the rank
    that stands for it; that rank receives the vectors of all its
    ``extras`` at once and combines them after its own.  Returns the buffer
    that holds this rank's operand now."""
    if role.newrank is None:
        for piece in pieces:
            b.round(Send(role.partner, Ref(SEND, piece.offset, piece.length)))
        return SEND
    if not role.extras:
        return SEND
    group_exchange(b, [rank] + list(role.extras), 0, {}, pieces, SEND, RECV)
    return RECV


def _exchanges(b: Builder, rank: int, pofk: int, k: int, pieces: list, src: int) -> int:
    """The log_k pofk steps, each with the k-1 other members of the group
    (new ranks are the real ones here: the ranks below pofk)."""
    for s in range(steps(pofk, k)):
        members, position = group(rank, s, k)
        sent = {j: pieces for j in range(k) if j != position}
        group_exchange(b, members, position, sent, pieces, src, RECV)
        src = RECV
    return src


def fold_out(b: Builder, role, count: int) -> None:
    """The ranks that took the steps hand the result, whole, to the ranks
    they stood for (all at once; k-nomial's fold too)."""
    whole = Ref(RECV, 0, count)
    if role.newrank is None:
        b.round(Recv(role.partner, whole))
    elif role.extras:
        b.round(*(Send(peer, whole) for peer in role.extras))


# --- one step of a group, shared with the k-nomial algorithm ------------------

def group_exchange(b: Builder, members: list, position: int, sent: dict, kept: list,
                   src: int, out: int) -> None:
    """One step of this rank (``members[position]``) with its group.

    To member ``j`` it sends the segments ``sent[j]`` of buffer ``src`` (a
    member missing from ``sent`` gets nothing); from every other member it
    receives that member's copy of the segments ``kept``, all members'
    copies of a segment in one round (into scratch, one slot per member),
    and at the start of the next round combines them with its own (in
    ``src``) into ``out``, in the group's order (:func:`combine`).  A
    round carries the i-th segment of every list.  Scratch: (k-1) times the
    longest kept segment."""
    others = [j for j in range(len(members)) if j != position]
    stride = max((piece.length for piece in kept), default=0)
    b.need_scratch(len(others) * stride)
    rounds = max([len(kept)] + [len(sent.get(j, ())) for j in others])
    for t in range(rounds):
        keep = kept[t] if t < len(kept) else None
        actions = []
        if keep is not None:
            actions += [Recv(members[j], Ref(SCRATCH, slot * stride, keep.length))
                        for slot, j in enumerate(others)]
        for j in others:
            pieces = sent.get(j, ())
            if t < len(pieces):
                actions.append(Send(members[j], Ref(src, pieces[t].offset, pieces[t].length)))
        b.round(*actions)
        if keep is not None and keep.length:
            slots = {j: Ref(SCRATCH, slot * stride, keep.length)
                     for slot, j in enumerate(others)}
            combine(b, position, slots, Ref(src, keep.offset, keep.length),
                    Ref(out, keep.offset, keep.length))


def combine(b: Builder, position: int, slots: dict, own: Ref, out: Ref) -> None:
    """``out = y_0 OP y_1 OP ... OP y_{m}`` (as local actions), where
    ``y_position`` is ``own`` and every other ``y_j`` is in ``slots[j]``:
    the operands left of ``own`` are folded in their slots, then ``own``,
    then those right of it, each one reduction (m in all).  ``own`` and
    ``out`` may be the same range."""
    left = [j for j in sorted(slots) if j < position]
    right = [j for j in sorted(slots) if j > position]
    for before, j in zip(left, left[1:]):
        b.local(Reduce(slots[j], slots[before], slots[j]))
    acc = own
    if left:
        b.local(Reduce(out, slots[left[-1]], own))
        acc = out
    for j in right:
        b.local(Reduce(out, acc, slots[j]))
        acc = out
