"""``auto`` measured: for long vectors, try the candidates on the live call and keep the fastest.

A decision table is a guess made on another day: which algorithm wins at a
given size also depends on things a table cannot see -- whether the data
was just written (fresh pages cost more to read across processes), the
placement of the buffers, what else runs on the node.  So for vectors of
:data:`TRIAL_MIN_BYTES` or more, ``auto`` spends its first calls of each
shape on a *trial*, round robin over the candidates:

    call        0    1    2    3    4    5    6   ...   n*k-1
    runs        c0   c1   c2   c3   c4   c0   c1  ...   c4

c0 is the table's choice, c1.. the other flat algorithms; each runs ``n``
times (:func:`samples_per_candidate`: ``rounds`` for long vectors, up to 8x
that for shorter, noisier ones).  Every trial call is a complete, correct
all-reduce that starts with a Barrier, so that all ranks start together and
no candidate pays for the previous one's stragglers.  A candidate's time
on a rank is the median of its calls (the first call's page faults and a
lucky call both fall outside it).  After the last trial call the ranks
agree on the slowest rank's time per candidate (one small ``Allreduce`` of
the timings; it and the barriers are the only collectives here, and neither
touches the data) and every rank keeps the same winner: the table's choice
unless another candidate is more than :data:`MARGIN` faster.  The decision is
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

__all__ = ["Trial", "decide", "samples_per_candidate", "TRIAL_MIN_BYTES", "DEFAULT_ROUNDS",
           "MARGIN"]

#: vectors this long and longer are measured (below, the table decides:
#: latency-bound calls are too short to time one by one)
TRIAL_MIN_BYTES = 64 * 1024
#: calls per candidate for long vectors (MPI_ALLREDUCE_AUTO_TRIALS)
DEFAULT_ROUNDS = 3
#: shorter vectors than this take more calls per candidate (up to 8x)
LONG_BYTES = 512 * 1024
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


def samples_per_candidate(nbytes: int, rounds: int) -> int:
    """Trial calls of each candidate for a vector of ``nbytes`` (the same on every rank)."""
    return rounds * max(1, min(8, LONG_BYTES // max(nbytes, 1)))


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
    choice.  Each runs ``samples`` times; ``decided(name)`` is called once,
    with the winner.
    """

    def __init__(self, comm: MPI.Intracomm, candidates: Sequence[str],
                 runner_for: Callable[[str], Callable], backend, samples: int,
                 decided: Callable[[str], None]):
        if samples < 1:
            raise ValueError(f"a trial needs at least one call per candidate, got {samples}")
        self.comm, self.names, self.backend = comm, tuple(candidates), backend
        self.runner_for, self.decided = runner_for, decided
        self.times = np.empty((samples, len(self.names)))
        self.calls = 0
        self.chosen: Optional[str] = None
        self.runner: Optional[Callable] = None

    def __call__(self, send, recv) -> None:
        if self.runner is not None:
            self.runner(send, recv)
            return
        sample, which = divmod(self.calls, len(self.names))
        self.comm.Barrier()
        self.times[sample, which] = _elapsed(self.runner_for(self.names[which]), send, recv,
                                             self.backend)
        self.calls += 1
        if self.calls == self.times.size:
            self._finish()

    def _finish(self) -> None:
        slowest = np.empty(len(self.names))
        self.comm.Allreduce(np.median(self.times, axis=0), slowest, MPI.MAX)
        self.seconds = dict(zip(self.names, slowest.tolist()))
        self.chosen = decide(self.names, slowest)
        self.runner = self.runner_for(self.chosen)
        self.runner_for = None  # the losers' runners (and scratch) may go
        self.decided(self.chosen)
