"""Every algorithm on every kind of sub-communicator, checked against a
reduction computed locally from every rank's (deterministic) input.

Run under mpiexec with ``--with-mpi``; tests/test_launch.py runs this file
at the world sizes its docstring gives (communicators of 1 to 5, 7 and 8
ranks).  Schedules, counts, segments, in place, bit-identity and message
cutting run on every algorithm; the dtype, op and MPI.Op matrices, which
do not depend on the algorithm, on one algorithm per kind of compiled
round (conftest.PATH_VARIANTS)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config
from mpi_allreduce.ops import OPS, SUPPORTED_DTYPES
from mpi_allreduce.options import options

from .conftest import PATH_VARIANTS
from .helpers import VARIANT_IDS, VARIANTS, expected, mine

#: the variants of conftest.PATH_VARIANTS: one per kind of compiled round
PATHS = [v for v in VARIANTS if v[0] in PATH_VARIANTS]
PATH_IDS = [v[0] for v in PATHS]
assert len(PATHS) == len(PATH_VARIANTS)

pytestmark = pytest.mark.mpi

DTYPE_OP = {name: ("lor" if name == "bool" else "sum") for name in SUPPORTED_DTYPES}
OP_DTYPE = {"sum": "int32", "prod": "int64", "min": "float32", "max": "int16", "land": "bool",
            "lor": "uint8", "lxor": "int8", "band": "uint32", "bor": "int64", "bxor": "uint16",
            "avg": "float64"}
#: every op but the pair ops (tests/test_types_ops_mpi.py has those)
assert set(OP_DTYPE) == set(OPS) - {"maxloc", "minloc"}


#: counts relative to the communicator size p: 0, 1, p-1, p, p+1, primes, 2^k +- 1
COUNTS = {
    "0": lambda p: 0, "1": lambda p: 1, "p-1": lambda p: p - 1, "p": lambda p: p,
    "p+1": lambda p: p + 1, "13": lambda p: 13, "127": lambda p: 127, "1025": lambda p: 1025,
}


def run(comm, variant, dtype, op, count, in_place, **extra):
    """Allreduce into a receive buffer followed by a sentinel element; check both."""
    _, algorithm, options = variant
    data = mine(comm, dtype, op, count)
    storage = np.zeros(count + 1, dtype=dtype)
    storage[count] = sentinel = np.array(42).astype(dtype)
    recv = storage[:count]
    if in_place:
        recv[...] = data
        out = mar.allreduce(MPI.IN_PLACE, recv, op, comm=comm, algorithm=algorithm,
                            **options, **extra)
    else:
        out = mar.allreduce(data, recv, op, comm=comm, algorithm=algorithm, **options, **extra)
        np.testing.assert_array_equal(data, mine(comm, dtype, op, count))  # input untouched
    assert out is recv
    np.testing.assert_array_equal(recv, expected(comm, dtype, op, count))
    assert storage[count] == sentinel, "the element after the receive buffer was overwritten"
    return recv


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("count", list(COUNTS))
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_counts(comm, variant, count, in_place):
    run(comm, variant, "float32", "sum", COUNTS[count](comm.Get_size()), in_place)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("variant", PATHS, ids=PATH_IDS)
def test_dtypes(comm, variant, dtype):
    run(comm, variant, dtype, DTYPE_OP[dtype], 2 * comm.Get_size() + 3, in_place=False)


@pytest.mark.parametrize("op", list(OP_DTYPE))
@pytest.mark.parametrize("variant", PATHS, ids=PATH_IDS)
def test_ops(comm, variant, op):
    run(comm, variant, OP_DTYPE[op], op, 3 * comm.Get_size() + 1, in_place=True)


@pytest.mark.parametrize("op", ["sum", "max", "bor"])
@pytest.mark.parametrize("variant", PATHS, ids=PATH_IDS)
def test_mpi_op_objects(comm, variant, op):
    """A predefined MPI.Op works like its name."""
    _, algorithm, options = variant
    data = mine(comm, "int64", op, 11)
    out = mar.allreduce(data, op=getattr(MPI, op.upper()), comm=comm, algorithm=algorithm,
                        **options)
    np.testing.assert_array_equal(out, expected(comm, "int64", op, 11))


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("segment_size", [1, 2, 3])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_multi_segment_paths(comm, variant, segment_size, in_place):
    """Tiny segments reach the multi-segment paths (ring, pipelined ring,
    recursive doubling and its fold, Rabenseifner) with tiny arrays."""
    for count in (comm.Get_size() + 1, 29):
        run(comm, variant, "int32", "sum", count, in_place, segment_size=segment_size)


#: scratch each algorithm may hold, in elements, for a vector of n on p ranks
#: cut into segments of s
SCRATCH_BOUND = {
    "ring": lambda n, p, s: min(-(-n // p), s),
    "ring_pipelined": lambda n, p, s: 2 * min(-(-n // p), s),
    "recursive_doubling": lambda n, p, s: min(n, s),
    "rabenseifner": lambda n, p, s: min(n, s),
    "driver": lambda n, p, s: min(n, s),
}


@pytest.mark.parametrize("segment_size", [5, 64, 4096])
@pytest.mark.parametrize("algorithm", list(SCRATCH_BOUND))
def test_scratch_is_bounded_by_a_segment(comm, algorithm, segment_size):
    """A plan's scratch is what its algorithm needs at most: one segment (two
    for the pipelined ring), never a copy of the vector, on any rank."""
    from mpi_allreduce import planner, validate
    from mpi_allreduce.context import context_for

    n, p = 1000, comm.Get_size()
    if p == 1:
        pytest.skip("one rank: nothing is planned")
    send = np.arange(n, dtype=np.float64)
    out = mar.allreduce(send, comm=comm, algorithm=algorithm, segment_size=segment_size)
    np.testing.assert_array_equal(out, send * p)
    # the cached runner of that call
    call = validate.validate(send, None, "sum", options(algorithm=algorithm,
                                                        segment_size=segment_size))
    held = planner.plan_for(context_for(comm), call, algorithm).scratch_bytes // send.itemsize
    bound = max(1, SCRATCH_BOUND[algorithm](n, p, segment_size))
    assert held <= bound, f"{algorithm} holds {held} elements of scratch, bound {bound}"


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_bit_identical_on_every_rank(comm, variant):
    """Random floats: the sum differs from a serial sum by rounding, but every
    rank must hold the very same bytes, and close to the exact sum."""
    _, algorithm, options = variant
    data = mine(comm, "float32", "sum", 1001, kind="random")
    out = mar.allreduce(data, comm=comm, algorithm=algorithm, **options)
    digests = comm.allgather(hashlib.sha1(out.tobytes()).hexdigest())
    assert len(set(digests)) == 1, f"ranks hold different results: {digests}"
    exact = expected(comm, "float64", "sum", 1001, kind="random")
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5 * comm.Get_size())


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_shapes_and_returned_buffer(comm, variant):
    """recvbuf=None allocates like sendbuf; shapes may differ if sizes match;
    a non-contiguous sendbuf is accepted (only recvbuf must be contiguous)."""
    _, algorithm, options = variant
    size = comm.Get_size()
    x = np.arange(24, dtype=np.float64).reshape(4, 6) * (comm.Get_rank() + 1)
    y = mar.allreduce(x, comm=comm, algorithm=algorithm, **options)
    assert y.shape == (4, 6) and y.dtype == x.dtype
    np.testing.assert_array_equal(y, np.arange(24).reshape(4, 6) * size * (size + 1) / 2)
    flat = np.empty(24)
    mar.allreduce(x.T, flat, comm=comm, algorithm=algorithm, **options)
    np.testing.assert_array_equal(flat, np.ascontiguousarray(y.T).reshape(-1))


@pytest.mark.parametrize("algorithm", ["auto"] + list(mar.ALGORITHMS))
def test_repeated_calls_reuse_the_plan(comm, algorithm):
    """The second call with the same arguments runs the cached plan and is still right."""
    for _ in range(3):
        run(comm, ("", algorithm, {}), "float64", "sum", 37, in_place=True)


@pytest.fixture
def validations(monkeypatch):
    """Counts how often allreduce validates its arguments (the slow path)."""
    from mpi_allreduce import validate

    calls = []
    real = validate.validate

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(validate, "validate", counting)
    return calls


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("algorithm", ["auto"] + list(mar.ALGORITHMS))
def test_repeat_with_same_buffers_skips_validation(comm, algorithm, in_place, validations):
    """A repeat with the same buffer objects takes the prepared call (no
    validation) and is right for whatever data the buffers now hold."""
    size, count = comm.Get_size(), 29
    send = np.empty(count)
    recv = np.empty(count)
    for step in range(4):
        mine_now = np.arange(count) * (comm.Get_rank() + 1) + step
        (recv if in_place else send)[...] = mine_now
        mar.allreduce(MPI.IN_PLACE if in_place else send, recv, comm=comm, algorithm=algorithm)
        np.testing.assert_array_equal(
            recv, np.arange(count) * size * (size + 1) / 2 + step * size)
    expected_validations = 1 if size > 1 else 4  # one rank: nothing worth keeping
    assert len(validations) == expected_validations


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
def test_a_repeated_reproducible_sum_skips_validation_too(comm, in_place, validations):
    """reproducible=True repeats are kept calls as well: validated once (with
    its two inner all-reduces' set-up), right for the buffers' new data, and
    a call with other options on the same buffers is not taken for one."""
    size, count = comm.Get_size(), 23
    send, recv = np.empty(count), np.empty(count)
    first = None
    for step in range(4):
        (recv if in_place else send)[...] = np.arange(count) * (comm.Get_rank() + 1) + step / 4
        mar.allreduce(MPI.IN_PLACE if in_place else send, recv, comm=comm, reproducible=True)
        np.testing.assert_array_equal(
            recv, np.arange(count) * size * (size + 1) / 2 + step / 4 * size)
        first = len(validations) if first is None else first
    # the first call validated (its inner all-reduces too, unless their shape was kept)
    assert first >= 1 and len(validations) == (first if size > 1 else 4)
    (recv if in_place else send)[...] = 1.0
    mar.allreduce(MPI.IN_PLACE if in_place else send, recv, comm=comm)
    np.testing.assert_array_equal(recv, float(size))
    assert len(validations) == (first + 1 if size > 1 else 5)  # the plain call: validated anew


def test_a_reshaped_buffer_is_the_same_memory(comm, validations):
    """A kept call holds views of the buffers: reshaping one in place changes
    nothing they cover, so the repeat stays on the short way and is right."""
    size = comm.Get_size()
    send, recv = np.ones(12), np.empty(12)
    mar.allreduce(send, recv, comm=comm)
    before = len(validations)
    recv.shape = (3, 4)
    mar.allreduce(send, recv, comm=comm)
    np.testing.assert_array_equal(recv, np.full((3, 4), size))
    assert len(validations) == before + (size == 1)
    if size > 1:
        with pytest.raises(ValueError):  # and numpy cannot resize it under the kept views
            recv.resize(24)


@pytest.mark.parametrize("change", ["dtype", "other_buffer", "new_op"])
def test_a_changed_call_is_validated_again(comm, change, validations):
    """What may change between calls on live arrays sends the call back
    through validation: results stay right and bad states still raise."""
    size = comm.Get_size()
    send, recv = np.ones(12), np.empty(12)
    mar.allreduce(send, recv, comm=comm)
    before = len(validations)
    if change == "dtype":
        recv.dtype = np.int64
        with pytest.raises(TypeError, match="dtype"):
            mar.allreduce(send, recv, comm=comm)
    elif change == "other_buffer":
        other = np.full(12, 2.0)
        mar.allreduce(other, recv, comm=comm)
        np.testing.assert_array_equal(recv, np.full(12, 2.0 * size))
    else:
        mar.allreduce(send, recv, "max", comm=comm)
        np.testing.assert_array_equal(recv, np.ones(12))
    # (a refusal on several ranks also validates its own empty call: api.refused)
    assert len(validations) == before + 1 + (change == "dtype" and size > 1)


#: each kind of call a repeat of which is a kept call's
KEPT_KINDS = {
    "allreduce": lambda send, recv, comm: mar.allreduce(send, recv, comm=comm),
    "iallreduce": lambda send, recv, comm: mar.iallreduce(send, recv, comm=comm).wait(),
    "reduce_scatter": lambda send, recv, comm: mar.reduce_scatter(send, recv, comm=comm),
}


@pytest.mark.filterwarnings("ignore:Setting the strides:DeprecationWarning")
@pytest.mark.parametrize("kind", list(KEPT_KINDS))
@pytest.mark.parametrize("change", ["recv_strides", "send_strides", "recv_read_only"])
def test_a_kept_calls_buffers_changed_in_place_are_validated_again(comm, kind, change):
    """The same array objects, changed in place between two calls (numpy
    lets a caller assign ``strides`` and ``flags.writeable``): the repeat
    is judged as a first call would be -- a receive buffer no longer
    C-contiguous, or read-only, raises; a send buffer now in Fortran order
    is reduced in its logical order (before: the kept call's views, made of
    the memory as it was, reduced it in memory order, a wrong result, or
    wrote into an array the caller had made read-only)."""
    p, r = comm.Get_size(), comm.Get_rank()
    send = np.arange(4.0 * p).reshape(p, 4) + r
    recv = np.zeros((2, 4) if kind != "reduce_scatter" else (2, 2))
    if kind != "reduce_scatter":
        send = send.reshape(-1)[:8].reshape(2, 4) if p >= 2 else np.arange(8.0).reshape(2, 4)
    call = KEPT_KINDS[kind]
    call(send, recv, comm)
    call(send, recv, comm)  # (the kept call's repeat)
    if change == "send_strides":
        rows = send.shape[0]
        send.strides = (8, 8 * rows)  # (Fortran order, the same memory)
        logical = np.ascontiguousarray(send) - r
        want = (logical * p + p * (p - 1) / 2).reshape(-1)
        if kind == "reduce_scatter":
            want = want[4 * r:4 * r + 4]
        np.testing.assert_array_equal(call(send, recv, comm).reshape(-1), want)
        return
    if change == "recv_strides":
        recv.strides = (8, 8 * recv.shape[0])
    else:
        recv.flags.writeable = False
    before = recv.copy()
    with pytest.raises(ValueError, match="C-contiguous|read-only"):
        call(send, recv, comm)
    np.testing.assert_array_equal(recv, before)


@pytest.mark.parametrize("dies", ["send", "recv"])
def test_a_dropped_buffer_drops_its_kept_call(comm, dies):
    """A kept call is found by the ids of its buffers and holds views of
    them; when the caller lets one go, the next call that is not a repeat
    drops the entry and so frees the buffer (it is not kept alive)."""
    import weakref

    from mpi_allreduce.context import CALLS

    if comm.Get_size() == 1:
        pytest.skip("one rank: nothing is kept")
    send, recv = np.ones(16), np.empty(16)
    mar.allreduce(send, recv, comm=comm)
    ids = (id(send), id(recv))

    def kept():
        return any((k.send, key) == ids for key, k in CALLS.items())
    assert kept()
    gone = weakref.ref(send if dies == "send" else recv)
    if dies == "send":
        del send
        send = [2.0] * 16  # a list, converted on the way in
    else:
        del recv
        recv = np.empty(16)
    mar.allreduce(np.ones(3), comm=comm)  # any call that is not a repeat
    assert not kept() and gone() is None
    out = mar.allreduce(send, recv, comm=comm)
    mine = 2.0 if dies == "send" else 1.0
    np.testing.assert_array_equal(out, np.full(16, mine * comm.Get_size()))


def test_alternating_calls_stay_kept(comm):
    """Two call shapes in turn, each buffer held in one place only (an
    attribute): neither entry is taken for abandoned by the other's call,
    so both repeats take the kept path (their references were once
    counted one too many, so each call dropped the other's entry)."""
    from mpi_allreduce.context import CALLS

    if comm.Get_size() == 1:
        pytest.skip("one rank: nothing is kept")

    class Holder:
        pass

    h = Holder()
    h.a, h.b, h.c, h.d = np.ones(3, np.int16), np.empty(3, np.int16), np.ones(5), np.empty(5)
    for _ in range(3):
        mar.allreduce(h.a, h.b, "max", comm=comm)
        mar.allreduce(h.c, h.d, comm=comm)
        assert id(h.b) in CALLS and id(h.d) in CALLS


def test_a_freed_communicator_is_not_reused(validations):
    """A prepared call dies with its communicator (its plan's scratch is not
    kept alive): the next call raises."""
    from mpi_allreduce.context import CALLS

    comm = MPI.COMM_WORLD.Dup()
    send, recv = np.ones(5), np.empty(5)
    mar.allreduce(send, recv, comm=comm)
    kept = [k for k in CALLS.values() if k.comm is comm]
    assert len(kept) == (1 if comm.Get_size() > 1 else 0)
    comm.Free()
    assert not any(k.comm is comm for k in CALLS.values())
    with pytest.raises(TypeError, match="intra-communicator"):
        mar.allreduce(send, recv, comm=comm)


def test_refresh_forgets_prepared_calls(comm, validations, monkeypatch):
    """Settings read from the environment are re-read after refresh()."""
    from mpi_allreduce import config

    send, recv = np.ones(40), np.empty(40)
    mar.allreduce(send, recv, comm=comm)
    monkeypatch.setenv(config.SEGMENT_ENV, "16")
    config.refresh()
    try:
        before = len(validations)
        mar.allreduce(send, recv, comm=comm, algorithm="ring")
        mar.allreduce(send, recv, comm=comm)
        assert len(validations) == before + 2
        np.testing.assert_array_equal(recv, np.full(40, comm.Get_size()))
    finally:
        monkeypatch.delenv(config.SEGMENT_ENV)
        config.refresh()


def test_oversubscription_is_agreed_by_every_rank(comm, monkeypatch):
    """One oversubscribed node makes every rank of comm choose as oversubscribed
    (so all ranks run the same algorithm); the launcher's count is used."""
    import os

    from mpi_allreduce.topology import LOCAL_SIZE_ENV, oversubscribed

    for name in LOCAL_SIZE_ENV:
        monkeypatch.delenv(name, raising=False)
    cpus = os.cpu_count() or 1
    monkeypatch.setenv(LOCAL_SIZE_ENV[0], str(cpus + 1 if comm.Get_rank() == 0 else 1))
    assert oversubscribed(comm) is True
    monkeypatch.setenv(LOCAL_SIZE_ENV[1], str(cpus + 1))
    monkeypatch.setenv(LOCAL_SIZE_ENV[0], "1")  # the first launcher variable found counts
    assert oversubscribed(comm) is False


@pytest.mark.parametrize("count", [2, 1000, 70001])
def test_auto_is_reproducible(comm, count):
    """auto by default: the same bytes on every call, on every rank, and the
    very bytes of the table's choice run by name (random floats, whose
    rounding depends on the order of combination)."""
    from mpi_allreduce.selection import choose
    from mpi_allreduce.context import context_for

    data = mine(comm, "float32", "sum", count, kind="random")
    out = np.empty_like(data)
    digests = set()
    for _ in range(120):
        mar.allreduce(data, out, comm=comm)
        digests.add(hashlib.sha1(out.tobytes()).hexdigest())
    assert len(digests) == 1
    assert len(set(comm.allgather(digests.pop()))) == 1
    if comm.Get_size() > 1:
        name = choose(count * 4, comm.Get_size(),
                      oversubscribed=context_for(comm).oversubscribed)
        named = mar.allreduce(data, comm=comm, algorithm=name)
        assert named.tobytes() == out.tobytes()


def test_live_selection_is_right_and_agreed(comm, monkeypatch):
    """selection="live" probes other algorithms on live calls: every call is
    still right, and every rank runs the same algorithm in every call (the
    bytes agree across ranks call by call).  A generous budget makes sure
    it probes within the test's calls."""
    from mpi_allreduce.selection import LiveSelector

    monkeypatch.setattr(LiveSelector, "BUDGET", 1.0)
    count = 5000  # 20 kB: live selection starts at 16 KiB
    data = mine(comm, "float32", "sum", count, kind="random")
    exact = expected(comm, "float64", "sum", count, kind="random")
    out = np.empty_like(data)
    digests = []
    for _ in range(600):
        mar.allreduce(data, out, comm=comm, selection="live")
        np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5 * comm.Get_size())
        digests.append(hashlib.sha1(out.tobytes()).hexdigest())
    everyone = comm.allgather(digests)
    assert all(d == everyone[0] for d in everyone)
    if comm.Get_size() > 1:  # and it did run other candidates than the table's
        from mpi_allreduce.context import context_for

        selector, = [s for shape, s in context_for(comm).selectors.items()
                     if shape[0] == count]
        assert sum(n for name, n in selector._counts.items() if name != selector.current) > 0


def test_live_selection_leaves_short_vectors_to_the_table(comm):
    from mpi_allreduce.context import context_for

    data = np.ones(100, np.float32)
    for _ in range(100):
        mar.allreduce(data, comm=comm, selection="live")
    if comm.Get_size() > 1:
        assert not [s for shape, s in context_for(comm).selectors.items() if shape[0] == 100]


def test_unknown_selection_is_refused(comm):
    with pytest.raises(ValueError, match="selection must be one of table, live"):
        mar.allreduce(np.ones(3), comm=comm, selection="fastest")


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_messages_longer_than_the_count_limit_are_cut(comm, variant, monkeypatch):
    """MPI counts are C ints: a message of more elements travels as several
    (the driver's whole-vector messages hit this at 2**31 elements).  The
    limit is lowered here so that every algorithm's messages are cut, with
    raw-byte (float16) and typed (int64) wire types, blocking and not."""
    from mpi_allreduce import executor, registry
    from mpi_allreduce.backend import backend_for
    from mpi_allreduce.context import context_for
    from mpi_allreduce.ops import resolve_op
    from mpi_allreduce.spec import CallSpec

    monkeypatch.setattr(executor, "MAX_MESSAGE_COUNT", 14)
    config.refresh()  # no plan or bound call made with the real limit
    _, algorithm, options = variant
    try:
        for dtype in ("float16", "int64"):
            count = 97
            data = mine(comm, dtype, "sum", count)
            out = mar.allreduce(data, None, "sum", comm=comm, algorithm=algorithm,
                                segment_size=1 << 20, **options)
            np.testing.assert_array_equal(out, expected(comm, dtype, "sum", count))
            request = mar.iallreduce(data, np.empty_like(data), "sum", comm=comm,
                                     algorithm=algorithm, segment_size=1 << 20, **options)
            np.testing.assert_array_equal(request.wait(), expected(comm, dtype, "sum", count))
            if comm.Get_size() > 1 and algorithm != "hierarchical":
                spec = CallSpec("allreduce", algorithm, comm.Get_size(), count,
                                data.dtype.str, "sum", 1 << 20)
                plan = executor.Plan(context_for(comm).comm, registry.schedule(
                    algorithm, comm.Get_rank(), comm.Get_size(), count, 1 << 20),
                    data.dtype, resolve_op("sum"), backend_for(data), spec)
                lengths = [len(v) for stage in plan.bind(data, out).stages
                           for send, _, recv, _ in stage.pairs for v in (send, recv)
                           if v is not None]
                limit = 14 // (2 if executor.wire_type(data.dtype) == MPI.BYTE else 1)
                assert lengths and max(lengths) <= limit
    finally:
        monkeypatch.undo()
        config.refresh()


def test_threads_each_on_their_own_communicator():
    """Four threads per rank, each calling on its own communicator (set up
    first, from one thread, with ``mar.setup``), all at once."""
    import threading

    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("the MPI library does not run MPI_THREAD_MULTIPLE")
    world = MPI.COMM_WORLD
    comms = [world.Dup() for _ in range(4)]
    for c in comms:
        mar.setup(c)
    p, rank = world.Get_size(), world.Get_rank()
    errors = []

    def work(k, comm):
        try:
            algorithm = ("ring", "recursive_doubling", "rabenseifner", "auto")[k]
            for i in range(20):
                x = np.full(50 + k + i, rank + k, np.int64)
                y = mar.allreduce(x, None, "sum", comm=comm, algorithm=algorithm)
                assert (y == sum(range(p)) + p * k).all(), (k, i)
                z = mar.iallreduce(x, np.empty_like(x), "max", comm=comm).wait()
                assert (z == p - 1 + k).all(), (k, i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {exc!r}")

    threads = [threading.Thread(target=work, args=(k, c)) for k, c in enumerate(comms)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors
    for c in comms:
        c.Free()
