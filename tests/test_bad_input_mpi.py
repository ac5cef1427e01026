"""Bad input: a clear exception on every rank, never a hang.

Each case is raised by every rank of the communicator; the test then
checks (with a collective) that no rank went on without raising.  The
arguments are checked before any algorithm runs, where only ``auto``
(its tuning table) and ``hierarchical`` (its node options) take paths of
their own: the bad-input matrix runs on those and on one flat algorithm."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config
from mpi_allreduce.context import QUARANTINE, cached_context, context_for, release

from .conftest import PATH_VARIANTS
from .helpers import VARIANTS, expected, mine, raise_mode

#: what validation tells apart (mpi_allreduce/validate.py): a flat
#: algorithm, ``auto`` and ``hierarchical`` with its options
CHECKED_AS = [("auto", "auto", {})] + [v for v in VARIANTS
                                       if v[0] in ("ring", "hierarchical-rpn3-ring")]
CHECKED_IDS = [v[0] for v in CHECKED_AS]
#: one algorithm per kind of compiled round (conftest.PATH_VARIANTS)
PATHS = [v for v in VARIANTS if v[0] in PATH_VARIANTS]
PATH_IDS = [v[0] for v in PATHS]

pytestmark = pytest.mark.mpi


def raised_everywhere(comm, exc_type, match, call):
    with pytest.raises(exc_type, match=match):
        call()
    # every rank got here, so every rank raised: nobody is left inside a message
    assert comm.allreduce(1) == comm.Get_size()


def readonly(n):
    a = np.zeros(n)
    a.flags.writeable = False
    return a


BAD = {
    "dtype_mismatch": (TypeError, "sendbuf dtype float32 != recvbuf dtype float64",
                       lambda: (np.ones(4, np.float32), np.empty(4, np.float64), "sum")),
    "size_mismatch": (ValueError, "sendbuf has 4 elements, recvbuf has 5",
                      lambda: (np.ones(4), np.empty(5), "sum")),
    "unsupported_dtype": (TypeError, "unsupported dtype",
                          lambda: (np.array(["a", "b"]), None, "sum")),
    "object_dtype": (TypeError, "unsupported dtype",
                     lambda: (np.array([1, "x"], dtype=object), None, "sum")),
    "band_on_float": (TypeError, "op 'band' is not defined for dtype float64",
                      lambda: (np.ones(4), None, MPI.BAND)),
    "max_on_complex": (TypeError, "op 'max' is not defined for dtype complex64",
                       lambda: (np.ones(4, np.complex64), None, "max")),
    "avg_on_int": (TypeError, "op 'avg' is not defined for dtype int32",
                   lambda: (np.ones(4, np.int32), None, "avg")),
    "unknown_op": (ValueError, "unknown op 'mean'", lambda: (np.ones(4), None, "mean")),
    "unsupported_mpi_op": (ValueError, "one-sided",
                           lambda: (np.ones(4), None, MPI.REPLACE)),
    "non_contiguous_recv": (ValueError, "recvbuf must be C-contiguous",
                            lambda: (np.ones(4), np.empty(8)[::2], "sum")),
    "readonly_recv": (ValueError, "recvbuf is read-only", lambda: (np.ones(4), readonly(4), "sum")),
    "in_place_without_recv": (ValueError, "no recvbuf", lambda: (MPI.IN_PLACE, None, "sum")),
    "in_place_as_recv": (ValueError, "MPI.IN_PLACE goes in sendbuf",
                         lambda: (np.ones(4), MPI.IN_PLACE, "sum")),
    "overlapping_buffers": (ValueError, "overlap", lambda: (_overlap()[0], _overlap()[1], "sum")),
    "byte_swapped": (TypeError, "native byte order",
                     lambda: (np.ones(4, dtype=">i4" if np.little_endian else "<i4"), None, "sum")),
    "not_an_array": (TypeError, "expected an array or a buffer", lambda: (object(), None, "sum")),
}

_SHARED = np.zeros(8)


def _overlap():
    return _SHARED[:4], _SHARED[2:6]


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("variant", CHECKED_AS, ids=CHECKED_IDS)
def test_bad_input(comm, variant, case):
    exc_type, match, make = BAD[case]
    _, algorithm, options = variant
    send, recv, op = make()
    raised_everywhere(comm, exc_type, match,
                      lambda: mar.allreduce(send, recv, op, comm=comm, algorithm=algorithm,
                                            **options))


@pytest.mark.parametrize("setting", [
    ({"algorithm": "butterfly"}, ValueError, "unknown algorithm 'butterfly'; choose one of: auto, driver, ring"),
    ({"algorithm": "hierarchical", "ranks_per_node": 0}, ValueError, "ranks_per_node must be a positive"),
    ({"algorithm": "hierarchical", "inner": "hierarchical"}, ValueError, "cannot be 'hierarchical'"),
    ({"algorithm": "hierarchical", "inner": "nope"}, ValueError, "unknown algorithm 'nope'"),
    ({"segment_size": 0}, ValueError, "segment_size must be a positive integer"),
], ids=["unknown_algorithm", "ranks_per_node_0", "inner_hierarchical", "inner_unknown", "segment_0"])
def test_bad_settings(comm, setting):
    kwargs, exc_type, match = setting
    raised_everywhere(comm, exc_type, match,
                      lambda: mar.allreduce(np.ones(4), comm=comm, **kwargs))


def test_intercommunicator_rejected():
    raised_everywhere(MPI.COMM_WORLD, TypeError, "intra-communicator",
                      lambda: mar.allreduce(np.ones(2), comm=MPI.COMM_NULL))


# --- check mode: what one rank cannot see --------------------------------

def _differs_on_rank0(comm, same, other):
    return other if comm.Get_rank() == 0 else same


@pytest.mark.parametrize("what", ["count", "dtype", "op", "algorithm", "one_rank_bad_input"])
def test_check_mode_finds_disagreement(comm, what):
    if comm.Get_size() == 1:
        pytest.skip("nothing to disagree with on one rank")
    count = _differs_on_rank0(comm, 10, 11) if what == "count" else 10
    dtype = _differs_on_rank0(comm, np.float64, np.float32) if what == "dtype" else np.float64
    op = _differs_on_rank0(comm, "sum", "max") if what == "op" else "sum"
    algorithm = _differs_on_rank0(comm, "ring", "driver") if what == "algorithm" else "ring"
    recv = None
    if what == "one_rank_bad_input":
        recv = _differs_on_rank0(comm, np.empty(10), np.empty(10, np.float32))
    match = "rejected on 1 rank" if what == "one_rank_bad_input" else f"differ across ranks in {what}"
    raised_everywhere(comm, mar.ArgumentMismatch, match,
                      lambda: mar.allreduce(np.ones(count, dtype), recv, op, comm=comm,
                                            algorithm=algorithm, check=True))


def test_check_mode_from_environment(comm, monkeypatch, request):
    if comm.Get_size() == 1:
        pytest.skip("nothing to disagree with on one rank")
    monkeypatch.setenv("MPI_ALLREDUCE_CHECK", "1")
    config.refresh()
    request.addfinalizer(config.refresh)
    count = 5 + (comm.Get_rank() == comm.Get_size() - 1)
    raised_everywhere(comm, mar.ArgumentMismatch, "count",
                      lambda: mar.allreduce(np.ones(count), comm=comm))


def test_check_mode_passes_when_ranks_agree(comm):
    out = mar.allreduce(mine(comm, "int32", "sum", 9), op="sum", comm=comm, check=True)
    np.testing.assert_array_equal(out, expected(comm, "int32", "sum", 9))


# --- the library's private communicator -------------------------------------

def test_pending_caller_receive_is_not_matched(comm):
    """A caller's wildcard receive posted on the same communicator must not
    catch library messages: the library talks on its own duplicate."""
    size, rank = comm.Get_size(), comm.Get_rank()
    probe = np.full(1, -1.0)
    req = comm.Irecv(probe, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    for algorithm in mar.ALGORITHMS:
        out = mar.allreduce(mine(comm, "float64", "sum", 33), comm=comm, algorithm=algorithm)
        np.testing.assert_array_equal(out, expected(comm, "float64", "sum", 33))
    status = MPI.Status()
    assert not req.Test(status), (f"a library message reached the caller's receive "
                                  f"(source {status.source}, tag {status.tag})")
    comm.Barrier()  # nobody sends the caller's own message before everyone has looked
    comm.Send(np.array([float(rank)]), dest=(rank + 1) % size, tag=5)
    req.Wait()
    assert probe[0] == (rank - 1) % size


def test_duplicate_is_cached_and_released():
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank: allreduce returns before it needs a communicator")
    comm = MPI.COMM_WORLD.Dup()
    mar.allreduce(np.ones(3), comm=comm, algorithm="ring")
    ctx = context_for(comm)
    assert ctx.comm != comm and ctx.comm.Get_size() == comm.Get_size()
    assert MPI.Comm.Compare(ctx.comm, comm) == MPI.CONGRUENT
    mar.allreduce(np.ones(3), comm=comm, algorithm="ring")
    assert context_for(comm) is ctx and len(ctx.plans) == 1
    release(comm)
    assert ctx.comm == MPI.COMM_NULL
    comm.Free()


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("variant", PATHS, ids=PATH_IDS)
def test_numpy_subclasses_are_plain_arrays(comm, variant):
    """An np.matrix (the same on every rank) used to hang or raise on some
    ranks after messages had started; it is reduced as the plain array it
    is, into the caller's matrix."""
    _, algorithm, options = variant
    count = 2 * comm.Get_size() + 3
    data = np.asmatrix(mine(comm, "float64", "sum", count))
    out = np.asmatrix(np.zeros(count))
    mar.allreduce(data, out, "sum", comm=comm, algorithm=algorithm, **options)
    np.testing.assert_array_equal(np.asarray(out).ravel(), expected(comm, "float64", "sum", count))
    inplace = data.copy()
    mar.allreduce(MPI.IN_PLACE, inplace, "sum", comm=comm, algorithm=algorithm, **options)
    np.testing.assert_array_equal(np.asarray(inplace).ravel(), expected(comm, "float64", "sum",
                                                                        count))
    result = mar.allreduce(data, None, "sum", comm=comm, algorithm=algorithm, **options)
    np.testing.assert_array_equal(np.ravel(result), expected(comm, "float64", "sum", count))


