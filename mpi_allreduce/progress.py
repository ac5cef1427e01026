"""Non-blocking and persistent calls as the caller sees them: requests,
and what runs a blocking call, on the one engine
(:mod:`~mpi_allreduce.engine`: operations, the progress thread, the one
wait loop).

Who advances an operation:

* **the progress thread**, one per process, where the MPI library was
  initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default)
  and the call moves at least :data:`~mpi_allreduce.engine.THREAD_MIN_BYTES`.  While operations
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
* **the progress thread again**, for a call of any size with a completion
  callback (:meth:`Request.add_done_callback`): it takes the call over
  until that start completes (``_Engine.adopt``) and runs the callbacks,
  so the call completes whether or not anyone waits (the torch backend's
  futures).

Ranks must start collective calls on one communicator in the same order
(as MPI requires); they may complete and be waited in any order, from any
thread.

Every kind of call goes through this one request path: blocking calls
(:func:`blocking`), non-blocking and persistent ones (one :class:`Request`
class and its persistent form; a call of one round of messages takes the
operation's fast path, ``Operation.one_round``, inside the same methods),
reduce-scatter and allgather, and MPI's own requests where the torch
backend hands a call to MPI (:func:`mpi_request`).  Every call and every
start of one enters through the one guard (:func:`guarded`).  Each is
watched by the watchdog from start to completion, and in the watchdog's
``raise`` mode each waits against one deadline loop (``_Engine.wait``).
"""

from __future__ import annotations

from threading import Lock, get_ident
from time import sleep as _yield
from typing import Optional

from mpi4py import MPI

from .context import _CLOSING, cached_context, reap
from .engine import (_ENGINE, _PRUNE, ABANDONED, THREAD_MIN_BYTES,  # noqa: F401
                     MPIOperation, Operation, _Started, _run_all, abandon, mpi_threads,
                     thread_progress)
from .errors import RequestError, Stalled, TagsExhausted, failed
from .backend import Slot, message_calls, started
from .executor import Bound, Stage, runner
from .watchdog import settings

_waitall, _testall = MPI.Request.Waitall, MPI.Request.Testall
#: a completed start's error changes hands under it (see Request._complete)
_TAKE = Lock()

__all__ = ["Request", "PersistentRequest", "RequestError", "waitall", "guarded", "blocking",
           "mpi_request", "restarter", "kept_scratch_back"]


def mpi_request(requests, what: str, comm, statuses=None, cancel=False,
                on_stall=None, shelter=False) -> "Request":
    """A :class:`Request` over MPI requests the caller posted on ``comm``
    (see :class:`~mpi_allreduce.engine.MPIOperation`): its ``wait()`` and ``test()`` are the
    engine's, as for the library's own calls.  Left by a stall, an interrupt or
    an error, it breaks the library's context of ``comm`` as the library's own
    calls do: ranks whose calls took different ways (MPI's here, the library's
    there) may have left messages on the library's communicator too.
    ``shelter``: MPI runs a user-defined ``MPI.Op`` as they complete (see
    :class:`~mpi_allreduce.engine.MPIOperation`)."""
    request = Request(MPIOperation(requests, what, comm, statuses, cancel, on_stall,
                                   cached_context(comm), shelter), None)
    request._state = "active"
    _ENGINE.start_caller(request._op)
    return request


