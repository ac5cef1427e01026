"""The library's state for one caller communicator, in one place.

A :class:`Context` is cached as an attribute of the caller's communicator
and owns everything the library keeps for it: its own duplicate of the
communicator (so a caller's pending receives never match library
messages), the node map, oversubscription flag and default decision table
(all three agreed by every rank at set-up, :meth:`Context.set_up`), the
plans (a schedule with its scratch, per call shape), the one cache of
bound calls (a plan on the caller's arrays, found again by the identity of
those arrays: blocking and non-blocking calls keep theirs here), the live
selectors, the tags of the calls in flight (:meth:`Context.claim`), the
re-entry guard (:attr:`Context.guard`), the call in progress
(:attr:`Context.what`: what the watchdog samples), and whether an earlier
call broke the communicator on this rank (:meth:`Context.breaks`).
:meth:`Context.free` drops all of it; it runs when the caller
frees the communicator, on :func:`release`, and (the caches only) on
:func:`mpi_allreduce.config.refresh`.  A communicator freed while
calls are in flight on it keeps its duplicate until they complete (MPI
completes pending operations on a freed communicator, and so do we).
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .config import on_refresh
from .engine import abandon, duplicate, wait_for
from .errors import ArgumentMismatch, Broken, ConcurrentCall, Stalled, TagsExhausted
from .executor import mpi_tags
from .selection import BUILT_IN_TABLE, DecisionTable, tuning_table
from .topology import emulated_nodes, where
from .watchdog import WATCH

__all__ = ["Context", "context_for", "release", "setup", "remember_call", "typed", "MAX_PLANS",
           "MAX_CALLS", "exchange_objects"]

#: plans kept per communicator (the least recently used go first)
MAX_PLANS = 64
#: bound calls kept per communicator (the oldest go first): more than a
#: model has parameter tensors (ResNet-50: 161), so a training step that
#: all-reduces each one repeats kept calls instead of binding every call
#: again (two thirds of the time per-tensor on ResNet-50 with 64)
MAX_CALLS = 256
#: live selectors (one per call shape) and decision tables kept per communicator
MAX_SELECTORS = 64
MAX_TABLES = 8


class Context:
    """The library's state for one caller communicator."""

    def __init__(self, comm: MPI.Intracomm):
        """Nothing collective yet: :meth:`set_up` does that, watched."""
        self.comm = MPI.COMM_NULL
        self.size = comm.Get_size()
        #: the node of every rank (from set-up) and some node runs more of
        #: these ranks than it has CPUs (``auto`` may then choose
        #: differently): agreed by all ranks, found once
        self.shared_nodes: tuple = ()
        self.oversubscribed = False
        #: auto's decision tables, agreed by all ranks on first use (None:
        #: the default one; else a file's path): see :meth:`table`
        self.tables: "OrderedDict[object, DecisionTable]" = OrderedDict()
        self.plans: "OrderedDict[tuple, object]" = OrderedDict()
        #: keys of this context's bound calls in :data:`CALLS`
        self.calls: dict = {}
        #: live selectors by call shape, at most MAX_SELECTORS (the least
        #: recently used go first: the same on every rank, which makes the
        #: same calls in the same order)
        self.selectors: "OrderedDict[tuple, object]" = OrderedDict()
        #: reproducible sums' work arrays and bound inner calls, per shape
        self.work: "OrderedDict[tuple, object]" = OrderedDict()
        #: handles of the caller's comm objects that lead here (see _LIVE)
        self.ids: set = set()
        #: how this communicator's tags are shared out (see spec.TagLayout)
        self.tags = mpi_tags()
        self._made = {True: 0, False: 0}  # persistent / non-blocking calls made so far
        #: slot -> weak reference to the operation holding it
        self.holders: dict = {}
        # (the slot each holder holds; its death lets the slot go, see claim)
        slot_of = self._slot_of = {}
        holders = self.holders

        def let_go(ref):  # (no reference to the context here: no cycle)
            slot = slot_of.pop(ref, None)
            if slot is not None and holders.get(slot) is ref:
                del holders[slot]
        self._let_go = let_go
        #: why this communicator is unusable on this rank (an exception: a
        #: call interrupted, failed or stalled after its messages started),
        #: or None; see :meth:`breaks`
        self.broken: Optional[Broken] = None
        #: the re-entry guard: held by the thread inside a call on this
        #: communicator (re-entrant: a call made of calls, such as a
        #: reproducible sum, holds it throughout); another thread that
        #: cannot take it gets ConcurrentCall instead of a wrong result
        self.guard = threading.RLock()
        #: whether a thread was refused the guard (ConcurrentCall) while
        #: another held it: the communicator is broken then, and the call
        #: that held the guard raises as it ends
        self.clashed = False
        #: the blocking call in progress, as (kind, plan), or a non-blocking
        #: one being started; None between calls: what the watchdog samples
        #: with ``count``
        self.what: Optional[tuple] = None
        self.count = 0

    def set_up(self, comm: MPI.Intracomm) -> None:
        """The collective part, every MPI call of it watched: the private
        duplicate (``MPI_Comm_idup``), then where the ranks run
        (:func:`~mpi_allreduce.topology.where`) and which decision table
        ``auto`` uses by default (:meth:`table`), agreed in one
        ``MPI_Iallgather``.  A rank that never comes is reported by the
        watchdog (and in its ``raise`` mode this raises
        :class:`~mpi_allreduce.errors.Stalled`, the communicator broken for
        the library on this rank)."""
        what = (f"the set-up of a communicator of {self.size} ranks (collective: "
                "MPI_Comm_idup and where the ranks run; mpi_allreduce.setup(comm) does it "
                "ahead)")
        self.comm = dup = duplicate(comm, what, self)
        table, error = _read_table(None)
        mine = np.array([*where(dup, what, self), *_record(table, error)], dtype=np.int64)
        everyone = np.empty((self.size, 4), dtype=np.int64)
        wait_for([dup.Iallgather(mine, everyone)], what, self)
        self.shared_nodes = tuple(int(n) for n in everyone[:, 0])
        self.oversubscribed = bool(everyone[:, 1].any())
        self.tables[None] = _decide(None, table, error, everyone[:, 2:])
        WATCH.watch(self)

    def breaks(self, cause: BaseException, what: str = "a call", keep=None) -> None:
        """An exception ended a call on this rank after its messages started
        (``cause``: an interrupt, an error, a stall): its messages are in
        disarray, so no later call may meet them.  Every later call on this
        communicator raises :class:`~mpi_allreduce.errors.Broken` (a stall:
        :class:`~mpi_allreduce.errors.Stalled`) at once on this rank; the
        peers' calls stall and are reported.  What the call's messages may
        still be read from or land in is kept for good (``engine.abandon``):
        this context (its plans' scratch, its kept calls' arrays) and
        ``keep`` (what ran the call, so its arrays) -- a late peer matches a
        send only then, even inside ``MPI_Finalize``.  (``keep`` is kept
        whether or not the communicator was broken already: a second call
        that ends with messages in flight on it needs its arrays kept too.)"""
        if keep is not None:
            abandon(keep, None)
        if self.broken is not None:
            return
        abandon(self, None)
        stalled = isinstance(cause, Stalled)
        how = "stalled" if stalled else "was left by an exception"
        self.broken = (Stalled if stalled else Broken)(
            f"an earlier call on this communicator ({what}) {how} on this rank "
            f"({type(cause).__name__}: {cause}); its messages are in disarray, so the library "
            "will not use this communicator again: free it and go on with a new one "
            "(comm.Dup() on every rank), or end the job")

    def collective(self, purpose: str, start: Callable[[], MPI.Request], what: str) -> None:
        """One non-blocking collective of the library on this communicator
        (``start`` posts it on :attr:`comm`), after the ranks agreed that it
        is the collective they all make (:meth:`record`, ``purpose``),
        waited for under the watchdog; refused at once on a broken
        communicator, where the peers may be inside another collective."""
        self.record(purpose, (), what)
        try:
            wait_for([start()], what, self)
        except BaseException as exc:  # (see allgather_object)
            self.breaks(exc, what)
            raise

    def record(self, purpose: str, values, what: str) -> np.ndarray:
        """Every rank's ``values`` (up to 3 integers), in rank order: the
        first or only step of every collective the library makes on this
        communicator after its set-up, one watched ``MPI_Iallgather`` of 4
        int64 a rank that also carries the collective's ``purpose``
        (:data:`PURPOSES`).  MPI matches collectives by call order alone;
        whether a rank makes one (``check=True``'s agreement, a tuning file
        named for the first time, live selection's sync, the choice of a
        device) is its options' affair, so two ranks may make two different
        ones.  Since all of them begin alike, those meet here, every rank
        sees that the purposes differ, and every rank raises
        :class:`~mpi_allreduce.errors.ArgumentMismatch` before any further
        message -- never one collective's bytes read as another's (the
        communicator stays usable, but where the collective ran inside a
        call, live selection's sync, which the error leaves as any error
        leaves a call).  Refused at once on a broken
        communicator, where the peers may be inside another collective."""
        if self.broken is not None:
            raise self.refusal()
        mine = np.zeros(4, np.int64)
        mine[0] = PURPOSES[purpose]
        mine[1:1 + len(values)] = values
        everyone = np.empty((self.size, 4), np.int64)
        wait_for([self.comm.Iallgather(mine, everyone)], what, self)
        codes = everyone[:, 0]
        if (codes != codes[0]).any():
            names = {code: name for name, code in PURPOSES.items()}
            made = ", ".join(f"rank {rank}: {names.get(int(code), code)}"
                             for rank, code in enumerate(codes))
            raise ArgumentMismatch(
                f"the ranks made different collectives of the library on this communicator "
                f"({made}), so none went further: the options that make them -- check, "
                "tuning, selection, the device -- must be the same on every rank")
        return everyone[:, 1:]

    def allgather_object(self, obj, purpose: str, what: str) -> list:
        """Every rank's ``obj``, in rank order, on the library's
        communicator: the sizes in :meth:`record` (``purpose``), then the
        pickled bytes (refused at once where it is broken)."""
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = self.record(purpose, (data.size,), what)[:, 0]
        try:
            everything = np.empty(int(sizes.sum()), dtype=np.uint8)
            wait_for([self.comm.Iallgatherv(data, [everything, sizes.tolist()])], what, self)
        except BaseException as exc:
            # (between the two steps, or in the second: the peers are in it,
            # and this rank's next collective would meet their second step)
            self.breaks(exc, what)
            raise
        return _unpickled(everything, sizes)

    def refusal(self) -> Broken:
        """The error a call on a broken communicator raises (a fresh one each
        time; one whose set-up never ran on this rank, say from another
        thread's interrupt as it began, is broken too)."""
        if self.broken is None:
            return Broken("the set-up of this communicator did not complete on this rank: the "
                          "library will not use it (free it and go on with a new one)")
        return type(self.broken)(*self.broken.args)

    def table(self, tuning) -> DecisionTable:
        """``auto``'s decision table for ``tuning`` (None: the default one,
        from ``MPI_ALLREDUCE_TUNING``, else the one ``tune`` measured, else
        the built-in; a str: that file; a :class:`DecisionTable`: itself).
        A table read from a file is rank-local state, so the ranks agree on
        it (the default at set-up, a named file the first time it is named:
        a watched ``MPI_Iallgather`` of its digest): a file some rank cannot
        read raises ValueError on every rank; where ranks found different
        default tables (nodes of different sizes find different measured
        tables), every rank takes the built-in one, with a warning;
        different files named explicitly raise ValueError."""
        if isinstance(tuning, DecisionTable):
            return tuning
        table = _kept(self.tables, tuning, lambda: self._agree_table(tuning), MAX_TABLES)
        if isinstance(table, ValueError):  # (every rank has it)
            raise ValueError(*table.args)
        return table

    def _agree_table(self, tuning):
        """The table of ``tuning`` every rank uses (or the error every rank
        raises), agreed in one watched ``MPI_Iallgather``."""
        table, error = _read_table(tuning)
        everyone = self.record("table", _record(table, error),
                               "the agreement on auto's decision table")
        return _decide(tuning, table, error, everyone[:, :2])

    def selector(self, shape: tuple, make: Callable[[], object]):
        """The live selector of ``shape``, made on first use (see :attr:`selectors`)."""
        return _kept(self.selectors, shape, make, MAX_SELECTORS)

    def snapshot(self) -> tuple:
        """What the watchdog samples: (calls made, the one in progress, thread)."""
        return self.count, self.what, None

    def counted(self, persistent: bool) -> int:
        """How many persistent (``persistent``) or non-blocking calls this
        rank has counted on the communicator (each :meth:`claim` counts one)."""
        return self._made[persistent]

    def claim(self, op, fingerprint: int, persistent: bool) -> int:
        """The tag of the next persistent (``persistent``) or non-blocking
        call, ``op``, held until ``op`` no longer holds it (complete; a
        persistent one freed; a slot it held before is let go: a completed
        non-blocking call started again).  Refused if its slot is still
        held here.  (One function: it runs at every start of a non-blocking
        call.)"""
        made, tags = self._made, self.tags
        number = made[persistent]
        made[persistent] = number + 1
        try:
            slot, tag = tags.place(persistent, number, fingerprint)
            holders = self.holders
            ref = holders.get(slot)
            mine = op.holder  # one weak reference per call, whose death lets its slot go
            if ref is not None and ref is not mine:
                held = ref()
                if held is not None and held.holds_tag():
                    raise self._exhausted(persistent)
            if mine is None:
                mine = op.holder = weakref.ref(op, self._let_go)
            else:
                old = self._slot_of.get(mine)
                if old is not None and holders.get(old) is mine:
                    del holders[old]
            holders[slot] = mine
            self._slot_of[mine] = slot
            return tag
        except TagsExhausted:
            # (not counted: a refusal, api.left -- where only this rank holds
            # more, its peers' call stalls with the refusal's empty call)
            made[persistent] = number
            raise
        except BaseException as exc:
            # an interrupt here: this rank counted a call its peers may not
            # have, so its later calls' tags would be theirs shifted by one
            self.breaks(exc, "the start of a non-blocking or persistent call")
            raise

    def _exhausted(self, persistent: bool) -> TagsExhausted:
        what = "persistent requests alive" if persistent else "non-blocking calls in flight"
        room = self.tags.persistent if persistent else self.tags.slots - self.tags.persistent
        return TagsExhausted(
            f"more than {room} {what} on one communicator (tags up to "
            f"2^{self.tags.bits}): the next would reuse the tag of one still held; wait "
            "for (or free) older ones first")

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
        """The node of every rank: emulated nodes of ``ranks_per_node``, or
        (None) the nodes found at set-up."""
        if ranks_per_node is None:
            return self.shared_nodes
        return emulated_nodes(self.size, ranks_per_node)

    def plan(self, key: tuple, build: Callable[[], object]):
        """The plan for ``key``, built on first use; least recently used go first."""
        return _kept(self.plans, key, build, MAX_PLANS)

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
            if call.release is not None:
                call.release()

    def clear(self) -> None:
        """Drop the caches (plans, bound calls, selectors); keep the communicator."""
        for key, call in list(self.calls.items()):
            self.forget(key, call)
        self.plans.clear()
        self.tables.clear()
        self.selectors.clear()
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


