"""``allreduce()``: validate, take the short cuts, plan, dispatch."""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from . import registry
from .config import environment, on_refresh
from .algorithms import entry
from .algorithms.hierarchical import inner_setting, ranks_per_node_setting
from .backend import as_array, backend_for
from .ops import Op, check_dtype, resolve_op
from .plan import ON_FREE, Plan, context_for
from .trial import DEFAULT_ROUNDS, Trial, block_length, watched

__all__ = ["allreduce", "ArgumentMismatch", "DEFAULT_SEGMENT_BYTES"]

#: default segment: the most one message carries when its data is to be
#: reduced, and so the scratch of every algorithm
DEFAULT_SEGMENT_BYTES = 1 << 20


class ArgumentMismatch(ValueError):
    """Raised on every rank when ``check=True`` finds ranks that disagree."""


class _Call(NamedTuple):
    send: object  # array, or None for MPI.IN_PLACE
    recv: object
    op: Op
    algorithm: str
    backend: object
    segment_size: int
    ranks_per_node: Optional[int]
    inner: str
    tuning: object  # registry.DecisionTable, or None unless algorithm == "auto"


def allreduce(
    sendbuf,
    recvbuf=None,
    op=MPI.SUM,
    *,
    comm: MPI.Intracomm = MPI.COMM_WORLD,
    algorithm: str = "auto",
    check: Optional[bool] = None,
    segment_size: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
    inner: Optional[str] = None,
    tuning=None,
):
    """All-reduce ``sendbuf`` over ``comm`` into ``recvbuf`` and return ``recvbuf``.

    Parameters
    ----------
    sendbuf : numpy or cupy array, or ``MPI.IN_PLACE``
        This rank's contribution.  With ``MPI.IN_PLACE`` the input is read
        from ``recvbuf`` and overwritten with the result.
    recvbuf : array, optional
        C-contiguous, writeable, same dtype and size as ``sendbuf`` (its
        shape may differ).  Allocated like ``sendbuf`` when omitted.
    op : MPI.Op or str
        SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR, their
        lower-case names, or ``"avg"`` (sum / comm size; floats only).
    comm : MPI.Intracomm
        Any intra-communicator.  The library talks on its own cached
        duplicate of it.
    algorithm : str
        ``"auto"`` or one of :data:`ALGORITHMS`.
    check : bool, optional
        Exchange a fingerprint of the arguments first and raise
        :class:`ArgumentMismatch` on every rank if the ranks disagree
        (count, dtype, op, algorithm) or any rank rejected its input.
        Default: the ``MPI_ALLREDUCE_CHECK`` environment variable.
    segment_size : int, optional
        Elements per message at most where the data is to be reduced (every
        algorithm's scratch is one such segment; default: 1 MiB worth, or
        ``MPI_ALLREDUCE_SEGMENT_BYTES``).
    ranks_per_node, inner : optional
        ``hierarchical`` only: group consecutive ranks into emulated nodes
        of this size instead of the shared-memory nodes
        (``MPI_ALLREDUCE_RANKS_PER_NODE``), and the algorithm the node
        leaders run (``MPI_ALLREDUCE_INNER``, default ``auto``).
    tuning : dict or str, optional
        The decision table ``auto`` uses (a dict or the path of a JSON file
        written by ``python -m mpi_allreduce tune``); default: the file named
        by ``MPI_ALLREDUCE_TUNING``, else the built-in table.
    """
    try:
        key = (id(comm), id(sendbuf), id(recvbuf), id(op), algorithm, check, segment_size,
               ranks_per_node, inner, tuning)
        prepared = _PREPARED.get(key)
    except TypeError:  # an unhashable argument (a tuning dict): no fast path
        key = prepared = None
    if prepared is not None:  # the same live objects (see _Prepared); recheck the arrays
        state = prepared.state
        if state(recvbuf) == prepared.recv_state and (
                prepared.send_state is None or state(sendbuf) == prepared.send_state):
            if prepared.plain:  # 1-D host arrays (their state says so) as they are
                prepared.entry(sendbuf, recvbuf)
                return recvbuf
            return prepared(sendbuf, recvbuf)

    checking = _check_enabled(check)
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an MPI intra-communicator, got {comm!r}")
    try:
        call = _validate(sendbuf, recvbuf, op, algorithm, segment_size, ranks_per_node, inner,
                         tuning)
        error = None
    except (TypeError, ValueError) as exc:
        if not checking or comm.Get_size() == 1:
            raise
        call, error = None, exc
    if checking and comm.Get_size() > 1:
        _agree(comm, call, error)

    prepared = _prepare(comm, call)
    if key is not None and not checking and prepared.runner is not None:
        _remember(key, prepared, comm, sendbuf, recvbuf, op, call)
    return prepared(call.send, call.recv)


