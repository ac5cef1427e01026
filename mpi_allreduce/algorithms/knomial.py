"""K-nomial all-reduce: reduce-scatter and allgather in groups of k (k-ary Rabenseifner).

Rabenseifner's algorithm with radix ``k`` (MPICH's
``src/mpi/coll/allreduce/allreduce_intra_k_reduce_scatter_allgather.c`` on
the neighbours of ``src/mpi/coll/algorithms/recexchalgo/recexchalgo.c``;
Gloo's "bcube" all-reduce, ``gloo/allreduce_bcube.h``, is the same
pattern).  The vector is cut into ``pofk`` blocks.  In reduce-scatter step
``s`` a rank's group is the k ranks that differ from it only in base-k
digit ``s`` (distance k^s, nearest first, :mod:`mpi_allreduce.radix`); the
range of blocks it still holds is cut into k equal runs, member j of the
group keeps run j, and every rank sends each other member that member's
run -- (k-1)/k of its range, to k-1 peers at once -- and combines the k
copies of its own run in the group's order.  After log_k pofk steps new
rank i holds block digit_reversed(i) reduced over every rank; the
allgather replays the steps backwards, handing each member the runs it
lacks::

    pofk = 9, k = 3, blocks b0..b8         new 0       new 4       new 8
    reduce-scatter step 0 (distance 1)     b0-b2       b3-b5       b6-b8
    reduce-scatter step 1 (distance 3)     b0          b4          b8
    allgather step 1                       b0-b2       b3-b5       b6-b8
    allgather step 0                       b0-b8       b0-b8       b0-b8

Each group of step s joins runs of k^s consecutive ranks in order, so
operands meet in rank order.  For p not a power of k the ranks fold as
MPICH's recursive exchange does (:func:`~mpi_allreduce.radix.recexch_fold`):
the first ``T = rem k/(k-1)`` ranks form sets of k consecutive ranks whose
first k-1 hand their vectors to the last (a last, unfinished set to rank
T), so every rank that takes part stands for a run of consecutive ranks
and the order holds through the fold too: a non-commutative op gets MPI's
result.  (MPICH's own k-nomial reduce-scatter asserts a commutative op: it
combines each peer's run as it arrives.)  A radix above p is lowered to p,
as MPICH does.

Cost, with P = pofk: 2 log_k P steps of k-1 messages; 2 n (P-1)/P beta
and n (P-1)/P gamma, Rabenseifner's bandwidth: 2 log_k P alpha if a
step's k-1 messages go out at once (2 (k-1) log_k P on one link), plus the
fold (alpha + n beta + (k-1) n gamma in, alpha + (k-1) n beta out at most).
Radix 2 is Rabenseifner's exchange pattern.  Messages that carry data to
be reduced travel in segments; the k-1 incoming copies of one segment are
the scratch: (k-1) min(n/k, segment) elements.

``options``: ``radix``, k (default :data:`DEFAULT_RADIX`).
"""

from __future__ import annotations

from ..partition import Block, segments
from ..radix import knomial_ranges, radix_for, recexch_fold, recexch_real_rank
from ..schedule import RECV, SEND, Builder, Recv, Ref, Send
from .phases import Phases, allreduce
from .recursive_multiplying import DEFAULT_RADIX, OPTIONS, fold_out, group_exchange, resolve

NAME = "knomial"
COMMUTATIVE = False

__all__ = ["NAME", "COMMUTATIVE", "DEFAULT_RADIX", "OPTIONS", "resolve", "build", "phases"]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    return allreduce(NAME, phases(rank, size, options), rank, size, count, segment_size)


def phases(rank: int, size: int, options=None) -> Phases:
    """The recursive-exchange fold and the k-nomial reduce-scatter and
    allgather of ``rank``, apart (:mod:`~mpi_allreduce.algorithms.phases`)."""
    k = radix_for(int((options or {}).get("radix") or DEFAULT_RADIX), size)
    role = recexch_fold(rank, size, k)
    return Phases(role, role.pofk,
                  fold_in=lambda b, pieces: _fold_in(b, rank, role, pieces),
                  fold_out=lambda b, count: fold_out(b, role, count),
                  plan=lambda blocks: _steps(role, k, blocks),
                  reduce_scatter=lambda b, steps, src, cut: _reduce_scatter(b, rank, steps, src,
                                                                            cut),
                  allgather=lambda b, steps: _allgather(b, steps),
                  kept=lambda steps: steps[-1][2][steps[-1][1]])


def _steps(role, k: int, blocks: list) -> list:
    """(members as real ranks, position, element range of each member's
    run) per reduce-scatter step."""
    def span(run):
        first, stop = run
        return Block(blocks[first].offset, blocks[stop - 1].stop - blocks[first].offset)

    return [([recexch_real_rank(m, role.rem, k) for m in members], position,
             [span(run) for run in runs])
            for members, position, runs in knomial_ranges(role.newrank, role.pofk, k)]


def _fold_in(b: Builder, rank: int, role, pieces: list) -> int:
    """The ranks that sit out send their vectors, a segment a round, to the
    rank that stands for them; it receives them all at once and combines
    the run in rank order (its own operand last).  Returns the buffer that
    holds this rank's operand now."""
    if role.newrank is None:
        for piece in pieces:
            b.round(Send(role.partner, Ref(SEND, piece.offset, piece.length)))
        return SEND
    if not role.extras:
        return SEND
    members = list(role.extras) + [rank]
    group_exchange(b, members, len(role.extras), {}, pieces, SEND, RECV)
    return RECV


def _reduce_scatter(b: Builder, rank: int, steps: list, src: int, cut: int) -> None:
    """Each kept run lies inside the one before, so after the first step
    this rank's operand is in ``RECV``; before it, in ``src``."""
    for members, position, runs in steps:
        sent = {j: segments(run, cut) for j, run in enumerate(runs) if j != position}
        group_exchange(b, members, position, sent, segments(runs[position], cut), src, RECV)
        src = RECV


def _allgather(b: Builder, steps: list) -> None:
    """Backwards through the steps: this rank's reduced run to every other
    member, theirs from each (whole: nothing is reduced), all at once."""
    for members, position, runs in reversed(steps):
        mine = runs[position]
        others = [j for j in range(len(members)) if j != position]
        b.round(*[Recv(members[j], Ref(RECV, runs[j].offset, runs[j].length)) for j in others],
                *[Send(members[j], Ref(RECV, mine.offset, mine.length)) for j in others])
