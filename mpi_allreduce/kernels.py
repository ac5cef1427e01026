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
  (below ``2^-1022``, above ``2^1023``) go through ``ldexp`` here too, in
  a second loop over the few elements that need them (an element that is
  non-finite on some rank, or tiny under a tiny shared exponent), so the
  first loop has no branch and no call and runs on vector registers;
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
from numba import types
from numba.extending import intrinsic

from .reproducible import _NAN, _NEG, _POS, EMIN, ENONFINITE, W

__all__ = ["DTYPES", "exponents", "slices", "assemble"]

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
    subnormal = False
    for i in range(x.shape[0]):  # no branch, no call: a vector loop
        b = (bits[i] >> shift) & mask
        v = ENONFINITE if b == mask else b - bias
        e[i] = EMIN if b == 0 else v
        subnormal |= (b == 0) & (x[i] != 0)
    if subnormal:
        for i in range(x.shape[0]):
            if e[i] == EMIN and x[i] != 0:
                e[i] = math.frexp(np.float64(x[i]))[1]


@intrinsic
def _float_of_bits(typingctx, bits):
    """The float64 whose bits are the int64 ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float64))
    return types.float64(types.int64), codegen


@jit
def _pow2(k):
    """``2^k`` for ``-1022 <= k <= 1023``, built from its bits (a table
    lookup would keep the loops from running on vectors)."""
    return _float_of_bits((k + 1023) << 52)


@numba.njit(inline="always")  # (called as a function, it keeps the loops off vectors)
def _rare(exponent, low, high):
    """Whether an element's scales 2^low .. 2^high (on the grid of its shared
    ``exponent``) leave the normal powers of two: then it is done one by
    one, with ``ldexp`` or as a non-finite one.  (EMIN: zero on every rank,
    any scale gives 0.)"""
    return ((low < -1022) | (high > 1023)) & (exponent != EMIN)


@jit
def _slices(x, e, out):
    """The vector loop does every element whose grid is a normal power of
    two and marks the others (non-finite somewhere, or tiny below a tiny
    shared exponent), which :func:`_slices_rare` then does one by one."""
    two, rare = out.shape[0] == 2, False
    for i in range(x.shape[0]):
        exponent = np.int64(e[i])
        k = W - exponent
        kept = min(max(k, -1022), 1023)
        odd = _rare(exponent, k, k)
        rare |= odd
        y = 0.0 if odd else np.float64(x[i]) * _pow2(kept)
        h = (y + MAGIC) - MAGIC
        out[0, i] = np.int64(h)
        if two:
            y = (y - h) * 1099511627776.0  # 2^W, exact: |y - h| <= 1/2
            out[1, i] = np.int64((y + MAGIC) - MAGIC)
    if rare:
        _slices_rare(x, e, out)


@jit
def _slices_rare(x, e, out):
    two = out.shape[0] == 2
    for i in range(x.shape[0]):
        exponent = np.int64(e[i])
        k = W - exponent
        if not _rare(exponent, k, k):
            continue
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
        y = math.ldexp(value, k)
        h = (y + MAGIC) - MAGIC
        out[0, i] = np.int64(h)
        if two:
            y = (y - h) * 1099511627776.0
            out[1, i] = np.int64((y + MAGIC) - MAGIC)


@jit
def _assemble(total, e, out):
    """As :func:`_slices`: a vector loop for the elements whose scales are
    normal powers of two, :func:`_assemble_rare` for the others."""
    two, rare = total.shape[0] == 2, False
    for i in range(out.shape[0]):
        exponent = np.int64(e[i])
        k = exponent - W
        last = k - W if two else k
        rare |= _rare(exponent, last, k)
        result = np.float64(total[0, i]) * _pow2(min(max(k, -1022), 1023))
        if two:
            result += np.float64(total[1, i]) * _pow2(max(last, -1022))
        out[i] = result
    if rare:
        _assemble_rare(total, e, out)


@jit
def _assemble_rare(total, e, out):
    two = total.shape[0] == 2
    for i in range(out.shape[0]):
        exponent = np.int64(e[i])
        k = exponent - W
        last = k - W if two else k
        if not _rare(exponent, last, k):
            continue
        if exponent == ENONFINITE:
            flags = total[0, i]
            pos = (flags // _POS) % (1 << 21) > 0
            neg = (flags // _NEG) % (1 << 21) > 0
            if flags // _NAN > 0 or (pos and neg):
                out[i] = np.nan
            else:
                out[i] = np.inf if pos else -np.inf
            continue
        value = np.float64(total[0, i])
        result = value * _pow2(k) if k >= -1022 else math.ldexp(value, k)
        if two:
            k, value = last, np.float64(total[1, i])
            result += value * _pow2(k) if k >= -1022 else math.ldexp(value, k)
        out[i] = result


def exponents(x, out) -> None:
    """:func:`~mpi_allreduce.reproducible.exponents` of float32 or float64
    ``x`` (read as float64) into int16 ``out``."""
    view, shift, mask, bias = _LAYOUT[x.dtype]
    _exponents(x, x.view(view), shift, mask, bias, out)


def slices(x, e, out) -> None:
    """:func:`~mpi_allreduce.reproducible.slices` of float32 or float64 ``x``
    into int64 ``out`` of shape ``(count, n)``, count 1 or 2."""
    _slices(x, e, out)


def assemble(total, e, out) -> None:
    """:func:`~mpi_allreduce.reproducible.assemble` into ``out`` (float64,
    or float32: the float64 sum rounded as numpy rounds it)."""
    _assemble(total, e, out)
