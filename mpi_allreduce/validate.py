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

from typing import NamedTuple, Optional

from mpi4py import MPI

from . import registry
from .backend import backend_for
from .buffers import arrays_and_datatype, messages
from .context import context_for
from .errors import ArgumentMismatch
from .ops import Op, check_dtype, dtype_label, resolve_op, spec_label
from .options import Options

__all__ = ["Call", "validate", "arguments", "agree"]


class Call(NamedTuple):
    send: object  # array, or None for MPI.IN_PLACE
    recv: object
    op: Op
    backend: object
    options: Options  # what the call was made with (its option fields read these)
    segment_size: int  # elements, for this call's dtype
    datatype: object = None  # the caller's MPI datatype (a message spec), else None
    #: what a call made on behalf of another adds to its spec (reproducible sums)
    salt: str = ""

    @property
    def algorithm(self) -> str:
        return self.options.algorithm

    @property
    def ranks_per_node(self) -> Optional[int]:
        return self.options.ranks_per_node

    @property
    def inner(self) -> Optional[str]:
        return self.options.inner

    @property
    def tuning(self):
        """None, a file's path or a DecisionTable (auto, hierarchical only)."""
        return self.options.tuning

    @property
    def selection(self) -> str:
        return self.options.selection


def validate(sendbuf, recvbuf, op, opts: Options) -> Call:
    """The call of these arrays and op with options ``opts`` (resolved by
    :func:`~mpi_allreduce.options.options`), checked the same way on every
    rank."""
    op = resolve_op(op)
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
    _check_order(op, opts.algorithm)

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

    return Call(send, recv, op, backend, opts, opts.segment(dtype), datatype)


def _check_order(op: Op, algorithm: str) -> None:
    """A non-commutative op runs only where operands combine in rank order."""
    if not op.commutative and algorithm != "auto" and registry.get(algorithm).COMMUTATIVE:
        raise ValueError(
            f"algorithm {algorithm!r} needs a commutative op and {op.name!r} is not; "
            f"choose one that combines in rank order: {', '.join(registry.ORDERED)}")


def arguments(call: Optional[Call]):
    """What check mode compares first: the arguments, options resolved."""
    if call is None:
        return None
    return {
        "count": int(call.recv.size),
        "dtype": dtype_label(call.recv.dtype),
        "op": spec_label(call.op, call.recv.dtype, call.datatype, int(call.recv.size)),
        "algorithm": call.algorithm,
        "segment_size": call.segment_size,
        "ranks_per_node": call.ranks_per_node,
        "inner": call.inner,
        "radix": call.options.radix,
        "row_size": call.options.row_size,
        "selection": call.selection,
        # (a reproducible sum is two all-reduces of its own: it shapes the messages)
        "reproducible": bool(call.options.reproducible),
        "salt": call.salt,
    }


def agree(comm: MPI.Intracomm, fingerprint: Optional[dict], error: Optional[Exception],
          what: str, purpose: str = "check") -> None:
    """Exchange argument fingerprints (None where this rank rejected its
    input with ``error``); raise the same error on every rank if they differ.
    (``purpose``: which agreement of a call this is, see ``Context.record``.)"""
    mine = (fingerprint, None if error is None else f"{type(error).__name__}: {error}")
    everyone = context_for(comm).allgather_object(mine, purpose, f"check=True's agreement on "
                                                                  f"a {what} call")
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

