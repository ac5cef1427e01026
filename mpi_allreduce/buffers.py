"""What the calls accept as buffers: mpi4py's conventions, made arrays.

A buffer argument is anything mpi4py's upper-case calls take:

* an array or buffer (:func:`~mpi_allreduce.backend.as_array`: numpy,
  cupy, the CUDA array interface, DLPack, the buffer protocol);
* a message spec ``[buf, datatype]``, ``[buf, count, datatype]``,
  ``[buf, count, displ, datatype]`` or ``[buf, (count, displ), datatype]``
  (lists or tuples): the buffer's memory taken as ``count`` elements of
  the MPI datatype from element ``displ`` on.  (mpi4py also lets the
  datatype be a typecode, or be left out: :func:`spelt` writes those
  spellings as these, for the drop-in ``Comm``, which reads buffers as
  mpi4py does; the library's own calls read a list of numbers as numbers.)

:func:`message` turns one into an array of the element's numpy dtype that
views the caller's memory (so the result lands there whatever the type),
and the datatype the caller named, if any.  Datatypes are predefined ones
(``MPI.DOUBLE``, ``MPI.C_LONG_DOUBLE_COMPLEX``...), MPI's pair types
(``MPI.DOUBLE_INT``... as numpy structured dtypes) and contiguous derived
types (``MPI.INT.Create_contiguous(9)``): with a predefined op these are
reduced as their base type, element by element; with a user-defined
``MPI.Op`` an element is the whole derived type.

:func:`in_place` knows mpi4py's three spellings of "in place": a send
buffer of ``MPI.IN_PLACE``, of ``None``, or the receive buffer object itself.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from .backend import as_array, backend_for

__all__ = ["Message", "message", "messages", "arrays_and_datatype", "in_place", "names_memory",
           "own_datatype", "spelt"]


class Message(NamedTuple):
    array: object  # numpy or cupy array of elements, viewing the caller's memory
    datatype: Optional[MPI.Datatype]  # the caller's datatype (a spec), else None


def in_place(sendbuf, recvbuf) -> bool:
    """Whether ``sendbuf`` asks for an in-place call: ``MPI.IN_PLACE``, or
    ``None`` or the receive buffer object itself (mpi4py's conventions)."""
    if sendbuf is MPI.IN_PLACE or (isinstance(sendbuf, MPI.BottomType)
                                   and sendbuf == MPI.IN_PLACE):
        return True
    return recvbuf is not None and (sendbuf is None or sendbuf is recvbuf)


def messages(sendbuf, recvbuf, user_op: bool = False) -> tuple:
    """A call's two buffers: (send :class:`Message`, or None in place; recv
    :class:`Message`, or None when omitted).  A receive buffer must name
    memory the result is written into (:func:`names_memory`): a list would
    be copied, and the result lost with the copy (mpi4py refuses it too)."""
    if in_place(recvbuf, None):  # (MPI.IN_PLACE, or an object equal to it)
        raise ValueError("recvbuf is MPI.IN_PLACE: MPI.IN_PLACE goes in sendbuf, and the "
                         "receive buffer holds this rank's data")
    if recvbuf is not None and not names_memory(recvbuf):
        raise TypeError(f"recvbuf must be an array or a buffer the result can be written "
                        f"into, not a {type(recvbuf).__name__} (it would be copied, and the "
                        "result lost)")
    if in_place(sendbuf, recvbuf):
        if recvbuf is None:
            raise ValueError("sendbuf is MPI.IN_PLACE but no recvbuf was given")
        return None, message(recvbuf, user_op, "recvbuf")
    if sendbuf is None:
        raise TypeError("sendbuf and recvbuf are both None; pass an array")
    send = message(sendbuf, user_op, "sendbuf")
    return send, None if recvbuf is None else message(recvbuf, user_op, "recvbuf")


def arrays_and_datatype(send: Optional[Message], recv: Optional[Message]) -> tuple:
    """(send array or None, recv array or None, the datatype the caller
    named, the receive buffer's first)."""
    datatype = next((m.datatype for m in (recv, send) if m is not None and m.datatype), None)
    return (None if send is None else send.array), (None if recv is None else recv.array), \
        datatype


def message(obj, user_op: bool = False, what: str = "buffer") -> Message:
    """``obj`` (an array, a buffer or a message spec) as an array of elements.

    ``user_op``: the call's op is a user-defined MPI.Op, so an element of a
    derived datatype stays whole (an opaque void element)."""
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[-1], MPI.Datatype):
        return _spec(obj, user_op, what)
    return Message(as_array(obj), None)


