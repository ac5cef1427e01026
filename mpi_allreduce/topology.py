"""Where the ranks run: the node of every rank, and whether a node is oversubscribed.

Both are collective over the communicator and found once per communicator
(the :class:`~mpi_allreduce.context.Context` keeps them); the answers are
plain data that schedule builders and the selection read without MPI.
"""

from __future__ import annotations

import os
from typing import Optional

from mpi4py import MPI

__all__ = ["node_map", "oversubscribed", "LOCAL_SIZE_ENV"]

#: set by launchers to the number of the job's ranks on this node (Open MPI, MPICH's Hydra)
LOCAL_SIZE_ENV = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def node_map(comm: MPI.Intracomm, ranks_per_node: Optional[int] = None) -> tuple:
    """The node of every rank of ``comm`` (a tuple of length p; a node is
    named by its lowest rank).  Nodes come from
    ``Split_type(COMM_TYPE_SHARED)``; ``ranks_per_node`` groups consecutive
    ranks instead (the last group smaller), which emulates several nodes on
    one machine.  Collective unless ``ranks_per_node`` is given."""
    size = comm.Get_size()
    if ranks_per_node is not None:
        return tuple((r // ranks_per_node) * ranks_per_node for r in range(size))
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        lowest = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    return tuple(comm.allgather(lowest))


def oversubscribed(comm: MPI.Intracomm) -> bool:
    """Whether the node of any rank of ``comm`` runs more ranks than it has
    CPUs (collective over ``comm``).  All the job's ranks on a node compete
    for its CPUs, not only those in ``comm``: their number comes from the
    launcher where it says, else from the ranks of ``comm`` that share memory."""
    local = next((int(v) for v in map(os.environ.get, LOCAL_SIZE_ENV) if v and v.isdigit()),
                 None)
    if local is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        local = node.Get_size()
        node.Free()
    return bool(comm.allreduce(local > (os.cpu_count() or 1), op=MPI.LOR))
