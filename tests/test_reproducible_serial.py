"""The reproducible sum's arithmetic without MPI: the ranks' slices summed
in any order and grouping give the same bits, the result is within the
error bound of docs/reproducible.md of the exact sum, and non-finite inputs follow IEEE."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from mpi_allreduce.reproducible import assemble, exponents, slices, slices_for


def reduce_like_mpi(vectors, order, dtype):
    """What the two all-reduces compute, with the ranks' slices summed in
    ``order`` (any order: integer sums are exact)."""
    xs = [v.astype(np.float64) for v in vectors]
    e = np.max([exponents(x) for x in xs], axis=0)
    count = slices_for(dtype)
    parts = [slices(x, e, count) for x in xs]
    total = np.zeros_like(parts[0])
    for r in order:
        total += parts[r]
    return assemble(total, e).astype(dtype)


def spread(rng, p, n, decades=30):
    """Values over 2 x ``decades`` orders of magnitude, with cancellation."""
    mags = rng.uniform(-decades, decades, (p, n))
    signs = rng.choice([-1.0, 1.0], (p, n))
    return list(signs * 10.0 ** mags)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("p", [2, 3, 7, 64, 1000])
def test_any_order_gives_the_same_bits(dtype, p):
    rng = np.random.default_rng(p)
    vectors = [v.astype(dtype) for v in spread(rng, p, 200, 3 if dtype == "float16" else 30)]
    first = reduce_like_mpi(vectors, range(p), dtype)
    for trial in range(3):
        again = reduce_like_mpi(vectors, rng.permutation(p), dtype)
        assert again.tobytes() == first.tobytes()
    # and the plain float sum in another order does differ (the problem solved)
    if dtype == "float64" and p >= 3:
        plain = [np.sum(np.array(vectors)[order], axis=0)
                 for order in (np.arange(p), rng.permutation(p))]
        assert plain[0].tobytes() != plain[1].tobytes()


@pytest.mark.parametrize("dtype,u,slack", [("float64", 2.0 ** -53, 2.0 ** -79),
                                           ("float32", 2.0 ** -24, 2.0 ** -39)])
@pytest.mark.parametrize("p", [2, 5, 100])
def test_error_bound(dtype, u, slack, p):
    """|result - S| <= k u |S| + p slack M per element, S exact (fractions),
    on data with heavy cancellation."""
    rng = np.random.default_rng(100 + p)
    vectors = [v.astype(dtype) for v in spread(rng, p, 300)]
    vectors[-1] = -np.sum(np.array(vectors[:-1], dtype=np.float64), axis=0).astype(dtype)
    got = reduce_like_mpi(vectors, range(p), dtype).astype(np.float64)
    k = 2 if dtype == "float64" else 1
    for i in range(300):
        exact = sum(Fraction(float(v[i])) for v in vectors)
        m = max(abs(float(v[i])) for v in vectors)
        bound = k * u * abs(exact) + p * slack * m  # docs/reproducible.md's bounds
        if dtype == "float32":
            bound += 2.0 ** -52 * abs(exact)
        assert abs(Fraction(float(got[i])) - exact) <= Fraction(bound), (i, float(exact))


def test_close_to_the_correctly_rounded_sum():
    """float64 on benign data: equal to math.fsum (correctly rounded) in
    almost every element, never more than one ulp away."""
    rng = np.random.default_rng(3)
    vectors = list(rng.normal(size=(16, 2000)))
    got = reduce_like_mpi(vectors, range(16), "float64")
    ref = np.array([math.fsum(v[i] for v in vectors) for i in range(2000)])
    ulps = np.abs(got - ref) / np.spacing(np.abs(ref))
    assert ulps.max() <= 1 and (ulps == 0).mean() > 0.9


@pytest.mark.parametrize("values,expected", [
    ([1.0, np.inf, 2.0], np.inf), ([-np.inf, 1.0, -np.inf], -np.inf),
    ([np.inf, -np.inf, 0.0], np.nan), ([np.nan, 1.0, 1.0], np.nan),
    ([0.0, -0.0, 0.0], 0.0), ([5e-324, 5e-324, 0.0], 1e-323),
    ([1.7e308, 1.7e308, -1.7e308], 1.7e308),
])
def test_special_values(values, expected):
    vectors = [np.array([v]) for v in values]
    got = reduce_like_mpi(vectors, range(len(values)), "float64")[0]
    if np.isnan(expected):
        assert np.isnan(got)
    else:
        assert got == expected


def edge_values(rng, n, dtype):
    """Ordinary values over many decades, with zeros of both signs,
    subnormals, the largest and smallest normals, infinities and nans."""
    info = np.finfo(dtype)
    x = (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-30, 30, n)).astype(dtype)
    special = np.array([0.0, -0.0, info.tiny, -info.tiny, info.smallest_subnormal,
                        -3 * info.smallest_subnormal, info.tiny / 3, info.max, -info.max,
                        np.inf, -np.inf, np.nan], dtype)
    x[rng.choice(n, 3 * special.size, replace=False)] = np.tile(special, 3)
    return x


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_numbas_fused_passes_give_numpys_bytes(dtype):
    """Each fused pass against its numpy passes, bit for bit, on three
    ranks' vectors whose shared exponents are often another rank's (so
    tiny values meet a coarse grid), with every kind of special value."""
    kernels = pytest.importorskip("mpi_allreduce.kernels")
    rng = np.random.default_rng(7)
    n, count = 5000, slices_for(dtype)
    xs = [edge_values(rng, n, dtype) for _ in range(3)]
    xs[2][:100] = 0  # elements where one rank holds a zero, another a subnormal
    xs[1][:100] = np.finfo(dtype).smallest_subnormal * rng.integers(-9, 9, 100)
    for x, zero in zip(xs, (0.0, -0.0, 0.0)):  # elements that are zero on every rank
        x[100:110] = zero
    e_all = None
    for x in xs:
        e = exponents(x.astype(np.float64))
        fused = np.empty(n, np.int16)
        kernels.exponents(x, fused)
        assert fused.tobytes() == e.tobytes()
        e_all = e if e_all is None else np.maximum(e_all, e)
    total = np.zeros((count, n), np.int64)
    for x in xs:
        part = slices(x.astype(np.float64), e_all, count)
        fused = np.empty_like(part)
        kernels.slices(x, e_all, fused)
        assert fused.tobytes() == part.tobytes()
        total += part
    for scale in (1, -999):  # sums as p ranks' slices make them, and larger ones
        with np.errstate(over="ignore"):  # (-999 x the largest float: an infinity)
            want = assemble(total * scale, e_all)
            for out in (np.empty(n, np.float64), np.empty(n, dtype)):
                kernels.assemble(total * scale, e_all, out)
                assert out.tobytes() == want.astype(out.dtype).tobytes()


def test_kernels_numba_without_numba_is_an_error_that_says_so(monkeypatch):
    """MPI_ALLREDUCE_KERNELS=numba where numba does not import: ImportError
    naming the extra; auto falls back to numpy's passes."""
    import sys

    import mpi_allreduce
    from mpi_allreduce import config
    from mpi_allreduce.api import kernels_for
    from mpi_allreduce.backend import backend_for

    backend = backend_for(np.zeros(1))
    monkeypatch.setitem(sys.modules, "mpi_allreduce.kernels", None)
    monkeypatch.delattr(mpi_allreduce, "kernels", raising=False)
    try:
        monkeypatch.setenv(config.KERNELS_ENV, "numba")
        config.refresh()
        with pytest.raises(ImportError, match=r"mpi_allreduce\[numba\]"):
            kernels_for(backend)
        monkeypatch.setenv(config.KERNELS_ENV, "auto")
        config.refresh()
        assert kernels_for(backend) is None
    finally:
        monkeypatch.undo()
        config.refresh()
