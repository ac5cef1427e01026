"""Non-blocking and persistent all-reduce, reduce-scatter and allgather,
under mpiexec on every kind of sub-communicator, against the expected
result computed locally (and against MPI's own collectives)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

import mpi_allreduce as mar
from mpi_allreduce import config, progress, registry

from .conftest import PATH_VARIANTS
from .helpers import VARIANTS, expected, mine

pytestmark = pytest.mark.mpi

DTYPE_OPS = [("float32", "sum"), ("int64", "max"), ("complex64", "prod"), ("bool", "lxor"),
             ("float64", "avg")]


def counts_for(p: int) -> list:
    return sorted({0, 1, max(p - 1, 0), p + 1, 13, 257})


@pytest.fixture(params=["thread", "caller"])
def progress_mode(request, monkeypatch):
    """Both ways calls are advanced: the progress thread (calls of at least
    THREAD_MIN_BYTES; lowered here so short test vectors use it) and the caller."""
    monkeypatch.setenv(config.PROGRESS_ENV, request.param)
    monkeypatch.setattr(progress, "THREAD_MIN_BYTES", 64)
    config.refresh()
    yield request.param
    monkeypatch.delenv(config.PROGRESS_ENV)
    config.refresh()


#: (variant, dtype, op, progress mode): every algorithm with float32 sums,
#: advanced by the progress thread and by the caller; the other dtypes and ops
#: (which depend on neither) on one algorithm per kind of compiled round, by
#: the thread
IN_FLIGHT = ([(v, *DTYPE_OPS[0], mode) for v in VARIANTS for mode in ("thread", "caller")]
             + [(v, d, o, "thread") for d, o in DTYPE_OPS[1:] for v in VARIANTS
                if v[0] in PATH_VARIANTS])


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("variant,dtype,op,progress_mode", IN_FLIGHT,
                         ids=[f"{m}-{v[0]}-{d}-{o}" for v, d, o, m in IN_FLIGHT],
                         indirect=["progress_mode"])
def test_iallreduce_many_in_flight(comm, variant, dtype, op, in_place, progress_mode):
    """Every count started at once, waited in reverse order: every algorithm
    with float32 sums, both progress modes; int64 max, complex64 prod, bool
    lxor and float64 avg (its finalizing stage) on conftest.PATH_VARIANTS."""
    _, algorithm, options = variant
    cases, requests = [], []
    for count in counts_for(comm.Get_size()):
        data = mine(comm, dtype, op, count)
        if in_place:
            out = data
            request = mar.iallreduce(MPI_IN_PLACE(), out, op, comm=comm, algorithm=algorithm,
                                     segment_size=4, **options)
        else:
            out = np.full_like(data, 0)
            request = mar.iallreduce(data, out, op, comm=comm, algorithm=algorithm,
                                     segment_size=4, **options)
        cases.append((count, out))
        requests.append(request)
    for request, (count, out) in zip(reversed(requests), reversed(cases)):
        assert request.wait() is out
        np.testing.assert_array_equal(out, expected(comm, dtype, op, count),
                                      err_msg=f"count {count}")


def MPI_IN_PLACE():
    from mpi4py import MPI

    return MPI.IN_PLACE


def test_requests_complete_in_any_order_by_test(comm, progress_mode):
    """Requests polled with test() in a shuffled order until all are done
    (each rank its own order), then waitall."""
    rng = np.random.default_rng(comm.Get_rank())
    sizes = [1, 3000, 17, 40000, 5]
    sends = [np.arange(n, dtype=np.float64) * (comm.Get_rank() + 1) for n in sizes]
    outs = [np.empty_like(s) for s in sends]
    requests = [mar.iallreduce(s, o, "sum", comm=comm, algorithm=a, segment_size=1000)
                for s, o, a in zip(sends, outs, ["ring", "driver", "rabenseifner",
                                                 "ring_pipelined", "recursive_doubling"])]
    pending = set(range(len(requests)))
    while pending:
        for k in rng.permutation(sorted(pending)):
            if requests[k].test():
                pending.discard(k)
    p = comm.Get_size()
    for n, out in zip(sizes, outs):
        np.testing.assert_array_equal(out, np.arange(n) * (p * (p + 1) // 2))
    with pytest.raises(mar.RequestError):
        mar.waitall(requests)  # each was completed by its true test()


@pytest.mark.parametrize("count", [1, 2, 1000, 70000])
@pytest.mark.parametrize("algorithm", ["auto", "recursive_doubling", "ring", "driver"])
def test_persistent_restarts_with_new_data(comm, algorithm, count, progress_mode):
    send = np.empty(count, np.float32)
    out = np.empty_like(send)
    request = mar.allreduce_init(send, out, "sum", comm=comm, algorithm=algorithm)
    p, rank = comm.Get_size(), comm.Get_rank()
    for step in range(4):
        send[...] = np.arange(count) % 7 + rank * step
        request.start()
        if step % 2:
            while not request.test():
                pass
        else:
            assert request.wait() is out
        np.testing.assert_array_equal(out, (np.arange(count) % 7) * p + step * p * (p - 1) // 2)
    request.free()


def test_persistent_in_place(comm):
    buf = np.empty(9, np.int32)
    request = mar.allreduce_init(MPI_IN_PLACE(), buf, "max", comm=comm)
    for step in range(3):
        buf[...] = comm.Get_rank() + step
        request.start()
        request.wait()
        assert (buf == comm.Get_size() - 1 + step).all()
    request.free()


def test_completed_calls_scratch_serves_the_next_never_one_in_flight(comm):
    """A non-blocking call's scratch stays with it while it is kept for
    repeats on the same arrays; once the caller drops the arrays, it goes
    back to its plan (fresh memory costs a page fault per page) and comes
    out again for a later call; calls in flight together each have their
    own, and all of them give the right sums."""
    if comm.Get_size() == 1:
        pytest.skip("one rank runs no schedule")
    x = np.arange(5000, dtype=np.float64) + comm.Get_rank()
    want = np.arange(5000) * comm.Get_size() + sum(range(comm.Get_size()))

    def start():
        return mar.iallreduce(x, np.empty_like(x), comm=comm, algorithm="ring")

    first = start()
    (bound,) = first._keep
    scratch, plan = bound.scratch, bound.plan
    np.testing.assert_array_equal(first.wait(), want)
    assert bound.scratch is scratch  # kept with its call
    del first  # the caller lets the arrays go: the kept call is dropped at the next
    together = [start() for _ in range(3)]
    held = [request._keep[0].scratch for request in together]
    assert any(h is scratch for h in held) and len({id(h) for h in held}) == 3
    for request in together:
        np.testing.assert_array_equal(request.wait(), want)


def test_a_repeated_nonblocking_call_runs_its_kept_call(comm):
    """iallreduce on the very same arrays again: the kept bound call and
    operation start again (no validation, plan or binding), with a new
    tag; several in flight on different arrays, all right."""
    x = np.arange(300, dtype=np.float64) + comm.Get_rank()
    outs = [np.empty_like(x) for _ in range(3)]
    want = np.arange(300) * comm.Get_size() + sum(range(comm.Get_size()))
    ops = []
    for _ in range(5):
        requests = [mar.iallreduce(x, out, comm=comm) for out in outs]
        ops.append([request._op for request in requests])
        for out, request in zip(outs, requests):
            assert request.wait() is out
            np.testing.assert_array_equal(out, want)
    if comm.Get_size() > 1:
        assert all(o is first for again in ops[1:] for o, first in zip(again, ops[0]))
        assert len({o.tag for o in ops[0]}) == 3


def _until(done, seconds: float = 30.0) -> None:
    """Sleep until ``done()`` (no wait() or test() of any request meanwhile)."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "a call with a callback never completed"
        time.sleep(0.001)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring", "driver"])
