"""``auto`` measured: for long vectors, try the candidates on the live call and keep the fastest.

A decision table is a guess made on another day: which algorithm wins at a
given size also depends on things a table cannot see -- whether the data
was just written (fresh pages cost more to read across processes), the
placement of the buffers, what else runs on the node.  So for vectors of
:data:`TRIAL_MIN_BYTES` or more, ``auto`` spends its first calls on a
*trial*:

    call        0      1      2      3      4      5     ...  rounds*k-1
    runs        c0     c1     c2     c3     c4     c0    ...  c4
                `-------- round 1 ---------'  `--- round 2 ...

c0 is the table's choice, c1.. the other flat algorithms.  Each call is a
complete, correct all-reduce; only its time is recorded (the best of the
rounds, so the first call's page faults do not count).  After the last
trial call the ranks agree on the slowest rank's time per candidate (one
small ``Allreduce`` of the timings, the only collective here, and not on
the data) and every rank keeps the same winner: the table's choice unless
another candidate is more than :data:`MARGIN` faster.  The decision is
remembered per plan key (count, dtype, op, segment, ...) on the
communicator, so later calls with other buffer objects of that shape run
the winner at once.

Every rank must make the same calls in the same order (as for any MPI
collective), so every rank is in the same trial call: the schedule needs no
messages.  ``MPI_ALLREDUCE_AUTO_TRIALS=0`` turns trials off (``auto`` is
then the table alone, reproducible from run to run); naming an algorithm
always does.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["Trial", "decide", "TRIAL_MIN_BYTES", "DEFAULT_ROUNDS", "MARGIN"]

#: vectors this long and longer are measured (below, the table decides:
#: latency-bound calls are too short to time one by one)
TRIAL_MIN_BYTES = 64 * 1024
#: calls per candidate, the best one counts
DEFAULT_ROUNDS = 3
#: another candidate must beat the table's choice by this fraction
MARGIN = 0.05


def decide(names: Sequence[str], seconds: Sequence[float], margin: float = MARGIN) -> str:
    """The winner: ``names[0]`` (the table's choice) unless the fastest of
    the others beats it by more than ``margin``."""
    if len(names) != len(seconds) or not names:
        raise ValueError(f"need one time per candidate, got {len(names)} names and "
                         f"{len(seconds)} times")
    fastest = int(np.argmin(seconds))
    if seconds[fastest] < seconds[0] * (1.0 - margin):
        return names[fastest]
    return names[0]


def _elapsed(runner: Callable, send, recv, backend) -> float:
    """Seconds one call of ``runner`` takes on this rank (the device drained)."""
    start = MPI.Wtime()
    runner(send, recv)
    if backend.device:
        backend.synchronize()
    return MPI.Wtime() - start


class Trial:
    """The runner ``auto`` gets for a long vector until its trial is over.

    ``candidates`` are algorithm names, the table's choice first;
    ``runner_for(name)`` builds (or finds) that algorithm's runner for this
    plan, lazily, so a call shape seen once costs no more than the table's
    choice.  ``decided(name)`` is called once, with the winner.
    """

    def __init__(self, comm: MPI.Intracomm, candidates: Sequence[str],
                 runner_for: Callable[[str], Callable], backend, rounds: int,
                 decided: Callable[[str], None]):
        if rounds < 1:
            raise ValueError(f"a trial needs at least one round, got {rounds}")
        self.comm, self.names, self.backend = comm, tuple(candidates), backend
        self.runner_for, self.rounds, self.decided = runner_for, rounds, decided
        self.best = np.full(len(self.names), np.inf)
        self.calls = 0
        self.chosen: Optional[str] = None
        self.runner: Optional[Callable] = None

    def __call__(self, send, recv) -> None:
        if self.runner is not None:
            self.runner(send, recv)
            return
        which = self.calls % len(self.names)
        seconds = _elapsed(self.runner_for(self.names[which]), send, recv, self.backend)
        self.best[which] = min(self.best[which], seconds)
        self.calls += 1
        if self.calls == self.rounds * len(self.names):
            self._finish()

    def _finish(self) -> None:
        slowest = np.empty_like(self.best)
        self.comm.Allreduce(self.best, slowest, MPI.MAX)
        self.seconds = dict(zip(self.names, slowest.tolist()))
        self.chosen = decide(self.names, slowest)
        self.runner = self.runner_for(self.chosen)
        self.runner_for = None  # the losers' runners (and scratch) may go
        self.decided(self.chosen)