class _Prepared:
    """One validated call, ready to run: the plan's runner and how the
    buffers reach it.

    Repeating a call with the very same buffer objects and arguments (the
    usual case in a training loop or a benchmark) finds it again by the
    ids of those objects and skips validation, planning and the table
    lookup.  An id names one live object: this holds the comm and op
    objects themselves, and weak references to the buffers whose death
    drops the entry (before the id can be reused), as freeing the comm
    does.  What may change on a live array (size, dtype, contiguity,
    writeable, number of dimensions) is rechecked on every call, so a
    stale entry is never used.
    """

    __slots__ = ("_runner", "entry", "backend", "size", "in_place", "copy_send", "finalize",
                 "plain", "comm", "context", "op", "refs", "state", "send_state", "recv_state")

    def __init__(self, runner, backend, size, in_place, copy_send, finalize):
        self.runner = runner  # None: nothing to communicate (count 0 or one rank)
        self.backend = backend
        self.size = size
        self.in_place = in_place
        self.copy_send = copy_send  # the send buffer is copied into recv first
        self.finalize = finalize
        #: host buffers go to the runner as they are: set for a kept call
        #: whose arrays are 1-D (``allreduce`` takes that short way itself)
        self.plain = False

    @property
    def runner(self):
        return self._runner

    @runner.setter
    def runner(self, runner) -> None:  # a trial sets its winner here once it has one
        self._runner = runner
        #: what the short way calls: an algorithm's bare ``run`` where it has one
        #: (the same call without its object's ``__call__`` in between)
        self.entry = entry(runner)

    def __call__(self, send, recv):
        """All-reduce array ``send`` (ignored in place) into array ``recv``."""
        backend = self.backend
        if backend.device:
            backend.device_synchronize()
        buf = recv if recv.ndim == 1 else backend.flat(recv)
        if self.in_place:
            send = buf
        elif self.copy_send:
            backend.copy(recv, send)
            send = buf
        elif send.ndim != 1:
            send = backend.flat(send)
        if self.runner is not None:
            self.runner(send, buf)
        if self.finalize is not None and buf.shape[0]:
            backend.ufunc(self.finalize)(buf, self.size, out=buf)
        return recv


def _prepare(comm, call: _Call) -> _Prepared:
    size = comm.Get_size()
    backend, recv = call.backend, call.recv
    count, dtype = recv.size, recv.dtype
    copy_send = call.send is not None and (size == 1 or not backend.is_contiguous(call.send))
    runner = None
    if count and size > 1:
        runner = _runner(context_for(comm), call, count, dtype)
    return _Prepared(runner, backend, size, call.send is None, copy_send, call.op.finalize)


