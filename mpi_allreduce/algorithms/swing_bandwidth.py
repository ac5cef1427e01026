"""Swing, bandwidth-optimal: Swing's reduce-scatter, then its allgather, block by block.

De Sensi, Bonato, Saam, Hoefler, "Swing: Short-cutting Rings for Higher
Bandwidth Allreduce", NSDI 2024.  The vector is cut into ``pof2`` blocks,
block r ending on rank r.  In step s of the reduce-scatter rank r
exchanges with ``pi(r, s)`` = r + rho(s) (r even) or r - rho(s) (r odd),
rho = 1, -1, 3, -5, 11, ... (:mod:`mpi_allreduce.negabinary`): it sends the
blocks of ``reach(pi(r, s), s+1)`` -- the peer's and those of every rank
the peer meets in the steps after, which the paper's schedule routes via
the peer -- and reduces the peer's copies of ``reach(r, s+1)`` into its
own: 2^(lg p - s - 1) blocks each way, half of what it held.  After lg p
steps rank r holds block r reduced over all ranks; the allgather replays
the steps backwards (the peer's distance halving) and hands the blocks on::

    p = 8    step 0 (rho = 1)          step 1 (rho = -1)     step 2 (rho = 3)
    r0       to r1: b1 b2 b5 b6        to r7: b4 b7          to r3: b3
             keeps  b0 b3 b4 b7        keeps  b0 b3          keeps  b0
    r1       to r0: b0 b3 b4 b7        to r2: b2 b5          to r6: b6
             keeps  b1 b2 b5 b6        keeps  b1 b6          keeps  b1

Both distances and bytes fall: step s moves n/2^(s+1) over a distance of
about 2^(s+1)/3 ranks, which is what saves hops on a torus.  The blocks of
a step are not contiguous in the vector (Bine's ``bine_bandwidth`` permutes
the blocks so that they are): runs of adjacent blocks go as one range,
cut in segments, and a step's segments go a segment's worth a round (the
pieces of one round, sent and received, :func:`pack`), each piece received
into scratch and reduced at the start of the next round.  Each block is
reduced on one rank and copied from there, so every rank gets the same
bits.

For p not a power of two: the fold of Swing's latency-optimal code
(:func:`~mpi_allreduce.negabinary.shrink`: rank ``pof2 + i`` hands its
vector to rank ``pof2 - rem + i`` and takes the result back last), the
butterfly among ranks ``0 .. pof2-1``.  The paper's own scheme for other p
(ceil(lg p) steps that skip blocks already reached) is not implemented.

Cost: 2 lg p alpha + 2 n (p-1)/p beta + n (p-1)/p gamma (plus the fold),
at least: the blocks of a step travel as several ranges (about 3p/4
messages a rank and phase at large p), so more messages than Bine's one
range a step, but one segment of scratch at most.  Operands meet out of
rank order: the op must be commutative.
"""

from __future__ import annotations

from itertools import zip_longest

from ..negabinary import shrink, swing_blocks
from ..partition import Block, block_bounds, segments
from ..schedule import RECV, SCRATCH, Builder, Recv, Reduce, Ref, Send
from .phases import Phases, allreduce
from .recursive_doubling import fold_in, fold_out

NAME = "swing_bandwidth"
COMMUTATIVE = True

__all__ = ["NAME", "COMMUTATIVE", "build", "phases", "runs", "pack", "steps"]


def build(rank: int, size: int, count: int, segment_size: int, options=None):
    """Rank ``rank``'s schedule: Swing's fold, reduce-scatter, allgather, the fold back."""
    return allreduce(NAME, phases(rank, size), rank, size, count, segment_size)


def phases(rank: int, size: int, options=None) -> Phases:
    """Swing's fold, reduce-scatter and allgather of ``rank``, apart
    (:mod:`~mpi_allreduce.algorithms.phases`)."""
    role = shrink(rank, size)
    return Phases(role, role.pof2,
                  fold_in=lambda b, pieces: fold_in(b, rank, role, pieces),
                  fold_out=lambda b, count: fold_out(b, role, count),
                  plan=lambda blocks: _steps(role.newrank, role.pof2, blocks),
                  reduce_scatter=lambda b, plan, src, cut: _reduce_scatter(b, rank, plan, src,
                                                                           cut),
                  allgather=lambda b, plan: _allgather(b, plan),
                  kept=lambda plan: _one(plan[-1][1]))


