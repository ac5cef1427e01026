"""The guarantees (docs/guarantees.md) on every path: ranks that disagree never get a
wrong result, calls in flight never match each other's messages, a call
that waits too long is reported, threads that share a communicator are
refused, and what a call holds is freed with it.  Each test is a case that
failed before the call spec, the tag claims and the one engine; stalls are
bounded by a raising watchdog of a second or less."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config
from mpi_allreduce.context import context_for
from mpi_allreduce.spec import tag_layout

pytestmark = pytest.mark.mpi

THREADS = MPI.Query_thread() == MPI.THREAD_MULTIPLE


@pytest.fixture
def trio():
    """The first three ranks (or fewer) in a communicator of their own, for
    the long loops (thousands of calls): at larger world sizes they would
    add nothing but time; the other ranks skip."""
    world = MPI.COMM_WORLD
    inside = world.Get_rank() < 3
    comm = world.Split(0 if inside else MPI.UNDEFINED, world.Get_rank())
    if not inside:
        pytest.skip("the long loops run on the first three ranks")
    mar.setup(comm)
    yield comm
    comm.Free()


def _need(comm, ranks: int = 2):
    if comm.Get_size() < ranks:
        pytest.skip(f"needs {ranks} ranks")


# --- many calls in flight, persistent and non-blocking mixed -------------------------------

@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_a_training_loop_past_4096_steps_stays_right(trio, algorithm):
    """One persistent all-reduce and one non-blocking one of the same
    shape per step: before, the non-blocking call's tag wrapped onto the
    persistent request's at step 4095 and returned a wrong result."""
    p, r = trio.Get_size(), trio.Get_rank()
    a = np.zeros(4)
    b = np.zeros(4)
    with mar.allreduce_init(MPI.IN_PLACE, a, comm=trio, algorithm=algorithm) as persistent:
        for step in range(4100):
            a[:] = r + step
            b[:] = r - step
            persistent.start()
            request = mar.iallreduce(MPI.IN_PLACE, b, comm=trio, algorithm=algorithm)
            request.wait()
            persistent.wait()
            assert a[0] == p * step + p * (p - 1) // 2, (step, a)
            assert b[0] == -p * step + p * (p - 1) // 2, (step, b)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_4500_calls_in_flight_at_once(trio, algorithm):
    r = trio.Get_rank()
    arrays = [np.full(3, float(r + i)) for i in range(4500)]
    requests = [mar.iallreduce(MPI.IN_PLACE, x, comm=trio, algorithm=algorithm) for x in arrays]
    mar.waitall(requests[::-1])
    p = trio.Get_size()
    got = np.array([x[0] for x in arrays])
    want = p * np.arange(4500) + p * (p - 1) // 2
    assert np.array_equal(got, want)


def _small_tags(comm):
    """The tag layout of an MPI with the standard's smallest MPI_TAG_UB
    (32767): 256 persistent slots, 768 non-blocking ones."""
    context = context_for(comm)
    context.tags = tag_layout(32767)
    return context.tags


def test_with_the_smallest_tag_space_a_wrap_never_meets_a_held_tag(trio):
    tags = _small_tags(trio)
    p, r = trio.Get_size(), trio.Get_rank()
    a, b = np.zeros(2), np.zeros(2)
    persistent = mar.allreduce_init(MPI.IN_PLACE, a, comm=trio, algorithm="ring")
    for step in range(2 * (tags.slots - tags.persistent) + 5):  # the slots wrap twice
        a[:], b[:] = r + step, r
        persistent.start()
        mar.iallreduce(MPI.IN_PLACE, b, comm=trio, algorithm="ring").wait()
        persistent.wait()
        assert a[0] == p * step + p * (p - 1) // 2 and b[0] == p * (p - 1) // 2, step
    persistent.free()


def test_more_calls_in_flight_than_tags_are_refused_on_every_rank(fresh):
    _need(fresh)
    tags = _small_tags(fresh)
    room = tags.slots - tags.persistent
    arrays = [np.full(2, float(i)) for i in range(room + 1)]
    requests = [mar.iallreduce(MPI.IN_PLACE, x, comm=fresh) for x in arrays[:room]]
    with pytest.raises(mar.TagsExhausted, match="non-blocking calls in flight"):
        mar.iallreduce(MPI.IN_PLACE, arrays[room], comm=fresh)
    mar.waitall(requests)
    p = fresh.Get_size()
    assert all(x[0] == p * i for i, x in enumerate(arrays[:room]))
    held = [mar.allreduce_init(MPI.IN_PLACE, np.zeros(2), comm=fresh)
            for _ in range(tags.persistent)]
    with pytest.raises(mar.TagsExhausted, match="persistent requests alive"):
        mar.allreduce_init(MPI.IN_PLACE, np.zeros(2), comm=fresh)
    for request in held:
        request.free()
    x = np.ones(2)  # a freed request's tag is free again
    with mar.allreduce_init(MPI.IN_PLACE, x, comm=fresh) as request:
        request.start()
        request.wait()
    assert x[0] == p


# --- ranks that disagree: never a wrong result ---------------------------------------------

def _disagree(comm, call, want):
    """Run ``call()`` on every rank: each returns ``want`` or raises Stalled
    (never another result), and some rank stalls."""
    try:
        out = call()
        stalled = False
        np.testing.assert_array_equal(out, want)
    except mar.Stalled:
        stalled = True
    assert MPI.COMM_WORLD.allreduce(int(stalled)) >= 1


SEGMENT = {
    "argument": lambda r, mp: dict(segment_size=2 if r == 0 else 3),
    "environment": lambda r, mp: (mp.setenv(config.SEGMENT_ENV, "16") if r == 0 else None,
                                  config.refresh(), {})[-1],
}


@pytest.mark.parametrize("algorithm", ["ring", "ring_pipelined", "rabenseifner", "auto"])
@pytest.mark.parametrize("how", list(SEGMENT))
def test_segment_size_mismatch(fresh, watchdog, monkeypatch, how, algorithm):
    _need(fresh)
    watchdog(0.5)
    options = SEGMENT[how](fresh.Get_rank(), monkeypatch)
    data = np.arange(40.0)
    _disagree(fresh, lambda: mar.allreduce(data, comm=fresh, algorithm=algorithm, **options),
              data * fresh.Get_size())
    monkeypatch.delenv(config.SEGMENT_ENV, raising=False)
    config.refresh()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_hierarchical_inner_mismatch(fresh, watchdog, monkeypatch, how):
    _need(fresh, 3)
    watchdog(0.5)
    r = fresh.Get_rank()
    inner = "ring" if r == 0 else "recursive_doubling"
    options = {"inner": inner} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv(config.INNER_ENV, inner)
        config.refresh()
    data = np.arange(30.0)
    _disagree(fresh, lambda: mar.allreduce(data, comm=fresh, algorithm="hierarchical",
                                           ranks_per_node=1, **options),
              data * fresh.Get_size())


@pytest.mark.parametrize("what", ["reduce_scatter", "allgather"])
def test_counts_mismatch_with_the_same_total(fresh, watchdog, what):
    _need(fresh)
    watchdog(0.5)
    p, r = fresh.Get_size(), fresh.Get_rank()
    counts = [2] * p
    if r == 0:
        counts[0], counts[1] = 3, 1
    if what == "reduce_scatter":
        data = np.arange(2.0 * p)
        want = (data * p)[sum(counts[:r]):sum(counts[:r + 1])]
        call = lambda: mar.reduce_scatter(data, None, "sum", counts, comm=fresh)  # noqa: E731
    else:
        data = np.full(counts[r], float(r))
        want = np.repeat(np.arange(p, dtype=float), counts)
        call = lambda: mar.allgather(data, None, counts, comm=fresh)  # noqa: E731
    _disagree(fresh, call, want)


