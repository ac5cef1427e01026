"""The library's state for one caller communicator, in one place.

A :class:`Context` is cached as an attribute of the caller's communicator
and owns everything the library keeps for it: its own duplicate of the
communicator (so a caller's pending receives never match library
messages), the node map and oversubscription flag, the plans (a schedule
with its scratch, per call shape), the one cache of bound calls (a plan on
the caller's arrays, found again by the identity of those arrays: every
kind of call keeps its bound calls here), the live selectors, the tags of
the calls in flight (:meth:`Context.claim`), and the call in progress
(:attr:`Context.what`: the re-entry guard, and what the watchdog
samples).  :meth:`Context.free` drops all of it; it runs when the caller
frees the communicator, on :func:`release`, and (the caches only) on
:func:`mpi_allreduce.config.refresh`.  A communicator freed while
calls are in flight on it keeps its duplicate until they complete (MPI
completes pending operations on a freed communicator, and so do we).
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from typing import Callable, Optional

from mpi4py import MPI

from .config import on_refresh
from .errors import ConcurrentCall, TagsExhausted
from .executor import mpi_tags
from .topology import node_map, oversubscribed
from .watchdog import WATCH, settings

__all__ = ["Context", "context_for", "release", "setup", "remember_call", "MAX_PLANS",
           "MAX_CALLS"]

#: plans kept per communicator (the least recently used go first)
MAX_PLANS = 64
#: bound calls kept per communicator (the oldest go first): more than a
#: model has parameter tensors (ResNet-50: 161), so a training step that
#: all-reduces each one repeats kept calls instead of binding every call
#: again (two thirds of the time per-tensor on ResNet-50 with 64)
MAX_CALLS = 256
#: bound reduce_scatter/allgather calls kept per communicator (they hold
#: views of their arrays: the fewer, the sooner a dropped array is freed)
MAX_HALVES = 16


class Context:
    """The library's state for one caller communicator."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        #: some node runs more of these ranks than it has CPUs (``auto`` may
        #: then choose differently); agreed by all ranks, found once
        self.oversubscribed = oversubscribed(self.comm)
        self._nodes: dict = {}
        self.plans: "OrderedDict[tuple, object]" = OrderedDict()
        #: keys of this context's bound calls in :data:`CALLS`
        self.calls: dict = {}
        self.selectors: dict = {}
        #: reduce_scatter/allgather calls bound to arrays, by (kind, ids):
        #: the arrays by weak reference (checked on every hit), at most MAX_HALVES
        self.halves: "OrderedDict[tuple, tuple]" = OrderedDict()
        #: reproducible sums' work arrays and bound inner calls, per shape
        self.work: "OrderedDict[tuple, object]" = OrderedDict()
        #: ids of the caller's comm objects that lead here (see _LIVE)
        self.ids: set = set()
        #: how this communicator's tags are shared out (see spec.TagLayout)
        self.tags = mpi_tags()
        self._made = {True: 0, False: 0}  # persistent / non-blocking calls made so far
        #: slot -> weak reference to the operation holding it
        self.holders: dict = {}
        #: why this communicator is unusable (a call stalled and raised), or None
        self.broken: Optional[str] = None
        #: the blocking call in progress, as (kind, plan), or a non-blocking
        #: one being started; None between calls.  A second thread that finds
        #: it set gets ConcurrentCall instead of a wrong result (the test and
        #: the store have no call between them: atomic under the GIL; see
        #: progress.blocking), and the watchdog samples it with ``count``
        self.what: Optional[tuple] = None
        self.count = 0
        WATCH.watch(self)

    def snapshot(self) -> tuple:
        """What the watchdog samples: (calls made, the one in progress, thread)."""
        return self.count, self.what, None

    def claim(self, op, fingerprint: int, persistent: bool) -> int:
        """The tag of the next persistent (``persistent``) or non-blocking
        call, ``op``, held until ``op`` no longer holds it (complete; a
        persistent one freed).  Refused if its slot is still held here."""
        number = self._made[persistent]
        self._made[persistent] = number + 1
        slot = self.tags.slot(persistent, number)
        ref = self.holders.get(slot)
        held = ref() if ref is not None else None
        if held is not None and held.holds_tag():
            what = "persistent requests alive" if persistent else "non-blocking calls in flight"
            room = self.tags.persistent if persistent else self.tags.slots - self.tags.persistent
            raise TagsExhausted(
                f"more than {room} {what} on one communicator (tags up to "
                f"2^{self.tags.bits}): the next would reuse the tag of one still held; wait "
                "for (or free) older ones first")
        holders = self.holders

        def gone(r, slot=slot):
            if holders.get(slot) is r:
                del holders[slot]
        holders[slot] = weakref.ref(op, gone)
        return self.tags.request_tag(slot, fingerprint)

    def in_flight(self) -> int:
        """Calls of this context in flight now (on this rank)."""
        return sum(1 for ref in list(self.holders.values())
                   if (op := ref()) is not None and not op.done)

    def concurrent(self) -> ConcurrentCall:
        return ConcurrentCall(
            f"two threads entered calls on one communicator ({self.size} ranks) at once; MPI "
            "leaves that erroneous (the ranks cannot agree on the calls' order): give each "
            "thread a communicator of its own (comm.Dup())")

    def nodes(self, ranks_per_node: Optional[int]) -> tuple:
        """The node of every rank (collective the first time for real nodes)."""
        nodes = self._nodes.get(ranks_per_node)
        if nodes is None:
            nodes = self._nodes[ranks_per_node] = node_map(self.comm, ranks_per_node)
        return nodes

    def plan(self, key: tuple, build: Callable[[], object]):
        """The plan for ``key``, built on first use; least recently used go first."""
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = build()
            while len(self.plans) > MAX_PLANS:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        return plan

    def remember(self, key: tuple, call) -> None:
        """Keep a bound call in :data:`CALLS` (and know it is this context's)."""
        self.forget(key, CALLS.get(key))
        CALLS[key] = self.calls[key] = call
        if len(self.calls) > MAX_CALLS:
            oldest = next(iter(self.calls))
            self.forget(oldest, self.calls[oldest])

    def keep_half(self, key: tuple, entry: tuple) -> None:
        self.halves[key] = entry
        self.halves.move_to_end(key)
        while len(self.halves) > MAX_HALVES:
            self.halves.popitem(last=False)

    def forget(self, key: tuple, call) -> None:
        if call is not None and self.calls.get(key) is call:
            del self.calls[key]
            if CALLS.get(key) is call:
                del CALLS[key]

    def clear(self) -> None:
        """Drop the caches (plans, bound calls, selectors); keep the communicator."""
        for key, call in list(self.calls.items()):
            self.forget(key, call)
        self.plans.clear()
        self.selectors.clear()
        self.halves.clear()
        self.work.clear()

    def free(self) -> None:
        self.clear()
        for key in self.ids:
            _LIVE.pop(key, None)
        self.ids.clear()
        if self.in_flight():  # the duplicate outlives its calls: see reap()
            _CLOSING.append(self)
        else:
            _free_duplicate(self)


