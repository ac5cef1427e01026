"""A bandwidth-optimal all-reduce is a reduce-scatter, then an allgather: the two apart.

Rabenseifner, k-nomial, Swing's and Bine's bandwidth variants are each a
fold (for a group that is not a power of two or of k), a reduce-scatter
among the ranks that take part, its allgather and the fold back.  Each
such module offers ``phases(rank, size, options)``, a :class:`Phases`
naming its parts; :func:`allreduce` composes them into the all-reduce, and
:func:`reduce_scatter` and :func:`allgather` into MPI's
``Reduce_scatter`` and ``Allgather(v)`` on the algorithm's own peers and
ranges.

Vocabulary.  The *logical vector* is what the algorithm's phases cut into
``parts`` blocks; after its reduce-scatter the rank that takes part as new
rank ``i`` holds one logical block, its *position* (Rabenseifner: the bit
reversal of ``i``; k-nomial: the digit reversal; Swing: ``i``; Bine:
``nu(i)``), read here from the module's own steps on unit blocks, never
restated.  MPI wants rank ``r``'s block (``counts[r]`` elements, in rank
order) on rank ``r``, so the halves lay the logical vector out for that:
the logical block at a rank's position holds the MPI blocks of the rank
and of the ranks its fold stands for, in rank order, and the rank hands
theirs on at the end (the ring's halves need no such layout: block ``r``
ends on rank ``r`` by construction)::

    Rabenseifner, p = 4, counts c0..c3     new 0   new 1   new 2   new 3
    position after the reduce-scatter        0       2       1       3
    logical vector (positions 0..3)          c0      c2      c1      c3

Where the layout is MPI's own (the positions follow the ranks and no rank
sits out: Swing at a power of two), the phases run on the caller's arrays;
elsewhere the input is laid out in scratch first (one local copy of the
vector, as MPICH's non-commutative reduce-scatter permutes its input) and
the allgather's result is copied back into rank order.  Out of place, the
last reductions of a rank's block write the caller's array, and the
allgather sends the rank's own block from the caller's input, not from
the copy just made.  Scratch: the phases' own, plus one or two vectors.
Operands meet in the order the algorithm's all-reduce has them meet, so a
non-commutative op gets MPI's result exactly where it does there.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..partition import Block, block_bounds, blocks_of, segments
from ..schedule import RECV, SCRATCH, SEND, Builder, Copy, Recv, Ref, Schedule, Send, relocate, \
    settle

__all__ = ["Phases", "allreduce", "reduce_scatter", "allgather", "layout"]


class Phases(NamedTuple):
    """One rank's parts of a bandwidth-optimal all-reduce.

    ================ ======================================================
    role             ``newrank`` (None: this rank sits out) and ``partner``
                     (a rank that sits out: the rank that stands for it)
    parts            blocks the logical vector is cut into
    fold_in          ``(b, pieces)``: the fold's messages in; returns the
                     buffer that holds this rank's operand
    fold_out         ``(b, count)``: the result back to the ranks that sat out
    plan             ``(blocks)``: the reduce-scatter's steps on ``blocks``
    reduce_scatter   ``(b, steps, src, cut)``: leaves this rank's block in
                     ``RECV``
    allgather        ``(b, steps)``: every block to every rank, in ``RECV``
    kept             ``(steps)``: the element range this rank holds after
                     the reduce-scatter
    ================ ======================================================
    """

    role: object
    parts: int
    fold_in: Callable
    fold_out: Callable
    plan: Callable
    reduce_scatter: Callable
    allgather: Callable
    kept: Callable


def allreduce(name: str, ph: Phases, rank: int, size: int, count: int, cut: int) -> Schedule:
    """The all-reduce: fold in, reduce-scatter, allgather, fold out."""
    b = Builder()
    src = ph.fold_in(b, segments(Block(0, count), cut))
    if ph.role.newrank is not None:
        steps = ph.plan(block_bounds(count, ph.parts))
        ph.reduce_scatter(b, steps, src, cut)
        ph.allgather(b, steps)
        settle(b, RECV if steps else src, count)
    ph.fold_out(b, count)
    return b.schedule(name, rank, size, count)


class Layout(NamedTuple):
    """Where MPI's blocks lie in the logical vector."""

    blocks: list  # the logical blocks, by position
    place: list  # place[r]: rank r's MPI block in the logical vector
    stands_for: list  # stands_for[r]: the rank that takes part for r (r itself if it does)
    identity: bool  # every MPI block is where MPI has it


