"""``auto`` measured: try the candidates on the live call and keep the fastest.

A decision table is a guess made on another day: which algorithm wins at a
given size also depends on things a table cannot see -- whether the data
was just written (fresh pages cost more to read across processes), the
placement of the buffers, what else runs on the node, and on a busy node
an algorithm's time can switch between two levels from one second to the
next.  So ``auto`` spends its first calls of each shape on a *trial*:
blocks of consecutive calls of one candidate, round robin over the
candidates, ``rounds`` times:

    block       0          1          2     ...  k-1        k          ...
    runs        c0 c0 c0   c1 c1 c1   c2 ...     c4 c4 c4   c0 c0 c0   ...
    timed       -  x  x    -  x  x    -  ...     -  x  x    -  x  x

c0 is the table's choice, c1.. the other flat algorithms.  Every call is a
complete, correct all-reduce.  The first call of a block is not timed: it
absorbs the switch from the previous candidate (its stragglers, its cache
footprint, a first call's page faults); the others are timed back to back
as a loop runs them (:func:`block_length`: blocks are longer for shorter,
noisier calls, up to 16 timed).  After the last block the ranks take, for
every timed call, its slowest rank (one small ``Allreduce`` of the timings,
the only collective here, and not on the data), and every rank keeps the
same winner by the mean of those without the highest and lowest tenth (the
mean, because a loop pays the mean; trimmed, because one preempted call
must not decide): the table's choice unless another candidate is more than
:data:`MARGIN` faster.  Eight rounds spread the trial over time, so that
a candidate is seen at both levels if it switches.  The decision is
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

__all__ = ["Trial", "decide", "block_length", "trial_length", "DEFAULT_ROUNDS", "MARGIN"]

#: blocks per candidate (MPI_ALLREDUCE_AUTO_TRIALS)
DEFAULT_ROUNDS = 8
#: the fraction of the slowest and of the fastest calls a candidate's time leaves out
TRIM = 0.1
#: a block times calls that move about this many bytes together (2 to 16 calls)
BLOCK_BYTES = 1 << 20
#: another candidate must beat the table's choice by this fraction: a trial
#: is a guard against the table being far off on the day, not a tie-breaker
#: between algorithms within the noise of each other (which would flip
#: from run to run, and at times to one only lucky in the trial)
MARGIN = 0.2


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


def block_length(nbytes: int) -> int:
    """Calls in one block for a vector of ``nbytes``: one untimed, then 2 to 16 timed."""
    return 1 + max(2, min(16, BLOCK_BYTES // max(nbytes, 1)))


def trial_length(nbytes: int, rounds: int, candidates: int) -> int:
    """Calls a trial takes (the same on every rank)."""
    return rounds * candidates * block_length(nbytes)


def trimmed_mean(samples: np.ndarray, trim: float) -> np.ndarray:
    """Per column, the mean without the ``trim`` fraction of highest and of lowest values."""
    cut = int(samples.shape[0] * trim)
    ordered = np.sort(samples, axis=0)
    return ordered[cut:samples.shape[0] - cut].mean(axis=0)


def _elapsed(runner: Callable, send, recv, backend) -> float:
    """Seconds one call of ``runner`` takes on this rank (the device drained)."""
    start = MPI.Wtime()
    runner(send, recv)
    if backend.device:
        backend.synchronize()
    return MPI.Wtime() - start


class Trial:
    """The runner ``auto`` gets for a call shape until its trial is over.

    ``candidates`` are algorithm names, the table's choice first;
    ``runner_for(name)`` builds (or finds) that algorithm's runner for this
    plan, lazily, so a call shape seen once costs no more than the table's
    choice.  ``decided(name)`` is called once, with the winner.
    """

    def __init__(self, comm: MPI.Intracomm, candidates: Sequence[str],
                 runner_for: Callable[[str], Callable], backend, rounds: int, block: int,
                 decided: Callable[[str], None]):
        if rounds < 1 or block < 2:
            raise ValueError(f"a trial needs a round of blocks of 2 calls or more, got "
                             f"{rounds} rounds of {block}")
        self.comm, self.names, self.backend = comm, tuple(candidates), backend
        self.runner_for, self.decided, self.block = runner_for, decided, block
        self.times = np.empty((rounds * (block - 1), len(self.names)))
        self.calls, self.length = 0, rounds * len(self.names) * block
        self.runner: Optional[Callable] = None  # the winner's, once decided
        self.holders: list = []

    def adopt(self, holder) -> None:
        """``holder.runner`` is this trial; set it to the winner once there is one
        (so a kept call runs the winner without this trial in between)."""
        if self.runner is None:
            self.holders.append(holder)
        else:
            holder.runner = self.runner

    def __call__(self, send, recv) -> None:
        if self.runner is not None:
            self.runner(send, recv)
            return
        blocks, position = divmod(self.calls, self.block)
        round_, which = divmod(blocks, len(self.names))
        runner = self.runner_for(self.names[which])
        if position == 0:
            runner(send, recv)
        else:
            self.times[round_ * (self.block - 1) + position - 1, which] = _elapsed(
                runner, send, recv, self.backend)
        self.calls += 1
        if self.calls == self.length:
            self._finish()

    def _finish(self) -> None:
        slowest = np.empty_like(self.times)
        self.comm.Allreduce(self.times, slowest, MPI.MAX)
        chosen = decide(self.names, trimmed_mean(slowest, TRIM))
        self.runner = self.runner_for(chosen)
        self.runner_for = None  # the losers' runners (and scratch) may go
        for holder in self.holders:
            holder.runner = self.runner
        self.holders.clear()
        self.decided(chosen)
