"""The engine: calls in flight, what moves them on, and the one wait loop.

A call in flight is an :class:`Operation`: the stages of a bound plan
(:class:`~mpi_allreduce.executor.Stage`: local steps, messages, local
steps that overlap them), run one after another.  Starting it posts the
first stage's messages; *advancing* it tests (or waits for) the messages of
the current stage and, once they are done, runs the next stage; the last
stage done, the call is complete.  These are Open MPI libnbc's rounds
(``NBC_Start_round`` and ``NBC_Progress``).  MPI's own requests (a
set-up collective, an MPI call the torch backend makes) are operations too
(:class:`MPIOperation`), so every wait of the library goes through
``_Engine.wait``: watched by the watchdog, and in its ``raise`` mode
polled against one deadline.  :func:`wait_for` is that wait for MPI
requests the library posts itself (the set-up of a communicator, check
mode's agreement, live selection's sync).

This module knows nothing of requests as the caller sees them
(:mod:`~mpi_allreduce.progress`) nor of communicators' contexts
(``mpi_allreduce.context``), which both build on it: an operation's
``context`` is any object with ``breaks(why)``.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import itertools
import os
import sys
import threading
import time
from typing import Optional

from mpi4py import MPI

from .backend import Slot, message_calls, started
from .config import environment
from .errors import Broken, Stalled
from .threads import sheltered, start_daemon
from .watchdog import WATCH, describe, report, settings

__all__ = ["Operation", "MPIOperation", "ENGINE", "wait_for", "wait_for_call",
           "blocking_collective", "duplicate",
           "thread_progress", "mpi_threads", "THREAD_MIN_BYTES", "ABANDONED"]


#: calls moving fewer bytes per rank than this are advanced by the caller
THREAD_MIN_BYTES = 64 * 1024
#: tag of the progress thread's wake-up message to itself
_WAKE_TAG = 0x77616B
#: a thread's list of calls it advances is pruned of completed ones from this length on
_PRUNE = 64
#: a polling wait (raise mode) spins this long after the last stage any
#: call moved to (MOVES), then sleeps before each poll, naps growing from
#: NAP_SECONDS[0] by half each time to at most NAP_SECONDS[1] and to a
#: twentieth of the time since: a rank whose peer is late gives its core to
#: the peer (on an oversubscribed node, the core the peer needs to come),
#: and a stage that completes late is seen at most 5% and a millisecond late
SPIN_SECONDS = 1e-3
NAP_SECONDS = (20e-6, 1e-3)
#: stages entered by every call so far (a wait's back-off starts again when it
#: moves; counted without a lock: a count lost between threads costs one nap)
MOVES = [0]


class Operation:
    """One call in flight: a bound plan's stages, run in order."""

    __slots__ = ("stages", "plan", "comm", "mpitype", "post", "tag", "slot", "index", "pending",
                 "done", "error", "event", "threaded", "persistent", "kind", "starts", "order",
                 "limit", "deadline", "reserved", "context", "lock", "owner", "kept",
                 "round", "live", "holder", "unwaited", "callbacks", "adopted", "quit",
                 "__weakref__")

    def __init__(self, stages: list, plan, tag: int, slot: Slot, threaded: bool,
                 kind: str = "non-blocking call", context=None, reserved: bool = False):
        self.stages, self.tag, self.plan = stages, tag, plan
        if plan is not None:
            self.comm, self.mpitype, self.post = plan.comm, plan.mpitype, plan.backend.post
        #: names this call's staging buffers (device backends: a backend.Slot,
        #: held while the operation lives; burnt if it is given up)
        self.slot = slot
        self.threaded = threaded
        #: per stage, MPI persistent requests made once (host buffers), or None
        self.persistent = None
        self.index = len(self.stages)
        self.pending: list = []
        self.done = True
        self.error: Optional[BaseException] = None
        self.event = threading.Event() if threaded else None
        self.kind, self.context, self.starts = kind, context, 0
        #: when this start began, among every call's starts (see ORDER)
        self.order = 0
        #: a persistent request's tag is held until it is freed
        self.reserved = reserved
        #: two threads never advance one operation at once
        self.lock = threading.Lock()
        self.owner = 0  # the thread that advances it (caller progress)
        #: kept for repeats with its bound call's scratch (a non-blocking
        #: call started again on the same arrays): its scratch stays its own
        self.kept = False
        seconds, action = settings()
        #: the watchdog's raise mode: seconds a start may wait (else 0)
        self.limit = seconds if action == "raise" else 0.0
        self.deadline = 0.0
        #: the one-round fast path (see :meth:`one_round`), or None
        self.round = None
        self.live: list = []  # the one-round fast path's requests in flight
        self.holder = None  # what holds its tag in its context (see Context.claim)
        #: a request of this call is complete but not yet waited (or tested)
        self.unwaited = False
        #: what runs once this start of the call is complete (see :meth:`when_done`), or None
        self.callbacks: Optional[list] = None
        #: handed to the progress thread for this start only (see ``_Engine.adopt``)
        self.adopted = False
        #: its waiter was left by an exception: the thread gives it up (``_Engine.give_up``)
        self.quit = False
        if plan is not None and seconds > 0:
            WATCH.watch(self)

    def one_round(self) -> None:
        """Take the fast path where every message travels in one round
        (host buffers, progressed by the caller: 2 ranks, short vectors).
        Nothing needs advancing between the start and the wait, so neither
        goes through the stages: a start runs :meth:`round_steps` (the local
        steps before the round, the start of its messages -- MPI persistent
        requests made once, else an ``MPI_Irecv``/``MPI_Isend`` pair with
        this start's tag -- and the steps that overlap them), and a wait
        (``Request.wait``) waits for ``self.live`` in MPI and runs the steps
        after them, with none of the engine's bookkeeping -- unless a
        deadline (the watchdog's raise mode) makes the call poll in the one
        wait loop, through the stages.  ``self.round``: (the steps before
        the round, those that overlap it, those after it, what posts its
        messages where they are not persistent requests, the round's stage)."""
        if self.threaded or self.limit or self.plan.backend.device:
            return
        rounds = [i for i, stage in enumerate(self.stages) if stage.pairs]
        if len(rounds) != 1:
            return
        (index,) = rounds
        stages = self.stages
        before = [s for stage in stages[:index] for s in stage.before + stage.overlap]
        before += stages[index].before
        after = [s for stage in stages[index + 1:] for s in stage.before + stage.overlap]
        posts = None  # (a persistent call's requests are made: they are its live ones)
        if self.persistent is not None:
            self.live = self.persistent[index]
        else:
            posts = message_calls(self.comm, stages[index].pairs, self.mpitype)
        self.round = (before, list(stages[index].overlap), after, posts, index)
        self.index = index

    def round_steps(self) -> list:
        """A one-round start as compiled steps (see :meth:`one_round`)."""
        before, overlap = self.round[:2]
        if self.persistent is not None:  # (its request counts the start: Request.start)
            return [*before, (_startall, (self.live,)), *overlap]
        return [*before, (self._post_round, ()), *overlap]

    def _post_round(self) -> None:
        self.started()
        self.live = started(self.round[3], self.tag)

    def snapshot(self) -> tuple:
        """What the watchdog samples: (starts, (kind, plan) while in flight, thread)."""
        return self.starts, None if self.done else (self.kind, self.plan), "any"

    def finished(self) -> bool:
        """Whether this start is complete as its caller may see it: a call
        on the progress thread once the thread has let it go (its event:
        ``done`` is set while the thread is still inside :meth:`advance`,
        and a start made then would be advanced there too), else ``done``."""
        return self.event.is_set() if self.threaded else self.done

    def holds_tag(self) -> bool:
        """Whether this call's tag may not be given to another call yet."""
        return self.reserved or not self.done

    def when_done(self, callback) -> None:
        """Run ``callback()`` once this start of the call is complete, with
        or without an error (at once if it is): on the thread that completes
        it -- the progress thread, which takes the call over if MPI runs
        threads (``_Engine.adopt``), so that it completes whether or not
        anyone waits; else the thread whose ``wait()`` or ``test()``
        completes it.  On the thread, the callbacks of calls on one
        communicator run in the order the calls started (see
        ``_Engine._turn``) whatever order they complete in; one added to a
        call already complete runs at once, on the thread that adds it,
        unless an earlier call's callbacks on its communicator are still to
        run on the thread: then there, after them."""
        # (complete, but an earlier call's callbacks on its communicator are
        # still to run on the thread: this one is run there, after them)
        behind = self.done and _ENGINE.callbacks_pending(self.context, self.order)
        with _CALLBACKS:
            queued = not self.done or behind
            if queued:
                if behind and self.threaded:
                    # (let go by the thread already: its waiter waits for it
                    # again, or would run the callback on its own thread)
                    self.event.clear()
                if self.callbacks is None:
                    self.callbacks = []
                self.callbacks.append(callback)
        if not queued:
            _run_all((callback,))  # (its exception printed, as on the thread)
        elif behind and self.threaded:
            _ENGINE.start_threaded(self)  # (taken again; or held there still: see _turn)
        elif not self.threaded and mpi_threads():
            _ENGINE.adopt(self)

    def taken(self) -> Optional[list]:
        """The callbacks of a completed start, taken (each runs once)."""
        with _CALLBACKS:
            callbacks, self.callbacks = self.callbacks, None
        return callbacks

    def fire(self) -> None:
        """Run the callbacks of a completed start (those :meth:`taken` now)."""
        _run_all(self.taken())

    def started(self) -> None:
        """A new start of this call: in flight, numbered among every call's
        starts (``ORDER``), with its own deadline (raise mode), and none of
        an earlier start's give-up left."""
        self.done, self.error, self.quit = False, None, False
        self.starts += 1
        self.order = next(ORDER)
        if self.limit:  # (raise mode: each start has its own deadline)
            self.deadline = time.monotonic() + self.limit

    def begin(self) -> None:
        """Run the stages up to the first with messages in flight."""
        self.index = -1
        self.started()
        if self.event is not None:
            self.event.clear()
        self._next()

    def _next(self) -> None:
        stages, persistent = self.stages, self.persistent
        MOVES[0] += 1
        while True:
            self.index += 1
            if self.index == len(stages):
                self.done = True
                return
            before, pairs, overlap = stages[self.index]
            for function, args in before:
                function(*args)
            if pairs:
                if persistent is not None:
                    requests = persistent[self.index]
                    MPI.Prequest.Startall(requests)
                    self.pending = [_Started(requests)]
                else:
                    post, comm, mpitype, slot = self.post, self.comm, self.mpitype, \
                        self.slot.name
                    self.pending = [post(comm, send, dest, recv, source, mpitype, self.tag,
                                         f"{slot}.{k}")
                                    for k, (send, dest, recv, source) in enumerate(pairs)]
            for function, args in overlap:
                function(*args)
            if pairs:
                return

    def advance(self, block: bool, take_lock: Optional[bool] = None) -> bool:
        """Move on as far as the messages allow (``block``: until done);
        whether the call is complete.  An error ends the call: it is kept
        for ``wait()`` to raise.  (Another thread advancing it now: no,
        unless ``take_lock`` -- the progress thread, which must not leave a
        call whose requests its own wait completed: others hold a call on
        the thread only for a moment.)"""
        if not self.lock.acquire(block if take_lock is None else take_lock):
            return self.done
        try:
            if self.adopted and threading.get_ident() != _ENGINE.ident:
                return self.done  # (the progress thread's alone now: see _Engine.adopt)
            if self.quit and not self.threaded:  # (given up while held here: see drop)
                self.quit = False
                if not self.done:
                    self.abandon()
                return True
            while not self.done:
                if block:
                    for p in self.pending:
                        p.wait()
                    self.pending = []
                else:
                    self.pending = [p for p in self.pending if not p.test()]
                    if self.pending:
                        return False
                context = self.context
                if context is not None and context.broken is not None \
                        and self.index + 1 < len(self.stages):
                    # its communicator broke while it was in flight (a wait
                    # of it or of another call left by an interrupt or a
                    # stall): its next stage could send what the caller
                    # wrote into its arrays since, so it posts nothing more
                    # -- on every path that advances a call, whoever holds it
                    raise context.refusal()
                self._next()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait()
            self.end(exc)
            if not isinstance(exc, Exception) and threading.get_ident() != _ENGINE.ident:
                # an interrupt (Ctrl-C, SystemExit) belongs to the thread it
                # landed in, now: raised out of whatever wait or test advanced
                # this call (it may be another call's: a wait advances all of
                # its thread's calls), never parked as this call's error while
                # that wait goes on -- the waiter would see only the broken
                # communicator.  This call's own later wait raises the broken
                # communicator's error, not the interrupt again.
                if self.context is not None:
                    self.error = self.context.refusal()
                raise
        finally:
            self.lock.release()
        return True

    def end(self, exc: BaseException) -> None:
        """End the call with ``exc``, raised by MPI (or by a step) while it
        was advanced: kept for ``wait()`` to raise, and its communicator
        broken -- its messages are in disarray.  Its holder calls it (under
        the call's lock)."""
        self.error, self.done, self.pending = exc, True, []
        self.slot.burn()  # (messages may be in flight: see abandon)
        if self.context is not None:
            self.context.breaks(exc, self.kind, self.stages)

    def stalled(self) -> Stalled:
        """Give up on this call (its deadline passed): the error to raise."""
        if not self.threaded:  # (the thread's own wait holds its requests)
            self.drop()
        text = report(describe(self.kind, self.plan), self.limit, self.starts,
                      threading.current_thread().name)
        error = Stalled(text)
        if self.context is not None:
            self.context.breaks(error, self.kind)
        return error

    def abandon(self) -> None:
        """Give up on the messages in flight (a stalled call): its posted
        requests are cancelled and freed, so none is left for MPI_Finalize;
        persistent ones are kept as they are (see below).  Its staging
        buffers are never reused, and its arrays are kept (``ABANDONED``):
        a late message may still land there, or a send still read from
        there."""
        self.slot.burn()
        abandon(self.stages)
        if self.persistent is not None:
            # persistent requests are kept as they are, never cancelled or
            # freed: MPICH crashes cancelling an active one (as the caller's
            # release would freeing it: it frees none of a given-up call's)
            abandon(self.persistent)
            self.persistent = None
        for request in self.requests():
            if request == MPI.REQUEST_NULL or isinstance(request, MPI.Prequest):
                continue
            try:
                request.Cancel()
                request.Free()
            except MPI.Exception:  # pragma: no cover - depends on the MPI
                pass
        self.pending, self.done = [], True

    def drop(self) -> None:
        """:meth:`abandon` this call, off the progress thread, without two
        threads in MPI on its requests at once: now if no thread holds it,
        else by the thread that holds it -- inside MPI on its requests (a
        wait of another call of its owner's) -- as it next advances it
        (cancelling and freeing requests another thread waits on would
        free them twice)."""
        if self.lock.acquire(False):
            try:
                self.abandon()
            finally:
                self.lock.release()
        else:
            self.quit = True

    def reads_status(self) -> bool:
        """Whether its caller reads the status of a request in flight (a
        receive from any source): a wait over several calls' requests
        would drop it, so it completes in its own test."""
        return any(p.statuses is not None for p in self.pending if isinstance(p, _Started))

    def waits_alone(self) -> bool:
        """Whether a caller's thread completes its requests in its own
        test, never in a wait over several calls' requests: where it
        :meth:`reads_status`, or where they run a user-defined ``MPI.Op``
        (see ``_Started``: on the progress thread, where no signal handler
        runs, they need not)."""
        return self.reads_status() or self.runs_user_op()

    def runs_user_op(self) -> bool:
        """Whether its requests run a user-defined ``MPI.Op`` (see ``_Started``)."""
        return any(isinstance(p, _Started) and p.sheltered for p in self.pending)

    def requests(self) -> list:
        """The MPI requests of the current stage (or round)."""
        if self.round is not None:
            return [] if self.done else list(self.live)
        return [r for p in self.pending for r in p.requests]