def _kept(cache: OrderedDict, key, make: Callable[[], object], most: int):
    """``cache[key]``, made by ``make()`` on first use; at most ``most``
    entries, the least recently used dropped first (alike on every rank,
    which makes the same calls in the same order)."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        while len(cache) > most:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


def _read_table(tuning) -> tuple:
    """(the decision table this rank reads for ``tuning``, None), or (None, the error)."""
    try:
        return tuning_table(tuning), None
    except (OSError, ValueError) as exc:
        return None, exc


def _record(table, error) -> tuple:
    """What a rank tells the others of its table: (digest, unreadable)."""
    return (0 if table is None else table.digest), int(error is not None)


def _decide(tuning, table, error, everyone) -> object:
    """The table every rank uses, from every rank's :func:`_record`
    (``everyone``: one row per rank), or the ValueError every rank raises
    when ``auto`` needs it (see :meth:`Context.table`)."""
    unread = [r for r in range(len(everyone)) if everyone[r, 1]]
    if unread:
        return ValueError(f"auto's decision table cannot be read on rank(s) "
                          f"{', '.join(map(str, unread))}"
                          + (f": {error}" if error is not None else ""))
    if len(set(everyone[:, 0].tolist())) == 1:
        return table
    if tuning is not None:
        return ValueError(f"the decision table {tuning} differs between ranks (digests "
                          f"{', '.join(f'{d:x}' for d in everyone[:, 0])}): give every "
                          "rank the same file")
    if table is not BUILT_IN_TABLE:
        warnings.warn("the ranks found different decision tables for auto (a measured table "
                      "on some nodes only, or MPI_ALLREDUCE_TUNING set differently): every "
                      "rank uses the built-in table", RuntimeWarning, stacklevel=2)
    return BUILT_IN_TABLE


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

#: communicator handle -> its context: the fast way to a context for a
#: repeated call, whatever Python object names the communicator (a new
#: wrapper of it per call finds the one entry, and none is held).  An entry
#: goes when its communicator is freed (Context.free, from the attribute's
#: delete callback), before MPI can give its handle to another one.
_LIVE: dict = {}


class Remembered:
    """A bound call kept for repeats with the very same argument objects
    (one per receive buffer: the last call made with it; ``extra``: its
    optional arguments, None when it had none).

    An id names one live object: the op and comm objects are held here,
    the buffers by weak references whose death drops the entry (before an
    id can be reused).  The bound call holds views of the buffers, so numpy
    cannot resize them in place; what a first call reads of them is
    rechecked on every call (:meth:`unchanged`: the dtype, C-contiguity, a
    writeable receive buffer -- numpy lets a caller assign each in place),
    and a reshaped buffer is the same memory, which the views still cover."""

    __slots__ = ("run", "dtype", "in_place", "send", "op", "comm", "algorithm", "extra", "refs",
                 "ours", "release", "host")

    def repeats(self, sendbuf, recvbuf, op, comm, algorithm, extra: tuple) -> bool:
        """Whether a call with these arguments is this kept call again: the
        very same objects, unchanged in what the first call's validation
        read of them (:meth:`unchanged`), the same optional arguments
        (``extra``: a dict of them, None when it had none)."""
        return (self.send == id(sendbuf) and self.op is op
                and (self.comm is comm or self.comm == comm)  # (another wrapper of it)
                and self.algorithm == algorithm and self.unchanged(sendbuf, recvbuf)
                and self.extra == extra)

    def unchanged(self, sendbuf, recvbuf) -> bool:
        """Whether the buffers are still what the bound call was made for:
        the dtype (assigning ``dtype`` reinterprets an array in place), and
        the layout -- C-contiguous, and a host receive buffer writeable
        (assigning ``strides`` or ``flags.writeable`` changes an array in
        place too: the bound call's views, made of the memory as it was,
        would reduce it in memory order, or write where the caller forbade
        it, where a first call raises)."""
        flags = recvbuf.flags
        return (recvbuf.dtype is self.dtype and flags.c_contiguous
                and (not self.host or flags.writeable)
                and (self.in_place or sendbuf.dtype is self.dtype
                     and sendbuf.flags.c_contiguous))

    def abandoned(self) -> bool:
        """Whether the caller holds none of the buffers any more: only the
        bound call's views keep them alive (then they are dropped)."""
        for ref, ours in zip(self.refs, self.ours):
            buf = ref()
            # the references: ours, this frame's ``buf`` and getrefcount's argument
            if buf is None or sys.getrefcount(buf) - 2 <= ours:
                return True
        return False


