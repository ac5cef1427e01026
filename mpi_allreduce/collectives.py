"""An all-reduce's two halves on their own: ``reduce_scatter`` and ``allgather``.

Sharded data parallelism (ZeRO, FSDP) uses them apart: gradients are
reduce-scattered so each rank keeps the reduced shard it updates, and the
updated shards are allgathered back.  Both follow MPI's conventions
(``MPI_Reduce_scatter``/``_block``, ``MPI_Allgather``/``v``): blocks in rank
order, ``counts`` per rank for the vector forms, ``MPI.IN_PLACE``.  They run
the phase functions of the ring (the default) or of a bandwidth-optimal
algorithm (``registry.HALVES``; laid out for MPI's
blocks by ``algorithms/phases.py``) as schedules through the
one executor, so they share its segments, staging and device handling.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from . import progress, registry
from .api import left
from .backend import backend_for
from .buffers import arrays_and_datatype, messages
from .context import CALLS, context_for, refcounts, remember_call, typed
from .errors import OWN_ERRORS, failed
from .executor import Plan
from .ops import check_dtype, dtype_label, resolve_op, spec_label
from .spec import CallSpec
from .options import Options, options as resolve
from .planner import algorithm_options
from .validate import agree

__all__ = ["reduce_scatter", "allgather"]


def reduce_scatter(sendbuf, recvbuf=None, op=MPI.SUM, counts=None, *,
                   comm: MPI.Intracomm = MPI.COMM_WORLD, algorithm: Optional[str] = None,
                   **options):
    """Reduce ``sendbuf`` over ``comm`` and leave block ``rank`` of the
    result in ``recvbuf``; return ``recvbuf``.

    ``counts`` (one per rank, summing to the send size) gives the blocks
    (``MPI_Reduce_scatter``); without it every block has ``recvbuf.size``
    elements, or ``sendbuf.size / comm.size`` when ``recvbuf`` is omitted
    (``MPI_Reduce_scatter_block``).  With ``sendbuf=MPI.IN_PLACE`` the input
    is the whole of ``recvbuf`` and the result lands at its start.  ``op`` as
    for :func:`~mpi_allreduce.allreduce`; a non-commutative one needs an
    algorithm that combines in rank order (``rabenseifner``, ``knomial``).
    ``algorithm``: one of ``registry.HALVES`` (default
    and ``auto``: the ring); the other options it takes: ``check``,
    ``segment_size`` (as for :func:`~mpi_allreduce.allreduce`) and ``radix``
    (for ``knomial``)."""
    try:  # (whatever leaves the call on this rank: api.left)
        return _reduce_scatter(sendbuf, recvbuf, op, counts, comm, algorithm, options)
    except BaseException as exc:
        left(comm, exc)


def _reduce_scatter(sendbuf, recvbuf, op, counts, comm, algorithm, options: dict):
    # (the counts read once: an iterator gives them once)
    counts = None if counts is None else tuple(counts)
    extra = _extra(counts, algorithm, options)
    if _repeated("reduce_scatter", sendbuf, recvbuf, op, comm, extra):
        return recvbuf
    opts = resolve("halves", algorithm=algorithm, **options)
    user = (sendbuf, recvbuf, op, extra)
    op = resolve_op(op)
    size, rank = comm.Get_size(), comm.Get_rank()

    def validate():
        if not op.commutative and opts.algorithm not in registry.ORDERED:
            raise ValueError(f"reduce_scatter with {opts.algorithm} needs a commutative op; "
                             f"{op.name!r} is not (choose one that combines in rank order: "
                             f"{', '.join(a for a in registry.HALVES if a in registry.ORDERED)})")
        send, recv, datatype = arrays_and_datatype(*messages(sendbuf, recvbuf, op.reduce_local))
        in_place = send is None
        full = recv if in_place else send
        blocks = _counts(counts, size, full.size,
                         None if in_place or recv is None else recv.size, "reduce_scatter")
        if recv is None:
            recv = backend_for(send).empty(blocks[rank], send.dtype)
        elif not in_place and recv.size != blocks[rank]:
            raise ValueError(f"recvbuf has {recv.size} elements; this rank's block has "
                             f"{blocks[rank]}")
        _check_pair(send, recv)
        check_dtype(recv.dtype, op)
        if backend_for(recv).device and not op.device:
            raise TypeError(f"op {op.name!r} runs on host memory only")
        return send, recv, blocks, datatype

    send, recv, blocks, datatype = _validated(
        validate, comm, opts, "reduce_scatter",
        lambda v: {"counts": v[2], "dtype": dtype_label(v[1].dtype),
                   "op": spec_label(op, v[1].dtype, v[3], sum(v[2]))})
    return _run(comm, "reduce_scatter", send, recv, blocks, op, opts, datatype, user)


def allgather(sendbuf, recvbuf=None, counts=None, *, comm: MPI.Intracomm = MPI.COMM_WORLD,
              algorithm: Optional[str] = None, **options):
    """Gather every rank's ``sendbuf`` into ``recvbuf`` on every rank, in
    rank order; return ``recvbuf``.

    Without ``counts`` every rank gives the same number of elements
    (``MPI_Allgather``; an omitted ``recvbuf`` is allocated with shape
    ``(comm.size,) + sendbuf.shape``); with ``counts`` (one per rank) rank r
    gives ``counts[r]`` elements (``MPI_Allgatherv``).  With
    ``sendbuf=MPI.IN_PLACE`` this rank's block is already in place in
    ``recvbuf``.  ``algorithm`` and the options as for :func:`reduce_scatter`."""
    try:  # (whatever leaves the call on this rank: api.left)
        return _allgather(sendbuf, recvbuf, counts, comm, algorithm, options)
    except BaseException as exc:
        left(comm, exc)


def _allgather(sendbuf, recvbuf, counts, comm, algorithm, options: dict):
    counts = None if counts is None else tuple(counts)  # (read once, see _reduce_scatter)
    extra = _extra(counts, algorithm, options)
    if _repeated("allgather", sendbuf, recvbuf, None, comm, extra):
        return recvbuf
    opts = resolve("halves", algorithm=algorithm, **options)
    user = (sendbuf, recvbuf, None, extra)
    size, rank = comm.Get_size(), comm.Get_rank()

    def validate():
        send, recv, _ = arrays_and_datatype(*messages(sendbuf, recvbuf))
        in_place = send is None
        if recv is None:
            total = send.size * size if counts is None else sum(counts)
            shape = (size,) + send.shape if counts is None else (total,)
            recv = backend_for(send).empty_shaped(shape, send.dtype)
        blocks = _counts(counts, size, recv.size, None, "allgather")
        if not in_place and send.size != blocks[rank]:
            raise ValueError(f"sendbuf has {send.size} elements; this rank's block has "
                             f"{blocks[rank]} (recvbuf {recv.size} / {size} ranks)")
        _check_pair(send, recv)
        return send, recv, blocks

    send, recv, blocks = _validated(validate, comm, opts, "allgather",
                                    lambda v: {"counts": v[2], "dtype": dtype_label(v[1].dtype)})
    return _run(comm, "allgather", send, recv, blocks, resolve_op(MPI.SUM), opts, user=user)


# --- shared by both ---------------------------------------------------------

def _extra(counts, algorithm, options: dict) -> Optional[tuple]:
    """What a kept call of these keywords must be given again to be
    repeated (None: nothing beyond the buffers, the op and the comm), each
    value with its type (see :func:`~mpi_allreduce.context.typed`)."""
    if counts is None and algorithm is None and not options:
        return None
    return (None if counts is None else tuple((type(c), c) for c in counts), algorithm,
            typed(options))


def _counts(counts, size: int, total: int, block: Optional[int], what: str) -> tuple:
    """Every rank's block: ``counts`` checked, or ``total`` cut evenly."""
    if counts is None:
        if block is not None and block * size != total:
            raise ValueError(f"{what}: {total} elements do not make {size} blocks of {block}")
        if total % size:
            raise ValueError(f"{what}: {total} elements do not split into {size} equal blocks; "
                             "pass counts= for unequal blocks")
        return (total // size,) * size
    counts = tuple(counts)
    if len(counts) != size or not all(isinstance(c, (int, np.integer)) and c >= 0
                                       for c in counts):
        raise ValueError(f"{what}: counts must be {size} non-negative integers, got {counts!r}")
    if sum(counts) != total:
        raise ValueError(f"{what}: counts sum to {sum(counts)}, the vector has {total} elements")
    return tuple(int(c) for c in counts)


def _check_pair(send, recv) -> None:
    backend = backend_for(recv)
    if not recv.dtype.isnative:
        raise TypeError(f"dtype {recv.dtype.str} is not in native byte order")
    if not backend.is_contiguous(recv):
        raise ValueError("recvbuf must be C-contiguous")
    if not backend.is_writeable(recv):
        raise ValueError("recvbuf is read-only")
    if send is None:
        return
    if backend_for(send) is not backend:
        raise TypeError("sendbuf and recvbuf live in different places")
    if send.dtype != recv.dtype:
        raise TypeError(f"sendbuf dtype {send.dtype} != recvbuf dtype {recv.dtype}")
    if backend.shares_memory(send, recv):
        raise ValueError("sendbuf and recvbuf overlap; use MPI.IN_PLACE for in-place")


def _validated(validate, comm, opts: Options, what: str, fingerprint):
    """``validate()`` on every rank; in check mode the ranks also agree
    (on the counts of every rank, the dtype, the op and the segment)."""
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an MPI intra-communicator, got {comm!r}")
    checking = opts.check and comm.Get_size() > 1
    try:
        values, error = validate(), None
        segment = opts.segment(values[1].dtype)
    except Exception as exc:  # noqa: BLE001 - any refusal, of any type
        if not checking or isinstance(exc, OWN_ERRORS):
            raise  # (a refusal: api.left, where the call is left)
        values, error = None, exc
    if checking:
        agree(comm, None if values is None else dict(
            fingerprint(values), segment_size=segment, algorithm=opts.algorithm,
            options=algorithm_options(opts.algorithm, opts, comm.Get_size())), error, what)
    return values


def _repeated(what: str, sendbuf, recvbuf, op, comm, extra: Optional[tuple]) -> bool:
    """Whether this is a repeat of a kept call with the very same objects
    (see :class:`~mpi_allreduce.context.Remembered`), which then ran again:
    no validation, spec or plan look-up, as :func:`~mpi_allreduce.allreduce`
    repeats its kept calls."""
    kept = CALLS.get((what, id(recvbuf)))
    if kept is None or not kept.repeats(sendbuf, recvbuf, op, comm, "ring", extra):
        return False
    try:
        kept.run()
    except Exception as exc:  # noqa: BLE001 - after messages started
        failed(kept.comm, exc, what)
    return True


class _Kept(NamedTuple):
    """What :func:`~mpi_allreduce.context.remember_call` reads of a call."""
    send: object
    recv: object
    algorithm: str = "ring"
    selection: str = "table"


def _run(comm, what: str, send, recv, blocks: tuple, op, opts: Options, datatype=None,
         user=None):
    backend, dtype = backend_for(recv), recv.dtype
    segment = opts.segment(dtype)
    # (no short cut for an empty call on several ranks: see api.allreduce)
    if comm.Get_size() == 1:
        if send is not None:
            backend.device_synchronize()
            backend.copy(recv.reshape(-1)[:send.size], send)
        return recv
    context = context_for(comm)
    # in place or not is each rank's own affair: in the cache key, not the spec
    spec = CallSpec(what, opts.algorithm, context.size, sum(blocks), dtype_label(dtype),
                    spec_label(op, dtype, datatype, sum(blocks)), segment,
                    algorithm_options(opts.algorithm, opts, context.size),
                    blocks=blocks)
    key = (spec, op.identity, backend, send is None)

    def build():
        schedule = registry.halves(what, spec.algorithm, context.comm.Get_rank(), context.size,
                                   blocks, segment, send is None, spec.options)
        return Plan(context.comm, schedule, dtype, op, backend, spec)
    call = _Kept(send, recv)
    held = refcounts(call)
    bound = context.plan(key, build).bind(send, recv, datatype=datatype)
    run = progress.blocking(bound, context, what)
    # (counted first: references taken below would count too)
    ours = [after - before for before, after in zip(held, refcounts(call))]
    if user is not None and not opts.check and datatype is None:
        # kept for repeats with the caller's very objects, as allreduce's are
        sendbuf, recvbuf, user_op, extra = user
        remember_call(context, run, sendbuf, recvbuf, user_op, comm, "ring", call, ours,
                      extra, kind=what)
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - after messages started
        failed(context.comm, exc, what)
    return recv