class Request:
    """A non-blocking call: ``test()``, ``wait()``; persistent ones also
    ``start()`` and ``free()`` (MPI-4's persistent collectives)."""

    __slots__ = ("_op", "_result", "_state", "_keep", "_start", "_round", "_error", "_late",
                 "__weakref__")

    # states: "active" (started, not yet waited), "complete" (waited; a
    # persistent request may start again), "freed"
    def __init__(self, op: Optional[Operation], result, keep=(), start=None):
        self._op, self._result, self._keep = op, result, keep
        #: what starts the call (see starter); made once for a call started often
        self._start = start if start is not None or op is None else starter(op)
        #: the operation's one-round fast path (see Operation.one_round), or None
        self._round = op.round if op is not None else None
        self._state = "complete"
        #: the error this start of the call ended with, once raised: every
        #: later wait() or test() of it raises it too (a callback's wait took it first:
        #: see _fired)
        self._error = None
        #: (an interrupt a callback raised after the call completed, its start)
        self._late = None

    def _begin(self) -> None:
        op = self._op
        if op is None:  # nothing to send: complete at once
            self._state, self._error = "active", None
            return
        self._start()  # (a start refused keeps the error of the start before)
        self._state, self._error = "active", None
        op.unwaited = True  # (until it is waited: see restarter)
        if op.done or self._round is not None:
            return  # (the one-round fast path: its wait or test finishes it)
        if op.threaded:
            _ENGINE.start_threaded(op)
        else:
            _ENGINE.start_caller(op)

    def test(self) -> bool:
        """Whether the call is complete (a true answer completes the
        request, as ``wait()`` would)."""
        self._check_active("test")
        op = self._op
        if self._round is not None and not op.done:  # (the one-round fast path)
            try:
                done = _testall(op.live)
            except BaseException as exc:
                self._given_up(exc)
                raise
            if done:
                self.wait()  # (the steps after the round)
            return done
        try:  # (to the end: an interrupt even as it completes breaks the communicator)
            if op is not None and not op.finished():
                if op.threaded:
                    if not op.event.is_set():
                        _ENGINE.overdue(op)
                        # let the progress thread have the interpreter: a loop
                        # of test() would hold it for the switch interval
                        # (5 ms) between the thread's stages
                        _yield(0)
                        return False
                else:
                    _ENGINE._advance(op)
                    if not op.done:
                        _ENGINE.overdue(op)
                        return False
            if op is not None and op.callbacks and self._fired(op):  # (completed here)
                return True
            self._complete()
        except BaseException as exc:
            self._given_up(exc)
            raise
        return True

    def wait(self):
        """Wait until the call is complete; return the result buffer."""
        op = self._op
        round_ = self._round
        if round_ is not None and _ENGINE.ident and _ENGINE.ident == get_ident() and not op.done:
            # on the progress thread (a callback's wait) nothing blocks in
            # MPI: the round's requests become its stage's, waited as any call
            op.pending, op.index, self._round = [_Started(op.live)], round_[4], None
            round_ = None
        if round_ is not None and self._state == "active":
            try:  # the one-round fast path: the rest of the call, in this frame
                if not op.done:  # (done: a callback of it waits for it, see below)
                    _waitall(op.live)
                    for function, args in round_[2]:
                        function(*args)
                    op.done = True
                op.unwaited = False
                # (the request still active: a callback's wait is its own)
                if op.callbacks and self._fired(op):
                    return self._result
                self._state = "complete"
                if _CLOSING or not op.kept and self.__class__ is Request:
                    self._complete()  # (reap; a call's own scratch back to its plan)
            except BaseException as exc:  # (to the end: as it completes too)
                self._given_up(exc)
                raise
            return self._result
        if self._state != "active":
            self._check_active("wait")
        try:  # (to the end: an interrupt even as it completes breaks the communicator)
            if op is not None and not op.finished():
                _ENGINE.wait(op)
            if op is not None and op.callbacks and self._fired(op):  # (completed here)
                return self._result
            if _CLOSING or self.__class__ is Request or op is not None and op.error is not None:
                self._complete()
            else:  # (a persistent call's wait: nothing more to do)
                self._state = "complete"
        except BaseException as exc:
            self._given_up(exc)
            raise
        return self._result

    def add_done_callback(self, callback) -> None:
        """Run ``callback(request)`` once the call is complete, with or
        without an error (at once if it is), whether or not anyone waits
        for it: where MPI runs threads (``MPI_THREAD_MULTIPLE``) the
        progress thread takes the call over and runs the callback when it
        completes; elsewhere the ``wait()`` or ``test()`` that completes it
        runs it.  In the callback, ``request.wait()`` returns the result at
        once (or raises the call's error); as any request, it is waited
        once, so a callback that waits is the request's waiter.  A callback
        may wait for other calls and make blocking calls: on the progress
        thread such a wait goes on completing the thread's other calls (the
        other callbacks wait their turn), so it waits as it would on any
        thread.  As
        with MPI's requests, one thread at a time uses a request: add
        callbacks before waiting for it, not while another thread waits."""
        self._check_active("add_done_callback")
        op = self._op
        if op is None or op.done and not _ENGINE.callbacks_pending(op.context, op.order):
            # (else after the earlier calls' ones: Operation.when_done); an
            # exception it raises is printed, as one on the thread is (an
            # interrupt is raised: engine._run_all)
            _run_all((lambda: callback(self),))
            return
        if self._round is not None and mpi_threads():
            # the progress thread completes it now, through its stages, not
            # this request's one-round wait (Operation.round)
            self._round = None
        op.when_done(lambda: callback(self))

    def _given_up(self, exc: BaseException) -> None:
        """A wait or test left by an exception (a stall, an interrupt)
        before the call completed, or as it completed: its messages may be
        in disarray, and a retry could meet the peers' next call, so its
        communicator is broken (see Context.breaks) and the request is not
        waited again."""
        op = self._op
        if op is None:
            self._state = "complete"
            return
        late, self._late = self._late, None
        if late is not None and late[0] is exc and op.done and op.error is None:
            # an interrupt a callback on this thread raised (see _fired): the
            # call had completed -- its result stands and its communicator is
            # sound -- so the request completes as it would have
            if self._state == "active" and op.starts == late[1]:
                self._state = "complete"
                op.unwaited = False
            return
        if op.context is not None:
            op.context.breaks(exc, op.kind)
        if self._error is None:
            # what a later wait() or test() of it raises (see _fired): the
            # error, or for an interrupt (the caller's own, already raised)
            # the broken communicator's error, not the interrupt again
            self._error = exc if isinstance(exc, Exception) or op.context is None \
                else op.context.refusal()
        if not isinstance(exc, Stalled) and not op.threaded:  # (the thread holds its requests)
            op.drop()
            _ENGINE._drop(op)
        elif not isinstance(exc, Stalled):
            # the thread's: it gives the call up at its next turn, before it
            # advances it again (it would go on sending from the call's
            # arrays, which the caller may write into again)
            _ENGINE.give_up(op)
        self._state = "complete"
        if not op.threaded and op.callbacks:  # (the thread runs those of its own calls)
            op.done = True  # (given up: complete, with this error)
            op.fire()

    def _fired(self, op: Operation) -> bool:
        """Run the callbacks of a call this thread completed (not the
        progress thread), the request still theirs to wait; whether one of
        them took it: waited for it (then what it raised, this wait raises
        too -- a call's error is never dropped), and may have started it
        again (a persistent request: the new start is not this wait's).  An
        interrupt raised in one is raised by this wait, the call complete
        and its communicator sound (see :meth:`_given_up`)."""
        starts = op.starts
        try:
            op.fire()
        except BaseException as exc:  # (an interrupt: engine._run_all; see _given_up)
            self._late = (exc, starts)
            raise
        if self._state == "active" and op.starts == starts:
            return False
        if self._error is not None:
            raise self._error
        return True

    # mpi4py's spellings, so code written for MPI.Request runs unchanged
    def Wait(self, status=None) -> bool:  # noqa: N802
        self.wait()
        return True

    def Test(self, status=None) -> bool:  # noqa: N802
        return self.test()

    def _complete(self) -> None:
        op = self._op
        self._state = "complete"
        if op is not None:
            op.unwaited = False
        if _CLOSING:
            reap()
        if op is not None:
            # (two waiters of one start -- its caller and a callback that waits,
            # on the progress thread -- may complete it at once: the first
            # takes the call's error, and the other raises it too, never the
            # result as if nothing had happened)
            with _TAKE:
                error, op.error = op.error, None
                if error is not None:
                    self._error = error
                else:
                    error = self._error
            if error is not None:
                failed(getattr(op, "comm", MPI.COMM_WORLD), error, "a non-blocking call")
        if self.__class__ is Request and (op is None or not op.kept):  # scratch: the next call's
            for bound in self._keep:  # (not after an error: messages may still land)
                _scratch_back(bound)

    def __del__(self) -> None:
        # a request dropped while its call is in flight (never waited): the
        # call is kept for good, as a given-up one is -- a receive it posted
        # may still land in its arrays, a send still read from them, and the
        # one-round fast path's requests are held by nothing else (freed
        # with them, a late message would write into freed memory)
        # (a call given up while another thread held it, too: Operation.drop)
        op = self._op
        if op is not None and not op.done:
            try:
                abandon(op)
            except Exception:  # noqa: BLE001 - (at the interpreter's end)
                pass

    def _check_active(self, what: str) -> None:
        if self._state == "active":
            return
        if self._error is not None and what in ("wait", "test") and self._state == "complete":
            raise self._error  # (the call ended with it: see _fired)
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
        if self._state != "complete":
            op = self._op
            if op is not None and op.context is not None and op.context.broken is not None:
                # (a start interrupted on its way, say, left it active: its
                # communicator is broken, which is what a start says first)
                raise op.context.refusal()
            if self._state == "active":
                raise RequestError("start() on a persistent request that is still active "
                                   "(wait() for it first)")
            raise RequestError("start() on a freed request")
        op = self._op
        try:
            if op is not None and op.round is not None:  # the one-round fast path: _begin, inline
                self._round = op.round  # (dropped by a callback's start: add_done_callback)
                self._start()
                op.started()
                self._state, self._error = "active", None
                return
            self._begin()
        except BaseException as exc:
            # (an interrupt as the start begins or ends, outside its guard:
            # this rank may have started the call or not, its peers cannot
            # tell -- a later start would meet their next one)
            if op is not None and op.context is not None:
                op.context.breaks(exc, "the start of a " + op.kind)
            raise

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

    def __del__(self):
        super().__del__()  # (in flight: kept)
        if self._state != "active" and self._state != "freed":
            self._release()

    def _release(self) -> None:
        op = self._op
        if op is not None:
            op.reserved = False
            persistent = op.persistent
            if persistent is not None and not MPI.Is_finalized():
                for requests in persistent:
                    for r in requests or ():
                        if r == MPI.REQUEST_NULL:
                            continue
                        # (done, and not by the thread giving it up meanwhile,
                        # which keeps them: Operation.abandon drops op.persistent first)
                        if op.done and op.persistent is persistent:
                            r.Free()
                        else:  # (stalled, still the thread's: MPI may be inside it)
                            abandon(r)
            op.persistent = None
        self._state, self._op, self._keep, self._start, self._round = "freed", None, (), None, \
            None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._state == "active" and exc[0] is None:
            self.wait()
        if self._state != "active":
            self._release()


