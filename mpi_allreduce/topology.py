"""Where the ranks run: the node of every rank, and whether a node is oversubscribed.

:func:`placement` finds both at once, collectively and watched (the
:class:`~mpi_allreduce.context.Context` finds them where a communicator is
set up, with :func:`where` and an exchange of its own); :func:`on_node`
gives a rank its place on its node (device selection, ``info``, ``bench``,
the torch backend's ``LOCAL_RANK``).  All of them split the communicator
by node in :func:`node_comm` alone, watched, and free what they split;
:func:`emulated_nodes` is the pure arithmetic of emulated nodes.  The
answers are plain data that schedule builders and the selection read
without MPI, agreed by every rank: no rank decides from what it alone sees.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
from mpi4py import MPI

from .engine import blocking_collective, wait_for

__all__ = ["placement", "where", "on_node", "node_comm", "emulated_nodes", "oversubscribed",
           "LOCAL_SIZE_ENV"]

#: set by launchers to the number of the job's ranks on this node (Open MPI, MPICH's Hydra)
LOCAL_SIZE_ENV = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def emulated_nodes(size: int, ranks_per_node: int) -> tuple:
    """The node of every rank when consecutive ranks are grouped into nodes
    of ``ranks_per_node`` (the last smaller): a node is named by its lowest rank."""
    return tuple((r // ranks_per_node) * ranks_per_node for r in range(size))


def where(comm: MPI.Intracomm, what: str = "where the ranks run", context=None) -> tuple:
    """This rank's part of :func:`placement`: (the lowest rank of ``comm``
    on its node, whether its node runs more of the job's ranks than it has
    CPUs).  Collective over ``comm`` (:func:`node_comm`, watched), with no
    answer agreed yet: :func:`placement`, or a caller's own exchange, agrees.

    All the job's ranks on a node compete for its CPUs, not only those in
    ``comm``: their number comes from the launcher where it says, else
    from the ranks of ``comm`` that share memory."""
    with node_comm(comm, what, context) as node:
        mine, whole = node.Get_group(), comm.Get_group()
        lowest = MPI.Group.Translate_ranks(mine, [0], whole)[0]
        mine.Free()
        whole.Free()
        local = next((int(v) for v in map(os.environ.get, LOCAL_SIZE_ENV) if v and v.isdigit()),
                     node.Get_size())
    return lowest, local > (os.cpu_count() or 1)


def on_node(comm: MPI.Intracomm, what: str = "where the ranks run", context=None) -> tuple:
    """(this rank's index among the ranks of ``comm`` on its node, in the
    order of ``comm``; how many ranks of ``comm`` that node runs).
    Collective over ``comm`` (:func:`node_comm`)."""
    with node_comm(comm, what, context) as node:
        return node.Get_rank(), node.Get_size()


@contextlib.contextmanager
def node_comm(comm: MPI.Intracomm, what: str = "where the ranks run", context=None):
    """The ranks of ``comm`` on this rank's node, as a communicator
    ranked in the order of ``comm`` (``Split_type(COMM_TYPE_SHARED)``),
    for the ``with`` block; freed when it ends, however it ends.
    Collective over ``comm``.

    ``Split_type`` has no non-blocking form, so it is waited for as
    :func:`~mpi_allreduce.engine.blocking_collective` waits (``what`` names
    it, ``context`` is broken if it stalls): a rank that never comes is
    reported, not waited for inside MPI."""
    node = blocking_collective(
        comm, lambda: MPI.Intracomm.Split_type(comm, MPI.COMM_TYPE_SHARED, key=comm.Get_rank()),
        what, context)
    try:
        yield node
    finally:
        node.Free()


def placement(comm: MPI.Intracomm, what: str = "where the ranks run", context=None) -> tuple:
    """(the node of every rank of ``comm``, whether any rank's node runs
    more of the job's ranks than it has CPUs): collective over ``comm``,
    every rank the same answer (:func:`where`, then one watched
    ``MPI_Iallgather``).  A node is named by its lowest rank."""
    record = np.array(where(comm, what, context), dtype=np.int64)
    everyone = np.empty((comm.Get_size(), 2), dtype=np.int64)
    wait_for([comm.Iallgather(record, everyone)], what, context)
    return tuple(int(n) for n in everyone[:, 0]), bool(everyone[:, 1].any())


def oversubscribed(comm: MPI.Intracomm) -> bool:
    """Whether the node of any rank of ``comm`` runs more ranks than it has
    CPUs (collective over ``comm``: :func:`placement`)."""
    return placement(comm)[1]
