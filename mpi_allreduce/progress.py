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
(as MPI requires); they may complete and be waited in any order.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
from typing import Optional

from mpi4py import MPI

from . import watchdog
from .config import environment
from .executor import Bound, Stage

__all__ = ["Operation", "Request", "RequestError", "waitall", "thread_progress",
           "THREAD_MIN_BYTES"]

#: calls moving fewer bytes per rank than this are advanced by the caller
THREAD_MIN_BYTES = 64 * 1024
#: tag of the progress thread's wake-up message to itself
_WAKE_TAG = 0x77616B


class RequestError(RuntimeError):
    """A request used out of turn: waited twice, never started, started
    while active, or used after ``free()``."""


class Operation:
    """One call in flight: a bound plan's stages, run in order."""

    __slots__ = ("stages", "plan", "comm", "mpitype", "post", "tag", "slot", "index", "pending",
                 "done", "error", "event", "threaded", "persistent")

    def __init__(self, stages: list, plan, tag: int, slot: str, threaded: bool,
                 persistent=None):
        self.stages, self.tag, self.plan = stages, tag, plan
        if plan is not None:
            self.comm, self.mpitype, self.post = plan.comm, plan.mpitype, plan.backend.post
        self.slot = slot  # names this call's staging buffers (device backends)
        self.threaded = threaded
        #: per stage, MPI persistent requests made once (host buffers), or None
        self.persistent = persistent
        self.index = len(self.stages)
        self.pending: list = []
        self.done = True
        self.error: Optional[BaseException] = None
        self.event = threading.Event() if threaded else None

    def begin(self) -> None:
        """Run the stages up to the first with messages in flight."""
        self.index, self.done, self.error = -1, False, None
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
        for ``wait()`` to raise."""
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
        return True

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
    """A stage's persistent requests, started (what ``Pending`` is to posted ones)."""

    __slots__ = ("requests",)

    def __init__(self, requests):
        self.requests = requests

    def wait(self) -> None:
        MPI.Request.Waitall(self.requests)

    def test(self) -> bool:
        return MPI.Request.Testall(self.requests)


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

    @property
    def caller(self) -> list:
        """This thread's calls advanced by test()/wait(), oldest first (a
        thread advances its own calls only: MPI requests are never waited
        on by two threads)."""
        ops = getattr(self._local, "ops", None)
        if ops is None:
            ops = self._local.ops = []
        return ops

    @caller.setter
    def caller(self, ops: list) -> None:
        self._local.ops = ops

    # --- caller progress ----------------------------------------------------
    def progress_caller(self) -> None:
        still = []
        for op in self.caller:
            if not op.advance(False):
                still.append(op)
        self.caller = still

    def wait_caller(self, op: Operation) -> None:
        while not op.done:
            if len(self.caller) == 1 and self.caller[0] is op:
                op.advance(True)
                self.caller = []
                return
            self.progress_caller()
            if op.done:
                return
            MPI.Request.Waitany([r for other in self.caller for r in other.requests()])

    # --- the thread -------------------------------------------------------------
    def start_threaded(self, op: Operation) -> None:
        if self.thread is None:
            self._start_thread()
        with self.cond:
            self.threaded.append(op)
            self.cond.notify()
            if self.in_mpi:
                self.wake_comm.Send([bytearray(0), MPI.BYTE], 0, _WAKE_TAG)

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
                self.wake_comm.Send([bytearray(0), MPI.BYTE], 0, _WAKE_TAG)
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
        self._state = "active"
        op = self._op
        if op is None:  # nothing to send: complete at once
            return
        try:
            op.begin()
        except BaseException:
            self._state = "complete"
            raise
        if op.done:
            return
        if op.threaded:
            _ENGINE.start_threaded(op)
        else:
            _ENGINE.caller.append(op)

    def test(self) -> bool:
        """Whether the call is complete (a true answer completes the
        request, as ``wait()`` would)."""
        self._check_active("test")
        op = self._op
        if op is not None and not op.done:
            if op.threaded:
                if not op.event.is_set():
                    return False
            else:
                _ENGINE.progress_caller()
                if not op.done:
                    return False
        self._complete()
        return True

    def wait(self):
        """Wait until the call is complete; return the result buffer."""
        self._check_active("wait")
        op = self._op
        if op is not None and not op.done:
            seconds, action = watchdog.settings()
            if seconds > 0 and action == "raise":
                self._wait_until(op, time.monotonic() + seconds, seconds)
            elif seconds > 0:
                watchdog.WATCH.ensure_monitor()
                watchdog.WATCH.current = ("non-blocking call", op.plan)
                watchdog.WATCH.calls += 1
                try:
                    self._wait(op)
                finally:
                    watchdog.WATCH.current = None
            else:
                self._wait(op)
        self._complete()
        return self._result

    @staticmethod
    def _wait(op: Operation) -> None:
        if op.threaded:
            while not op.event.wait(1.0):
                pass
        else:
            _ENGINE.wait_caller(op)

    def _wait_until(self, op: Operation, deadline: float, seconds: float) -> None:
        """Wait by polling; past the deadline, raise :class:`~.watchdog.Stalled`."""
        while not (op.event.wait(0.01) if op.threaded else op.done):
            if not op.threaded:
                _ENGINE.progress_caller()
            if time.monotonic() > deadline and not op.done:
                self._state = "complete"  # abandoned: not waitable again
                if not op.threaded:
                    _ENGINE.caller = [o for o in _ENGINE.caller if o is not op]
                    op.abandon()
                raise watchdog.Stalled(watchdog.report(
                    watchdog.describe("non-blocking call", op.plan), seconds,
                    watchdog.WATCH.calls))

    # mpi4py's spellings, so code written for MPI.Request runs unchanged
    def Wait(self, status=None) -> bool:  # noqa: N802
        self.wait()
        return True

    def Test(self, status=None) -> bool:  # noqa: N802
        return self.test()

    def _complete(self) -> None:
        op = self._op
        self._state = "complete"
        if op is not None and op.error is not None:
            error, op.error = op.error, None
            from .api import failed  # (api imports this module)
            failed(getattr(op, "comm", MPI.COMM_WORLD), error, "a non-blocking call")

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
    ``wait()`` (or ``test()``), again and again; ``free()`` at the end."""

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
        """Release the request (not while it is active)."""
        if self._state == "active":
            raise RequestError("free() on an active request (wait() for it first)")
        op = self._op
        if op is not None and op.persistent is not None:
            for requests in op.persistent:
                for r in requests or ():
                    r.Free()
        self._state, self._op, self._keep = "freed", None, ()


class _OneRound(PersistentRequest):
    """A persistent call whose messages all travel in one round (2 ranks,
    short vectors): ``start()`` runs the local steps before that round and
    starts its MPI persistent requests, ``wait()`` waits for them and runs
    the rest.  With one round nothing needs advancing in between, so the
    call bypasses the engine: no more Python than that per call."""

    __slots__ = ("_before", "_requests", "_after", "_after_wait")

    def __init__(self, op: Operation, result, keep=()):
        super().__init__(op, result, keep)
        (index,) = [i for i, requests in enumerate(op.persistent) if requests]
        stages = op.stages
        self._before = [s for stage in stages[:index] for s in stage.before + stage.overlap]
        self._before += stages[index].before
        self._requests = op.persistent[index]
        self._after = list(stages[index].overlap)  # runs before the wait: it overlaps
        self._after_wait = [s for stage in stages[index + 1:] for s in stage.before + stage.overlap]

    def start(self) -> None:
        if self._state != "complete":
            super().start()  # raises
        for function, args in self._before:
            function(*args)
        _startall(self._requests)
        for function, args in self._after:
            function(*args)
        self._state = "active"

    def wait(self):
        if self._state != "active":
            self._check_active("wait")
        _waitall(self._requests)
        for function, args in self._after_wait:
            function(*args)
        self._state = "complete"
        return self._result

    def test(self) -> bool:
        if self._state != "active":
            self._check_active("test")
        if not _testall(self._requests):
            return False
        self.wait()
        return True


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


def operation(bound: Bound, tag: int, nbytes: int, persistent: bool) -> Operation:
    """An operation for ``bound`` whose messages carry ``tag`` (one of its
    own: calls in flight together must not match each other's messages):
    threaded or not, persistent MPI requests or not."""
    threaded = nbytes >= THREAD_MIN_BYTES and thread_progress()
    requests = persistent_requests(bound, tag) if persistent and not bound.plan.backend.device \
        else None
    return Operation(bound.stages, bound.plan, tag, _ENGINE.slot(), threaded, requests)


def local_operation(backend, send, recv) -> Operation:
    """The call of one rank, or of no elements: the input copied to the result."""
    steps = []
    if send is not None and recv.size:
        steps = [(backend.device_synchronize, ()), (backend.copy, (recv, send))]
    return Operation([Stage(tuple(steps), (), ())], None, 0, "", False)


def waitall(requests) -> list:
    """Wait for every request (in any order of completion); their results."""
    return [r.wait() for r in requests]
