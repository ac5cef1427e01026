"""Non-blocking and persistent calls: requests, and what moves them on.

A call in flight is an :class:`Operation`: the stages of a bound plan
(:class:`~mpi_allreduce.executor.Stage`: local steps, messages, local
steps that overlap them), run one after another.  Starting it posts the
first stage's messages; *advancing* it tests (or waits for) the messages of
the current stage and, once they are done, runs the next stage; the last
stage done, the call is complete.  These are Open MPI libnbc's rounds
(``NBC_Start_round`` and ``NBC_Progress``).

Who advances an operation:

* **the progress thread**, one per process, where the MPI library was
  initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default)
  and the call moves at least :data:`THREAD_MIN_BYTES`.  While operations
  are in flight it waits in ``MPI_Waitany`` over their current messages
  (and a wake-up receive from itself), so a stage follows the last within
  microseconds while the caller computes; with nothing in flight it sleeps
  on a condition variable and costs nothing.  ``wait()`` then waits for
  the thread to say the call is done; ``test()`` only reads that.
* **the caller**, otherwise (``MPI_ALLREDUCE_PROGRESS=caller``, a lower
  thread level, or a short vector): ``test()`` advances every such call the
  calling thread has in flight without blocking, and ``wait()`` advances them until its own is
  done -- a call alone in flight waits in ``MPI_Waitall`` stage by stage,
  several in ``MPI_Waitany`` over all of them, so calls may be waited in
  any order.  Short vectors stay with the caller because their messages
  are sent eagerly as soon as they are posted: a hand-over to a thread
  would cost more than the call.

Ranks must start collective calls on one communicator in the same order
(as MPI requires); they may complete and be waited in any order, from any
thread.

This module is the one engine every kind of call goes through: blocking
calls (:func:`blocking`), non-blocking and persistent ones, the one-round
persistent short cut, reduce-scatter and allgather, and MPI's own requests
where the torch backend hands a call to MPI (:func:`mpi_request`).  Each is watched by the
watchdog from start to completion, and in the watchdog's ``raise`` mode
each waits against one deadline loop (``_Engine.wait``).
"""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
import time
from typing import Optional

from mpi4py import MPI

from .config import environment
from .context import _CLOSING, reap
from .errors import RequestError, Stalled, failed
from .executor import Bound, Stage
from .watchdog import WATCH, describe, report, settings

__all__ = ["Operation", "MPIOperation", "Request", "PersistentRequest", "RequestError",
           "waitall", "thread_progress", "blocking", "mpi_request", "THREAD_MIN_BYTES"]

#: calls moving fewer bytes per rank than this are advanced by the caller
THREAD_MIN_BYTES = 64 * 1024
#: tag of the progress thread's wake-up message to itself
_WAKE_TAG = 0x77616B
#: a thread's list of calls it advances is pruned of completed ones from this length on
_PRUNE = 64


