"""``auto``'s watch (mpi_allreduce/trial.py) on one process, with fake
candidates and fake timings: which candidate is audited when, what the
audits cost, and when the watch moves.  The MPI side (every rank keeps the
same winner, every call stays right) is in test_trial_mpi.py."""

from __future__ import annotations

import math

import pytest
from mpi4py import MPI

from mpi_allreduce import trial


class Candidate:
    """Stands in for an algorithm's runner: counts its calls."""

    def __init__(self, name):
        self.name, self.calls = name, 0

    def __call__(self, send, recv):
        self.calls += 1


class Clock:
    """Fake ``_elapsed``: seconds per call by candidate (changeable)."""

    def __init__(self, seconds):
        self.seconds = dict(seconds)

    def __call__(self, runner, send, recv, backend):
        runner(send, recv)
        return self.seconds[runner.name]


class NoDevice:
    device = False


def make_watch(seconds, current, block=5):
    """A watch over candidates named as in ``seconds`` (their trial times)."""
    runners = {name: Candidate(name) for name in seconds}
    watch = trial.Watch(MPI.COMM_SELF, runners, list(seconds.values()), current, NoDevice(),
                        block)
    return watch, runners


def run(watch, clock, calls):
    """``calls`` calls of the watch; returns the seconds they took (untimed
    calls cost what the candidate run costs, too)."""
    total = 0.0
    for _ in range(calls):
        before = {n: r.calls for n, r in watch.runners.items()}
        watch(None, None)
        (ran,) = [n for n, r in watch.runners.items() if r.calls != before[n]]
        total += clock.seconds[ran]
    return total


def audits(watch, fake, count):
    """The candidates of the next ``count`` audits, in order."""
    seen = []
    for _ in range(count):
        seen.append(watch.candidate)
        run(watch, fake, watch.plain + 2 * watch.timed + 1)
    return seen


@pytest.fixture
def clock(monkeypatch):
    def install(seconds):
        fake = Clock(seconds)
        monkeypatch.setattr(trial, "_elapsed", fake)
        return fake
    return install


def test_audits_go_round_the_other_candidates_in_turn(clock):
    times = {"a": 1.0, "b": 1.0, "c": 1.0}
    fake = clock(times)
    watch, _ = make_watch(times, "b")
    assert audits(watch, fake, 4) == ["a", "c", "a", "c"]


@pytest.mark.parametrize("slower", [1.0, 2.0, 5.0, 40.0])
def test_the_pause_after_an_audit_pays_for_it(clock, slower):
    """After an audit of a candidate ``slower`` times the winner, the plain
    calls are enough that the candidate's block is AUDIT_SHARE of the time."""
    times = {"w": 1.0, "x": slower}
    fake = clock(times)
    watch, _ = make_watch(times, "w", block=5)
    run(watch, fake, watch.plain + 2 * watch.timed + 1)  # up to the end of one audit
    assert watch.plain == math.ceil(5 * slower / trial.AUDIT_SHARE)


def test_audits_cost_at_most_their_share_however_slow_the_others(clock):
    """Over a long run the watch spends no more than AUDIT_SHARE beyond the
    winner's own time, however slow the other candidates are."""
    times = {"w": 1.0, "close": 1.05, "slow": 3.0, "slower": 30.0}
    fake = clock(times)
    watch, _ = make_watch(times, "w", block=9)
    calls = 200_000
    spent = run(watch, fake, calls)
    assert watch.current == "w"
    assert spent / calls <= 1.0 + trial.AUDIT_SHARE * 1.05
    assert spent / calls > 1.0  # the audits did run


def test_a_candidate_that_turns_faster_takes_over_and_ratios_move_with_it(clock):
    times = {"w": 1.0, "x": 1.5, "y": 2.0}
    fake = clock(times)
    watch, runners = make_watch(times, "w")
    run(watch, fake, 1000)
    assert watch.current == "w" and watch.moves == 0
    fake.seconds["x"] = 0.5
    run(watch, fake, 5000)
    assert watch.current == "x" and watch.moves == 1
    # ratios are now to x: w is slower than x, y slower still
    assert watch.ratio["x"] == 0.0
    assert 0.0 < watch.ratio["w"] < watch.ratio["y"]
    calls = runners["x"].calls
    run(watch, fake, 100)
    assert runners["x"].calls > calls  # the plain calls run the new winner


def test_a_candidate_within_the_margin_does_not_take_over(clock):
    times = {"w": 1.0, "x": 1.0 - trial.WATCH_MARGIN / 2}
    fake = clock(times)
    watch, _ = make_watch(times, "w")
    run(watch, fake, 5000)
    assert watch.current == "w" and watch.moves == 0


def test_one_lucky_audit_is_not_enough(clock):
    """A running ratio: one audit that sees the candidate twice as fast moves
    it part of the way, not past the margin."""
    times = {"w": 1.0, "x": 1.3}
    fake = clock(times)
    watch, _ = make_watch(times, "w", block=3)
    fake.seconds["x"] = 0.5
    run(watch, fake, watch.plain + 2 * watch.timed + 1)  # exactly one audit of x
    assert watch.current == "w"
    expected = math.log(1.3) + trial.AUDIT_WEIGHT * (math.log(0.5) - math.log(1.3))
    assert watch.ratio["x"] == pytest.approx(expected)


def test_a_candidate_faster_in_its_audit_is_audited_again_next(clock):
    """x lost the trial by far (1.5x) and is now twice as fast: its audits
    follow each other until it takes over, instead of one per round."""
    times = {"w": 1.0, "x": 1.5, "y": 1.2, "z": 1.3}
    fake = clock(times)
    watch, _ = make_watch(times, "w")
    assert audits(watch, fake, 3) == ["x", "y", "z"]
    fake.seconds["x"] = 0.5
    # the next audit is x's in turn (the round starts again); its ratio goes
    # from log 1.5 to 0.13, then to -0.08: past the margin, in two audits
    assert audits(watch, fake, 2) == ["x", "x"]
    assert watch.current == "x" and watch.moves == 1


def test_a_candidate_a_little_faster_does_not_keep_the_others_unseen(clock):
    """Within the margin, x stays faster in every audit: it is audited
    again AGAIN times in a row at most, then the others get their turns."""
    times = {"w": 1.0, "x": 1.0 - trial.WATCH_MARGIN / 2, "y": 1.2}
    fake = clock(times)
    watch, _ = make_watch(times, "w")
    seen = audits(watch, fake, 40)
    assert watch.current == "w"
    assert seen.count("y") >= 40 // (trial.AGAIN + 2)
    longest = max(len(run_) for run_ in "".join(seen).split("y"))
    assert longest == trial.AGAIN + 1  # its turn, then AGAIN more
