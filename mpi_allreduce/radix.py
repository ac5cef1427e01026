"""Pure index maths of the radix-k algorithms: no MPI, no arrays.

Recursive multiplying and the k-nomial reduce-scatter + allgather both
generalise a power-of-two algorithm to radix ``k``: a step no longer pairs
a rank with one peer but puts it in a *group* of ``k`` ranks that all
exchange with each other.  Vocabulary (beside :mod:`~mpi_allreduce.partition`'s):

radix
    ``k``, the size of a group (the option ``radix``; 2 gives the
    power-of-two algorithms).
pofk
    The largest power of ``k`` not above ``p``: the ranks that take part in
    the steps.  The others fold in before and out after, each algorithm as
    its source does (:func:`multiplying_fold`, :func:`recexch_fold`).
new rank
    A rank's number among the ``pofk`` that take part, ``0 .. pofk-1``.
group
    In step ``s`` (distance ``d = k^s``), the ``k`` new ranks that differ
    from each other only in base-``k`` digit ``s``: ``base + j*d`` for
    ``j = 0 .. k-1``; ``j`` is a member's *position*.  Groups of step ``s``
    join runs of ``d`` consecutive new ranks into runs of ``k*d``, so
    combining a group's operands by position combines them in rank order::

        k = 3, pofk = 9        step 0 (d = 1)     step 1 (d = 3)
        new rank   0 1 2       group {0, 1, 2}    group {0, 3, 6}
                   3 4 5       group {3, 4, 5}    group {1, 4, 7}
                   6 7 8       group {6, 7, 8}    group {2, 5, 8}

After ``log_k pofk`` steps every new rank has met every other, through
``k - 1`` peers a step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["power_floor", "radix_for", "group", "steps", "digit_reversed", "MultiplyingFold",
           "multiplying_fold", "RecexchFold", "recexch_fold", "recexch_real_rank",
           "knomial_ranges"]


def power_floor(n: int, k: int) -> int:
    """The largest power of ``k`` that is at most ``n`` (n >= 1, k >= 2)."""
    if n < 1 or k < 2:
        raise ValueError(f"need n >= 1 and k >= 2, got n={n}, k={k}")
    power = 1
    while power * k <= n:
        power *= k
    return power


def radix_for(k: int, size: int) -> int:
    """The radix a group of ``size`` ranks runs with: ``k``, but at most
    ``size`` (a radix above p would leave every rank but one out of the
    steps; MPICH's recursive exchange lowers it the same way), at least 2."""
    if k < 2:
        raise ValueError(f"radix must be at least 2, got {k}")
    return max(2, min(k, size))


def steps(pofk: int, k: int) -> int:
    """``log_k pofk``: the steps among ``pofk`` ranks (a power of ``k``)."""
    n = 0
    while pofk > 1:
        pofk //= k
        n += 1
    return n


def group(newrank: int, step: int, k: int) -> tuple[list, int]:
    """(the new ranks of ``newrank``'s group in step ``step``, in position
    order; ``newrank``'s position in it)."""
    distance = k ** step
    position = (newrank // distance) % k
    base = newrank - position * distance
    return [base + j * distance for j in range(k)], position


def digit_reversed(newrank: int, pofk: int, k: int) -> int:
    """``newrank`` with its ``log_k pofk`` base-``k`` digits in reverse order."""
    out = 0
    for _ in range(steps(pofk, k)):
        newrank, digit = divmod(newrank, k)
        out = out * k + digit
    return out


class MultiplyingFold(NamedTuple):
    """A rank's part in recursive multiplying's fold (MPICH's
    ``allreduce_intra_recursive_multiplying.c``): rank ``r >= pofk`` hands
    its vector to ``r mod pofk`` and sits out (``newrank`` None, ``partner``
    that rank); rank ``r < pofk`` takes the steps as new rank ``r`` and
    folds in ``extras``, the ranks ``r + pofk, r + 2 pofk, ...`` below p
    (at most ``k - 1`` of them)."""

    pofk: int
    newrank: Optional[int]
    partner: Optional[int]
    extras: tuple


def multiplying_fold(rank: int, size: int, k: int) -> MultiplyingFold:
    pofk = power_floor(size, k)
    if rank >= pofk:
        return MultiplyingFold(pofk, None, rank % pofk, ())
    return MultiplyingFold(pofk, rank, None, tuple(range(rank + pofk, size, pofk)))


class RecexchFold(NamedTuple):
    """A rank's part in the recursive exchange fold (MPICH's
    ``MPII_Recexchalgo_get_neighbors``): with ``rem = p - pofk`` ranks too
    many and ``T = rem k / (k-1)`` (rounded down), the first ``T`` ranks
    form sets of ``k`` consecutive ranks whose first ``k - 1`` hand their
    vectors to the last, which takes the steps; the ``T mod k`` ranks of an
    unfinished last set hand theirs to rank ``T``.  Every rank that takes
    part so holds a run of consecutive ranks ending at itself (``extras``,
    the ones below it, in rank order), and new ranks keep the order of the
    real ones: the fold keeps operands in rank order."""

    pofk: int
    rem: int
    newrank: Optional[int]
    partner: Optional[int]
    extras: tuple


def recexch_fold(rank: int, size: int, k: int) -> RecexchFold:
    pofk = power_floor(size, k)
    rem = size - pofk
    t = rem * k // (k - 1)
    if rank < t:
        if rank % k != k - 1:
            return RecexchFold(pofk, rem, None, min(rank + k - 1 - rank % k, t), ())
        return RecexchFold(pofk, rem, rank // k, None, tuple(range(rank - k + 1, rank)))
    extras = tuple(range(t - t % k, t)) if rank == t else ()
    return RecexchFold(pofk, rem, rank - rem, None, extras)


def recexch_real_rank(newrank: int, rem: int, k: int) -> int:
    """The real rank of new rank ``newrank`` in :func:`recexch_fold`."""
    return newrank * k + k - 1 if newrank < rem // (k - 1) else newrank + rem


def knomial_ranges(newrank: int, pofk: int, k: int) -> list[tuple[list, int, list]]:
    """The k-nomial reduce-scatter over ``pofk`` blocks, step by step:
    ``(group, position, ranges)`` per step, ``ranges[j]`` the blocks
    ``(first, stop)`` that member ``j`` keeps (this rank sends member
    ``j`` its ``ranges[j]`` and keeps ``ranges[position]``).

    Step ``s`` cuts the range this rank still holds into ``k`` equal runs
    of blocks and gives member ``j`` of the group the ``j``-th; after the
    steps new rank ``i`` keeps block :func:`digit_reversed` ``(i)``, reduced
    over every rank.  The allgather replays the steps backwards."""
    out = []
    lo, width = 0, pofk
    for s in range(steps(pofk, k)):
        members, position = group(newrank, s, k)
        width //= k
        ranges = [(lo + j * width, lo + (j + 1) * width) for j in range(k)]
        out.append((members, position, ranges))
        lo = ranges[position][0]
    return out