#: contexts freed with calls in flight, their duplicates not yet freed
_CLOSING: list = []

#: duplicates of communicators where a call stalled, never freed.  The
#: stalled call's messages may still be on their way or waiting unmatched
#: at a peer; freeing the duplicate would let MPI give its context to a new
#: communicator, whose messages with the same tag (the same call spec)
#: could then match those old ones.  One communicator per stall is kept.
QUARANTINE: list = []


def _free_duplicate(context: "Context") -> None:
    if context.comm == MPI.COMM_NULL or MPI.Is_finalized():
        return
    if context.broken is not None:
        QUARANTINE.append(context.comm)
    else:
        context.comm.Free()


def reap() -> None:
    """Free the duplicates of freed communicators whose calls have ended."""
    for context in list(_CLOSING):
        if not context.in_flight():
            _CLOSING.remove(context)
            _free_duplicate(context)


#: every context's bound calls, by the identity of the call's arguments:
#: the one look-up of a repeated call (see api.allreduce); entries are
#: added and removed by their context only
CALLS: dict = {}

#: id(caller's comm object) -> (that object, its context): the fast way to a
#: context for a repeated call (the object is held, so its id stays its own)
_LIVE: dict = {}


class Remembered:
    """A bound call kept for repeats with the very same argument objects
    (one per receive buffer: the last call made with it; ``extra``: its
    optional arguments, None when it had none).

    An id names one live object: the op and comm objects are held here,
    the buffers by weak references whose death drops the entry (before an
    id can be reused).  The bound call holds views of the buffers, so numpy
    cannot resize them in place; their dtype is rechecked on every call
    (assigning ``dtype`` reinterprets an array in place), and a reshaped
    buffer is the same memory, which the views still cover.  Buffers that
    are not C-contiguous, or read-only, were refused when first seen."""

    __slots__ = ("run", "dtype", "in_place", "send", "op", "comm", "algorithm", "extra", "refs",
                 "ours")

    def abandoned(self) -> bool:
        """Whether the caller holds none of the buffers any more: only the
        bound call's views keep them alive (then they are dropped)."""
        for ref, ours in zip(self.refs, self.ours):
            buf = ref()
            # the references: ours, this frame's ``buf`` and getrefcount's argument
            if buf is None or sys.getrefcount(buf) - 2 <= ours:
                return True
        return False