def persistent_requests(bound: Bound, tag: int) -> list:
    """MPI persistent requests for every stage's messages (host buffers)."""
    plan = bound.plan
    return [started(message_calls(plan.comm, stage.pairs, plan.mpitype, "init"), tag) or None
            for stage in bound.stages]


def operation(bound: Bound, context, nbytes: int, persistent: bool) -> Operation:
    """An operation for ``bound`` on ``context``, threaded or not, its tag
    not yet claimed: :func:`claim` gives it one of its own from the context
    (calls in flight together must not match each other's messages; a
    persistent request holds its tag until it is freed), inside the
    caller's ``try`` of :func:`broken_if_counted`."""
    threaded = nbytes >= THREAD_MIN_BYTES and thread_progress()
    kind = "persistent call" if persistent else "non-blocking call"
    return Operation(bound.stages, bound.plan, 0, Slot(bound.plan.backend.device), threaded,
                     kind, context, reserved=persistent)


def claim(op: Operation, bound: Bound, context, persistent: bool) -> None:
    """Give ``op`` its tag from the context (the call is counted: see
    :func:`broken_if_counted`) and what is made with the tag: a persistent
    call's MPI requests, the one-round fast path's messages."""
    op.tag = context.claim(op, bound.plan.fingerprint, persistent)
    if persistent and not bound.plan.backend.device:
        op.persistent = persistent_requests(bound, op.tag)
    op.one_round()


