"""The guarantees by construction, one test per class of failure and kind of call.

* An exception that leaves a call on one rank (an interrupt too) breaks the
  communicator there: the next call raises ``Broken`` at once, the peers
  stall and are reported, and nobody gets a wrong result.
* Decisions that shape the messages are agreed: auto's decision table,
  live selection's syncs.
* Every MPI call of the library is watched: the set-up of a communicator
  and check mode's agreement, a peer that never comes is reported.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config
from mpi_allreduce.context import context_for

from .helpers import interrupt_once, raise_mode, restore_watchdog
from .test_bad_input_mpi import raising_watchdog  # noqa: F401 - a fixture

pytestmark = pytest.mark.mpi

COUNT = 3000


def interrupting_sum(rank: int, at: int = 2):
    """A sum as a user op that raises KeyboardInterrupt in its ``at``-th
    combination on rank 0 (as Ctrl-C between two rounds would)."""
    calls = [0]

    def add(a, b):
        calls[0] += 1
        if rank == 0 and calls[0] == at:
            raise KeyboardInterrupt("between rounds")
        return a + b
    return mar.user_op(add, commute=True, name="interrupting_sum")


def _blocking(data, op, comm):
    return mar.allreduce(data, None, op, comm=comm, algorithm="ring", segment_size=64 * 8)


def _nonblocking(data, op, comm):
    return mar.iallreduce(data, None, op, comm=comm, algorithm="ring",
                          segment_size=64 * 8).wait()


def _persistent(data, op, comm):
    request = mar.allreduce_init(data, None, op, comm=comm, algorithm="ring",
                                 segment_size=64 * 8)
    request.start()
    return request.wait()


def _persistent_once(data, comm):
    with mar.allreduce_init(data, None, comm=comm) as request:
        request.start()
        return request.wait().copy()


def _reduce_scatter(data, op, comm):
    return mar.reduce_scatter(data, None, op, comm=comm, segment_size=64 * 8)


def _fusion(data, op, comm):
    from mpi_allreduce.fusion import Fusion

    fusion = Fusion(comm, op=op, bucket_bytes=1 << 10)
    halves = np.split(data, 2)
    for half in halves:
        fusion.add(half)
    fusion.wait()
    return np.concatenate(halves)


def _comm(data, op, comm):
    out = np.empty_like(data)
    mar.Comm(comm, algorithm="ring", segment_size=64 * 8).Allreduce(data, out, op)
    return out


def _short(call):
    """``call`` on the first SHORT elements: one round of messages on 2
    ranks (the one-round fast path of non-blocking and persistent calls)."""
    return lambda data, op, comm: call(data[:SHORT], op, comm)


SHORT = 4

#: kind -> (what runs it, the elements it reduces)
KINDS = {"allreduce": (_blocking, COUNT), "iallreduce": (_nonblocking, COUNT),
         "allreduce_init": (_persistent, COUNT), "reduce_scatter": (_reduce_scatter, COUNT),
         "fusion": (_fusion, COUNT), "Comm.Allreduce": (_comm, COUNT),
         "iallreduce short": (_short(_nonblocking), SHORT),
         "allreduce_init short": (_short(_persistent), SHORT)}


def _exact(kind, comm):
    count = KINDS[kind][1]
    total = sum(np.arange(count, dtype=np.float64) + r for r in range(comm.Get_size()))
    if kind != "reduce_scatter":
        return total
    counts = [COUNT // comm.Get_size() + (r < COUNT % comm.Get_size())
              for r in range(comm.Get_size())]
    start = sum(counts[:comm.Get_rank()])
    return total[start:start + counts[comm.Get_rank()]]


def _outcome(run, exact) -> str:
    """What one attempt of an interrupted-call test saw on this rank: the
    exact result, a wrong one, the interrupt, or the Broken/Stalled it
    raised -- judged by :func:`_judge` on every rank at once."""
    try:
        return "exact" if np.array_equal(run(), exact) else "wrong"
    except KeyboardInterrupt:
        return "interrupted"
    except mar.Broken as exc:  # (Stalled is a Broken)
        return type(exc).__name__


def _judge(outcomes: list, world) -> None:
    """Rank 0 was interrupted, then refused; no peer's retry met the
    interrupted call's messages; some rank was told of the stall.  Every
    rank's outcomes are gathered first, so that a failure on one rank is
    a failure on all, never a peer left in a collective it skipped."""
    everyone = world.allgather(outcomes)
    assert everyone[0] == ["interrupted", "Broken"], everyone
    assert all(peer[0] != "interrupted" and "wrong" not in peer and peer[1] != "exact"
               for peer in everyone[1:]), \
        f"a peer's retry met the interrupted call's messages (or summed wrong): {everyone}"
    assert any("Stalled" in peer for peer in everyone), everyone  # (the peers were told)


def _interrupted_by_a_timer(run, exact, rank: int) -> list:
    """Two attempts of ``run``, each as :func:`_outcome` saw it: in the
    first, Ctrl-C (SIGINT's handler, from a timer) lands on rank 0 while it
    waits inside ``run`` for its peers, which come 1 s late; the second is
    the retry.  For a call with no reduction to raise from (an allgather)
    or one whose wait is not the library's own (the torch backend's)."""
    import signal

    outcomes = []
    for attempt in range(2):
        previous = signal.getsignal(signal.SIGALRM)
        if rank == 0 and attempt == 0:
            signal.signal(signal.SIGALRM, signal.default_int_handler)
            signal.setitimer(signal.ITIMER_REAL, 0.1)  # (the raise mode's wait polls)
        elif attempt == 0:
            time.sleep(1.0)  # (rank 0 waits for this rank meanwhile)
        try:
            outcomes.append(_outcome(run, exact))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return outcomes


@pytest.fixture
def interrupt_watchdog(monkeypatch):
    """The watchdog's raise mode for the interrupted-call tests: patient on
    rank 0, which must reach its interrupt even when its peers are slow to
    be scheduled (8 oversubscribed ranks beside other launches: a wait of
    0.5 s for a message, raised as a stall, once failed the test); 1 s on
    the others, which wait that long once for the interrupted rank (each
    such test costs its peers' limit at every world size it runs at)."""
    yield from raise_mode(monkeypatch, 30 if MPI.COMM_WORLD.Get_rank() == 0 else 1)


@pytest.fixture
def peers_world():
    """A fresh duplicate of the world, for a test in which a rank waits for
    its peers or takes a way of its own (skipped on one rank)."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to wait for or differ from")
    return world.Dup()


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_interrupt_breaks_the_communicator_never_a_wrong_result(interrupt_watchdog, kind):
    """Rank 0 is interrupted inside a call and calls again: there it raises
    Broken at once; the peers either had all they needed (the exact
    result) or stall and raise; the retried call never meets the
    interrupted call's messages."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    comm = world.Dup()
    rank = comm.Get_rank()
    data = np.arange(COUNT, dtype=np.float64) + rank
    call, count = KINDS[kind]
    # (a short call combines once per rank: interrupted in its first)
    outcomes = [_outcome(lambda: call(data.copy(), interrupting_sum(rank, 2 if count > SHORT
                                                                    else 1), comm),
                         _exact(kind, comm)) for _ in range(2)]
    _judge(outcomes, world)
    comm.Free()


def test_an_interrupt_in_another_call_is_raised_by_the_wait_it_landed_in(monkeypatch, watchdog):
    """Rank 0 waits for call A while its call B is interrupted (B's
    reduction, advanced by A's wait, raises KeyboardInterrupt): A's wait
    raises the interrupt -- the caller is told of it where it landed, never
    only of the broken communicator -- and B's own wait then raises
    Broken, not the interrupt a second time.  A is on a second
    communicator whose peers join only once B is over, so A cannot
    complete first.  The peers return exact results or stall."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    first, second = world.Dup(), world.Dup()
    for comm in (first, second):
        mar.setup(comm)  # (collective: ahead, so that the calls' order alone differs)
    watchdog(3)  # (patient: rank 1's messages must come first)
    rank = world.Get_rank()
    data = np.arange(COUNT, dtype=np.float64) + rank
    exact = sum(np.arange(COUNT, dtype=np.float64) + r for r in range(world.Get_size()))
    outcomes = {}

    def outcome(name, request):
        try:
            np.testing.assert_array_equal(request.wait(), exact)
            outcomes[name] = "exact"
        except KeyboardInterrupt:
            outcomes[name] = "interrupted"
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes[name] = type(exc).__name__

    def start(comm, op="sum"):
        return mar.iallreduce(data.copy(), None, op, comm=comm, algorithm="ring",
                              segment_size=64 * 8)

    try:
        if rank == 0:
            a, b = start(first), start(second, interrupting_sum(rank, 1))
            outcome("A", a)
            outcome("B", b)
            assert outcomes == {"A": "interrupted", "B": "Broken"}, outcomes
        else:  # (B first, then A: A's peer joins only once B is over)
            outcome("B", start(second, interrupting_sum(rank, 1)))
            outcome("A", start(first))
            assert set(outcomes.values()) <= {"exact", "Stalled", "Broken"}, outcomes
    finally:
        restore_watchdog(monkeypatch)
    world.Barrier()
    first.Free()
    second.Free()


def test_another_thread_is_refused_for_the_whole_of_a_composite_call():
    """The guard covers a reproducible sum from its first to its last
    message: a second thread that calls on the same communicator while it
    runs gets ConcurrentCall, never shares its work arrays, and the
    communicator is broken on that rank."""
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("a call on one rank sends nothing and takes no guard")
    comm = MPI.COMM_WORLD.Dup()
    data = np.arange(50_000, dtype=np.float64) * 0.1
    context = context_for(comm)
    seen = []
    entered = threading.Event()
    release = threading.Event()

    def other():
        entered.wait(30)
        try:
            mar.allreduce(data, comm=comm, reproducible=True)
            seen.append("ran")
        except mar.ConcurrentCall:
            seen.append("refused")
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    context.guard.acquire()  # as a call in progress on this thread holds it
    try:
        entered.set()
        release.wait(30)
    finally:
        context.guard.release()
    thread.join(30)
    assert seen == ["refused"]
    with pytest.raises(mar.Broken, match="two threads"):  # (the refusal broke it)
        mar.allreduce(data, comm=comm, reproducible=True)
    comm.Free()


def _table(path, algorithm):
    import json

    path.write_text(json.dumps({"rules": [{"comm_size": 1, "table": [
        {"max_bytes": None, "algorithm": algorithm}]}]}))
    return str(path)


def test_a_default_table_found_on_some_ranks_only_is_agreed(tmp_path, monkeypatch):
    """A table that rank 0 finds and the others don't (nodes of different
    sizes find different measured tables): every rank runs the built-in
    one, rank 0 is warned, the sums are right."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank agrees with itself")
    if world.Get_rank() == 0:
        monkeypatch.setenv("MPI_ALLREDUCE_TUNING", _table(tmp_path / "t.json", "driver"))
    config.refresh()
    comm = world.Dup()
    data = np.arange(1000, dtype=np.float64)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mar.allreduce(data, comm=comm)
        assert np.array_equal(out, data * comm.Get_size())
        warned = any("different decision tables" in str(w.message) for w in caught)
        assert warned == (world.Get_rank() == 0)
    finally:
        monkeypatch.undo()
        config.refresh()
        comm.Free()


