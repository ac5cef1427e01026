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


#: rank 0: a Split that rank 1 never makes (raise mode, 1 s), given up on
#: while its thread stays inside MPI; both ranks then end
STUCK = """\
import os

os.environ["MPI_ALLREDUCE_WATCHDOG"] = "1"
os.environ["MPI_ALLREDUCE_WATCHDOG_ACTION"] = "raise"

from mpi4py import MPI

import mpi_allreduce as mar

world = MPI.COMM_WORLD
comm = world.Dup()
if world.Get_rank() == 0:
    try:
        mar.Comm(comm).Split(0, 0)
    except mar.Stalled:
        print("rank 0: Stalled", flush=True)
print(f"rank {world.Get_rank()}: ends", flush=True)
"""


def test_a_collective_left_inside_mpi_ends_its_process_without_finalize(tmp_path):
    """A collective with no non-blocking form, given up on while its thread
    is still inside MPI (a peer never came): MPI_Finalize under that thread
    is undefined (a peer's process was seen to crash there, in
    MPI_Comm_split_type), so the process leaves without it, saying why,
    with status 1; the other rank ends as usual."""
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    result = run_mpi(2, [sys.executable, str(script)], timeout=90, cwd=str(ROOT))
    out = result.stdout
    assert "rank 0: Stalled" in out and "rank 1: ends" in out, out[-3000:]
    assert "leaving without MPI_Finalize: an earlier collective on this communicator " \
        "(MPI_Comm_split)" in out, out[-3000:]
    assert result.returncode != 0 and "Segmentation fault" not in out, out[-3000:]


#: rank 0: interrupted (a timer) in the first call on a drop-in Comm, before
#: its set-up's node map; rank 1 comes late, its set-up stalls (raise mode,
#: 2 s) with its thread inside MPI_Comm_split_type; both then set up and use
#: a second communicator, and end
SET_UP_STUCK = """\
import os
import signal
import time

os.environ["MPI_ALLREDUCE_WATCHDOG"] = "2"
os.environ["MPI_ALLREDUCE_WATCHDOG_ACTION"] = "raise"

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce.context import context_for


def interrupt(*_):
    raise KeyboardInterrupt


signal.signal(signal.SIGALRM, interrupt)
world = MPI.COMM_WORLD
rank = world.Get_rank()
comm = mar.Comm(world.Dup())
if rank == 0:
    signal.setitimer(signal.ITIMER_REAL, 0.5)
else:
    time.sleep(1.5)
try:
    comm.Allreduce(np.ones(4), np.zeros(4))
except (KeyboardInterrupt, mar.Stalled) as exc:
    print(f"rank {rank}: {type(exc).__name__}", flush=True)
other = mar.Comm(world.Dup())
out = np.zeros(3)
other.Allreduce(np.ones(3), out)
print(f"rank {rank}: other {out.tolist()} {type(context_for(other).comm).__name__}",
      flush=True)
"""


def test_a_set_up_left_inside_mpi_ends_its_process_without_finalize(tmp_path):
    """A drop-in Comm's set-up given up on while its thread is inside
    MPI_Comm_split_type, then a second communicator set up and used: the
    process still leaves without MPI_Finalize, saying why (before: the
    library's duplicate of a drop-in Comm was itself a drop-in Comm, so its
    node map ran the drop-in's Split_type on a thread inside the set-up's
    thread, whose return cleared the record of the inner one -- then
    MPI_Finalize under it, a segmentation fault)."""
    script = tmp_path / "set_up_stuck.py"
    script.write_text(SET_UP_STUCK)
    result = run_mpi(2, [sys.executable, str(script)], timeout=90, cwd=str(ROOT))
    out = result.stdout
    assert "rank 0: KeyboardInterrupt" in out and "rank 1: Stalled" in out, out[-3000:]
    assert "rank 0: other [2.0, 2.0, 2.0] Intracomm" in out, out[-3000:]
    assert "rank 1: other [2.0, 2.0, 2.0] Intracomm" in out, out[-3000:]
    assert "rank 1: leaving without MPI_Finalize" in out, out[-3000:]
    assert "Segmentation fault" not in out and result.returncode == 1, out[-3000:]