def typed(keywords: Optional[dict]) -> Optional[dict]:
    """A call's keywords as a kept call keeps and compares them (None for
    none): each value with its type, so that a value equal to a kept one
    but of another type (``0`` for ``False``, ``512.0`` for ``512``, which a
    first call refuses) makes a new call, validated as a first one is."""
    if not keywords:
        return None
    return {name: (type(value), value) for name, value in keywords.items()}


def refcounts(call) -> list:
    return [sys.getrefcount(b) for b in (call.recv, call.send) if b is not None]


def remember_call(context: Context, run, sendbuf, recvbuf, op, comm, algorithm,
                  call, ours: list, extra, kind=None, release=None) -> bool:
    """Keep the bound call for repeats (``kind``: None for a blocking call,
    keyed by the receive buffer's id; else its key is ``(kind, id)``;
    ``release``: what gives back what it holds of its own when it is
    dropped); drop those whose buffers the caller has let go (the bound
    views would keep them alive otherwise).  Whether it is kept."""
    for key, old in list(context.calls.items()):
        if old.ours is not None and old.abandoned():
            context.forget(key, old)
    if recvbuf is not call.recv or (call.send is not None and sendbuf is not call.send):
        return False  # converted on the way in (a list, a foreign device array): no identity
    kept = Remembered()
    key = id(recvbuf) if kind is None else (kind, id(recvbuf))

    def forget(ref):  # a buffer dies: its entry goes before its id can be reused
        entry = context.calls.get(key)  # (no reference to ``kept`` here: no cycle)
        if entry is not None and ref in entry.refs:
            context.forget(key, entry)

    try:
        # (in the order of ``ours``: see refcounts)
        buffers = (recvbuf,) if call.send is None else (recvbuf, sendbuf)
        kept.refs = [weakref.ref(b, forget) for b in buffers]
    except TypeError:  # an array type without weak references
        return False
    # (the options as they are now: a tuning dict changed in place later
    # makes the next call a new one, never a repeat of this one)
    try:
        kept.extra = None if extra is None else copy.deepcopy(extra)
    except Exception:  # noqa: BLE001 - a value that cannot be copied (a path
        return False  # object holding a lock, say): each call is a first one
    kept.run, kept.op, kept.comm, kept.algorithm = run, op, comm, algorithm
    kept.release = release
    kept.dtype, kept.in_place, kept.send = recvbuf.dtype, call.send is None, id(sendbuf)
    kept.host = isinstance(recvbuf, np.ndarray)  # (a device array has no writeable flag)
    #: references the bound call holds on each buffer (recv, send); live
    #: selection binds more later, so its entries are only evicted by age
    kept.ours = ours if call.selection == "table" or call.algorithm != "auto" else None
    context.remember(key, kept)
    return True


