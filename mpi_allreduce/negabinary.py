"""Pure index maths of the Swing and Bine butterflies: no MPI, no arrays.

Both papers build a butterfly on ``P`` ranks (a power of two, ``L = lg P``
steps) whose peers are close on a ring of ranks: in step ``s`` rank ``r``
exchanges with

    pi(r, s) = r + rho(s)  (mod P)   if r is even
               r - rho(s)  (mod P)   if r is odd

    rho(s) = sum_{i=0..s} (-2)^i = (1 - (-2)^(s+1)) / 3 = 1, -1, 3, -5, 11, -21, ...

so the distance ``|rho(s)|`` grows as about ``2^(s+1) / 3`` where recursive
doubling's grows as ``2^s``.  ``rho(s)`` is the negabinary (base -2) number
whose ``s+1`` lowest digits are ones, hence the name of this module.  An
even rank and an odd rank swap, so ``pi(pi(r, s), s) = r``::

    P = 8            r0  r1  r2  r3  r4  r5  r6  r7
    s = 0, rho =  1  r1  r0  r3  r2  r5  r4  r7  r6
    s = 1, rho = -1  r7  r2  r1  r4  r3  r6  r5  r0
    s = 2, rho =  3  r3  r6  r5  r0  r7  r2  r1  r4

Vocabulary (besides :mod:`~mpi_allreduce.partition`'s block, segment,
step, peer):

reach
    ``reach(q, t)``: the ranks that ``q`` and the peers it meets in steps
    ``t, t+1, ..., L-1`` reach, recursively: ``{q}`` and ``reach(pi(q, u),
    u+1)`` for every ``u >= t``; it holds ``2^(L-t)`` ranks.  In Swing's
    reduce-scatter, step ``s``, rank ``r`` sends its peer ``q = pi(r, s)``
    the blocks of ``reach(q, s+1)`` (the ranks whose blocks the peer will
    pass on or keep) and keeps those of ``reach(r, s+1)``; after ``L`` steps
    it keeps block ``r`` alone.
nu
    Bine's block permutation: ``nu(r)``, the position of rank ``r``'s block
    in the vector, is the ``L``-bit reversal of the Gray-like code ``n ^ (n
    >> 1)`` of ``n``, the negabinary digits of ``r`` (odd ``r``) or of ``-r``
    (even ``r``), taken modulo ``P`` within the ``L``-digit range.  The
    positions of ``reach(q, s+1)`` are then the ``2^(L-s-1)`` consecutive
    ones that share the top ``s+1`` bits of ``nu(q)``: with the blocks in
    that order every message of the butterfly is one contiguous range, and
    ``nu(r)`` and ``nu(pi(r, s))`` differ in bit ``L-1-s`` and agree above
    it, so the halving is recursive halving on positions (the top half
    goes to the rank whose ``nu`` has that bit set)::

        P = 8      r0  r1  r2  r3  r4  r5  r6  r7
        nu(r)       0   4   6   1   3   7   5   2

The fold for ``P`` below ``size`` is :func:`shrink` for Swing (the
authors' code: rank ``P + i`` hands its vector to rank ``P - rem + i``, so
the ranks that stay keep their rank and Swing's short distances) and
:func:`~mpi_allreduce.partition.fold` for Bine (the authors' code: MPICH's
even-odd pairs, as recursive doubling).
"""

from __future__ import annotations

from functools import lru_cache

from .partition import Fold, pow2_floor

__all__ = ["rho", "pi", "peers", "reach", "negabinary", "from_negabinary", "nu",
           "nu_inverse", "halving", "swing_blocks", "shrink"]


def rho(step: int) -> int:
    """``sum_{i=0..step} (-2)^i``: 1, -1, 3, -5, 11, -21, 43, ..."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return (1 - (-2) ** (step + 1)) // 3


def pi(rank: int, step: int, size: int) -> int:
    """Rank ``rank``'s peer in step ``step`` among ``size`` ranks: ``rank +
    rho(step)`` for even ranks, ``rank - rho(step)`` for odd ones (mod size)."""
    delta = rho(step)
    return (rank + delta) % size if rank % 2 == 0 else (rank - delta) % size


def peers(rank: int, size: int) -> list[int]:
    """``pi(rank, s, size)`` for ``s = 0 .. lg(size) - 1`` (size a power of two)."""
    _steps(size)
    return [pi(rank, s, size) for s in range(size.bit_length() - 1)]


def reach(rank: int, step: int, size: int) -> set[int]:
    """The ranks ``rank`` reaches in steps ``step .. lg(size)-1`` (itself
    included), by the definition: what Swing's reduce-scatter routes via
    ``rank`` from ``step`` on.  Exponential in the steps: for tests and
    pictures; :func:`swing_blocks` lists the same sets through ``nu``."""
    out = {rank}
    for later in range(step, _steps(size)):
        out |= reach(pi(rank, later, size), later + 1, size)
    return out


def negabinary(value: int) -> int:
    """The digits of ``value`` in base -2, as the bits of an int (any sign)."""
    digits, place = 0, 0
    while value:
        digit = value & 1  # value mod 2, the same in base -2
        digits |= digit << place
        value = (value - digit) // -2
        place += 1
    return digits


def from_negabinary(digits: int) -> int:
    """The integer whose base -2 digits are the bits of ``digits``."""
    value, place = 0, 1
    while digits:
        if digits & 1:
            value += place
        digits >>= 1
        place *= -2
    return value


def _steps(size: int) -> int:
    """lg size; ValueError unless size is a power of two."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"size must be a power of two, got {size}")
    return size.bit_length() - 1


