"""The public calls: ``allreduce()``, ``iallreduce()``, ``allreduce_init()``.

A call goes one way: validate the arguments (:mod:`~mpi_allreduce.validate`:
the same checks on every rank, before any message; ``check=True`` agrees)
-> the communicator's :class:`~mpi_allreduce.context.Context` -> the
algorithm, the call's :class:`~mpi_allreduce.spec.CallSpec` (whose
fingerprint gives the tags and what ``check=True`` compares) and its
:class:`~mpi_allreduce.executor.Plan` (:mod:`~mpi_allreduce.planner`) ->
the plan bound to the caller's arrays -> the engine
(:mod:`~mpi_allreduce.progress`: the re-entry guard, the watchdog) -> MPI.
The bound call is kept by the identity of the arguments
(:func:`~mpi_allreduce.context.remember_call`), so a repeat with the very
same objects (a training loop, a benchmark) is a dictionary look-up, a few
identity checks and the compiled steps.
"""

from __future__ import annotations

import threading
from typing import NoReturn, Optional

import numpy as np
from mpi4py import MPI

from . import progress, validate as _validate
from .buffers import in_place, names_memory
from .config import KERNELS_ENV, environment
from .context import (CALLS, broken_by, cached_context, context_for, refcounts, remember_call,
                      setup, typed)
from .errors import OWN_ERRORS, ArgumentMismatch, Stalled, failed
from .ops import dtype_label
from .planner import choice, plan_for, resolved, runner
from .progress import PersistentRequest, Request
from .selection import DecisionTable
from .options import DEFAULT_SEGMENT_BYTES, Options, options as resolve
from .validate import Call, agree, arguments

__all__ = ["allreduce", "iallreduce", "allreduce_init", "setup", "ArgumentMismatch",
           "DEFAULT_SEGMENT_BYTES"]

def allreduce(sendbuf, recvbuf=None, op=MPI.SUM, *, comm: MPI.Intracomm = MPI.COMM_WORLD,
              algorithm: str = "auto", **options):
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
        ``"auto"`` or one of :data:`~mpi_allreduce.ALGORITHMS`.

    Other Parameters
    ----------------
    **options
        The options below, by keyword; each one left out (or None) takes its
        environment setting.  Every entry point takes them the same way and
        resolves them once, in one place
        (:func:`~mpi_allreduce.options.options`): a name no call takes, or
        one the algorithm does not use, is a ``TypeError``.
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
    radix : int, optional
        ``recursive_multiplying`` and ``knomial`` only: the group size k
        (at least 2; default 4; lowered to p on fewer ranks).
    row_size : int, optional
        ``torus`` only: the ranks in a row of its grid (consecutive ranks);
        it must divide the communicator's size (a ``ValueError`` on every
        rank otherwise).  Default: the divisor nearest sqrt(p).
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
    try:  # (whatever leaves the call on this rank: left)
        kept = CALLS.get(id(recvbuf))  # a repeat with the very same objects: Remembered.repeats,
        if (kept is not None and kept.send == id(sendbuf) and kept.op is op  # inline (the
                and (kept.comm is comm or kept.comm == comm)  # latency-critical path)
                and kept.algorithm == algorithm and recvbuf.dtype is kept.dtype
                # (Remembered.unchanged, inline: the layout as the first call found it)
                and (flags := recvbuf.flags).c_contiguous and (flags.writeable or not kept.host)
                and (kept.in_place or sendbuf.dtype is kept.dtype
                     and sendbuf.flags.c_contiguous)
                and (kept.extra == typed(options) if options else kept.extra is None)):
            try:
                kept.run()
            except Exception as exc:  # noqa: BLE001 - after messages started
                failed(kept.comm, exc, kept.algorithm)
            return recvbuf

        opts = resolve("allreduce", algorithm=algorithm, **options)
        call = _setup(sendbuf, recvbuf, op, comm, opts)
        exact = opts.reproducible and _order_matters(call)
        # (no short cut for an empty call on several ranks: its messages,
        # empty, carry its spec like any call's, so a rank whose count
        # differs from its peers' stalls there instead of skipping a call
        # its peers make, and meeting their next call with its own:
        # docs/guarantees.md)
        if comm.Get_size() == 1:
            if call.send is not None:
                call.backend.device_synchronize()  # the caller's other streams may still write it
                call.backend.copy(call.recv, call.send)
            return call.recv
        context = context_for(comm)
        held = refcounts(call)
        # (the plan too: an option resolved against the communicator -- a
        # torus row that does not divide it -- is refused there)
        run = _reproducible(comm, call) if exact else runner(context, call)
        if not opts.check:
            # counted first: arguments already pushed for a call would count too
            ours = [after - before for before, after in zip(held, refcounts(call))]
            remember_call(context, run, sendbuf, recvbuf, op, comm, algorithm, call, ours,
                          typed(options))
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - after messages started
            failed(comm, exc, "reproducible sum" if exact else call.algorithm)
        return call.recv
    except BaseException as exc:
        left(comm, exc)


