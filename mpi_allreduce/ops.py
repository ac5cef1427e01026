"""Reduction operations: name -> (numpy ufunc, MPI.Op, dtypes it is valid for).

Every predefined MPI operation is commutative and associative (up to
floating-point rounding); the algorithms still apply operands in a fixed
order by rank so that every rank gets bit-identical results.

Besides the predefined ops (and ``avg``) an :class:`Op` may be

* ``MAXLOC`` / ``MINLOC`` on MPI's pair types (a value and an ``int``
  index, e.g. ``MPI.DOUBLE_INT`` as a numpy structured dtype);
* a user-defined ``MPI.Op`` (``MPI.Op.Create(fn, commute)``), applied with
  ``MPI_Reduce_local`` on host buffers;
* a Python callable ``fn(a, b)`` returning ``a OP b`` elementwise (``a``
  holds the lower ranks' operand), on numpy or cupy arrays -- see
  :func:`user_op`.

An op that is not commutative runs only on the algorithms that combine
operands in rank order (``COMMUTATIVE = False`` in their module); its
result is then exactly MPI's: ``x_0 OP x_1 OP ... OP x_{p-1}``.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .threads import sheltered

__all__ = ["Op", "resolve_op", "OPS", "SUPPORTED_DTYPES", "check_dtype", "user_op", "behaviour",
           "spec_label", "dtype_kind", "dtype_label", "reduce_step", "value_bytes"]

_INTEGER = "integer"
_FLOAT = "float"
_COMPLEX = "complex"
_BOOL = "bool"
_PAIR = "pair"
#: the kinds a user-defined op takes: any element at all
_ANY = "any"

#: dtypes the library reduces with the predefined ops (numpy names; long
#: double and its complex are the platform's, e.g. float128/complex256);
#: also bfloat16 where ``ml_dtypes`` is installed, and MPI's pair types
#: with MAXLOC/MINLOC
SUPPORTED_DTYPES: tuple[str, ...] = tuple(dict.fromkeys((
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", np.dtype(np.longdouble).name,
    "complex64", "complex128", np.dtype(np.clongdouble).name,
    "bool",
)))


def dtype_label(dtype: np.dtype) -> str:
    """A dtype's name for keys and fingerprints: ``dtype.str`` ('<f4'),
    which is the same ('|V8') for every 8-byte structured or extension
    type, so those are told apart by their fields or their name."""
    dtype = np.dtype(dtype)
    if dtype.kind != "V":
        return dtype.str
    return repr(dtype.descr) if dtype.names is not None else f"{dtype.name}:{dtype.str}"


def value_bytes(array: np.ndarray) -> bytes:
    """The bytes that carry ``array``'s values (host memory).  x86's 80-bit
    long double sits in 16 bytes whose last 6 are padding that no
    arithmetic defines, so two equal results may differ there."""
    dtype = array.dtype
    part = np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype
    if part == np.longdouble and np.finfo(np.longdouble).nmant == 63 and part.itemsize > 10:
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8).reshape(-1, part.itemsize)
        return raw[:, :10].tobytes()
    return array.tobytes()


def dtype_kind(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return _BOOL
    if dtype.names is not None:
        if len(dtype.names) == 2 and dtype.fields[dtype.names[1]][0].kind == "i" \
                and dtype.fields[dtype.names[0]][0].kind in "if":
            return _PAIR
        return "other"
    if np.issubdtype(dtype, np.integer):
        return _INTEGER
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
        return _FLOAT
    if np.issubdtype(dtype, np.complexfloating):
        return _COMPLEX
    return "other"


@dataclass(frozen=True)
class Op:
    """A reduction: ``reduce(a, b, out)`` computes ``out = a OP b`` in place,
    ``a`` the operand of the lower ranks."""

    name: str
    ufunc: Optional[np.ufunc]
    mpi_op: MPI.Op
    kinds: frozenset
    #: applied to the result after the reduction (``avg`` divides by size)
    finalize: Optional[Callable] = None
    #: whether operands may be combined in any order (else: rank order only)
    commutative: bool = True
    #: ``fn(a, b) -> a OP b`` for Python callables; for pair ops the combine
    function: Optional[Callable] = None
    #: whether the op runs on device arrays (MPI_Reduce_local needs host memory)
    device: bool = True
    #: what tells this op from others with the same name in caches (user ops;
    #: the name alone, which must agree across ranks, may be shared)
    key: object = None
    #: whether what a user op computes is part of its identity across ranks
    #: (see ``spec_label``; not where its caller named it)
    probed: bool = False
    #: more of the call's identity that a caller reduces with this op (see
    #: ``tagged``): part of :attr:`stable`, so of the call's spec
    tag: str = ""

    @property
    def stable(self) -> str:
        """The op's identity across ranks, for a call's spec: the name of a
        predefined op or a callable, and whether a user op commutes (a user
        ``MPI.Op``'s handle is not part of it: ranks that made their ops in
        another order have different handles for the same function); its
        :attr:`tag`."""
        label = self.name if self.key is None else \
            f"{self.name}/{'commutative' if self.commutative else 'ordered'}"
        return f"{label}|{self.tag}" if self.tag else label

    @property
    def identity(self):
        """The op in cache keys: the name of a predefined op; a user op's
        function or MPI handle as well; its tag."""
        plain = self.name if self.key is None else (self.name, self.key)
        return (plain, self.tag) if self.tag else plain

    def valid_for(self, dtype: np.dtype) -> bool:
        return _ANY in self.kinds or dtype_kind(np.dtype(dtype)) in self.kinds

    @property
    def reduce_local(self) -> bool:
        """A user-defined MPI.Op: applied with ``MPI_Reduce_local``."""
        return self.ufunc is None and self.function is None

    @property
    def user(self) -> bool:
        """A user-defined op (an MPI.Op of the caller's, or a Python callable)."""
        return _ANY in self.kinds


_NUMERIC = frozenset({_INTEGER, _FLOAT, _COMPLEX})
_ORDERED = frozenset({_INTEGER, _FLOAT})
_LOGICAL = frozenset({_INTEGER, _BOOL})
_BITWISE = frozenset({_INTEGER})


def _loc(better):
    """MAXLOC/MINLOC: the better value, and on a tie the smaller index (MPI's rule)."""
    def combine(first, second, out):
        value, index = first.dtype.names
        v1, i1, v2, i2 = first[value], first[index], second[value], second[index]
        take = better(v2, v1) | ((v2 == v1) & (i2 < i1))
        values, indices = np.where(take, v2, v1), np.where(take, i2, i1)
        out[value], out[index] = values, indices  # computed first: out may be an operand
    return combine


OPS: dict[str, Op] = {
    "sum": Op("sum", np.add, MPI.SUM, _NUMERIC),
    "prod": Op("prod", np.multiply, MPI.PROD, _NUMERIC),
    "min": Op("min", np.minimum, MPI.MIN, _ORDERED),
    "max": Op("max", np.maximum, MPI.MAX, _ORDERED),
    "land": Op("land", np.logical_and, MPI.LAND, _LOGICAL),
    "lor": Op("lor", np.logical_or, MPI.LOR, _LOGICAL),
    "lxor": Op("lxor", np.logical_xor, MPI.LXOR, _LOGICAL),
    "band": Op("band", np.bitwise_and, MPI.BAND, _BITWISE),
    "bor": Op("bor", np.bitwise_or, MPI.BOR, _BITWISE),
    "bxor": Op("bxor", np.bitwise_xor, MPI.BXOR, _BITWISE),
    "maxloc": Op("maxloc", None, MPI.MAXLOC, frozenset({_PAIR}), function=_loc(np.greater),
                 device=False),
    "minloc": Op("minloc", None, MPI.MINLOC, frozenset({_PAIR}), function=_loc(np.less),
                 device=False),
    # the mean over ranks: a sum, then a division by the communicator size
    "avg": Op("avg", np.add, MPI.SUM, frozenset({_FLOAT, _COMPLEX}), finalize=np.true_divide),
}

_BY_MPI_OP = [(op.mpi_op, op) for name, op in OPS.items() if name != "avg"]


def tagged(name: str, tag: str) -> Op:
    """The predefined op ``name`` with ``tag`` in its identity across ranks
    (:attr:`Op.stable`): it reduces as ``name`` does, and a call made with
    it is another call than one made with the plain op or another tag, so
    ranks that disagree stall instead of combining -- for what a caller
    folds into one call that the op, count and dtype do not show (the torch
    backend: a coalesced call's tensor sizes, a pre-multiplied sum).  One
    object per (name, tag), the latest :data:`MAX_TAGGED` kept, so repeats
    find their kept calls."""
    key = (name, tag)
    op = _TAGGED.get(key)
    if op is None:
        op = _TAGGED[key] = dataclasses.replace(OPS[name], tag=tag)
        while len(_TAGGED) > MAX_TAGGED:
            _TAGGED.popitem(last=False)
    else:
        _TAGGED.move_to_end(key)
    return op


#: tagged ops by (name, tag), least recently used first
_TAGGED: "OrderedDict[tuple, Op]" = OrderedDict()
MAX_TAGGED = 256


def user_op(function: Callable, commute: bool = False, name: Optional[str] = None) -> Op:
    """An op from a Python callable ``function(a, b)`` that returns ``a OP b``
    elementwise for arrays ``a`` and ``b`` of equal shape (numpy or cupy,
    ``a`` holding the lower ranks' operand).  ``commute=False`` (the default
    for a bare callable) keeps it to the algorithms that combine in rank
    order.  ``name`` (default: the function's qualified name) must be the
    same on every rank: it is part of the call's fingerprint.  Without a
    ``name``, what the function computes is too (``spec_label``: it is
    called once on two short vectors when a call of a new shape is
    planned), since a qualified name may be shared (two lambdas); a
    ``name`` says the caller vouches that it names one reduction."""
    if not callable(function):
        raise TypeError(f"a user op needs a callable, got {type(function).__name__}")
    label = name or getattr(function, "__qualname__", None) or type(function).__name__
    return Op(f"user:{label}", None, MPI.OP_NULL, frozenset({_ANY}), commutative=bool(commute),
              function=_applied(function), key=(function, bool(commute)), probed=name is None)


def _applied(function):
    def combine(first, second, out):
        out[...] = function(first, second)
    return combine


def _mpi_user_op(op: MPI.Op) -> Op:
    """The caller's user-defined MPI.Op, itself (not a copy made from its
    handle: a freed op's handle is reused by the next one made, so a handle
    names no function for long).  Caches tell it by the object, which the
    Op holds, so its id stays its own while a plan keeps it."""
    commutative = bool(op.Is_commutative())
    return Op("mpi-user-op", None, op, frozenset({_ANY}), commutative=commutative,
              device=False, key=(id(op), op.py2f(), commutative), probed=True)


def resolve_op(op) -> Op:
    """Accept a predefined ``MPI.Op``, its lower-case name, ``"avg"``, a
    user-defined ``MPI.Op``, a Python callable (see :func:`user_op`) or an
    :class:`Op`."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        try:
            return OPS[op.lower()]
        except KeyError:
            raise ValueError(
                f"unknown op {op!r}; expected one of {', '.join(OPS)}, an MPI.Op or a callable"
            ) from None
    if isinstance(op, MPI.Op):
        if op == MPI.OP_NULL:
            raise ValueError("op is MPI.OP_NULL")
        for mpi_op, ours in _BY_MPI_OP:
            if op == mpi_op:
                return ours
        if op in (MPI.REPLACE, MPI.NO_OP):
            raise ValueError("MPI.REPLACE and MPI.NO_OP are for one-sided accumulates, "
                             "not for a reduction")
        return _mpi_user_op(op)
    if callable(op):
        return user_op(op)
    raise TypeError(f"op must be an MPI.Op, a string or a callable, got {type(op).__name__}")


def spec_label(op: Op, dtype, datatype=None, count: Optional[int] = None) -> str:
    """The op's identity in a call's spec (and in check mode's agreement):
    :attr:`Op.stable`; for a user op its caller did not name also what it
    computes on this dtype (:func:`behaviour`).  Two user ops that share a
    name -- two lambdas, or ``MPI.Op.Create`` ops, whose handles say nothing
    across ranks -- but reduce differently then give their calls different
    fingerprints, so ranks that disagree about the op stall and are
    reported instead of combining two reductions.  ``count``: the call's
    elements (see :func:`behaviour`)."""
    if not op.probed:
        return op.stable
    return f"{op.stable}/{behaviour(op, np.dtype(dtype), datatype, count)}"


#: lengths of the vectors a user op is tried on, the next where it raises on
#: the one before (an op on rows of 3 elements, say)
_PROBES = (4, 12, 60)


def behaviour(op: Op, dtype: np.dtype, datatype=None, count: Optional[int] = None) -> str:
    """A digest of ``a OP b`` for two fixed vectors of ``dtype`` (their
    bytes a fixed pattern, booleans 0 or 1; of the bytes that carry values,
    :func:`value_bytes`): the op is called on host memory each time a call
    of a new shape is planned, with the element datatype its reductions
    use.  An op that raises on every probe is ``unprobed`` (alike on every
    rank that has it: it is then told apart by its name alone).  An
    ``MPI.Op`` is tried on one vector only, as long as the call's
    (``count``, once per new shape, as the call's plan is made): mpi4py
    ends the job where the Python function behind one raises, so it is
    never given a length its call does not give it (an op on records of
    the call's length, say)."""
    lengths = _PROBES
    if op.function is None:
        if count is not None:
            lengths = (count,) if count else ()
        if datatype is None:
            from .executor import element_type
            datatype = element_type(dtype)
    for length in lengths:
        n = dtype.itemsize * length
        i = np.arange(n, dtype=np.int64)
        first = ((37 * i + 11) % 251).astype(np.uint8)
        second = ((53 * i + 29) % 241).astype(np.uint8)
        if dtype.kind == "b":  # (0 or 1, unequal where or and and differ)
            first = (first >> 1) & 1
            second = (second >> 2) & 1
        out = second.copy()
        try:
            a, b, o = first.view(dtype), second.view(dtype), out.view(dtype)
            with np.errstate(all="ignore"):
                if op.function is not None:
                    op.function(a, b, o)
                else:  # (MPI_Reduce_local(in, inout): inout = in OP inout)
                    sheltered(op.mpi_op.Reduce_local, [a, datatype], [o, datatype])
        except Exception as exc:  # noqa: BLE001 - the same on every rank with this op
            if op.function is None and not isinstance(exc, MPI.Exception):
                # (an MPI.Op's function cannot raise here: what did is not the
                # op's -- an interrupt that CPython made an error as the shelter
                # started, say -- and says nothing of what it computes)
                raise
            continue
        return f"{zlib.crc32(value_bytes(o)):08x}"
    return "unprobed"


def check_dtype(dtype: np.dtype, op: Op) -> None:
    """Raise TypeError for a dtype we do not reduce or an op/dtype pair that is invalid."""
    if (dtype, op.name) in _VALID_PAIRS:
        return
    dtype = np.dtype(dtype)
    kind = dtype_kind(dtype)
    if op.user:
        if dtype.hasobject:
            raise TypeError(f"dtype {dtype} holds Python objects; MPI cannot send them")
    elif kind == _PAIR:
        if not op.valid_for(dtype):
            raise TypeError(f"op {op.name!r} is not defined for the pair type {dtype}; "
                            "pair types take maxloc or minloc")
    elif dtype.name not in SUPPORTED_DTYPES and dtype.name != "bfloat16":
        raise TypeError(
            f"unsupported dtype {dtype}; expected one of {', '.join(SUPPORTED_DTYPES)}, "
            "bfloat16 (ml_dtypes), a pair type (MPI.DOUBLE_INT ...) with maxloc/minloc, "
            "or any dtype with a user-defined op"
        )
    elif not op.valid_for(dtype):
        kinds = " or ".join(sorted(op.kinds))
        raise TypeError(f"op {op.name!r} is not defined for dtype {dtype} (needs {kinds} data)")
    if len(_VALID_PAIRS) >= MAX_VALID_PAIRS:  # (a program that makes dtypes without end)
        _VALID_PAIRS.clear()
    _VALID_PAIRS.add((dtype, op.name))


#: (dtype, op name) pairs already checked (dtypes hash and compare by value;
#: each holds its dtype, so at most MAX_VALID_PAIRS: a new structured dtype
#: per call must not grow the process without bound)
_VALID_PAIRS: set = set()
MAX_VALID_PAIRS = 1024


def reduce_step(op: Op, backend, first, second, out, datatype=None, temp=None):
    """``out = first OP second`` as a ``(function, arguments)`` step, views made.

    ``datatype``: the MPI datatype of one element (user ``MPI.Op`` only, which
    runs ``MPI_Reduce_local(in, inout)``: ``inout = in OP inout``); ``temp``:
    an array of at least ``len(out)`` elements it may use when ``out`` is
    ``first`` (then ``second`` must be combined into a copy)."""
    if op.ufunc is not None:
        combine = backend.ufunc(op.ufunc)
        if op.ufunc in (np.maximum, np.minimum):  # they take out= by keyword only
            return functools.partial(combine, out=out), (first, second)
        return combine, (first, second, out)
    if op.function is not None:
        return op.function, (first, second, out)
    # (the Python function behind it, which mpi4py cannot raise from, runs
    # where no signal handler interrupts it: threads.sheltered)
    reduce_local = functools.partial(sheltered, op.mpi_op.Reduce_local)
    if backend.shares_memory(out, second):
        return reduce_local, ([first, datatype], [out, datatype])
    if backend.shares_memory(out, first):
        tmp = temp[:len(out)]
        return _through(reduce_local, backend.copy), ([first, datatype], [tmp, datatype],
                                                      second, tmp, out)
    return _into(reduce_local, backend.copy), ([first, datatype], [out, datatype], second, out)


def _through(reduce_local, copy):
    def step(first, tmp_spec, second, tmp, out):
        copy(tmp, second)
        reduce_local(first, tmp_spec)
        copy(out, tmp)
    return step


def _into(reduce_local, copy):
    def step(first, out_spec, second, out):
        copy(out, second)
        reduce_local(first, out_spec)
    return step