@pytest.mark.parametrize("what", ["reduce_scatter", "allgather"])
def test_an_empty_half_on_one_rank_stalls_never_shifts_the_next(fresh, watchdog, what):
    """A half of no elements on one rank where its peers' has some is no
    short cut there: it stalls with its peers (or returns nothing, having
    met nothing), and the next call, the same on every rank, is exact or
    stalls -- never met by the peers' earlier one."""
    _need(fresh)
    watchdog(0.5)
    p, r = fresh.Get_size(), fresh.Get_rank()
    n = 0 if r == 0 else 2

    def half(each):
        if what == "reduce_scatter":
            return mar.reduce_scatter(np.arange(float(each * p)) + r, None, "sum", [each] * p,
                                      comm=fresh)
        return mar.allgather(np.full(each, float(r)), None, [each] * p, comm=fresh)

    wrong, stalled = None, False
    try:
        out = half(n)
        if out.size:
            wrong = f"a mismatched half returned {out}"
        out = half(3)
        want = ((np.arange(3.0 * p) * p + p * (p - 1) / 2)[3 * r:3 * r + 3]
                if what == "reduce_scatter" else np.repeat(np.arange(p, dtype=float), 3))
        if not np.array_equal(out.ravel(), want):
            wrong = f"the next half returned {out}, not {want}"
    except mar.Stalled:
        stalled = True
    everyone = MPI.COMM_WORLD.allgather((stalled, wrong))
    assert not any(w for _, w in everyone), everyone
    assert any(s for s, _ in everyone), everyone


@pytest.mark.parametrize("what", ["reduce_scatter", "allgather"])
def test_counts_one_rank_gives_as_no_list_stall_never_shift_the_next(fresh, watchdog, what):
    """Rank 0 gives ``counts`` as a number (refused: counts are a list, one
    a rank) where its peers give a list: its refusal is no short cut, the
    calls stall on every rank and the next one, the same everywhere, is
    exact or stalls (before: the number was read outside the refusal's
    handling, so rank 0 raised alone and its next call met its peers'
    refused one, a wrong result on both).  Counts given as an iterator are
    read once: the call is exact."""
    _need(fresh)
    p, r = fresh.Get_size(), fresh.Get_rank()

    def half(counts, step):
        if what == "reduce_scatter":
            return mar.reduce_scatter(np.arange(2.0 * p) + r + step, None, "sum", counts,
                                      comm=fresh)
        return mar.allgather(np.full(2, float(r + step)), None, counts, comm=fresh)

    def exact(step):
        if what == "reduce_scatter":
            return (np.arange(2.0 * p) * p + p * (p - 1) / 2 + p * step)[2 * r:2 * r + 2]
        return np.repeat(np.arange(p, dtype=float) + step, 2)
    np.testing.assert_array_equal(half(iter([2] * p), 0).ravel(), exact(0))
    watchdog(0.5)
    outcomes = []
    for step in (1, 2):
        try:
            out = half(2 if r == 0 and step == 1 else [2] * p, step)
            outcomes.append("exact" if np.array_equal(out.ravel(), exact(step)) else "WRONG")
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
        except (TypeError, ValueError) as exc:
            outcomes.append(f"refused alone: {exc}")
    everyone = MPI.COMM_WORLD.allgather(outcomes)
    assert not any("WRONG" in o for o in everyone), everyone
    assert all(o[0] == "Stalled" for o in everyone), everyone


def test_an_array_one_rank_refuses_to_a_fusion_stalls_never_shifts_the_next(fresh, watchdog):
    """Rank 0 adds a read-only array to a Fusion (refused) and goes on; its
    peers add it writeable: rank 0's refusal is an empty call of its own,
    which stalls with its peers' bucket (reported on every rank), never
    its next bucket meeting theirs (before: a wrong sum on both)."""
    from mpi_allreduce.fusion import Fusion

    _need(fresh)
    p, r = fresh.Get_size(), fresh.Get_rank()
    watchdog(0.5)
    fusion = Fusion(fresh, bucket_bytes=16)
    a, b = np.full(4, 1.0 + r), np.full(4, 100.0 + r)
    if r == 0:
        a.setflags(write=False)
    outcomes = []
    for array in (a, b):
        try:
            fusion.add(array)
            outcomes.append("added")
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
        except ValueError:
            outcomes.append("refused alone")
    try:
        fusion.wait()
        outcomes.append("exact" if (b == sum(100.0 + q for q in range(p))).all() else "WRONG")
    except mar.Broken as exc:
        outcomes.append(type(exc).__name__)
    everyone = MPI.COMM_WORLD.allgather(outcomes)
    assert not any("WRONG" in o or "alone" in o for o in everyone), everyone
    assert everyone[0][0] == "Stalled" and all("Stalled" in o for o in everyone), everyone


#: what ranks may name differently for the halves' messages (radix 2 and 3
#: are one radix at 2 ranks, where k-nomial lowers it to p)
HALVES_OPTIONS = {
    "algorithm": lambda r: {"algorithm": "rabenseifner" if r == 0 else "swing_bandwidth"},
    "radix": lambda r: {"algorithm": "knomial", "radix": 2 if r == 0 else 3},
}


@pytest.mark.parametrize("case", list(HALVES_OPTIONS))
@pytest.mark.parametrize("what", ["reduce_scatter", "allgather"])
def test_halves_algorithms_that_differ_between_ranks(fresh, watchdog, what, case):
    """The halves' algorithm and radix are in their messages' tags: ranks
    that name different ones stall and are reported, never mix."""
    _need(fresh, 3)
    watchdog(0.5)
    p, r = fresh.Get_size(), fresh.Get_rank()
    options = HALVES_OPTIONS[case](r)
    if what == "reduce_scatter":
        data = np.arange(3.0 * p) + r
        want = (np.arange(3.0 * p) * p + p * (p - 1) / 2)[3 * r:3 * r + 3]
        call = lambda: mar.reduce_scatter(data, None, "sum", comm=fresh, **options)  # noqa: E731
    else:
        data = np.full(3, float(r))
        want = np.repeat(np.arange(p, dtype=float), 3).reshape(p, 3)
        call = lambda: mar.allgather(data, None, comm=fresh, **options)  # noqa: E731
    _disagree(fresh, call, want)


REPRODUCIBLE = {
    "float64-complex128": lambda r: (np.ones(8, np.float64 if r == 0 else np.complex128), "sum"),
    "float32-float16": lambda r: (np.ones(8, np.float32 if r == 0 else np.float16), "sum"),
    "sum-avg": lambda r: (np.ones(8), "sum" if r == 0 else "avg"),
}


@pytest.mark.parametrize("case", list(REPRODUCIBLE))
def test_reproducible_keeps_the_callers_dtype_and_op(fresh, watchdog, case):
    _need(fresh)
    watchdog(0.5)
    data, op = REPRODUCIBLE[case](fresh.Get_rank())
    _disagree(fresh, lambda: mar.allreduce(data, None, op, comm=fresh, reproducible=True),
              data * (fresh.Get_size() if op == "sum" else 1))
    with pytest.raises(mar.ArgumentMismatch):
        mar.allreduce(data, None, op, comm=MPI.COMM_WORLD, reproducible=True, check=True)