def test_callbacks_complete_calls_nobody_waits_for(comm, algorithm, progress_mode):
    """Calls on two communicators, each with a completion callback, that no
    rank waits for or tests; rank 0 adds its callbacks in the opposite
    order (a call of several rounds moves only when someone advances it:
    the progress thread takes each over).  Every callback runs, once, with
    the result there; kept repeats on the same arrays alternate with
    waited ones, and fresh arrays with both."""
    other = comm.Dup()
    try:
        p, rank = comm.Get_size(), comm.Get_rank()
        x = np.arange(7, dtype=np.float64) + rank
        want = np.arange(7) * p + p * (p - 1) // 2
        kept = [np.empty_like(x), np.empty_like(x)]
        for round_ in range(6):
            outs = kept if round_ % 3 else [np.empty_like(x), np.empty_like(x)]
            requests = [mar.iallreduce(x, out, comm=c, algorithm=algorithm)
                        for c, out in zip((comm, other), outs)]
            if round_ % 2:  # waited, as any call is
                for request in requests:
                    np.testing.assert_array_equal(request.wait(), want)
                continue
            seen: list = []
            for k in (range(2) if rank else (1, 0)):
                requests[k].add_done_callback(
                    lambda request, k=k: seen.append((k, request.wait().copy())))
            _until(lambda: len(seen) == 2)
            assert sorted(k for k, _ in seen) == [0, 1]
            for _, result in seen:
                np.testing.assert_array_equal(result, want)
    finally:
        other.Free()