def _delete_context(comm, keyval, context) -> None:
    if not MPI.Is_finalized():
        context.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_context)

#: what each collective the library makes on its communicator after the
#: set-up is for: the first integer of its first message (see Context.record)
PURPOSES = {"table": 1, "check": 2, "check-spec": 3, "live": 4, "device": 5, "counts": 6,
            "mpi4py": 7}


def exchange_objects(comm: MPI.Intracomm, obj, root: Optional[int], what: str,
                     context: Optional[Context] = None) -> Optional[list]:
    """Every rank's ``obj`` (pickled), in rank order: on every rank (``root``
    None) or on ``root`` alone (None elsewhere).  Two non-blocking
    collectives on ``comm``, the sizes and then the bytes, each waited for
    under the watchdog (:func:`~mpi_allreduce.engine.wait_for`; ``what``
    names them in a report, ``context`` is broken if they stall)."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    mine = root is None or comm.Get_rank() == root
    size = np.array([data.size], dtype=np.int64)
    sizes = np.empty(comm.Get_size() if mine else 0, dtype=np.int64)
    wait_for([comm.Iallgather(size, sizes) if root is None else
              comm.Igather(size, sizes if mine else None, root)], what, context)
    everything = np.empty(int(sizes.sum()), dtype=np.uint8)
    whole = [everything, sizes.tolist()] if mine else None
    wait_for([comm.Iallgatherv(data, whole) if root is None else
              comm.Igatherv(data, whole, root)], what, context)
    if not mine:
        return None
    return _unpickled(everything, sizes)


def _unpickled(everything: np.ndarray, sizes: np.ndarray) -> list:
    """The objects pickled one after another in ``everything``, ``sizes``
    bytes each (what :func:`exchange_objects` and
    :meth:`Context.allgather_object` gathered)."""
    ends = np.cumsum(sizes).tolist()
    return [pickle.loads(everything[end - n:end].tobytes())
            for n, end in zip(sizes.tolist(), ends)]


def context_for(comm: MPI.Intracomm) -> Context:
    """The cached context of ``comm`` (collective the first time: its
    watched set-up, :meth:`Context.set_up`).  A communicator whose set-up
    did not complete on this rank raises :class:`~mpi_allreduce.errors.Broken`."""
    context = _LIVE.get(comm.handle)
    if context is None:
        context = comm.Get_attr(_KEYVAL)
        if context is None:
            context = Context(comm)
            try:  # (attached in the try: an interrupt as it is attached breaks it too)
                comm.Set_attr(_KEYVAL, context)
                context.set_up(comm)
            except BaseException as exc:
                context.breaks(exc, "its set-up")
                raise
        context.ids.add(comm.handle)
        _LIVE[comm.handle] = context
    if context.comm == MPI.COMM_NULL:
        raise context.refusal()
    return context


def broken_by(comm, cause: BaseException, what: str) -> None:
    """``cause`` (an interrupt) left a call on ``comm`` on this rank before
    its messages, where its peers may be inside it: the communicator is
    broken for the library on this rank (:meth:`Context.breaks`), its
    context made for that where it has none yet -- no set-up, no MPI call:
    the set-up its peers are in stalls and is reported, as they would be
    with any broken communicator's rank."""
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL or comm.Get_size() == 1:
        return
    context = cached_context(comm)
    if context is None:
        context = comm.Get_attr(_KEYVAL)
        if context is None:
            context = Context(comm)
            comm.Set_attr(_KEYVAL, context)
        context.ids.add(comm.handle)
        _LIVE[comm.handle] = context
    context.breaks(cause, what)


