"""Arguments -> a validated call, and ``check=True``'s agreement.

:func:`validate` makes the same checks on every rank before any message
and returns a :class:`Call` (the arrays viewed, the op resolved, every
option resolved from its argument or the environment); :func:`agree`
exchanges what the ranks were given (:func:`arguments`, then the resolved
spec, see :func:`~mpi_allreduce.planner.resolved`) and raises
:class:`~mpi_allreduce.errors.ArgumentMismatch` on every rank if they
differ or any rank rejected its input.
"""

from __future__ import annotations

import os
import pickle
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from . import registry, selection as _selection
from .backend import backend_for
from .buffers import arrays_and_datatype, messages
from .config import environment
from .context import context_for
from .errors import ArgumentMismatch
from .ops import Op, check_dtype, dtype_label, resolve_op

__all__ = ["Call", "validate", "check_enabled", "arguments", "agree", "segment_elements",
           "DEFAULT_SEGMENT_BYTES", "SELECTIONS"]

#: default segment: the most one message carries when its data is to be
#: reduced, and so the scratch of every algorithm
DEFAULT_SEGMENT_BYTES = 1 << 20


#: the ways ``auto`` chooses (``selection=``, ``MPI_ALLREDUCE_SELECTION``)
SELECTIONS = ("table", "live")


class Call(NamedTuple):
    send: object  # array, or None for MPI.IN_PLACE
    recv: object
    op: Op
    algorithm: str
    backend: object
    segment_size: int
    ranks_per_node: Optional[int]
    inner: Optional[str]
    tuning: object  # None, a file's path or a DecisionTable (auto, hierarchical only)
    selection: str
    datatype: object = None  # the caller's MPI datatype (a message spec), else None
    #: what a call made on behalf of another adds to its spec (reproducible sums)
    salt: str = ""


def check_enabled(check: Optional[bool]) -> bool:
    return environment().check if check is None else bool(check)


def validate(sendbuf, recvbuf, op, algorithm, segment_size, ranks_per_node, inner,
              tuning, selection) -> Call:
    op = resolve_op(op)
    algorithm = registry.check_name(algorithm)
    tuning = _tuning_argument(tuning) if algorithm in ("auto", "hierarchical") else None
    if algorithm == "hierarchical":
        inner = _selection.inner_setting(inner)
        ranks_per_node = ranks_per_node_setting(ranks_per_node)
    selection = selection or environment().selection or "table"
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")

    send, recv, datatype = arrays_and_datatype(*messages(sendbuf, recvbuf, op.reduce_local))

    backend = backend_for(send if send is not None else recv)
    if recv is None:
        recv = backend.empty_shaped(send.shape, send.dtype)
    elif backend_for(recv) is not backend:
        raise TypeError(
            f"sendbuf and recvbuf live in different places "
            f"({backend.name} vs {backend_for(recv).name})"
        )
    if backend.device and not op.device:
        raise TypeError(f"op {op.name!r} runs on host memory only (MPI_Reduce_local); for "
                        "device arrays pass a Python callable (mpi_allreduce.user_op)")
    _check_order(op, algorithm)

    dtype = recv.dtype
    if not dtype.isnative:
        raise TypeError(f"dtype {dtype.str} is not in native byte order")
    check_dtype(dtype, op)
    if send is not None:
        if send.dtype != dtype:
            raise TypeError(f"sendbuf dtype {send.dtype} != recvbuf dtype {dtype}")
        if send.size != recv.size:
            raise ValueError(f"sendbuf has {send.size} elements, recvbuf has {recv.size}")
        if backend.shares_memory(send, recv):
            raise ValueError("sendbuf and recvbuf overlap; use MPI.IN_PLACE for in-place")
    if not backend.is_contiguous(recv):
        raise ValueError("recvbuf must be C-contiguous")
    if not backend.is_writeable(recv):
        raise ValueError("recvbuf is read-only")

    return Call(send, recv, op, algorithm, backend, segment_elements(segment_size, dtype),
                ranks_per_node, inner, tuning, selection, datatype)


