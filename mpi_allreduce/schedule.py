"""Schedules: an all-reduce as data, one rank at a time, without MPI.

A :class:`Schedule` is what one rank does in one all-reduce: a sequence of
*rounds*, each an ordered tuple of *actions* on three buffers -- this rank's
input (``SEND``), the result (``RECV``) and a scratch area (``SCRATCH``)::

    Send(peer, src)            post a send of range ``src`` to ``peer``
    Recv(peer, dst)            post a receive from ``peer`` into range ``dst``
    Reduce(out, first, second) out = first OP second, now; ``first`` holds
                               the operand of the lower ranks
    Copy(dst, src)             dst = src, now

A round starts its actions in order -- sends and receives are posted, local
actions run at once -- and ends when all its messages are done; the next
round starts after that (the rounds of Open MPI's libnbc).  A local action
placed after a message in its round overlaps with it, so it must not touch
that message's ranges.  Between one pair of ranks, messages match in the
order they are posted (MPI's non-overtaking rule; every message of a
schedule has the same tag on a private communicator).

In place, ``SEND`` and ``RECV`` are the same array: a schedule reads every
element of ``SEND`` before it writes that element of ``RECV``, so one
schedule serves both.  Peers are ranks ``0 .. size-1`` of the group the
schedule was built for; :func:`remap` moves a schedule onto other ranks and
buffers (the hierarchical algorithm runs a whole schedule among its node
leaders that way).

The builders in :mod:`mpi_allreduce.algorithms` make schedules from
``(rank, size, count, segment_size, options)``; :mod:`~.executor` runs one
over MPI, :mod:`~.simulate` runs all ``size`` of them in one process.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["SEND", "RECV", "SCRATCH", "Ref", "Send", "Recv", "Reduce", "Copy", "Schedule",
           "Builder", "remap", "map_refs", "relocate", "exchange", "settle", "BUFFER_NAMES"]

#: the buffers a schedule names
SEND, RECV, SCRATCH = 0, 1, 2
BUFFER_NAMES = ("send", "recv", "scratch")


class Ref(NamedTuple):
    """Elements ``[offset, offset + length)`` of buffer ``buf``."""

    buf: int
    offset: int
    length: int

    @property
    def stop(self) -> int:
        return self.offset + self.length


class Send(NamedTuple):
    peer: int
    src: Ref


class Recv(NamedTuple):
    peer: int
    dst: Ref


class Reduce(NamedTuple):
    out: Ref
    first: Ref
    second: Ref


class Copy(NamedTuple):
    dst: Ref
    src: Ref


class Schedule(NamedTuple):
    """One rank's part of one all-reduce."""

    algorithm: str
    rank: int
    size: int
    count: int
    rounds: tuple  # of tuples of actions
    scratch: int  # elements of scratch the rounds use

    @property
    def messages(self) -> int:
        """Messages this rank sends."""
        return sum(isinstance(a, Send) for r in self.rounds for a in r)

    def sent(self) -> int:
        """Elements this rank sends."""
        return sum(a.src.length for r in self.rounds for a in r if isinstance(a, Send))

    def reduced(self) -> int:
        """Elements this rank reduces."""
        return sum(a.out.length for r in self.rounds for a in r if isinstance(a, Reduce))


class Builder:
    """Collects rounds.  Local actions given with ``local`` wait for the
    next round with messages and run first in it (before its messages are
    posted), or form the last round."""

    def __init__(self):
        self.rounds: list = []
        self._pending: list = []
        self.scratch = 0

    def local(self, action) -> None:
        self._pending.append(action)

    def round(self, *actions) -> None:
        """A round: the pending local actions, then ``actions`` in order."""
        if None in actions:
            actions = tuple(a for a in actions if a is not None)
        if self._pending:
            actions = tuple(self._pending) + actions
            self._pending = []
        if actions:
            self.rounds.append(actions)

    def need_scratch(self, elements: int) -> None:
        self.scratch = max(self.scratch, elements)

    def extend(self, schedule: Schedule) -> None:
        """Append another schedule's rounds (already remapped) after these."""
        self.round()
        self.rounds.extend(schedule.rounds)
        self.need_scratch(schedule.scratch)

    def schedule(self, algorithm: str, rank: int, size: int, count: int) -> Schedule:
        self.round()
        return Schedule(algorithm, rank, size, count, tuple(self.rounds), self.scratch)