def _advanced(ops: list) -> list:
    """``ops`` advanced without blocking; those still in flight."""
    return [op for op in ops if not op.advance(False)]


def _run_all(callbacks) -> None:
    """Run each callback; an exception in one is reported on standard error,
    as a thread's would be, and the others still run.  An interrupt (not an
    ``Exception``: a ``KeyboardInterrupt`` from a signal handler, say) on a
    thread other than the progress thread is the thread's own: raised once
    the others have run (the first, where several land)."""
    interrupt = None
    for callback in callbacks or ():
        try:
            callback()
        except BaseException as exc:  # noqa: BLE001 - a callback's error is its own
            if isinstance(exc, Exception) or threading.get_ident() == _ENGINE.ident:
                sys.excepthook(type(exc), exc, exc.__traceback__)
            elif interrupt is None:
                interrupt = exc
    if interrupt is not None:
        raise interrupt


_startall = MPI.Prequest.Startall
#: numbers the starts of calls as they are made (``Operation.order``): on one
#: communicator the same sequence on every rank, which orders its calls'
#: callbacks (``_Engine._turn``)
ORDER = itertools.count(1)
#: orders the callbacks' list of a call between the thread adding one and the one running them
_CALLBACKS = threading.Lock()


class _Started:
    """Requests in flight that are not the library's messages (a stage's
    persistent requests, started; an MPI call the caller posted), with
    their statuses where asked for: what ``Pending`` is to posted ones.
    ``sheltered``: MPI runs the Python function of a user-defined
    ``MPI.Op`` as they complete (MPI's own collective), so they are waited
    and tested where no signal handler can raise inside it
    (:func:`~mpi_allreduce.threads.sheltered`)."""

    __slots__ = ("requests", "statuses", "sheltered")

    def __init__(self, requests, statuses=None, sheltered=False):
        self.requests, self.statuses, self.sheltered = requests, statuses, sheltered

    def wait(self) -> None:
        if self.sheltered:
            sheltered(MPI.Request.Waitall, self.requests, self.statuses)
        else:
            MPI.Request.Waitall(self.requests, self.statuses)

    def test(self) -> bool:
        if self.sheltered:
            return sheltered(MPI.Request.Testall, self.requests, self.statuses)
        return MPI.Request.Testall(self.requests, self.statuses)


