"""A ``torch.distributed`` backend on this library, for training with pip alone.

``import mpi_allreduce.torch`` registers a backend named ``mpi_allreduce``::

    import torch.distributed as dist
    import mpi_allreduce.torch            # registers the backend
    dist.init_process_group("mpi_allreduce")   # under mpiexec or srun: no MASTER_ADDR needed

Rank and world size come from MPI.  Where the environment does not already
name them (``torchrun`` does), importing this module fills in ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (rank 0's host name) and
``MASTER_PORT`` (a free port on rank 0) from ``MPI.COMM_WORLD``, so torch's
default ``env://`` rendezvous works unchanged -- importing it is collective
over ``COMM_WORLD``.

What runs where:

============================================== ==================================
``all_reduce`` (SUM, AVG, PRODUCT, MIN, MAX,    :func:`mpi_allreduce.allreduce` in
BAND, BOR, BXOR)                                place (``auto``, or the options)
``reduce_scatter_tensor``, ``reduce_scatter``   :func:`mpi_allreduce.reduce_scatter`
``all_gather_into_tensor``, ``all_gather``      :func:`mpi_allreduce.allgather`
``broadcast``, ``barrier``                      MPI (``Bcast``, ``Barrier``) on the
                                                group's communicator
============================================== ==================================

Options for the all-reduces (``algorithm``, ``reproducible``, ...) are
given to :func:`configure`.  Subgroups
(``dist.new_group``) run on MPI sub-communicators of the member ranks.

CPU tensors are handed to the library without copies (through DLPack);
a tensor that is not contiguous is reduced in a contiguous copy that is
copied back.  Every call runs to completion before it returns, also with
``async_op=True`` (its ``Work`` is complete, and ``wait()`` and
``get_future()`` behave as torch expects): the calls are not yet
overlapped with the caller's computation.
"""

from __future__ import annotations

import os
import socket
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from . import collectives
from .api import allreduce

__all__ = ["BACKEND", "MPIAllreduceGroup", "configure"]

#: the name ``init_process_group`` takes
BACKEND = "mpi_allreduce"

_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}

#: keyword arguments of mpi_allreduce.allreduce every all-reduce of the backend takes
_OPTIONS: dict = {}


def configure(**options) -> None:
    """Options of :func:`mpi_allreduce.allreduce` (``algorithm``,
    ``reproducible``, ``segment_size``, ...) for the backend's all-reduces."""
    _OPTIONS.clear()
    _OPTIONS.update(options)


def _op(reduce_op) -> str:
    for torch_op, name in _OPS.items():
        if reduce_op == torch_op:
            return name
    raise ValueError(f"the {BACKEND} backend does not support {reduce_op}")


def _done(result) -> "dist.Work":
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


#: numpy views of the last tensors reduced, by (address, elements, dtype, shape): the
#: same tensor again (a DDP bucket, a training loop's buffer) gets the same array
#: object, which the library's kept calls recognise -- a repeat is then a look-up
#: instead of a validation, a plan and a bind.  A view holds its tensor's memory,
#: so an address in the key cannot be reused while it is kept; at most MAX_VIEWS
#: views and MAX_VIEW_BYTES of memory are held (the least recently used go first).
_VIEWS: "OrderedDict[tuple, object]" = OrderedDict()
MAX_VIEWS = 64
MAX_VIEW_BYTES = 256 << 20


def _array(tensor: torch.Tensor):
    """A numpy array over the tensor's memory (no copy; bfloat16 as
    ``ml_dtypes.bfloat16``, which numpy cannot import through DLPack)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"the {BACKEND} backend takes CPU tensors; got one on {tensor.device}")
    key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, tuple(tensor.shape))
    view = _VIEWS.get(key)
    if view is not None:
        _VIEWS.move_to_end(key)
        return view
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        view = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        view = tensor.numpy()
    _VIEWS[key] = view
    while len(_VIEWS) > MAX_VIEWS or \
            (len(_VIEWS) > 1 and sum(v.nbytes for v in _VIEWS.values()) > MAX_VIEW_BYTES):
        _VIEWS.popitem(last=False)
    return view


def _in_place(tensor: torch.Tensor, run) -> None:
    """``run(array)`` on ``tensor``'s memory, or on a contiguous copy written back."""
    if tensor.is_contiguous():
        run(_array(tensor))
    else:
        work = tensor.contiguous()
        run(_array(work))
        tensor.copy_(work)


