"""Every MPI call of the library that can wait is watched, by construction:
this reads the package's source and fails on a blocking MPI call (a
collective, a point-to-point call, a wait, a communicator constructor)
that is not one of the few below, each with the reason it is watched.

Watched means: posted non-blocking and waited for by
:func:`~mpi_allreduce.engine.wait_for` (the requests) or
:func:`~mpi_allreduce.engine.wait_for_call` (a call with no non-blocking
form, passed as a ``lambda``), or inside a call whose progress the
watchdog samples.  ``mpi_allreduce/tools/`` is left out: ``bench``,
``verify``, ``tune`` and the model's calibration time and check the MPI
library's own blocking calls, which are what they measure; and so is
``mpi_allreduce/examples/``, the user's side of the API."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mpi_allreduce"
LEFT_OUT = ("tools", "examples")

#: mpi4py's calls that can wait for another rank (or for a request)
BLOCKING = {
    "allreduce", "bcast", "gather", "allgather", "scatter", "alltoall", "barrier", "reduce",
    "send", "recv", "sendrecv", "ssend", "probe", "mprobe", "scan", "exscan",
    "Allreduce", "Bcast", "Gather", "Gatherv", "Allgather", "Allgatherv", "Scatter",
    "Scatterv", "Alltoall", "Alltoallv", "Alltoallw", "Barrier", "Reduce", "Reduce_scatter",
    "Reduce_scatter_block", "Send", "Recv", "Sendrecv", "Sendrecv_replace", "Ssend", "Rsend",
    "Bsend", "Probe", "Mprobe", "Dup", "Split", "Split_type", "Create", "Create_group",
    "Create_cart", "Create_graph", "Wait", "Waitall", "Waitany", "Waitsome", "Scan", "Exscan",
    "Accept", "Connect", "Merge", "Spawn", "Neighbor_allgather", "Neighbor_alltoall", "Fence",
}
#: receivers that are the library's own functions of the same names, not MPI
LIBRARY = {"api", "collectives", "reproducible", "ph", "self", "threading"}
#: (file, the call) -> why it is watched
ALLOWED = {
    ("engine.py", "MPI.Request.Waitall"): "the engine's wait loop: what the watchdog watches",
    ("engine.py", "MPI.Request.Waitany"): "the engine's wait loop",
    ("engine.py", "wake.Wait"): "the progress thread's wake-up, a message to itself",
    ("engine.py", "MPI.COMM_SELF.Dup"): "the progress thread's own COMM_SELF: no peer",
    ("backend.py", "MPI.Request.Waitall"):
        "a stage's messages, waited for inside a call the watchdog samples",
    ("topology.py", "MPI.Intracomm.Split_type"): "behind a watched MPI_Ibarrier (node_comm)",
    ("comm.py", "MPI.Intracomm.Split"): "behind a watched MPI_Ibarrier",
    ("comm.py", "MPI.Intracomm.Split_type"): "behind a watched MPI_Ibarrier",
    ("comm.py", "MPI.Intracomm.Create"): "behind a watched MPI_Ibarrier",
}


def _unwatched(path: Path) -> list:
    """(line, call) of every blocking MPI call in ``path`` outside
    :func:`wait_for_call`'s lambdas and :data:`ALLOWED`."""
    tree = ast.parse(path.read_text(), str(path))
    inside_calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "wait_for_call":
            for argument in node.args[:1]:
                if isinstance(argument, ast.Lambda):
                    inside_calls.update(id(n) for n in ast.walk(argument.body))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        call, receiver = ast.unparse(node.func), ast.unparse(node.func.value)
        if (node.func.attr in BLOCKING and receiver not in LIBRARY and id(node) not in inside_calls
                and (path.name, call) not in ALLOWED):
            found.append((node.lineno, call))
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).parts[0] not in LEFT_OUT)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_mpi_call_that_can_wait_is_watched(path):
    found = _unwatched(path)
    assert not found, (f"{path.name}: MPI calls that can wait, not watched: "
                       + ", ".join(f"line {line}: {call}" for line, call in found)
                       + " (post the non-blocking form and wait_for it, or wait_for_call)")


def test_the_check_finds_what_it_looks_for(tmp_path):
    """The reading itself: a blocking call is found, the same call inside
    wait_for_call's lambda and a library function of an MPI name are not."""
    source = tmp_path / "sample.py"
    source.write_text("def f(comm, members):\n"
                      "    comm.allgather(1)\n"
                      "    wait_for_call(lambda: comm.Create_group(members), 'x')\n"
                      "    comm.Create_group(members)\n"
                      "    api.allreduce(1)\n")
    assert _unwatched(source) == [(2, "comm.allgather"), (4, "comm.Create_group")]


@pytest.mark.parametrize("name,call", sorted(ALLOWED))
def test_every_exception_is_still_there(name, call):
    """An exception for a call the code no longer makes is removed, not kept."""
    assert f"{call}(" in "".join(p.read_text() for p in PACKAGE.rglob(name)), (name, call)