@pytest.mark.comm_kinds("world", "even")
def test_a_call_the_thread_took_over_completes_while_its_owner_polls_others(comm):
    """A call with a callback (the progress thread's now) while its owner
    waits for and polls calls of its own on another communicator (which
    take the thread's calls' locks for a moment): the thread never leaves
    a call whose requests its own wait completed (a race: a short switch
    interval widens its window; a program of this shape hung within 120
    rounds in each of three runs before the fix, though this test did not
    catch it in the one run I made of it then), and the owner's list of
    calls stays bounded however often a call is taken over and waited
    (65 entries after 65 rounds before)."""
    from mpi_allreduce.engine import _PRUNE, ENGINE
    other = comm.Dup()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        p, rank = comm.Get_size(), comm.Get_rank()
        x = np.arange(5, dtype=np.float64) + rank
        want = np.arange(5) * p + p * (p - 1) // 2
        a_out, b_out = np.empty(5), np.empty(5)
        for round_ in range(200):
            a = mar.iallreduce(x, a_out, comm=comm, algorithm="ring")
            seen: list = []
            a.add_done_callback(lambda request: seen.append(request.wait() is a_out))
            for _ in range(3):
                if rank == 0:
                    time.sleep(0.003)  # (the others spin in test() or wait() meanwhile)
                b = mar.iallreduce(x, b_out, comm=other, algorithm="ring")
                if round_ % 2:
                    b.wait()
                else:
                    while not b.test():
                        pass
                np.testing.assert_array_equal(b_out, want)
            _until(lambda: seen, 20.0)
            assert seen == [True]
            np.testing.assert_array_equal(a_out, want)
        for _ in range(3 * _PRUNE):  # taken over and waited, again and again
            a = mar.iallreduce(x, a_out, comm=comm, algorithm="ring")
            a.add_done_callback(lambda request: None)
            a.wait()
            assert len(ENGINE.caller) <= _PRUNE
        np.testing.assert_array_equal(a_out, want)
    finally:
        sys.setswitchinterval(interval)
        other.Free()


