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
not of the data; each audit of the watch below takes one more), and every
rank keeps the same winner by the mean of those without the highest and
lowest tenth (the mean, because a loop pays the mean; trimmed, because one
preempted call must not decide): the table's choice unless another
candidate is more than :data:`MARGIN` faster (:data:`WATCH_MARGIN` where a
watch follows).  Eight rounds spread the trial over time, so that a
candidate is seen at both levels if it switches.  The decision is
remembered per plan key (count, dtype, op, segment, ...) on the
communicator, so later calls with other buffer objects of that shape run
the winner at once.

On a busy node the winner of the moment is not the winner of the next
minute, so for vectors of :data:`WATCH_MIN_BYTES` and more the trial hands
over to a :class:`Watch`: the winner runs, and now and then one *audit*
times a block of the winner against a block of one other candidate, side
by side:

    calls       w w w ... w   w  w  w   c  c  c   w w w ... w   w  w  w   c' ...
    timed                     x  x  x   -  x  x                 x  x  x   -  ...
                plain calls   an audit of c       plain calls   an audit of c'

Each candidate keeps a running ratio of its time to the winner's (the
trial's ratio first, then each audit weighted :data:`AUDIT_WEIGHT`); when
one is more than :data:`WATCH_MARGIN` faster, it becomes the winner.  The
candidates are audited in turn, except that one faster than the winner in
its audit is audited again next (:data:`AGAIN` times in a row at most), so
that a change is followed within a few audits.  The plain calls after an
audit take as long as make the candidate's block the share
:data:`AUDIT_SHARE` of the time (so audits cost at most that share, and a
slow candidate is seen seldom in calls).  The candidates share one plan,
so the scratch of a watched shape is the largest candidate's (two
segments at most), not their sum.

Every rank must make the same calls in the same order (as for any MPI
collective), so every rank is in the same trial call: the schedule needs no
messages, and the watch's decisions come from the same agreed timings on
every rank.  ``MPI_ALLREDUCE_AUTO_TRIALS=0`` turns trials (and the watch)
off (``auto`` is then the table alone, reproducible from run to run);
naming an algorithm always does.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .algorithms import entry

__all__ = ["Trial", "Watch", "decide", "block_length", "trial_length", "watched",
           "DEFAULT_ROUNDS", "MARGIN"]

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
#: vectors from this many bytes are watched after their trial: below it a
#: call is latency, the candidates' order follows their message counts and
#: does not change with the day, and an audit would cost without paying back
WATCH_MIN_BYTES = 16 << 10
#: the watch moves to a candidate whose running ratio is below 1 - this
WATCH_MARGIN = 0.05
#: a candidate faster than the winner in its audit is audited again next
#: (not after a round of the others), up to this many times in a row: a
#: real change is followed within a few audits, and a candidate that is
#: only a little faster, within the margin, does not keep the others unseen
AGAIN = 3
#: the weight of one audit in a candidate's running ratio
AUDIT_WEIGHT = 0.25
#: the share of a watched shape's time its audits' candidate blocks may take
AUDIT_SHARE = 0.02


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