def spelt(spec):
    """A message spec as ``[buf, datatype]``, ``[buf, count, datatype]`` or
    ``[buf, count, displ, datatype]`` with an ``MPI.Datatype``, however
    mpi4py lets it be spelt: the datatype a typecode (``[buf, "d"]``,
    ``[buf, 4, "f8"]``), or ``None`` or left out, the buffer's own element
    type then (``[buf, 4]``, ``[buf, (4, 2)]``, ``[buf, 4, None]``); and
    ``[buf, (count, displ), datatype]`` as ``[buf, count, displ,
    datatype]``.  ``spec`` itself where it is none of these (its first
    item no buffer: a list of numbers), or names a type mpi4py would not
    find (its call then says so).  Used by the drop-in ``Comm`` only."""
    if not isinstance(spec, (list, tuple)) or not 2 <= len(spec) <= 4 or \
            not (_null(spec[0]) or _buffer(spec[0])):
        return spec
    if isinstance(spec[-1], MPI.Datatype):
        if len(spec) == 3 and isinstance(spec[1], (list, tuple)):
            return [spec[0], *_pair(spec[1]), spec[2]]
        return spec
    buf, count, displ = spec[0], None, None
    if len(spec) == 2:
        typ = spec[1]
        if isinstance(typ, (list, tuple)):
            typ, (count, displ) = None, _pair(typ)
        elif _is_count(typ):
            typ, count = None, typ
    elif len(spec) == 3:
        count, typ = spec[1], spec[2]
        if isinstance(count, (list, tuple)):
            count, displ = _pair(count)
    else:
        count, displ, typ = spec[1], spec[2], spec[3]
    if isinstance(typ, str):
        try:
            datatype = MPI.Datatype.fromcode(typ)
        except (KeyError, ValueError):
            return spec
    elif typ is None:
        datatype = own_datatype(buf)
        if datatype is None:
            return spec
    else:
        return spec
    if displ is not None:
        return [buf, count, displ, datatype]
    return [buf, datatype] if count is None else [buf, count, datatype]


def _pair(counted) -> tuple:
    """``(count, displ)`` of a spec's pair (mpi4py's spelling): two items."""
    if len(counted) != 2:
        raise ValueError(f"a message spec's (count, displacement) has two items, got "
                         f"{len(counted)}")
    return tuple(counted)


