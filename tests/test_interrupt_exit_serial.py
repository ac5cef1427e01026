"""A job whose rank 0 is interrupted inside a call while its peer comes late
ends cleanly: what the interrupted call's messages may still be read from is
kept past Python's own end, since a late peer matches rank 0's send only
inside ``MPI_Finalize`` (which mpi4py calls after Python has freed its
objects).  Before, the send read freed memory there: a segmentation fault at
exit, and the peer killed unreported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpi_allreduce.launch import find_mpiexec, run_mpi

ROOT = Path(__file__).resolve().parent.parent

#: rank 0: interrupted (a KeyboardInterrupt from a timer) 0.3 s into a call
#: of 1 MiB whose peer comes after 1 s, then refused (Broken), then it ends;
#: rank 1: the call (its sum, or a stall: rank 0 left), then it ends
SCRIPT = """\
import os
import signal
import sys
import time

os.environ["MPI_ALLREDUCE_WATCHDOG"] = "3"
os.environ["MPI_ALLREDUCE_WATCHDOG_ACTION"] = "raise"

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar

kind, algorithm = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
comm = world.Dup()
mar.setup(comm)


def interrupt(signum, frame):
    raise KeyboardInterrupt("timer")


signal.signal(signal.SIGALRM, interrupt)
n = 1 << 17
outcomes = []
for attempt in range(2):
    x = np.arange(n, dtype=np.float64) % 1000 + rank + 10 * attempt
    if attempt == 0:
        if rank == 0:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
        else:
            time.sleep(1.0)
    try:
        if kind == "allreduce":
            mar.allreduce(x, comm=comm, algorithm=algorithm)
        else:
            mar.reduce_scatter(x, None, "sum", comm=comm, algorithm=algorithm)
        outcomes.append("returned")
    except BaseException as exc:
        outcomes.append(type(exc).__name__)
print(f"rank {rank}: {outcomes}", flush=True)
"""

pytestmark = pytest.mark.skipif(
    find_mpiexec() is None,
    reason="no mpiexec found: pip install 'mpi_allreduce[mpi]' (bundled Open MPI) "
           "or load your site's MPI module",
)


@pytest.mark.parametrize("kind,algorithm", [("allreduce", "ring"),
                                            ("allreduce", "recursive_doubling"),
                                            ("reduce_scatter", "ring")])
def test_an_interrupted_call_whose_peer_comes_late_ends_the_job_cleanly(tmp_path, kind,
                                                                        algorithm):
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT)
    result = run_mpi(2, [sys.executable, str(script), kind, algorithm], timeout=90,
                     cwd=str(ROOT))
    out = result.stdout
    assert "rank 0: ['KeyboardInterrupt', 'Broken']" in out, out[-3000:]
    assert "rank 1: [" in out, out[-3000:]
    assert "Segmentation fault" not in out and result.returncode == 0, out[-3000:]