def exchange(b: Builder, rank: int, peer: int, pairs: list, src: int, out: int) -> None:
    """One step's messages with ``peer``, a segment a round.

    Per ``(sent, kept, into)`` of ``pairs`` (:func:`~.partition.exchange_pairs`)
    the ``sent`` range of buffer ``src`` goes to the peer while the peer's
    copy of the ``kept`` range arrives in scratch (range ``into``); it is
    combined with this rank's operand (in ``src``) into buffer ``out`` at the
    start of the next round, lower rank's operand first.  Scratch: one
    segment.
    """
    lower = peer < rank
    for sent, kept, into in pairs:
        b.round(None if sent is None else Send(peer, Ref(src, sent.start, sent.stop - sent.start)),
                None if into is None else Recv(peer, Ref(SCRATCH, 0, into.stop)))
        if into is not None:
            b.need_scratch(into.stop)
        if kept is None:
            continue
        n = kept.stop - kept.start
        mine, theirs = Ref(src, kept.start, n), Ref(SCRATCH, 0, n)
        b.local(Reduce(Ref(out, kept.start, n), *((theirs, mine) if lower else (mine, theirs))))


def settle(b: Builder, src: int, count: int) -> None:
    """If this rank's result is still in ``src == SEND`` (a group of one),
    copy it to ``RECV``."""
    if src == SEND:
        b.local(Copy(Ref(RECV, 0, count), Ref(SEND, 0, count)))


def _move(ref: Ref, buffers: dict, offset: int) -> Ref:
    buf = buffers.get(ref.buf, ref.buf)
    return Ref(buf, ref.offset + (offset if buf == SCRATCH else 0), ref.length)


def remap(schedule: Schedule, ranks: list, buffers: Optional[dict] = None,
          scratch_offset: int = 0) -> Schedule:
    """``schedule`` with peer ``i`` replaced by ``ranks[i]`` and buffer ``b``
    by ``buffers.get(b, b)`` (``{SEND: RECV}`` runs it in place on the
    result), its scratch shifted by ``scratch_offset`` elements."""
    buffers = buffers or {}

    def move(action):
        if isinstance(action, Send):
            return Send(ranks[action.peer], _move(action.src, buffers, scratch_offset))
        if isinstance(action, Recv):
            return Recv(ranks[action.peer], _move(action.dst, buffers, scratch_offset))
        return type(action)(*(_move(r, buffers, scratch_offset) for r in action))

    rounds = tuple(tuple(move(a) for a in r) for r in schedule.rounds)
    return schedule._replace(rank=ranks[schedule.rank], rounds=rounds,
                             scratch=schedule.scratch + scratch_offset)


def map_refs(schedule: Schedule, move) -> Schedule:
    """``schedule`` with ``move(ref)`` in place of every range its actions
    name (peers, order and kinds of action unchanged)."""
    def moved(action):
        if isinstance(action, (Send, Recv)):
            return type(action)(action[0], move(action[1]))
        return type(action)(*map(move, action))

    return schedule._replace(rounds=tuple(tuple(moved(a) for a in r) for r in schedule.rounds))


def relocate(schedule: Schedule, bases: dict) -> Schedule:
    """``schedule`` with buffer ``b`` moved into scratch at element
    ``bases[b]`` for each ``b`` in ``bases`` (its own scratch stays at the
    start).  Its ``scratch`` is left as it is: the caller, who knows how
    long the moved buffers are, says how much scratch the whole needs."""
    return map_refs(schedule, lambda ref: Ref(SCRATCH, bases[ref.buf] + ref.offset, ref.length)
                    if ref.buf in bases else ref)