def _is_count(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


#: the prefixes of a buffer's format that name this machine's byte order
_NATIVE = ("@", "=", "<" if sys.byteorder == "little" else ">")


def own_datatype(buf) -> Optional[MPI.Datatype]:
    """The predefined datatype of ``buf``'s elements, as mpi4py finds it for
    a spec without one (from the buffer's format); None if none is found."""
    if _null(buf):
        return None
    try:
        with memoryview(buf) as view:
            code = view.format
    except TypeError:
        dtype = getattr(buf, "dtype", None)  # (a device array: its dtype's code)
        if dtype is None:
            return None
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            return None
        if not dtype.isnative:
            return None
        code = dtype.char
    if code[:1] in _NATIVE:
        code = code[1:]
    try:
        return MPI.Datatype.fromcode(code)
    except (KeyError, ValueError):
        return None


def names_memory(obj) -> bool:
    """Whether ``obj`` names memory that :func:`message` views as it lies:
    an array or a buffer, or a message spec of one (or of none: ``[None,
    datatype]``) -- not a list of numbers, a scalar or another array-like,
    which :func:`message` would copy into a new array."""
    if isinstance(obj, (list, tuple)):
        return bool(obj) and isinstance(obj[-1], MPI.Datatype) and (_null(obj[0])
                                                                    or _buffer(obj[0]))
    return _buffer(obj)


def _buffer(obj) -> bool:
    if isinstance(obj, np.ndarray) or hasattr(obj, "__cuda_array_interface__") \
            or (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        return True
    if obj is None or isinstance(obj, (list, tuple)):
        return False
    try:
        with memoryview(obj):
            return True
    except TypeError:
        return False


def _spec(spec, user_op: bool, what: str) -> Message:
    datatype = spec[-1]
    if len(spec) == 2:
        count = displ = None
    elif len(spec) == 3:
        count, displ = (spec[1], None) if not isinstance(spec[1], (tuple, list)) \
            else tuple(spec[1])
    elif len(spec) == 4:
        count, displ = spec[1], spec[2]
    else:
        raise TypeError(f"{what}: a message spec is [buf, datatype], [buf, count, datatype] or "
                        f"[buf, count, displ, datatype], got {len(spec)} items")
    if datatype == MPI.DATATYPE_NULL:
        raise TypeError(f"{what}: datatype is MPI.DATATYPE_NULL")
    kept, base = _element(datatype, user_op, what)
    extent = datatype.Get_extent()[1]
    if _null(spec[0]):
        # no buffer: a message of no elements (mpi4py's [None, datatype])
        for value, name in ((count, "count"), (displ, "displacement")):
            if value is not None and _integer(value, name, what) != 0:
                raise ValueError(f"{what}: a message spec without a buffer has no elements, "
                                 f"got {name} {value}")
        return Message(np.empty(0, base), kept)
    raw = _raw_bytes(as_array(spec[0]), what)
    available = raw.shape[0] // extent if extent else 0
    displ = 0 if displ is None else _integer(displ, "displacement", what)
    count = (available - displ) if count is None else _integer(count, "count", what)
    if count < 0 or displ < 0 or displ + count > available:
        raise ValueError(f"{what}: {count} elements of {datatype_name(datatype)} from element "
                         f"{displ} do not fit in {raw.shape[0]} bytes")
    if len(spec) == 2 and raw.shape[0] % extent:
        raise ValueError(f"{what}: {raw.shape[0]} bytes are not a whole number of "
                         f"{datatype_name(datatype)} ({extent} bytes each)")
    array = raw[displ * extent:(displ + count) * extent].view(base)
    return Message(array, kept)


def _element(datatype: MPI.Datatype, user_op: bool, what: str):
    """(the datatype kept for Reduce_local or None, the numpy dtype of the
    array)."""
    dtype = _numpy_dtype(datatype, what)
    size, (lb, extent) = datatype.Get_size(), datatype.Get_extent()
    if lb != 0 or extent <= 0:
        raise TypeError(f"{what}: datatype {datatype_name(datatype)} has lower bound {lb} and "
                        f"extent {extent}; only types that start at their first byte are taken")
    if dtype.subdtype is not None:  # a contiguous derived type: k elements of a base type
        base, shape = dtype.subdtype
        if base.itemsize * int(np.prod(shape)) != extent or size != extent:
            raise TypeError(f"{what}: datatype {datatype_name(datatype)} has gaps; pack the data "
                            "into a contiguous buffer first")
        if user_op:
            return datatype, np.dtype((np.void, extent))
        return None, base
    if dtype.itemsize != extent:
        raise TypeError(f"{what}: datatype {datatype_name(datatype)} spans {extent} bytes but "
                        f"its numpy dtype {dtype} has {dtype.itemsize}")
    if size != extent and not datatype.is_predefined:  # (MPI's pair types have padding)
        raise TypeError(f"{what}: datatype {datatype_name(datatype)} has gaps; pack the data "
                        "into a contiguous buffer first")
    return (datatype if user_op else None), dtype


@functools.lru_cache(maxsize=128)
def _numpy_dtype_of(handle: int) -> np.dtype:
    from mpi4py.util import dtlib
    return np.dtype(dtlib.to_numpy_dtype(MPI.Datatype.f2py(handle)))


def _numpy_dtype(datatype: MPI.Datatype, what: str) -> np.dtype:
    try:
        if datatype.is_predefined:
            return _numpy_dtype_of(datatype.py2f())
        from mpi4py.util import dtlib
        return np.dtype(dtlib.to_numpy_dtype(datatype))
    except (ValueError, TypeError, KeyError) as exc:
        raise TypeError(f"{what}: datatype {datatype_name(datatype)} has no numpy equivalent "
                        f"({exc})") from None


def _null(buf) -> bool:
    """Whether a message spec's buffer is none: ``None`` or ``MPI.BOTTOM``."""
    return buf is None or buf is MPI.BOTTOM or (isinstance(buf, MPI.BottomType)
                                                and buf == MPI.BOTTOM)


def _raw_bytes(array, what: str):
    """The bytes of a message spec's buffer, in memory order (a spec names
    memory, as in MPI: a Fortran-ordered buffer is taken as it lies)."""
    backend = backend_for(array)
    if not backend.is_contiguous(array):
        if array.ndim < 2 or not backend.is_contiguous(array.T):
            raise ValueError(f"{what}: the buffer of a message spec must be contiguous")
        array = array.T  # Fortran order: its transpose is C-contiguous, the same memory
    flat = array.reshape(-1)
    return flat.view(np.uint8) if flat.dtype != np.uint8 else flat


def _integer(value, name: str, what: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{what}: the {name} of a message spec must be an integer, got {value!r}")
    return int(value)


def datatype_name(datatype: MPI.Datatype) -> str:
    try:
        return datatype.Get_name() or repr(datatype)
    except MPI.Exception:  # pragma: no cover - an MPI without names
        return repr(datatype)
