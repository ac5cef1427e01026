"""The library's state for one caller communicator, in one place.

A :class:`Context` is cached as an attribute of the caller's communicator
and owns everything the library keeps for it: its own duplicate of the
communicator (so a caller's pending receives never match library
messages), the node map and oversubscription flag, the plans (a schedule
with its scratch, per call shape), the bound calls (a plan on the caller's
arrays, found again by the identity of those arrays) and the live
selectors.  :meth:`Context.free` drops all of it; it runs when the caller
frees the communicator, on :func:`release`, and (the caches only) on
:func:`mpi_allreduce.config.refresh`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from mpi4py import MPI

from .config import on_refresh
from .executor import tag_space
from .topology import node_map, oversubscribed

__all__ = ["Context", "context_for", "release", "MAX_PLANS", "MAX_CALLS"]

#: plans kept per communicator (the least recently used go first)
MAX_PLANS = 64
#: bound calls kept per communicator (the oldest go first)
MAX_CALLS = 64
#: non-blocking calls in flight together on one communicator with
#: different tags for sure (their sequence numbers cycle through these)
SEQUENCE_SLOTS = 4096


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
        #: ids of the caller's comm objects that lead here (see _LIVE)
        self.ids: set = set()
        self._sequence = 0
        #: why this communicator is unusable (a call stalled and raised), or None
        self.broken: Optional[str] = None

    def next_tag(self, fingerprint: int) -> int:
        """The tag of the next non-blocking or persistent call, in the lower
        half of the tag space (blocking calls take the upper half): its
        place in the sequence of such calls (every rank starts them in the
        same order, so each call has one tag everywhere, and calls in flight
        together have different ones, as in libnbc), and above that bits of
        the call's fingerprint, so mismatched calls cannot match."""
        self._sequence += 1
        half = tag_space(self.comm)
        slots = min(SEQUENCE_SLOTS, half)
        return self._sequence % slots + slots * (fingerprint % (half // slots))

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

    def free(self) -> None:
        self.clear()
        for key in self.ids:
            _LIVE.pop(key, None)
        self.ids.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


#: every context's bound calls, by the identity of the call's arguments:
#: the one look-up of a repeated call (see api.allreduce); entries are
#: added and removed by their context only
CALLS: dict = {}

#: id(caller's comm object) -> (that object, its context): the fast way to a
#: context for a repeated call (the object is held, so its id stays its own)
_LIVE: dict = {}


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
        context = Context(comm)
        comm.Set_attr(_KEYVAL, context)
    context.ids.add(id(comm))
    _LIVE[id(comm)] = (comm, context)
    return context


def cached_context(comm) -> Optional[Context]:
    """The context of this very comm object if it has one already (no MPI call)."""
    entry = _LIVE.get(id(comm))
    return entry[1] if entry is not None and entry[0] is comm else None


def release(comm: MPI.Intracomm) -> None:
    """Free the library's duplicate communicator and caches for ``comm`` now."""
    if comm.Get_attr(_KEYVAL) is not None:
        comm.Delete_attr(_KEYVAL)


@on_refresh
def _clear_all() -> None:
    for _, context in list(_LIVE.values()):
        context.clear()