def gathered(ops, first=None) -> tuple:
    """(the call of each request, the requests) of ``ops`` in flight, for
    :func:`wait_any`; ``first``, a request of the waiter's own, leads the
    requests (and has no call)."""
    owners, requests = [], [] if first is None else [first]
    for op in ops:
        for request in op.requests():
            if request:  # (one a Waitany completed before is null already)
                owners.append(op)
                requests.append(request)
    return owners, requests


def wait_any(owners: list, requests: list, locked: bool = True) -> Optional[int]:
    """``MPI_Waitany`` over the requests of several calls (as
    :func:`gathered` lists them; ``locked``: the waiter holds the calls'
    locks): the one wait in MPI over more than one call's requests.  Its
    index in ``requests``, or None where MPI reported an error.

    Such an error belongs to the call whose request it ended, not to the
    waiter (whose own call may be another): MPI frees that request, and its
    call, finding it complete, would go on with a message that never
    arrived.  That call is given up (its other requests cancelled, its
    arrays kept: :meth:`Operation.abandon`) and ends with the error
    (:meth:`Operation.end`); the waiter goes on.  A persistent request's
    error leaves the request as it is: then the calls with a persistent
    request in the wait end (an error on each call that may own it, never a
    result without it), or all of them where none has one."""
    try:
        return MPI.Request.Waitany(requests)
    except MPI.Exception as exc:
        offset = len(requests) - len(owners)
        if offset and not requests[0]:  # (the waiter's own request: it posts it again)
            return 0
        ended = {id(op): op for k, op in enumerate(owners) if not requests[offset + k]} or \
            {id(op): op for k, op in enumerate(owners)
             if isinstance(requests[offset + k], MPI.Prequest)} or \
            {id(op): op for op in owners}
        for op in ended.values():
            if not locked:
                op.lock.acquire()
            try:
                if not op.done:
                    try:
                        op.abandon()
                    except MPI.Exception:  # pragma: no cover - depends on the MPI
                        pass
                    # (each call its own exception: they may be raised on several threads)
                    op.end(MPI.Exception(exc.Get_error_code()))
            finally:
                if not locked:
                    op.lock.release()
        return None