@pytest.mark.parametrize("own", [False, True], ids=["packed", "in_their_buckets"])
def test_fusions_whose_buckets_differ_between_ranks(fresh, watchdog, own):
    """A fusion whose bucket holds other sizes on rank 0 (the same dtype and
    op): its packed or own-memory bucket's persistent call has another spec
    there, so the ranks stall instead of summing misaligned arrays."""
    _need(fresh)
    watchdog(0.5)
    p, r = fresh.Get_size(), fresh.Get_rank()
    sizes = [5, 7] if r == 0 else [5, 8]
    fusion = mar.Fusion(fresh, op="sum", bucket_bytes=1 << 20)
    arrays = fusion.empty_like([np.empty(n) for n in sizes]) if own else \
        [np.empty(n) for n in sizes]
    for a in arrays:
        a[...] = 1.0

    def call():
        fusion.allreduce(arrays)
        return np.concatenate(arrays)
    try:
        _disagree(fresh, call, np.full(sum(sizes), float(p)))
    finally:
        fusion.free()


#: options on rank 0 and on the others that make the library's own
#: collectives of different purposes (check's agreement, a named tuning
#: file's agreement) on one call
COLLECTIVES = {
    "check against a tuning file": ({"check": True}, {"tuning": "FILE"}),
    "a tuning file against check": ({"tuning": "FILE"}, {"check": True}),
}


@pytest.mark.parametrize("case", list(COLLECTIVES))
def test_library_collectives_that_differ_between_ranks_raise_on_every_rank(
        fresh, watchdog, tmp_path_factory, case):
    """Rank 0 and its peers make one call with options that make the
    library's own collectives of different purposes: they meet in the one
    first step every such collective begins with, see the purposes differ,
    and every rank raises ArgumentMismatch before any further message; the
    communicator stays usable (before: check's byte counts were read as
    the table's digest on one rank, MPI truncated the other's)."""
    import shutil
    from pathlib import Path

    _need(fresh)
    watchdog(30)
    p, r = fresh.Get_size(), fresh.Get_rank()
    path = str(tmp_path_factory.mktemp("table") / "table.json") if r == 0 else None
    path = MPI.COMM_WORLD.bcast(path, root=0)
    if r == 0:  # (a decision table that tune wrote)
        shutil.copy(Path(__file__).parent.parent / "benchmarks/results/tuning.json", path)
    MPI.COMM_WORLD.Barrier()
    mine, theirs = COLLECTIVES[case]
    options = {k: path if v == "FILE" else v for k, v in (mine if r == 0 else theirs).items()}
    x = np.arange(8.0) + r
    with pytest.raises(mar.ArgumentMismatch, match="different collectives"):
        mar.allreduce(x, comm=fresh, **options)
    np.testing.assert_array_equal(mar.allreduce(x, comm=fresh),
                                  np.arange(8.0) * p + p * (p - 1) / 2)


CHECKED = {
    "segment_size": lambda r: dict(algorithm="ring", segment_size=2 + (r == 0)),
    "inner": lambda r: dict(algorithm="hierarchical", ranks_per_node=1,
                            inner="ring" if r == 0 else "tree"),
    "reproducible": lambda r: dict(algorithm="ring", reproducible=r == 0),
}


@pytest.mark.parametrize("field", list(CHECKED))
def test_check_names_every_option_that_shapes_the_messages(comm, field):
    _need(comm)
    with pytest.raises(mar.ArgumentMismatch, match=field):
        mar.allreduce(np.ones(10), comm=comm, check=True, **CHECKED[field](comm.Get_rank()))


def test_check_names_different_counts_of_reduce_scatter(comm):
    _need(comm)
    p = comm.Get_size()
    counts = [1] * p
    counts[0], counts[1] = (2, 0) if comm.Get_rank() == 0 else (1, 1)
    with pytest.raises(mar.ArgumentMismatch, match="counts"):
        mar.reduce_scatter(np.ones(p), None, "sum", counts, comm=comm, check=True)


def _pick_second(a, b, datatype):  # another user op, made first on rank 0
    pass


def test_user_op_handles_that_differ_between_ranks(comm):
    """The same function, its MPI.Op made in another order on rank 0: the
    handles differ, the call is the same (before: a hang, and check=True
    raised a false mismatch)."""
    def add(a, b, datatype):
        np.add(np.frombuffer(a, np.float64), np.frombuffer(b, np.float64),
               out=np.frombuffer(b, np.float64))
    if comm.Get_rank() == 0:
        other = MPI.Op.Create(_pick_second, commute=True)
        mine = MPI.Op.Create(add, commute=True)
    else:
        mine = MPI.Op.Create(add, commute=True)
        other = MPI.Op.Create(_pick_second, commute=True)
    handles = comm.allgather(mine.py2f())
    try:
        x = np.arange(6.0) + comm.Get_rank()
        want = np.empty_like(x)
        comm.Allreduce(x, want, MPI.SUM)
        for algorithm in ("ring", "recursive_doubling"):
            got = mar.allreduce(x, None, mine, comm=comm, algorithm=algorithm, check=True)
            np.testing.assert_array_equal(got, want)
        if comm.Get_size() > 1 and len(set(handles)) == 1:  # (the same on every rank)
            pytest.skip("this MPI gave the op one handle on every rank this time (MPICH "
                        "reuses freed handles): the case did not arise")
    finally:
        mine.Free()
        other.Free()


# --- the watchdog on every path -----------------------------------------------------------

@pytest.mark.parametrize("what", ["reduce_scatter", "allgather"])
def test_watchdog_on_the_halves(fresh, watchdog, what):
    _need(fresh)
    watchdog(0.5)
    p = fresh.Get_size()
    if fresh.Get_rank() == 0:  # the others never come
        with pytest.raises(mar.Stalled, match=what):
            if what == "reduce_scatter":
                mar.reduce_scatter(np.ones(p), comm=fresh)
            else:
                mar.allgather(np.ones(1), comm=fresh)


def test_watchdog_on_the_one_round_persistent_call(fresh, watchdog):
    _need(fresh)
    watchdog(0.5)
    x = np.ones(2)
    request = mar.allreduce_init(MPI.IN_PLACE, x, comm=fresh, algorithm="recursive_doubling")
    if fresh.Get_rank() == 0:  # the others never start it
        request.start()
        with pytest.raises(mar.Stalled, match="persistent call"):
            request.wait()


def test_watchdog_on_a_test_polling_loop(fresh, watchdog):
    _need(fresh)
    watchdog(0.5)
    if fresh.Get_rank() == 0:
        request = mar.iallreduce(np.ones(4), comm=fresh, algorithm="ring")
        with pytest.raises(mar.Stalled, match="non-blocking call"):
            while not request.test():
                time.sleep(0.001)


def test_watchdog_on_a_call_with_a_callback_nobody_waits_for(fresh, watchdog):
    """Raise mode: a call only rank 0 starts, with a completion callback and
    no wait() or test(): the progress thread gives up on it at its deadline
    and the callback sees Stalled."""
    _need(fresh)
    watchdog(0.5)
    if fresh.Get_rank() == 0:
        request = mar.iallreduce(np.ones(4), comm=fresh, algorithm="ring")
        seen = []

        def record(r):
            try:
                r.wait()
            except mar.Stalled as exc:
                seen.append(exc)
        request.add_done_callback(record)
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and "non-blocking call" in str(seen[0])


def _wait_or_test(request, how):
    """Complete ``request`` by ``wait()`` or by a ``test()`` polling loop
    (after a ``wait()`` that returned, ``test()`` once more: the callers
    expect an error from one of them)."""
    if how == "wait":
        request.wait()
    while not request.test():
        time.sleep(0.001)


def _held_by_thread(comm, seconds: float = 10.0) -> list:
    """The progress thread's calls on ``comm`` still held after waiting up
    to ``seconds`` for it to let go of them."""
    from mpi_allreduce.engine import ENGINE
    context = context_for(comm)
    deadline = time.monotonic() + seconds
    while True:
        with ENGINE.cond:
            held = [op for op in ENGINE.threaded if op.context is context]
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.01)


