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
