"""``auto``: the trial of the candidates and the watch after it
(mpi_allreduce/trial.py).

Trials and decisions last as long as the communicator, and the
sub-communicators of conftest.py live for the whole session, so each test
here runs on its own duplicate of one: no trial of another test's calls is
under way on it."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config, registry, trial
from mpi_allreduce.plan import context_for

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm(comm):
    fresh = comm.Dup()
    yield fresh
    fresh.Free()

#: float64 elements: 64 KiB and a bit (a prime number of them)
LONG = 8209


def trial_calls(count, rounds=trial.DEFAULT_ROUNDS):
    return trial.trial_length(count * 8, rounds, len(registry.FLAT_ALGORITHMS))


@pytest.fixture
def unwatched(monkeypatch):
    """No vector is long enough for the watch: the trial decides once."""
    monkeypatch.setattr(trial, "WATCH_MIN_BYTES", 1 << 62)


def watch_of(comm, count):
    """The watch ``auto`` runs for ``count`` elements (None before or without one)."""
    for key, runner in context_for(comm).plans.items():
        if key[0] == count and key[3] == "auto" and isinstance(runner.runner, trial.Watch):
            return runner.runner
    return None


def timed_in_trial(count):
    """Calls of a trial that are timed (every block's first is not)."""
    block = trial.block_length(count * 8)
    return trial_calls(count) // block * (block - 1)


def plan_names(comm, count):
    return sorted(key[3] for key in context_for(comm).plans if key[0] == count)


def decision(comm, count):
    return [trial.winner for key, trial in context_for(comm).plans.items()
            if key[0] == count and key[3] == "auto" and trial.winner is not None]


def call_and_check(comm, count, step, in_place=False):
    size, rank = comm.Get_size(), comm.Get_rank()
    values = np.arange(count, dtype=np.float64) % 97 * (rank + 1) + step
    recv = values.copy() if in_place else np.empty(count)
    mar.allreduce(MPI.IN_PLACE if in_place else values, recv, comm=comm)
    np.testing.assert_array_equal(recv, np.arange(count) % 97 * size * (size + 1) / 2
                                  + step * size)


@pytest.fixture
def trials(monkeypatch):
    """Set MPI_ALLREDUCE_AUTO_TRIALS for one test."""
    def set_(rounds):
        monkeypatch.setenv(config.AUTO_TRIALS_ENV, str(rounds))
        config.refresh()
    yield set_
    monkeypatch.delenv(config.AUTO_TRIALS_ENV, raising=False)
    config.refresh()


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
def test_every_trial_call_is_right_and_every_rank_keeps_the_same_winner(comm, in_place):
    count = LONG + (1 if in_place else 0)
    for step in range(trial_calls(count) + 2):  # new buffers each call: the decision is by shape
        call_and_check(comm, count, step, in_place)
    if comm.Get_size() == 1:
        assert decision(comm, count) == []  # nothing to measure on one rank
        return
    (winner,) = decision(comm, count)
    assert winner in registry.FLAT_ALGORITHMS
    assert len(set(comm.allgather(winner))) == 1
    # the candidates live on in the watch, on one plan (one scratch), not in the cache
    watch = watch_of(comm, count)
    assert watch.current == winner and sorted(watch.runners) == sorted(registry.FLAT_ALGORITHMS)
    assert len({id(r.plan) for r in watch.runners.values()}) == 1
    assert plan_names(comm, count) == ["auto"]


def test_a_watched_shape_holds_one_candidates_scratch(comm):
    """The watch's candidates share one plan of their own, even where named
    algorithms of that shape are cached already: its scratch is the largest
    candidate's (here one vector: two half-blocks of the pipelined ring on
    2 ranks, two segments if that were less), not their sum."""
    from mpi_allreduce.bench import plans_of

    count = LONG + 8
    for name in registry.FLAT_ALGORITHMS:
        mar.allreduce(np.ones(count), comm=comm, algorithm=name)
    for step in range(trial_calls(count) + 1):
        call_and_check(comm, count, step)
    if comm.Get_size() > 1:
        (plan,) = plans_of(watch_of(comm, count))
        assert plan.scratch_bytes == (count + 1) * 8  # one vector (and an element)
        buffer = plan.scratch("incoming", count + 1)
        for runner in watch_of(comm, count).runners.values():
            views = [getattr(runner, "incoming", None)] + list(getattr(runner, "halves", ()))
            assert all(np.shares_memory(v, buffer) for v in views if v is not None)
        named = [r.plan for k, r in context_for(comm).plans.items()
                 if k[0] == count and k[3] != "auto"]
        assert len(named) == len(registry.FLAT_ALGORITHMS) and plan not in named


def test_unwatched_the_losers_go_and_the_winner_is_cached(comm, unwatched):
    count = LONG + 9
    for step in range(trial_calls(count) + 2):
        call_and_check(comm, count, step)
    if comm.Get_size() > 1:
        (winner,) = decision(comm, count)
        assert watch_of(comm, count) is None
        assert plan_names(comm, count) == sorted({"auto", winner})


def test_the_winner_is_fastest_on_the_slowest_rank(comm, monkeypatch):
    """Candidates are timed on every rank and compared by their slowest rank:
    the driver, fastest on every rank but the last, must lose to the
    pipelined ring, which is fastest everywhere else."""
    count = LONG + 2
    last = comm.Get_size() - 1

    def fake_elapsed(runner, send, recv, backend):
        runner(send, recv)  # still a real all-reduce, so results stay right
        if runner.name == "driver":
            return 10.0 if comm.Get_rank() == last else 0.1
        return 0.5 if runner.name == "ring_pipelined" else 1.0

    monkeypatch.setattr(trial, "_elapsed", fake_elapsed)
    for step in range(trial_calls(count)):
        call_and_check(comm, count, step)
    if comm.Get_size() > 1:
        assert decision(comm, count) == ["ring_pipelined"]


def test_trials_turned_off_leave_auto_to_the_table(comm, trials):
    count = LONG + 3
    trials(0)
    for step in range(trial_calls(count)):
        call_and_check(comm, count, step)
    assert decision(comm, count) == []
    if comm.Get_size() > 1:
        context = context_for(comm)
        assert plan_names(comm, count) == [registry.choose(
            count * 8, comm.Get_size(), oversubscribed=context.oversubscribed)]


def test_fewer_rounds_decide_sooner(comm, trials):
    count = LONG + 4
    trials(1)
    for step in range(trial_calls(count, rounds=1) - 1):
        call_and_check(comm, count, step)
    assert decision(comm, count) == []
    call_and_check(comm, count, 99)
    assert len(decision(comm, count)) == (1 if comm.Get_size() > 1 else 0)


@pytest.mark.parametrize("count", [1, 7, 1031])
def test_short_vectors_are_measured_too(comm, count, trials):
    """Short vectors (latency-bound, fewer elements than ranks) have their
    trial as well, with longer blocks; every call is right."""
    trials(2)
    for step in range(trial_calls(count, rounds=2) + 1):
        call_and_check(comm, count, step)
    assert len(decision(comm, count)) == (1 if comm.Get_size() > 1 else 0)


def test_a_kept_call_runs_the_winner_directly(comm, unwatched):
    """The same buffers called again (the prepared-call path) run the winner
    itself once the trial is over, not the trial in between (unwatched; a
    watched one runs the watch, test below)."""
    from mpi_allreduce import api

    count, size = LONG + 5, comm.Get_size()
    send, recv = np.ones(count), np.empty(count)
    for _ in range(trial_calls(count)):
        mar.allreduce(send, recv, comm=comm)
        np.testing.assert_array_equal(recv, np.full(count, size))
    if size > 1:
        (kept,) = [p for k, p in api._PREPARED.items()
                   if k[1] == id(send) and p.refs[0]() is send]
        assert not isinstance(kept.runner, (trial.Trial, trial.Watch))
        assert kept.runner.name == decision(comm, count)[0]


class Switching:
    """Fake timings, the same on every rank, that change at call ``when``:
    ``before`` and ``after`` map algorithm -> seconds (1.0 if not named)."""

    def __init__(self, before, after, when):
        self.before, self.after, self.when, self.calls = before, after, when, 0

    def __call__(self, runner, send, recv, backend):
        runner(send, recv)  # still a real all-reduce, so results stay right
        self.calls += 1
        return (self.before if self.calls <= self.when else self.after).get(runner.name, 1.0)


def test_the_watch_follows_a_switch_and_every_call_stays_right(comm, monkeypatch):
    """The trial's winner (the driver) turns slow after the trial; the
    watch moves to the one fastest now (recursive doubling), on every rank,
    and a kept call follows it; no call is wrong on the way."""
    from mpi_allreduce import api

    count, size = LONG + 6, comm.Get_size()
    fake = Switching({"driver": 0.5}, {"driver": 2.0, "recursive_doubling": 0.5},
                     when=timed_in_trial(count))
    monkeypatch.setattr(trial, "_elapsed", fake)
    monkeypatch.setattr(trial, "AUDIT_SHARE", 0.5)  # frequent audits: a short test
    send = np.arange(count, dtype=np.float64)
    recv = np.empty(count)
    for step in range(trial_calls(count) + 600):
        mar.allreduce(send, recv, comm=comm)
        np.testing.assert_array_equal(recv, send * size)
        if step == trial_calls(count) and size > 1:
            assert decision(comm, count) == ["driver"]
    if size > 1:
        watch = watch_of(comm, count)
        # the others turned 2x faster than the driver as well: the watch may
        # stop at one of them on the way, not stay there
        assert watch.current == "recursive_doubling" and watch.moves >= 1
        assert decision(comm, count) == ["recursive_doubling"]
        assert len(set(comm.allgather((watch.current, watch.turn, watch.plain)))) == 1
        (kept,) = [p for k, p in api._PREPARED.items() if k[1] == id(send)]
        assert kept.runner is watch


def test_the_watch_judges_by_the_slowest_rank(comm, monkeypatch):
    """A candidate that turns fast on every rank but the last is no faster
    for the job: the watch stays with the winner."""
    count, size = LONG + 7, comm.Get_size()
    last = size - 1
    slow_on_last = {"recursive_doubling": 0.5 if comm.Get_rank() != last else 3.0}
    fake = Switching({"driver": 0.5}, dict(slow_on_last, driver=1.0),
                     when=timed_in_trial(count))
    monkeypatch.setattr(trial, "_elapsed", fake)
    monkeypatch.setattr(trial, "AUDIT_SHARE", 0.5)
    for step in range(trial_calls(count) + 400):
        call_and_check(comm, count, step)
    if size > 1:
        assert watch_of(comm, count).current == "driver"


def test_a_bad_trials_setting_is_refused(comm, trials):
    trials(-1)
    with pytest.raises(ValueError, match="MPI_ALLREDUCE_AUTO_TRIALS=-1 is negative"):
        mar.allreduce(np.ones(LONG), comm=comm)


def test_the_benchmark_times_auto_after_its_trial(comm):
    """bench warms ``auto`` up through its trial, so the timed calls run the
    winner, and it reports the winner as what auto ran."""
    from mpi_allreduce.bench import bench

    nbytes = 4 * 16411
    results = bench(comm, [nbytes], ["mpi", "auto"], dtype="float32", iters=2, warmup=1,
                    check=True, progress=False)
    auto = next(r for r in results if r.algorithm == "auto")
    assert auto.wrong == 0
    if comm.Get_size() > 1:
        assert [auto.runs] == decision(comm, nbytes // 4)
