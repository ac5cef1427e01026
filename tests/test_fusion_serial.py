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


@pytest.mark.parametrize("sizes,limit", [
    ([0, 16, 0, 16], 8), ([0, 0, 3], 1), ([1, 2, 3, 10, 1, 1], 4), ([5, 0, 5, 0], 5),
    ([(i * 37) % 11 for i in range(60)], 7),
])
def test_add_closes_buckets_as_bucket_bounds_does(sizes, limit, monkeypatch):
    """The buckets a Fusion fills as arrays arrive are bucket_bounds' groups
    of their sizes -- the groups empty_like makes its homes of, so arrays
    made there and added in order are reduced where they lie (before: add
    closed a bucket holding only empty arrays, and no home was ever used)."""
    import numpy as np
    from mpi4py import MPI

    from mpi_allreduce.fusion import Fusion

    groups, launch = [], Fusion._launch

    def record(self, key):
        groups.append([a.nbytes for a in self._open[key].arrays])
        launch(self, key)
    monkeypatch.setattr(Fusion, "_launch", record)
    fusion = Fusion(MPI.COMM_SELF, bucket_bytes=limit)
    arrays = [np.ones(n, np.uint8) for n in sizes]
    for a in arrays:
        fusion.add(a)
    fusion.wait()
    assert groups == [sizes[start:stop] for start, stop in bucket_bounds(sizes, limit)]
    fusion.free()


def test_an_array_added_twice_in_a_step_is_refused():
    """One array added twice between two waits would be reduced twice at
    once in the same memory (ranks got different values): the second add
    is refused, alike on every rank that makes it, and the step goes on."""
    import numpy as np
    from mpi4py import MPI

    from mpi_allreduce.fusion import Fusion

    fusion = Fusion(MPI.COMM_SELF, bucket_bytes=8)
    a = np.full(4, 2.0)
    fusion.add(a)
    with pytest.raises(ValueError, match="added already in this step"):
        fusion.add(a)
    fusion.wait()
    np.testing.assert_array_equal(a, np.full(4, 2.0))
    fusion.add(a)  # (the next step takes it again)
    fusion.wait()
    fusion.free()