def _runner(context, call: _Call, count: int, dtype):
    """The plan's runner from the context's cache; for ``auto``, the
    :class:`~.trial.Trial` of the candidates, or once it is over the winner
    (or the :class:`~.trial.Watch` that keeps measuring it)."""
    nbytes = count * dtype.itemsize
    call = call._replace(send=None, recv=None)  # plans outlive the call: no buffers in them
    name = registry.resolve(call.algorithm, nbytes, context.comm.Get_size(), call.tuning,
                            context.oversubscribed)

    def key(name):
        return (count, dtype.str, call.op.name, name, call.backend, call.segment_size,
                call.ranks_per_node, call.inner)

    def new_plan(name=None):
        options = {}
        if name == "hierarchical":
            options = {"ranks_per_node": call.ranks_per_node, "inner": call.inner}
        return Plan(context, context.comm, count, dtype, call.op, call.backend,
                    call.segment_size, options)

    def build(name, plan=None):
        return registry.get(name)(plan or new_plan(name))

    rounds = trial_rounds()
    if call.algorithm != "auto" or not rounds:
        return context.get_plan(key(name), lambda: build(name))
    trial = context.get_plan(key("auto"), lambda: _trial(context, call, name, nbytes, rounds,
                                                          key, build, new_plan))
    return trial if trial.runner is None else trial.runner


def _trial(context, call: _Call, name: str, nbytes: int, rounds: int, key, build,
           new_plan) -> Trial:
    """``auto``'s trial for one call shape, the table's choice ``name`` first.

    Unwatched, the candidates are built for the trial alone and dropped
    after it unless they win (or were in the cache already); watched, they
    live on in the watch, built on one plan of their own whose scratch they
    share (they never run at the same time), so that a watched shape holds
    the largest candidate's scratch (two segments at most), whatever else
    is cached."""
    watch = watched(nbytes)
    built = {}
    shared = []

    def runner_for(name):
        runner = built.get(name)
        if runner is None:
            if watch:
                if not shared:
                    plan = new_plan()
                    # every candidate's "incoming" is a segment, or the
                    # pipelined ring's two (two half-blocks of an odd count
                    # on 2 ranks: a vector and an element): allocated first,
                    # it is never regrown, so all hold views of this buffer
                    plan.scratch("incoming", min(plan.count + 1, 2 * plan.segment_size))
                    shared.append(plan)
                runner = build(name, shared[0])
            else:
                runner = context.plans.get(key(name)) or build(name)
            built[name] = runner
        return runner

    def decided(winner):
        if not watch:  # the winner is cached, the losers go
            context.get_plan(key(winner), lambda: built[winner])
            built.clear()

    candidates = [name] + [a for a in registry.FLAT_ALGORITHMS if a != name]
    return Trial(context.comm, candidates, runner_for, call.backend, rounds,
                 block_length(nbytes), decided, watch)


def trial_rounds() -> int:
    """Blocks per candidate in ``auto``'s trial (``MPI_ALLREDUCE_AUTO_TRIALS``; 0: no trial)."""
    rounds = environment().auto_trials
    return DEFAULT_ROUNDS if rounds is None else rounds


#: calls seen lately, by the identity of their arguments (see _Prepared)
_PREPARED: dict = {}
#: how many of them are kept (the oldest goes first)
MAX_PREPARED = 64
on_refresh(_PREPARED.clear)


def _forget_context(context) -> None:
    """A freed communicator's prepared calls go with it (and their scratch)."""
    for key in [k for k, p in _PREPARED.items() if p.context is context]:
        del _PREPARED[key]


ON_FREE.append(_forget_context)


def _remember(key, prepared: _Prepared, comm, sendbuf, recvbuf, op, call: _Call) -> None:
    """Keep ``prepared`` for repeats, if the caller's objects are the arrays used."""
    backend = call.backend
    if recvbuf is not call.recv or (call.send is not None and sendbuf is not call.send):
        return  # converted on the way in (a list, a foreign device array): no identity

    def forget(ref):  # a buffer dies: its entry goes before its id can be reused
        entry = _PREPARED.get(key)
        if entry is not None and ref in entry.refs:
            del _PREPARED[key]

    try:
        buffers = (recvbuf,) if call.send is None else (sendbuf, recvbuf)
        prepared.refs = [weakref.ref(b, forget) for b in buffers]
    except TypeError:  # an array type without weak references
        return
    prepared.comm, prepared.context, prepared.op = comm, context_for(comm), op
    prepared.state = backend.state
    prepared.recv_state = backend.state(recvbuf)
    prepared.send_state = backend.state(sendbuf) if call.send is not None else None
    # the states hold ndim, so a kept call found again has 1-D arrays still
    prepared.plain = (prepared.runner is not None and not backend.device
                      and not prepared.in_place and not prepared.copy_send
                      and prepared.finalize is None and recvbuf.ndim == 1 and sendbuf.ndim == 1)
    _PREPARED[key] = prepared
    if isinstance(prepared.runner, Trial):
        prepared.runner.adopt(prepared)
    if len(_PREPARED) > MAX_PREPARED:
        del _PREPARED[next(iter(_PREPARED))]


