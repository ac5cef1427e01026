"""``allreduce()``: validate, take the short cuts, plan, run.

A call goes one way: validate the arguments (the same checks on every
rank, before any message) -> the communicator's
:class:`~mpi_allreduce.context.Context` -> the algorithm (named, or
``auto``'s choice from :mod:`~mpi_allreduce.selection`) and its options ->
the call's :class:`~mpi_allreduce.spec.CallSpec` (whose fingerprint gives
the tags and what ``check=True`` compares) -> its
:class:`~mpi_allreduce.executor.Plan` (schedule and scratch, cached per
spec) -> the plan bound to the caller's arrays -> the engine
(:mod:`~mpi_allreduce.progress`: the re-entry guard, the watchdog) -> MPI.  The bound
call is kept by the identity of the arguments, so a repeat with the very
same objects (a training loop, a benchmark) is a dictionary look-up, a few
identity checks and the compiled steps.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import NamedTuple, Optional

import numpy as np
from mpi4py import MPI

from . import progress, registry, selection as _selection
from .backend import backend_for
from .buffers import arrays_and_datatype, messages
from .config import environment
from .context import CALLS, Context, context_for
from .errors import ArgumentMismatch, failed
from .executor import Plan
from .progress import PersistentRequest, Request
from .ops import Op, check_dtype, dtype_label, resolve_op
from .spec import CallSpec

__all__ = ["allreduce", "iallreduce", "allreduce_init", "setup", "ArgumentMismatch", "DEFAULT_SEGMENT_BYTES", "plan_for", "choice"]

#: default segment: the most one message carries when its data is to be
#: reduced, and so the scratch of every algorithm
DEFAULT_SEGMENT_BYTES = 1 << 20

#: the ways ``auto`` chooses (``selection=``, ``MPI_ALLREDUCE_SELECTION``)
SELECTIONS = ("table", "live")
#: below this many bytes live selection leaves ``auto`` to the table: a call
#: is then latency, the algorithms' order follows their message counts, and
#: the selector's own Python (about 0.3 us a call) would be 10% of a call
LIVE_MIN_BYTES = 16 * 1024
#: live selection times one call of the current algorithm in this many
#: (each timed call stands for them all: the mean is what it needs)
SAMPLE = 8


class _Call(NamedTuple):
    send: object  # array, or None for MPI.IN_PLACE
    recv: object
    op: Op
    algorithm: str
    backend: object
    segment_size: int
    ranks_per_node: Optional[int]
    inner: Optional[str]
    tuning: object  # selection.DecisionTable, or None unless algorithm == "auto"
    selection: str
    datatype: object = None  # the caller's MPI datatype (a message spec), else None
    #: what a call made on behalf of another adds to its spec (reproducible sums)
    salt: str = ""


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
    selection: Optional[str] = None,
    reproducible: Optional[bool] = None,
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
    selection : str, optional
        How ``auto`` chooses: ``"table"`` (the decision table alone: the
        same algorithm, hence the same bytes, in every call and every run)
        or ``"live"`` (also time candidates on live calls, see
        :class:`~mpi_allreduce.selection.LiveSelector`).  Default:
        ``MPI_ALLREDUCE_SELECTION``, else ``"table"``.
    reproducible : bool, optional
        Sums (``sum``, ``avg``) of floats and complex numbers that are
        bit-identical whatever the algorithm, the order of combination, the
        segment size and which rank holds which vector (see
        :mod:`~mpi_allreduce.reproducible` for the method, its error bound
        and cost).  Ops that are exact anyway (integers, min, max, the
        logical and bitwise ops) run as usual; a float ``prod`` or a
        user-defined op is refused.
    """
    kept = CALLS.get(id(recvbuf))  # a repeat with the very same objects (see _Remembered)
    if (kept is not None and kept.send == id(sendbuf) and kept.op is op and kept.comm is comm
            and kept.algorithm == algorithm and recvbuf.dtype is kept.dtype
            and (kept.in_place or sendbuf.dtype is kept.dtype)
            and (kept.extra is None
                 and check is segment_size is ranks_per_node is inner is tuning is selection
                 is reproducible is None
                 or kept.extra == (check, segment_size, ranks_per_node, inner, tuning, selection,
                                   reproducible))):
        try:
            kept.run()
        except Exception as exc:  # noqa: BLE001 - after messages started
            failed(kept.comm, exc, kept.algorithm)
        return recvbuf

    call, checking = _setup(sendbuf, recvbuf, op, comm, algorithm, check, segment_size,
                            ranks_per_node, inner, tuning, selection)
    exact = bool(reproducible) and _order_matters(call)
    if call.recv.size == 0:
        setup(comm)  # the set-up is collective: every rank takes part, whatever its count
        return call.recv
    if comm.Get_size() == 1:
        if call.send is not None:
            call.backend.device_synchronize()  # the caller's other streams may still write it
            call.backend.copy(call.recv, call.send)
        return call.recv
    if exact:
        return _reproducible(comm, call, check, ranks_per_node, inner, tuning, selection)
    context = context_for(comm)
    held = _refcounts(call)
    run = _runner(context, call)
    if not checking:
        extra = (check, segment_size, ranks_per_node, inner, tuning, selection, reproducible)
        # counted first: arguments already pushed for a call would count too
        ours = [after - before for before, after in zip(held, _refcounts(call))]
        _remember(context, run, sendbuf, recvbuf, op, comm, algorithm, call, ours,
                  None if extra == (None,) * len(extra) else extra)
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - after messages started
        failed(comm, exc, call.algorithm)
    return call.recv