def broken_if_counted(context, persistent: bool, before: int, exc: BaseException,
                      what: str) -> None:
    """After ``exc`` left the span from a call's tag claim to its hand-over
    to the caller (its start, where it is started at once), in the one
    ``try`` that holds both: where this rank counted a call since
    ``before`` (``Context.counted``), as its peers count it, the
    communicator is broken (``Context.breaks``) -- a retry would take the
    tag of the peers' next call and meet it.  (A refusal for want of tags
    is every rank's alike: it breaks nothing.)"""
    if context.counted(persistent) != before and not isinstance(exc, TagsExhausted):
        context.breaks(exc, what)


def starter(op: Operation):
    """What starts ``op``: its :meth:`~mpi_allreduce.engine.Operation.begin`
    under its communicator's guard (:func:`guarded`: a start is a call of
    its own on the communicator, and an exception in it breaks the
    communicator), or as it is for a call with no communicator."""
    if op.context is None:
        return op.begin
    what = ("start of a " + op.kind, op.plan)
    if op.round is not None:  # (see Operation.one_round)
        steps = op.round_steps()
        return guarded(op.context, what, runner(steps), steps=steps)
    return guarded(op.context, what, op.begin)


def kept_scratch_back(op: Operation, bound: Bound):
    """What gives a kept non-blocking call's scratch back to its plan when
    the call is dropped (not while it is in flight: messages may land)."""
    def release():
        if op.done and op.error is None:
            _scratch_back(bound)
    return release