def _check_enabled(check: Optional[bool]) -> bool:
    return environment().check if check is None else bool(check)


def _validate(sendbuf, recvbuf, op, algorithm, segment_size, ranks_per_node, inner,
              tuning) -> _Call:
    op = resolve_op(op)
    algorithm = registry.check_name(algorithm)
    if algorithm == "auto":
        try:
            tuning = registry.tuning_table(tuning)
        except OSError as exc:
            raise ValueError(f"cannot read the decision table: {exc}") from None
    else:
        tuning = None
    if algorithm == "hierarchical":
        inner = inner_setting(inner)
        ranks_per_node = ranks_per_node_setting(ranks_per_node)

    in_place = sendbuf is MPI.IN_PLACE or (
        isinstance(sendbuf, MPI.BottomType) and sendbuf == MPI.IN_PLACE
    )
    if in_place:
        if recvbuf is None:
            raise ValueError("sendbuf is MPI.IN_PLACE but no recvbuf was given")
        send = None
        recv = as_array(recvbuf)
    else:
        if sendbuf is None:
            raise TypeError("sendbuf is None; pass an array or MPI.IN_PLACE")
        send = as_array(sendbuf)
        recv = None if recvbuf is None else as_array(recvbuf)

    backend = backend_for(send if send is not None else recv)
    if recv is None:
        recv = backend.empty_shaped(send.shape, send.dtype)
    elif backend_for(recv) is not backend:
        raise TypeError(
            f"sendbuf and recvbuf live in different places "
            f"({backend.name} vs {backend_for(recv).name})"
        )

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

    if segment_size is None:
        segment_bytes = environment().segment_bytes or DEFAULT_SEGMENT_BYTES
        segment_size = max(1, segment_bytes // dtype.itemsize)
    if not isinstance(segment_size, (int, np.integer)) or segment_size < 1:
        raise ValueError(f"segment_size must be a positive integer, got {segment_size!r}")
    return _Call(send, recv, op, algorithm, backend, int(segment_size), ranks_per_node, inner,
                 tuning)


def _fingerprint(call: Optional[_Call]):
    if call is None:
        return None
    return {
        "count": int(call.recv.size),
        "dtype": call.recv.dtype.str,
        "op": call.op.name,
        "algorithm": call.algorithm,
        "segment_size": call.segment_size,
        "ranks_per_node": call.ranks_per_node,
        "inner": call.inner,
    }


def _agree(comm: MPI.Intracomm, call: Optional[_Call], error: Optional[Exception]) -> None:
    """Exchange argument fingerprints; raise the same error on every rank if they differ."""
    mine = (_fingerprint(call), None if error is None else f"{type(error).__name__}: {error}")
    everyone = context_for(comm).comm.allgather(mine)
    failed = [(rank, err) for rank, (_, err) in enumerate(everyone) if err is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {err}" for rank, err in failed)
        raise ArgumentMismatch(f"allreduce rejected on {len(failed)} rank(s): {detail}")
    reference = everyone[0][0]
    for key in reference:
        values = [fp[key] for fp, _ in everyone]
        if any(v != values[0] for v in values):
            by_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ArgumentMismatch(f"allreduce arguments differ across ranks in {key} ({by_rank})")
