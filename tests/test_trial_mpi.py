"""``auto``: the trial of the candidates (mpi_allreduce/trial.py).

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


def plan_names(comm, count):
    return sorted(key[3] for key in context_for(comm).plans if key[0] == count)


def decision(comm, count):
    return [name for key, name in context_for(comm).decisions.items() if key[0] == count]


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
    # the losers built for the trial are gone; the winner is cached
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


def test_a_kept_call_runs_the_winner_directly(comm):
    """The same buffers called again (the prepared-call path) run the winner
    itself once the trial is over, not the trial in between."""
    from mpi_allreduce import api

    count, size = LONG + 5, comm.Get_size()
    send, recv = np.ones(count), np.empty(count)
    for _ in range(trial_calls(count)):
        mar.allreduce(send, recv, comm=comm)
        np.testing.assert_array_equal(recv, np.full(count, size))
    if size > 1:
        (kept,) = [p for k, p in api._PREPARED.items()
                   if k[1] == id(send) and p.send_ref() is send]
        assert not isinstance(kept.runner, trial.Trial)
        assert kept.runner.name == decision(comm, count)[0]


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