def layout(phases_of: Callable, size: int, counts: tuple) -> Layout:
    """The logical vector's layout for MPI blocks ``counts`` (one a rank),
    ``phases_of(rank)`` the algorithm's :class:`Phases` of each rank."""
    everyone = [phases_of(r) for r in range(size)]
    stands_for = [r if ph.role.newrank is not None else ph.role.partner
                  for r, ph in enumerate(everyone)]
    position = {}
    for r, ph in enumerate(everyone):
        if ph.role.newrank is not None:
            steps = ph.plan(block_bounds(ph.parts, ph.parts))  # unit blocks: offset == index
            position[r] = ph.kept(steps).offset if steps else 0
    if sorted(position.values()) != list(range(len(position))) or len(position) != everyone[0].parts:
        raise RuntimeError(f"the reduce-scatter leaves blocks {sorted(position.values())} on "
                           f"{len(position)} ranks; expected each of {everyone[0].parts} once")
    groups: dict = {}
    for x, r in enumerate(stands_for):
        groups.setdefault(r, []).append(x)
    blocks, place, offset = [], [None] * size, 0
    for r in sorted(position, key=position.get):
        start = offset
        for x in groups[r]:
            place[x] = Block(offset, counts[x])
            offset += counts[x]
        blocks.append(Block(start, offset - start))
    identity = all(stands_for[r] == r and place[r] == mpi
                   for r, mpi in enumerate(blocks_of(counts)))
    return Layout(blocks, place, stands_for, identity)


def _group(lay: Layout, rank: int) -> list:
    """The ranks that sit out for which ``rank`` takes part."""
    return [x for x, r in enumerate(lay.stands_for) if r == rank and x != rank]


def reduce_scatter(name: str, phases_of: Callable, rank: int, size: int, counts: tuple,
                   cut: int, in_place: bool = False) -> Schedule:
    """MPI's Reduce_scatter on the algorithm's phases: ``SEND`` holds
    ``sum(counts)`` elements (in place: ``RECV`` is that array, read
    before the result is written); rank r ends with the reduced block r in
    ``RECV[:counts[r]]``.

    The fold and the reduce-scatter run on the logical vector (the input,
    laid out in scratch unless the layout is MPI's) with its partial sums in
    scratch; out of place the last reductions of this rank's block write
    ``RECV`` itself, in place the block is copied out at the end; the rank
    then sends the ranks it stands for their blocks."""
    lay = layout(phases_of, size, counts)
    ph = phases_of(rank)
    n, mine = sum(counts), lay.place[rank]
    inner = Builder()
    src = ph.fold_in(inner, segments(Block(0, n), cut))
    if ph.role.newrank is not None:
        steps = ph.plan(lay.blocks)
        ph.reduce_scatter(inner, steps, src, cut)
        settle(inner, RECV if steps else src, n)
    part = inner.schedule(name, rank, size, n)
    own, into = part.scratch, part.scratch + (0 if lay.identity else n)
    part = relocate(part, {RECV: into} if lay.identity else {SEND: own, RECV: into})
    result = Ref(RECV, 0, mine.length)
    # out of place, the steps that reduce this rank's block for the last
    # time write it straight into the caller's array (no copy out)
    sunk = None if in_place or ph.role.newrank is None else \
        _last_writes_into(part, Ref(SCRATCH, into + mine.offset, mine.length), result)
    b = Builder()
    if not lay.identity:
        _lay_out(b, lay, counts, own)
    b.extend(sunk or part)
    if ph.role.newrank is None:
        b.round(Recv(ph.role.partner, result))
    else:
        if mine.length and not sunk:
            b.local(Copy(result, Ref(SCRATCH, into + mine.offset, mine.length)))
        b.round(*(Send(x, Ref(SCRATCH, into + lay.place[x].offset, counts[x]))
                  for x in _group(lay, rank)))
    b.need_scratch(own + n if ph.role.newrank is None else into + n)
    return b.schedule(name, rank, size, n)


def allgather(name: str, phases_of: Callable, rank: int, size: int, counts: tuple, cut: int,
              in_place: bool) -> Schedule:
    """MPI's Allgather(v) on the algorithm's phases: ``SEND`` holds this
    rank's ``counts[rank]`` elements (in place: already at its place in
    ``RECV``); every rank ends with all blocks in rank order in ``RECV``.

    A rank that sits out hands its block to the rank that stands for it and
    gets the whole vector back at the end; the others gather their group's
    blocks into the logical vector and run the allgather on it."""
    lay = layout(phases_of, size, counts)
    ph = phases_of(rank)
    n, c = sum(counts), counts[rank]
    own = Ref(RECV, blocks_of(counts)[rank].offset, c) if in_place else Ref(SEND, 0, c)
    b = Builder()
    if ph.role.newrank is None:
        b.round(Send(ph.role.partner, own))
        b.round(Recv(ph.role.partner, Ref(RECV, 0, n)))
        return b.schedule(name, rank, size, n)
    inner = Builder()
    ph.allgather(inner, ph.plan(lay.blocks))
    part = inner.schedule(name, rank, size, n)
    # the logical vector: RECV itself where the layout is MPI's, else
    # scratch after the phase's own
    buf, base = (RECV, 0) if lay.identity else (SCRATCH, part.scratch)
    mine = Ref(buf, base + lay.place[rank].offset, c)
    if c and not (lay.identity and in_place):
        b.local(Copy(mine, own))
    b.round(*(Recv(x, Ref(buf, base + lay.place[x].offset, counts[x]))
              for x in _group(lay, rank)))
    b.extend(_sends_from(part if lay.identity else relocate(part, {RECV: base}), mine, own))
    if not lay.identity:
        for x, block in enumerate(blocks_of(counts)):
            if counts[x]:
                b.local(Copy(Ref(RECV, block.offset, counts[x]),
                             Ref(SCRATCH, base + lay.place[x].offset, counts[x])))
        b.need_scratch(base + n)
    b.round(*(Send(x, Ref(RECV, 0, n)) for x in _group(lay, rank)))
    return b.schedule(name, rank, size, n)


