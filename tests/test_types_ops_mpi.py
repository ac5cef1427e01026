"""Every buffer kind mpi4py takes, the extra dtypes and the user-defined
and non-commutative ops, each compared with ``MPI.Allreduce`` of the same
data (MPI's own user ops where it can run them), on every kind of
sub-communicator; and every refusal the same exception on every rank."""

from __future__ import annotations

import array
import importlib.util

import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import dtlib

import mpi_allreduce as mar
from mpi_allreduce import config, registry
from mpi_allreduce.tools.verify import K, interval, interval_mpi

from .conftest import PATH_VARIANTS

pytestmark = pytest.mark.mpi

#: the algorithms that combine in rank order (the non-commutative ops run on each)
ORDERED = list(registry.ORDERED)
#: the dtype and pair-type matrices: one algorithm per kind of compiled round
#: (conftest.PATH_VARIANTS; none of them takes options)
PATHS = list(PATH_VARIANTS)
#: buffer kinds are read into arrays before any algorithm runs: the default
#: (auto) and one algorithm named
BUFFER_ALGORITHMS = ["auto", "ring"]


def vendor(comm, data, op=MPI.SUM, datatype=None):
    out = np.empty_like(data)
    if datatype is None:
        comm.Allreduce(data, out, op)
    else:
        comm.Allreduce([data, datatype], [out, datatype], op)
    return out


def data_of(comm, count, dtype=np.float64, salt=0):
    rng = np.random.default_rng([comm.Get_rank(), count, salt])
    return rng.integers(-50, 50, count).astype(dtype)


# --- buffers ------------------------------------------------------------------