#: calls the progress thread holds (128 KiB and more, or with a callback),
#: each started by rank 0 alone
THREAD_CALLS = {
    "non-blocking": lambda comm, x, a: mar.iallreduce(x, comm=comm, algorithm=a),
    "persistent": lambda comm, x, a: (lambda r: (r.start(), r)[1])(
        mar.allreduce_init(MPI.IN_PLACE, x, comm=comm, algorithm=a)),
    "with-a-callback": lambda comm, x, a: (lambda r: (r.add_done_callback(lambda _: None), r)[1])(
        mar.iallreduce(x[:4], comm=comm, algorithm=a)),
}


@pytest.mark.skipif(not THREADS, reason="needs MPI_THREAD_MULTIPLE")
@pytest.mark.parametrize("how", ["wait", "test"])
@pytest.mark.parametrize("kind", list(THREAD_CALLS))
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_a_stalled_call_of_the_threads_is_given_up_there_too(fresh, watchdog, algorithm, kind,
                                                              how):
    """Raise mode: a call on the progress thread that only rank 0 starts
    raises Stalled in its wait or test, and the thread gives it up as well
    (before: it stayed in the thread's list for good, the thread waited in
    MPI on its requests -- Open MPI's wait spins a core -- and every later
    call on the rank ran some ten times slower)."""
    _need(fresh)
    watchdog(0.5)
    if fresh.Get_rank() == 0:
        request = THREAD_CALLS[kind](fresh, np.ones(1 << 14), algorithm)
        with pytest.raises(mar.Stalled):
            _wait_or_test(request, how)
        held = _held_by_thread(fresh)
        assert not held, f"the thread still holds {held[0].kind} after its stall"


@pytest.mark.skipif(not THREADS, reason="needs MPI_THREAD_MULTIPLE")
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_a_call_dropped_in_flight_is_given_up_by_the_thread(fresh, watchdog, algorithm):
    """Raise mode: rank 0 alone starts a call the thread holds and drops
    its request; nobody waits, yet the thread gives it up (twice the limit
    after its start) and the communicator is broken: the next call raises
    Stalled (before: the call stayed on the thread for good)."""
    _need(fresh)
    watchdog(0.5)
    if fresh.Get_rank() == 0:
        mar.iallreduce(np.ones(1 << 14), comm=fresh, algorithm=algorithm)  # (dropped)
        gc.collect()
        assert not _held_by_thread(fresh), "the thread still holds the dropped call"
        with pytest.raises(mar.Stalled, match="earlier call on this communicator"):
            mar.allreduce(np.ones(2), comm=fresh, algorithm=algorithm)


def _one_round(kind, comm):
    """A one-round call of ``kind`` (2 ranks, 4 elements), started."""
    if kind == "iallreduce":
        return mar.iallreduce(np.ones(4), comm=comm, algorithm="recursive_doubling")
    request = mar.allreduce_init(np.ones(4), comm=comm, algorithm="recursive_doubling")
    request.start()
    return request


@pytest.mark.parametrize("kind", ["iallreduce", "allreduce_init"])
def test_a_one_round_call_dropped_in_flight_keeps_its_arrays(fresh, kind):
    """2 ranks, the one-round fast path (its requests held by the request
    alone): rank 0 drops a call before its peer has sent; the call is kept
    for good, so the peer's late message lands in live memory (before: the
    call and its receive buffer were freed with the request), and the
    peer's call completes with the sum."""
    from mpi_allreduce.engine import ABANDONED
    if fresh.Get_size() != 2:
        pytest.skip("the one-round fast path is the 2-rank one")
    rank = fresh.Get_rank()
    if rank == 0:
        request = _one_round(kind, fresh)
        op = request._op
        assert op.round is not None  # (the fast path this test is about)
        del request
        gc.collect()
        assert any(item is op for item in ABANDONED), "the dropped call was not kept"
    fresh.Barrier()
    if rank == 1:
        np.testing.assert_array_equal(_one_round(kind, fresh).wait(), np.full(4, 2.0))


def test_a_call_given_up_by_another_thread_is_abandoned_by_the_one_inside_mpi_on_it(
        fresh, watchdog):
    """Rank 0's main thread blocks in MPI on its two calls (waiting for Y,
    made before the raise mode, whose peer comes late); a second thread
    waits for X past X's deadline and raises Stalled -- without cancelling
    or freeing X's requests under the main thread's wait (two threads in
    MPI on one request: a double free).  The main thread abandons X itself
    once its wait returns."""
    _need(fresh)
    if fresh.Get_size() != 2:
        pytest.skip("rank 1 alone answers the late call")
    other = MPI.COMM_WORLD.Dup()
    mar.setup(other)
    n = 1 << 10  # (below the progress thread's size: its caller advances it)
    if fresh.Get_rank() == 0:
        y = mar.iallreduce(np.ones(n), comm=other, algorithm="ring")
        watchdog(0.5)
        x = mar.iallreduce(np.ones(n), comm=fresh, algorithm="ring")  # (rank 1 never joins)
        seen = []

        def waiter():
            time.sleep(0.2)  # (the main thread is inside MPI on both calls by now)
            try:
                x.wait()
                seen.append("a result")
            except mar.Stalled:
                seen.append(len(x._op.requests()))  # left to the main thread's wait

        thread = threading.Thread(target=waiter)
        thread.start()
        np.testing.assert_array_equal(y.wait(), np.full(n, 2.0))
        thread.join(30)
        assert seen and seen[0] != "a result" and seen[0] > 0, seen
        assert x._op.done and not x._op.requests()  # (abandoned since, by the main thread)
    else:
        time.sleep(3)
        np.testing.assert_array_equal(
            mar.iallreduce(np.ones(n), comm=other, algorithm="ring").wait(), np.full(n, 2.0))
    other.Free()


@pytest.mark.parametrize("how", ["wait", "test"])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_without_threads_a_wait_that_raises_runs_the_callbacks_with_its_error(
        fresh, watchdog, monkeypatch, how, algorithm):
    """Where MPI runs no threads, the wait() or test() that completes a call
    runs its callbacks -- also one that ends it with an error (a stall,
    under raise): the callback's own wait raises that error, and so does
    the caller's, never a result (recursive doubling at 2 ranks is the
    one-round fast path, the ring at 2 ranks is not)."""
    from mpi_allreduce import engine, progress
    _need(fresh)
    for module in (engine, progress):
        monkeypatch.setattr(module, "mpi_threads", lambda: False)
    watchdog(0.5)
    if fresh.Get_rank() == 0:
        request = mar.iallreduce(np.ones(4), comm=fresh, algorithm=algorithm)
        seen = []

        def record(r):
            try:
                r.wait()
                seen.append("a result")
            except mar.Stalled as exc:
                seen.append(exc)
        request.add_done_callback(record)
        with pytest.raises(mar.Stalled) as raised:
            _wait_or_test(request, how)
        assert seen == [raised.value]
        with pytest.raises(mar.Stalled):  # (its error, again, not a result)
            request.wait()


