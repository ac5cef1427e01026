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
2. *Pre-rounding.*  Each rank cuts its ``x_i`` into K integer slices of
   ``W = 40`` bits on the grid fixed by ``e_i`` (K = 2 for float64, 1 for
   the narrower floats: :func:`slices_for`):
   ``h1 = rint(x 2^(W - e))``, ``h2 = rint((x 2^(W - e) - h1) 2^W)``.  What
   is below the last slice (below ``2^(e - K W)``) is dropped, the same way
   on every rank whatever the others hold.
3. *Exact accumulation.*  An all-reduce SUM of the int64 slices: integer
   addition is exact and associative (``|sum| <= p 2^W < 2^63`` for
   ``p <= 2^20`` ranks), so every algorithm and order gives the same
   integers.
4. *Assembly.*  Each slice sum is scaled to its place and added from the
   top, the same operations on every rank.

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

from collections import OrderedDict

import numpy as np

__all__ = ["Scratch", "exponents", "slices", "assemble", "slices_for", "W", "MAX_RANKS", "allreduce"]

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


class Scratch:
    """Temporaries of ``n`` elements, allocated once: fresh large arrays
    cost page faults on every call, which is most of a pass here."""

    def __init__(self, n: int, xp=np):
        self.f, self.g = xp.empty(n, np.float64), xp.empty(n, np.float64)
        self.i = xp.empty(n, np.int32)
        self.xp = xp


def exponents(x, out=None, tmp: Scratch = None):
    """int16 ``e`` with ``|x| < 2^e`` per element (``EMIN`` for 0,
    ``ENONFINITE`` for inf and nan); ``x`` float64."""
    tmp = tmp or Scratch(x.shape[0])
    xp = tmp.xp
    xp.frexp(x, tmp.f, tmp.i)
    e = tmp.i
    xp.copyto(e, EMIN, where=(x == 0))
    finite = xp.isfinite(x)
    if not bool(finite.all()):
        xp.copyto(e, ENONFINITE, where=~finite)
    out = xp.empty(x.shape[0], np.int16) if out is None else out
    out[...] = e
    return out


def _shared(e, tmp: Scratch):
    """The shared exponents as int32 (in ``tmp.i``), those of non-finite
    elements replaced by ``W`` (their first slice carries counts instead);
    (that array, the non-finite mask, whether it has any)."""
    exponent = tmp.i
    exponent[...] = e
    nonfinite = exponent == ENONFINITE
    special = bool(nonfinite.any())
    if special:
        tmp.xp.copyto(exponent, W, where=nonfinite)
    return exponent, nonfinite, special


def slices(x, e, count: int, out=None, tmp: Scratch = None):
    """``x`` (float64) pre-rounded on the grid of ``e``: int64 of shape
    ``(count, n)``; elements whose shared exponent is ``ENONFINITE`` carry
    their non-finite counts in slice 0 instead."""
    tmp = tmp or Scratch(x.shape[0])
    xp = tmp.xp
    shift, nonfinite, special = _shared(e, tmp)
    finite = xp.where(nonfinite, 0.0, x) if special else x
    xp.subtract(W, shift, out=shift)
    y, h = xp.ldexp(finite, shift, out=tmp.f), tmp.g
    out = xp.empty((count, x.shape[0]), np.int64) if out is None else out
    for k in range(count):
        xp.rint(y, out=h)
        out[k] = h
        if k + 1 < count:
            y -= h  # exact: h is within 1/2 of y
            xp.ldexp(y, W, out=y)
    if special:
        flags = (xp.where(x == np.inf, _POS, 0) + xp.where(x == -np.inf, _NEG, 0)
                 + xp.where(xp.isnan(x), _NAN, 0)).astype(np.int64)
        out[0] = xp.where(nonfinite, flags, out[0])
    return out


