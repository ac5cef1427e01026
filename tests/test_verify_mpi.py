"""The verify harness itself: it must catch a wrong algorithm."""

from __future__ import annotations

import io

import pytest
from mpi4py import MPI

from mpi_allreduce import registry
from mpi_allreduce.algorithms import ring
from mpi_allreduce.schedule import RECV, Copy, Reduce, Ref
from mpi_allreduce.tools.verify import verify

pytestmark = pytest.mark.mpi


class _Broken:
    """A ring whose schedule ends with one corrupting action on one rank."""

    COMMUTATIVE = True

    def __init__(self, name, on_last_rank, corrupt):
        self.NAME, self.on_last_rank, self.corrupt = name, on_last_rank, corrupt

    def build(self, rank, size, count, segment_size, options=None):
        schedule = ring.build(rank, size, count, segment_size, options)
        target = size - 1 if self.on_last_rank else 0
        if rank != target or count < 2:
            return schedule._replace(algorithm=self.NAME)
        rounds = schedule.rounds + ((self.corrupt(),),)
        return schedule._replace(algorithm=self.NAME, rounds=rounds)


#: the last rank adds element 1 into element 0; rank 0 copies element 1 over element 0
OffByOneOnLastRank = _Broken("broken", True, lambda: Reduce(Ref(RECV, 0, 1), Ref(RECV, 0, 1),
                                                             Ref(RECV, 1, 1)))
DifferentBitsOnRank0 = _Broken("not_identical", False, lambda: Copy(Ref(RECV, 0, 1),
                                                                     Ref(RECV, 1, 1)))


@pytest.mark.parametrize("broken", [OffByOneOnLastRank, DifferentBitsOnRank0],
                         ids=["off_by_one_on_last_rank", "different_bits_on_rank0"])
def test_verify_counts_wrong_results(monkeypatch, broken):
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("one rank: no algorithm runs")
    monkeypatch.setitem(registry._ALGORITHMS, broken.NAME, broken)
    out = io.StringIO()
    bad = verify(MPI.COMM_WORLD, [broken.NAME], ["float64"], ["sum"], counts=[7], large=False,
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