def _order_matters(call: Call) -> bool:
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


def _reproducible(comm, call: Call):
    """What runs ``allreduce(..., reproducible=True)`` of a validated call
    (see :mod:`~mpi_allreduce.reproducible`), kept for repeats as the other
    calls are; its two all-reduces are bound once per shape, with the
    caller's algorithm and options."""
    from . import reproducible

    # the inner calls carry the caller's dtype and op in their spec: ranks
    # that disagree about them must not meet in the inner calls' messages
    salt = f"reproducible/{dtype_label(call.recv.dtype)}/{call.op.stable}"
    kept = context_for(comm).work
    # (the table by its content: an id could be a dead dict's, reused)
    table = call.tuning.digest if isinstance(call.tuning, DecisionTable) else call.tuning
    inner_options = call.options.but(segment_size=None, reproducible=False)
    key = (inner_options.but(tuning=table), salt)
    # (no reference to ``call`` is kept: the kept call's references to the
    # buffers are counted, see remember_call)
    send, recv, backend, finalize = call.send, call.recv, call.backend, call.op.finalize
    size = comm.Get_size()

    def bind(send, recv, name):
        return runner(context_for(comm), _setup(send, recv, name, comm, inner_options, salt))

    def run():
        # (numba's import inside the guard too: an interrupt there breaks the
        # communicator, as one anywhere in the call does)
        reproducible.allreduce(send, recv, comm, backend, bind, key, kept, kernels_for(backend))
        if finalize is not None:
            backend.ufunc(finalize)(recv, size, out=recv)
    # guarded as a whole: its work arrays are shared by its calls of one
    # shape, and an interrupt between its two all-reduces breaks the
    # communicator as one inside them would
    return progress.guarded(context_for(comm), ("reproducible sum", None), run)


def kernels_for(backend):
    """The reproducible sum's passes for ``backend``'s arrays: numba's fused
    ones (``mpi_allreduce.kernels``) for host arrays where
    ``MPI_ALLREDUCE_KERNELS`` allows them and numba imports, else None
    (numpy's passes)."""
    choice = environment().kernels
    if choice == "numpy" or backend.device or backend.xp is not np:
        return None
    try:
        from . import kernels
    except Exception as exc:  # noqa: BLE001 - (numba's import cut short by an interrupt
        # leaves it half there: AttributeError) numpy's passes, the same bytes
        if choice == "numba":
            raise ImportError(f"{KERNELS_ENV}=numba, but numba does not import ({exc}): "
                              "pip install 'mpi_allreduce[numba]'") from exc
        return None
    return kernels


def iallreduce(sendbuf, recvbuf=None, op=MPI.SUM, *, comm: MPI.Intracomm = MPI.COMM_WORLD,
               algorithm: str = "auto", **options) -> Request:
    """Start an all-reduce and return at once: a :class:`~.progress.Request`
    whose ``wait()`` returns ``recvbuf`` once the result is there (``test()``
    asks without waiting).  Arguments as :func:`allreduce`, but ``auto``
    chooses by the decision table whatever ``selection`` says (live
    selection times blocking calls), and ``reproducible=True`` is refused
    where it would change the result (a float sum: use the blocking
    :func:`allreduce`).  The buffers must not be touched until the request
    is complete.  Many calls may be in flight on one communicator; every
    rank starts them in the same order and may wait for them in any order."""
    try:  # (whatever leaves the call on this rank: left)
        kept = CALLS.get((_NONBLOCKING, id(recvbuf)))  # a repeat with the very same objects
        if kept is not None and kept.repeats(sendbuf, recvbuf, op, comm, algorithm,
                                             typed(options)):
            request = kept.run()
            if request is not None:  # (None: its last call is in flight or not yet waited)
                return request
        opts = resolve("request", algorithm=algorithm, **options)
        return _request(sendbuf, recvbuf, op, comm, opts, persistent=False, extra=options)
    except BaseException as exc:
        left(comm, exc)


def allreduce_init(sendbuf, recvbuf=None, op=MPI.SUM, *, comm: MPI.Intracomm = MPI.COMM_WORLD,
                   algorithm: str = "auto", **options) -> PersistentRequest:
    """Set up an all-reduce of these buffers once (MPI-4's
    ``MPI_Allreduce_init``): ``start()`` it, ``wait()`` for it, as often as
    needed, then ``free()`` it.  Each start reduces the buffers' contents at
    that moment.  The schedule, its compiled stages, its scratch and (for
    host buffers) MPI persistent requests are made here once; this is the
    fastest way to repeat a call.  Arguments as :func:`iallreduce`."""
    try:  # (whatever leaves the call on this rank: left)
        opts = resolve("request", algorithm=algorithm, **options)
        return _request(sendbuf, recvbuf, op, comm, opts, persistent=True)
    except BaseException as exc:
        left(comm, exc)


