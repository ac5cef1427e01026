"""Swing, latency-optimal: lg p exchanges of the whole vector with peers close on the ring.

De Sensi, Bonato, Saam, Hoefler, "Swing: Short-cutting Rings for Higher
Bandwidth Allreduce", NSDI 2024.  Recursive doubling's butterfly with
Swing's peers (:mod:`mpi_allreduce.negabinary`): in the step that uses
``rho(s)`` rank r swaps its vector with ``pi(r, s)`` (r + rho(s) if r is
even, r - rho(s) if odd, mod p) and both combine the two, lower rank's
operand first.  The distances ``|rho(s)|`` = 1, 1, 3, 5, 11, 21, ... stay
below recursive doubling's 2^s, which is what saves hops on a torus.

The steps run last first, ``s = lg p - 1, ..., 1, 0``: the same exchanges
as the paper's order ``s = 0, 1, ...`` and the same cost (each moves the
whole vector), but every rank then combines the same partial results in
the same tree, so every rank gets the same bits -- in the paper's order
the ranks' trees differ from p = 8 on (rank 0 receives the sums of {1},
{6, 7}, {2, 3, 4, 5}, rank 1 those of {0}, {2, 3}, {4, 5, 6, 7}: no one
tree holds both {2, 3, 4, 5} and {4, 5, 6, 7}), and a float sum would
differ in its last bits from rank to rank::

    p = 8, s = 2 (rho = 3), 1 (rho = -1), 0 (rho = 1)

    step        r0    r1    r2    r3    r4    r5    r6    r7
    rho =  3    r3    r6    r5    r0    r7    r2    r1    r4
    rho = -1    r7    r2    r1    r4    r3    r6    r5    r0
    rho =  1    r1    r0    r3    r2    r5    r4    r7    r6
    holds      {0,3,4,7}+{1,2,5,6} on every rank, the same tree

For p not a power of two the authors' code folds, and so does this: with
``pof2`` the largest power of two below p and ``rem = p - pof2``, rank
``pof2 + i`` hands its vector to rank ``pof2 - rem + i`` first and takes the
result back last (:func:`~mpi_allreduce.negabinary.shrink`); the ranks
below ``pof2`` keep their numbers, so their peers keep Swing's distances.
The paper's own scheme for other p (ceil(lg p) steps that skip blocks
already reached) is not implemented.

Cost: lg p (alpha + n beta + n gamma), plus 2 (alpha + n beta) + n gamma
when p is not a power of two: recursive doubling's.  The vector travels in
segments, so scratch is one segment at most.  Operands meet out of rank
order (rank 0 combines with rank 3 first), so the op must be commutative.
"""

from __future__ import annotations

from ..negabinary import pi, shrink
from ..partition import Block, exchange_pairs, segments
from ..schedule import RECV, Builder, exchange, settle
from .recursive_doubling import fold_in, fold_out

NAME = "swing_latency"
COMMUTATIVE = True

__all__ = ["NAME", "COMMUTATIVE", "build", "butterfly", "step_order"]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    """Rank ``rank``'s schedule: Swing's fold, the butterfly last step first, the fold back."""
    b = Builder()
    role = shrink(rank, size)
    pieces = segments(Block(0, count), segment_size)
    src = fold_in(b, rank, role, pieces)
    if role.newrank is not None:
        src = butterfly(b, rank, role.newrank, role.pof2, lambda new: new, pieces, src)
        settle(b, src, count)
    fold_out(b, role, count)
    return b.schedule(NAME, rank, size, count)


def step_order(pof2: int) -> list[int]:
    """The steps ``s`` of the butterfly in the order they run: last first."""
    return list(reversed(range(pof2.bit_length() - 1)))


def butterfly(b: Builder, rank: int, newrank: int, pof2: int, real, pieces: list,
              src: int) -> int:
    """One exchange of the whole vector (in ``pieces``, its segments) per
    step with ``real(pi(newrank, s, pof2))``, ``real`` mapping a new rank to
    its rank in the communicator.  Returns the buffer that holds the
    result: ``RECV``, or ``src`` if there was no step."""
    pairs = exchange_pairs(pieces, pieces)
    for step in step_order(pof2):
        exchange(b, rank, real(pi(newrank, step, pof2)), pairs, src, RECV)
        src = RECV
    return src
