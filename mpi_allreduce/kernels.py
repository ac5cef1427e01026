"""The reproducible sum's three passes over memory as fused loops, compiled
by numba (an optional dependency: ``pip install 'mpi_allreduce[numba]'``).

Each function here does in one pass what :mod:`~mpi_allreduce.reproducible`
does in several numpy passes, and gives the same bytes: the numpy passes
stay the reference (and the only path for cupy arrays, float16 and
bfloat16), and a test compares the two on ordinary, tiny, subnormal, huge
and non-finite values.  The same bytes follow from three facts:

* the exponent is read from the float's bits, and from ``frexp`` where
  the bits do not give it (subnormals), so it is ``frexp``'s exponent;
* multiplying by a power of two that is a normal float is correctly
  rounded, as ``ldexp`` is, so both give the same float; other powers
  (below ``2^-1022``, above ``2^1023``) go through ``ldexp`` here too;
* ``(y + 1.5 2^52) - 1.5 2^52`` is ``rint(y)`` (to nearest, ties to even)
  for ``|y| < 2^51``, and slices stay below ``2^40``.

This module imports numba: :mod:`~mpi_allreduce.reproducible` imports it
on a reproducible sum's first use (``MPI_ALLREDUCE_KERNELS``).  Each loop is
compiled on its first call and kept in numba's cache on disk.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .reproducible import _NAN, _NEG, _POS, EMIN, ENONFINITE, W

__all__ = ["DTYPES", "exponents", "slices", "assemble"]

#: 2^k for k = -1022 .. 1023 (the normal powers of two), at index k + 1022
POW2 = np.ldexp(1.0, np.arange(-1022, 1024))
#: adding and subtracting it rounds a float below 2^51 to an integer, ties to even
MAGIC = 1.5 * 2.0 ** 52
#: the layout of each float's bits: (mantissa bits, exponent mask, frexp bias)
_LAYOUT = {np.dtype(np.float64): (np.int64, 52, 0x7FF, 1022),
           np.dtype(np.float32): (np.int32, 23, 0xFF, 126)}


jit = numba.njit(cache=True, nogil=True, error_model="numpy")

#: the input dtypes the fused passes read directly
DTYPES = tuple(_LAYOUT)


@jit
def _exponents(x, bits, shift, mask, bias, e):
    for i in range(x.shape[0]):
        b = (bits[i] >> shift) & mask
        if b == mask:
            e[i] = ENONFINITE
        elif b != 0:
            e[i] = b - bias
        elif x[i] == 0:
            e[i] = EMIN
        else:
            e[i] = math.frexp(np.float64(x[i]))[1]


@jit
def _slices(x, e, out, powers):
    two = out.shape[0] == 2
    for i in range(x.shape[0]):
        exponent = np.int64(e[i])
        value = np.float64(x[i])
        if exponent == ENONFINITE:
            flag = 0
            if value == np.inf:
                flag = _POS
            elif value == -np.inf:
                flag = _NEG
            elif value != value:
                flag = _NAN
            out[0, i] = flag
            if two:
                out[1, i] = 0
            continue
        k = W - exponent  # (a helper function for this ldexp is 5x slower)
        y = value * powers[k + 1022] if k <= 1023 else math.ldexp(value, k)
        h = (y + MAGIC) - MAGIC
        out[0, i] = np.int64(h)
        if two:
            y = (y - h) * 1099511627776.0  # 2^W, exact: |y - h| <= 1/2
            out[1, i] = np.int64((y + MAGIC) - MAGIC)


@jit
def _assemble(total, e, out, powers):
    two = total.shape[0] == 2
    for i in range(out.shape[0]):
        exponent = np.int64(e[i])
        if exponent == ENONFINITE:
            flags = total[0, i]
            pos = (flags // _POS) % (1 << 21) > 0
            neg = (flags // _NEG) % (1 << 21) > 0
            if flags // _NAN > 0 or (pos and neg):
                out[i] = np.nan
            else:
                out[i] = np.inf if pos else -np.inf
            continue
        k, value = exponent - W, np.float64(total[0, i])
        result = value * powers[k + 1022] if k >= -1022 else math.ldexp(value, k)
        if two:
            k, value = exponent - 2 * W, np.float64(total[1, i])
            result += value * powers[k + 1022] if k >= -1022 else math.ldexp(value, k)
        out[i] = result


def exponents(x, out) -> None:
    """:func:`~mpi_allreduce.reproducible.exponents` of float32 or float64
    ``x`` (read as float64) into int16 ``out``."""
    view, shift, mask, bias = _LAYOUT[x.dtype]
    _exponents(x, x.view(view), shift, mask, bias, out)


def slices(x, e, out) -> None:
    """:func:`~mpi_allreduce.reproducible.slices` of float32 or float64 ``x``
    into int64 ``out`` of shape ``(count, n)``, count 1 or 2."""
    _slices(x, e, out, POW2)


def assemble(total, e, out) -> None:
    """:func:`~mpi_allreduce.reproducible.assemble` into ``out`` (float64,
    or float32: the float64 sum rounded as numpy rounds it)."""
    _assemble(total, e, out, POW2)