def cached_context(comm) -> Optional[Context]:
    """The context of ``comm`` if it has one already (no MPI call)."""
    try:
        return _LIVE.get(comm.handle)
    except AttributeError:  # not a communicator (the call's checks say so)
        return None


def setup(comm: MPI.Intracomm) -> None:
    """Do now what the first call on ``comm`` would: duplicate it (the
    library's private communicator) and find whether its node is
    oversubscribed -- both collective over ``comm``.  Call it on every rank
    from one thread before threads start calls on their own communicators
    (concurrent first uses on several communicators can deadlock in the MPI
    library's communicator creation), or to keep that cost out of a timed
    first call.  A communicator of one rank needs none.  On a communicator
    the library broke on this rank (see ``Context.breaks``) it raises
    that error, as every call does: what is made on it after set-up (the
    drop-in ``Comm``'s calls handed to mpi4py) must not be made either."""
    if comm.Get_size() > 1:
        context = context_for(comm)
        if context.broken is not None:
            raise context.refusal()


def release(comm: MPI.Intracomm) -> None:
    """Free the library's duplicate communicator and caches for ``comm`` now."""
    if comm.Get_attr(_KEYVAL) is not None:
        comm.Delete_attr(_KEYVAL)


@on_refresh
def _clear_all() -> None:
    for context in list(_LIVE.values()):
        context.clear()