def empty_call(comm: MPI.Intracomm, what: str) -> None:
    """An empty all-reduce on ``comm`` standing for a call of nothing (a
    ``Fusion`` step of no arrays, a torch call given no tensors; ``what``:
    its salt, so it meets only its own kind): no short cut either, so a
    rank whose call is empty where its peers' is not stalls with them
    instead of meeting their next call with its own."""
    # (of integers: the same on every rank whatever the environment's options
    # say, a reproducible sum's included, which refuses non-blocking float sums)
    _request(MPI.IN_PLACE, np.empty(0, np.int32), "sum", comm, resolve("request"),
             persistent=False, salt=what).wait()


#: the salt of the empty call that a refused call makes (see refused)
REFUSED = "refused"


def _refusals_call(comm) -> None:
    """The empty call a refusal makes (salt :data:`REFUSED`): a blocking
    one, whose tag comes from its spec -- a call refused for want of tags
    (``TagsExhausted``) could take none for a non-blocking one."""
    call = _setup(MPI.IN_PLACE, np.empty(0, np.int32), "sum", comm, resolve("allreduce"),
                  REFUSED)
    runner(context_for(comm), call)()


def refused(comm, exc: Exception) -> NoReturn:
    """Raise ``exc``, the refusal of a call on this rank before any message
    (its arguments or its options): on a communicator of several ranks,
    after an empty call of its own (a blocking one, salt :data:`REFUSED`)
    -- a refusal is no short cut either.  Where every rank
    refuses the call (the same bad input everywhere) their empty calls meet
    and every rank raises its own error; where only some ranks do, their
    empty calls stall with their peers' real call (reported; the
    :class:`~mpi_allreduce.errors.Stalled` raised here says why, its cause
    the refusal) instead of their next call meeting the peers' refused one
    (before: a wrong result on both).  ``check=True``'s verdict, which every
    rank reached together, is raised at once.  An interrupt before the
    empty call's guard breaks the communicator (as :func:`left` does)."""
    if isinstance(exc, ArgumentMismatch) or not isinstance(comm, MPI.Intracomm) \
            or comm == MPI.COMM_NULL or comm.Get_size() == 1 \
            or getattr(_DEFERRED, "on", False):
        raise exc
    try:
        context = cached_context(comm)
        if context is not None and context.broken is not None:
            raise exc  # (it makes no call again: no later call can meet a peer's)
        _refusals_call(comm)
    except Stalled as stall:
        if stall is exc:
            raise
        raise Stalled(f"{stall} -- this rank refused the call ({type(exc).__name__}: {exc}), "
                      "its peers made it") from exc
    except Exception as other:  # (check mode's verdict on the empty calls, say)
        if other is exc:
            raise
        raise other from exc
    except BaseException as interrupt:  # (before the empty call's guard: see left)
        broken_by(comm, interrupt, "a refused call, interrupted before its empty call")
        raise
    exc.refused_everywhere = True  # (see refused_everywhere)
    raise exc


def left(comm, exc: BaseException) -> NoReturn:
    """The one handler of an exception that leaves a call of the library on
    this rank (every entry point's ``except BaseException``; the drop-in
    ``Comm``, ``Fusion`` and the torch backend's calls too).  Raised as it
    is: the library's own errors (:data:`~mpi_allreduce.errors.OWN_ERRORS`,
    each dealt with where raised), a refusal every rank made, and anything
    on a communicator already broken (a call's guard breaks it for whatever
    leaves the call once its messages may be in flight).  An interrupt (a
    ``BaseException`` that is not an ``Exception``: ``KeyboardInterrupt``,
    ``SystemExit``...) that came before the guard breaks the communicator
    here (:func:`~mpi_allreduce.context.broken_by`): this rank did not make
    a call its peers make, and its next call must never meet theirs.  Any
    other exception is this rank's refusal of the call, whatever its type
    (:func:`refused`: an empty call of its own first).  An interrupt that
    lands while this runs breaks the communicator too."""
    try:
        if isinstance(exc, OWN_ERRORS) or refused_everywhere(exc):
            raise exc
        context = cached_context(comm)
        if context is not None and context.broken is not None:
            raise exc
        if not isinstance(exc, Exception):
            broken_by(comm, exc, "a call interrupted before its messages")
            raise exc
        refused(comm, exc)
    except BaseException as raised:
        if raised is not exc and not isinstance(raised, Exception):
            # (an interrupt as this rank's refusal was being handled: it may
            # have made no empty call, its peers are in the call)
            broken_by(comm, raised, "a call interrupted as it was refused")
        raise