def _lay_out(b: Builder, lay: Layout, counts: tuple, base: int) -> None:
    """Copy every MPI block of the input into its place in the logical
    vector at scratch element ``base``."""
    for x, block in enumerate(blocks_of(counts)):
        if counts[x]:
            b.local(Copy(Ref(SCRATCH, base + lay.place[x].offset, counts[x]),
                         Ref(SEND, block.offset, counts[x])))


def _writes(action) -> list:
    if isinstance(action, Recv):
        return [action.dst]
    if isinstance(action, Send):
        return []
    return [action[0]]


def _reads(action) -> list:
    if isinstance(action, Send):
        return [action.src]
    if isinstance(action, Recv):
        return []
    return list(action[1:])


def _overlap(a: Ref, b: Ref) -> bool:
    return a.buf == b.buf and a.offset < b.stop and b.offset < a.stop


def _last_writes_into(part: Schedule, block: Ref, result: Ref) -> "Schedule | None":
    """``part`` with the last writes of ``block`` (this rank's reduced
    block in the logical vector) made into ``result`` instead; a local
    action that writes the block and its neighbours (the block of a rank
    the fold stands for) is cut at the block's bounds.  Earlier writes
    (partial results the last ones read, as k-nomial's chain of reductions)
    stay where they were.  None where that is not clearly safe (a later
    read of the block, a message that lands partly in it): the caller then
    copies the block out."""
    if not block.length:
        return None
    rounds = [list(r) for r in part.rounds]
    covered: list = []  # the block's last writes found so far
    later: list = []  # what the actions after the one at hand read

    def inside(ref: Ref) -> int:  # elements of ``ref`` already claimed by a later write
        return sum(max(0, min(ref.stop, c.stop) - max(ref.offset, c.offset)) for c in covered)

    for number in range(len(rounds) - 1, -1, -1):
        kept = []
        for action in reversed(rounds[number]):  # backwards in time
            writes = [w for w in _writes(action) if _overlap(w, block)]
            pieces = [action]
            if writes:
                if isinstance(action, Recv) and (writes[0].offset < block.offset
                                                 or writes[0].stop > block.stop):
                    return None  # a message that lands partly in the block
                pieces = _cut(action, block)
            for piece in reversed(pieces):
                out = _writes(piece)[0] if _writes(piece) else None
                if out is not None and _overlap(out, block):
                    claimed = inside(out)
                    if claimed == 0:  # its last write
                        if any(_overlap(out, r) for r in later):
                            return None  # read after its last write
                        covered.append(out)
                        target = Ref(result.buf, result.offset + out.offset - block.offset,
                                     out.length)
                        piece = Recv(piece.peer, target) if isinstance(piece, Recv) else \
                            type(piece)(target, *piece[1:])
                    elif claimed != out.length:
                        return None  # partly claimed: not a clean partial result
                kept.append(piece)
            later.extend(_reads(action))
        rounds[number] = kept[::-1]
        if sum(c.length for c in covered) == block.length:
            return part._replace(rounds=tuple(tuple(r) for r in rounds))
    return None


def _cut(action, block: Ref) -> list:
    """A local action cut where its output crosses ``block``'s bounds (its
    operands alike): elementwise work, so the pieces do what it did."""
    if isinstance(action, (Send, Recv)):
        return [action]
    out = action[0]
    bounds = sorted({out.offset, out.stop} | {x for x in (block.offset, block.stop)
                                              if out.offset < x < out.stop})
    return [type(action)(*(Ref(r.buf, r.offset + lo - out.offset, hi - lo) for r in action))
            for lo, hi in zip(bounds, bounds[1:])]


def _sends_from(part: Schedule, mine: Ref, own: Ref) -> Schedule:
    """``part`` (an allgather on the logical vector, where this rank's block
    is ``mine``) with every message of that block, or of a piece of it,
    sent from where the caller has it (``own``) rather than from the copy
    just written: a message whose sender just wrote it costs more (Open
    MPI's single-copy path on fresh pages, as the ring's allgather avoids)."""
    def moved(action):
        src = action.src if isinstance(action, Send) else None
        if src is not None and src.length and src.buf == mine.buf and \
                mine.offset <= src.offset and src.stop <= mine.stop:
            return Send(action.peer, Ref(own.buf, own.offset + src.offset - mine.offset,
                                         src.length))
        return action
    return part._replace(rounds=tuple(tuple(moved(a) for a in r) for r in part.rounds))