def _order_matters(call: _Call) -> bool:
    """Whether ``reproducible=True`` changes this call: a sum or avg of
    floats (integers, min and max are exact in any order already).  Ops
    whose float result depends on the order and that it cannot make
    reproducible are refused."""
    dtype = call.recv.dtype
    if not (dtype.kind in "fc" or dtype.name == "bfloat16") or call.op.name in ("min", "max"):
        return False
    if call.op.name not in ("sum", "avg"):
        raise ValueError(f"reproducible=True covers sum and avg of floats; {call.op.name!r} "
                         f"on {dtype} depends on the order of combination")
    if dtype.itemsize > 8 * (2 if dtype.kind == "c" else 1):
        raise TypeError(f"reproducible sums take float16, bfloat16, float32 and float64 "
                        f"(and their complex), not {dtype}")
    return True


def _reproducible(comm, call: _Call, check, ranks_per_node, inner, tuning, selection):
    """``allreduce(..., reproducible=True)`` of a validated call (see
    :mod:`~mpi_allreduce.reproducible`); its two all-reduces are bound once
    per shape, with the caller's algorithm and options."""
    from . import reproducible

    # the inner calls carry the caller's dtype and op in their spec: ranks
    # that disagree about them must not meet in the inner calls' messages
    salt = f"reproducible/{dtype_label(call.recv.dtype)}/{call.op.stable}"

    def bind(send, recv, name):
        inner_call, _ = _setup(send, recv, name, comm, call.algorithm, check, None,
                               ranks_per_node, inner, tuning, selection, salt)
        return _runner(context_for(comm), inner_call)

    try:
        reproducible.allreduce(call.send, call.recv, comm, call.backend, bind,
                               (call.algorithm, ranks_per_node, inner, id(tuning), selection,
                                salt), context_for(comm).work)
        if call.op.finalize is not None:
            call.backend.ufunc(call.op.finalize)(call.recv, comm.Get_size(), out=call.recv)
    except Exception as exc:  # noqa: BLE001 - after messages started
        failed(comm, exc, "reproducible sum")
    return call.recv


def iallreduce(sendbuf, recvbuf=None, op=MPI.SUM, *, comm: MPI.Intracomm = MPI.COMM_WORLD,
               algorithm: str = "auto", check: Optional[bool] = None,
               segment_size: Optional[int] = None, ranks_per_node: Optional[int] = None,
               inner: Optional[str] = None, tuning=None) -> Request:
    """Start an all-reduce and return at once: a :class:`~.progress.Request`
    whose ``wait()`` returns ``recvbuf`` once the result is there (``test()``
    asks without waiting).  Arguments as :func:`allreduce`; ``auto`` uses the
    decision table.  The buffers must not be touched until the request is
    complete.  Many calls may be in flight on one communicator; every rank
    starts them in the same order and may wait for them in any order."""
    request = _request(sendbuf, recvbuf, op, comm, algorithm, check, segment_size,
                       ranks_per_node, inner, tuning, persistent=False)
    request._begin()
    return request