class Operation:
    """One call in flight: a bound plan's stages, run in order."""

    __slots__ = ("stages", "plan", "comm", "mpitype", "post", "tag", "slot", "index", "pending",
                 "done", "error", "event", "threaded", "persistent", "kind", "starts",
                 "limit", "deadline", "reserved", "context", "lock", "owner", "__weakref__")

    def __init__(self, stages: list, plan, tag: int, slot: str, threaded: bool,
                 kind: str = "non-blocking call", context=None, reserved: bool = False):
        self.stages, self.tag, self.plan = stages, tag, plan
        if plan is not None:
            self.comm, self.mpitype, self.post = plan.comm, plan.mpitype, plan.backend.post
        self.slot = slot  # names this call's staging buffers (device backends)
        self.threaded = threaded
        #: per stage, MPI persistent requests made once (host buffers), or None
        self.persistent = None
        self.index = len(self.stages)
        self.pending: list = []
        self.done = True
        self.error: Optional[BaseException] = None
        self.event = threading.Event() if threaded else None
        self.kind, self.context, self.starts = kind, context, 0
        #: a persistent request's tag is held until it is freed
        self.reserved = reserved
        #: two threads never advance one operation at once
        self.lock = threading.Lock()
        self.owner = 0  # the thread that advances it (caller progress)
        seconds, action = settings()
        #: the watchdog's raise mode: seconds a start may wait (else 0)
        self.limit = seconds if action == "raise" else 0.0
        self.deadline = 0.0
        if plan is not None and seconds > 0:
            WATCH.watch(self)

    def snapshot(self) -> tuple:
        """What the watchdog samples: (starts, (kind, plan) while in flight, thread)."""
        return self.starts, None if self.done else (self.kind, self.plan), "any"

    def holds_tag(self) -> bool:
        """Whether this call's tag may not be given to another call yet."""
        return self.reserved or not self.done

    def begin(self) -> None:
        """Run the stages up to the first with messages in flight."""
        self.index, self.done, self.error = -1, False, None
        self.starts += 1
        if self.limit:
            self.deadline = time.monotonic() + self.limit
        if self.event is not None:
            self.event.clear()
        self._next()

    def _next(self) -> None:
        stages, persistent = self.stages, self.persistent
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
                    post, comm, mpitype, slot = self.post, self.comm, self.mpitype, self.slot
                    self.pending = [post(comm, send, dest, recv, source, mpitype, self.tag,
                                         f"{slot}.{k}")
                                    for k, (send, dest, recv, source) in enumerate(pairs)]
            for function, args in overlap:
                function(*args)
            if pairs:
                return

    def advance(self, block: bool) -> bool:
        """Move on as far as the messages allow (``block``: until done);
        whether the call is complete.  An error ends the call: it is kept
        for ``wait()`` to raise.  (Another thread advancing it now: no.)"""
        if not self.lock.acquire(block):
            return self.done
        try:
            while not self.done:
                if block:
                    for p in self.pending:
                        p.wait()
                    self.pending = []
                else:
                    self.pending = [p for p in self.pending if not p.test()]
                    if self.pending:
                        return False
                self._next()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait()
            self.error, self.done, self.pending = exc, True, []
        finally:
            self.lock.release()
        return True

    def stalled(self) -> Stalled:
        """Give up on this call (its deadline passed): the error to raise."""
        if not self.threaded:  # (the thread's own wait holds its requests)
            self.abandon()
        text = report(describe(self.kind, self.plan), self.limit, self.starts,
                      threading.current_thread().name)
        if self.context is not None:
            self.context.broken = ("an earlier call on this communicator stalled, its "
                                   "messages are in disarray: " + text)
        return Stalled(text)

    def abandon(self) -> None:
        """Give up on the messages in flight (a stalled call): receives are
        cancelled, every request is freed, so none is left for MPI_Finalize."""
        for request in self.requests():
            if request == MPI.REQUEST_NULL:
                continue
            try:
                request.Cancel()
                request.Free()
            except MPI.Exception:  # pragma: no cover - depends on the MPI
                pass
        self.pending, self.done = [], True

    def requests(self) -> list:
        """The MPI requests of the current stage."""
        return [r for p in self.pending for r in p.requests]


class _Started:
    """Requests in flight that are not the library's messages (a stage's
    persistent requests, started; an MPI call the caller posted), with
    their statuses where asked for: what ``Pending`` is to posted ones."""

    __slots__ = ("requests", "statuses")

    def __init__(self, requests, statuses=None):
        self.requests, self.statuses = requests, statuses

    def wait(self) -> None:
        MPI.Request.Waitall(self.requests, self.statuses)

    def test(self) -> bool:
        return MPI.Request.Testall(self.requests, self.statuses)


#: requests of MPI calls given up on (stalled): never freed, since MPI does
#: not let a collective's request be cancelled or freed while it is active
ABANDONED: list = []


class MPIOperation(Operation):
    """MPI's own requests in flight (``what``: how a report names the
    call), as one operation of the engine: advanced, waited (with the
    deadline of the watchdog's raise mode) and watched like the library's
    calls.  Stalled, its receives are cancelled when ``cancel``; its
    requests are kept in ``ABANDONED``, and ``on_stall(report)`` runs."""

    __slots__ = ("cancel", "on_stall")

    def __init__(self, requests, what: str, comm, statuses=None, cancel=False,
                 on_stall=None):
        super().__init__([], None, 0, "", False, what)
        self.comm, self.cancel, self.on_stall = comm, cancel, on_stall
        self.pending, self.index, self.done, self.starts = [_Started(requests, statuses)], -1, \
            False, 1
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
            ABANDONED.append(request)
        self.pending, self.done = [], True