def test_a_named_table_that_differs_between_ranks_raises_on_every_rank(tmp_path):
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank agrees with itself")
    path = _table(tmp_path / f"t{world.Get_rank()}.json",
                  "driver" if world.Get_rank() == 0 else "ring")
    # every rank names "the same" file, whose content differs between ranks
    comm = world.Dup()
    with pytest.raises(ValueError, match="differs between ranks"):
        mar.allreduce(np.ones(10), comm=comm, tuning=path)
    out = mar.allreduce(np.ones(10), comm=comm)  # nothing broken
    assert np.array_equal(out, np.full(10, comm.Get_size()))
    comm.Free()


def test_a_table_one_rank_cannot_read_raises_on_every_rank(tmp_path):
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("a call on one rank runs no algorithm: no table is read")
    path = tmp_path / "table.json"
    if world.Get_rank() != 0:
        _table(path, "ring")
    comm = world.Dup()
    with pytest.raises(ValueError, match="cannot be read on rank"):
        mar.allreduce(np.ones(10), comm=comm, tuning=str(path))
    comm.Free()


def test_live_selection_syncs_at_one_call_whatever_arrays_each_rank_uses(comm):
    """One rank alternates two pairs of arrays, the others use one pair:
    the selector counts calls per shape, so every rank syncs at the same
    call (counting per pair left one rank in the sync's collective)."""
    count = 4096  # 32 KiB: live selection's size
    pairs = [(np.full(count, 1.0), np.empty(count)) for _ in range(2)]
    alternate = comm.Get_rank() == 0
    for i in range(200):
        send, recv = pairs[i % 2 if alternate else 0]
        mar.allreduce(send, recv, comm=comm, selection="live")
        assert recv[0] == comm.Get_size() and recv[-1] == comm.Get_size()


