"""The library's own threads (the progress thread, the watchdog's monitor,
the trace writer, the shelter below) are started here, one way: a thread
records itself as running, on its own thread, before its work.

An interrupt (a ``KeyboardInterrupt`` from a signal handler, say) can land
anywhere in the thread that starts one -- inside ``Thread.start``, or
between a record and the next statement -- but never in the new thread:
Python runs signal handlers on the main thread only.  So the new thread
keeps itself (``keep``), and runs its work, unless a live thread of its kind
is recorded already (``recorded()``: two starters, or one an interrupt
stopped and the next caller, start one worker between them); the record
and the work cannot be parted by an interrupt.  Interrupted before the
launch, nothing is started (the next caller starts one); after it, the
thread runs; the interrupt is raised either way.

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
from typing import Callable, Optional

from mpi4py import MPI

__all__ = ["start_daemon", "sheltered"]

#: orders the new threads' look at what is recorded and their record
_KEEPING = threading.Lock()


def start_daemon(target: Callable[[], None], name: str,
                 keep: Callable[[threading.Thread], None],
                 recorded: Callable[[], Optional[threading.Thread]]) -> None:
    """Start a daemon thread ``name`` that, unless ``recorded()`` is
    another live thread, records itself (``keep(thread)``) and runs
    ``target``; return once it has decided (see the module's docstring)."""
    decided = threading.Event()

    def run() -> None:
        me = threading.current_thread()
        try:
            with _KEEPING:
                other = recorded()
                if other is not None and other is not me and other.is_alive():
                    return  # (one runs already)
                keep(me)
        finally:
            decided.set()
        target()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    decided.wait()


#: the shelter's work: [function, args, a lock it releases, [(its error,
#: its result)] once run, whether it ran, the caller's context]
_SHELTER_WORK: queue.SimpleQueue = queue.SimpleQueue()
#: the shelter thread, the last one kept
_SHELTER: list = []
#: how often a waiting caller looks whether its work was taken (by a
#: shelter still alive: one may have ended)
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


def _recorded_shelter() -> Optional[threading.Thread]:
    return _SHELTER[-1] if _SHELTER else None


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
                start_daemon(_shelter, "mpi_allreduce-shelter", _kept_shelter,
                             _recorded_shelter)
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