def allreduce_init(sendbuf, recvbuf=None, op=MPI.SUM, *, comm: MPI.Intracomm = MPI.COMM_WORLD,
                   algorithm: str = "auto", check: Optional[bool] = None,
                   segment_size: Optional[int] = None, ranks_per_node: Optional[int] = None,
                   inner: Optional[str] = None, tuning=None) -> PersistentRequest:
    """Set up an all-reduce of these buffers once (MPI-4's
    ``MPI_Allreduce_init``): ``start()`` it, ``wait()`` for it, as often as
    needed, then ``free()`` it.  Each start reduces the buffers' contents at
    that moment.  The schedule, its compiled stages, its scratch and (for
    host buffers) MPI persistent requests are made here once; this is the
    fastest way to repeat a call."""
    return _request(sendbuf, recvbuf, op, comm, algorithm, check, segment_size,
                    ranks_per_node, inner, tuning, persistent=True)


def _request(sendbuf, recvbuf, op, comm, algorithm, check, segment_size, ranks_per_node, inner,
             tuning, persistent: bool) -> Request:
    call, _ = _setup(sendbuf, recvbuf, op, comm, algorithm, check, segment_size,
                     ranks_per_node, inner, tuning, "table")
    kind = PersistentRequest if persistent else Request
    if call.recv.size == 0 or comm.Get_size() == 1:
        setup(comm)
        return kind(progress.local_operation(call.backend, call.send, call.recv), call.recv)
    context = context_for(comm)
    plan = plan_for(context, call, choice(context, call, call.recv.size))
    bound = plan.bind(call.send, call.recv, request=True)
    operation = progress.operation(bound, context, call.recv.nbytes, persistent)
    if persistent:
        return progress.persistent_request(operation, call.recv, (bound,))
    return Request(operation, call.recv, (bound,))


def _setup(sendbuf, recvbuf, op, comm, algorithm, check, segment_size, ranks_per_node, inner,
           tuning, selection, salt: str = ""):
    """Validate a call (the same checks on every rank, before any message);
    in check mode, also agree with the other ranks on its whole spec.
    (call, checking)."""
    checking = _check_enabled(check)
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an MPI intra-communicator, got {comm!r}")
    try:
        call = _validate(sendbuf, recvbuf, op, algorithm, segment_size, ranks_per_node, inner,
                         tuning, selection)._replace(salt=salt)
        error = None
    except (TypeError, ValueError) as exc:
        if not checking or comm.Get_size() == 1:
            raise
        call, error = None, exc
    if checking and comm.Get_size() > 1:
        context = context_for(comm)
        agree(comm, _fingerprint(call), error, "allreduce")
        # then what the call will run (collective where the node map is made)
        agree(comm, _resolved(context, call), None, "allreduce")
    return call, checking


def setup(comm: MPI.Intracomm) -> None:
    """Do now what the first call on ``comm`` would: duplicate it (the
    library's private communicator) and find whether its node is
    oversubscribed -- both collective over ``comm``.  Call it on every rank
    from one thread before threads start calls on their own communicators
    (concurrent first uses on several communicators can deadlock in the MPI
    library's communicator creation), or to keep that cost out of a timed
    first call.  A communicator of one rank needs none."""
    if comm.Get_size() > 1:
        context_for(comm)


def choice(context: Context, call: _Call, count: int) -> str:
    """The algorithm the table runs for this call (``auto`` resolved)."""
    if call.algorithm != "auto":
        return call.algorithm
    nbytes = count * call.recv.dtype.itemsize
    name = call.tuning.choose(nbytes, context.size, context.oversubscribed)
    return name if call.op.commutative else registry.in_rank_order(name)