def _scratch_back(bound: Bound) -> None:
    """A completed call's scratch back to its plan, for the plan's next calls."""
    if bound.scratch is not None:
        bound.plan.give_back(bound.scratch)
        bound.scratch = None


def restarter(op: Operation, context, result):
    """What starts ``op`` (a non-blocking call's, kept for repeats) again: a
    new :class:`Request` over the same operation, with a new tag from the
    context (calls are numbered in the order they start, on every rank);
    None while its last start is still in flight."""
    fingerprint, start = op.plan.fingerprint, starter(op)
    if op.round is not None and not op.round[0] and not op.round[1]:
        return _restarter_one_round(op, context, result, fingerprint, start)

    def restart():
        if not op.done or op.unwaited:
            return None  # in flight, or complete but not yet waited: a call of its own
        before = context.counted(False)
        try:  # (the claim inside it: see broken_if_counted)
            op.tag = context.claim(op, fingerprint, False)
            request = Request(op, result, start=start)
            request._begin()
            return request
        except BaseException as exc:
            broken_if_counted(context, False, before, exc, f"the start of a {op.kind}")
            raise
    return restart


def _restarter_one_round(op: Operation, context, result, fingerprint: int, start):
    """:func:`restarter` for a call of one round of messages and no local
    step before them (``Operation.one_round``: 2 ranks, a short vector):
    the tag's claim, the start of the messages and the new request in one
    guarded frame -- what :meth:`Request._begin` and ``Operation.round_steps``
    do, without their calls (a repeated ``iallreduce`` + ``wait`` of a few
    bytes costs about three MPI messages: benchmarks/floor.py)."""
    claim, posts, round_ = context.claim, op.round[3], op.round

    def restart():
        if not op.done or op.unwaited:
            return None  # in flight, or complete but not yet waited: a call of its own
        op.tag = tag = claim(op, fingerprint, False)
        op.started()
        op.live = [call(spec, peer, tag) for call, spec, peer in posts]
        request = Request(op, result, start=start)
        request._state = "active"
        op.unwaited = True
        return request
    return guarded(context, ("start of a " + op.kind, op.plan), restart)


def local_operation(backend, send, recv) -> Operation:
    """The call of one rank, or of no elements: the input copied to the result."""
    steps = []
    if send is not None and recv.size:
        steps = [(backend.device_synchronize, ()), (backend.copy, (recv, send))]
    return Operation([Stage(tuple(steps), (), ())], None, 0, Slot(False), False)


