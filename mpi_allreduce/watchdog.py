"""The watchdog: a call that waits too long is reported, then raises or aborts.

Ranks that disagree about a call (count, dtype, op, algorithm; a count of
0 on some ranks) post messages whose tags cannot match (see
:class:`~mpi_allreduce.executor.Plan`), so they wait instead of returning a
wrong result.  The watchdog turns that wait -- or any other, a rank that
never arrives -- into a report on the ranks that wait: which call (its
number in this process, count, dtype, op, algorithm, ranks) and which
peers its messages go to and come from.  Then, as configured
(``MPI_ALLREDUCE_WATCHDOG=SECONDS``, 0 = off, default 600;
``MPI_ALLREDUCE_WATCHDOG_ACTION``):

* ``abort`` (default): ``MPI_Abort`` of the whole job, as PyTorch's NCCL
  watchdog does.  A monitor thread watches a call counter; a call costs
  two attribute stores and an increment.
* ``raise``: the call raises :class:`Stalled` on the ranks that wait.
  Calls then progress by polling (``MPI_Testall``) against a deadline
  instead of blocking in MPI, which costs a little per call; the
  communicator is unusable afterwards (its messages are in disarray), and
  every later call on it raises the same error.
* ``warn``: the report alone, once per stalled call; the call goes on
  waiting.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from mpi4py import MPI

from .config import environment

__all__ = ["Stalled", "WATCH", "describe", "settings"]


class Stalled(RuntimeError):
    """A call waited longer than the watchdog allows (action ``raise``)."""


def settings() -> tuple:
    """(seconds, action) from the environment; seconds 0: off."""
    env = environment()
    return env.watchdog, env.watchdog_action


def describe(kind: str, plan) -> str:
    """What a report says of a call: its shape and its peers."""
    schedule = plan.schedule
    peers = sorted({a.peer for r in schedule.rounds for a in r if hasattr(a, "peer")})
    return (f"{kind} of {schedule.count} x {plan.dtype.name}, op {plan.op.name}, "
            f"algorithm {schedule.algorithm} on {schedule.size} ranks (rank "
            f"{schedule.rank} here; its messages go to and come from ranks "
            f"{', '.join(map(str, peers)) or 'none'})")


def report(what: str, waited: float, number: int) -> str:
    return (f"mpi_allreduce watchdog: world rank {MPI.COMM_WORLD.Get_rank()} has waited "
            f"{waited:.0f} s in call #{number} of this process: {what}.  The ranks disagree "
            "about the call (count, dtype, op, algorithm), or one of the peers never entered "
            "it (check=True names a disagreement)")


class _Watch:
    """The call in progress (``current``: its description, or None) and a
    count of calls, sampled by the monitor thread."""

    def __init__(self):
        self.current: Optional[tuple] = None  # (kind, plan) of the call in progress
        self.calls = 0
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def ensure_monitor(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._monitor, daemon=True,
                                                name="mpi_allreduce-watchdog")
                self._thread.start()

    def _monitor(self) -> None:
        seen, since, reported = None, time.monotonic(), False
        while True:
            seconds, action = settings()
            time.sleep(min(1.0, seconds / 4) if seconds > 0 else 1.0)
            if seconds <= 0 or action == "raise":
                continue
            snapshot = (self.calls, self.current)
            now = time.monotonic()
            if snapshot[1] is None or snapshot != seen:
                seen, since, reported = snapshot, now, False
                continue
            if now - since < seconds or reported:
                continue
            reported = True
            sys.stderr.write(report(describe(*snapshot[1]), now - since, snapshot[0]) + "\n")
            sys.stderr.flush()
            if action == "abort":
                sys.stderr.write("mpi_allreduce watchdog: aborting the job "
                                 "(MPI_ALLREDUCE_WATCHDOG_ACTION=raise or warn to keep it)\n")
                sys.stderr.flush()
                MPI.COMM_WORLD.Abort(2)


WATCH = _Watch()


def watched(run, context, kind: str, bound):
    """``run`` under the watchdog, as configured (``run`` itself when off)."""
    seconds, action = settings()
    if seconds <= 0:
        return run
    what = (kind, bound.plan)
    if action == "raise":
        from .progress import Operation  # (progress imports the executor only)

        op = Operation(bound.stages, bound.plan, bound.plan.tag, "wd", False)
        return lambda: run_with_deadline(op, context, what, seconds)
    WATCH.ensure_monitor()
    watch = WATCH

    def watched_run():
        watch.current = what
        watch.calls += 1
        try:
            run()
        finally:
            watch.current = None
    return watched_run


def run_with_deadline(stages_op, context, what: tuple, seconds: float) -> None:
    """Run an operation by polling until it is done or ``seconds`` pass
    without completing it (then the communicator is marked unusable)."""
    if context.broken is not None:
        raise Stalled(context.broken)
    WATCH.calls += 1
    stages_op.begin()
    deadline = time.monotonic() + seconds
    spins = 0
    while not stages_op.advance(False):
        spins += 1
        if spins & 0xFF == 0 and time.monotonic() > deadline:
            stages_op.abandon()
            text = report(describe(*what), seconds, WATCH.calls)
            context.broken = ("an earlier call on this communicator stalled, its messages "
                              "are in disarray: " + text)
            raise Stalled(text)
    if stages_op.error is not None:
        error, stages_op.error = stages_op.error, None
        raise error
