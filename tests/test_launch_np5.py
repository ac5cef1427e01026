"""The MPI tests' launch at world size 5, of the tests on the ``comm``
fixture (sizes 5 and 4: tests/test_launch.py's docstring says why each
size).  A file of its own so that the serial session's other process runs
it (a file stays in one process) while tests/test_launch.py runs its own
launches one after another."""

from __future__ import annotations

from . import test_launch
from .test_launch import ELSEWHERE, launches, run_suite

pytestmark = test_launch.pytestmark  # (skipped where there is no mpiexec)


@launches(ELSEWHERE)
def test_mpi_suite(size, only, record_property):
    """The ``comm`` fixture's tests pass on every rank at this world size."""
    run_suite(size, only, record_property)
