"""The two ring halves on their own (reduce-scatter, allgather), as
schedules: every rank's schedules run against each other in the simulator
(:func:`mpi_allreduce.simulate.execute`: rendezvous messages, matching and
race checks) and every element compared with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_allreduce.algorithms.ring import blocks_of, build_allgather, build_reduce_scatter
from mpi_allreduce.schedule import Copy
from mpi_allreduce.simulate import execute

SIZES = [1, 2, 3, 5, 7, 8]


def count_cases(p: int) -> list:
    """Even blocks, empty blocks, uneven blocks, one long block."""
    return [tuple([3] * p), tuple(range(p)), tuple((7 * i + 2) % 5 for i in range(p)),
            tuple(11 if i == p // 2 else 0 for i in range(p))]


def case_id(counts) -> str:
    return "-".join(map(str, counts))


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("segment", [1, 2, 1 << 10], ids=lambda s: f"seg{s}")
@pytest.mark.parametrize("p", SIZES, ids=lambda p: f"p{p}")
def test_reduce_scatter_schedule(p, segment, in_place):
    """In place, ``SEND`` and ``RECV`` are one array (the whole vector, the
    result left at its start); out of place, ``RECV`` is the block alone."""
    for counts in count_cases(p):
        n = sum(counts)
        scheds = [build_reduce_scatter(r, p, counts, segment, in_place) for r in range(p)]
        inputs = [np.arange(n, dtype=np.int64) * (r + 1) + r * r for r in range(p)]
        arrays = []
        for r, s in enumerate(scheds):
            scratch = np.zeros(max(s.scratch, 1), np.int64)
            if in_place:
                whole = inputs[r].copy()
                arrays.append((whole, whole, scratch))
            else:
                arrays.append((inputs[r], np.full(counts[r], -1, np.int64), scratch))
        execute(scheds, arrays, label=case_id(counts))
        total = sum(inputs)
        for r, block in enumerate(blocks_of(counts)):
            np.testing.assert_array_equal(arrays[r][1][:counts[r]], total[block.offset:block.stop],
                                          err_msg=f"rank {r}, counts {counts}")
        if not in_place:  # the block reduced where it belongs: no copy
            assert not any(isinstance(a, Copy) for s in scheds for rnd in s.rounds for a in rnd
                           if p > 1)


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("segment", [1, 2, 1 << 10], ids=lambda s: f"seg{s}")
@pytest.mark.parametrize("p", SIZES, ids=lambda p: f"p{p}")
def test_allgather_schedule(p, segment, in_place):
    for counts in count_cases(p):
        n = sum(counts)
        full = np.arange(n, dtype=np.float64) * 3 + 1
        blocks = blocks_of(counts)
        scheds = [build_allgather(r, p, counts, segment, in_place) for r in range(p)]
        arrays = []
        for r, (s, block) in enumerate(zip(scheds, blocks)):
            recv = np.full(n, np.nan)
            mine = full[block.offset:block.stop].copy()
            if in_place:
                recv[block.offset:block.stop] = mine
            arrays.append((recv if in_place else mine, recv, np.zeros(max(s.scratch, 1))))
        execute(scheds, arrays, label=case_id(counts))
        for r in range(p):
            np.testing.assert_array_equal(arrays[r][1], full, err_msg=f"rank {r}, counts {counts}")


def test_reduce_scatter_sends_each_element_once_per_step():
    """The ring's cost: each rank sends (p-1)/p of the vector (even blocks)."""
    p, counts = 5, (4,) * 5
    for r in range(p):
        assert build_reduce_scatter(r, p, counts, 1 << 10).sent() == 4 * (p - 1)
        assert build_allgather(r, p, counts, 1 << 10, False).sent() == 4 * (p - 1)