def test_a_callback_may_wait_for_a_call_not_complete(comm):
    """A callback (on the progress thread) that waits for a call its own
    rank has not completed, one that nobody else waits for: the wait goes
    on advancing the thread's calls, so it returns the sum, on every rank;
    the call whose callback it is completes too, and both communicators
    take the next call."""
    if comm.Get_size() < 2:
        pytest.skip("on one rank every call is complete when it starts")
    other = comm.Dup()
    try:
        p = comm.Get_size()
        for c in (comm, other):  # (a communicator's first call may complete as it starts)
            mar.iallreduce(np.ones(4), comm=c, algorithm="ring").wait()
        for algorithm in ("ring", "recursive_doubling"):
            first = mar.iallreduce(np.ones(4), comm=comm, algorithm="ring")
            second = mar.iallreduce(np.full(3, 2.0), comm=other, algorithm=algorithm)
            seen: list = []
            first.add_done_callback(lambda request: seen.append(second.wait().copy()))
            _until(lambda: seen)
            np.testing.assert_array_equal(seen[0], 2 * p)
            np.testing.assert_array_equal(first.wait(), p)
            np.testing.assert_array_equal(mar.iallreduce(np.ones(2), comm=other).wait(), p)
    finally:
        other.Free()


def test_callbacks_of_a_persistent_call_run_each_start(comm, progress_mode):
    x = np.ones(5)
    request = mar.allreduce_init(x, np.empty_like(x), comm=comm, algorithm="recursive_doubling")
    with request:
        for round_ in range(4):
            request.start()
            if round_ % 2:
                np.testing.assert_array_equal(request.wait(), comm.Get_size())
                continue
            seen: list = []
            request.add_done_callback(lambda r: seen.append(r.wait().copy()))
            _until(lambda: seen)
            assert len(seen) == 1
            np.testing.assert_array_equal(seen[0], comm.Get_size())
            with pytest.raises(mar.RequestError):
                request.add_done_callback(seen.append)  # (not started)


def test_request_misuse_raises(comm):
    x = np.ones(4)
    request = mar.iallreduce(x, None, comm=comm)
    request.wait()
    with pytest.raises(mar.RequestError, match="already complete"):
        request.wait()
    with pytest.raises(mar.RequestError, match="already complete"):
        request.test()
    persistent = mar.allreduce_init(x, np.empty(4), comm=comm)
    with pytest.raises(mar.RequestError, match="not started"):
        persistent.wait()
    persistent.start()
    with pytest.raises(mar.RequestError, match="still active"):
        persistent.start()
    with pytest.raises(mar.RequestError, match="active"):
        persistent.free()
    persistent.wait()
    persistent.free()
    with pytest.raises(mar.RequestError, match="freed"):
        persistent.start()


def test_nonblocking_check_mode_raises_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank cannot disagree")
    count = 3 + (comm.Get_rank() == 0)
    with pytest.raises(mar.ArgumentMismatch, match="count"):
        mar.iallreduce(np.ones(count), comm=comm, check=True)
    with pytest.raises(mar.ArgumentMismatch, match="count"):
        mar.allreduce_init(np.ones(count), comm=comm, check=True)


# --- reduce_scatter and allgather ---------------------------------------------

def block_counts(p: int) -> list:
    """Vector forms: uneven, empty and long blocks (the same on every rank)."""
    return [[(3 * r + 1) % 4 for r in range(p)], [0] * (p - 1) + [5], [2] * p]


