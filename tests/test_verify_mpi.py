"""The verify harness itself: it must catch a wrong algorithm."""

from __future__ import annotations

import io

import numpy as np
import pytest
from mpi4py import MPI

from mpi_allreduce import registry
from mpi_allreduce.algorithms.ring import Ring
from mpi_allreduce.verify import verify

pytestmark = pytest.mark.mpi


class OffByOneOnLastRank(Ring):
    """A ring that corrupts one element on the last rank."""

    name = "broken"

    def __call__(self, send, buf):
        super().__call__(send, buf)
        if self.plan.rank == self.plan.size - 1 and buf.shape[0]:
            buf[0] += 1


class DifferentBitsOnRank0(Ring):
    """A ring whose result is right within tolerance but not bit-identical."""

    name = "not_identical"

    def __call__(self, send, buf):
        super().__call__(send, buf)
        if self.plan.rank == 0 and buf.shape[0]:
            buf[0] = np.nextafter(buf[0], np.inf)


@pytest.mark.parametrize("broken", [OffByOneOnLastRank, DifferentBitsOnRank0])
def test_verify_counts_wrong_results(monkeypatch, broken):
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank: no algorithm runs")
    monkeypatch.setitem(registry._ALGORITHMS, broken.name, broken)
    out = io.StringIO()
    bad = verify(MPI.COMM_WORLD, [broken.name], ["float64"], ["sum"], counts=[7], large=False,
                 out=out)
    assert bad > 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "FAILED" in out.getvalue()


def test_verify_passes_a_correct_algorithm():
    out = io.StringIO()
    assert verify(MPI.COMM_WORLD, ["ring"], ["int64"], ["sum", "bxor"], counts=[0, 9],
                  large=False, out=out) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "# OK:" in out.getvalue()