def guarded(context, what: tuple, run, on_thread=None, steps=None):
    """``run`` as one call on ``context`` (``what``: (kind, plan), what the
    watchdog reports; what ``run`` returns is returned): the one re-entry guard of every call -- another
    thread inside a call on this communicator: ConcurrentCall, which breaks
    the communicator (the two threads' calls may pair with each other's on
    the peers: the call inside raises Broken as it ends, and every later
    call on it raises at once); a broken
    communicator: Broken at once -- and any exception (an interrupt too)
    that leaves ``run`` breaks the communicator, since messages may be in
    flight (see ``Context.breaks`` in ``mpi_allreduce.context``).  A call
    made of calls (a reproducible sum, live selection) is guarded as a
    whole; its inner calls re-enter on the same thread.  On the progress
    thread (a completion callback's blocking call) ``on_thread`` runs
    instead, where given: the call as an operation of the engine, whose
    wait there never blocks in MPI (see ``_Engine._wait_on_thread``).
    ``steps``: ``run``'s compiled steps, where it is one or two of them (a
    kept call on two ranks: the exchange and the reduction; a persistent
    call's start), run in the guard's own frame -- the same guard, one
    Python call fewer on the latency-critical path (``benchmarks/floor.py``)."""
    acquire, release = context.guard.acquire, context.guard.release
    kind = what[0]
    engine, ident = _ENGINE, get_ident

    if steps is not None and len(steps) in (1, 2):
        (f0, a0), (f1, a1) = steps if len(steps) == 2 else (steps[0], (None, ()))
    else:  # (the call, one step of its own)
        (f0, a0), (f1, a1) = (run, ()), (None, ())

    def guarded_run():
        body, first, args, second = run, f0, a0, f1
        if on_thread is not None and engine.ident and engine.ident == ident():
            # (ident is 0 until the thread starts)
            body, first, args, second = on_thread, on_thread, (), None
        if not acquire(False):
            if context.broken is not None:  # (a clash broke it: Broken, as every later call)
                raise context.refusal()
            clash = context.concurrent()
            context.breaks(clash, kind)
            context.clashed = True  # (the call that holds the guard raises as it ends)
            raise clash
        held, began = True, False
        try:
            if context.broken is not None:
                raise context.refusal()
            context.what = what
            context.count += 1
            began = True
            value = first(*args)
            if second is not None:
                second(*a1)
            context.what = None
            held = False
            # (an interrupt is raised as a call returns, this one too: inside
            # this try, so one that lands as the call completes breaks the
            # communicator as well -- a retry would meet the peers' next call)
            release()
            if context.clashed:
                # (another thread was refused while this call ran -- looked at
                # once the guard is let go, so a refusal up to then is seen: the
                # two threads' calls may have paired with each other's on some
                # peer, so this result is not handed back as this thread's)
                raise context.refusal()
        except BaseException as exc:
            context.what = None
            if held:
                release()
            # (what ran the call is kept only where it ran: a call refused
            # on a broken communicator sent nothing, and keeps nothing)
            context.breaks(exc, kind, body if began else None)
            raise
        return value
    return guarded_run


def blocking(bound: Bound, context, kind: str):
    """What runs a blocking call of ``bound`` on ``context``: its compiled
    steps under the guard (:func:`guarded`), or the call run as an
    operation waited in the one wait loop -- in the watchdog's raise mode
    (against its deadline), and on the progress thread (a completion
    callback's blocking call: that wait never blocks in MPI)."""
    seconds, action = settings()
    what = (kind, bound.plan)
    op = None

    def as_operation():
        nonlocal op
        if op is None:  # (made at the first such call: most never are)
            op = Operation(bound.stages, bound.plan, bound.plan.tag,
                           Slot(bound.plan.backend.device), False, kind, context)
        op.begin()
        if not op.done:  # the one wait loop (it polls against a deadline)
            _ENGINE.start_caller(op)
            _ENGINE.wait(op)
        if op.error is not None:
            error, op.error = op.error, None
            raise error
    if seconds > 0 and action == "raise":
        return guarded(context, what, as_operation)
    return guarded(context, what, bound.run, as_operation, bound.steps)


def waitall(requests) -> list:
    """Wait for every request (in any order of completion); their results."""
    return [r.wait() for r in requests]