@pytest.mark.parametrize("dtype,op", DTYPE_OPS[:4], ids=[f"{d}-{o}" for d, o in DTYPE_OPS[:4]])
def test_reduce_scatter_matches_mpi(comm, dtype, op):
    from mpi4py import MPI

    from mpi_allreduce.ops import resolve_op

    p, rank = comm.Get_size(), comm.Get_rank()
    mpi_op = resolve_op(op).mpi_op
    for counts in block_counts(p):
        n = sum(counts)
        data = mine(comm, dtype, op, n)
        ours = mar.reduce_scatter(data, None, op, counts, comm=comm, segment_size=2)
        theirs = np.empty(counts[rank], data.dtype)
        comm.Reduce_scatter(data, theirs, counts, mpi_op)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"counts {counts}")
        inplace = data.copy()
        mar.reduce_scatter(MPI.IN_PLACE, inplace, op, counts, comm=comm)
        np.testing.assert_array_equal(inplace[:counts[rank]], theirs)
    block = mine(comm, dtype, op, 3 * p)
    theirs = np.empty(3, block.dtype)
    comm.Reduce_scatter_block(block, theirs, mpi_op)
    np.testing.assert_array_equal(mar.reduce_scatter(block, np.empty_like(theirs), op, comm=comm),
                                  theirs)
    np.testing.assert_array_equal(mar.reduce_scatter(block, None, op, comm=comm), theirs)


@pytest.mark.parametrize("dtype", ["float64", "int8", "bool"])
def test_allgather_matches_mpi(comm, dtype):
    from mpi4py import MPI

    p, rank = comm.Get_size(), comm.Get_rank()
    mine_ = (np.arange(5) + 10 * rank).astype(dtype)
    theirs = np.empty((p, 5), dtype)
    comm.Allgather(mine_, theirs)
    np.testing.assert_array_equal(mar.allgather(mine_, comm=comm, segment_size=3), theirs)
    inplace = np.zeros((p, 5), dtype)
    inplace[rank] = mine_
    np.testing.assert_array_equal(mar.allgather(MPI.IN_PLACE, inplace, comm=comm), theirs)
    for counts in block_counts(p):
        offsets = np.concatenate([[0], np.cumsum(counts)])
        part = (np.arange(counts[rank]) + offsets[rank]).astype(dtype)
        want = np.empty(sum(counts), dtype)
        comm.Allgatherv(part, [want, counts])
        np.testing.assert_array_equal(mar.allgather(part, None, counts, comm=comm, segment_size=2),
                                      want, err_msg=f"counts {counts}")


@pytest.mark.parametrize("algorithm", [a for a in registry.HALVES if a != "ring"])
def test_halves_of_every_algorithm_match_mpi(comm, algorithm):
    """Each algorithm's halves (its own peers and ranges, laid out for MPI's
    blocks): uneven, empty and long blocks, segments, in place, equal to
    MPI's Reduce_scatter and Allgatherv; a non-commutative op where the
    algorithm combines in rank order, refused where it does not."""
    from mpi4py import MPI

    from mpi_allreduce.tools.verify import K, interval, interval_mpi

    p, rank = comm.Get_size(), comm.Get_rank()
    for counts in block_counts(p):
        n = sum(counts)
        data = np.arange(n, dtype=np.float64) * (rank + 1) + rank * rank
        theirs = np.empty(counts[rank])
        comm.Reduce_scatter(data, theirs, counts, MPI.SUM)
        for segment in (None, 2):
            ours = mar.reduce_scatter(data, None, "sum", counts, comm=comm, algorithm=algorithm,
                                      segment_size=segment)
            np.testing.assert_array_equal(ours, theirs, err_msg=f"counts {counts}")
        inplace = data.copy()
        mar.reduce_scatter(MPI.IN_PLACE, inplace, "sum", counts, comm=comm, algorithm=algorithm)
        np.testing.assert_array_equal(inplace[:counts[rank]], theirs)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        part = np.arange(offsets[rank], offsets[rank + 1], dtype=np.int32)
        want = np.empty(n, np.int32)
        comm.Allgatherv(part, [want, counts])
        np.testing.assert_array_equal(
            mar.allgather(part, None, counts, comm=comm, algorithm=algorithm, segment_size=2),
            want, err_msg=f"counts {counts}")
        whole = np.zeros(n, np.int32)
        whole[offsets[rank]:offsets[rank + 1]] = part
        mar.allgather(MPI.IN_PLACE, whole, counts, comm=comm, algorithm=algorithm)
        np.testing.assert_array_equal(whole, want)
    mine_ = np.full(3 * p, rank * (K + 1), np.int64)
    if algorithm in registry.ORDERED:
        op = MPI.Op.Create(interval_mpi, commute=False)
        try:
            expected = np.empty(3, np.int64)
            comm.Reduce_scatter_block(mine_, expected, op)
            np.testing.assert_array_equal(
                mar.reduce_scatter(mine_, None, interval, comm=comm, algorithm=algorithm),
                expected)
        finally:
            op.Free()
    elif p > 1:
        with pytest.raises(ValueError, match="commutative"):
            mar.reduce_scatter(mine_, None, interval, comm=comm, algorithm=algorithm)