def spec_of(context: Context, call: _Call, name: str) -> CallSpec:
    """The spec of ``call`` run with algorithm ``name`` on ``context``
    (hierarchical's options resolved by
    :func:`~mpi_allreduce.selection.hierarchical_options`)."""
    count, dtype = call.recv.size, call.recv.dtype
    options = ()
    if name == "hierarchical":
        options = _selection.hierarchical_options(
            context.nodes(call.ranks_per_node), call.inner, count * dtype.itemsize, call.tuning,
            context.oversubscribed, call.op.commutative)
    return CallSpec("allreduce", name, context.size, count, dtype_label(dtype), call.op.stable,
                    call.segment_size, options, salt=call.salt)


def plan_for(context: Context, call: _Call, name: str) -> Plan:
    """The plan of algorithm ``name`` for this call's spec, from the context's cache."""
    spec = spec_of(context, call, name)
    datatype = call.datatype
    key = (spec, call.op.identity, call.backend, None if datatype is None else datatype.py2f())

    def build():
        schedule = registry.schedule(name, context.comm.Get_rank(), context.size, spec.count,
                                     spec.segment_size, spec.options)
        return Plan(context.comm, schedule, call.recv.dtype, call.op, call.backend, spec,
                    datatype=datatype)
    return context.plan(key, build)


def _runner(context: Context, call: _Call):
    """What runs this call on these arrays: the bound plan of the chosen
    algorithm, or under live selection a small loop around the selector."""
    send, recv = call.send, call.recv
    name = choice(context, call, recv.size)
    if call.algorithm != "auto" or call.selection == "table" or \
            recv.nbytes < LIVE_MIN_BYTES:
        bound = plan_for(context, call, name).bind(send, recv)
        return progress.blocking(bound, context, "allreduce")
    shape = (recv.size, dtype_label(recv.dtype), call.op.identity, call.backend, call.segment_size)
    selector = context.selectors.get(shape)
    if selector is None:
        selector = context.selectors[shape] = _selection.LiveSelector(
            context.comm, name, registry.FLAT_ALGORITHMS if call.op.commutative
            else tuple(a for a in registry.FLAT_ALGORITHMS if a in registry.ORDERED))
    bound = {}
    clock = time.perf_counter
    n = counted = 0  # calls made, calls told to the selector
    due = 1  # the next call that times, probes or follows a move; the others just run
    name = step = None  # the current algorithm and its bound call

    def bound_run(chosen):
        run = bound.get(chosen)
        if run is None:
            b = plan_for(context, call, chosen).bind(send, recv)
            run = bound[chosen] = progress.blocking(b, context, "allreduce")
        return run

    def run():
        nonlocal n, counted, due, name, step
        n += 1
        if n < due:  # most calls: the current algorithm, untimed
            step()
            return
        start = clock()  # a first call pays for its plan: it is counted
        probe = selector.probe
        if probe is not None:
            bound_run(probe)()
            selector.observe(probe, clock() - start)
            counted += 1
        else:
            if name != selector.current:
                name, step = selector.current, bound_run(selector.current)
            step()
            # this timed call stands for the untimed ones since the last
            selector.tick(clock() - start, n - counted)
            counted = n
        due = n + 1 if selector.probe is not None or name != selector.current else n + SAMPLE
    return run


class _Remembered:
    """A bound call kept for repeats with the very same argument objects
    (one per receive buffer: the last call made with it; ``extra``: its
    optional arguments, None when it had none).

    An id names one live object: the op and comm objects are held here,
    the buffers by weak references whose death drops the entry (before an
    id can be reused).  The bound call holds views of the buffers, so numpy
    cannot resize them in place; their dtype is rechecked on every call
    (assigning ``dtype`` reinterprets an array in place), and a reshaped
    buffer is the same memory, which the views still cover.  Buffers that
    are not C-contiguous, or read-only, were refused when first seen."""

    __slots__ = ("run", "dtype", "in_place", "send", "op", "comm", "algorithm", "extra", "refs",
                 "ours")

    def abandoned(self) -> bool:
        """Whether the caller holds none of the buffers any more: only the
        bound call's views keep them alive (then they are dropped)."""
        for ref, ours in zip(self.refs, self.ours):
            buf = ref()
            # the references: ours, this frame's ``buf`` and getrefcount's argument
            if buf is None or sys.getrefcount(buf) - 2 <= ours:
                return True
        return False