def refcounts(call) -> list:
    return [sys.getrefcount(b) for b in (call.recv, call.send) if b is not None]


def remember_call(context: Context, run, sendbuf, recvbuf, op, comm, algorithm,
                  call, ours: list, extra) -> None:
    """Keep the bound call for repeats; drop those whose buffers the caller
    has let go (the bound views would keep them alive otherwise)."""
    for key, old in list(context.calls.items()):
        if old.ours is not None and old.abandoned():
            context.forget(key, old)
    if recvbuf is not call.recv or (call.send is not None and sendbuf is not call.send):
        return  # converted on the way in (a list, a foreign device array): no identity
    kept = Remembered()
    key = id(recvbuf)

    def forget(ref):  # a buffer dies: its entry goes before its id can be reused
        entry = context.calls.get(key)  # (no reference to ``kept`` here: no cycle)
        if entry is not None and ref in entry.refs:
            context.forget(key, entry)

    try:
        # (in the order of ``ours``: see refcounts)
        buffers = (recvbuf,) if call.send is None else (recvbuf, sendbuf)
        kept.refs = [weakref.ref(b, forget) for b in buffers]
    except TypeError:  # an array type without weak references
        return
    kept.run, kept.op, kept.comm, kept.algorithm, kept.extra = run, op, comm, algorithm, extra
    kept.dtype, kept.in_place, kept.send = recvbuf.dtype, call.send is None, id(sendbuf)
    #: references the bound call holds on each buffer (recv, send); live
    #: selection binds more later, so its entries are only evicted by age
    kept.ours = ours if call.selection == "table" or call.algorithm != "auto" else None
    context.remember(key, kept)


def _delete_context(comm, keyval, context) -> None:
    if not MPI.Is_finalized():
        context.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_context)


def context_for(comm: MPI.Intracomm) -> Context:
    """The cached context of ``comm`` (collective the first time: it Dups)."""
    entry = _LIVE.get(id(comm))
    if entry is not None and entry[0] is comm:
        return entry[1]
    context = comm.Get_attr(_KEYVAL)
    if context is None:
        context = _watched_setup(comm)
        comm.Set_attr(_KEYVAL, context)
    context.ids.add(id(comm))
    _LIVE[id(comm)] = (comm, context)
    return context


def _watched_setup(comm: MPI.Intracomm) -> Context:
    """A new context: collective (a Dup, the node's CPU count), so a rank
    that never comes leaves the others waiting in MPI -- watched like a
    call (abort and warn modes: MPI cannot be left early)."""
    seconds, _ = settings()
    if seconds <= 0:
        return Context(comm)
    cell = WATCH.cell()
    cell.what = (f"the first call on a communicator of {comm.Get_size()} ranks (its set-up: "
                 "MPI_Comm_dup, collective; mpi_allreduce.setup(comm) does it ahead)", None)
    cell.count += 1
    try:
        return Context(comm)
    finally:
        cell.what = None


def cached_context(comm) -> Optional[Context]:
    """The context of this very comm object if it has one already (no MPI call)."""
    entry = _LIVE.get(id(comm))
    return entry[1] if entry is not None and entry[0] is comm else None


def setup(comm: MPI.Intracomm) -> None:
    """Do now what the first call on ``comm`` would: duplicate it (the
    library's private communicator) and find whether its node is
    oversubscribed -- both collective over ``comm``.  Call it on every rank
    from one thread before threads start calls on their own communicators
    (concurrent first uses on several communicators can deadlock in the MPI
    library's communicator creation), or to keep that cost out of a timed
    first call.  A communicator of one rank needs none."""
    if comm.Get_size() > 1:
        context_for(comm)


def release(comm: MPI.Intracomm) -> None:
    """Free the library's duplicate communicator and caches for ``comm`` now."""
    if comm.Get_attr(_KEYVAL) is not None:
        comm.Delete_attr(_KEYVAL)


@on_refresh
def _clear_all() -> None:
    for _, context in list(_LIVE.values()):
        context.clear()
