"""Serial tests of live selection: when it probes, what it costs, when it moves."""

from __future__ import annotations

import pytest

from mpi_allreduce.selection import LiveSelector


class OneRank:
    """The selector's only collective, on a communicator of one."""

    def __init__(self):
        self.syncs = 0

    def Iallreduce(self, send, recv, op):
        from mpi4py import MPI

        self.syncs += 1
        recv[...] = send
        return MPI.REQUEST_NULL


def drive(selector, seconds_of, calls):
    """Make ``calls`` calls; return the algorithm of each."""
    ran = []
    for _ in range(calls):
        name = selector.choose()
        selector.observe(name, seconds_of[name])
        ran.append(name)
    return ran


def test_nothing_but_the_table_before_the_first_sync():
    selector = LiveSelector(OneRank(), "ring", ["ring", "driver", "rabenseifner"])
    assert drive(selector, {"ring": 1.0, "driver": 0.1, "rabenseifner": 0.1}, 64) == ["ring"] * 64


def test_syncs_are_rare_and_at_fixed_calls():
    comm = OneRank()
    selector = LiveSelector(comm, "ring", ["ring", "driver"])
    drive(selector, {"ring": 1.0, "driver": 1.0}, 64 * 2 ** 6)
    assert comm.syncs == 7  # calls 64, 128, ..., 4096


@pytest.mark.parametrize("ratio", [1.5, 4.0, 20.0])
def test_probes_cost_at_most_the_budget(ratio):
    """Candidates slower than the table's choice by ``ratio``: the time spent
    in them stays within 5% of the time of all calls so far, at every sync."""
    selector = LiveSelector(OneRank(), "ring", ["ring", "driver", "rabenseifner"])
    seconds = {"ring": 1.0, "driver": ratio, "rabenseifner": ratio}
    total = probes = 0.0
    for call in range(1, 20001):
        name = selector.choose()
        selector.observe(name, seconds[name])
        total += seconds[name]
        probes += seconds[name] if name != "ring" else 0.0
        if call >= 64:
            # one probe may overshoot by what the guess missed
            assert probes <= 0.05 * total + max(0.0, ratio - selector.PROBE_GUESS)
    assert selector.current == "ring" and probes > 0


def test_moves_to_a_faster_candidate_and_stays():
    selector = LiveSelector(OneRank(), "ring", ["ring", "driver", "rabenseifner"])
    ran = drive(selector, {"ring": 1.0, "driver": 2.0, "rabenseifner": 0.5}, 40000)
    assert selector.current == "rabenseifner" and selector.moves == 1
    assert ran[-1000:] == ["rabenseifner"] * 1000 or ran[-1000:].count("rabenseifner") > 990


def test_a_candidate_within_the_margin_does_not_move_it():
    selector = LiveSelector(OneRank(), "ring", ["ring", "driver"])
    drive(selector, {"ring": 1.0, "driver": 0.95}, 40000)
    assert selector.current == "ring" and selector.moves == 0


def test_a_first_call_that_builds_a_plan_is_budgeted():
    """The first call (plan built, bound) took 100 times a later one: a
    candidate never run is probed only once 5% of the time so far covers
    a first call like it, and the probes stay within the budget."""
    selector = LiveSelector(OneRank(), "ring", ["ring", "driver"])
    total = probes = 0.0
    first_probe = None
    for call in range(1, 8001):
        name = selector.choose()
        seconds = 100.0 if call == 1 else 1.0
        if name == "driver" and first_probe is None:
            first_probe, seconds = call, 100.0  # its plan is built now
        selector.observe(name, seconds)
        total += seconds
        probes += seconds if name == "driver" else 0.0
    assert first_probe is not None and first_probe > 1024
    assert probes <= 0.05 * total
