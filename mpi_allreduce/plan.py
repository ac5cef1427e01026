"""Plans and the per-communicator context.

A :class:`Plan` fixes everything about one kind of call -- communicator,
count, dtype, op, backend, segment size -- and owns the scratch memory the
algorithm needs; algorithms are built once per plan and run many times.

Plans live in a :class:`Context` cached as an attribute of the caller's
communicator.  The context holds the library's own duplicate of that
communicator (so a caller's pending receives never match library messages),
the sub-communicators the hierarchical algorithm splits off, and a bounded
cache of plans.  Freeing the caller's communicator frees all of it.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .backend import Backend
from .ops import Op

__all__ = ["Plan", "Context", "context_for", "oversubscribed", "wire_type"]

#: plans kept per communicator (least recently used ones are dropped)
MAX_PLANS = 64
#: tag of every library message (the library's communicator is private)
TAG = 0x6172


@functools.lru_cache(maxsize=None)
def wire_type(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype messages of ``dtype`` travel as: the matching
    predefined type, or raw bytes where the MPI has none (float16, say)."""
    mpitype = MPI._typedict.get(np.dtype(dtype).char)
    if mpitype is None or mpitype == MPI.DATATYPE_NULL or mpitype.Get_size() != dtype.itemsize:
        return MPI.BYTE
    return mpitype


class Plan:
    """Everything fixed about one kind of all-reduce call, plus its scratch."""

    def __init__(
        self,
        context: "Context",
        comm: MPI.Intracomm,
        count: int,
        dtype: np.dtype,
        op: Op,
        backend: Backend,
        segment_size: int,
        options: Optional[dict] = None,
    ):
        self.context = context
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.count = count
        self.dtype = np.dtype(dtype)
        self.op = op
        self.backend = backend
        self.segment_size = segment_size
        self.options = dict(options or {})
        self.mpitype = wire_type(self.dtype)
        #: ``combine(first, second, out=out)``: ``out = first OP second`` in place,
        #: ``first`` from the lower rank; the op's ufunc itself, called directly
        self.combine = backend.ufunc(op.ufunc)
        #: ``sendrecv(send, dest, recv, source)``: send ``send`` to ``dest``
        #: while receiving ``recv`` from ``source``; either side may be None
        #: (nothing to send or receive this step)
        self.sendrecv = backend.channel(comm, self.mpitype, TAG)
        self._scratch: dict[str, object] = {}

    # --- memory -----------------------------------------------------------
    def scratch(self, name: str, count: int):
        """A 1-D scratch array of ``count`` elements, allocated once per plan."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < count:
            buf = self.backend.empty(max(count, 1), self.dtype)
            self._scratch[name] = buf
        return buf[:count]

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch this plan holds (the staging buffers not included)."""
        return sum(b.nbytes for b in self._scratch.values())

    # --- messaging and reduction -----------------------------------------
    def exchange(self, peer: int, pairs: list, src, buf, incoming) -> None:
        """One step's messages with ``peer``, a segment at a time.

        Per message of ``pairs`` (:func:`~mpi_allreduce.partition.exchange_pairs`)
        the ``sent`` range of ``src`` goes to the peer while the peer's copy
        of the ``kept`` one arrives in ``incoming`` and is combined with this
        rank's (from ``src``) into ``buf``, the lower rank's operand first.
        Sent and kept ranges do not overlap, or are the same one (sent
        before it is overwritten).  So the scratch is one segment.
        """
        lower, combine, sendrecv = peer < self.rank, self.combine, self.sendrecv
        for sent, kept, into in pairs:
            arrived = incoming[into] if into is not None else None
            sendrecv(src[sent] if sent is not None else None, peer, arrived, peer)
            if kept is None:
                continue
            if lower:
                combine(arrived, src[kept], out=buf[kept])
            else:
                combine(src[kept], arrived, out=buf[kept])

    def post(self, send, dest: int, recv, source: int, slot: int = 0):
        """Nonblocking ``sendrecv``; returns a handle with ``wait()``."""
        return self.backend.post(self.comm, send, dest, recv, source, self.mpitype, TAG, slot)

    def derive(self, comm: MPI.Intracomm, **options) -> "Plan":
        """The same call on another (sub-)communicator."""
        return Plan(self.context, comm, self.count, self.dtype, self.op, self.backend,
                    self.segment_size, options)


#: called with a context when it is freed (to drop what refers to its plans)
ON_FREE: list = []


class Context:
    """The library's state for one caller communicator."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm.Dup()
        #: some node runs more of these ranks than it has CPUs (``auto`` may
        #: then choose differently); agreed by all ranks, found once
        self.oversubscribed = oversubscribed(self.comm)
        self.plans: "OrderedDict[tuple, Callable]" = OrderedDict()
        self.subcomms: dict[tuple, tuple] = {}

    def get_plan(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        runner = self.plans.get(key)
        if runner is None:
            runner = build()
            self.plans[key] = runner
            while len(self.plans) > MAX_PLANS:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        return runner

    def node_comms(self, ranks_per_node: Optional[int]) -> tuple:
        """(node communicator, leader communicator or None), split once.

        Nodes come from ``Split_type(COMM_TYPE_SHARED)``; ``ranks_per_node``
        overrides that with consecutive groups of that many ranks (the last
        one smaller), which emulates several nodes on one machine.
        """
        key = ("nodes", ranks_per_node)
        comms = self.subcomms.get(key)
        if comms is None:
            comm = self.comm
            if ranks_per_node is None:
                node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
            else:
                node = comm.Split(comm.Get_rank() // ranks_per_node, comm.Get_rank())
            is_leader = node.Get_rank() == 0
            leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, comm.Get_rank())
            if leaders == MPI.COMM_NULL:
                leaders = None
            comms = (node, leaders)
            self.subcomms[key] = comms
        return comms

    def free(self) -> None:
        for hook in ON_FREE:
            hook(self)
        self.plans.clear()
        for node, leaders in self.subcomms.values():
            node.Free()
            if leaders is not None:
                leaders.Free()
        self.subcomms.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


#: set by launchers to the number of the job's ranks on this node (Open MPI, MPICH's Hydra)
LOCAL_SIZE_ENV = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


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


def _delete_context(comm, keyval, context) -> None:
    if not MPI.Is_finalized():
        context.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_context)


def context_for(comm: MPI.Intracomm) -> Context:
    """The cached context of ``comm`` (collective the first time: it Dups)."""
    context = comm.Get_attr(_KEYVAL)
    if context is None:
        context = Context(comm)
        comm.Set_attr(_KEYVAL, context)
    return context


def release(comm: MPI.Intracomm) -> None:
    """Free the library's duplicate communicators and plans for ``comm`` now."""
    if comm.Get_attr(_KEYVAL) is not None:
        comm.Delete_attr(_KEYVAL)