#: requests (and the stages, so their arrays) of MPI calls given up on
#: (stalled): never freed, since MPI does not let a collective's request be
#: cancelled or freed while it is active, and a late message may still land
ABANDONED: list = []


def abandon(item, into: Optional[list] = ABANDONED) -> None:
    """Keep ``item`` (a given-up call's stages, so its arrays, or an MPI
    request, which holds its buffer) for good: in ``into``, and past the
    interpreter's own end -- mpi4py's ``MPI_Finalize`` runs after Python has
    freed its objects, and a send a late peer matches only then reads its
    buffer there (freed, that was a segmentation fault in the finalize)."""
    if into is not None:
        into.append(item)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))


class MPIOperation(Operation):
    """MPI's own requests in flight (``what``: how a report names the
    call), as one operation of the engine: advanced, waited (with the
    deadline of the watchdog's raise mode) and watched like the library's
    calls.  Stalled, its receives are cancelled when ``cancel``; its
    requests are kept in ``ABANDONED``, ``context`` (if any) is broken and
    ``on_stall(report)`` runs.  ``shelter``: they run a user-defined
    ``MPI.Op`` (see ``_Started``)."""

    __slots__ = ("cancel", "on_stall")

    def __init__(self, requests, what: str, comm, statuses=None, cancel=False,
                 on_stall=None, context=None, shelter=False):
        super().__init__([], None, 0, Slot(False), False, what, context)
        self.comm, self.cancel, self.on_stall = comm, cancel, on_stall
        self.pending, self.index, self.done, self.starts = \
            [_Started(requests, statuses, shelter)], -1, False, 1
        if shelter:  # (any MPI call of its caller's wait may apply the op)
            _ENGINE.sheltering = True
        if self.limit:
            self.deadline = time.monotonic() + self.limit
        if settings()[0] > 0:
            WATCH.watch(self)

    def stalled(self) -> Stalled:
        error = super().stalled()
        if self.on_stall is not None:
            self.on_stall(str(error))
        return error

    def abandon(self) -> None:
        for request in self.requests():
            if self.cancel:
                request.Cancel()
            abandon(request)
        self.pending, self.done = [], True

    def end(self, exc: BaseException) -> None:
        # (its requests, MPI's, kept: MPI may still be inside them, and they
        # hold the buffers; dropped, a late message would land in freed memory)
        for request in self.requests():
            if request:
                abandon(request)
        super().end(exc)