#: rank 1: an interrupt as the library starts its progress thread (the first
#: call of the process handed to it: a persistent or non-blocking call of
#: many rounds on ``first``), then the start again; then both ranks make the
#: same kind of call on two other communicators, set up before
THREAD_START = """\
import os
import sys
import threading

os.environ["MPI_ALLREDUCE_WATCHDOG"] = "2"
os.environ["MPI_ALLREDUCE_WATCHDOG_ACTION"] = "raise"

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar

kind = sys.argv[1]
world = MPI.COMM_WORLD
rank = world.Get_rank()
first, second, third = world.Dup(), world.Dup(), world.Dup()
for comm in (first, second, third):
    mar.setup(comm)
start = threading.Thread.start


def interrupted(thread):
    threading.Thread.start = start  # (once)
    raise KeyboardInterrupt("lands as the thread starts")


if rank == 1:
    threading.Thread.start = interrupted


def call(comm, value):
    send, recv = np.full(100_000, float(value)), np.empty(100_000)
    options = dict(comm=comm, algorithm="ring", segment_size=1000)
    if kind == "persistent":
        request = mar.allreduce_init(send, recv, **options)
    else:
        request = None
    for attempt in range(2):
        try:
            if request is None:
                mar.iallreduce(send, recv, **options).wait()
            else:
                request.start()
                request.wait()
            return "exact" if (recv == 2.0 * value).all() else "WRONG"
        except mar.Broken as exc:
            return type(exc).__name__
        except KeyboardInterrupt:
            outcomes.append("interrupted")
    return "interrupted twice"


outcomes = []
outcomes.append(call(first, 1))
world.Barrier()
outcomes += [call(second, 2), call(third, 3)]
print(f"rank {rank}: {outcomes}", flush=True)
"""


@pytest.mark.parametrize("kind", ["persistent", "iallreduce"])
def test_an_interrupt_as_the_progress_thread_starts_breaks_one_communicator(tmp_path, kind):
    """The progress thread is the process's, not a communicator's: an
    interrupt as it starts breaks the communicator of the call that started
    it (its start again raises Broken, its peer stalls) and no other -- the
    next call handed over starts the thread (before: a thread that never ran
    was kept, every later non-blocking or persistent call of the process
    waited for it, and the watchdog reported them; a persistent call's start
    again raised RequestError, "still active")."""
    script = tmp_path / "thread_start.py"
    script.write_text(THREAD_START)
    result = run_mpi(2, [sys.executable, str(script), kind], timeout=90, cwd=str(ROOT))
    out = result.stdout
    assert "rank 1: ['interrupted', 'Broken', 'exact', 'exact']" in out, out[-3000:]
    assert "rank 0: ['Stalled', 'exact', 'exact']" in out, out[-3000:]