class MPIAllreduceGroup(dist.ProcessGroup):
    """A ProcessGroup whose collectives run on ``comm`` (an MPI communicator
    of the group's ranks, in group-rank order)."""

    def __init__(self, rank: int, size: int, comm: MPI.Intracomm):
        super().__init__(rank, size)
        self.comm = comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    # --- ours ------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for tensor in tensors:
            _in_place(tensor, lambda t: allreduce(MPI.IN_PLACE, t, op, comm=self.comm,
                                                  **_OPTIONS))
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for output, parts in zip(outputs, inputs):
            whole = _array(torch.cat([p.reshape(-1) for p in parts]))
            _in_place(output, lambda t: collectives.reduce_scatter(
                whole, t, op, [p.numel() for p in parts], comm=self.comm))
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        _in_place(output, lambda t: collectives.reduce_scatter(
            _array(input.contiguous()), t, op, comm=self.comm))
        return _done(output)

    _reduce_scatter_base = reduce_scatter_single

    def allgather(self, outputs, inputs, opts=None):
        for output_list, tensor in zip(outputs, inputs):
            counts = [o.numel() for o in output_list]
            whole = torch.empty(sum(counts), dtype=tensor.dtype)
            collectives.allgather(_array(tensor.contiguous()), _array(whole), counts,
                                  comm=self.comm)
            for piece, out in zip(torch.split(whole, counts), output_list):
                out.copy_(piece.reshape(out.shape))
        return _done(outputs)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        _in_place(output, lambda t: collectives.allgather(_array(input.contiguous()), t,
                                                          comm=self.comm))
        return _done(output)

    _allgather_base = all_gather_single

    # --- MPI's ------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for tensor in tensors:
            _in_place(tensor, lambda t: self.comm.Bcast(t.view(f"u{t.itemsize}")
                                                        if t.dtype.kind == "V" else t, root=root))
        return _done(tensors)

    def barrier(self, opts=None):
        self.comm.Barrier()
        return _done(None)

    def __repr__(self) -> str:
        return f"<{BACKEND} process group: rank {self.rank()} of {self.size()}>"


def _create(options, backend_options=None) -> MPIAllreduceGroup:
    """torch's creator (extended API): the group's MPI communicator from its
    global ranks (collective over the members only, as torch calls it)."""
    world = MPI.COMM_WORLD
    ranks = list(getattr(options, "global_ranks_in_group", []) or [])
    if not ranks or ranks == list(range(world.Get_size())):
        comm = world.Dup()
    else:
        comm = world.Create_group(world.Get_group().Incl(ranks))
    if comm.Get_size() != options.group_size or comm.Get_rank() != options.group_rank:
        raise RuntimeError(f"{BACKEND}: torch's group (rank {options.group_rank} of "
                           f"{options.group_size}) is not MPI's (rank {comm.Get_rank()} of "
                           f"{comm.Get_size()}): launch every process with mpiexec or srun")
    return MPIAllreduceGroup(options.group_rank, options.group_size, comm)


def _fill_environment() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from MPI,
    unless the launcher set them (collective over COMM_WORLD)."""
    world = MPI.COMM_WORLD
    missing = not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                      "MASTER_PORT"))
    if not world.allreduce(int(missing), op=MPI.MAX):
        return
    address: Optional[tuple] = None
    if world.Get_rank() == 0:
        with socket.socket() as probe:  # a free port on rank 0's host
            probe.bind(("", 0))
            address = (socket.gethostname(), probe.getsockname()[1])
    host, port = world.bcast(address, root=0)
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local = node.Get_rank()
    node.Free()
    os.environ.update({"RANK": str(world.Get_rank()), "WORLD_SIZE": str(world.Get_size()),
                       "LOCAL_RANK": str(local), "MASTER_ADDR": host,
                       "MASTER_PORT": str(port)})


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
_fill_environment()