class _Engine:
    """The calls in flight in this process, and the progress thread."""

    def __init__(self):
        self._local = threading.local()  # each thread's calls advanced by test()/wait()
        self.threaded: list = []  # advanced by the thread (under ``cond``)
        self.cond = threading.Condition()
        self.thread: Optional[threading.Thread] = None
        self.in_mpi = False  # the thread waits in MPI (wake it with a message)
        self.stopping = False
        self.wake_comm = None
        self.posted = None  # the thread's receive of its wake-up (see _round)
        self.ident = 0  # the progress thread's, once it runs
        self.later: list = []  # what runs on the thread at its next turn (see soon)
        #: lists of callbacks to run on the thread, one at a time, in order
        #: (only its main loop runs them: see _wait_on_thread)
        self.due: collections.deque = collections.deque()
        #: whether a caller's calls may include one of MPI's own with a
        #: user-defined MPI.Op (see progress_caller)
        self.sheltering = False
        self.running = False  # the thread runs callbacks (see _run)
        self.served = 0  # turns taken inside waits on the thread (see _run)
        self._starting = threading.Lock()
        self._exit_registered = False

    # --- caller progress ----------------------------------------------------
    @property
    def caller(self) -> list:
        """This thread's calls advanced by test()/wait(), oldest first: the
        thread that starts a call owns it, and blocks in MPI only on its
        own calls' requests (a thread blocked on another's could wait for
        a peer that waits for that other thread)."""
        ops = getattr(self._local, "ops", None)
        if ops is None:
            ops = self._local.ops = []
        return ops

    @caller.setter
    def caller(self, ops: list) -> None:
        self._local.ops = ops

    def start_caller(self, op: Operation) -> None:
        op.owner = threading.get_ident()
        caller = self.caller
        if len(caller) >= _PRUNE:  # calls other threads waited for stay here until pruned
            # (once each: a call restarted while an older entry of it stays,
            # one the thread took over, is here twice)
            caller = self.caller = list({id(other): other for other in caller
                                         if not other.done and other is not op}.values())
        caller.append(op)

    def progress_caller(self) -> None:
        if self.sheltering and threading.current_thread() is threading.main_thread():
            # (among them a call of MPI's own with a user-defined MPI.Op: any
            # MPI call here may apply it, so all of them are sheltered)
            self.caller = sheltered(_advanced, self.caller)
            self.sheltering = any(op.runs_user_op() for op in self.caller)
            return
        self.caller = _advanced(self.caller)

    def _advance(self, op: Operation) -> None:
        """One step of progress for ``op`` without blocking: by its owner,
        with the owner's other calls; by another thread, that call alone
        (under its lock: never while its owner blocks on it)."""
        if op.owner == threading.get_ident():
            self.progress_caller()
        else:
            op.advance(False)

    def wait(self, op: Operation) -> None:
        """Until ``op`` is done: the one wait loop.  Without a deadline its
        owner blocks in MPI (``MPI_Waitall`` for a call alone in flight,
        ``MPI_Waitany`` over all of its calls otherwise); another thread,
        or any thread with a deadline (the watchdog's raise mode), polls --
        after SPIN_SECONDS, with naps between polls -- and past the deadline
        abandons the call and raises :class:`Stalled`.  On the progress
        thread (a completion callback's wait, or its blocking call) the
        thread goes on with its own work while it waits
        (:meth:`_wait_on_thread`)."""
        if self.ident and threading.get_ident() == self.ident:
            self._wait_on_thread(op)
            return
        limit = op.limit
        spins = 0
        began, nap, moves = time.monotonic() if limit else 0.0, 0.0, MOVES[0]
        while not op.finished():
            if op.threaded:
                if op.event.wait(0.01 if limit else 1.0):
                    return
            elif op.owner != threading.get_ident():
                if not op.advance(False):
                    time.sleep(20e-6)  # (its owner may be blocked on it: let it run)
            else:
                self.progress_caller()
                if op.done:
                    return
                if not limit:
                    self._block(op)
            if limit:
                spins += 1
                check = op.threaded or spins & 0xFF == 0
                if not op.threaded and (nap or spins & 0xF == 0):
                    now = time.monotonic()
                    if MOVES[0] != moves:  # (a call moved on: spin again)
                        began, nap, moves = now, 0.0, MOVES[0]
                    elif now - began > SPIN_SECONDS:
                        nap = min(NAP_SECONDS[1], (now - began) / 20,
                                  max(NAP_SECONDS[0], nap * 1.5))
                        time.sleep(nap)
                        check = True
                if check and time.monotonic() > op.deadline and not op.done:
                    raise self._stalled(op)

    def _wait_on_thread(self, op: Operation) -> None:
        """:meth:`wait` on the progress thread (a completion callback's wait
        or blocking call): the thread completes this rank's part of every
        call it holds, and its peers' waits may depend on any of them, so it
        never blocks in MPI here: it polls ``op`` and advances its other
        calls (:meth:`_serve`) until ``op`` is done -- as a wait on any
        other thread, it deadlocks only where the calls' order would in MPI
        -- against the deadline of the raise mode.  Callbacks still due
        wait for this one to return (callbacks run one at a time, in order:
        one run inside another's wait could start a call on a communicator
        whose call is in flight lower on the same stack)."""
        while not op.finished():
            if not op.threaded and op.owner != self.ident:  # (a call of another thread's)
                op.advance(False)
            self._serve()
            if op.finished():
                return
            if op.limit and time.monotonic() > op.deadline:
                raise self._stalled(op)
            time.sleep(20e-6)

    def serve_until(self, done) -> None:
        """On the progress thread, serve (:meth:`_serve`) until ``done()``:
        what any wait there must do, a framework's too (a lock a caller
        holds while it waits for a call this thread completes; ``done`` may
        take the lock: it is not asked again once it answered true).
        Elsewhere nothing: the caller waits its own way."""
        if self.ident != threading.get_ident():
            return
        while not done():  # (done() is asked again only after a false answer)
            self._serve()
            time.sleep(20e-6)

    def _serve(self) -> None:
        """One turn of the thread's work that needs no waiting, from inside a
        wait on the thread: its calls advanced, those callbacks started on it
        too; the callbacks due wait for the one running to return (see
        :meth:`_wait_on_thread`)."""
        self.progress_caller()
        with self.cond:
            self._turn()
            self.served += 1

    def _block(self, op: Operation) -> None:
        """Block in MPI until one of this thread's calls can move on."""
        caller = self.caller
        if len(caller) == 1 and caller[0] is op:
            op.advance(True)
            self.caller = []
            return
        held = [other for other in caller if other.lock.acquire(False)]
        for other in [other for other in held if other.adopted]:  # (the thread's now)
            other.lock.release()
            held.remove(other)
        try:
            owners, requests = gathered(held)
            if requests and not any(other.waits_alone() for other in held):
                wait_any(owners, requests)
            else:
                # another thread is advancing them right now; or a receive
                # whose status its caller reads (a receive from any source)
                # is among them: a Waitany that completed it would drop its
                # status, so it completes in its own Testall, polled
                time.sleep(20e-6)
        finally:
            for other in held:
                other.lock.release()

    def _drop(self, op: Operation) -> None:
        if op.owner == threading.get_ident():
            self.caller = [o for o in self.caller if o is not op]

    def _stalled(self, op: Operation) -> Stalled:
        """Give up on ``op``, past its deadline (raise mode), for every path
        that waits for it: out of this thread's calls, and a call of the
        progress thread's given up there at its next turn (:meth:`give_up`;
        left in its list, the thread would wait in MPI on its requests for
        good, and Open MPI's wait spins a core); the error to raise."""
        self._drop(op)
        error = op.stalled()  # (first: it breaks the communicator, which the thread reads)
        if op.threaded:
            self.give_up(op)
        return error

    def overdue(self, op: Operation) -> None:
        """``test()``'s deadline check (raise mode): raise once it passed."""
        if op.limit and not op.done and time.monotonic() > op.deadline:
            raise self._stalled(op)

    # --- the thread -------------------------------------------------------------
    def adopt(self, op: Operation) -> None:
        """Hand ``op``, a call its caller advances, to the progress thread
        until its current start completes (then it is the caller's again):
        what makes a completion callback (``Operation.when_done``) run
        whether or not anyone waits.  Under the call's lock, so no thread
        is inside MPI on its requests as they change hands (``advance`` and
        ``_block`` hold it there, and leave an adopted call alone)."""
        on_thread = threading.get_ident() == self.ident
        # (on the thread itself, a call whose owner blocks in MPI on it now is
        # taken over at the thread's next turn: waiting for it would stop
        # every call the thread advances)
        if not op.lock.acquire(not on_thread):
            self._hand("later", functools.partial(self.adopt, op))
            return
        try:
            if op.threaded:
                return
            # (complete already, by its owner, or meanwhile: taken all the same,
            # so its callbacks keep their turn among its communicator's: _turn)
            if op.round is not None and not op.done:  # the one-round fast path: op.live
                op.pending, op.index = [_Started(op.live)], op.round[4]
            op.event = threading.Event()
            op.adopted = op.threaded = True
        finally:
            op.lock.release()
        self._drop(op)  # (from its owner's calls, where the owner adopts it)
        self.start_threaded(op)

    def soon(self, callback) -> None:
        """Run ``callback()`` on the progress thread at its next turn: a
        completion callback added to a call already complete that must
        still run on the thread that completes calls (torch's profiler
        calls an event asynchronous only when another thread ends it).
        Where MPI runs no threads there is no such thread: it runs now."""
        if not mpi_threads():
            callback()
            return
        self._hand("later", callback)

    def start_threaded(self, op: Operation) -> None:
        self._hand("threaded", op)

    def give_up(self, op: Operation) -> None:
        """A call of the thread's whose waiter was left by an exception (an
        interrupt): the thread abandons it at its next turn (receives
        cancelled, requests freed, arrays kept: ``Operation.abandon``) and
        posts nothing more for it, so a late peer's call stalls instead of
        completing with what the caller writes into the arrays next.  (A
        send already posted may still be read: as in MPI, the arrays of a
        call in flight are not the caller's to write.)"""
        with self.cond:
            op.quit = True
            self.cond.notify()
            if self.in_mpi:
                self._wake()

    def callbacks_pending(self, context, order: int) -> bool:
        """Whether callbacks of a call on ``context`` started before
        ``order`` may still be to run on the thread (a call it holds with
        callbacks), or callbacks are due or running there: asked off the
        thread, where MPI runs threads."""
        if context is None or not self.ident or threading.get_ident() == self.ident \
                or not mpi_threads():
            return False
        with self.cond:
            return self.running or bool(self.due) or bool(self.later) or any(
                op.context is context and op.callbacks and op.order < order
                for op in self.threaded)

    def _hand(self, name: str, item) -> None:
        """``item`` onto the thread's list ``name`` (the thread started
        first), the thread woken to take it.  (The list is looked up under
        the lock: the thread replaces it there.)"""
        thread = self.thread
        if thread is None or not thread.is_alive():
            with self._starting:  # (two threads' first hand-overs start one thread)
                if self.stopping:
                    raise RuntimeError("the library's progress thread has stopped (the "
                                       "interpreter is exiting): no call can be handed to it")
                thread = self.thread
                if thread is None or not thread.is_alive():
                    self._start_thread()
        with self.cond:
            getattr(self, name).append(item)
            self.cond.notify()
            if self.in_mpi:
                self._wake()

    def _wake(self) -> None:
        """Wake the thread from its wait in MPI: an empty message to itself,
        sent without waiting (the caller holds ``cond``, which the thread
        needs before it can post the receive again; a blocking send to
        oneself waits for that receive under MPICH, and the two would wait
        for each other).  The request is freed: the send completes when the
        thread's receive matches it."""
        self.wake_comm.Isend([bytearray(0), MPI.BYTE], 0, _WAKE_TAG).Free()

    def _start_thread(self) -> None:
        """Start the thread (under ``_starting``): ``self.thread`` once it
        runs (:func:`~mpi_allreduce.threads.start_daemon`: it records itself,
        where no interrupt lands, so none is recorded that never runs; one
        an interrupt stopped before its launch is started by the next
        hand-over)."""
        if self.wake_comm is None:
            self.wake_comm = MPI.COMM_SELF.Dup()
        if not self._exit_registered:
            atexit.register(self.stop)
            self._exit_registered = True
        start_daemon(self._run, "mpi_allreduce-progress",
                     functools.partial(setattr, self, "thread"),
                     functools.partial(getattr, self, "thread"))

    def _turn(self) -> list:
        """Under ``cond``: advance the thread's calls without blocking, let
        go of the complete ones and queue their callbacks (and what
        :meth:`soon` handed over) in ``due``; the calls still in flight."""
        due = self.due
        still, complete = [], []
        #: per communicator, the first start among its calls in flight with
        #: callbacks: a later call's callbacks wait behind it (those of calls
        #: on one communicator run in the calls' start order, which is the
        #: same on every rank, whatever order they complete in on this rank,
        #: so that blocking calls the callbacks make meet their peers' in that
        #: order on every rank)
        first: dict = {}
        for op in self.threaded:
            if op.quit:  # (its waiter was left by an exception: see give_up)
                with op.lock:
                    op.quit = False
                    if not op.done:
                        op.abandon()
                        if op.error is None and op.context is not None \
                                and op.context.broken is not None:
                            # (what its callbacks see: its waiter broke the communicator)
                            op.error = op.context.refusal()
                complete.append(op)
                continue
            if op.advance(False, True) or self._overdue(op):
                complete.append(op)
            else:
                still.append(op)
                context = op.context
                if op.callbacks and context is not None \
                        and op.order < first.get(context, op.order + 1):
                    first[context] = op.order
        if len(complete) > 1:
            complete.sort(key=lambda op: op.order)
        for op in complete:
            if op.callbacks and op.context is not None \
                    and first.get(op.context, op.order) < op.order:
                still.append(op)  # (complete; its event is set once it is let go)
                continue
            callbacks = self._let_go(op)
            if callbacks:
                due.append(callbacks)
        self.threaded = still
        if self.later:
            due.append(self.later)
            self.later = []
        return still

    @staticmethod
    def _let_go(op: Operation) -> Optional[list]:
        """Let go of a call of the thread's that is complete: its callbacks,
        to run, taken before -- a start made after it has callbacks of its
        own, and an event (this start's is set)."""
        callbacks = op.taken()
        event = op.event
        if op.adopted:  # (its next start is its caller's again)
            op.adopted = op.threaded = False
        event.set()
        return callbacks

    def _run_due(self) -> None:
        """Outside the lock (a callback may start a call): the callbacks due,
        oldest first, one list at a time (the thread's main loop alone runs
        them)."""
        due = self.due
        while due:
            _run_all(due.popleft())

    def _run(self) -> None:
        self.ident = threading.get_ident()
        wake_buf = bytearray(1)
        self.posted = self.wake_comm.Irecv([wake_buf, MPI.BYTE], 0, _WAKE_TAG)
        try:
            while not self.stopping:
                try:
                    self._round(wake_buf)
                except BaseException as exc:  # noqa: BLE001 - the thread lives on
                    self._fail_held(exc)
        finally:
            wake = self.posted
            wake.Cancel()
            wake.Wait()

    def _round(self, wake_buf) -> None:
        """One turn of the thread's loop: wait for work, advance its calls,
        run the callbacks due, then wait in MPI for any of their requests
        (or ``self.posted``, the wake-up's receive, posted again once it fires)."""
        with self.cond:
            while not self.threaded and not self.later and not self.due \
                    and not self.stopping:
                self.cond.wait()
            if self.stopping:
                return
            still = self._turn()
            # a call with callbacks and a deadline (raise mode) is
            # polled: nobody may be waiting to notice its stall; so
            # is one whose caller reads a receive's status (a
            # receive from any source): MPI_Waitany would drop it
            poll = any(op.limit and op.callbacks or op.reads_status() for op in still)
            owners, requests = gathered(still, self.posted)
            # (``still`` is the list calls started from now on join:
            # what is in flight is decided here, under the lock)
            idle = not still
            self.in_mpi = not idle and not poll
            served = self.served
            self.running = bool(self.due)
        self._run_due()
        self.running = False
        if idle:
            return
        if poll or self.served != served:
            # (a wait inside a callback took turns: ``requests`` may
            # be stale, and a call's next stage not among them)
            with self.cond:
                self.in_mpi = False
            if poll:
                time.sleep(200e-6)
            return
        index = wait_any(owners, requests, locked=False)
        with self.cond:
            self.in_mpi = False
        if index == 0:
            self.posted = self.wake_comm.Irecv([wake_buf, MPI.BYTE], 0, _WAKE_TAG)

    def _fail_held(self, exc: BaseException) -> None:
        """An error no call owns escaped the thread's loop (a fault of the
        library's own): it is printed, and every call the thread holds ends
        with it -- given up, its arrays kept, its communicator broken --
        rather than waiting for a thread that stopped advancing it."""
        self.running = False
        sys.excepthook(type(exc), exc, exc.__traceback__)
        with self.cond:
            self.in_mpi = False
            held, self.threaded = self.threaded, []
        for op in held:
            with op.lock:
                if not op.done:
                    try:
                        op.abandon()
                    except BaseException:  # noqa: BLE001 - (ending it matters more)
                        pass
                    op.end(exc)
            callbacks = self._let_go(op)
            if callbacks:
                _run_all(callbacks)

    @staticmethod
    def _forsaken(op: Operation, now: float) -> bool:
        """Whether the thread gives ``op`` up on its own (raise mode): a call
        with callbacks once past its deadline, any other once late by its
        limit again (whoever waits for it raises at the deadline itself;
        nobody did: a request dropped in flight)."""
        return bool(op.limit) and now - op.deadline > (0.0 if op.callbacks else op.limit)

    def _overdue(self, op: Operation) -> bool:
        """A call past its deadline that nobody may notice (:meth:`_forsaken`),
        given up on here.  Its error is the stall, which its callbacks and
        wait() see."""
        if not self._forsaken(op, time.monotonic()):
            return False
        try:
            error = op.stalled()
        except BaseException as exc:  # noqa: BLE001 - (an owner's on_stall): the thread lives on
            sys.excepthook(*sys.exc_info())
            error = exc
        op.abandon()
        op.error = error
        return True

    def sweep(self) -> None:
        """From the watchdog's monitor, in raise mode: wake the thread where
        it would give up a call it holds (:meth:`_forsaken`; the thread may
        wait in MPI on that call's requests alone)."""
        now = time.monotonic()
        with self.cond:
            if any(self._forsaken(op, now) for op in self.threaded):
                self.cond.notify()
                if self.in_mpi:
                    self._wake()

    def stop(self) -> None:
        """End the thread (at exit, before MPI is finalised)."""
        with self._starting:  # (no hand-over starts a thread meanwhile)
            self.stopping = True
            thread = self.thread
        if thread is None or MPI.Is_finalized():
            return
        with self.cond:
            self.cond.notify()
            if self.in_mpi:
                self._wake()
        thread.join(timeout=10)


