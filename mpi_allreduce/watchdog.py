"""The watchdog: a call that waits too long is reported, then raises or aborts.

Ranks that disagree about a call post messages whose tags cannot match
(see :mod:`~mpi_allreduce.spec`), so they wait instead of returning a
wrong result.  The watchdog turns that wait -- or any other, a rank that
never arrives -- into a report on the ranks that wait: which call (kind,
count, dtype, op, algorithm, ranks), on which thread, and which peers its
messages go to and come from.  Then, as configured
(``MPI_ALLREDUCE_WATCHDOG=SECONDS``, 0 = off, default 600;
``MPI_ALLREDUCE_WATCHDOG_ACTION``):

* ``abort`` (default): ``MPI_Abort`` of the whole job, as PyTorch's NCCL
  watchdog does;
* ``raise``: the call raises :class:`~mpi_allreduce.errors.Stalled` on the
  ranks that wait (the engine then polls against a deadline instead of
  blocking in MPI, which costs a little per call); the communicator is
  unusable afterwards (its messages are in disarray), and every later call
  on it raises the same error;
* ``warn``: the report alone, once per stalled call.

Every kind of call is watched the same way: a blocking call through its
communicator's call slot (``Context.what``; a call costs two attribute
stores and an increment, and the report finds the thread from the
threads' frames), a non-blocking or persistent call through its operation
itself, from the moment it starts until it is complete -- whoever waits
for it, from whichever thread, or if nobody does and the caller only polls
``test()``.  One monitor thread samples them all (:data:`WATCH`); in
``raise`` mode the waiting thread checks its own deadline instead, and a
call of the progress thread's that nobody waited for (a request dropped in
flight) is given up there once it is late by twice the limit.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from typing import Optional

from mpi4py import MPI

from . import trace
from .config import environment
from .threads import start_daemon

__all__ = ["WATCH", "Cell", "describe", "report", "settings"]


def settings() -> tuple:
    """(seconds, action) from the environment; seconds 0: off."""
    env = environment()
    return env.watchdog, env.watchdog_action


def describe(kind: str, plan) -> str:
    """What a report says of a call: its shape and its peers (or, for a
    step without a plan, the kind alone)."""
    if plan is None:
        return kind
    schedule = plan.schedule
    peers = sorted({a.peer for r in schedule.rounds for a in r if hasattr(a, "peer")})
    return (f"{kind} of {schedule.count} x {plan.dtype.name}, op {plan.op.name}, "
            f"algorithm {schedule.algorithm} on {schedule.size} ranks (rank "
            f"{schedule.rank} here; its messages go to and come from ranks "
            f"{', '.join(map(str, peers)) or 'none'})")


def report(what: str, waited: float, number: int, thread: str) -> str:
    return (f"mpi_allreduce watchdog: world rank {MPI.COMM_WORLD.Get_rank()} has waited "
            f"{waited:.0f} s in call #{number} of thread {thread!r}: {what}.  The ranks "
            "disagree about the call (count, dtype, op, algorithm, options), or one of the "
            "peers never entered it (check=True names a disagreement)")


class Cell:
    """A thread's blocking call in progress (``what``: (kind, plan), or
    None between calls) and how many it has made."""

    __slots__ = ("what", "count", "thread", "__weakref__")

    def __init__(self, thread: str):
        self.what: Optional[tuple] = None
        self.count = 0
        self.thread = thread

    def snapshot(self) -> tuple:
        return self.count, self.what, self.thread


class _Watch:
    """Everything watched (blocking calls' cells, operations in flight),
    and the monitor thread that samples them."""

    def __init__(self):
        self.items: "weakref.WeakSet" = weakref.WeakSet()
        self._cells: dict = {}  # thread ident -> Cell
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        #: in raise mode, called at each sample (the engine's ``_Engine.sweep``)
        self.sweep = None

    def cell(self) -> Cell:
        """The calling thread's cell (made on its first call)."""
        ident = threading.get_ident()
        cell = self._cells.get(ident)
        if cell is None:
            cell = self._cells[ident] = Cell(threading.current_thread().name)
            self.watch(cell)
        return cell

    def watch(self, item) -> None:
        """Watch ``item`` (a :class:`Cell`, or an operation with
        ``snapshot()``) while it lives; the monitor starts with the first."""
        with self._lock:
            self.items.add(item)
            if self._thread is None or not self._thread.is_alive():  # (threads.start_daemon)
                start_daemon(self._monitor, "mpi_allreduce-watchdog",
                             functools.partial(setattr, self, "_thread"),
                             functools.partial(getattr, self, "_thread"))

    def _monitor(self) -> None:
        seen: dict = {}  # id(item) -> (snapshot, since, reported)
        while True:
            seconds, action = settings()
            time.sleep(min(1.0, seconds / 4) if seconds > 0 else 1.0)
            if seconds <= 0 or action == "raise":
                seen.clear()  # (in raise mode each waiting thread keeps its own deadline)
                if seconds > 0 and self.sweep is not None:
                    self.sweep()  # (and the progress thread those of calls nobody waits for)
                continue
            now = time.monotonic()
            with self._lock:  # (no strong reference to an item outlives its snapshot)
                snaps = [(id(item), item.snapshot(), weakref.ref(item)) for item in self.items]
            present = {key for key, _, _ in snaps}
            seen = {key: value for key, value in seen.items() if key in present}
            for key, snap, ref in snaps:
                if snap[1] is None:
                    seen.pop(key, None)
                    continue
                old = seen.get(key)
                if old is None or old[0] != snap:
                    seen[key] = (snap, now, False)
                    continue
                if now - old[1] < seconds or old[2]:
                    continue
                seen[key] = (snap, old[1], True)
                self._act(action, snap, now - old[1], ref())

    @staticmethod
    def _act(action: str, snap: tuple, waited: float, item) -> None:
        count, (kind, plan), thread = snap
        if thread == "any":  # (an operation's: whichever thread advances it)
            thread = _thread_of(item)
        thread = thread or _thread_in(item)
        sys.stderr.write(report(describe(kind, plan), waited, count, thread) + "\n")
        sys.stderr.flush()
        if action == "abort":
            sys.stderr.write("mpi_allreduce watchdog: aborting the job "
                             "(MPI_ALLREDUCE_WATCHDOG_ACTION=raise or warn to keep it)\n")
            sys.stderr.flush()
            trace.flush()  # (the trace files then show everything until here)
            MPI.COMM_WORLD.Abort(2)


def _thread_of(op) -> str:
    """The thread that advances ``op`` (a non-blocking or persistent call),
    named when a report is written."""
    if op is None:  # (gone as the report is written)
        return "?"
    if getattr(op, "threaded", False) or not getattr(op, "owner", 0):
        return "the progress thread"
    names = {t.ident: t.name for t in threading.enumerate()}
    return names.get(op.owner, f"{op.owner} (ended)")


def _thread_in(item) -> str:
    """The thread whose blocking call has ``item`` (a communicator's
    context) as its ``context``: found from the threads' frames when a
    report is written, so a call need not record its thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code.co_name in ("guarded_run", "deadline_run") and \
                    frame.f_locals.get("context") is item:
                return names.get(ident, str(ident))
            frame = frame.f_back
    return "?"


WATCH = _Watch()