# --- ranks that disagree, without check mode: never a wrong result --------------

def _mpi_sum(a, b, datatype):
    np.frombuffer(b, dtype=np.float64)[:] += np.frombuffer(a, dtype=np.float64)


def _mpi_prod(a, b, datatype):
    np.frombuffer(b, dtype=np.float64)[:] *= np.frombuffer(a, dtype=np.float64)


#: user ops that tell nothing apart by name: MPI.Op.Create ops (their
#: handles say nothing across ranks) and two lambdas (one qualified name)
USER_OPS = {"mpi_sum": MPI.Op.Create(_mpi_sum, commute=True),
            "mpi_prod": MPI.Op.Create(_mpi_prod, commute=True),
            "lambda_add": mar.user_op(lambda a, b: a + b, commute=True),
            "lambda_mul": mar.user_op(lambda a, b: a * b, commute=True)}

#: per kind of disagreement, rank -> (count, dtype, op, algorithm or None)
MISMATCHES = {
    "op": lambda r: (5, "float64", "max" if r == 0 else "sum", None),
    "count": lambda r: (5 + (r == 0), "float64", "sum", None),
    "dtype": lambda r: (5, "float32" if r == 0 else "float64", "sum", None),
    "count0": lambda r: (0 if r == 0 else 5, "float64", "sum", None),
    "algorithm": lambda r: (5, "float64", "sum", "driver" if r == 0 else None),
    "user MPI.Op": lambda r: (5, "float64", USER_OPS["mpi_sum" if r == 0 else "mpi_prod"], None),
    "user callable": lambda r: (5, "float64", USER_OPS["lambda_add" if r == 0 else "lambda_mul"],
                                None),
}