class DLPackOnly:
    """A producer of DLPack only (as a torch CPU tensor or a JAX array is)."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def _buffer_kinds(values: np.ndarray):
    """(label, the object passed, a function reading the object's values)."""
    d = values.astype(np.float64)
    i = values.astype(np.int32)
    arr = array.array("d", d.tolist())
    raw = bytearray(i.tobytes())
    dl = d.copy()
    padded = np.zeros(d.size + 3)
    padded[2:2 + d.size] = d
    return [
        ("array.array", arr, lambda: np.asarray(arr)),
        ("bytearray+INT", [raw, MPI.INT], lambda: np.frombuffer(raw, np.int32)),
        ("memoryview", memoryview(dl), lambda: dl),
        ("dlpack", DLPackOnly(dl), lambda: dl),
        ("spec-count", [padded, d.size + 2, MPI.DOUBLE], lambda: padded[:d.size + 2]),
        ("spec-count-displ", [padded, d.size, 2, MPI.DOUBLE], lambda: padded[2:2 + d.size]),
        ("spec-tuple-displ", (padded, (d.size, 2), MPI.DOUBLE), lambda: padded[2:2 + d.size]),
        ("matrix", np.asmatrix(d.reshape(1, -1)), None),
    ]


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("count", ["0", "1", "p+1", "2p+3"])
@pytest.mark.parametrize("algorithm", BUFFER_ALGORITHMS)
def test_buffer_kinds(comm, algorithm, count, in_place):
    """Send and receive buffers of each kind; the result lands in the
    caller's receive object, equal to MPI.Allreduce of the same values."""
    p = comm.Get_size()
    n = {"0": 0, "1": 1, "p+1": p + 1, "2p+3": 2 * p + 3}[count]
    values = data_of(comm, n)
    for label, send, read in _buffer_kinds(values):
        if in_place and label == "matrix":
            continue
        expected = vendor(comm, (read or (lambda: np.asarray(send)))().copy())
        if in_place:
            mar.allreduce(MPI.IN_PLACE, send, comm=comm, algorithm=algorithm)
            got = (read or (lambda: np.asarray(send)))()
        else:
            _, recv, read_recv = next(k for k in _buffer_kinds(np.zeros(n)) if k[0] == label)
            mar.allreduce(send, recv, comm=comm, algorithm=algorithm)
            got = (read_recv or (lambda: np.asarray(recv)))()
        np.testing.assert_array_equal(got.reshape(-1), expected.reshape(-1), err_msg=label)


@pytest.mark.parametrize("spelling", ["IN_PLACE", "None", "same object"])
def test_in_place_spellings(comm, spelling):
    """mpi4py's three ways of saying in place, on a buffer and on a spec."""
    data = data_of(comm, 11)
    for wrap in (lambda a: a, lambda a: [a, MPI.DOUBLE]):
        buf = data.copy()
        recv = wrap(buf)
        send = {"IN_PLACE": MPI.IN_PLACE, "None": None, "same object": recv}[spelling]
        mar.allreduce(send, recv, comm=comm)
        np.testing.assert_array_equal(buf, vendor(comm, data))


def test_overlapping_but_different_buffers_are_refused(comm):
    buf = np.arange(10.0)
    with pytest.raises(ValueError, match="overlap"):
        mar.allreduce(buf[:8], buf[2:], comm=comm)


# --- dtypes -------------------------------------------------------------------

@pytest.mark.parametrize("dtype,datatype", [(np.longdouble, MPI.LONG_DOUBLE),
                                            (np.clongdouble, MPI.C_LONG_DOUBLE_COMPLEX)],
                         ids=["longdouble", "clongdouble"])
@pytest.mark.parametrize("algorithm", PATHS)
def test_long_double(comm, algorithm, dtype, datatype):
    """Small integers sum exactly in any order: equal to MPI's bit for bit;
    thirds round, so within a few units of long double's precision."""
    exact = data_of(comm, 7, dtype)
    np.testing.assert_array_equal(mar.allreduce(exact, comm=comm, algorithm=algorithm),
                                  vendor(comm, exact, MPI.SUM, datatype))
    thirds = data_of(comm, 3 * comm.Get_size() + 1, dtype) / 3
    got = mar.allreduce(thirds, comm=comm, algorithm=algorithm)
    assert got.dtype == np.dtype(dtype)
    eps = np.finfo(np.longdouble).eps
    np.testing.assert_allclose(got, vendor(comm, thirds, MPI.SUM, datatype), rtol=0,
                               atol=float(4 * comm.Get_size() * eps * 50))


@pytest.mark.parametrize("algorithm", PATHS)
def test_bfloat16(comm, algorithm):
    """bfloat16 (ml_dtypes) travels as raw bytes and is reduced by numpy;
    small integers sum exactly, so it equals MPI's float32 sum rounded."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    data = data_of(comm, 2 * comm.Get_size() + 5, np.float32)
    got = mar.allreduce(data.astype(ml_dtypes.bfloat16), comm=comm, algorithm=algorithm)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), vendor(comm, data))


PAIRS = {"DOUBLE_INT": MPI.DOUBLE_INT, "FLOAT_INT": MPI.FLOAT_INT, "LONG_INT": MPI.LONG_INT,
         "2INT": MPI.TWOINT, "SHORT_INT": MPI.SHORT_INT}


@pytest.mark.parametrize("op", ["MAXLOC", "MINLOC"])
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("algorithm", PATHS)
def test_pair_types(comm, algorithm, pair, op):
    """Value and index pairs, with ties (the smaller index wins), as a
    structured array and as a spec [buf, MPI.DOUBLE_INT]; equal to MPI's."""
    datatype, mpi_op = PAIRS[pair], getattr(MPI, op)
    dtype = np.dtype(dtlib.to_numpy_dtype(datatype))
    count = 2 * comm.Get_size() + 3
    data = np.zeros(count, dtype)
    value, index = dtype.names
    data[value] = data_of(comm, count, np.int64) % 4  # few values: many ties
    data[index] = (comm.Get_rank() * 7) % 5 + np.arange(count)
    expected = vendor(comm, data, mpi_op, datatype)
    got = mar.allreduce(data, op=mpi_op, comm=comm, algorithm=algorithm)
    assert got.tobytes() == expected.tobytes() or (
        np.array_equal(got[value], expected[value]) and np.array_equal(got[index], expected[index]))
    spec_out = np.zeros_like(data)
    mar.allreduce([data, datatype], [spec_out, datatype], op, comm=comm, algorithm=algorithm)
    np.testing.assert_array_equal(spec_out[index], expected[index])


# --- user-defined and non-commutative ops ---------------------------------------

def _matmul_mpi(inbuf, inoutbuf, datatype):
    """2x2 integer matrices, inout = in @ inout (mod a prime), as MPICH's allred3."""
    a = np.frombuffer(inbuf, np.int64).reshape(-1, 2, 2)
    b = np.frombuffer(inoutbuf, np.int64).reshape(-1, 2, 2)
    b[...] = np.einsum("kij,kjl->kil", a, b) % 1000003


@pytest.fixture(scope="module")
def user_ops():
    ops = {"interval": MPI.Op.Create(interval_mpi, commute=False),
           "matmul": MPI.Op.Create(_matmul_mpi, commute=False),
           "sum": MPI.Op.Create(lambda i, io, t: np.add(np.frombuffer(i, np.float64),
                                                         np.frombuffer(io, np.float64),
                                                         out=np.frombuffer(io, np.float64)),
                                commute=True)}
    yield ops
    for op in ops.values():
        op.Free()


@pytest.mark.parametrize("algorithm", ["auto"] + ORDERED)
def test_noncommutative_ops_give_mpis_rank_ordered_result(comm, algorithm, user_ops):
    p, count = comm.Get_size(), 3 * comm.Get_size() + 2
    mine = np.full(count, comm.Get_rank() * (K + 1), np.int64)
    expected = vendor(comm, mine, user_ops["interval"])
    assert (expected == p - 1).all()  # MPI's own answer: [0, p-1]
    np.testing.assert_array_equal(
        mar.allreduce(mine, op=user_ops["interval"], comm=comm, algorithm=algorithm), expected)
    np.testing.assert_array_equal(
        mar.allreduce(mine, op=interval, comm=comm, algorithm=algorithm, segment_size=3),
        expected)
    np.testing.assert_array_equal(
        mar.allreduce(mine, op=mar.user_op(interval), comm=comm, algorithm=algorithm), expected)


@pytest.mark.parametrize("algorithm", ["auto"] + ORDERED)
def test_matrix_product_over_a_derived_datatype(comm, algorithm, user_ops):
    """MPICH allred3-style: a contiguous datatype of 4 longs is one 2x2 matrix,
    the op a non-commutative product; each matrix stays whole."""
    rank, count = comm.Get_rank(), 2 * comm.Get_size() + 1
    matrix = MPI.INT64_T.Create_contiguous(4).Commit()
    try:
        mine = np.zeros((count, 2, 2), np.int64)
        mine[:, 0, 0], mine[:, 0, 1] = 1, rank + np.arange(count)
        mine[:, 1, 0], mine[:, 1, 1] = (rank * 3 + 1) % 7, 1
        expected = np.empty_like(mine)
        comm.Allreduce([mine, count, matrix], [expected, count, matrix], user_ops["matmul"])
        got = np.zeros_like(mine)
        mar.allreduce([mine, count, matrix], [got, count, matrix], user_ops["matmul"],
                      comm=comm, algorithm=algorithm, segment_size=2)
        np.testing.assert_array_equal(got, expected)
    finally:
        matrix.Free()


def test_callables_of_one_name_are_told_apart(comm):
    """Two closures from one factory share a qualified name (which goes
    into the tag): the plans they get are still their own."""
    def make(ufunc):
        return lambda a, b: ufunc(a, b)

    data = data_of(comm, 2 * comm.Get_size() + 1)
    for ufunc, mpi_op in ((np.maximum, MPI.MAX), (np.minimum, MPI.MIN), (np.maximum, MPI.MAX)):
        got = mar.allreduce(data, op=mar.user_op(make(ufunc), commute=True), comm=comm)
        np.testing.assert_array_equal(got, vendor(comm, data, mpi_op))


def test_a_commutative_user_op_runs_everywhere(comm, user_ops):
    data = data_of(comm, 2 * comm.Get_size() + 3)
    for algorithm in ("ring", "ring_pipelined", "hierarchical"):
        np.testing.assert_array_equal(
            mar.allreduce(data, op=user_ops["sum"], comm=comm, algorithm=algorithm),
            vendor(comm, data))


def test_auto_keeps_rank_order_for_long_vectors(comm, user_ops):
    """2 MiB: the table's ring would swap operands; auto takes an ordered one."""
    count = (2 << 20) // 8
    mine = np.full(count, comm.Get_rank() * (K + 1), np.int64)
    got = mar.allreduce(mine, op=interval, comm=comm)
    assert (got == comm.Get_size() - 1).all()


# --- refusals: the same exception on every rank --------------------------------

@pytest.mark.parametrize("case", ["ring+noncommutative", "hierarchical+noncommutative",
                                  "pair op on floats", "sum on pairs", "gappy datatype",
                                  "spec too long", "ragged bytes", "one-sided op"])
def test_refusals_on_every_rank(comm, case, user_ops):
    x = np.arange(6.0)
    pairs = np.zeros(3, dtlib.to_numpy_dtype(MPI.DOUBLE_INT))
    vector = MPI.DOUBLE.Create_vector(2, 1, 2).Commit()
    calls = {
        "ring+noncommutative": (ValueError, "needs a commutative op",
                                lambda: mar.allreduce(x, op=interval, comm=comm, algorithm="ring")),
        "hierarchical+noncommutative": (ValueError, "needs a commutative op",
                                        lambda: mar.allreduce(x, op=user_ops["interval"],
                                                              comm=comm, algorithm="hierarchical")),
        "pair op on floats": (TypeError, "maxloc", lambda: mar.allreduce(x, op=MPI.MAXLOC,
                                                                         comm=comm)),
        "sum on pairs": (TypeError, "pair type", lambda: mar.allreduce(pairs, comm=comm)),
        "gappy datatype": (TypeError, "gaps|start", lambda: mar.allreduce([x, 2, vector],
                                                                          comm=comm)),
        "spec too long": (ValueError, "do not fit", lambda: mar.allreduce([x, 7, MPI.DOUBLE],
                                                                          comm=comm)),
        "ragged bytes": (ValueError, "whole number", lambda: mar.allreduce([bytearray(10),
                                                                              MPI.INT],
                                                                             comm=comm)),
        "one-sided op": (ValueError, "one-sided", lambda: mar.allreduce(x, op=MPI.REPLACE,
                                                                       comm=comm)),
    }
    kind, message, call = calls[case]
    try:
        with pytest.raises(kind, match=message):
            call()
    finally:
        vector.Free()
    comm.Barrier()  # nobody is left inside a call


# --- the drop-in communicator ---------------------------------------------------

def test_comm_wraps_and_keeps_its_options(comm):
    wrapped = mar.Comm(comm, algorithm="tree", segment_size=4)
    assert isinstance(wrapped, MPI.Intracomm) and wrapped == comm
    for made in (wrapped.Dup(), wrapped.Split(0, comm.Get_rank())):
        assert isinstance(made, mar.Comm)
        assert (made.algorithm, made.options) == ("tree", {"segment_size": 4})
        data = data_of(comm, 9)
        out = np.empty_like(data)
        made.Allreduce(data, out, MPI.SUM)
        np.testing.assert_array_equal(out, vendor(comm, data))
        request = made.Iallreduce(data, out, MPI.MAX)
        assert request.Wait() is True
        np.testing.assert_array_equal(out, vendor(comm, data, MPI.MAX))
        made.Free()
    with pytest.raises(ValueError, match="unknown algorithm"):
        mar.Comm(comm, algorithm="fastest")


# --- reproducible sums ------------------------------------------------------------

#: the reproducible sum's passes over memory this environment has
KERNELS = ["numpy"] + (["numba"] if importlib.util.find_spec("numba") else [])


@pytest.fixture
def kernels(monkeypatch):
    """Set MPI_ALLREDUCE_KERNELS by calling it; the setting is restored after."""
    def use(kernel):
        monkeypatch.setenv(config.KERNELS_ENV, kernel)
        config.refresh()
    yield use
    monkeypatch.undo()
    config.refresh()


@pytest.mark.parametrize("dtype", ["float64", "float32", "complex128", "bfloat16"])
def test_reproducible_sum_is_the_same_bits_everywhere(comm, dtype, kernels):
    """Every algorithm, two segment sizes, in place or not, the ranks'
    vectors handed out in reverse, numpy's passes and numba's fused ones
    (where numba is installed): one set of bytes, on every rank."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    p, rank, count = comm.Get_size(), comm.Get_rank(), 4 * comm.Get_size() + 7

    def vector(r):
        rng = np.random.default_rng([r, 11])
        x = rng.normal(size=count) * 10.0 ** rng.integers(-8, 8, count)
        if np.dtype(dtype).kind == "c":
            x = x + 1j * rng.normal(size=count)
        return x.astype(dtype)

    results = set()
    for kernel, algorithm in [(k, a) for k in KERNELS for a in ["auto"] + [
            a for a in registry.ALGORITHMS if a != "hierarchical"] + ["hierarchical"]]:
        kernels(kernel)
        for segment_size, owner, in_place in ((None, rank, False), (3, p - 1 - rank, True)):
            buf = vector(owner)
            if in_place:
                mar.allreduce(MPI.IN_PLACE, buf, comm=comm, algorithm=algorithm,
                              segment_size=segment_size, reproducible=True)
                out = buf
            else:
                out = mar.allreduce(buf, comm=comm, algorithm=algorithm,
                                    segment_size=segment_size, reproducible=True)
            results.add(out.tobytes())
    assert len(results) == 1
    everyone = comm.allgather(results.pop())
    assert len(set(everyone)) == 1
    # and it is the sum: close to MPI's (within a few units of the type's precision)
    plain = vector(rank).astype(np.complex128 if np.dtype(dtype).kind == "c" else np.float64)
    total = vendor(comm, plain)
    got = np.frombuffer(everyone[0], dtype).astype(total.dtype)
    scale = vendor(comm, np.abs(plain), MPI.MAX) * p
    eps = np.finfo(np.float32 if np.dtype(dtype).itemsize <= 4 else np.float64).eps \
        if np.dtype(dtype).name != "bfloat16" else 2.0 ** -7
    assert (np.abs(got - total) <= 4 * eps * scale).all()


def test_reproducible_avg_and_the_ops_that_are_exact_anyway(comm):
    x = data_of(comm, 9) / 7
    avg = mar.allreduce(x, op="avg", comm=comm, reproducible=True)
    total = mar.allreduce(x, comm=comm, reproducible=True)
    np.testing.assert_array_equal(avg, total / comm.Get_size())
    ints = data_of(comm, 9, np.int64)
    np.testing.assert_array_equal(mar.allreduce(ints, comm=comm, reproducible=True),
                                  vendor(comm, ints))
    np.testing.assert_array_equal(mar.allreduce(x, op="max", comm=comm, reproducible=True),
                                  vendor(comm, x, MPI.MAX))


@pytest.mark.parametrize("case", ["prod", "user op", "long double"])
def test_reproducible_refusals(comm, case, user_ops):
    x = np.arange(5.0)
    kind, message, call = {
        "prod": (ValueError, "covers sum and avg",
                 lambda: mar.allreduce(x, op="prod", comm=comm, reproducible=True)),
        "user op": (ValueError, "covers sum and avg",
                    lambda: mar.allreduce(x, op=user_ops["sum"], comm=comm, reproducible=True)),
        "long double": (TypeError, "not float128|not float96",
                        lambda: mar.allreduce(x.astype(np.longdouble), comm=comm,
                                              reproducible=True)),
    }[case]
    with pytest.raises(kind, match=message):
        call()
    comm.Barrier()


def test_reproducible_after_a_plain_call_on_the_same_buffers(comm):
    """A kept plain call is not reused for reproducible=True on the same
    buffers and options: 2^60 + 1 - 2^60 is 1 exactly, 0 in floats."""
    if comm.Get_size() < 3:
        pytest.skip("needs three ranks for the cancellation")
    rank = comm.Get_rank()
    x = np.full(4, {0: 2.0 ** 60, 1: 1.0, 2: -2.0 ** 60}.get(rank, 0.0))
    out = np.empty_like(x)
    plain = mar.allreduce(x, out, comm=comm, algorithm="recursive_doubling", segment_size=3)
    assert (plain != 1.0).any()  # floats lose the 1 (it meets 2^60 first)
    got = mar.allreduce(x, out, comm=comm, algorithm="recursive_doubling", segment_size=3,
                        reproducible=True)
    np.testing.assert_array_equal(got, 1.0)
