"""Traces of long runs stay bounded (``MPI_ALLREDUCE_TRACE``): a rank
holds at most one chunk of events in memory however many calls it makes,
writes the rest to its file as it goes, and the merged trace still has
every call."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import trace
from mpi_allreduce.tools.traces import load, merge, validate

from .test_trace_mpi import traced  # noqa: F401 - a fixture

pytestmark = pytest.mark.mpi

#: calls of the long run
CALLS = 20000


def _wait_quietly(comm) -> None:
    """A barrier that sleeps instead of spinning (ranks left out of the
    long run leave the cores to the ranks in it)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


@pytest.mark.long_loop
def test_many_calls_hold_one_chunk_at_most_and_the_trace_has_them_all(traced):
    """Ranks 0 and 1 make the calls (whatever the world's size, so the run
    and its merged trace stay the same size); the others wait."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank runs no plan: nothing is recorded")
    rank = world.Get_rank()
    pair = world.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if rank < 2:
        x, y = np.ones(1), np.empty(1)
        mar.allreduce(x, y, algorithm="recursive_doubling", comm=pair)
        t = trace.tracer()
        assert t.flush() is not None
        per_call = t.written  # this rank's events of one call
        assert per_call > 0 and not t.events
        most = 0
        for _ in range(CALLS - 1):
            mar.allreduce(x, y, algorithm="recursive_doubling", comm=pair)
            most = max(most, len(t.events))
        pair.Free()
        assert y[0] == 2
        assert most <= t.chunk and t.peak <= t.chunk
        # every event written once or still held, none lost; all but the last chunk written
        assert t.dropped == 0
        assert t.written + len(t.events) == CALLS * per_call
        assert t.written >= CALLS * per_call - t.chunk
        assert t.close() is not None  # what atexit does
    _wait_quietly(world)
    if rank == 0:
        out = os.path.join(traced, "merged.json")
        merge([traced], out)
        doc = load(out)
        counts = validate(doc)
        assert "unfinished" not in doc["otherData"]
        assert counts["call"] == CALLS * 2
        numbers = defaultdict(list)
        for e in doc["traceEvents"]:
            if e.get("cat") == "call" and e["ph"] == "X":
                numbers[e["pid"]].append(e["args"]["call"])
        assert sorted(numbers) == [0, 1]
        assert all(sorted(n) == list(range(1, CALLS + 1)) for n in numbers.values())
    _wait_quietly(world)


def test_a_rank_file_is_written_as_it_goes(traced):
    """Before any exit or flush, a rank whose calls filled a chunk has them
    in its file (a JSON array whose ``]`` is still missing: readers of the
    format add it), and the files merge."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("one rank runs no plan: nothing is recorded")
    t = trace.tracer()
    t.chunk, t.soon = 10, 8  # a small chunk: written after a few calls
    x, y = np.ones(3), np.empty(3)
    for _ in range(10):  # (a call records 4 events at least)
        mar.allreduce(x, y, algorithm="ring")
    assert t.written >= 10 and t.peak <= 10 and len(t.events) <= 10
    with open(t.path) as f:
        text = f.read()
    assert text.startswith("[\n") and not text.rstrip().endswith("]")
    events = json.loads(text + "]")
    assert {e["pid"] for e in events} == {comm.Get_rank()}
    calls = sum(e.get("cat") == "call" for e in events)
    assert 1 <= calls <= 10
    comm.Barrier()
    if comm.Get_rank() == 0:
        out = os.path.join(traced, "merged.json")
        merge([traced], out)
        doc = load(out)
        assert sorted(doc["otherData"]["unfinished"]) == sorted(
            os.path.join(traced, n) for n in os.listdir(traced) if n.startswith("rank-"))
        assert validate(doc)["call"] >= comm.Get_size()
    comm.Barrier()