@pytest.mark.parametrize("how", ["wait", "test"])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_an_interrupt_in_a_callback_of_a_completed_call_leaves_the_communicator_sound(
        fresh, monkeypatch, how, algorithm):
    """Where MPI runs no threads, the wait() or test() that completes a call
    runs its callbacks; an interrupt one raises (a signal handler's
    KeyboardInterrupt, say) is raised there -- the call complete, its result
    in place, the communicator sound, the next call exact -- never printed
    and dropped, and never a broken communicator from a call that
    completed (whether a callback runs at once or later is timing)."""
    from mpi_allreduce import engine, progress
    _need(fresh)
    for module in (engine, progress):
        monkeypatch.setattr(module, "mpi_threads", lambda: False)
    p = fresh.Get_size()
    x = np.arange(6.0) + fresh.Get_rank()
    request = mar.iallreduce(x, comm=fresh, algorithm=algorithm)
    ran = []

    def interrupted(r):
        raise KeyboardInterrupt("Ctrl-C in a callback")
    request.add_done_callback(interrupted)
    request.add_done_callback(lambda r: ran.append(r.wait().copy()))  # (its waiter, then)
    with pytest.raises(KeyboardInterrupt, match="in a callback"):
        _wait_or_test(request, how)
    assert len(ran) == 1
    np.testing.assert_array_equal(ran[0], np.arange(6.0) * p + p * (p - 1) / 2)
    y = mar.allreduce(np.ones(3), comm=fresh, algorithm=algorithm)
    np.testing.assert_array_equal(y, np.full(3, float(p)))


@pytest.mark.parametrize("how", ["wait", "test"])
def test_a_callback_that_waits_takes_the_error_and_the_caller_still_gets_it(fresh, watchdog,
                                                                            monkeypatch, how):
    """A call that ends with an error (an operation that raises inside the
    call, on every rank, under MPI_ALLREDUCE_ON_ERROR=raise), whose callback
    waits for it: the callback gets the error, and the caller's wait() or
    test() raises it too instead of returning the result as if nothing
    had happened."""
    from mpi_allreduce import progress
    _need(fresh)
    monkeypatch.setenv(config.ON_ERROR_ENV, "raise")
    monkeypatch.setattr(progress, "THREAD_MIN_BYTES", 1 << 40)  # (completed by its caller)
    config.refresh()
    try:
        def boom(a, b):
            raise ZeroDivisionError("an operation that fails")
        op = mar.user_op(boom, commute=True)
        # (a block for every rank: each reduces, so each raises; a rank with
        # nothing to reduce would wait for peers that raised)
        request = mar.iallreduce(np.ones(3 * fresh.Get_size() + 1), comm=fresh, op=op,
                                 algorithm="ring")
        seen = []

        def record(r):
            try:
                r.wait()
                seen.append("a result")
            except ZeroDivisionError as exc:
                seen.append(exc)
        request.add_done_callback(record)
        with pytest.raises(ZeroDivisionError, match="fails") as raised:
            if how == "wait":  # (the wait itself raises: no test() after it here)
                request.wait()
            else:
                _wait_or_test(request, how)
        assert seen == [raised.value]
    finally:
        monkeypatch.delenv(config.ON_ERROR_ENV)
        config.refresh()


BLOCKING_CALLS = {
    "allreduce": lambda c: mar.allreduce(np.ones(3), comm=c),
    "reduce_scatter": lambda c: mar.reduce_scatter(np.ones(3 * c.Get_size()), None, comm=c),
    "allgather": lambda c: mar.allgather(np.ones(2), None, comm=c),
    "reproducible sum": lambda c: mar.allreduce(np.ones(3), comm=c, reproducible=True),
    "live selection": lambda c: mar.allreduce(np.ones(3), comm=c, selection="live"),
    "Comm.Allreduce": lambda c: mar.Comm(c).Allreduce(np.ones(3), np.empty(3)),
}


@pytest.mark.skipif(not THREADS, reason="callbacks run on a progress thread only where MPI "
                                        "runs threads")
@pytest.mark.parametrize("kind", list(BLOCKING_CALLS))
def test_a_blocking_call_in_a_callback_completes_whichever_thread_runs_it(fresh, kind,
                                                                          monkeypatch):
    """The same blocking call in a completion callback, run on rank 0 by
    the progress thread (its call not complete when the callback is added)
    and on the other ranks at once by the caller's thread (its call already
    completed by the thread): each kind completes with its result on every
    rank -- a wait on the progress thread goes on advancing that thread's
    calls.  (Refusing it on the thread only would leave the ranks that ran
    it elsewhere waiting for rank 0.)"""
    from mpi_allreduce import progress
    _need(fresh)
    monkeypatch.setenv(config.PROGRESS_ENV, "thread")
    monkeypatch.setattr(progress, "THREAD_MIN_BYTES", 8)  # (completed by the thread)
    config.refresh()
    other = fresh.Dup()
    try:
        p = fresh.Get_size()
        call = BLOCKING_CALLS[kind]
        call(other)  # (the communicator's set-up)
        if fresh.Get_rank() != 0:
            time.sleep(0.05)  # (so rank 0 adds its callback before its call can complete)
        first = mar.iallreduce(np.ones(4), comm=fresh, algorithm="ring")
        if fresh.Get_rank() != 0:  # (completed on the thread, not yet waited)
            deadline = time.monotonic() + 20
            while not first._op.finished() and time.monotonic() < deadline:
                time.sleep(0.001)
        seen: list = []

        def blocking(request):
            try:
                seen.append(call(other))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                seen.append(exc)
        first.add_done_callback(blocking)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(seen) == 1 and not isinstance(seen[0], BaseException), seen
        if kind == "allreduce" or kind == "reproducible sum" or kind == "live selection":
            np.testing.assert_array_equal(seen[0], p)
        np.testing.assert_array_equal(first.wait(), p)
        np.testing.assert_array_equal(mar.allreduce(np.ones(2), comm=other), p)
    finally:
        other.Free()
        monkeypatch.delenv(config.PROGRESS_ENV)
        config.refresh()


@pytest.mark.skipif(not THREADS, reason="callbacks run on a progress thread only where MPI "
                                        "runs threads")
def test_callbacks_of_a_short_and_a_long_call_run_in_their_start_order(fresh):
    """A short call (its caller's, handed to the thread only as its callback
    is added) then a long one (the thread's from its start), each with a
    callback making a blocking all-reduce of its own value, one rank coming
    late each round: the short call's callback runs first on every rank
    (ordered by the thread's hand-over, the long call's ran first where it
    was in flight when the short one's callback came: every sum crossed)."""
    _need(fresh)
    other = fresh.Dup()
    try:
        rank, p = fresh.Get_rank(), fresh.Get_size()
        mar.allreduce(np.ones(4), comm=other)  # (its set-up)
        for round_ in range(2 * p):
            if rank == round_ % p:
                time.sleep(0.3)
            got: dict = {}
            done = threading.Semaphore(0)

            def make(k):
                def callback(request):
                    got[k] = mar.allreduce(np.full(4, 1000.0 * k + round_), comm=other)[0]
                    done.release()
                return callback
            short = mar.iallreduce(np.ones(8), comm=fresh)
            long_ = mar.iallreduce(np.ones(16384), comm=fresh)
            short.add_done_callback(make(0))
            long_.add_done_callback(make(1))
            for _ in range(2):
                assert done.acquire(timeout=60), (round_, got)
            assert got == {k: p * (1000.0 * k + round_) for k in (0, 1)}, (round_, got)
            mar.waitall([short, long_])
    finally:
        other.Free()


@pytest.mark.skipif(not THREADS, reason="the progress thread's calls only where MPI runs "
                                        "threads")