def _one(ranges: list) -> Block:
    """The one range of ``ranges`` (the last step keeps one block)."""
    if len(ranges) != 1:
        raise ValueError(f"expected one range, got {ranges}")
    return ranges[0]


def runs(blocks: list, chosen: list) -> list[Block]:
    """The element ranges of the blocks ``chosen`` (indices, ascending):
    adjacent ones merged, empty ones left out."""
    out: list[Block] = []
    for index in chosen:
        block = blocks[index]
        if not block.length:
            continue
        if out and out[-1].stop == block.offset:
            out[-1] = Block(out[-1].offset, out[-1].length + block.length)
        else:
            out.append(block)
    return out


def pack(ranges: list, cut: int) -> list[list[Block]]:
    """``ranges`` cut in segments of at most ``cut`` elements, the segments
    grouped in order into rounds of at most ``cut`` elements in all.  The
    sender of some ranges and their receiver pack them alike, so the i-th
    round's messages match on both sides.  No ranges: no rounds."""
    rounds: list[list[Block]] = []
    total = cut
    for piece in (p for r in ranges for p in segments(r, cut)):
        if total + piece.length > cut:
            rounds.append([])
            total = 0
        rounds[-1].append(piece)
        total += piece.length
    return rounds


def steps(rank: int, pof2: int, count: int) -> list:
    """``(peer, kept, sent)`` per reduce-scatter step: the peer (a rank
    below ``pof2``, the same in the communicator) and the ranges
    (:func:`runs`) of the kept and sent blocks, ``count`` elements cut
    into ``pof2`` blocks."""
    return _steps(rank, pof2, block_bounds(count, pof2))


def _steps(rank: int, pof2: int, blocks: list) -> list:
    return [(peer, runs(blocks, kept), runs(blocks, sent))
            for peer, kept, sent in swing_blocks(rank, pof2)]


def _reduce_scatter(b: Builder, rank: int, plan: list, src: int, cut: int) -> None:
    """Per step the rounds of :func:`pack`: this rank's pieces of the sent
    ranges go out of ``src``, the peer's copies of the kept ones arrive in
    scratch one after the other and are reduced into ``RECV`` at the start
    of the next round, lower rank's operand first.  A step with nothing to
    move either way still exchanges one empty message."""
    for peer, kept, sent in plan:
        lower = peer < rank
        outgoing, incoming = pack(sent, cut), pack(kept, cut)
        if not outgoing and not incoming:
            outgoing = incoming = [[Block(0, 0)]]
        for out, into in zip_longest(outgoing, incoming, fillvalue=[]):
            actions, slot = [], 0
            for piece in out:
                actions.append(Send(peer, Ref(src, piece.offset, piece.length)))
            for piece in into:
                actions.append(Recv(peer, Ref(SCRATCH, slot, piece.length)))
                slot += piece.length
            b.round(*actions)
            b.need_scratch(slot)
            slot = 0
            for piece in into:
                n = piece.length
                if n:
                    mine, theirs = Ref(src, piece.offset, n), Ref(SCRATCH, slot, n)
                    b.local(Reduce(Ref(RECV, piece.offset, n),
                                   *((theirs, mine) if lower else (mine, theirs))))
                slot += n
        src = RECV


def _allgather(b: Builder, plan: list) -> None:
    """The steps backwards, one round each: the kept ranges go to the peer,
    its kept ranges (this rank's sent ones) arrive in ``RECV``."""
    for peer, kept, sent in reversed(plan):
        actions = [Send(peer, Ref(RECV, r.offset, r.length)) for r in kept]
        actions += [Recv(peer, Ref(RECV, r.offset, r.length)) for r in sent]
        b.round(*(actions or [Send(peer, Ref(RECV, 0, 0)), Recv(peer, Ref(RECV, 0, 0))]))