def _digits_range(bits: int) -> tuple[int, int]:
    """The smallest and largest integers with ``bits`` negabinary digits."""
    low = sum((-2) ** i for i in range(1, bits, 2))
    high = sum((-2) ** i for i in range(0, bits, 2))
    return low, high


def nu(rank: int, size: int) -> int:
    """Bine's block position of ``rank`` among ``size`` ranks (a power of
    two): see the module docstring.  A permutation of ``0 .. size-1``."""
    bits = _steps(size)
    low, high = _digits_range(bits)
    value = rank if rank % 2 else -rank
    # the one representative of value mod size with ``bits`` digits
    value = low + (value - low) % size
    assert low <= value <= high
    code = negabinary(value)
    code ^= code >> 1
    return int(format(code, f"0{bits}b")[::-1], 2) if bits else 0


@lru_cache(maxsize=64)
def nu_inverse(size: int) -> tuple[int, ...]:
    """``out[nu(r, size)] = r``: the rank whose block sits at each position."""
    out = [0] * size
    for r in range(size):
        out[nu(r, size)] = r
    return tuple(out)


def halving(rank: int, size: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """``(peer, kept, sent)`` per step of the Bine reduce-scatter on
    ``size`` positions (a power of two): ``kept`` and ``sent`` are position
    ranges ``(first, stop)``, the two halves of the range kept the step
    before (the lower half to the rank of the two with the lower ``nu``).
    After the steps ``rank`` keeps position ``nu(rank)`` alone.  The
    allgather replays the steps backwards with ``kept`` and ``sent`` swapped."""
    steps = []
    low, high = 0, size
    mine = nu(rank, size)
    for s in range(_steps(size)):
        peer = pi(rank, s, size)
        middle = (low + high) // 2
        if mine < nu(peer, size):
            kept, sent = (low, middle), (middle, high)
        else:
            kept, sent = (middle, high), (low, middle)
        steps.append((peer, kept, sent))
        low, high = kept
    return steps


def swing_blocks(rank: int, size: int) -> list[tuple[int, list[int], list[int]]]:
    """``(peer, kept, sent)`` per step of Swing's reduce-scatter on
    ``size`` blocks, block ``r`` ending on rank ``r``: ``sent`` lists the
    blocks of ``reach(peer, s+1)``, ``kept`` those of ``reach(rank, s+1)``,
    each ascending.  These are :func:`halving`'s ranges mapped back through
    ``nu``: the same butterfly with the blocks in rank order, so a message
    carries blocks that are not contiguous in the vector."""
    ranks = nu_inverse(size)
    return [(peer, sorted(ranks[i] for i in range(*kept)), sorted(ranks[i] for i in range(*sent)))
            for peer, kept, sent in halving(rank, size)]


def shrink(rank: int, size: int) -> Fold:
    """Swing's fold of ``size`` ranks to ``pof2``: rank ``pof2 + i`` (for
    ``i < rem``) hands its vector to rank ``pof2 - rem + i`` and sits out;
    every other rank keeps its number (``newrank == rank``), so the peers
    of the butterfly keep their distances on the ring of ranks.  The same
    :class:`~mpi_allreduce.partition.Fold` as MPICH's
    :func:`~mpi_allreduce.partition.fold` gives, so recursive doubling's
    fold-in and fold-out serve both."""
    pof2 = pow2_floor(size)
    rem = size - pof2
    if rank >= pof2:
        return Fold(pof2, rem, None, rank - rem)
    if rank >= pof2 - rem:
        return Fold(pof2, rem, rank, rank + rem)
    return Fold(pof2, rem, rank, None)