def test_an_interrupted_wait_stops_the_threads_call_so_late_peers_never_sum_new_data(
        fresh, watchdog):
    """Rank 0's wait() for a call of the thread's (128 KiB, in place) is
    interrupted while its peers come late; rank 0 then writes new values
    into the array: the peers' calls stall (raise mode) or get the sum,
    never rank 0's new values, and rank 0's array keeps them (before: the
    thread went on with the call, sending from the array rewritten, and
    wrote the sum over rank 0's new values seconds later)."""
    import signal

    _need(fresh)
    watchdog(3)
    rank, n = fresh.Get_rank(), 16384
    old = signal.getsignal(signal.SIGALRM)

    def interrupt(signum, frame):
        raise KeyboardInterrupt("timer")
    try:
        x = np.ones(n)
        if rank == 0:
            request = mar.iallreduce(MPI.IN_PLACE, x, comm=fresh, algorithm="ring")
            signal.signal(signal.SIGALRM, interrupt)
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # (inside the wait: the peers come at 1 s)
            with pytest.raises(KeyboardInterrupt):
                request.wait()
            x[:] = 1000.0
            time.sleep(4.5)  # (the peers come, then stall)
            assert (x == 1000.0).all(), "the thread wrote into the array after the interrupt"
        else:
            time.sleep(1.0)
            try:
                mar.iallreduce(MPI.IN_PLACE, x, comm=fresh, algorithm="ring").wait()
                assert (x == fresh.Get_size()).all(), x[:3]
            except mar.Stalled:
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    MPI.COMM_WORLD.Barrier()


def _started(request):
    """A persistent request, started."""
    request.start()
    return request


#: a call in flight, advanced by its caller (small), the progress thread
#: (128 KiB) or started from a persistent request
IN_FLIGHT = {
    "caller": (16, lambda comm, x: mar.iallreduce(MPI.IN_PLACE, x, comm=comm,
                                                   algorithm="ring")),
    "thread": (1 << 14, lambda comm, x: mar.iallreduce(MPI.IN_PLACE, x, comm=comm,
                                                        algorithm="ring")),
    "persistent": (16, lambda comm, x: _started(
        mar.allreduce_init(MPI.IN_PLACE, x, comm=comm, algorithm="ring"))),
    "one-round": (16, lambda comm, x: mar.iallreduce(MPI.IN_PLACE, x, comm=comm,
                                                      algorithm="recursive_doubling")),
    "one-round-persistent": (16, lambda comm, x: _started(
        mar.allreduce_init(MPI.IN_PLACE, x, comm=comm, algorithm="recursive_doubling"))),
}


@pytest.mark.parametrize("kind", list(IN_FLIGHT))
def test_a_call_in_flight_when_its_communicator_breaks_posts_nothing_more(fresh, watchdog,
                                                                          kind):
    """Rank 0 starts a ring all-reduce (several stages), then its next call
    on the communicator stalls (raise mode), which breaks it; rank 0 writes
    new values into the first call's array, and only then do the peers
    start it.  Rank 0's call posts no later stage (its wait raises, unless
    its last stage was posted before the break), so the peers get the sum
    or stall, never rank 0's new values (before: a call its caller or the
    thread advanced went on, sending from the array written since)."""
    _need(fresh)
    watchdog(1.0)
    p, rank = fresh.Get_size(), fresh.Get_rank()
    n, start = IN_FLIGHT[kind]
    x = np.arange(float(n)) + rank
    want = p * np.arange(float(n)) + p * (p - 1) / 2
    if rank == 0:
        request = start(fresh, x)
        with pytest.raises(mar.Stalled):
            mar.allreduce(np.ones(2), comm=fresh, algorithm="ring")  # (the peers never come)
        x[:] = 1000.0
    MPI.COMM_WORLD.Barrier()
    try:
        (request if rank == 0 else start(fresh, x)).wait()
        np.testing.assert_array_equal(x, want)
    except (mar.Broken, mar.Stalled):
        pass
    MPI.COMM_WORLD.Barrier()


@pytest.mark.skipif(not THREADS, reason="callbacks run on a progress thread only where MPI "
                                        "runs threads")
@pytest.mark.parametrize("late", ["as-started", "added-late"])
def test_callbacks_of_calls_on_one_communicator_run_in_their_start_order(fresh, late):
    """Three all-reduces of 512 KiB on one communicator, started in the same
    order everywhere, each with a callback (added as it starts) that makes a
    blocking all-reduce of its own value on another: whatever order they
    complete in on each rank, the callbacks run in the calls' order, so
    every callback gets its own value's sum (before: a rank whose calls
    completed in another order ran them in that order, and the blocking
    calls met crosswise -- 120, 210, 12, ...: wrong, silently; in 5 of 30
    rounds at 3 ranks).  ``added-late``: the last call's callback is added
    once its call is complete (not waited), while the others' may still be
    to run: it runs after them, on the thread (run at once, it crossed them
    or met one on another thread: ConcurrentCall)."""
    _need(fresh)
    other = fresh.Dup()
    try:
        p, n = fresh.Get_size(), 1 << 16
        mar.allreduce(np.ones(4), comm=other)  # (its set-up)
        for round_ in range(12):
            got: dict = {}

            def make(k):
                def callback(request):
                    got[k] = mar.allreduce(np.full(4, 10.0 ** k), comm=other)[0]
                return callback
            requests = [mar.iallreduce(np.ones(n), np.empty(n), comm=fresh, algorithm="ring")
                        for _ in range(3)]
            for k, request in enumerate(requests):
                if late == "added-late" and k == 2:
                    # (512 KiB: the thread's from its start; complete, not waited)
                    deadline = time.monotonic() + 30
                    while not request._op.done and time.monotonic() < deadline:
                        time.sleep(0.0005)
                request.add_done_callback(make(k))
            mar.waitall(requests)
            deadline = time.monotonic() + 30
            while len(got) < 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert got == {k: p * 10.0 ** k for k in range(3)}, (round_, got)
    finally:
        other.Free()


@pytest.mark.skipif(not THREADS, reason="callbacks run on a progress thread only where MPI "
                                        "runs threads")
def test_callbacks_run_one_at_a_time_so_their_blocking_calls_never_cross(fresh):
    """Two callbacks, each making one blocking all-reduce (ring) on a
    second communicator, in the same order on every rank; on rank 0 the
    second is due while the first's call waits for the other ranks (they
    add it only once their first is over).  Callbacks run one at a time,
    so the second call starts after the first is complete: every rank gets
    both sums (run inside the first's wait, it crossed the first's messages
    and summed the wrong data, or MPI aborted the job)."""
    _need(fresh)
    other = fresh.Dup()
    try:
        rank, p, n = fresh.Get_rank(), fresh.Get_size(), 6
        mar.allreduce(np.ones(n), comm=other, algorithm="ring")  # (its set-up)
        results: dict = {}

        def make(k):
            def callback(request):
                try:
                    if k == 1 and rank != 0:
                        time.sleep(0.2)
                    results[k] = mar.allreduce(np.full(n, float(k)), comm=other,
                                               algorithm="ring").tolist()
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    results[k] = exc
            return callback
        first = mar.iallreduce(np.ones(4), comm=fresh, algorithm="recursive_doubling")
        second = mar.iallreduce(np.ones(4), comm=fresh, algorithm="recursive_doubling")
        first.add_done_callback(make(1))
        deadline = time.monotonic() + 30
        if rank != 0:
            while 1 not in results and time.monotonic() < deadline:
                time.sleep(0.001)
        second.add_done_callback(make(2))
        while len(results) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert results == {1: [1.0 * p] * n, 2: [2.0 * p] * n}, results
        first.wait()
        second.wait()
    finally:
        other.Free()