def watched(nbytes: int) -> bool:
    """Whether ``auto`` keeps watching a vector of ``nbytes`` after its trial."""
    return nbytes >= WATCH_MIN_BYTES


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
    choice.  ``decided(name)`` is called once, with the winner.  Once
    decided, ``runner`` is the winner's runner, or (``watch=True``) the
    :class:`Watch` that keeps measuring it.
    """

    def __init__(self, comm: MPI.Intracomm, candidates: Sequence[str],
                 runner_for: Callable[[str], Callable], backend, rounds: int, block: int,
                 decided: Callable[[str], None], watch: bool = False):
        if rounds < 1 or block < 2:
            raise ValueError(f"a trial needs a round of blocks of 2 calls or more, got "
                             f"{rounds} rounds of {block}")
        self.comm, self.names, self.backend = comm, tuple(candidates), backend
        self.runner_for, self.decided, self.block = runner_for, decided, block
        self.watch = watch
        self.times = np.empty((rounds * (block - 1), len(self.names)))
        self.calls, self.length = 0, rounds * len(self.names) * block
        self.runner: Optional[Callable] = None  # the winner's, once decided
        self.holders: list = []

    @property
    def winner(self) -> Optional[str]:
        """What ``auto`` runs for this shape: None during the trial, then its
        winner, or the algorithm its watch has moved to since."""
        runner = self.runner
        if runner is None:
            return None
        return runner.current if isinstance(runner, Watch) else runner.name

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
        seconds = trimmed_mean(slowest, TRIM)
        # watched, the trial need not guard the table: the watch follows up
        chosen = decide(self.names, seconds, WATCH_MARGIN if self.watch else MARGIN)
        if self.watch:
            self.runner = Watch(self.comm, {n: self.runner_for(n) for n in self.names},
                                seconds, chosen, self.backend, self.block)
        else:
            self.runner = self.runner_for(chosen)
        self.runner_for = None  # unwatched, the losers' runners (and scratch) may go
        for holder in self.holders:
            holder.runner = self.runner
        self.holders.clear()
        self.decided(chosen)


class Watch:
    """``auto`` after its trial, for a watched shape: the winner runs, with
    an audit of one other candidate now and then (see the module docstring).

    ``runners`` maps every candidate to its runner, ``seconds`` are their
    times in the trial (same order), ``current`` the trial's winner.
    """

    def __init__(self, comm: MPI.Intracomm, runners: dict, seconds: Sequence[float],
                 current: str, backend, block: int):
        self.comm, self.runners, self.backend = comm, runners, backend
        self.names = tuple(runners)
        base = _positive(seconds[self.names.index(current)])
        #: log(time of the candidate / time of the current winner); 0 for the winner
        self.ratio = {n: math.log(_positive(s) / base) for n, s in zip(self.names, seconds)}
        self._follow(current)
        self.timed = block - 1
        self.times = np.empty((2, self.timed))  # the winner's row, the candidate's
        self.slowest = np.empty_like(self.times)
        self.turn = 0
        self.again = 0  # audits in a row of the present candidate beyond its turn
        self.moves = 0
        self._schedule()

    def run(self, send, recv) -> None:
        """One call: the winner's, or the next of an audit.  A plain call is
        this method and the winner's bare ``run``, nothing else (a short
        vector's call is a few microseconds)."""
        if self.plain:
            self.plain -= 1
            self.winner(send, recv)
        else:
            self._audit(send, recv)

    __call__ = run

    def _follow(self, name: str) -> None:
        """Make ``name`` the winner: its runner (timed in audits) and what a
        plain call runs, its bare ``run`` where it has one."""
        self.current, self.runner = name, self.runners[name]
        self.winner = entry(self.runner)

    def _schedule(self, audited: float = 0.0, again: bool = False) -> None:
        """The next candidate -- the same one ``again``, else the next in
        turn -- and the plain calls before its audit: enough that the last
        audit's candidate block, ``audited`` calls of the winner long, is
        :data:`AUDIT_SHARE` of the time (a block at least)."""
        self.again = self.again + 1 if again else 0
        while not again:
            self.candidate = self.names[self.turn % len(self.names)]
            self.turn += 1
            if self.candidate != self.current:
                break
        self.plain = max(self.timed + 1, math.ceil(audited / AUDIT_SHARE))
        self.position = 0

    def _audit(self, send, recv) -> None:
        position, timed = self.position, self.timed
        self.position += 1
        if position < timed:
            self.times[0, position] = _elapsed(self.runner, send, recv, self.backend)
        elif position == timed:  # the candidate's first call absorbs the switch: untimed
            self.runners[self.candidate](send, recv)
        else:
            self.times[1, position - timed - 1] = _elapsed(self.runners[self.candidate], send,
                                                           recv, self.backend)
            if position == 2 * timed:
                self._judge()

    def _judge(self) -> None:
        self.comm.Allreduce(self.times, self.slowest, MPI.MAX)
        current, candidate = trimmed_mean(self.slowest.T, TRIM)
        current, candidate = _positive(current), _positive(candidate)
        name, seen = self.candidate, math.log(candidate / current)
        self.ratio[name] += AUDIT_WEIGHT * (seen - self.ratio[name])
        audited = (self.timed + 1) * candidate / current
        if self.ratio[name] < math.log(1.0 - WATCH_MARGIN):
            shift = self.ratio[name]
            for other in self.names:
                self.ratio[other] -= shift
            self._follow(name)
            self.moves += 1
            self._schedule(audited)
        else:
            self._schedule(audited, again=seen < 0.0 and self.again < AGAIN)


def _positive(seconds: float) -> float:
    """A time to take a ratio of (a timer may read 0 for a very short call)."""
    return max(float(seconds), 1e-9)