@pytest.fixture
def raising_watchdog(monkeypatch):
    """A watchdog that raises Stalled after half a second."""
    yield from raise_mode(monkeypatch, 0.5)


def _persistent(*args, **keywords):
    """A persistent call, started once and waited for (freed once it returned)."""
    request = mar.allreduce_init(*args, **keywords)
    request.start()
    out = request.wait()
    request.free()
    return out


#: each kind of all-reduce call (the persistent one on one algorithm: its
#: messages come from the same compiled stages as the non-blocking call's)
KINDS = {
    "allreduce": mar.allreduce,
    "iallreduce": lambda *a, **k: mar.iallreduce(*a, **k).wait(),
    "persistent": _persistent,
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("what", list(MISMATCHES))
def test_mismatched_calls_stall_and_raise_never_return_wrong(raising_watchdog, what, algorithm,
                                                             kind):
    """Messages of calls the ranks disagree about cannot match (their tags
    come from the call's fingerprint): ranks wait, and the watchdog raises
    Stalled there.  A rank that returns (one that had nothing to receive)
    must not have skipped the call: its next call, which every rank makes
    alike, is exact or stalls (an empty call is no short cut on several
    ranks: before, a rank of count 0 returned at once and its next call met
    its peers' mismatched one, a wrong sum on both)."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank cannot disagree")
    if kind == "persistent" and algorithm != "ring":
        pytest.skip("the persistent call is tried on one algorithm")
    blocking = kind == "allreduce"
    comm = world.Dup()  # its private communicator is left unusable: a fresh one per case
    count, dtype, op, other = MISMATCHES[what](comm.Get_rank())
    data = np.arange(count, dtype=dtype) + 1
    wrong = None  # (judged once every rank is done: a failure on one rank fails all)
    try:
        call = KINDS[kind]
        out = call(data, None, op, comm=comm, algorithm=other or algorithm)
        stalled = False
        if out.size:
            wrong = f"a mismatched call returned {out}"
        agreed = np.arange(5.0) + comm.Get_rank()
        after = call(agreed, None, "sum", comm=comm, algorithm=algorithm)
        exact = np.arange(5.0) * comm.Get_size() + comm.Get_size() * (comm.Get_size() - 1) / 2
        if not np.array_equal(after, exact):
            wrong = f"the next call after a mismatched one returned {after}, not {exact}"
    except mar.Stalled as exc:
        stalled = True
        if not ("call #" in str(exc) and "ranks" in str(exc)):
            wrong = f"the report names no call and ranks: {exc}"
        try:  # the communicator stays unusable
            if blocking:
                mar.allreduce(data, None, op, comm=comm, algorithm=other or algorithm)
                wrong = "a call after the stall returned"
            else:
                raise mar.Stalled(context_for(comm).broken or "stalled")
        except mar.Broken as again:  # (Stalled is a Broken)
            if not isinstance(again, mar.Stalled) or "stalled" not in str(again):
                wrong = f"the call after the stall raised {again!r}"
    everyone = world.allgather((stalled, wrong))
    assert not any(w for _, w in everyone), everyone
    assert any(s for s, _ in everyone), everyone
    context = cached_context(comm)
    comm.Free()
    if stalled:
        # its private duplicate is kept, never freed: MPI cannot give its
        # context to a new communicator whose messages could meet the old ones
        assert any(kept is context.comm for kept in QUARANTINE)
        assert context.comm.Get_size() == world.Get_size()


#: each kind of call, given a receive buffer and options: (call, exact result)
def _refusable(kind, comm, recv, sendbuf=None, **options):
    p, r = comm.Get_size(), comm.Get_rank()
    x = np.arange(4.0 * p) + r if sendbuf is None else sendbuf
    whole = np.arange(4.0 * p) * p + p * (p - 1) / 2
    if kind == "allreduce":
        return lambda: mar.allreduce(x, recv, comm=comm, **options), whole
    if kind == "iallreduce":
        return lambda: mar.iallreduce(x, recv, comm=comm, **options).wait(), whole
    if kind == "allreduce_init":
        return lambda: _persistent(x, recv, comm=comm, **options), whole
    if kind == "reduce_scatter":
        return (lambda: mar.reduce_scatter(x, recv[:4], comm=comm, **options),
                whole[4 * r:4 * r + 4])
    gathered = np.repeat(np.arange(p, dtype=float), 4)
    block = np.full(4, float(r)) if sendbuf is None else sendbuf
    return (lambda: mar.allgather(block, recv, comm=comm, **options), gathered)


class _Unexportable:
    """A CPU array through DLPack whose export fails with BufferError (as a
    torch tensor that requires grad does): a refusal of no TypeError or
    ValueError."""

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **_):
        raise BufferError("this array cannot be exported")


REFUSALS = {
    "read-only recvbuf": lambda recv: (recv.setflags(write=False), {})[1],
    "send buffer whose export raises BufferError": lambda recv: {"sendbuf": _Unexportable()},
    "unknown algorithm": lambda recv: {"algorithm": "no-such-algorithm"},
    # (refused where the plan is made, against the communicator's size)
    "torus row that does not divide the ranks": lambda recv: {
        "algorithm": "torus", "row_size": recv.size // 4 + 1},
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize("kind", ["allreduce", "iallreduce", "allreduce_init", "reduce_scatter",
                                  "allgather"])
def test_a_call_refused_on_one_rank_stalls_never_shifts_the_next(raising_watchdog, kind,
                                                                  refusal):
    """Rank 0 gives bad input (a read-only receive buffer, a send buffer
    that cannot be exported, an unknown algorithm) and goes on; its peers
    make the call right.  A refusal is no
    short cut: rank 0's refused call is an empty call of its own, which
    stalls with the peers' real call (reported on every rank) -- never
    rank 0's next call meeting its peers' refused one (before: wrong sums on
    both).  Where every rank refuses, every rank raises its own error and
    the next call is exact."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank cannot disagree")
    for everywhere in (True, False):
        comm = world.Dup()
        rank, p = comm.Get_rank(), comm.Get_size()
        bad = everywhere or rank == 0
        recv = np.zeros(4 * p)
        options = REFUSALS[refusal](recv) if bad else {}
        if "torus" in refusal and kind in ("reduce_scatter", "allgather"):
            options = {}  # (the halves take no torus: that refusal is the algorithm's)
            bad = False
        call, _ = _refusable(kind, comm, recv, **options)
        outcomes = []
        try:
            call()
            outcomes.append("returned")
        except mar.Stalled:
            outcomes.append("Stalled")
        except (TypeError, ValueError, BufferError) as exc:
            outcomes.append(f"refused: {type(exc).__name__}")
        try:  # the next call, the same on every rank
            again, want = _refusable(kind, comm, np.zeros(4 * p))
            out = again()
            outcomes.append("exact" if np.array_equal(out.reshape(-1), want) else "WRONG")
        except mar.Broken as exc:  # (Stalled is a Broken)
            outcomes.append(type(exc).__name__)
        everyone = world.allgather(outcomes)
        assert not any("WRONG" in o for o in everyone), (everywhere, everyone)
        if not world.allreduce(int(bad)):
            assert all(o == ["returned", "exact"] for o in everyone), everyone
        elif everywhere:
            assert all(o[0].startswith("refused") and o[1] == "exact" for o in everyone), everyone
        else:
            assert all(o[0] == "Stalled" for o in everyone), everyone
        comm.Free()
