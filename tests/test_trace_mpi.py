"""Traces of real runs (``MPI_ALLREDUCE_TRACE``): every kind of call is
recorded through the same stages -- blocking, non-blocking calls in flight
together, persistent requests, the halves, on the world and on a
sub-communicator -- and the merged trace is well formed: required keys,
every rank's calls and rounds in order, every send with its receive; the
per-rank files written at exit merge into the same; an unwritable
directory is refused on every rank before any message; ranks that
disagree while tracing still stall and raise, never answer; and with the
setting off a call runs no recording step."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config, trace
from mpi_allreduce.tools import traces

pytestmark = pytest.mark.mpi


@pytest.fixture
def traced(monkeypatch):
    """Tracing on into a directory rank 0 makes and every rank names alike
    (outside pytest's per-rank temporary trees); off and removed afterwards."""
    comm = MPI.COMM_WORLD
    directory = comm.bcast(tempfile.mkdtemp(prefix="mar-trace-") if comm.Get_rank() == 0
                           else None)
    monkeypatch.setenv(config.TRACE_ENV, directory)
    config.refresh()
    yield directory
    if trace.tracer() is not None:
        trace.tracer().take()
    monkeypatch.undo()
    config.refresh()
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


def _calls(doc, **match) -> list:
    return [e for e in doc["traceEvents"] if e.get("cat") == "call" and e["ph"] == "X"
            and all(e["args"].get(k) == v for k, v in match.items())]


def test_every_kind_of_call_is_traced(traced):
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("one rank sends no messages")
    x = np.arange(37, dtype=np.float64) + rank
    y = np.empty_like(x)
    for algorithm in ("ring", "recursive_doubling", "driver"):
        mar.allreduce(x, y, algorithm=algorithm)
        np.testing.assert_array_equal(y, comm.allreduce(x))
    outs = [np.empty_like(x) for _ in range(4)]
    requests = [mar.iallreduce(x, out, algorithm="ring") for out in outs]  # in flight together
    mar.waitall(requests)
    with mar.allreduce_init(x, outs[0], algorithm="recursive_doubling") as persistent:
        for _ in range(2):
            persistent.start()
            persistent.wait()
    grads = [np.full(n, rank, dtype=np.float32) for n in (5, 700, 3)]
    with mar.Fusion(bucket_bytes=1024) as fusion:  # two buckets: persistent requests
        fusion.allreduce(grads)
    assert all((g == sum(range(size))).all() for g in grads)
    mar.reduce_scatter(np.ones(size * 3), np.empty(3))
    mar.allgather(np.ones(3), np.empty(3 * size))
    half = comm.Split(rank % 2, rank)
    if half.Get_size() > 1:
        mar.allreduce(x, y, algorithm="ring", comm=half)
    request = mar.iallreduce(x, outs[0], algorithm="ring")
    assert _recording(request)  # what test_off_adds_no_step looks for
    request.wait()
    # large enough for the progress thread (where MPI runs threads): its steps are
    # recorded on that thread
    from mpi_allreduce.progress import THREAD_MIN_BYTES

    big = np.ones(THREAD_MIN_BYTES // 4, dtype=np.float32)
    threaded = mar.iallreduce(big, np.empty_like(big), algorithm="ring")
    np.testing.assert_array_equal(threaded.wait(), np.full_like(big, size))
    path = trace.collect(comm, os.path.join(traced, "run.json"))
    half.Free()
    if rank != 0:
        return
    doc = traces.load(path)
    counts = traces.validate(doc)
    assert counts["messages"] > 0 and counts["flows"] == 2 * counts["messages"]
    for algorithm in ("ring", "recursive_doubling", "driver"):
        assert len(_calls(doc, algorithm=algorithm, kind="blocking", ranks=size)) >= size
    # four in flight together, two starts of the persistent request, one more; the
    # fusion's buckets
    calls = _calls(doc, kind="non-blocking or persistent", ranks=size)
    assert sum(e["args"]["dtype"] == "float64" for e in calls) == 7 * size
    # the fusion's buckets (float32): the 700-element array alone, the other two packed;
    # the threaded call
    assert sum(e["args"]["dtype"] == "float32" and e["args"]["elements"] < 1000
               for e in calls) >= 2 * size
    assert sum(e["args"]["elements"] == THREAD_MIN_BYTES // 4 for e in calls) == size
    pids = {e["pid"] for e in doc["traceEvents"] if e.get("ph") == "X"}
    assert pids == set(range(size))
    # local steps are named for what they do (out of place, the ring copies its input first)
    assert {"copy", "reduce"} <= {e["name"] for e in doc["traceEvents"] if e.get("cat") == "local"}
    # calls in flight together never share a lane on a rank
    lanes = [e for e in _calls(doc, algorithm="ring", kind="non-blocking or persistent")
             if e["pid"] == 0]
    assert len({e["tid"] for e in lanes}) == 4
    # the sub-communicator's messages stay inside its half of the world
    if size > 2:
        for e in doc["traceEvents"]:
            if e.get("cat") == "message" and e["ph"] == "X" and \
                    e["args"]["key"].startswith("(0, 2"):
                assert e["pid"] % 2 == 0 and e["args"]["peer"] % 2 == 0


def test_rank_files_at_exit_merge_into_one(traced):
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("one rank sends no messages")
    x = np.ones(1000, dtype=np.float32)
    y = np.empty_like(x)
    for _ in range(3):
        mar.allreduce(x, y, algorithm="ring")
    written = trace.tracer().close()  # what atexit does
    assert written and os.path.exists(written)
    comm.Barrier()
    if comm.Get_rank() == 0:
        out = os.path.join(traced, "merged.json")
        traces.merge([traced], out)
        doc = traces.load(out)
        counts = traces.validate(doc)
        assert counts["call"] == 3 * comm.Get_size()
        assert sorted(doc["otherData"]["ranks"]) == list(range(comm.Get_size()))
        rows = traces.breakdown(doc)
        assert {r["algorithm"] for r in rows} == {"ring"}
        assert all(r["time_us"] >= r["wait_us"] + r["reduce_us"] - 1e-6 for r in rows)
    comm.Barrier()


def test_unwritable_directory_is_refused_before_any_message(monkeypatch):
    monkeypatch.setenv(config.TRACE_ENV, "/etc/passwd/not-a-directory")
    config.refresh()
    try:
        with pytest.raises(mar.SettingError, match="MPI_ALLREDUCE_TRACE"):
            mar.allreduce(np.ones(5), np.empty(5), algorithm="ring")
    finally:
        monkeypatch.undo()
        config.refresh()
    # nothing was sent: the next call on the same communicator is right
    out = mar.allreduce(np.ones(5), np.empty(5), algorithm="ring")
    np.testing.assert_array_equal(out, np.full(5, MPI.COMM_WORLD.Get_size()))


def test_off_adds_no_step():
    """Off, a call's stages are the schedule's alone (the blocking steps
    are compiled from the same stages)."""
    assert trace.tracer() is None
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank runs no plan")
    x, y = np.ones(9), np.empty(9)
    request = mar.iallreduce(x, y, algorithm="ring")
    assert not _recording(request)
    request.wait()


def _recording(request) -> bool:
    """Whether a request's call has recording steps."""
    stages = request._op.stages
    return any(isinstance(getattr(f, "__self__", None), trace._Call)
               for stage in stages for f, _ in stage.before + stage.overlap)


@pytest.mark.parametrize("blocking", [True, False], ids=["allreduce", "iallreduce"])
def test_ranks_that_disagree_while_tracing_stall_and_raise(traced, watchdog, blocking):
    """The recording steps leave the tags and the watchdog as they are:
    rank 0 reduces 5 elements, the others 6 (raise mode, 0.5 s): Stalled on
    every rank, and rank 0, whose messages match nobody's, holds no sum (the
    others, which agree, may hold partial sums among themselves when they
    give up: the call raised, it returned nothing)."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank cannot disagree")
    watchdog(0.5)
    comm = world.Dup()  # left unusable
    data = np.ones(5 if world.Get_rank() == 0 else 6)
    out = np.zeros_like(data)
    with pytest.raises(mar.Stalled):
        if blocking:
            mar.allreduce(data, out, comm=comm, algorithm="ring")
        else:
            mar.iallreduce(data, out, comm=comm, algorithm="ring").wait()
    if world.Get_rank() == 0:
        assert (out <= 1).all()  # its own data at most
    world.Barrier()
    comm.Free()


def test_a_clock_on_another_host_is_moved_onto_rank_0s(monkeypatch):
    """Ranks that report hosts of their own are put on rank 0's clock by
    the watched ping-pong: a rank whose clock runs 5 s ahead is moved back
    by 5 s (to within a round trip); ranks on rank 0's host are not moved."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() == 1:
        pytest.skip("one rank: no other clock")
    ahead = 5_000_000_000 if rank % 2 else 0
    now = trace._now
    monkeypatch.setattr(trace, "_now", lambda: now() + ahead)
    monkeypatch.setattr(MPI, "Get_processor_name", lambda: f"host-{rank % 2}")
    own = comm.Dup()
    try:
        offset = trace._offset_to_root(own, "the test's clocks")
    finally:
        own.Free()
    assert abs(offset + ahead) < 500_000_000, offset
