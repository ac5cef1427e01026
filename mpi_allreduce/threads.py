"""The library's own threads (the progress thread, the watchdog's monitor,
the trace writer) are started here, one way: a thread is kept -- recorded
as running -- only once it runs.

An interrupt (a ``KeyboardInterrupt`` from a signal handler, say) can land
inside ``Thread.start``.  Kept before it started, a thread that never ran
would be taken for a running one for the rest of the process: every call
handed to the progress thread, on any communicator, would wait for it.
Here a thread runs its work only once its starter has kept it: an
interrupt before the launch keeps nothing (the next caller starts one), one
after it keeps the thread that runs (lest a second one start), and a thread
kept that never gets to its work ends, which its keeper sees
(``is_alive()``); the interrupt is raised either way.

One of them, the shelter (:func:`sheltered`), runs what must not be
interrupted by a signal handler: the Python function behind a user-defined
``MPI.Op``, which MPI calls back from ``MPI_Reduce_local``.  An exception
there, a ``KeyboardInterrupt`` from a handler included, is one mpi4py cannot
hand back (it ends the job with ``MPI_Abort``).  Python runs signal handlers
on the main thread only, so the main thread hands such a function to the
shelter and waits; an interrupt lands in that wait, and is raised once the
function has returned.  The function so runs on another thread than its
caller's (with a copy of the caller's context variables): a lock the caller
holds is not the function's to take again."""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Callable

from mpi4py import MPI

__all__ = ["start_daemon", "sheltered"]

#: how long an interrupted start waits to learn whether its thread was launched
LAUNCH_SECONDS = 1.0
#: how long a new thread waits for its starter's verdict (given at once,
#: unless an interrupt kept the starter from giving it: then it does nothing)
VERDICT_SECONDS = 60.0


def start_daemon(target: Callable[[], None], name: str,
                 keep: Callable[[threading.Thread], None]) -> None:
    """Start a daemon thread ``name`` that runs ``target`` if, and only if,
    it was handed to ``keep`` (see the module's docstring).

    The new thread waits for its starter's verdict before ``target``: kept
    once it runs (where ``is_alive()`` is true until it ends), or not (an
    interrupt before its launch, or one that kept the starter from seeing
    it run).  However an interrupt falls, a thread that runs ``target`` has
    been kept, and one kept that does not run ends at once: its keeper
    sees it dead (``is_alive()``) and starts another."""
    ran, verdict = threading.Event(), threading.Event()
    kept: list = []

    def run() -> None:
        ran.set()
        verdict.wait(VERDICT_SECONDS)
        if kept:
            target()
    thread = threading.Thread(target=run, name=name, daemon=True)
    launched = False
    try:
        thread.start()
        launched = True
    finally:
        try:
            # (started, it runs however long a loaded machine takes to get
            # to it; interrupted, it may never have been launched)
            if ran.wait(None if launched else LAUNCH_SECONDS):
                keep(thread)
                kept.append(thread)
        finally:
            verdict.set()


#: the shelter's work: [function, args, a lock it releases, [(its error,
#: its result)] once run, whether it ran, the caller's context]
_SHELTER_WORK: queue.SimpleQueue = queue.SimpleQueue()
#: the shelter thread, the last one kept
_SHELTER: list = []
#: how often a waiting caller looks whether its work was taken (a shelter
#: recorded as an interrupt landed may end without running: see start_daemon)
_LOOK_SECONDS = 0.1
#: whether MPI runs threads (``MPI_THREAD_MULTIPLE``), once known
_MULTIPLE: list = []


def _shelter() -> None:
    while True:
        job = _SHELTER_WORK.get()
        function, args, done, outcome, _, context = job
        if function is None:  # (handed over twice: see sheltered)
            continue
        job[0] = None
        try:
            outcome.append((None, context.run(function, *args)))
        except BaseException as exc:  # noqa: BLE001 - the waiter's to raise
            outcome.append((exc, None))
        finally:
            job[4] = True  # (before the release: see sheltered)
            done.release()
            # (nothing of the caller's kept alive until the next job)
            job = function = args = outcome = context = None


def _kept_shelter(thread: threading.Thread) -> None:
    _SHELTER[:] = [thread]


def sheltered(function: Callable, *args):
    """``function(*args)``, run where no signal handler can raise inside
    it (see the module's docstring): on the main thread, by the shelter
    (in a copy of the caller's context: numpy's error state, say) while
    the main thread waits; an interrupt that lands meanwhile is raised once
    the function has returned (the first, where several land; a second
    that lands within the few instructions that take the first in may
    leave before).  Elsewhere, and where MPI runs no threads (below
    ``MPI_THREAD_MULTIPLE``: a signal handler could then call MPI while the
    shelter is inside it), on the calling thread."""
    if not _MULTIPLE:
        _MULTIPLE.append(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    if not _MULTIPLE[0] or threading.current_thread() is not threading.main_thread():
        return function(*args)
    done = threading.Lock()
    done.acquire()
    job = [function, args, done, [], False, contextvars.copy_context()]
    handed, interrupt = False, None
    while True:
        try:  # (an interrupt in here waits for the function too)
            if job[4]:  # (ran: set before the lock's release, so never waited twice)
                break
            if job[0] is not None and not (_SHELTER and _SHELTER[-1].is_alive()):
                start_daemon(_shelter, "mpi_allreduce-shelter", _kept_shelter)
            if not handed:  # (handed over twice where an interrupt lands in
                _SHELTER_WORK.put(job)  # between: the shelter runs it once)
                handed = True
            done.acquire(timeout=_LOOK_SECONDS)
        except BaseException as exc:  # noqa: BLE001 - raised once it has returned
            if interrupt is None:
                interrupt = exc
    error, result = job[3][0]
    if interrupt is not None:
        if error is not None:
            interrupt.__context__ = error
        raise interrupt
    if error is not None:
        raise error
    return result