def test_halves_refuse_algorithms_without_halves_and_check_names_what_differs(comm):
    """An all-reduce algorithm with no halves of its own is refused (the
    drop-in Comm's halves run the ring for it); ranks that name different
    algorithms or radices are told apart by check mode."""
    p, rank = comm.Get_size(), comm.Get_rank()
    with pytest.raises(ValueError, match="run one of ring"):
        mar.reduce_scatter(np.ones(p), None, comm=comm, algorithm="tree")
    with pytest.raises(TypeError, match="radix"):
        mar.allgather(np.ones(2), None, comm=comm, algorithm="rabenseifner", radix=3)
    wrapped = mar.Comm(comm, algorithm="recursive_doubling")
    want = np.arange(2 * p, dtype=np.float64) * p
    got = np.empty(2)
    wrapped.Reduce_scatter_block(np.arange(2 * p, dtype=np.float64), got)
    np.testing.assert_array_equal(got, want[2 * rank:2 * rank + 2])
    if p == 1:
        return
    with pytest.raises(mar.ArgumentMismatch, match="algorithm"):
        mar.reduce_scatter(np.ones(p), None, comm=comm, check=True,
                           algorithm="rabenseifner" if rank == 0 else "bine_bandwidth")
    if p >= 3:  # (radix 2 and 3 differ where the radix is not lowered to p)
        with pytest.raises(mar.ArgumentMismatch, match="options"):
            mar.allgather(np.ones(2), None, comm=comm, check=True, algorithm="knomial",
                          radix=2 if rank == 0 else 3)


def test_repeated_halves_skip_validation_and_changed_ones_do_not(comm, monkeypatch):
    """A reduce_scatter or allgather repeated with the very same arrays and
    arguments runs its kept bound call (the validating path is not taken:
    it would raise here) and is right; any change -- counts, the op object,
    the dtype, check mode, other arrays, IN_PLACE -- takes the full path."""
    from mpi4py import MPI

    from mpi_allreduce import collectives

    p, r = comm.Get_size(), comm.Get_rank()
    full = np.arange(3 * p, dtype=np.float64) + r
    part = np.empty(3)
    gathered = np.empty(3 * p)
    want_part = (np.arange(3 * p, dtype=np.float64) * p + p * (p - 1) / 2)[3 * r:3 * r + 3]
    mar.reduce_scatter(full, part, comm=comm)
    mar.allgather(part, gathered, comm=comm)
    real_run = collectives._run
    full_path = []

    def refuse(*args, **kwargs):
        full_path.append(args[1])
        return real_run(*args, **kwargs)
    monkeypatch.setattr(collectives, "_run", refuse)
    for _ in range(3):
        part[:] = 0
        assert mar.reduce_scatter(full, part, comm=comm) is part
        np.testing.assert_array_equal(part, want_part)
        assert mar.allgather(part, gathered, comm=comm) is gathered
        np.testing.assert_array_equal(gathered.reshape(p, 3)[r], part)
    # (one rank has no bound call to keep: it copies)
    assert full_path == [] or p == 1, "a repeat took the validating path"
    changed = [
        lambda: mar.reduce_scatter(full, part, MPI.SUM, [3] * p, comm=comm),  # counts
        lambda: mar.reduce_scatter(full, part, "sum", comm=comm),  # another op object
        lambda: mar.reduce_scatter(full, part, comm=comm, check=True),
        lambda: mar.reduce_scatter(full.copy(), part, comm=comm),  # other arrays
        lambda: mar.allgather(part, gathered, [3] * p, comm=comm),
        lambda: mar.allgather(MPI.IN_PLACE, gathered, comm=comm),
    ]
    for k, call in enumerate(changed):
        before = len(full_path)
        call()
        assert len(full_path) == before + 1, f"change {k} was taken for a repeat"
    np.testing.assert_array_equal(part, want_part)
    as_float32 = full.astype(np.float32)
    small = np.empty(3, np.float32)
    mar.reduce_scatter(as_float32, small, comm=comm)
    small.dtype = np.int32  # the same array object, reinterpreted
    with pytest.raises(TypeError):
        mar.reduce_scatter(as_float32, small, comm=comm)