def test_live_selectors_are_bounded_and_evicted_alike_on_every_rank(comm, monkeypatch):
    """More call shapes than selectors kept: the least recently used goes
    first, on every rank alike (a runner finds its shape's selector per
    call, never keeps an evicted one), so the syncs still meet."""
    from mpi_allreduce import context as context_module

    monkeypatch.setattr(context_module, "MAX_SELECTORS", 2)
    counts = [2048, 3072, 4096]  # float64: all at or above live selection's size
    arrays = {n: [(np.full(n, 1.0), np.empty(n)) for _ in range(3)] for n in counts}
    for i in range(300):
        n = counts[2] if i % 100 == 99 else counts[i % 2]  # the third evicts one
        # rank 0: other arrays, new ones after an eviction; the others: the same
        pair = (i // 2) % 2 + (i > 150) if comm.Get_rank() == 0 else 0
        send, recv = arrays[n][pair]
        mar.allreduce(send, recv, comm=comm, selection="live")
        assert recv[0] == comm.Get_size() and recv[-1] == comm.Get_size()
    if comm.Get_size() > 1:
        selectors = context_for(comm).selectors
        assert len(selectors) <= 2
        assert max(s.made for s in selectors.values()) >= 64  # past a sync


@pytest.mark.parametrize("where", ["set-up", "check"])
def test_a_peer_that_never_comes_to_a_collective_is_reported(raising_watchdog, where):
    """The set-up of a communicator (MPI_Comm_idup) and check mode's
    agreement are watched as calls are: in raise mode the ranks that wait
    raise Stalled instead of waiting in MPI forever."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank never waits for a peer")
    from mpi_allreduce.engine import ABANDONED

    comm = world.Dup()
    if where == "check":
        mar.setup(comm)
    late = comm.Get_rank() == 0
    before = len(ABANDONED)  # (earlier tests' abandoned requests are not this test's)
    if not late:
        with pytest.raises(mar.Stalled, match="set-up|agreement"):
            mar.allreduce(np.ones(4), comm=comm, check=where == "check")
        with pytest.raises(mar.Broken):  # and the communicator stays unusable
            mar.allreduce(np.ones(4), comm=comm)
    world.Barrier()
    # the late rank completes the collective the others gave up on, and
    # they complete their requests of it: nothing is left pending when the
    # communicator is freed or MPI finalised
    if not late:
        # (its requests: a call an earlier test dropped in flight may be kept
        # here meanwhile, as the garbage collector frees its request)
        MPI.Request.Waitall([r for r in ABANDONED[before:] if isinstance(r, MPI.Request)])
        del ABANDONED[before:]
    if late:
        if where == "set-up":
            dup, request = comm.Idup()
            request.Wait()
            dup.Free()
        else:
            # (the first step of every collective of the library: see Context.record)
            from mpi_allreduce.context import PURPOSES

            mine = np.array([PURPOSES["check"], 0, 0, 0], dtype=np.int64)
            rows = np.empty((comm.Get_size(), 4), dtype=np.int64)
            context_for(comm).comm.Iallgather(mine, rows).Wait()
    comm.Free()


def test_a_tuning_dict_changed_in_place_makes_a_new_call(comm):
    """The caller changes its tuning dict between two calls, alike on every
    rank; one rank repeats the same arrays (a kept call), the others pass
    new ones: every rank runs the changed table's algorithm (the kept call
    remembers the options as they were), and the sums are right."""
    table = {"rules": [{"comm_size": 1, "table": [{"max_bytes": None, "algorithm": "ring"}]}]}
    x, y = np.ones(64), np.empty(64)
    mar.allreduce(x, y, comm=comm, tuning=table)
    for algorithm in ("driver", "recursive_doubling", "ring"):
        table["rules"][0]["table"][0]["algorithm"] = algorithm
        if comm.Get_rank() != 0:
            x, y = np.ones(64), np.empty(64)
        mar.allreduce(x, y, comm=comm, tuning=table)
        assert np.all(y == comm.Get_size()), algorithm


def test_a_fusions_single_array_takes_one_path_whatever_its_layout(comm):
    """One array alone in a bucket: contiguous on some ranks, a strided
    view on others; how it lies in memory never decides the messages."""
    whole = np.zeros(2000)
    a = whole[::2] if comm.Get_rank() % 2 else np.zeros(1000)
    a[:] = comm.Get_rank() + 1
    fusion = mar.Fusion(comm=comm)
    fusion.allreduce([a])
    assert np.all(a == comm.Get_size() * (comm.Get_size() + 1) / 2)
    fusion.free()


class _ReleaseInterrupted:
    """A communicator's guard whose ``at``-th release raises
    KeyboardInterrupt once the lock is released: a signal that lands as a
    call returns, after its messages all completed (Python raises it as the
    release returns, inside the library's frame)."""

    def __init__(self, at: int):
        self.lock, self.releases, self.at = threading.RLock(), 0, at

    def acquire(self, blocking: bool = True) -> bool:
        return self.lock.acquire(blocking)

    def release(self) -> None:
        self.lock.release()
        self.releases += 1
        if self.releases == self.at:
            raise KeyboardInterrupt("as the call returned")


RETURNING = {"allreduce": lambda x, comm: mar.allreduce(x, None, comm=comm),
             "iallreduce": lambda x, comm: mar.iallreduce(x, None, comm=comm).wait(),
             "allreduce_init": _persistent_once}


@pytest.mark.parametrize("kind", list(RETURNING))
def test_an_interrupt_as_a_call_returns_breaks_the_communicator(interrupt_watchdog, kind):
    """Rank 0's call completes and is interrupted as it returns; rank 0
    calls again.  Its peers have gone on to their next call, which the
    retry would meet (the same spec: the same tags) and mix with; so the
    retry raises Broken, and the peers' next call stalls and is reported."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    comm = world.Dup()
    mar.setup(comm)
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank == 0:  # (before the first call binds the guard: its second release raises)
        context_for(comm).guard = _ReleaseInterrupted(at=2)
    outcomes = []
    step = 0
    while step < 3 and len(outcomes) < 4:
        x = np.full(4, 10.0 * step + rank)
        try:
            got = RETURNING[kind](x, comm)
            outcomes.append("exact" if (got == 10.0 * step * p + p * (p - 1) / 2).all()
                            else "WRONG")
            step += 1
        except KeyboardInterrupt:
            outcomes.append("interrupted")  # (and the same step again)
        except mar.Broken as exc:
            outcomes.append(type(exc).__name__)
            break
    everyone = world.allgather(outcomes)  # (first: a failure on one rank fails all)
    assert not any("WRONG" in peer for peer in everyone), everyone
    assert everyone[0][:3] == ["exact", "interrupted", "Broken"], everyone
    assert any("Stalled" in peer for peer in everyone), everyone  # (the peers were told)
    comm.Free()


def test_a_fusion_waited_again_after_an_interrupt_raises(raising_watchdog):
    """A Fusion's wait() left by an interrupt on rank 0: waited again, with
    nothing left to finish, it raises as every call on the broken
    communicator does -- never returns as if the arrays held results.  A
    peer either had all it needed (exact results) or stalled, and then
    raises again too."""
    from mpi_allreduce.fusion import Fusion

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    comm = world.Dup()
    rank = comm.Get_rank()
    fusion = Fusion(comm, op=interrupting_sum(rank, at=1), bucket_bytes=8000, algorithm="ring")
    arrays = [np.full(1000, float(rank)) for _ in range(4)]
    for array in arrays:
        fusion.add(array)
    try:
        fusion.wait()
        first = "exact" if all((a == sum(range(comm.Get_size()))).all() for a in arrays) \
            else "WRONG"
    except (KeyboardInterrupt, mar.Broken) as exc:
        first = type(exc).__name__
    assert first != "WRONG"
    assert first != "exact" or rank != 0
    if first == "exact":
        fusion.wait()  # (nothing in flight, nothing broken here)
    else:
        with pytest.raises(mar.Broken):
            fusion.wait()
    comm.Free()


def _persistent_once(request):
    request.Start()
    request.Wait()
    request.Free()


#: the drop-in Comm's all-reduces, each made and waited for
SPELT = {
    "Allreduce": lambda comm, x, y: comm.Allreduce(x, y),
    "Iallreduce": lambda comm, x, y: comm.Iallreduce(x, y).Wait(),
    "Allreduce_init": lambda comm, x, y: _persistent_once(comm.Allreduce_init(x, y)),
}


#: mpi4py's spellings of one buffer of 6 doubles (the drop-in takes each as the same)
SPELLINGS = [lambda y: y, lambda y: [y, "d"], lambda y: [y, 6], lambda y: [y, MPI.DOUBLE],
             lambda y: [y, (6, 0), "f8"], lambda y: [y, 6, None]]


@pytest.mark.parametrize("call", list(SPELT))
def test_one_call_spelt_differently_on_each_rank_is_one_call(fresh, call):
    """The drop-in Comm takes every spelling mpi4py has for a buffer --
    bare, a typecode, a count without a datatype, a datatype -- as the same
    call, so ranks that spell it differently get the exact sum (before: a
    typecode or a bare count went to mpi4py's own collective and the rest to
    the library's, and the ranks stalled where mpi4py gives the sum, or
    with the default watchdog action the job was aborted)."""
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    x, y = np.arange(6.0) + rank, np.zeros(6)
    spell = SPELLINGS[rank % len(SPELLINGS)]
    SPELT[call](comm, spell(x), spell(y))
    np.testing.assert_array_equal(y, np.arange(6.0) * p + p * (p - 1) / 2)


def _vector():
    """Three doubles two apart: a datatype with gaps, which the library
    leaves to mpi4py (and MPI)."""
    return MPI.DOUBLE.Create_vector(3, 1, 2).Commit()


@pytest.mark.parametrize("call", list(SPELT))
def test_ranks_whose_calls_go_different_ways_stall_never_mix(raising_watchdog, call,
                                                             peers_world):
    """Rank 0's call has a datatype with gaps (mpi4py's way, which begins
    with the ranks' agreement on the call), the others' plain arrays (the
    library's way): different calls, which travel on different messages of
    the library's communicator, so every rank stalls and raises, and none
    gets a result mixed from the two."""
    world, base = MPI.COMM_WORLD, peers_world  # (not set up: the first call on it sets it up)
    comm, rank = mar.Comm(base), base.Get_rank()
    x, y = np.arange(5.0) + rank, np.zeros(5)
    vector = _vector()
    try:
        if rank == 0:
            SPELT[call](comm, [x, 1, vector], [y, 1, vector])
        else:
            SPELT[call](comm, x[::2].copy(), y[:3])
        outcome = "WRONG"  # (no rank may return)
    except (mar.Broken, MPI.Exception) as exc:
        outcome = type(exc).__name__
    everyone = world.allgather(outcome)
    assert all(o == "Stalled" for o in everyone), everyone
    vector.Free()
    world.Barrier()
    base.Free()


def test_a_call_handed_to_mpi4py_is_agreed_first(fresh):
    """Calls that go to MPI's own collective (a datatype with gaps) are
    agreed on first: ranks whose ops or counts differ all raise
    ArgumentMismatch and nothing is sent (before: MPI's collective gave
    every rank the same wrong numbers), and the communicator stays usable."""
    if fresh.Get_size() == 1:
        pytest.skip("one rank agrees with itself")
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    vector = _vector()
    x, y = np.arange(10.0) + rank, np.zeros(10)
    with pytest.raises(mar.ArgumentMismatch, match="disagree"):
        comm.Allreduce([x, 1, vector], [y, 1, vector], MPI.SUM if rank else MPI.MAX)
    with pytest.raises(mar.ArgumentMismatch, match="disagree"):
        comm.Iallreduce([x, 1 + (rank == 0), vector], [y, 1 + (rank == 0), vector]).Wait()
    assert not y.any()
    comm.Allreduce(x, y)
    np.testing.assert_array_equal(y, np.arange(10.0) * p + p * (p - 1) / 2)
    vector.Free()


def _gapped_add(inbuf, inoutbuf, datatype):
    a, b = np.frombuffer(inbuf, np.float64), np.frombuffer(inoutbuf, np.float64)
    b[::2] += a[::2]


def _gapped_max(inbuf, inoutbuf, datatype):
    a, b = np.frombuffer(inbuf, np.float64), np.frombuffer(inoutbuf, np.float64)
    np.maximum(a[::2], b[::2], out=b[::2])


def test_user_ops_handed_to_mpi4py_are_agreed_by_what_they_compute(fresh):
    """A user-defined MPI.Op on a datatype with gaps (mpi4py's way): ranks
    with ops that compute different things (an add on one, a max on
    another) all raise ArgumentMismatch -- the op is agreed by what it
    computes on the call's own elements, its handle saying nothing across
    ranks (before: every rank got the add's numbers, silently); the same op
    everywhere gives MPI's answer."""
    if fresh.Get_size() == 1:
        pytest.skip("one rank agrees with itself")
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    vector = _vector()
    add = MPI.Op.Create(_gapped_add, commute=True)
    other = MPI.Op.Create(_gapped_max if rank == 1 else _gapped_add, commute=True)
    try:
        x, y = (np.arange(5.0) + 1) * (rank + 1), np.zeros(5)
        with pytest.raises(mar.ArgumentMismatch, match="disagree"):
            comm.Allreduce([x, 1, vector], [y, 1, vector], other)
        comm.Allreduce([x, 1, vector], [y, 1, vector], add)
        np.testing.assert_array_equal(y[::2], (np.arange(5.0) + 1)[::2] * p * (p + 1) / 2)
    finally:
        add.Free()
        other.Free()
        vector.Free()


def test_mpi4pys_persistent_request_after_a_stall_is_given_up(raising_watchdog, peers_world):
    """A persistent all-reduce handed to mpi4py (a datatype with gaps) whose
    start rank 0's peers never match: its wait raises Stalled, and then its
    Start raises Broken as the communicator does and Free keeps the request
    (before: Start raised RequestError "already active" and Free failed)."""
    from mpi_allreduce.engine import ABANDONED

    world, base = MPI.COMM_WORLD, peers_world
    mar.setup(base)
    comm, rank = mar.Comm(base), base.Get_rank()
    vector, add = _vector(), MPI.Op.Create(_gapped_add, commute=True)
    x, y = np.arange(5.0) + 1, np.zeros(5)
    before = len(ABANDONED)
    request = comm.Allreduce_init([x, 1, vector], [y, 1, vector], add)
    if rank == 0:
        request.Start()
        with pytest.raises(mar.Stalled):
            request.Wait()
        with pytest.raises(mar.Broken):
            request.Start()
        request.Free()
    world.Barrier()
    if rank:  # (the late match of rank 0's start: nothing left pending)
        MPI.Prequest.Start(request._prequest)
        MPI.Prequest.Wait(request._prequest)
        request.Free()
    else:
        for pending in ABANDONED[before:]:
            if isinstance(pending, MPI.Prequest):
                pending.Wait()
                pending.Free()
        del ABANDONED[before:]
    world.Barrier()
    add.Free()
    vector.Free()
    base.Free()


def test_type_signatures_are_agreed_in_order(fresh):
    """A struct of (double, int) on one rank and (int, double) on another
    are different type signatures (MPI: erroneous): ArgumentMismatch on
    every rank (before: compared as sets, they agreed, and the allgather
    delivered bytes of one read as the other)."""
    if fresh.Get_size() == 1:
        pytest.skip("one rank agrees with itself")
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    order = [MPI.DOUBLE, MPI.INT] if rank == 0 else [MPI.INT, MPI.DOUBLE]
    struct = MPI.Datatype.Create_struct([1, 1], [0, 8], order)
    padded = struct.Create_resized(0, 16).Commit()
    try:
        send, recv = np.zeros(2), np.zeros(2 * p)
        with pytest.raises(mar.ArgumentMismatch, match="disagree"):
            comm.Allgather([send, 1, padded], [recv, 1, padded])
    finally:
        padded.Free()
        struct.Free()


def test_a_reduce_scatter_of_unequal_blocks_handed_to_mpi4py_is_right(fresh):
    """Each rank's receive count is its own block (here 1 and 3, ...): the
    ranks agree on the counts, not on their receive buffers' sizes (before:
    a valid call with unequal blocks was refused on every rank)."""
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    first = MPI.Op.Create(_first, commute=False)
    try:
        counts = [1 + 2 * (r % 2) for r in range(p)]
        x = np.arange(float(sum(counts))) + 100 * rank
        for given in (counts, None):
            y = np.zeros(counts[rank])
            comm.Reduce_scatter(x, y, given, first)
            start = sum(counts[:rank])
            np.testing.assert_array_equal(y, x[start:start + counts[rank]] - 100 * rank)
    finally:
        first.Free()


@pytest.mark.parametrize("spell", [lambda r, n: [r, n, MPI.DOUBLE], lambda r, n: [r, (n, 0)],
                                   lambda r, n: [r, n, "d"], lambda r, n: [r, n]],
                         ids=["count, datatype", "pair", "count, typecode", "count"])
def test_an_allgathers_receive_count_is_each_ranks_block(fresh, spell):
    """``Allgather(s, [r, 2, MPI.DOUBLE])``: as in mpi4py, the receive spec's
    count is each rank's block, not the whole (before: refused with a
    ValueError on every rank)."""
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    send, recv = np.arange(2.0) + 10 * rank, np.zeros(2 * p)
    comm.Allgather([send, 2, MPI.DOUBLE], spell(recv, 2))
    np.testing.assert_array_equal(recv, np.concatenate([np.arange(2.0) + 10 * r
                                                        for r in range(p)]))


def _first(inbuf, inoutbuf, datatype):
    """A non-commutative op: the lower rank's value (MPI combines in rank order)."""
    a = np.frombuffer(inbuf, dtype=np.float64)
    b = np.frombuffer(inoutbuf, dtype=np.float64)
    b[:] = a


def test_a_call_handed_to_mpi4py_on_every_rank_is_right(fresh):
    """Every rank's call goes to mpi4py (a reduce-scatter with a
    non-commutative op, which the library's ring does not take): mpi4py's
    own call, agreed on first and waited through the library's request,
    gives MPI's answer -- with the receive counts given, and without them
    (exchanged by the library, watched)."""
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    first = MPI.Op.Create(_first, commute=False)
    try:
        x = np.arange(2.0 * p) + 100 * rank
        expected = np.empty(2)
        theirs = fresh.Dup()
        MPI.Intracomm.Reduce_scatter_block(theirs, x, expected, first)
        theirs.Free()
        for counts in ([2] * p, None):
            y = np.zeros(2)
            comm.Reduce_scatter([x, "d"], y, counts, first)
            np.testing.assert_array_equal(y, expected)
        y = np.zeros(2)
        comm.Reduce_scatter_block(x, y, first)
        np.testing.assert_array_equal(y, expected)
    finally:
        first.Free()


def test_an_interrupt_as_a_test_of_mpis_own_collective_returns_keeps_its_request(
        interrupt_watchdog, monkeypatch, peers_world):
    """An interrupt that lands as a test of MPI's own collective (the
    drop-in's way for a datatype with gaps) returns unfinished -- where a
    signal handler's interrupt is raised once a sheltered test returns: a
    user-defined op here -- keeps MPI's request, which still holds its buffers, for good (before:
    the call's end dropped it, and a late message could land in freed
    memory); the communicator is broken."""
    from mpi_allreduce import engine
    from mpi_allreduce.engine import ABANDONED

    world, base = MPI.COMM_WORLD, peers_world
    mar.setup(base)
    comm, rank = mar.Comm(base), base.Get_rank()
    vector, x, y = _vector(), np.arange(5.0) + 1, np.zeros(5)
    add = MPI.Op.Create(_gapped_add, commute=True)
    if rank == 0:
        armed, real = [False], engine._Started.test

        def test(self):
            done = real(self)
            if armed[0] and not done:
                armed[0] = False
                raise KeyboardInterrupt("lands as a test returns")
            return done
        monkeypatch.setattr(engine._Started, "test", test)
        before = len(ABANDONED)
        request = comm.Iallreduce([x, 1, vector], [y, 1, vector], add)
        theirs = request._op.pending[0].requests[0]
        armed[0] = True
        with pytest.raises(KeyboardInterrupt, match="as a test returns"):
            while not request.Test():
                time.sleep(0.001)
        assert any(item is theirs for item in ABANDONED[before:])
        with pytest.raises(mar.Broken):
            comm.Allreduce(np.ones(2), np.zeros(2))
    else:  # (the agreement on the call, then never the call itself)
        comm._agreed("allreduce", [x, 1, vector], [y, 1, vector], add, None)
    world.Barrier()
    vector.Free()  # (the op is kept: rank 0's collective may still apply it)


def test_reduce_scatters_exchange_of_counts_is_watched(raising_watchdog, peers_world):
    """Reduce_scatter given no receive counts exchanges them (as mpi4py
    does), whichever way the call then goes: the library's watched
    collective, so a peer that never comes is reported (before: mpi4py's
    blocking MPI_Allgather, where rank 0 waited unreported under every
    watchdog action)."""
    world, base = MPI.COMM_WORLD, peers_world
    mar.setup(base)
    comm, rank = mar.Comm(base), base.Get_rank()
    if rank == 0:
        with pytest.raises(mar.Stalled, match="receive counts"):
            comm.Reduce_scatter([np.ones(2 * world.Get_size()), "d"], [np.zeros(2), "d"])
    world.Barrier()
    base.Free()


@pytest.mark.parametrize("make", ["Dup", "Split", "Split_type", "Create", "Create_group"])
def test_a_peer_that_never_comes_to_a_wrappers_new_communicator_is_reported(raising_watchdog,
                                                                            make, peers_world):
    """The drop-in Comm's Dup (MPI_Comm_idup), Split, Split_type, Create and
    Create_group (no non-blocking form: each runs on a thread of its own,
    waited for under the watchdog) are watched as the library's own calls
    are: the ranks that wait raise Stalled.  While one given up on is still
    inside MPI, another on the same communicator raises Broken.  (Where MPI
    runs no threads, Split, Split_type and Create come after a watched
    MPI_Ibarrier, where the waiting ranks stall.)"""
    from mpi_allreduce.engine import ABANDONED, mpi_threads

    threads = mpi_threads()
    if make == "Create_group" and not threads:
        pytest.skip("MPI runs no threads here: Create_group is MPI's own wait")
    world, base = MPI.COMM_WORLD, peers_world
    comm, late = mar.Comm(base), base.Get_rank() == 0
    before = len(ABANDONED)  # (earlier tests' abandoned requests are not this test's)
    if not late:
        whole = comm.Get_group()
        with pytest.raises(mar.Stalled, match="Comm_idup|Comm_split|Comm_create"):
            {"Dup": lambda: comm.Dup(), "Split": lambda: comm.Split(0, 0),
             "Split_type": lambda: comm.Split_type(MPI.COMM_TYPE_SHARED),
             "Create": lambda: comm.Create(whole),
             "Create_group": lambda: comm.Create_group(whole)}[make]()
        if make != "Dup" and threads:  # (its thread is still inside MPI: no second one)
            with pytest.raises(mar.Broken, match="still inside MPI"):
                comm.Create_group(whole)
        whole.Free()
    world.Barrier()
    if late:  # (completes what the others gave up on: nothing left pending)
        whole = base.Get_group()
        if make == "Dup":
            dup, request = base.Idup()
            request.Wait()
            dup.Free()
        elif not threads:
            base.Ibarrier().Wait()
        else:
            made = {"Split": lambda: base.Split(0, 0),
                    "Split_type": lambda: base.Split_type(MPI.COMM_TYPE_SHARED),
                    "Create": lambda: base.Create(whole),
                    "Create_group": lambda: base.Create_group(whole)}[make]()
            made.Free()
        whole.Free()
    else:
        # (its requests: a call an earlier test dropped in flight may be kept
        # here meanwhile, as the garbage collector frees its request)
        MPI.Request.Waitall([r for r in ABANDONED[before:] if isinstance(r, MPI.Request)])
        del ABANDONED[before:]
    base.Free()


@pytest.mark.parametrize("where", ["one_round", "persistent_requests", "remember_call"])
def test_an_interrupt_between_a_calls_tag_and_its_start_breaks_the_communicator(
        interrupt_watchdog, monkeypatch, fresh, where):
    """An interrupt lands on rank 0 after its call took its tag and before
    the call is started and handed over (``where``: in the fast path's
    set-up, a persistent call's MPI requests, the keeping of a
    non-blocking call); rank 0 retries.  Its tag counter is one ahead of
    the call it runs, so the retry would take the tag of its peers' next
    call: instead the communicator is broken there (the retry raises
    Broken), the peers stall, and nobody gets a wrong sum (before: the
    retry and the peers' next call met, a wrong sum on both ranks)."""
    from mpi_allreduce import api, engine, progress

    world, comm = MPI.COMM_WORLD, fresh
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to mislead")
    rank, p = comm.Get_rank(), comm.Get_size()
    armed = [False]
    module, name = {"one_round": (engine.Operation, "one_round"),
                    "persistent_requests": (progress, "persistent_requests"),
                    "remember_call": (api, "remember_call")}[where]
    if rank == 0:
        interrupt_once(monkeypatch, module, name, armed)

    def start(x):
        if where == "persistent_requests":
            request = mar.allreduce_init(x, None, comm=comm, algorithm="recursive_doubling")
            request.start()
            return request
        return mar.iallreduce(x, None, comm=comm, algorithm="recursive_doubling")
    outcomes = []
    for step in range(2):
        a, b = np.full(8, 1.0 + rank + 10 * step), np.full(8, 100.0 + rank + 10 * step)
        exact_a = np.full(8, sum(1.0 + r + 10 * step for r in range(p)))
        exact_b = np.full(8, sum(100.0 + r + 10 * step for r in range(p)))
        armed[0] = step == 1
        for _ in range(2):  # (a retry after an interrupt)
            try:
                requests = [start(a), start(b)]
            except KeyboardInterrupt:
                outcomes.append("interrupted")
                continue
            except mar.Broken:
                outcomes.append("Broken")
                break
            for request, exact in zip(requests, (exact_a, exact_b)):
                try:
                    outcomes.append("exact" if np.array_equal(request.wait(), exact) else "WRONG")
                except mar.Broken as exc:  # (Stalled is a Broken)
                    outcomes.append(type(exc).__name__)
            break
    monkeypatch.undo()
    everyone = world.allgather(outcomes)
    assert not any("WRONG" in o for o in everyone), everyone
    assert everyone[0][2:] == ["interrupted", "Broken"], everyone
    world.Barrier()


@pytest.mark.parametrize("make", ["Split", "Split_type", "Create", "node map"])
def test_an_interrupt_as_a_blocking_collective_starts_leaves_no_peer_inside_it(monkeypatch,
                                                                                fresh, make):
    """Rank 0 is interrupted just as a collective with no non-blocking form
    starts (the drop-in Comm's Split, Split_type and Create; the node map
    that a first hierarchical call makes): the call already runs on its
    own thread, so it completes there and the peers get their
    communicator (before: the peers were left inside the blocking MPI call
    after a barrier rank 0 had passed, where no watchdog reaches)."""
    from mpi_allreduce import engine, topology

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave inside the call")
    if not engine.mpi_threads():
        pytest.skip("MPI runs no threads here: the call is the caller's own blocking call")
    base = fresh
    rank, p = base.Get_rank(), base.Get_size()
    if rank == 0:
        def interrupted(requests, what, context=None):
            raise KeyboardInterrupt(f"lands as {what} starts")
        monkeypatch.setattr(engine, "wait_for", interrupted)
    whole = base.Get_group()
    calls = {"Split": lambda: mar.Comm(base).Split(0, rank),
             "Split_type": lambda: mar.Comm(base).Split_type(MPI.COMM_TYPE_SHARED, rank),
             "Create": lambda: mar.Comm(base).Create(whole),
             "node map": lambda: topology.on_node(base)}
    try:
        made = calls[make]()
        outcome = "made"
    except KeyboardInterrupt:
        outcome = "interrupted"
    monkeypatch.undo()
    everyone = world.allgather(outcome)
    assert everyone == ["interrupted"] + ["made"] * (p - 1), everyone
    if rank and make == "node map":
        assert made[1] >= 1
    elif rank:
        assert made.Get_size() == p  # (one host: the node's ranks are all of them)
        made.Free()
    whole.Free()
    world.Barrier()


@pytest.mark.parametrize("where", ["caller", "thread", "persistent"])
def test_an_mpi_error_in_a_wait_over_several_calls_ends_the_call_it_belongs_to(monkeypatch, where):
    """Two calls in flight on rank 0 (MPI's own receives, as the torch
    backend and the drop-in Comm post them), waited in one MPI_Waitany by
    the caller (``caller``) or by the progress thread (``thread``: both
    have completion callbacks) -- where calls wait without a deadline (in
    the watchdog's raise mode they poll); ``persistent``: the short receive
    is a persistent one, whose error MPI reports without freeing it.  The first receive's message is too long
    (MPI_ERR_TRUNCATE): that call raises it, the other returns its message
    -- not the other's wait raising it while the truncated call returns
    what never arrived, and not a progress thread ended by the error
    (under ``MPI_ALLREDUCE_ON_ERROR=raise``: by default an error after
    messages started aborts the job)."""
    from mpi_allreduce.engine import mpi_threads
    from mpi_allreduce.progress import mpi_request

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank sends itself nothing here")
    if where == "thread" and not mpi_threads():
        pytest.skip("MPI runs no threads here: no progress thread")
    monkeypatch.setenv(config.ON_ERROR_ENV, "raise")
    config.refresh()
    comm = world.Dup()
    rank = comm.Get_rank()
    if rank == 1:
        comm.Barrier()
        time.sleep(0.3)  # (rank 0 is inside its wait by now)
        comm.Send(np.arange(4.0), 0, 1)
        comm.Send(np.full(2, 7.0), 0, 2)
    elif rank == 0:
        short, fine = np.zeros(2), np.zeros(2)
        if where == "persistent":
            posted = comm.Recv_init(short, 1, 1)
            posted.Start()
        else:
            posted = comm.Irecv(short, 1, 1)
        truncated = mpi_request([posted], "a receive too short", comm)
        whole = mpi_request([comm.Irecv(fine, 1, 2)], "a receive", comm)
        if where == "thread":
            for request in (truncated, whole):
                request.add_done_callback(lambda *_: None)
        comm.Barrier()
        whole.wait()
        assert fine.tolist() == [7.0, 7.0]
        with pytest.raises(MPI.Exception) as raised:
            truncated.wait()
        # (MPI_Waitany names the error; MPI_Testall points to the request's status)
        assert raised.value.Get_error_class() in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS)
    else:
        comm.Barrier()
    world.Barrier()
    comm.Free()
    monkeypatch.delenv(config.ON_ERROR_ENV)
    config.refresh()


def test_a_fault_in_the_progress_threads_loop_ends_its_calls_and_the_thread_lives_on(monkeypatch):
    """An error that no call owns escapes the progress thread's loop (here
    a fault injected where the thread gathers its calls' requests): the
    calls the thread holds end with it -- their waits raise it, never wait
    for a thread that stopped -- and the thread serves the next call
    (under ``MPI_ALLREDUCE_ON_ERROR=raise``: by default the error aborts the
    job, as any error after messages started does)."""
    from mpi_allreduce import engine
    from mpi_allreduce.engine import ABANDONED
    from mpi_allreduce.progress import mpi_request

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank sends itself nothing here")
    if not engine.mpi_threads():
        pytest.skip("MPI runs no threads here: no progress thread")
    comm = world.Dup()
    rank = comm.Get_rank()
    gathered, faults, before = engine.gathered, [], len(ABANDONED)

    def faulty(ops, first=None):
        if threading.get_ident() == engine._ENGINE.ident and ops and not faults:
            faults.append(len(ops))
            raise RuntimeError("a fault in the thread's loop")
        return gathered(ops, first)

    monkeypatch.setenv(config.ON_ERROR_ENV, "raise")
    config.refresh()
    if rank == 0:
        monkeypatch.setattr(engine, "gathered", faulty)
        first, second = np.zeros(2), np.zeros(2)
        request = mpi_request([comm.Irecv(first, 1, 1)], "a receive", comm)
        request.add_done_callback(lambda *_: None)  # (the thread's now)
        with pytest.raises(RuntimeError, match="a fault in the thread's loop"):
            request.wait()
        assert faults == [1]
        comm.Barrier()
        later = mpi_request([comm.Irecv(second, 1, 2)], "a receive", comm)
        later.add_done_callback(lambda *_: None)
        later.wait()
        assert second.tolist() == [7.0, 7.0]
        # the receive given up on is kept, posted: its message comes now,
        # so that nothing is left pending at MPI_Finalize
        MPI.Request.Waitall([r for r in ABANDONED[before:] if isinstance(r, MPI.Request)])
        del ABANDONED[before:]
    elif rank == 1:
        comm.Barrier()
        comm.Send(np.full(2, 7.0), 0, 2)
        comm.Send(np.zeros(2), 0, 1)
    else:
        comm.Barrier()
    world.Barrier()
    comm.Free()
    monkeypatch.undo()
    config.refresh()


def test_an_interrupt_inside_an_allgather_breaks_the_communicator(interrupt_watchdog):
    """An allgather has no reduction to raise from: Ctrl-C (SIGINT's
    handler, from a timer) lands while rank 0 waits inside one for its late
    peers.  Rank 0 raises the KeyboardInterrupt, and Broken when it calls
    again; the peers had all they needed from the part rank 0 sent (the
    exact blocks) or stall and raise, and none of them meets a retried
    call's messages."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals land on the main thread")
    comm = world.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    mar.setup(comm)  # (the set-up, collective, out of the interrupted wait)
    data = np.arange(COUNT, dtype=np.float64) + rank
    exact = np.stack([np.arange(COUNT, dtype=np.float64) + r for r in range(size)])
    comm.Barrier()
    _judge(_interrupted_by_a_timer(
        lambda: mar.allgather(data, comm=comm, segment_size=64 * 8), exact, rank), world)
    comm.Free()


def test_a_receive_whose_status_is_read_keeps_it_on_the_progress_thread():
    """A receive from any source with its status asked for, taken over by
    the progress thread (a completion callback, as the torch backend's
    futures have): the status says who sent it and with which tag (a
    MPI_Waitany over the thread's requests would have dropped it)."""
    from mpi_allreduce.engine import mpi_threads
    from mpi_allreduce.progress import mpi_request

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank sends itself nothing here")
    if not mpi_threads():
        pytest.skip("MPI runs no threads here: no progress thread")
    comm = world.Dup()
    if comm.Get_rank() == 1:
        comm.Barrier()
        time.sleep(0.3)  # (the thread waits for it by now)
        comm.Send(np.full(2, 5.0), 0, 8)
    elif comm.Get_rank() == 0:
        data, status = np.zeros(2), MPI.Status()
        request = mpi_request([comm.Irecv(data, MPI.ANY_SOURCE, MPI.ANY_TAG)],
                              "a receive from any source", comm, [status])
        request.add_done_callback(lambda *_: None)
        comm.Barrier()
        request.wait()
        assert data.tolist() == [5.0, 5.0]
        assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.DOUBLE)) == (1, 8, 2)
    else:
        comm.Barrier()
    world.Barrier()
    comm.Free()


def test_an_interrupt_between_checks_two_agreements_breaks_the_communicator(
        interrupt_watchdog, monkeypatch, fresh):
    """``check=True`` agrees on the arguments, then on what the call runs
    (two collectives of the library, a user op tried on this rank in
    between): an interrupt lands on rank 0 between them.  Its retry raises
    Broken at once; the peers, inside the second agreement, stall and are
    reported (before: the retry's first agreement met the peers' second)."""
    from mpi_allreduce import api

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to mislead")
    rank = fresh.Get_rank()
    real = api.resolved

    def interrupted(*args):
        raise KeyboardInterrupt("lands between check's two agreements")
    if rank == 0:
        monkeypatch.setattr(api, "resolved", interrupted)
    x = np.arange(8.0) + rank
    outcomes = []
    for _ in range(2):  # (a retry after the interrupt)
        try:
            mar.allreduce(x, comm=fresh, check=True)
            outcomes.append("returned")
        except KeyboardInterrupt:
            outcomes.append("interrupted")
            monkeypatch.setattr(api, "resolved", real)
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
            break
    monkeypatch.undo()
    everyone = world.allgather(outcomes)
    assert everyone[0] == ["interrupted", "Broken"], everyone
    assert all(o == ["Stalled"] for o in everyone[1:]), everyone


def test_a_buffer_one_rank_spells_in_fortran_order_is_still_one_call(fresh):
    """The drop-in Comm: rank 0's receive buffer is Fortran-ordered (the
    library refuses it as it is, mpi4py takes its memory as it lies), its
    peers' C-ordered.  The library's refusal on the plain way is not final
    there (no empty call of its own), so rank 0 takes the library's way
    with its memory and every rank gets the exact sum (a final refusal
    would have stalled against the peers' call)."""
    comm, rank, p = mar.Comm(fresh), fresh.Get_rank(), fresh.Get_size()
    x = np.arange(6.0) + rank
    y = np.zeros((2, 3), order="F" if rank == 0 else "C")
    comm.Allreduce(x, y)
    want = np.arange(6.0) * p + p * (p - 1) / 2
    memory = y.T.reshape(-1) if rank == 0 else y.reshape(-1)
    np.testing.assert_array_equal(memory, want)


def test_check_mode_refuses_an_option_every_rank_refuses_on_every_rank(fresh):
    """check=True, and a torus row that does not divide the ranks (refused
    as what the call runs is resolved, after the agreement on the
    arguments): every rank raises ArgumentMismatch naming it, and the
    communicator stays usable (before this session's check fixes: the
    error broke the communicator)."""
    p = fresh.Get_size()
    if p == 1:
        pytest.skip("one rank agrees with itself")
    x = np.arange(8.0)
    with pytest.raises(mar.ArgumentMismatch, match="row"):
        mar.allreduce(x, comm=fresh, check=True, algorithm="torus", row_size=p + 1)
    np.testing.assert_array_equal(mar.allreduce(x, comm=fresh, check=True), x * p)


#: where an interrupt lands before a call's first message: (module, name) of
#: a function on every kind's path there (api for the all-reduces, Comm and
#: Fusion through them; collectives for the halves)
BEFORE_MESSAGES = {
    "before its set-up": {"api": "_setup", "collectives": "_validated"},
    "after its set-up": {"api": "refcounts", "collectives": "refcounts"},
}


#: (kind, where): every entry point once it is set up (the one-round fast
#: paths come after the guard: their cases are the other tests'), and the
#: first call of three of them
BEFORE_CASES = [(kind, "after its set-up") for kind in KINDS if "short" not in kind] + [
    (kind, "before its set-up") for kind in ("allreduce", "reduce_scatter", "Comm.Allreduce")]


@pytest.mark.parametrize("kind, where", BEFORE_CASES)
def test_an_interrupt_before_a_calls_messages_breaks_the_communicator(interrupt_watchdog,
                                                                      monkeypatch, kind, where):
    """An interrupt lands on rank 0 in a call before its first message
    (``where``: before the communicator's set-up, in the first call on it,
    or once it is set up), and rank 0 calls again: the communicator is
    broken there (its later call raises Broken at once), the peers stall,
    and nobody gets a wrong result (before: only the call's guard broke it,
    so rank 0 skipped a call its peers made and its next call met theirs:
    wrong sums on both)."""
    from mpi_allreduce import api, collectives

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    comm = world.Dup()
    rank = comm.Get_rank()
    if where == "after its set-up":
        mar.setup(comm)
    armed = [rank == 0]  # (one interrupt, in whichever module's function comes first)
    for module in (api, collectives):
        interrupt_once(monkeypatch, module,
                       BEFORE_MESSAGES[where][module.__name__.rsplit(".", 1)[1]], armed)
    data = np.arange(COUNT, dtype=np.float64) + rank
    call, count = KINDS[kind]
    outcomes = [_outcome(lambda: call(data[:count].copy(), "sum", comm), _exact(kind, comm))
                for _ in range(2)]
    monkeypatch.undo()
    _judge(outcomes, world)
    comm.Free()


def _counts_by_mpi4py(comm, x, out, rank, p):
    # (rank 0 gives no receive counts: the drop-in exchanges them, as mpi4py
    # does, in a watched collective of the library, where its peers, which
    # give them, make the library's reduce-scatter)
    comm.Reduce_scatter(x, out, None if rank == 0 else [2] * p)


#: drop-in calls that rank 0 spells so that it takes mpi4py's way (or
#: mpi4py refuses it) where its peers take the library's
DIFFERENT_WAYS = {
    "Reduce_scatter without counts": _counts_by_mpi4py,
    "Allreduce of a byte-swapped array": lambda comm, x, out, rank, p: comm.Allreduce(
        x.astype(">f8") if rank == 0 else x, np.zeros(x.size)),
}


@pytest.mark.parametrize("case", list(DIFFERENT_WAYS))
def test_a_drop_in_call_one_rank_takes_another_way_never_shifts_the_next(raising_watchdog,
                                                                         case, peers_world):
    """Rank 0's drop-in call goes mpi4py's way (or mpi4py refuses it: a
    BufferError, no TypeError) where its peers' goes the library's: the
    calls stall on every rank, and rank 0's next call, the same as its
    peers', never meets the peers' stalled one (before: a stall of the
    mpi4py way's own MPI request left the library's communicator usable,
    and rank 0's next call read the peers' stale messages: a wrong sum)."""
    world, base = MPI.COMM_WORLD, peers_world
    comm, rank, p = mar.Comm(base), base.Get_rank(), base.Get_size()
    outcomes = []
    for step in range(3):
        x, out = np.arange(2.0 * p) + rank + 10 * step, np.zeros(2)
        want = (np.arange(2.0 * p) * p + p * (p - 1) / 2 + 10 * step * p)[2 * rank:2 * rank + 2]
        try:
            if step == 0:
                DIFFERENT_WAYS[case](comm, x, out, rank, p)
                outcomes.append("returned")
                continue
            # the next calls the same on every rank: the library's way, then
            # mpi4py's (a buffer spelt as mpi4py reads it), which must not
            # be made on the broken communicator either
            comm.Reduce_scatter(x, out if step == 1 else [out, "d"], [2] * p)
            outcomes.append("exact" if np.array_equal(out, want) else "WRONG")
        except (mar.Broken, BufferError) as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
    everyone = world.allgather(outcomes)
    assert not any("WRONG" in o for o in everyone), everyone
    assert all(o[0] == "Stalled" for o in everyone), everyone
    world.Barrier()
    base.Free()


def _refused_on_rank_0(kind, comm, x, recv):
    if kind == "allreduce":
        return mar.allreduce(x, recv, comm=comm)
    if kind == "reduce_scatter":
        return mar.reduce_scatter(x, recv[:x.size // comm.Get_size()], comm=comm)
    wrapped = mar.Comm(comm)
    if kind == "Comm.Allreduce":
        wrapped.Allreduce(x, recv)
        return recv
    wrapped.Reduce_scatter_block(x, recv[:x.size // comm.Get_size()])
    return recv[:x.size // comm.Get_size()]


#: (kind of call, where the interrupt lands as rank 0 refuses it): the
#: refusal's empty call, and the drop-in's way from its deferred refusal to
#: the refusal made final
IN_A_REFUSAL = [("allreduce", "api", "_refusals_call"),
                ("reduce_scatter", "api", "_refusals_call"),
                ("allreduce", "api", "cached_context"),  # (in api.left, before refused)
                ("reduce_scatter", "api", "cached_context"),
                ("Comm.Allreduce", "Comm", "_call"),
                ("Comm.Reduce_scatter_block", "Comm", "_call")]


@pytest.mark.parametrize("kind, owner, name", IN_A_REFUSAL)
def test_an_interrupt_as_a_rank_refuses_a_call_breaks_the_communicator(
        interrupt_watchdog, monkeypatch, kind, owner, name):
    """Rank 0 refuses its call (a read-only receive buffer) and an interrupt
    lands before the refusal's empty call; rank 0 calls again: the
    communicator is broken there (Broken at once), the peers' call stalls,
    nobody gets a wrong result (before: rank 0 left with no empty call and
    nothing broken, and its next call met its peers' refused one)."""
    from mpi_allreduce import api

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    comm = world.Dup()
    mar.setup(comm)
    rank, p = comm.Get_rank(), comm.Get_size()
    interrupt_once(monkeypatch, {"api": api, "Comm": mar.Comm}[owner], name, [rank == 0])
    outcomes = []
    for attempt in range(2):
        x, recv = np.arange(4.0 * p) + rank + attempt, np.zeros(4 * p)
        if rank == 0 and attempt == 0:
            recv.setflags(write=False)
        whole = np.arange(4.0 * p) * p + p * (p - 1) / 2 + p * attempt
        exact = whole if "scatter" not in kind else whole[4 * rank:4 * rank + 4]
        outcomes.append(_outcome(lambda: _refused_on_rank_0(kind, comm, x, recv), exact))
    monkeypatch.undo()
    _judge(outcomes, world)
    comm.Free()


@pytest.mark.parametrize("kind", ["allreduce", "iallreduce", "reduce_scatter"])
def test_calls_refused_on_a_broken_communicator_keep_nothing(kind):
    """Calls on a communicator broken on this rank raise at once and hold
    nothing of theirs: their arrays are freed once the caller drops them
    (before: each refused call's arrays were kept for good, as a call that
    sent messages keeps them -- 100 KB a call)."""
    import gc
    import weakref

    from mpi_allreduce.context import broken_by

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("a call on one rank takes no guard")
    comm = world.Dup()
    mar.setup(comm)
    broken_by(comm, KeyboardInterrupt("breaks it on every rank, here"), "the test")
    refs = []
    for _ in range(100):
        x = np.ones(4 * comm.Get_size())
        refs.append(weakref.ref(x))
        with pytest.raises(mar.Broken):
            if kind == "allreduce":
                mar.allreduce(x, np.empty_like(x), comm=comm)
            elif kind == "iallreduce":
                mar.iallreduce(x, np.empty_like(x), comm=comm).wait()
            else:
                mar.reduce_scatter(x, np.empty(4), comm=comm)
        del x
    gc.collect()
    # (a few are the kept calls' of the last calls, dropped at the next ones)
    assert sum(ref() is not None for ref in refs) <= 25, sum(ref() is not None for ref in refs)
    world.Barrier()


def test_an_interrupt_between_the_parts_of_a_fusions_allreduce_breaks_the_communicator(
        interrupt_watchdog, monkeypatch):
    """``Fusion.allreduce`` interrupted on rank 0 as it adds its first array
    (before any add of its own ran); rank 0 calls it again: Broken at once,
    the peers stall, nobody gets a wrong sum (before: rank 0 skipped the
    step and its next one met the peers' first: wrong on both ranks)."""
    from mpi_allreduce.fusion import Fusion

    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank has no peer to leave waiting")
    comm = world.Dup()
    mar.setup(comm)
    rank, p = comm.Get_rank(), comm.Get_size()
    fusion = Fusion(comm, bucket_bytes=16)  # (each array a bucket of its own, started at once)
    interrupt_once(monkeypatch, Fusion, "add", [rank == 0], "lands as Fusion.allreduce adds")

    def step(k):
        arrays = [np.full(4, 1.0 + rank + 10 * k), np.full(4, 100.0 + rank + 10 * k)]
        fusion.allreduce(arrays)
        return np.concatenate(arrays)
    outcomes = [_outcome(lambda k=k: step(k), np.concatenate(
        [np.full(4, sum(1.0 + q + 10 * k for q in range(p))),
         np.full(4, sum(100.0 + q + 10 * k for q in range(p)))])) for k in range(2)]
    monkeypatch.undo()
    _judge(outcomes, world)
    comm.Free()