@pytest.mark.parametrize("kind", ["non-blocking", "persistent"])
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_without_threads_a_callback_waits_for_its_own_call_and_adds_more(
        fresh, monkeypatch, algorithm, kind):
    """Where MPI runs no threads, the wait() that completes a call runs its
    callbacks while the request is still its callbacks' to wait: a
    callback's wait() returns the sum (the one-round fast path -- recursive
    doubling at 2 ranks -- said "already complete" before), and a callback
    added inside a callback runs at once."""
    from mpi_allreduce import engine, progress
    _need(fresh)
    for module in (engine, progress):
        monkeypatch.setattr(module, "mpi_threads", lambda: False)
    p = fresh.Get_size()
    x, out = np.ones(4), np.empty(4)
    request = mar.allreduce_init(x, out, comm=fresh, algorithm=algorithm) \
        if kind == "persistent" else None
    for _ in range(3):
        if request is None:
            r = mar.iallreduce(x, out, comm=fresh, algorithm=algorithm)
        else:
            r = request
            r.start()
        seen: list = []

        def callback(req):
            req.add_done_callback(lambda again: seen.append("added inside"))
            seen.append(req.wait().tolist())
        r.add_done_callback(callback)
        np.testing.assert_array_equal(r.wait(), p)
        assert seen == ["added inside", [float(p)] * 4], seen
    if request is not None:
        request.free()


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_without_threads_a_persistent_call_restarted_by_its_callback_goes_on(
        fresh, monkeypatch, algorithm):
    """Where MPI runs no threads, a persistent request whose callback waits
    for it and starts it again: the restarted call stays active (it was
    marked complete under its own feet before, and its MPI requests were
    then started twice), and its next wait gives the next sum."""
    from mpi_allreduce import engine, progress
    _need(fresh)
    for module in (engine, progress):
        monkeypatch.setattr(module, "mpi_threads", lambda: False)
    p = fresh.Get_size()
    x, out = np.ones(5), np.empty(5)
    request = mar.allreduce_init(x, out, comm=fresh, algorithm=algorithm)
    sums: list = []

    def again(req):
        sums.append(req.wait()[0])
        if len(sums) < 3:
            req.start()
            req.add_done_callback(again)
    request.start()
    request.add_done_callback(again)
    for _ in range(3):
        request.wait()
    assert sums == [float(p)] * 3, sums
    with pytest.raises(mar.RequestError):
        request.wait()
    request.free()


def test_callbacks_added_from_another_thread_run_once(fresh):
    """A request started on one thread, its callback added from another
    while the call may be completing (on the progress thread, or by the
    starter's wait): the callback runs exactly once, with the sum there."""
    p = fresh.Get_size()
    x, out = np.ones(6), np.empty(6)
    for round_ in range(40):
        request = mar.iallreduce(x, out, comm=fresh,
                                 algorithm="ring" if round_ % 2 else "recursive_doubling")
        seen: list = []
        adder = threading.Thread(
            target=request.add_done_callback,
            args=(lambda r: seen.append(r.wait().copy() if round_ % 4 < 2 else out.copy()),))
        adder.start()
        adder.join()
        if round_ % 4 >= 2:
            request.wait()
        deadline = time.monotonic() + 20
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.002)
        assert len(seen) == 1, seen
        np.testing.assert_array_equal(seen[0], p)


@pytest.mark.parametrize("how", ["wait", "test"])
def test_mpis_own_requests_go_through_the_engine_and_its_watchdog(fresh, watchdog, how):
    """MPI's requests handed to the engine (the torch backend's broadcasts,
    gathers, receives): waited beside the library's calls in any order,
    and in the raise mode a receive nobody sends to raises Stalled naming
    the call, is cancelled and tells its owner."""
    from mpi_allreduce.progress import mpi_request
    _need(fresh)
    rank, p = fresh.Get_rank(), fresh.Get_size()
    value = np.full(1, rank, np.int64)
    status = MPI.Status()
    posted = [fresh.Irecv(value, (rank - 1) % p, 5),
              fresh.Isend(np.full(1, rank, np.int64), (rank + 1) % p, 5)]
    ring = mpi_request(posted, "a ring of sends", fresh, [status, MPI.Status()])
    ours = mar.iallreduce(np.ones(3), comm=fresh)
    np.testing.assert_array_equal(ours.wait(), np.full(3, p))
    ring.wait()
    assert value[0] == (rank - 1) % p and status.Get_source() == (rank - 1) % p
    watchdog(0.5)  # (set after the calls that must pass, which a late peer only delays)
    told = []
    lonely = mpi_request([fresh.Irecv(np.empty(1), MPI.ANY_SOURCE, 6)], "a lonely receive",
                         fresh, cancel=True, on_stall=told.append)
    with pytest.raises(mar.Stalled, match="a lonely receive"):
        _wait_or_test(lonely, how)
    assert len(told) == 1 and "a lonely receive" in told[0]
    fresh.Barrier()


@pytest.mark.skipif(not THREADS, reason="needs MPI_THREAD_MULTIPLE")
def test_watchdog_names_the_stalled_call_while_another_thread_makes_calls(watchdog, capfd):
    """Warn mode: one thread waits in a call on one communicator; the main
    thread keeps making calls on another.  The report names the waiting
    call and its thread (before: one global slot, overwritten by the main
    thread's calls, and no report)."""
    world = MPI.COMM_WORLD
    _need(world)
    watchdog(0.5, "warn")
    slow, busy = world.Dup(), world.Dup()
    mar.setup(slow)
    mar.setup(busy)
    late = np.arange(7.0)

    def waiter():
        mar.allreduce(late, comm=slow, algorithm="ring")
    thread = threading.Thread(target=waiter, name="stuck-thread")
    if world.Get_rank() == 0:
        thread.start()
    for _ in range(40):  # about 2 s of the main threads' calls on the other communicator
        mar.allreduce(np.ones(2), comm=busy, algorithm="ring")
        time.sleep(0.05)
    if world.Get_rank() != 0:
        waiter()
    thread.join(timeout=30) if world.Get_rank() == 0 else None
    err = capfd.readouterr().err
    if world.Get_rank() == 0:
        assert not thread.is_alive()
        assert "thread 'stuck-thread'" in err and "allreduce of 7 x float64" in err, err
    slow.Free()
    busy.Free()


@pytest.mark.skipif(not THREADS, reason="needs MPI_THREAD_MULTIPLE")
@pytest.mark.parametrize("mode", ["caller", "thread"])
def test_a_request_waited_from_another_thread(fresh, monkeypatch, mode):
    monkeypatch.setenv(config.PROGRESS_ENV, mode)
    config.refresh()
    x = np.arange(100000.0) + fresh.Get_rank()
    request = mar.iallreduce(x, comm=fresh, algorithm="ring")
    result = []
    thread = threading.Thread(target=lambda: result.append(request.wait()))
    thread.start()
    thread.join(timeout=60)
    monkeypatch.undo()
    config.refresh()
    assert not thread.is_alive(), "the wait from another thread never returned"
    p = fresh.Get_size()
    np.testing.assert_array_equal(result[0], p * np.arange(100000.0) + p * (p - 1) / 2)


def test_calls_waited_by_another_thread_do_not_pile_up_in_their_starters_list(fresh):
    """A thread that starts calls another thread waits for (torch's
    completion thread waits for DDP's): its list of calls to advance keeps
    only those in flight, however many it starts."""
    from mpi_allreduce.progress import _ENGINE, _PRUNE
    x = np.ones(4)
    for _ in range(5 * _PRUNE):
        request = mar.iallreduce(x, comm=fresh, algorithm="ring")
        waiter = threading.Thread(target=request.wait)
        waiter.start()
        waiter.join(timeout=60)
        assert not waiter.is_alive()
    assert len(_ENGINE.caller) <= _PRUNE  # (all 320 before)


