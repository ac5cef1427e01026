"""Bucket grouping of fused arrays: pure maths, no MPI."""

from __future__ import annotations

import pytest

from mpi_allreduce.fusion import bucket_bounds


@pytest.mark.parametrize("sizes,limit,groups", [
    ([], 4, []),
    ([5], 4, [(0, 1)]),  # larger than a bucket: alone
    ([1, 2, 3, 10, 1, 1], 4, [(0, 2), (2, 3), (3, 4), (4, 6)]),
    ([2, 2, 2, 2], 4, [(0, 2), (2, 4)]),  # closed exactly full
    ([1] * 5, 100, [(0, 5)]),
    ([0, 0, 3], 1, [(0, 3)]),  # empty arrays ride with the next
])
def test_bucket_bounds(sizes, limit, groups):
    assert bucket_bounds(sizes, limit) == groups


@pytest.mark.parametrize("limit", [1, 7, 64, 1000])
def test_buckets_cover_every_array_once_and_stay_under_the_limit(limit):
    sizes = [(i * 37) % 101 for i in range(200)]
    groups = bucket_bounds(sizes, limit)
    assert [i for start, stop in groups for i in range(start, stop)] == list(range(len(sizes)))
    for start, stop in groups:
        # over the limit only when its last array alone is (the rest empty)
        assert sum(sizes[start:stop]) <= limit or sum(sizes[start:stop - 1]) == 0