def assemble(total, e, tmp: Scratch = None):
    """The float64 sums from the summed slices ``total`` (``(count, n)``
    int64) and the shared exponents ``e``: each slice scaled to its place
    and added from the top, the same operations on every rank.  (The
    result is ``tmp.f`` when ``tmp`` is given.)"""
    tmp = tmp or Scratch(total.shape[1])
    xp = tmp.xp
    exponent, nonfinite, special = _shared(e, tmp)
    result, part = tmp.f, tmp.g
    for k in range(total.shape[0]):
        exponent -= W
        part[...] = total[k]
        if k == 0:
            xp.ldexp(part, exponent, out=result)
        else:
            result += xp.ldexp(part, exponent, out=part)
    if special:
        flags = total[0]
        pos, neg = (flags // _POS) % (1 << 21) > 0, (flags // _NEG) % (1 << 21) > 0
        nan = flags // _NAN > 0
        value = xp.where(nan | (pos & neg), np.nan, xp.where(pos, np.inf, -np.inf))
        xp.copyto(result, value, where=nonfinite)
    return result


class _Work:
    """The arrays of one shape's reproducible sums and the two all-reduces
    bound to them, kept for repeats."""

    def __init__(self, backend, n: int, count: int, bind):
        self.backend, self.n = backend, n
        self.x = None  # a float64 copy of narrower inputs, made on first need
        self.tmp = None  # numpy's passes' temporaries, made on first need
        self.e, self.e_all = backend.empty(n, np.int16), backend.empty(n, np.int16)
        self.slices = backend.empty(count * n, np.int64)
        self.total = backend.empty(count * n, np.int64)
        self.max = bind(self.e, self.e_all, "max")
        self.sum = bind(self.slices, self.total, "sum")

    def scratch(self) -> Scratch:
        if self.tmp is None:
            self.tmp = Scratch(self.n, self.backend.xp)
        return self.tmp

    def wide(self):
        """The float64 array for narrower inputs and results."""
        if self.x is None:
            self.x = self.backend.empty(self.n, np.float64)
        return self.x

    def float64(self, real):
        """``real`` as float64: itself, or copied into :meth:`wide`."""
        if real.dtype == np.float64:
            return real
        self.wide()[...] = real
        return self.x


#: shapes whose work arrays and bound calls a communicator keeps
MAX_WORK = 4


def allreduce(send, recv, comm, backend, bind, options: tuple, kept: "OrderedDict",
              fused=None):
    """The reproducible sum of ``send`` (None: in place, read from ``recv``)
    into ``recv`` over ``comm``.  ``bind(sendbuf, recvbuf, op)`` returns an
    all-reduce of those arrays (the library's, with the caller's algorithm
    and ``options`` -- everything the bound calls depend on, the caller's
    dtype and op included), run by calling it.  The work arrays and bound
    calls of the last ``MAX_WORK`` shapes are kept in ``kept`` (the
    communicator's context owns it; 36 bytes per element with numba's
    fused passes, 56 with numpy's, and 8 more for a copy as float64 where
    the passes do not read the dtype itself).  ``fused``: ``mpi_allreduce.kernels`` for its fused passes
    (host arrays), or None for numpy's."""
    if comm.Get_size() > MAX_RANKS:
        raise ValueError(f"reproducible sums take at most {MAX_RANKS} ranks")
    real = _real_view(recv if send is None else send).reshape(-1)
    n, count = real.shape[0], slices_for(real.dtype)
    key = (n, count, backend, options)
    work = kept.get(key)
    if work is None:
        work = kept[key] = _Work(backend, n, count, bind)
        while len(kept) > MAX_WORK:
            kept.popitem(last=False)
    else:
        kept.move_to_end(key)
    x = real if fused is not None and real.dtype in fused.DTYPES else work.float64(real)
    rows = work.slices.reshape(count, n), work.total.reshape(count, n)
    out = _real_view(recv).reshape(-1)
    if fused is not None:
        fused.exponents(x, work.e)
        work.max()
        fused.slices(x, work.e_all, rows[0])
        work.sum()
        result = out if out.dtype in fused.DTYPES else work.wide()
        fused.assemble(rows[1], work.e_all, result)
    else:
        exponents(x, work.e, work.scratch())
        work.max()
        slices(x, work.e_all, count, rows[0], work.tmp)
        work.sum()
        result = assemble(rows[1], work.e_all, work.tmp)
    if result is not out:
        out[...] = result
    return recv


def _real_view(array):
    """A float array as itself, a complex one as its real and imaginary parts."""
    if array.dtype.kind == "c":
        return array.view(np.dtype(f"f{array.dtype.itemsize // 2}"))
    return array
