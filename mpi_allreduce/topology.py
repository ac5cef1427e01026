"""Where the ranks run: the node of every rank, and whether a node is oversubscribed.

:func:`placement` finds both at once, collectively and watched (the
:class:`~mpi_allreduce.context.Context` finds them where a communicator is
set up, with :func:`where` and an exchange of its own);
:func:`emulated_nodes` is the pure arithmetic of emulated nodes.  The answers are plain data that schedule builders and the
selection read without MPI, agreed by every rank: no rank decides from
what it alone sees.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from .engine import wait_for

__all__ = ["placement", "where", "emulated_nodes", "oversubscribed", "LOCAL_SIZE_ENV"]

#: set by launchers to the number of the job's ranks on this node (Open MPI, MPICH's Hydra)
LOCAL_SIZE_ENV = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def emulated_nodes(size: int, ranks_per_node: int) -> tuple:
    """The node of every rank when consecutive ranks are grouped into nodes
    of ``ranks_per_node`` (the last smaller): a node is named by its lowest rank."""
    return tuple((r // ranks_per_node) * ranks_per_node for r in range(size))


def where(comm: MPI.Intracomm, what: str = "where the ranks run", context=None) -> tuple:
    """This rank's part of :func:`placement`: (the lowest rank of ``comm``
    on its node, whether its node runs more of the job's ranks than it has
    CPUs).  Collective over ``comm`` (``Split_type``), with no answer
    agreed yet: :func:`placement`, or a caller's own exchange, agrees.

    ``Split_type(COMM_TYPE_SHARED)`` has no non-blocking form, so the
    ranks first meet in a watched ``MPI_Ibarrier``: a rank that never comes
    is reported there, not waited for inside MPI.  All the job's ranks on a
    node compete for its CPUs, not only those in ``comm``: their number
    comes from the launcher where it says, else from the ranks of ``comm``
    that share memory."""
    wait_for([comm.Ibarrier()], what, context)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        mine, whole = node.Get_group(), comm.Get_group()
        lowest = MPI.Group.Translate_ranks(mine, [0], whole)[0]
        mine.Free()
        whole.Free()
        local = next((int(v) for v in map(os.environ.get, LOCAL_SIZE_ENV) if v and v.isdigit()),
                     node.Get_size())
    finally:
        node.Free()
    return lowest, local > (os.cpu_count() or 1)


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