def test_reduce_scatter_bad_counts_raise_on_every_rank(comm):
    p = comm.Get_size()
    with pytest.raises(ValueError, match="counts sum to"):
        mar.reduce_scatter(np.ones(p + 1), None, "sum", [1] * p, comm=comm)
    with pytest.raises(ValueError, match="counts must be"):
        mar.reduce_scatter(np.ones(p), None, "sum", [1] * (p + 1), comm=comm)
    if p > 1:
        with pytest.raises(ValueError, match="equal blocks"):
            mar.reduce_scatter(np.ones(p + 1), comm=comm)


def test_allgather_check_mode_finds_mismatched_blocks(comm):
    if comm.Get_size() == 1:
        pytest.skip("one rank cannot disagree")
    with pytest.raises(mar.ArgumentMismatch, match="counts"):
        mar.allgather(np.ones(2 + (comm.Get_rank() == 0)), comm=comm, check=True)


# --- fusion -------------------------------------------------------------------------

def model_like_arrays(rank: int, rng_seed: int = 3) -> list:
    """Mixed shapes and dtypes, as a model's gradients: many small, a few large."""
    rng = np.random.default_rng(rng_seed)
    shapes = [(64, 3, 3, 3), (64,), (64,), (128, 64, 1, 1), (128,), (1000, 128), (1000,), (7,),
              (3, 5), ()]
    arrays = [np.array(rng.integers(-50, 50, size=s) * (rank + 1), dtype=np.float32)
              for s in shapes]
    arrays += [np.arange(11, dtype=np.int64) * (rank + 2), np.arange(5, dtype=np.float64)[::2]]
    return arrays


@pytest.mark.parametrize("bucket_bytes", [1, 600, 1 << 22])
def test_fusion_matches_per_array_allreduce(comm, bucket_bytes, progress_mode):
    from mpi4py import MPI

    from mpi_allreduce.fusion import Fusion, bucket_bounds

    fusion = Fusion(comm, op="sum", bucket_bytes=bucket_bytes)
    for step in range(3):  # the later steps reuse the kept buckets
        arrays = model_like_arrays(comm.Get_rank() + step)
        want = [a.copy() for a in arrays]
        for w in want:
            comm.Allreduce(MPI.IN_PLACE, w, MPI.SUM)
        started = []
        for a in arrays:
            fusion.add(a)
            started.append(fusion.buckets_in_flight)
        fusion.wait()
        for k, (a, w) in enumerate(zip(arrays, want)):
            np.testing.assert_array_equal(a, w, err_msg=f"array {k}, step {step}")
        # float32 arrays come first: their buckets started as bucket_bounds
        # groups them; the last group only on wait() unless it is full
        floats = [a.nbytes for a in arrays if a.dtype == np.float32]
        groups = bucket_bounds(floats, bucket_bytes)
        last_full = sum(floats[groups[-1][0]:]) >= bucket_bytes
        assert started[len(floats) - 1] == len(groups) - (not last_full)