def _tuning_argument(tuning):
    """``tuning`` as the planner takes it: None (the default table), a
    file's absolute path (both read and agreed by the ranks on first use:
    :meth:`~mpi_allreduce.context.Context.table`), or a checked
    :class:`~mpi_allreduce.selection.DecisionTable` (a dict the caller
    passes: what it makes ``auto`` choose is in the call's fingerprint)."""
    if tuning is None or isinstance(tuning, _selection.DecisionTable):
        return tuning
    if isinstance(tuning, dict):
        return _selection.DecisionTable(tuning)
    if isinstance(tuning, (str, os.PathLike)):
        return os.path.abspath(os.fspath(tuning))
    raise TypeError(f"tuning must be a dict, a DecisionTable or a file's path, got "
                    f"{type(tuning).__name__}")


def segment_elements(segment_size, dtype) -> int:
    """Elements per message at most: the argument, else
    ``MPI_ALLREDUCE_SEGMENT_BYTES`` (or the default) in elements of ``dtype``."""
    if segment_size is None:
        segment_bytes = environment().segment_bytes or DEFAULT_SEGMENT_BYTES
        return max(1, segment_bytes // dtype.itemsize)
    if isinstance(segment_size, bool) or not isinstance(segment_size, (int, np.integer)) \
            or segment_size < 1:
        raise ValueError(f"segment_size must be a positive integer, got {segment_size!r}")
    return int(segment_size)


def _check_order(op: Op, algorithm: str) -> None:
    """A non-commutative op runs only where operands combine in rank order."""
    if not op.commutative and algorithm != "auto" and registry.get(algorithm).COMMUTATIVE:
        raise ValueError(
            f"algorithm {algorithm!r} needs a commutative op and {op.name!r} is not; "
            f"choose one that combines in rank order: {', '.join(registry.ORDERED)}")


def ranks_per_node_setting(value):
    """The node-size override: the argument, else the environment, else None."""
    if value is None:
        value = environment().ranks_per_node
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {value!r}")
    return value


def arguments(call: Optional[Call]):
    """What check mode compares first: the arguments, options resolved."""
    if call is None:
        return None
    return {
        "count": int(call.recv.size),
        "dtype": dtype_label(call.recv.dtype),
        "op": call.op.stable,
        "algorithm": call.algorithm,
        "segment_size": call.segment_size,
        "ranks_per_node": call.ranks_per_node,
        "inner": call.inner,
        "selection": call.selection,
        "salt": call.salt,
    }


def agree(comm: MPI.Intracomm, fingerprint: Optional[dict], error: Optional[Exception],
          what: str) -> None:
    """Exchange argument fingerprints (None where this rank rejected its
    input with ``error``); raise the same error on every rank if they differ."""
    mine = (fingerprint, None if error is None else f"{type(error).__name__}: {error}")
    everyone = _allgather(context_for(comm), mine, f"check=True's agreement on a {what} call")
    failed = [(rank, err) for rank, (_, err) in enumerate(everyone) if err is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {err}" for rank, err in failed)
        raise ArgumentMismatch(f"{what} rejected on {len(failed)} rank(s): {detail}")
    keys = dict.fromkeys(key for fp, _ in everyone for key in fp)
    for key in keys:
        values = [fp.get(key) for fp, _ in everyone]
        if any(v != values[0] for v in values):
            by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ArgumentMismatch(f"{what} arguments differ across ranks in {key} ({by_rank})")


def _allgather(context, obj, what: str) -> list:
    """Every rank's ``obj`` (pickled), through two watched non-blocking
    collectives on the library's communicator: their sizes, then the bytes."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    comm, size = context.comm, context.size
    sizes = np.empty(size, dtype=np.int64)
    context.collective(lambda: comm.Iallgather(np.array([data.size], dtype=np.int64), sizes), what)
    everything = np.empty(int(sizes.sum()), dtype=np.uint8)
    context.collective(lambda: comm.Iallgatherv(data, [everything, sizes.tolist()]), what)
    ends = np.cumsum(sizes).tolist()
    return [pickle.loads(everything[end - n:end].tobytes()) for n, end in zip(sizes.tolist(), ends)]