_ENGINE = _Engine()


def mpi_threads() -> bool:
    """Whether the MPI library runs threads (``MPI_THREAD_MULTIPLE``): what
    the progress thread, the thread of :func:`wait_for_call` and the
    torch backend's overlapping calls need."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def thread_progress() -> bool:
    """Whether calls of at least :data:`THREAD_MIN_BYTES` are advanced by the
    progress thread (``MPI_ALLREDUCE_PROGRESS``; default: where the MPI
    library runs with ``MPI_THREAD_MULTIPLE``)."""
    setting = environment().progress or "thread"
    return setting == "thread" and mpi_threads()


ENGINE = _ENGINE
WATCH.sweep = _ENGINE.sweep


def wait_for(requests, what: str, context=None) -> None:
    """Wait for MPI requests the library posted itself (``what``: how a
    report names them), as an operation of the engine: watched by the
    watchdog under every action, against the deadline in ``raise`` mode
    (then :class:`~mpi_allreduce.errors.Stalled`, and ``context``, if
    given, is broken).  An interrupt while waiting breaks ``context`` too."""
    op = MPIOperation(requests, what, None, context=context)
    _ENGINE.start_caller(op)
    try:
        _ENGINE.wait(op)
    except Stalled:
        raise
    except BaseException as exc:
        if context is not None:
            context.breaks(exc, what)
        raise
    if op.error is not None:
        error, op.error = op.error, None
        if context is not None:
            context.breaks(error, what)
        raise error


def duplicate(comm, what: str, context=None, info=None):
    """A duplicate of ``comm`` (``MPI_Comm_idup``, with ``info``), waited
    for as :func:`wait_for` waits (``what`` names it in a report)."""
    dup, request = MPI.Intracomm.Idup(comm, info)
    wait_for([request], what, context)
    # (mpi4py makes the duplicate of a subclass's communicator -- the drop-in
    # Comm -- of that subclass, whose methods run the library: the library's
    # own communicator is a plain one, the same handle)
    return dup if type(dup) is MPI.Intracomm else MPI.Intracomm(dup)


#: the keys of calls given up on whose threads are still inside MPI (see
#: :func:`wait_for_call`), with why (and the call's own outcome: only its
#: thread's return removes its entry); and the lock that orders a thread's
#: return against its caller's giving up
_STUCK: dict = {}
_STUCK_LOCK = threading.Lock()


def _leave_if_stuck() -> None:
    """At the end of the process: a collective with no non-blocking form
    that was given up on (a peer never came) leaves its thread inside MPI
    (:func:`wait_for_call`), and ``MPI_Finalize`` under it is undefined (a
    segmentation fault was seen, in the thread's ``MPI_Comm_split_type``).
    The process then leaves without it, saying why, with status 1 (the job
    had a stall).  (Registered at import, after mpi4py's: it runs first.)"""
    with _STUCK_LOCK:
        stuck = list(_STUCK.values())
    if not stuck or MPI.Is_finalized():
        return
    sys.stdout.flush()
    sys.stderr.write(f"mpi_allreduce: rank {MPI.COMM_WORLD.Get_rank()}: leaving without "
                     f"MPI_Finalize: {stuck[0][0]}\n")
    sys.stderr.flush()
    os._exit(1)


atexit.register(_leave_if_stuck)


def blocking_collective(comm, call, what: str, context=None):
    """The result of ``call()``, a blocking collective over every rank of
    ``comm`` with no non-blocking form (``MPI_Comm_split``,
    ``MPI_Comm_split_type``, ``MPI_Comm_create``), watched: where MPI runs
    threads, :func:`wait_for_call` -- the call runs on a thread of its own,
    so an interrupt of its caller cannot keep this rank out of it once it
    has begun (the peers would wait inside MPI, where no watchdog reaches
    them), and a peer that never comes is reported, and raises
    :class:`~mpi_allreduce.errors.Stalled` in raise mode, like any call's.
    Without threads the ranks first meet in a watched ``MPI_Ibarrier``, and
    the call is this thread's blocking call (reported under ``warn`` and
    ``abort``)."""
    if not mpi_threads():
        wait_for([MPI.Intracomm.Ibarrier(comm)], f"{what} (its barrier)", context)
    return wait_for_call(call, what, key=comm.handle, context=context)


def wait_for_call(call, what: str, key=None, context=None):
    """The result of ``call()``, an MPI call with no non-blocking form (such
    as ``MPI_Comm_create_group``, collective over a group's members only,
    so no watched barrier can come first), waited for as :func:`wait_for`
    waits: ``call`` runs on a thread of its own that completes an MPI
    generalized request when it returns, and the caller waits for that
    request under the watchdog.  A stall raises
    :class:`~mpi_allreduce.errors.Stalled` in the caller (raise mode); the
    thread is left inside MPI until the late ranks come, and until then
    every later call with the same ``key`` (the parent communicator's
    handle: MPI forbids two such calls at once on one communicator)
    raises :class:`~mpi_allreduce.errors.Broken` at once.

    Where MPI does not run threads (below ``MPI_THREAD_MULTIPLE``) ``call``
    runs on the caller's thread, as the thread's blocking call: the
    watchdog reports it under its ``warn`` and ``abort`` actions; nothing
    can give up on it, so under ``raise`` it is MPI's own wait."""
    if key is not None and key in _STUCK:
        raise Broken(_STUCK[key][0])
    if not mpi_threads():
        cell = WATCH.cell()
        cell.count += 1
        cell.what = (what, None)
        try:
            return call()
        finally:
            cell.what = None
    outcome: dict = {}
    request = MPI.Grequest.Start()

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
        finally:
            with _STUCK_LOCK:
                outcome["returned"] = True
                if _STUCK.get(key, (None, None))[1] is outcome:  # (this call's entry only)
                    del _STUCK[key]
            request.Complete()

    thread = threading.Thread(target=run, name=f"mpi_allreduce: {what}", daemon=True)
    try:
        thread.start()  # (inside: an interrupt after its launch leaves it in MPI)
        wait_for([request], what, context)
    except BaseException as exc:
        with _STUCK_LOCK:
            if key is not None and thread.ident is not None and "returned" not in outcome:
                _STUCK[key] = (f"an earlier collective on this communicator ({what}) was "
                               f"given up on ({type(exc).__name__}) and is still inside MPI on "
                               "this rank; MPI allows one such call at a time", outcome)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