def _refcounts(call: _Call) -> list:
    return [sys.getrefcount(b) for b in (call.recv, call.send) if b is not None]


def _remember(context: Context, run, sendbuf, recvbuf, op, comm, algorithm,
              call: _Call, ours: list, extra) -> None:
    """Keep the bound call for repeats; drop those whose buffers the caller
    has let go (the bound views would keep them alive otherwise)."""
    for key, old in list(context.calls.items()):
        if old.ours is not None and old.abandoned():
            context.forget(key, old)
    if recvbuf is not call.recv or (call.send is not None and sendbuf is not call.send):
        return  # converted on the way in (a list, a foreign device array): no identity
    kept = _Remembered()
    key = id(recvbuf)

    def forget(ref):  # a buffer dies: its entry goes before its id can be reused
        entry = context.calls.get(key)  # (no reference to ``kept`` here: no cycle)
        if entry is not None and ref in entry.refs:
            context.forget(key, entry)

    try:
        # (in the order of ``ours``: see _refcounts)
        buffers = (recvbuf,) if call.send is None else (recvbuf, sendbuf)
        kept.refs = [weakref.ref(b, forget) for b in buffers]
    except TypeError:  # an array type without weak references
        return
    kept.run, kept.op, kept.comm, kept.algorithm, kept.extra = run, op, comm, algorithm, extra
    kept.dtype, kept.in_place, kept.send = recvbuf.dtype, call.send is None, id(sendbuf)
    #: references the bound call holds on each buffer (recv, send); live
    #: selection binds more later, so its entries are only evicted by age
    kept.ours = ours if call.selection == "table" or call.algorithm != "auto" else None
    context.remember(key, kept)


def _check_enabled(check: Optional[bool]) -> bool:
    return environment().check if check is None else bool(check)


def _validate(sendbuf, recvbuf, op, algorithm, segment_size, ranks_per_node, inner,
              tuning, selection) -> _Call:
    op = resolve_op(op)
    algorithm = registry.check_name(algorithm)
    if algorithm in ("auto", "hierarchical"):
        try:
            tuning = _selection.tuning_table(tuning)
        except OSError as exc:
            raise ValueError(f"cannot read the decision table: {exc}") from None
    else:
        tuning = None
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

    if segment_size is None:
        segment_bytes = environment().segment_bytes or DEFAULT_SEGMENT_BYTES
        segment_size = max(1, segment_bytes // dtype.itemsize)
    if not isinstance(segment_size, (int, np.integer)) or segment_size < 1:
        raise ValueError(f"segment_size must be a positive integer, got {segment_size!r}")
    return _Call(send, recv, op, algorithm, backend, int(segment_size), ranks_per_node, inner,
                 tuning, selection, datatype)


def _check_order(op: Op, algorithm: str) -> None:
    """A non-commutative op runs only where operands combine in rank order."""
    if not op.commutative and algorithm != "auto" and registry.get(algorithm).COMMUTATIVE:
        raise ValueError(
            f"algorithm {algorithm!r} needs a commutative op and {op.name!r} is not; "
            f"choose one that combines in rank order: {', '.join(registry.ORDERED)}")


def _fingerprint(call: Optional[_Call]):
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


def _resolved(context: Context, call: _Call) -> dict:
    """What check mode compares next: the spec the call runs (the decision
    table's choice, hierarchical's options), where the table decides."""
    if not call.recv.size or (call.algorithm == "auto" and call.selection == "live"):
        return {}
    return spec_of(context, call, choice(context, call, call.recv.size)).fields()


def agree(comm: MPI.Intracomm, fingerprint: Optional[dict], error: Optional[Exception],
          what: str) -> None:
    """Exchange argument fingerprints (None where this rank rejected its
    input with ``error``); raise the same error on every rank if they differ."""
    mine = (fingerprint, None if error is None else f"{type(error).__name__}: {error}")
    everyone = context_for(comm).comm.allgather(mine)
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


def ranks_per_node_setting(value):
    """The node-size override: the argument, else the environment, else None."""
    if value is None:
        value = environment().ranks_per_node
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {value!r}")
    return value