def mpi_request(requests, what: str, comm, statuses=None, cancel=False,
                on_stall=None) -> "Request":
    """A :class:`Request` over MPI requests the caller posted on ``comm``
    (see :class:`MPIOperation`): its ``wait()`` and ``test()`` are the
    engine's, as for the library's own calls."""
    request = Request(MPIOperation(requests, what, comm, statuses, cancel, on_stall), None)
    request._state = "active"
    _ENGINE.start_caller(request._op)
    return request


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
        self._slots = itertools.count(1)  # next() is atomic: threads get distinct slots

    def slot(self) -> str:
        return f"nb{next(self._slots)}"

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
            caller = self.caller = [other for other in caller if not other.done]
        caller.append(op)

    def progress_caller(self) -> None:
        self.caller = [op for op in self.caller if not op.advance(False)]

    def _advance(self, op: Operation) -> None:
        """One step of progress for ``op`` without blocking: by its owner,
        with the owner's other calls; by another thread, that call alone
        (under its lock: never while its owner blocks on it)."""
        if op.owner == threading.get_ident():
            self.progress_caller()
        else:
            op.advance(False)

    def wait(self, op: Operation) -> None:
        """Until ``op`` is done, from any thread: the one wait loop.
        Without a deadline its owner blocks in MPI (``MPI_Waitall`` for a
        call alone in flight, ``MPI_Waitany`` over all of its calls
        otherwise); another thread, or any thread with a deadline (the
        watchdog's raise mode), polls -- and past the deadline abandons the
        call and raises :class:`Stalled`."""
        limit = op.limit
        spins = 0
        while not op.done:
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
                if (op.threaded or spins & 0xFF == 0) and time.monotonic() > op.deadline \
                        and not op.done:
                    self._drop(op)
                    raise op.stalled()

    def _block(self, op: Operation) -> None:
        """Block in MPI until one of this thread's calls can move on."""
        caller = self.caller
        if len(caller) == 1 and caller[0] is op:
            op.advance(True)
            self.caller = []
            return
        held = [other for other in caller if other.lock.acquire(False)]
        try:
            requests = [r for other in held for r in other.requests()]
            if requests:
                MPI.Request.Waitany(requests)
            else:  # another thread is advancing them right now
                time.sleep(20e-6)
        finally:
            for other in held:
                other.lock.release()

    def _drop(self, op: Operation) -> None:
        if op.owner == threading.get_ident():
            self.caller = [o for o in self.caller if o is not op]

    def overdue(self, op: Operation) -> None:
        """``test()``'s deadline check (raise mode): raise once it passed."""
        if op.limit and not op.done and time.monotonic() > op.deadline:
            self._drop(op)
            raise op.stalled()

    # --- the thread -------------------------------------------------------------
    def start_threaded(self, op: Operation) -> None:
        if self.thread is None:
            self._start_thread()
        with self.cond:
            self.threaded.append(op)
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
        self.wake_comm = MPI.COMM_SELF.Dup()
        self.thread = threading.Thread(target=self._run, name="mpi_allreduce-progress",
                                       daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def _run(self) -> None:
        wake_buf = bytearray(1)
        wake = self.wake_comm.Irecv([wake_buf, MPI.BYTE], 0, _WAKE_TAG)
        try:
            while True:
                with self.cond:
                    while not self.threaded and not self.stopping:
                        self.cond.wait()
                    if self.stopping:
                        return
                    still = []
                    for op in self.threaded:
                        if op.advance(False):
                            op.event.set()
                        else:
                            still.append(op)
                    self.threaded = still
                    if not still:
                        continue
                    requests = [wake] + [r for op in still for r in op.requests()]
                    self.in_mpi = True
                index = MPI.Request.Waitany(requests)
                with self.cond:
                    self.in_mpi = False
                if index == 0:
                    wake = self.wake_comm.Irecv([wake_buf, MPI.BYTE], 0, _WAKE_TAG)
        finally:
            wake.Cancel()
            wake.Wait()

    def stop(self) -> None:
        """End the thread (at exit, before MPI is finalised)."""
        if self.thread is None or MPI.Is_finalized():
            return
        with self.cond:
            self.stopping = True
            self.cond.notify()
            if self.in_mpi:
                self._wake()
        self.thread.join(timeout=10)
        self.thread = None


_ENGINE = _Engine()


def thread_progress() -> bool:
    """Whether calls of at least :data:`THREAD_MIN_BYTES` are advanced by the
    progress thread (``MPI_ALLREDUCE_PROGRESS``; default: where the MPI
    library runs with ``MPI_THREAD_MULTIPLE``)."""
    setting = environment().progress or "thread"
    return setting == "thread" and MPI.Query_thread() == MPI.THREAD_MULTIPLE


class Request:
    """A non-blocking call: ``test()``, ``wait()``; persistent ones also
    ``start()`` and ``free()`` (MPI-4's persistent collectives)."""

    __slots__ = ("_op", "_result", "_state", "_keep", "__weakref__")

    # states: "active" (started, not yet waited), "complete" (waited; a
    # persistent request may start again), "freed"
    def __init__(self, op: Optional[Operation], result, keep=()):
        self._op, self._result, self._keep = op, result, keep
        self._state = "complete"

    def _begin(self) -> None:
        op = self._op
        if op is None:  # nothing to send: complete at once
            self._state = "active"
            return
        context = op.context
        if context is not None:
            if context.what is not None:
                raise context.concurrent()
            context.what = _STARTING
        try:
            if context is not None and context.broken is not None:
                raise Stalled(context.broken)
            op.begin()
            self._state = "active"
        finally:
            if context is not None:
                context.what = None
        if op.done:
            return
        if op.threaded:
            _ENGINE.start_threaded(op)
        else:
            _ENGINE.start_caller(op)

    def test(self) -> bool:
        """Whether the call is complete (a true answer completes the
        request, as ``wait()`` would)."""
        self._check_active("test")
        op = self._op
        if op is not None and not op.done:
            if op.threaded:
                if not op.event.is_set():
                    _ENGINE.overdue(op)
                    return False
            else:
                _ENGINE._advance(op)
                if not op.done:
                    _ENGINE.overdue(op)
                    return False
        self._complete()
        return True

    def wait(self):
        """Wait until the call is complete; return the result buffer."""
        self._check_active("wait")
        op = self._op
        if op is not None and not op.done:
            try:
                _ENGINE.wait(op)
            except Stalled:
                self._state = "complete"  # abandoned: not waitable again
                raise
        self._complete()
        return self._result

    # mpi4py's spellings, so code written for MPI.Request runs unchanged
    def Wait(self, status=None) -> bool:  # noqa: N802
        self.wait()
        return True

    def Test(self, status=None) -> bool:  # noqa: N802
        return self.test()

    def _complete(self) -> None:
        op = self._op
        self._state = "complete"
        if _CLOSING:
            reap()
        if op is not None and op.error is not None:
            error, op.error = op.error, None
            failed(getattr(op, "comm", MPI.COMM_WORLD), error, "a non-blocking call")
        if self.__class__ is Request:  # done for good: its scratch serves the next call
            for bound in self._keep:  # (not after an error: messages may still land)
                if bound.scratch is not None:
                    bound.plan.give_back(bound.scratch)
                    bound.scratch = None

    def _check_active(self, what: str) -> None:
        if self._state == "active":
            return
        if self._state == "freed":
            raise RequestError(f"{what}() on a freed request")
        if isinstance(self, PersistentRequest):
            raise RequestError(f"{what}() on a persistent request that is not started "
                               "(call start() first)")
        raise RequestError(f"{what}() on a request that is already complete "
                           "(each non-blocking call is waited once)")


class PersistentRequest(Request):
    """A call set up once and started many times: ``start()``, then
    ``wait()`` (or ``test()``), again and again; ``free()`` at the end (or
    ``with allreduce_init(...) as request:``).  A request that is garbage
    collected is freed too (its MPI requests and its tag)."""

    __slots__ = ()

    def start(self) -> None:
        """Start the call (the buffers' current contents are reduced)."""
        if self._state == "active":
            raise RequestError("start() on a persistent request that is still active "
                               "(wait() for it first)")
        if self._state == "freed":
            raise RequestError("start() on a freed request")
        self._begin()

    def Start(self) -> None:  # noqa: N802
        self.start()

    def Free(self) -> None:  # noqa: N802
        self.free()

    def free(self) -> None:
        """Release the request (not while it is active): its MPI requests
        and its tag."""
        if self._state == "active":
            raise RequestError("free() on an active request (wait() for it first)")
        self._release()

    def _release(self) -> None:
        op = self._op
        if op is not None:
            op.reserved = False
            if op.persistent is not None and not MPI.Is_finalized():
                for requests in op.persistent:
                    for r in requests or ():
                        if r != MPI.REQUEST_NULL:  # (an abandoned stage's are freed)
                            r.Free()
            op.persistent = None
        self._state, self._op, self._keep = "freed", None, ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._state == "active" and exc[0] is None:
            self.wait()
        if self._state != "active":
            self._release()

    def __del__(self):
        if self._state != "active" and self._state != "freed":
            self._release()


class _OneRound(PersistentRequest):
    """A persistent call whose messages all travel in one round (2 ranks,
    short vectors): ``start()`` runs the local steps before that round and
    starts its MPI persistent requests, ``wait()`` waits for them and runs
    the rest.  With one round nothing needs advancing in between, so the
    call needs no more Python than that; it is still watched by the
    watchdog (this request is the watched item), holds its tag, sets its
    communicator's call slot while it starts, and in raise mode waits
    against its deadline."""

    __slots__ = ("_before", "_requests", "_after", "_after_wait", "_context", "_limit",
                 "_starts")

    def __init__(self, op: Operation, result, keep=()):
        super().__init__(op, result, keep)
        (index,) = [i for i, requests in enumerate(op.persistent) if requests]
        stages = op.stages
        self._before = [s for stage in stages[:index] for s in stage.before + stage.overlap]
        self._before += stages[index].before
        self._requests = op.persistent[index]
        self._after = list(stages[index].overlap)  # runs before the wait: it overlaps
        self._after_wait = [s for stage in stages[index + 1:] for s in stage.before + stage.overlap]
        self._context, self._limit, self._starts = op.context, op.limit, 0
        if settings()[0] > 0:
            WATCH.watch(self)

    def snapshot(self) -> tuple:
        op = self._op
        active = self._state == "active" and op is not None
        return self._starts, (op.kind, op.plan) if active else None, "any"

    def start(self) -> None:
        if self._state != "complete":
            super().start()  # raises
        context = self._context
        if context.what is not None:
            raise context.concurrent()
        context.what = _STARTING
        try:
            if self._limit:
                if context.broken is not None:
                    raise Stalled(context.broken)
                self._op.deadline = time.monotonic() + self._limit
            for function, args in self._before:
                function(*args)
            _startall(self._requests)
            for function, args in self._after:
                function(*args)
            self._starts += 1
            self._state = "active"
        finally:
            context.what = None

    def wait(self):
        if self._state != "active":
            self._check_active("wait")
        if self._limit:  # the engine's one wait loop, against the deadline
            op = self._pending()
            _ENGINE.start_caller(op)
            try:
                _ENGINE.wait(op)
            except Stalled:
                self._state = "complete"
                raise
            if op.error is not None:  # (an MPI error, raised as the wait below raises it)
                error, op.error = op.error, None
                raise error
        else:
            _waitall(self._requests)
        for function, args in self._after_wait:
            function(*args)
        self._state = "complete"
        return self._result

    def test(self) -> bool:
        if self._state != "active":
            self._check_active("test")
        if not _testall(self._requests):
            if self._limit and time.monotonic() > self._op.deadline:
                raise self._stalled()
            return False
        self.wait()
        return True

    def _pending(self) -> Operation:
        """The operation, in flight with this start's requests as its last
        stage's (what the engine waits for, and a report describes)."""
        op = self._op
        op.pending, op.index, op.done = [_Started(self._requests)], len(op.stages) - 1, False
        op.starts = self._starts
        return op

    def _stalled(self) -> Stalled:
        self._state = "complete"
        return self._pending().stalled()


_startall, _waitall, _testall = MPI.Prequest.Startall, MPI.Request.Waitall, MPI.Request.Testall


def persistent_request(op: Operation, result, keep=()) -> PersistentRequest:
    """The persistent request for ``op``: the one-round short cut where it
    applies (host buffers, progressed by the caller, one round of messages)."""
    if op.persistent is not None and not op.threaded and \
            sum(1 for requests in op.persistent if requests) == 1:
        return _OneRound(op, result, keep)
    return PersistentRequest(op, result, keep)


def persistent_requests(bound: Bound, tag: int) -> list:
    """MPI persistent requests for every stage's messages (host buffers)."""
    plan = bound.plan
    comm, mpitype = plan.comm, plan.mpitype
    out = []
    for stage in bound.stages:
        requests = []
        for send, dest, recv, source in stage.pairs:
            if recv is not None:
                requests.append(comm.Recv_init([recv, mpitype], source, tag))
            if send is not None:
                requests.append(comm.Send_init([send, mpitype], dest, tag))
        out.append(requests or None)
    return out


def operation(bound: Bound, context, nbytes: int, persistent: bool) -> Operation:
    """An operation for ``bound`` on ``context``, threaded or not, with MPI
    persistent requests or not, holding a tag of its own from the
    context (calls in flight together must not match each other's
    messages; a persistent request holds its tag until it is freed)."""
    threaded = nbytes >= THREAD_MIN_BYTES and thread_progress()
    kind = "persistent call" if persistent else "non-blocking call"
    op = Operation(bound.stages, bound.plan, 0, _ENGINE.slot(), threaded, kind, context,
                   reserved=persistent)
    op.tag = context.claim(op, bound.plan.fingerprint, persistent)
    if persistent and not bound.plan.backend.device:
        op.persistent = persistent_requests(bound, op.tag)
    return op


def local_operation(backend, send, recv) -> Operation:
    """The call of one rank, or of no elements: the input copied to the result."""
    steps = []
    if send is not None and recv.size:
        steps = [(backend.device_synchronize, ()), (backend.copy, (recv, send))]
    return Operation([Stage(tuple(steps), (), ())], None, 0, "", False)


#: what a communicator's call slot holds while a non-blocking call starts
_STARTING = ("start of a non-blocking call", None)
#: whether a test and a store with no call between them are atomic: under
#: the GIL (the interpreter switches threads only at calls and backward
#: jumps); a free-threaded interpreter takes a lock instead
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


def blocking(bound: Bound, context, kind: str):
    """What runs a blocking call of ``bound`` on ``context``: its compiled
    steps, with the communicator's call slot set (the re-entry guard, and
    what the watchdog's monitor samples: three attribute stores a call),
    or in the watchdog's raise mode the call run as an operation against
    its deadline."""
    run = bound.run
    seconds, action = settings()
    what = (kind, bound.plan)
    if seconds > 0 and action == "raise":
        op = Operation(bound.stages, bound.plan, bound.plan.tag, "wd", False, kind, context)

        def deadline_run():
            if context.what is not None:
                raise context.concurrent()
            context.what = what
            try:
                if context.broken is not None:
                    raise Stalled(context.broken)
                op.begin()
                if not op.done:  # the one wait loop (it polls against the deadline)
                    _ENGINE.start_caller(op)
                    _ENGINE.wait(op)
            finally:
                context.what = None
            if op.error is not None:
                error, op.error = op.error, None
                raise error
        return _locked(deadline_run, context)

    def guarded_run():
        if context.what is not None:
            raise context.concurrent()
        context.what = what
        context.count += 1
        try:
            run()
        finally:
            context.what = None
    return _locked(guarded_run, context)


def _locked(run, context):
    """``run`` as it is under the GIL; with a lock around its guard elsewhere."""
    if _GIL:
        return run
    lock = context.__dict__.setdefault("_guard", threading.Lock())

    def locked():
        if not lock.acquire(False):
            raise context.concurrent()
        try:
            run()
        finally:
            lock.release()
    return locked


def waitall(requests) -> list:
    """Wait for every request (in any order of completion); their results."""
    return [r.wait() for r in requests]
