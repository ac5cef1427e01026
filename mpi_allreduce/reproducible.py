"""Reproducible sums: the same bits whatever the algorithm, the order in
which ranks' values meet, the segment size, and which rank holds which
vector.

Floating-point addition is not associative, so an all-reduce's result
depends on the order the algorithm combines in (the ring and recursive
doubling differ at p >= 3, and so does one algorithm at two segment
sizes).  ``allreduce(x, op="sum", reproducible=True)`` removes the order
from the arithmetic, after Demmel and Nguyen's pre-rounding ("Fast
reproducible floating-point summation", 2013):

1. *Shared exponent.*  Per element i, ``e_i`` is the largest binary
   exponent of ``|x_i|`` over all ranks (``frexp``; an all-reduce MAX of
   int16, which is exact): every ``|x_i| < 2^e_i``.
2. *Pre-rounding.*  Each rank cuts its ``x_i`` into ``SLICES`` integers
   of ``W = 40`` bits on the grid fixed by ``e_i``:
   ``h1 = rint(x 2^(W - e))``, ``h2 = rint((x 2^(W - e) - h1) 2^W)``.  What
   is below the last slice (below ``2^(e - SLICES W)``) is dropped, the
   same way on every rank whatever the others hold.
3. *Exact accumulation.*  An all-reduce SUM of the int64 slices: integer
   addition is exact and associative (``|sum| <= p 2^W < 2^63`` for
   ``p <= 2^20`` ranks), so every algorithm and order gives the same
   integers.
4. *Assembly.*  The integers are carried into normal form and turned
   into the float the same way on every rank.

The result therefore depends only on the multiset of the ranks' vectors.
Error bound, per element (``M_i = max_r |x_{r,i}|``, ``u`` the unit
roundoff of the result's type, ``S`` the exact sum)::

    float64 (2 slices):                   |result - S| <= 2u |S| + p 2^-79 M_i
    float32, float16, bfloat16 (1 slice): |result - S| <=  u |S| + p 2^-39 M_i
                                                          (+ 2^-52 |S|)

Complex numbers are two real sums.  Non-finite inputs give IEEE's answer
(inf if only +inf appear, nan for nan or +inf with -inf); zeros come back
as +0.  Cost: two all-reduces (2 bytes, then 8 bytes per slice per
element: 2.25x the bytes of a float64 sum, 2.5x of a float32 one) and a
few passes over the vector (``benchmarks/reproducible.py``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["exponents", "slices", "assemble", "slices_for", "W", "MAX_RANKS", "allreduce"]

#: bits per slice
W = 40
#: the most ranks whose slice sums fit int64 (and the non-finite counts their field)
MAX_RANKS = 1 << 20
#: exponent of an element that is zero on every rank (below any float's)
EMIN = -1100
#: exponent that marks a non-finite value somewhere
ENONFINITE = 2000
#: the non-finite counts' fields in the first slice: +inf, -inf, nan
_POS, _NEG, _NAN = 1, 1 << 21, 1 << 42


def slices_for(dtype: np.dtype) -> int:
    """Slices per real element: 2 for float64, 1 for the narrower floats."""
    return 2 if np.dtype(dtype).itemsize >= 8 else 1


def exponents(x, xp=np):
    """int16 ``e`` with ``|x| < 2^e`` per element (``EMIN`` for 0,
    ``ENONFINITE`` for inf and nan); ``x`` float64."""
    finite = xp.isfinite(x)
    _, e = xp.frexp(xp.where(finite, x, 0.0))
    e = xp.where(x == 0, EMIN, e)
    return xp.where(finite, e, ENONFINITE).astype(np.int16)


def slices(x, e, count: int, xp=np):
    """``x`` (float64) pre-rounded on the grid of ``e``: int64 of shape
    ``(count, n)``; elements whose shared exponent is ``ENONFINITE`` carry
    their non-finite counts in slice 0 instead."""
    e = e.astype(np.int32)
    nonfinite = e == ENONFINITE
    y = xp.ldexp(xp.where(nonfinite, 0.0, x), xp.where(nonfinite, 0, W - e))
    out = xp.empty((count, x.shape[0]), np.int64)
    for k in range(count):
        h = xp.rint(y)
        out[k] = h.astype(np.int64)
        y = xp.ldexp(y - h, W)  # exact: h is within 1/2 of y
    if bool(nonfinite.any()):
        flags = (xp.where(x == np.inf, _POS, 0) + xp.where(x == -np.inf, _NEG, 0)
                 + xp.where(xp.isnan(x), _NAN, 0)).astype(np.int64)
        out[0] = xp.where(nonfinite, flags, out[0])
    return out


def assemble(total, e, xp=np):
    """The float64 sums from the summed slices ``total`` (``(count, n)``
    int64) and the shared exponents ``e``: carried into normal form (each
    lower slice within half a unit of the one above), then added from the
    top, the same operations on every rank."""
    total = total.copy()
    count = total.shape[0]
    for k in range(count - 1, 0, -1):
        carry = (total[k] + (1 << (W - 1))) >> W
        total[k] -= carry << W
        total[k - 1] += carry
    e = e.astype(np.int32)
    nonfinite = e == ENONFINITE
    exponent = xp.where(nonfinite, 0, e - W)
    result = xp.ldexp(total[0].astype(np.float64), exponent)
    for k in range(1, count):
        result = result + xp.ldexp(total[k].astype(np.float64), exponent - k * W)
    if bool(nonfinite.any()):
        flags = total[0]
        pos, neg = (flags // _POS) % (1 << 21) > 0, (flags // _NEG) % (1 << 21) > 0
        nan = flags // _NAN > 0
        special = xp.where(nan | (pos & neg), np.nan, xp.where(pos, np.inf, -np.inf))
        result = xp.where(nonfinite, special, result)
    return result


def allreduce(send, recv, comm, backend, run):
    """The reproducible sum of ``send`` (None: in place, read from ``recv``)
    into ``recv`` over ``comm``.  ``run(sendbuf, op)`` is an all-reduce of
    the library's (the caller's algorithm and options) returning its result."""
    if comm.Get_size() > MAX_RANKS:
        raise ValueError(f"reproducible sums take at most {MAX_RANKS} ranks")
    xp = backend.xp
    source = recv if send is None else send
    real = _real_view(source)
    x = real.reshape(-1).astype(np.float64)
    e = run(exponents(x, xp), "max")
    count = slices_for(real.dtype)
    total = run(slices(x, e, count, xp).reshape(-1), "sum").reshape(count, -1)
    result = assemble(total, e, xp)
    out = _real_view(recv).reshape(-1)
    out[...] = result.astype(out.dtype)
    return recv


def _real_view(array):
    """A float array as itself, a complex one as its real and imaginary parts."""
    if array.dtype.kind == "c":
        return array.view(np.dtype(f"f{array.dtype.itemsize // 2}"))
    return array