def test_a_rank_whose_peers_are_late_leaves_its_core_in_raise_mode(fresh, watchdog):
    """The raise mode polls; past its first millisecond the wait sleeps
    between polls (``engine.SPIN_SECONDS``, ``NAP_SECONDS``): rank 0, whose
    peers come 0.5 s late, spends under a quarter of that wait on the CPU
    (a spinning wait spent all of it that a core gave it, and on an
    oversubscribed node took that core from the late peers; the naps' own
    wake-ups, beside other processes, once took an eighth under MPICH) and
    gets the sum.  Judged after every rank's numbers are gathered."""
    _need(fresh)
    watchdog(30)
    p, r = fresh.Get_size(), fresh.Get_rank()
    fresh.Barrier()  # (so rank 0 starts first, however late it came)
    if r != 0:
        time.sleep(0.5)
    wall, cpu = time.monotonic(), time.thread_time()
    out = mar.allreduce(np.full(4, float(r + 1)), comm=fresh, algorithm="ring")
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    seen = MPI.COMM_WORLD.allgather((wall, cpu, out.tolist()))
    assert all(got == [p * (p + 1) / 2] * 4 for _, _, got in seen), seen
    wall, cpu, _ = seen[0]
    assert wall > 0.3 and cpu < 0.25 * wall, \
        f"rank 0 waited {wall:.3f} s, {cpu:.3f} s of it on the CPU"


# --- threads, lifetimes --------------------------------------------------------------------

@pytest.mark.skipif(not THREADS, reason="needs MPI_THREAD_MULTIPLE")
def test_two_threads_on_one_communicator_are_refused(fresh):
    """Rank 0's second thread calls while its first waits inside a call:
    ConcurrentCall, which breaks the communicator there.  The first
    thread's call still completes (its peers are in it), but raises Broken
    rather than hand back a result that, on some peer, may have paired with
    the other thread's call; every later call on rank 0 raises at once
    (before: the communicator stayed usable, and two threads that kept
    calling paired crosswise with their peers' threads, summing the wrong
    data silently)."""
    _need(fresh)
    mar.setup(fresh)
    x = np.arange(5.0)
    result = []

    def first():
        try:
            result.append(mar.allreduce(x, comm=fresh, algorithm="ring"))
        except mar.Broken as exc:
            result.append(exc)
    if fresh.Get_rank() == 0:
        thread = threading.Thread(target=first)
        thread.start()
        time.sleep(0.3)  # the thread waits in its call: the others come later
        with pytest.raises(mar.ConcurrentCall, match="two threads"):
            mar.allreduce(x, comm=fresh, algorithm="ring")
        with pytest.raises(mar.Broken, match="two threads"):  # (the refusal broke it)
            mar.iallreduce(x, comm=fresh, algorithm="ring")
        fresh.send(None, dest=1)  # now the others may enter
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert isinstance(result[0], mar.Broken) and "two threads" in str(result[0])
        with pytest.raises(mar.Broken, match="two threads"):
            mar.allreduce(x, comm=fresh, algorithm="ring")
    else:
        if fresh.Get_rank() == 1:
            fresh.recv(source=0)
        first()
        np.testing.assert_array_equal(result[0], x * fresh.Get_size())


@pytest.mark.skipif(not THREADS, reason="needs MPI_THREAD_MULTIPLE")
def test_threads_that_clash_on_every_rank_never_return_each_others_sums(fresh):
    """Two threads per rank call on one communicator, a different one first
    on even and odd ranks, each with its own value: each rank's first call
    pairs with the other thread's on its neighbours.  The second thread is
    refused (ConcurrentCall) while the first is inside (a slow reduction
    keeps it there), which breaks the communicator: the first raises Broken
    as it ends instead of returning a sum of the other thread's data, and
    no later call returns either (before: both first calls returned 101
    where each thread expected 2 or 200, and the survivors went on pairing
    crosswise, silently)."""
    _need(fresh)
    rank, p = fresh.Get_rank(), fresh.Get_size()
    slow = threading.Event()

    def slow_add(a, b):
        if slow.is_set():
            time.sleep(0.5)
        return a + b
    op = mar.user_op(slow_add, commute=True, name="slow add")
    mar.allreduce(np.ones(4), op=op, comm=fresh, algorithm="ring")  # (planned, set up)
    slow.set()
    value = {"a": 1.0, "b": 100.0}
    outcomes: dict = {}

    def call(name):
        try:
            for _ in range(3):
                out = mar.allreduce(np.full(4, value[name]), op=op, comm=fresh,
                                    algorithm="ring")
                outcomes.setdefault(name, []).append(
                    "exact" if (out == value[name] * p).all() else f"WRONG {out[0]}")
        except (mar.ConcurrentCall, mar.Broken) as exc:
            outcomes.setdefault(name, []).append(type(exc).__name__)
    first, second = ("a", "b") if rank % 2 == 0 else ("b", "a")
    thread = threading.Thread(target=call, args=(first,))
    thread.start()
    time.sleep(0.25)  # (the first is inside its slow reduction)
    call(second)
    thread.join(60)
    everyone = fresh.allgather(outcomes)
    assert not any(o.startswith("WRONG") for got in everyone for seen in got.values()
                   for o in seen), everyone
    assert outcomes == {first: ["Broken"], second: ["ConcurrentCall"]}, everyone


def test_free_with_a_call_in_flight_completes_it():
    comm = MPI.COMM_WORLD.Dup()
    x = np.arange(50.0) + comm.Get_rank()
    request = mar.iallreduce(x, comm=comm, algorithm="ring")
    comm.Free()
    out = request.wait()
    p = MPI.COMM_WORLD.Get_size()
    np.testing.assert_array_equal(out, p * np.arange(50.0) + p * (p - 1) / 2)


def test_repr_of_a_null_comm():
    assert "null" in repr(mar.Comm(MPI.COMM_NULL))
    assert "null" in repr(mar.Comm())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_dropped_fusions_and_persistent_requests_free_what_they_hold(trio):
    a, b = np.ones(100), np.ones(50, np.float32)

    def fusions(n):
        for _ in range(n):
            fusion = mar.Fusion(trio, op="max", bucket_bytes=1 << 20)
            fusion.add(a)
            fusion.add(b)
            fusion.wait()

    def persistents(n):
        for _ in range(n):
            request = mar.allreduce_init(MPI.IN_PLACE, a, "max", comm=trio)
            request.start()
            request.wait()

    fusions(200)
    persistents(500)
    gc.collect()
    before = _rss()
    fusions(2000)
    persistents(10000)
    gc.collect()
    grown = _rss() - before
    assert grown < 8 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
    assert len(context_for(trio).holders) < 10, "tags of dropped requests still held"


def test_reproducible_sums_of_two_dtypes_of_one_shape_keep_their_own_identity(fresh, watchdog):
    """Every rank sums float32 reproducibly, then rank 0 sums float16 of the
    same length while the others sum float32 again: a mismatch, which must
    stall (before: the float16 call reused the float32 call's kept inner
    calls, whose spec carried float32, and returned)."""
    _need(fresh)
    p = fresh.Get_size()
    first = mar.allreduce(np.ones(8, np.float32), None, "sum", comm=fresh, reproducible=True)
    assert first[0] == p
    watchdog(0.5)  # (set after the call that must pass: a peer late by 0.5 s is no mismatch)
    data = np.ones(8, np.float16 if fresh.Get_rank() == 0 else np.float32)
    _disagree(fresh, lambda: mar.allreduce(data, None, "sum", comm=fresh, reproducible=True),
              data * p)


def test_split_communicators_get_the_mpis_whole_tag_space(comm):
    """MPI attaches MPI_TAG_UB to COMM_WORLD; a Split communicator (and
    its Dup) may not carry it.  Its calls still get the MPI's whole tag
    space, not the standard's minimum (before: 768 non-blocking calls in
    flight on a Split communicator, and 2^14 blocking tags)."""
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    _need(comm)
    mar.allreduce(np.ones(2), comm=comm, algorithm="ring")
    context = context_for(comm)
    assert context.tags == tag_layout(ub)
    assert all(plan.tag >= tag_layout(ub).blocking for plan in context.plans.values())
