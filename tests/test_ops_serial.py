"""Serial tests of op and dtype handling, and of arguments rejected before any message."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import registry
from mpi_allreduce.ops import OPS, SUPPORTED_DTYPES, check_dtype, resolve_op
from mpi_allreduce.executor import wire_type


@pytest.mark.parametrize("name", list(OPS))
def test_resolve_op_by_name_and_mpi_op(name):
    op = resolve_op(name)
    assert op.name == name
    assert resolve_op(name.upper()).name == name
    if name != "avg":
        assert resolve_op(op.mpi_op).name == name


def test_resolve_op_rejects_unknown():
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        resolve_op("mean")
    with pytest.raises(ValueError, match="one-sided"):
        resolve_op(MPI.REPLACE)
    assert resolve_op(MPI.MAXLOC).name == "maxloc"
    with pytest.raises(TypeError):
        resolve_op(3)


@pytest.mark.parametrize(
    "dtype,op",
    [("float32", "band"), ("float64", "bxor"), ("complex64", "max"), ("complex128", "min"),
     ("bool", "sum"), ("bool", "band"), ("int32", "avg"), ("float16", "lor")],
)
def test_invalid_op_dtype_pairs(dtype, op):
    with pytest.raises(TypeError, match=f"op '{op}' is not defined for dtype {dtype}"):
        check_dtype(np.dtype(dtype), resolve_op(op))


@pytest.mark.parametrize("dtype", ["object", "U4", "datetime64[s]", "V8"])
def test_unsupported_dtypes(dtype):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        pytest.skip(f"numpy on this platform has no {dtype}")
    with pytest.raises(TypeError, match="unsupported dtype"):
        check_dtype(dt, resolve_op("sum"))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_wire_type_has_the_element_size(dtype):
    dt = np.dtype(dtype)
    mpitype = wire_type(dt)
    assert mpitype == MPI.BYTE or mpitype.Get_size() == dt.itemsize


def test_unknown_algorithm_lists_choices():
    with pytest.raises(ValueError) as info:
        mar.allreduce(np.ones(3), algorithm="butterfly")
    for name in ("auto",) + mar.ALGORITHMS:
        assert name in str(info.value)


def test_algorithms_registry():
    assert set(mar.ALGORITHMS) >= {"driver", "ring", "recursive_doubling", "hierarchical",
                                   "ring_pipelined", "rabenseifner"}
    for name in mar.ALGORITHMS:
        assert registry.get(name).NAME == name


@pytest.mark.parametrize("op", ["sum", "prod"])
def test_in_place_timing_data_stays_as_it_is(op):
    """bench times in-place calls on one buffer over and over: its data must
    not run off to inf (or through slow denormals), as sum and prod would
    take the verification data within a hundred calls on 3 ranks."""
    from mpi_allreduce.tools.bench import timing_data

    ufunc = resolve_op(op).ufunc
    first = timing_data(np.dtype(np.float32), op, 7, 0, in_place=True)
    data = first.copy()
    with np.errstate(all="raise"):  # an overflow or underflow fails the test
        for _ in range(200):  # every rank holds the same values after a call
            data = ufunc.reduce(np.stack([data] * 3))
    np.testing.assert_array_equal(data, first)


def test_out_of_place_timing_data_is_the_verification_data():
    from mpi_allreduce.tools.bench import timing_data
    from mpi_allreduce.tools.verify import make_data

    for op in ("sum", "prod", "max"):
        np.testing.assert_array_equal(timing_data(np.dtype(np.float32), op, 7, 2, in_place=False),
                                      make_data(np.dtype(np.float32), op, 7, 2, "exact", 5))


def test_repeat_order_shuffles_the_same_way_on_every_rank():
    """bench runs the algorithms of a repeat in a shuffled order: every rank
    must compute the same one (they all take part in every call), and over
    the repeats every algorithm must take every place and follow others."""
    from mpi_allreduce.tools.bench import repeat_order

    names = ["mpi", "driver", "ring", "recursive_doubling", "rabenseifner", "auto"]
    orders = [repeat_order(names, 1 << 20, r) for r in range(60)]
    assert orders == [repeat_order(list(names), 1 << 20, r) for r in range(60)]
    assert all(sorted(o) == sorted(names) for o in orders)
    for place in range(len(names)):
        assert {o[place] for o in orders} == set(names)
    after_auto = {o[o.index("auto") - 1] for o in orders if o[0] != "auto"}
    assert len(after_auto) > 1
    assert [repeat_order(names, 8, r) for r in range(5)] != orders[:5]  # seeded by size too


def test_value_bytes_ignore_long_double_padding():
    """x86's long double carries 10 bytes in 16: equal values with different
    padding compare equal, different values do not."""
    from mpi_allreduce.ops import value_bytes

    a = np.array([1.5, -2.0], np.longdouble)
    if np.finfo(np.longdouble).nmant != 63 or a.itemsize <= 10:
        pytest.skip("long double is not x86's 80-bit type here")
    b = a.copy()
    b.view(np.uint8)[12] ^= 0xFF
    assert a.tobytes() != b.tobytes() and value_bytes(a) == value_bytes(b)
    b[0] = 1.25
    assert value_bytes(a) != value_bytes(b)
    f = np.arange(3.0)
    assert value_bytes(f) == f.tobytes()


def test_a_type_the_mpi_names_but_refuses_travels_as_bytes(monkeypatch):
    """Open MPI 4.1 has mpi4py's float16 type (MPIX_C_FLOAT16) by name but
    raises MPI_ERR_TYPE when asked its size: float16 then travels as raw
    bytes, as where the MPI has no such type, instead of aborting the job."""
    import numpy as np
    from mpi4py import MPI

    from mpi_allreduce import executor

    class Refused:
        def __eq__(self, other):
            return other is self

        __hash__ = object.__hash__

        def Get_size(self):  # noqa: N802 - mpi4py's name
            raise MPI.Exception(MPI.ERR_TYPE)

    monkeypatch.setattr(MPI, "_typedict", {**MPI._typedict, "e": Refused()})
    executor.wire_type.cache_clear()
    try:
        assert executor.wire_type(np.dtype("float16")) == MPI.BYTE
        assert executor.wire_type(np.dtype("float32")) == MPI.FLOAT
    finally:
        executor.wire_type.cache_clear()


# --- a user op's identity across ranks: its name, and what it computes --------------

_STRUCT = np.dtype([("v", "f8"), ("i", "i4")])


def _mpi_struct(combine):
    def function(a, b, datatype):
        x, y = np.frombuffer(a, dtype=_STRUCT), np.frombuffer(b, dtype=_STRUCT)
        y["v"] = combine(x["v"], y["v"])
    return resolve_op(MPI.Op.Create(function, commute=True))


def _rows(combine):
    """A callable that takes rows of 3 elements (it raises on 4: probed on more)."""
    return mar.user_op(lambda a, b: combine(a.reshape(-1, 3), b.reshape(-1, 3)).reshape(-1),
                       commute=True)


@pytest.mark.parametrize("dtype, make", [
    ("float64", lambda f: mar.user_op(lambda a, b: f(a, b), commute=True)),
    ("longdouble", lambda f: mar.user_op(lambda a, b: f(a, b), commute=True)),
    ("clongdouble", lambda f: mar.user_op(lambda a, b: f(a, b), commute=True)),
    ("bool", lambda f: mar.user_op(lambda a, b: f(a, b), commute=True)),
    ("float16", lambda f: mar.user_op(lambda a, b: f(a, b), commute=True)),
    (_STRUCT, _mpi_struct),
    ("float64", _rows),
], ids=["float64", "longdouble", "clongdouble", "bool", "float16", "MPI.Op on a struct",
        "rows of 3"])
def test_user_ops_that_share_a_name_are_told_apart_by_what_they_compute(dtype, make):
    """Two user ops of one name (lambdas; MPI.Op.Create ops, whose handles
    say nothing across ranks) that compute different things have different
    identities in a call's spec, so ranks that disagree stall instead of
    combining two reductions; the same op has the same identity each time
    (the padding bytes of x86's long double, which arithmetic leaves
    undefined, are not part of it: a valid program would stall)."""
    from mpi_allreduce.ops import spec_label

    dtype = np.dtype(dtype)
    add, multiply = make(np.add), make(np.multiply)
    assert spec_label(add, dtype) != spec_label(multiply, dtype)
    assert spec_label(add, dtype) == spec_label(make(np.add), dtype)
    assert "unprobed" not in spec_label(add, dtype)


def test_a_user_op_named_by_its_caller_is_identified_by_the_name_alone():
    """``user_op(fn, name=...)``: the caller vouches for the name, and the
    op is not called to identify it."""
    from mpi_allreduce.ops import spec_label

    calls = []

    def counted(a, b):
        calls.append(len(a))
        return a + b
    assert spec_label(mar.user_op(counted, commute=True, name="my_sum"), np.float64) == \
        "user:my_sum/commutative"
    assert calls == []
    assert spec_label(mar.user_op(counted, commute=True), np.float64).startswith(
        "user:test_a_user_op_named_by_its_caller_is_identified_by_the_name_alone.<locals>.counted")
    assert calls == [4]


def test_checked_dtype_op_pairs_stay_bounded_however_many_dtypes_a_program_makes():
    """A new structured dtype per call (each checked once, then remembered)
    keeps at most ``MAX_VALID_PAIRS`` pairs, and a pair checked again after
    the memory was emptied is still judged (a bad one still refused)."""
    from mpi_allreduce import ops

    maxloc = ops.resolve_op("maxloc")
    for n in range(3 * ops.MAX_VALID_PAIRS):
        ops.check_dtype(np.dtype([("value", "f8"), ("index", "i4")], metadata={"n": n}), maxloc)
        ops.check_dtype(np.dtype([(f"v{n}", "f8"), ("i", "i4")]), maxloc)
        assert len(ops._VALID_PAIRS) <= ops.MAX_VALID_PAIRS
    with pytest.raises(TypeError):
        ops.check_dtype(np.dtype([(f"v{n}", "f8"), ("i", "i4")]), ops.resolve_op("sum"))


def test_structured_dtypes_committed_types_stay_bounded_and_held_ones_are_kept():
    """A new structured dtype per call: at most ``MAX_TYPES`` committed MPI
    datatypes are remembered (wire types too); one let go while something
    still holds it (a kept call's messages) is freed only once nothing does."""
    from mpi4py import MPI

    from mpi_allreduce import executor

    def dtype(n):
        return np.dtype([(f"value{n}", "f8"), (f"index{n}", "i8")])
    held = executor.element_type(dtype(-1))
    for n in range(3 * executor.MAX_TYPES):
        executor.element_type(dtype(n))
        assert len(executor._ELEMENT_TYPES) <= executor.MAX_TYPES
        assert executor.wire_type.cache_info().currsize <= executor.MAX_TYPES
    assert any(t is held for t in executor._RETIRED)
    assert held.Get_size() == 16 and held != MPI.DATATYPE_NULL  # (still usable)
    del held
    executor.element_type(dtype(10 ** 6))  # (an eviction frees what nothing holds)
    assert executor._RETIRED == []