def refused_everywhere(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal that every rank made (:func:`refused`:
    their empty calls met), so the communicator is as it was."""
    return getattr(exc, "refused_everywhere", False)


#: on this thread, refusals are raised with no empty call (``on``): the
#: drop-in Comm tries the library first and, where it refuses, reads the
#: buffers as mpi4py does, or refuses for good (then :func:`refused` itself)
_DEFERRED = threading.local()


#: the kind of a kept non-blocking call in :data:`~mpi_allreduce.context.CALLS`
_NONBLOCKING = "iallreduce"


def _request(sendbuf, recvbuf, op, comm, opts: Options, persistent: bool, salt: str = "",
             extra: Optional[dict] = None) -> Request:
    """A non-blocking call, started, or (``persistent``) a persistent one,
    not started (``salt``: what else its spec must carry, see CallSpec;
    ``extra``: the keywords it was given, kept with a non-blocking call for
    its repeats)."""
    if persistent and sendbuf is not None and not in_place(sendbuf, recvbuf) \
            and not names_memory(sendbuf):
        # (a list or another array-like: made into an array once, here, so
        # every start would reduce its first contents)
        raise TypeError(f"a persistent call reads its send buffer at each start: give an "
                        f"array, a buffer or a message spec, not a {type(sendbuf).__name__}")
    call = _setup(sendbuf, recvbuf, op, comm, opts, salt)
    if opts.reproducible and _order_matters(call):
        raise ValueError("reproducible=True makes a float sum a blocking call: use "
                         "allreduce(..., reproducible=True)")
    kind = PersistentRequest if persistent else Request
    if comm.Get_size() == 1:
        setup(comm)
        request = kind(progress.local_operation(call.backend, call.send, call.recv), call.recv)
        if not persistent:
            request._begin()
        return request
    context = context_for(comm)
    plan = plan_for(context, call, choice(context, call, call.recv.size))
    held = refcounts(call)
    bound = plan.bind(call.send, call.recv, request=True, datatype=call.datatype)
    operation = progress.operation(bound, context, call.recv.nbytes, persistent)
    counted = context.counted(persistent)
    try:  # from the tag's claim to the hand-over: see progress.broken_if_counted
        progress.claim(operation, bound, context, persistent)
        if persistent:
            return PersistentRequest(operation, call.recv, (bound,))
        if not opts.check and extra is not None:  # kept: its bound call, scratch and operation
            restart = progress.restarter(operation, context, call.recv)
            ours = [after - before for before, after in zip(held, refcounts(call))]
            # (kept, its scratch stays with the call until the call is dropped)
            operation.kept = remember_call(
                context, restart, sendbuf, recvbuf, op, comm, opts.algorithm, call, ours,
                typed(extra), kind=_NONBLOCKING,
                release=progress.kept_scratch_back(operation, bound))
        request = Request(operation, call.recv, (bound,))
        request._begin()
        return request
    except BaseException as exc:
        progress.broken_if_counted(context, persistent, counted, exc,
                                   f"the start of a {operation.kind}")
        raise


def _setup(sendbuf, recvbuf, op, comm, opts: Options, salt: str = "") -> Call:
    """Validate a call (the same checks on every rank, before any message);
    in check mode, also agree with the other ranks on its whole spec."""
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an MPI intra-communicator, got {comm!r}")
    try:
        call = _validate.validate(sendbuf, recvbuf, op, opts)._replace(salt=salt)
        error = None
    except Exception as exc:  # noqa: BLE001 - any refusal, of any type
        if not opts.check or comm.Get_size() == 1 or isinstance(exc, OWN_ERRORS):
            raise
        call, error = None, exc
    if opts.check and comm.Get_size() > 1:
        context = context_for(comm)
        agree(comm, arguments(call), error, "allreduce")
        try:
            # then what the call will run (collective where the node map is
            # made; a user op is tried on this rank only: an interrupt there
            # leaves this rank between two collectives its peers make); an
            # option refused there (a torus row that does not divide the
            # ranks) is every rank's verdict too
            try:
                spec, refusal = resolved(context, call), None
            except Exception as exc:  # noqa: BLE001 - any refusal, of any type
                if isinstance(exc, OWN_ERRORS):
                    raise
                spec, refusal = None, exc
            agree(comm, spec, refusal, "allreduce", "check-spec")
        except ArgumentMismatch:
            raise  # (every rank raises it at this step)
        except BaseException as exc:
            context.breaks(exc, "check=True's agreement on what the call runs")
            raise
    return call