@pytest.mark.parametrize("homed", [False, True], ids=["packed", "in_buckets"])
def test_fusion_allreduce_of_a_list_finishes_each_bucket_as_the_next_starts(comm, homed):
    """``Fusion.allreduce(arrays)`` has nothing to overlap: at most two
    buckets are in flight at a time (the one just started and the one being
    finished), never all; the sums are those of per-array calls, in every
    step, with the buckets' memory reused; afterwards the fusion takes
    buckets side by side again (add/wait)."""
    from mpi4py import MPI

    from mpi_allreduce.fusion import Fusion

    fusion = Fusion(comm, op="sum", bucket_bytes=600)
    in_flight = []
    launch = fusion._launch

    def counted(key):
        launch(key)
        in_flight.append(fusion.buckets_in_flight)
    fusion._launch = counted
    for step in range(3):
        arrays = model_like_arrays(comm.Get_rank() + step)
        want = [a.copy() for a in arrays]
        for w in want:
            comm.Allreduce(MPI.IN_PLACE, w, MPI.SUM)
        if homed:
            views = fusion.empty_like(arrays)
            for view, a in zip(views, arrays):
                view[...] = a
            arrays = views
        in_flight.clear()
        fusion.allreduce(arrays)
        for k, (a, w) in enumerate(zip(arrays, want)):
            np.testing.assert_array_equal(a, w, err_msg=f"array {k}, step {step}")
        assert len(in_flight) > 3 and max(in_flight) == 2, in_flight
        assert fusion.buckets_in_flight == 0
    in_flight.clear()
    for a in arrays:
        fusion.add(a)
    fusion.wait()
    assert max(in_flight) > 2, in_flight


@pytest.mark.parametrize("bucket_bytes", [600, 1 << 22])
def test_fusion_of_arrays_in_their_buckets_packs_nothing_and_gives_the_same_bytes(
        comm, bucket_bytes, progress_mode):
    """Arrays from Fusion.empty_like, added in their order, are reduced where
    they lie (the packing path is never taken) and hold the same bytes as
    packed copies of them (random floats: any change of grouping or order
    would round differently); added in another order they are packed, and
    still right."""
    from mpi4py import MPI

    from mpi_allreduce.fusion import Fusion

    rng = np.random.default_rng(comm.Get_rank())
    templates = model_like_arrays(0)
    packed = Fusion(comm, op="sum", bucket_bytes=bucket_bytes)
    own = Fusion(comm, op="sum", bucket_bytes=bucket_bytes)
    views = own.empty_like(templates)
    assert [(v.shape, v.dtype) for v in views] == [(t.shape, t.dtype) for t in templates]

    def refuse(*args):
        raise AssertionError("an array made by empty_like was packed")
    for step in range(3):
        arrays = [rng.standard_normal(t.shape).astype(t.dtype) if t.dtype.kind == "f"
                  else t * (step + 1) for t in templates]
        for view, array in zip(views, arrays):
            view[...] = array
        packed.allreduce(arrays)
        own._reusable, kept = refuse, own._reusable
        own.allreduce(views)
        own._reusable = kept
        for k, (view, array) in enumerate(zip(views, arrays)):
            assert view.tobytes() == array.tobytes(), f"array {k}, step {step}"
    for view, array in zip(views, arrays):
        view[...] = array
    own.allreduce(views[::-1])  # another order: packed, and still the sum
    for view, array in zip(views, arrays):
        want = array.copy()
        comm.Allreduce(MPI.IN_PLACE, want, MPI.SUM)
        np.testing.assert_allclose(view, want, rtol=1e-5)
    own.free()
    packed.free()


def test_fusion_rejects_read_only(comm):
    from mpi_allreduce.fusion import Fusion

    frozen = np.ones(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        Fusion(comm).add(frozen)
