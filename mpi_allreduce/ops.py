"""Reduction operations: name -> (numpy ufunc, MPI.Op, dtypes it is valid for).

Every predefined MPI operation is commutative and associative (up to
floating-point rounding); the algorithms still apply operands in a fixed
order by rank so that every rank gets bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

__all__ = ["Op", "resolve_op", "OPS", "SUPPORTED_DTYPES", "check_dtype"]

_INTEGER = "integer"
_FLOAT = "float"
_COMPLEX = "complex"
_BOOL = "bool"

#: dtypes the library reduces (numpy names)
SUPPORTED_DTYPES: tuple[str, ...] = (
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
    "bool",
)


def dtype_kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return _BOOL
    if np.issubdtype(dtype, np.integer):
        return _INTEGER
    if np.issubdtype(dtype, np.floating):
        return _FLOAT
    if np.issubdtype(dtype, np.complexfloating):
        return _COMPLEX
    return "other"


@dataclass(frozen=True)
class Op:
    """A reduction: ``reduce(a, b, out)`` computes ``out = a OP b`` in place."""

    name: str
    ufunc: np.ufunc
    mpi_op: MPI.Op
    kinds: frozenset
    #: applied to the result after the reduction (``avg`` divides by size)
    finalize: Optional[Callable] = None

    def valid_for(self, dtype: np.dtype) -> bool:
        return dtype_kind(np.dtype(dtype)) in self.kinds


_NUMERIC = frozenset({_INTEGER, _FLOAT, _COMPLEX})
_ORDERED = frozenset({_INTEGER, _FLOAT})
_LOGICAL = frozenset({_INTEGER, _BOOL})
_BITWISE = frozenset({_INTEGER})

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
    # the mean over ranks: a sum, then a division by the communicator size
    "avg": Op("avg", np.add, MPI.SUM, frozenset({_FLOAT, _COMPLEX}), finalize=np.true_divide),
}

_BY_MPI_OP = [(op.mpi_op, op) for name, op in OPS.items() if name != "avg"]


def resolve_op(op) -> Op:
    """Accept a predefined ``MPI.Op``, its lower-case name, or ``"avg"``."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        try:
            return OPS[op.lower()]
        except KeyError:
            raise ValueError(
                f"unknown op {op!r}; expected one of {', '.join(OPS)} or a predefined MPI.Op"
            ) from None
    if isinstance(op, MPI.Op):
        for mpi_op, ours in _BY_MPI_OP:
            if op == mpi_op:
                return ours
        raise ValueError(
            f"unsupported MPI.Op {op!r}: only the predefined ops "
            f"{', '.join(n.upper() for n in OPS if n != 'avg')} are supported"
        )
    raise TypeError(f"op must be an MPI.Op or a string, got {type(op).__name__}")


def check_dtype(dtype: np.dtype, op: Op) -> None:
    """Raise TypeError for a dtype we do not reduce or an op/dtype pair that is invalid."""
    if (dtype, op.name) in _VALID_PAIRS:
        return
    dtype = np.dtype(dtype)
    if dtype.name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"unsupported dtype {dtype}; expected one of {', '.join(SUPPORTED_DTYPES)}"
        )
    if not op.valid_for(dtype):
        kinds = " or ".join(sorted(op.kinds))
        raise TypeError(f"op {op.name!r} is not defined for dtype {dtype} (needs {kinds} data)")
    _VALID_PAIRS.add((dtype, op.name))


#: (dtype, op name) pairs already checked (dtypes hash and compare by value)
_VALID_PAIRS: set = set()