#: rank 0's user-defined MPI.Op sends its process a signal, whose handler
#: raises KeyboardInterrupt, at its n-th application, then goes on in Python
#: for 0.2 s (where a handler would run, were the function on the main
#: thread); each case on a communicator of its own, two calls each; then a
#: last communicator's all-reduce
USER_OP = """\
import os
import signal
import time

os.environ["MPI_ALLREDUCE_WATCHDOG"] = "2"
os.environ["MPI_ALLREDUCE_WATCHDOG_ACTION"] = "raise"
os.environ["MPI_ALLREDUCE_PROGRESS"] = "caller"  # (waits advance every call of the caller's)

import numpy as np
from mpi4py import MPI

import mpi_allreduce as mar

world = MPI.COMM_WORLD
rank = world.Get_rank()
signal.signal(signal.SIGUSR1, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt("signal")))
vector = MPI.DOUBLE.Create_vector(3, 1, 2).Commit()
applied = [0, 0]  # (applications so far, the one that signals)


def add(inbuf, inoutbuf, datatype):
    applied[0] += 1
    if rank == 0 and applied[0] == applied[1]:
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(20):
            time.sleep(0.01)
    a, b = np.frombuffer(inbuf, np.float64), np.frombuffer(inoutbuf, np.float64)
    b[::2] += a[::2]


op = MPI.Op.Create(add, commute=True)


def library(comm, x, y):
    y[...] = mar.allreduce(x, op=op, comm=comm, algorithm="ring")


def persistent(comm, x, y):
    request = comm.Allreduce_init([x, 1, vector], [y, 1, vector], op)
    request.Start()
    request.Wait()
    request.Free()


CASES = {  # (name: the call, the application that signals)
    "the planning probe": (library, 1),
    "the library's reduction": (library, 2),
    "MPI's Allreduce": (lambda comm, x, y: comm.Allreduce([x, 1, vector], [y, 1, vector], op), 2),
    "MPI's Iallreduce": (lambda comm, x, y: comm.Iallreduce([x, 1, vector], [y, 1, vector],
                                                           op).Wait(), 2),
    "MPI's Allreduce_init": (persistent, 2),
}
for name, (call, signals) in CASES.items():
    comm = mar.Comm(world.Dup())
    mar.setup(comm)
    applied[:] = [0, signals]
    outcomes = []
    for attempt in range(2):
        x, y = np.arange(5.0) + 1 + rank, np.zeros(5)
        try:
            call(comm, x, y)
            outcomes.append("exact" if y[::2].tolist() == [3.0, 7.0, 11.0] else "WRONG")
        except BaseException as exc:
            outcomes.append(type(exc).__name__)
    print(f"rank {rank}: {name}: {outcomes}", flush=True)
    world.Barrier()

# MPI's Allreduce while a call of the library's own is in flight on another
# communicator: the wait advances that call too, where MPI may apply the op
other, comm = world.Dup(), mar.Comm(world.Dup())
mar.setup(other)
mar.setup(comm)
applied[:] = [0, 2]
big, outcomes = np.full(1 << 16, rank + 1.0), []
x, y = np.arange(5.0) + 1 + rank, np.zeros(5)
if rank == 0:
    pending = mar.iallreduce(big, comm=other, algorithm="ring")
    try:
        comm.Allreduce([x, 1, vector], [y, 1, vector], op)
        outcomes.append("exact" if y[::2].tolist() == [3.0, 7.0, 11.0] else "WRONG")
    except BaseException as exc:
        outcomes.append(type(exc).__name__)
else:
    request = comm.Iallreduce([x, 1, vector], [y, 1, vector], op)
    time.sleep(0.5)
    pending = mar.iallreduce(big, comm=other, algorithm="ring")
    try:
        request.Wait()
        outcomes.append("exact" if y[::2].tolist() == [3.0, 7.0, 11.0] else "WRONG")
    except BaseException as exc:
        outcomes.append(type(exc).__name__)
outcomes.append("the other exact" if (pending.wait() == 3.0).all() else "the other WRONG")
print(f"rank {rank}: beside another call: {outcomes}", flush=True)
world.Barrier()
print(f"rank {rank}: then {mar.allreduce(np.ones(3), comm=world.Dup()).tolist()}", flush=True)
"""


def test_an_interrupt_while_a_user_mpi_op_runs_breaks_the_communicator(tmp_path):
    """A signal handler's KeyboardInterrupt that lands while the Python
    function of a user-defined MPI.Op runs -- in the library's planning
    probe, in its reduction, in MPI's own collective of the drop-in Comm
    (blocking, non-blocking, persistent; and blocking while a call of the
    library's own is in flight, whose progress in the same wait may apply
    the op) -- is raised by the call once the function has returned: the
    communicator is broken, the peer's next call stalls (reported), another
    communicator is exact.  Before, the handler
    raised inside the function, where mpi4py cannot raise: "Fatal Python
    error: exception in user-defined reduction operation" and MPI_Abort."""
    script = tmp_path / "user_op.py"
    script.write_text(USER_OP)
    result = run_mpi(2, [sys.executable, str(script)], timeout=120, cwd=str(ROOT))
    out = result.stdout
    assert "Fatal Python error" not in out and result.returncode == 0, out[-3000:]
    for case in ("the planning probe", "the library's reduction", "MPI's Allreduce",
                 "MPI's Iallreduce", "MPI's Allreduce_init"):
        assert f"rank 0: {case}: ['KeyboardInterrupt', 'Broken']" in out, out[-3000:]
        # (rank 1: the call's sum, where rank 0's application of the op completed
        # it, or a stall; its second call stalls)
        assert any(f"rank 1: {case}: ['{first}', 'Stalled']" in out
                   for first in ("exact", "Stalled")), out[-3000:]
    assert "rank 0: beside another call: ['KeyboardInterrupt', 'the other exact']" in out, \
        out[-3000:]
    assert any(f"rank 1: beside another call: ['{first}', 'the other exact']" in out
               for first in ("exact", "Stalled")), out[-3000:]
    assert "rank 0: then [2.0, 2.0, 2.0]" in out and "rank 1: then [2.0, 2.0, 2.0]" in out, \
        out[-3000:]
