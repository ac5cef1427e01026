"""A drop-in communicator: mpi4py code switches with one line.

    comm = mar.Comm(MPI.COMM_WORLD)          # was: comm = MPI.COMM_WORLD
    comm.Allreduce(sendbuf, recvbuf, MPI.SUM)  # now runs our algorithms

:class:`Comm` *is* an ``MPI.Intracomm`` (the same communicator handle), so
everything else -- point-to-point, other collectives, attributes, passing
it to other libraries -- is the underlying communicator's.  Its
``Allreduce``, ``Iallreduce``, ``Allreduce_init``, ``Reduce_scatter_block``,
``Reduce_scatter`` and ``Allgather`` take mpi4py's arguments (buffers,
message specs, ``MPI.IN_PLACE``/``None``, ops) and run
:func:`~mpi_allreduce.allreduce`, :func:`~mpi_allreduce.iallreduce`,
:func:`~mpi_allreduce.allreduce_init`,
:func:`~mpi_allreduce.reduce_scatter` and :func:`~mpi_allreduce.allgather`
with the options given to the constructor.  ``Dup``, ``Split``,
``Split_type``, ``Create`` and ``Create_group`` return wrapped
communicators with the same options.

Buffers are read as mpi4py reads them.  What this library takes as it is
-- arrays and buffers (C- or Fortran-contiguous, the latter in memory
order, as mpi4py takes them), message specs of them or of no buffer
(``[None, MPI.INT]``: no elements) however mpi4py lets them be spelt (a
datatype, a typecode, or none: ``[buf, MPI.DOUBLE]``, ``[buf, "d"]``,
``[buf, 8]`` and ``buf`` are one call, see
:func:`~mpi_allreduce.buffers.spelt`), ``MPI.IN_PLACE`` or ``None`` --
runs here; anything else goes to the underlying communicator's own
method, so mpi4py parses it and answers as it does: a list or ``None`` as
receive buffer, a strided array, send and receive datatypes or counts
that differ, a datatype with gaps, a receive buffer that cannot be
written, the send buffer given again as the receive buffer; and ops this
library does not reduce on the type given (a non-commutative op, for the
reduce-scatters).  Either way no result is lost and the exception, where
there is one, is mpi4py's.  (This library also takes what some MPIs
refuse: a predefined op on a contiguous derived datatype.)

Which way a call goes is thus a matter of what the call is, not of how
its buffers are spelt.  A call handed to mpi4py first has its ranks agree
on it (one watched ``MPI_Iallgather`` on the library's communicator of a
digest of the kind, op, counts and type signatures, see
:meth:`Comm._agreed`): ranks that disagree all raise
:class:`~mpi_allreduce.ArgumentMismatch` before MPI's collective is
posted, where MPI's own would give them wrong numbers.  The receive
counts that ``Reduce_scatter`` exchanges when given none are exchanged
the same way, by the library, watched, whichever way the call then goes
(mpi4py's own exchange is a blocking ``MPI_Allgather`` no watchdog sees).
Two costs of that agreement, for calls handed to mpi4py only: the start
of such an ``Iallreduce`` or ``Allreduce_init`` waits for the peers to
start theirs (an MPI start returns at once), and these calls are not
under the library's guard of one call at a time per communicator.

The requests of ``Iallreduce`` and ``Allreduce_init`` are this library's
(:class:`~mpi_allreduce.Request`): they have ``Wait``, ``Test``, ``Start``
and ``Free`` but are not ``MPI.Request`` objects, so wait for lists of
them with :func:`mpi_allreduce.waitall`, not ``MPI.Request.Waitall``.  A
call that went to mpi4py returns the library's request over mpi4py's, so
that its wait is watched too; ranks whose calls go different ways (they
are different calls) travel on two communicators and stall (reported)
instead of meeting.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, NoReturn, Optional

import numpy as np
from mpi4py import MPI

from . import api, collectives, progress
from .context import broken_by, cached_context, setup
from .engine import abandon, blocking_collective, duplicate, wait_for_call
from .backend import backend_for
from .buffers import message, names_memory, own_datatype, spelt
from .errors import OWN_ERRORS, ArgumentMismatch, RequestError
from . import ops
from .ops import check_dtype, resolve_op
from .options import keywords_for, options as resolve_options
from .threads import sheltered

_DEFERRED = api._DEFERRED

__all__ = ["Comm"]

_ndarray = np.ndarray
_IN_PLACE = MPI.IN_PLACE


def _plain(sendbuf, recvbuf) -> bool:
    """Whether the buffers are numpy arrays that this library and mpi4py
    both take, told by their types and one flag (``Allreduce`` spells this
    out inline): a receive array, and in place or a C-contiguous send
    array of its own.  What else they must be (writeable, one dtype...)
    the library checks when it first sees them; where it refuses them,
    :meth:`Comm._route` tells its error from mpi4py's."""
    return type(recvbuf) is _ndarray and (
        sendbuf is None or sendbuf is _IN_PLACE
        or type(sendbuf) is _ndarray and sendbuf is not recvbuf and sendbuf.flags.c_contiguous)


def _left(comm, exc: BaseException) -> NoReturn:
    """:func:`~mpi_allreduce.api.left` for the drop-in's calls: this
    thread's refusals are final again first (an interrupt may have left
    :func:`_deferred` before it said so)."""
    _DEFERRED.on = False
    api.left(comm, exc)


def _deferred(run) -> Optional[Exception]:
    """``run()``, the library's call of plain buffers, whose refusal is not
    yet final (see :meth:`Comm._call`: the buffers may be mpi4py's to read):
    the refusal, or None once it ran."""
    _DEFERRED.on = True
    try:
        run()
    except OWN_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - a refusal of any type
        return exc
    finally:
        _DEFERRED.on = False
    return None


class _Message(NamedTuple):
    """A buffer as mpi4py reads it, and what the library is given for it."""

    given: object  # the caller's object, or a view of its memory in memory order
    array: object  # its elements, as the library views them
    datatype: Optional[MPI.Datatype]  # a message spec's; None for a bare buffer
    per: int  # elements of ``array`` per element of ``datatype``
    count: int  # elements of ``datatype`` (mpi4py's count)


def _message(obj, writable: bool, user_op: bool) -> Optional[_Message]:
    """``obj`` as mpi4py reads it, where this library takes it with the same
    meaning; None where it is mpi4py's to read (or refuse)."""
    obj = spelt(obj)  # ([buf, "d"], [buf, 8]: [buf, MPI.DOUBLE], [buf, 8, MPI.DOUBLE])
    if not names_memory(obj):
        return None  # None, a list of numbers, an int...
    try:
        array = message(obj, user_op).array
    except (TypeError, ValueError):
        return None  # a datatype with gaps, a count that does not fit...
    backend = backend_for(array)
    datatype, given, per = None, obj, 1
    if isinstance(obj, (list, tuple)):
        datatype = obj[-1]
        per = max(datatype.Get_extent()[1] // array.dtype.itemsize, 1)
    elif not backend.is_contiguous(array):
        if array.ndim < 2 or not backend.is_contiguous(array.T):
            return None  # strided: mpi4py refuses it
        # Fortran order: mpi4py takes the memory as it lies, and so do we
        given = array = array.T.reshape(-1)
    elif not array.dtype.isnative:
        return None
    if writable and not backend.is_writeable(array):
        return None
    return _Message(given, array, datatype, per, array.size // per)


def _same_type(send: _Message, recv: _Message) -> bool:
    """Whether mpi4py finds the send and receive datatypes the same (the
    numpy dtypes, for two bare buffers, as this library compares them)."""
    if send.datatype is not None and recv.datatype is not None:
        return send.datatype == recv.datatype
    if send.datatype is None and recv.datatype is None:
        return send.array.dtype == recv.array.dtype
    bare, spec = (send, recv) if send.datatype is None else (recv, send)
    try:
        return MPI.Datatype.fromcode(bare.array.dtype.char) == spec.datatype
    except (KeyError, ValueError):
        return False


def _their_count(obj, blocks: int = 1) -> Optional[int]:
    """How many elements of its datatype mpi4py reads in ``obj`` (a receive
    buffer or spec) for each of ``blocks`` ranks (an allgather's receive
    buffer: the communicator's size; a count a spec gives is per rank
    then, as in mpi4py); None where mpi4py would not read it."""
    obj = spelt(obj)
    if isinstance(obj, (list, tuple)) and len(obj) > 2 and isinstance(obj[-1], MPI.Datatype):
        count = obj[1]  # (given: per rank)
        return int(count) if isinstance(count, (int, np.integer)) and count >= 0 else None
    given = _message(obj, False, False)
    if given is not None:
        whole = given.count
    elif isinstance(obj, (list, tuple)) and len(obj) == 2 and \
            isinstance(obj[1], MPI.Datatype) and obj[1] != MPI.DATATYPE_NULL:
        extent = obj[1].Get_extent()[1]  # ([buf, datatype] of a type with gaps, as mpi4py counts)
        try:
            with memoryview(obj[0]) as view:
                size = view.nbytes
        except TypeError:
            return None
        if extent <= 0 or size % extent:
            return None
        whole = size // extent
    else:
        return None
    return whole // blocks if whole % blocks == 0 else None


def _signature(datatype: MPI.Datatype) -> tuple:
    """A datatype's type signature, as far as a call's ranks must agree on
    it: its bytes of data and the element types they are made of."""
    if datatype == MPI.DATATYPE_NULL:
        return 0, ("null",)  # (mpi4py refuses it)
    try:
        from mpi4py.util import dtlib
        leaves = _leaves(np.dtype(dtlib.to_numpy_dtype(datatype)))
    except (TypeError, ValueError, KeyError):
        leaves = ("?",)
    return datatype.Get_size(), leaves


def _leaves(dtype: np.dtype) -> tuple:
    """The element types of ``dtype`` in the order of their bytes, each as
    often as it occurs (runs counted): its type signature."""
    flat: list = []

    def walk(d: np.dtype) -> None:
        if d.fields:
            for field in sorted(d.fields.values(), key=lambda f: f[1]):
                walk(field[0])
        elif d.subdtype is not None:
            for _ in range(int(np.prod(d.subdtype[1]))):
                walk(d.subdtype[0])
        else:
            flat.append(d.str)
    walk(dtype)
    runs: list = []
    for leaf in flat:
        if runs and runs[-1][0] == leaf:
            runs[-1][1] += 1
        else:
            runs.append([leaf, 1])
    return tuple((leaf, n) for leaf, n in runs)


def _datatype_of(buf) -> Optional[MPI.Datatype]:
    obj = spelt(buf)
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[-1], MPI.Datatype):
        return obj[-1]
    return own_datatype(obj)


def _described(buf, blocks: int = 1, counted: bool = True) -> object:
    """One buffer of a call for mpi4py, as its ranks must agree on it: in
    place, or its count (per rank of ``blocks``; left out where it may
    differ by rank: ``counted`` false) times its type signature."""
    if buf is None or buf is _IN_PLACE:
        return "in place"
    datatype = _datatype_of(buf)
    if datatype is None:
        return type(buf).__name__  # (mpi4py refuses it)
    size, leaves = _signature(datatype)
    if not counted:
        return leaves
    count = _their_count(buf, blocks)
    # (MPI matches count x type signature: 2 doubles and 1 of a type of 2 are one message)
    if count is None:
        return None, leaves
    if len(leaves) == 1:
        return count * size, ((leaves[0][0], leaves[0][1] * count),)
    return count * size, leaves, count


def _runs_python(op) -> bool:
    """Whether MPI's own collective with ``op`` runs a Python function (a
    user-defined ``MPI.Op``'s) inside MPI's calls."""
    return isinstance(op, MPI.Op) and op != MPI.OP_NULL and not op.is_predefined


def _op_described(op, buf=None) -> object:
    """The op as the ranks must agree on it; a user-defined ``MPI.Op`` by
    what it computes on the call's own elements (``buf``'s datatype and
    count: :func:`~mpi_allreduce.ops.spec_label`'s probe, where MPI will
    apply it), since its handle says nothing across ranks."""
    if isinstance(op, MPI.Op):
        if op.is_predefined:
            return "predefined", op.py2f()
        described = ("user-defined", op.Is_commutative())
        datatype = None if buf is None else _datatype_of(buf)
        count = None if buf is None else _their_count(buf)
        if datatype is not None and datatype != MPI.DATATYPE_NULL and count:
            try:
                element = np.dtype((np.void, datatype.Get_extent()[1]))
                described += (ops.behaviour(resolve_op(op), element, datatype, count),)
            except (TypeError, ValueError, MPI.Exception):
                described += ("unprobed",)
        return described
    return repr(op)


class _Routed(NamedTuple):
    send: object  # for the library: the caller's objects, or views of their memory
    recv: object
    counts: Optional[list]  # every rank's block in the library's elements (Reduce_scatter)


class _TheirPersistent:
    """mpi4py's persistent request (``MPI_Allreduce_init`` with buffers as
    mpi4py reads them), each start waited in the library's engine and
    watched as the library's calls are: ``Start``/``Wait``/``Test``/``Free``
    (and the lower-case forms of :class:`~mpi_allreduce.PersistentRequest`)."""

    def __init__(self, prequest, what: str, comm, shelter: bool = False):
        self._prequest, self._what, self._comm = prequest, what, comm
        self._shelter = shelter  # (it runs a user-defined MPI.Op: see Comm._theirs)
        self._started: Optional[progress.Request] = None
        self._abandoned = False

    def Start(self) -> None:  # noqa: N802
        if self._started is not None:
            raise RequestError("start() of a persistent request already active: wait() first")
        setup(self._comm)  # (on a communicator the library broke, it raises as every call does)
        try:
            if self._shelter:
                sheltered(self._prequest.Start)
            else:
                self._prequest.Start()
            self._started = progress.mpi_request([self._prequest], self._what, self._comm,
                                                 shelter=self._shelter)
        except BaseException as exc:  # (started on this rank, or not: its peers cannot tell)
            self._abandoned = True  # (kept: it may be in flight, never freed so)
            broken_by(self._comm, exc, self._what)
            raise

    def _given_up(self) -> None:
        """A wait or test of a start given up on (stalled, interrupted):
        the communicator's error, never a completion MPI has not made."""
        if self._abandoned and self._started is None:
            raise cached_context(self._comm).refusal()

    def Wait(self, status=None) -> bool:  # noqa: N802
        self._given_up()
        if self._started is not None:
            started = self._started
            try:
                started.wait()
            except BaseException:
                # (stalled or left: MPI's request is abandoned with its call, see
                # progress.mpi_request; the next Start raises as the communicator does)
                self._started, self._abandoned = None, True
                raise
            self._started = None
        return True

    def Test(self, status=None) -> bool:  # noqa: N802
        self._given_up()
        if self._started is None:
            return True
        try:
            done = self._started.test()
        except BaseException:
            self._started, self._abandoned = None, True
            raise
        if done:
            self._started = None
        return done

    def Free(self) -> None:  # noqa: N802
        if self._started is not None:
            raise RequestError("free() of a persistent request in flight: wait() first")
        if not self._abandoned:  # (an abandoned one is kept, as the library keeps its own)
            self._prequest.Free()

    start, test, free = Start, Test, Free

    def wait(self):
        self.Wait()

    def __enter__(self) -> "_TheirPersistent":
        return self

    def __exit__(self, *exc) -> None:  # (as the library's own PersistentRequest)
        if self._started is not None and exc[0] is None:
            self.Wait()
        if self._started is None and self._prequest != MPI.REQUEST_NULL and \
                not self._abandoned:
            self.Free()


class Comm(MPI.Intracomm):
    """``MPI.Intracomm`` whose all-reduce family runs this library's algorithms.

    ``Comm(comm, algorithm="auto", **options)``: ``options`` are
    :func:`~mpi_allreduce.allreduce`'s keyword arguments (``check``,
    ``segment_size``, ``ranks_per_node``, ``inner``, ``radix``,
    ``row_size``, ``tuning``, ``selection``, ``reproducible``), checked here
    by the one function every call's are
    (:func:`~mpi_allreduce.options.options`).  Each call is given those that
    apply to it (:data:`~mpi_allreduce.options.APPLIES`): the
    reduce-scatter and allgather take ``check`` and ``segment_size``;
    ``Iallreduce`` and ``Allreduce_init`` refuse ``reproducible`` where it
    would change a float sum.  ``Comm()`` is the null communicator, as
    ``MPI.Intracomm()`` is."""

    def __new__(cls, comm=None, algorithm: str = "auto", **options):
        if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
            comm = None  # the null communicator, as MPI.Intracomm(MPI.COMM_NULL) is
        if comm is not None and not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"Comm wraps an MPI.Intracomm, got {type(comm).__name__}")
        # checked here, once (the same check as every call's)
        algorithm = resolve_options(algorithm=algorithm, **options).algorithm
        self = super().__new__(cls, comm)
        self.algorithm = algorithm
        self.options = dict(options)
        return self

    def __init__(self, comm=None, algorithm: str = "auto", **options):
        super().__init__()

    def __repr__(self) -> str:
        if self == MPI.COMM_NULL:
            return f"<mpi_allreduce.Comm: null, algorithm={self.algorithm!r}>"
        return f"<mpi_allreduce.Comm of {self.Get_size()} ranks, algorithm={self.algorithm!r}>"

    def _wrap(self, comm):
        if comm == MPI.COMM_NULL:
            return comm
        return Comm(comm, self.algorithm, **self.options)

    def _request_options(self) -> dict:
        return keywords_for(self.options, "request")

    # --- the calls that run our algorithms ---------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:  # noqa: N802
        refused = None
        try:  # (whatever leaves the call on this rank: api.left)
            # _plain(), inline: a repeated call comes this way
            if type(recvbuf) is _ndarray and (
                    sendbuf is None or sendbuf is _IN_PLACE or type(sendbuf) is _ndarray
                    and sendbuf is not recvbuf and sendbuf.flags.c_contiguous):
                _DEFERRED.on = True  # (_deferred, inline: a repeated call comes this way)
                try:
                    if self.options:
                        api.allreduce(sendbuf, recvbuf, op, comm=self, algorithm=self.algorithm,
                                      **self.options)
                    else:
                        api.allreduce(sendbuf, recvbuf, op, comm=self, algorithm=self.algorithm)
                    return
                except OWN_ERRORS:
                    raise
                except Exception as exc:  # noqa: BLE001 - a refusal of any type
                    refused = exc
                finally:
                    _DEFERRED.on = False
            self._allreduce(sendbuf, recvbuf, op, refused)
        except BaseException as exc:
            _left(self, exc)

    def _allreduce(self, sendbuf, recvbuf, op, refused) -> None:
        # (apart from Allreduce: its closures would cost every call of it)
        self._call("allreduce", sendbuf, recvbuf, op, None, refused,
                   lambda send, recv, _: api.allreduce(
                       send, recv, op, comm=self, algorithm=self.algorithm, **self.options),
                   lambda: self._theirs("Allreduce", lambda: MPI.Intracomm.Iallreduce(
                       self, sendbuf, recvbuf, op), op))

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):  # noqa: N802
        return self._call("allreduce", sendbuf, recvbuf, op, None, None,
                          lambda send, recv, _: api.iallreduce(
                              send, recv, op, comm=self, algorithm=self.algorithm,
                              **self._request_options()),
                          lambda: self._their_request("Iallreduce", lambda: (
                              MPI.Intracomm.Iallreduce(self, sendbuf, recvbuf, op)), op))

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=None):  # noqa: N802
        return self._call("allreduce", sendbuf, recvbuf, op, None, None,
                          lambda send, recv, _: api.allreduce_init(
                              send, recv, op, comm=self, algorithm=self.algorithm,
                              **self._request_options()),
                          lambda: self._their_request("Allreduce_init", lambda: (
                              MPI.Intracomm.Allreduce_init(
                                  self, sendbuf, recvbuf, op,
                                  MPI.INFO_NULL if info is None else info)), op,
                              persistent=True))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:  # noqa: N802
        try:  # (whatever leaves the call on this rank: _left)
            refused = None
            if _plain(sendbuf, recvbuf):
                refused = _deferred(lambda: collectives.reduce_scatter(
                    sendbuf, recvbuf, op, comm=self, **self._halves_options()))
                if refused is None:
                    return
            self._call("reduce_scatter_block", sendbuf, recvbuf, op, None, refused,
                       lambda send, recv, _: collectives.reduce_scatter(
                           send, recv, op, comm=self, **self._halves_options()),
                       lambda: self._theirs("Reduce_scatter_block",
                                            lambda: MPI.Intracomm.Ireduce_scatter_block(
                                                self, sendbuf, recvbuf, op), op))
        except BaseException as exc:
            _left(self, exc)

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> None:  # noqa: N802
        try:  # (whatever leaves the call on this rank: _left)
            if recvcounts is None and sendbuf is not None and sendbuf is not _IN_PLACE:
                # every rank's block is the size of its receive buffer (as mpi4py
                # has it), exchanged by the library, watched, whichever way the call goes
                recvcounts = self._counts(_their_count(recvbuf))
            refused = None
            if _plain(sendbuf, recvbuf) and recvcounts is not None:
                refused = _deferred(lambda: collectives.reduce_scatter(
                    sendbuf, recvbuf, op, recvcounts, comm=self, **self._halves_options()))
                if refused is None:
                    return
            self._call("reduce_scatter", sendbuf, recvbuf, op, recvcounts, refused,
                       lambda send, recv, counts: collectives.reduce_scatter(
                           send, recv, op, counts, comm=self, **self._halves_options()),
                       lambda: self._theirs("Reduce_scatter",
                                            lambda: MPI.Intracomm.Ireduce_scatter(
                                                self, sendbuf, recvbuf, recvcounts, op), op))
        except BaseException as exc:
            _left(self, exc)

    def Allgather(self, sendbuf, recvbuf) -> None:  # noqa: N802
        try:  # (whatever leaves the call on this rank: _left)
            refused = None
            if _plain(sendbuf, recvbuf):
                refused = _deferred(lambda: collectives.allgather(
                    sendbuf, recvbuf, comm=self, **self._halves_options()))
                if refused is None:
                    return
            self._call("allgather", sendbuf, recvbuf, None, None, refused,
                       lambda send, recv, _: collectives.allgather(
                           send, recv, comm=self, **self._halves_options()),
                       lambda: self._theirs("Allgather", lambda: MPI.Intracomm.Iallgather(
                           self, sendbuf, recvbuf)))
        except BaseException as exc:
            _left(self, exc)

    def _theirs(self, name: str, start, op=None) -> None:
        """mpi4py's own call, in its non-blocking form (``start`` posts it:
        mpi4py reads the buffers and raises as the blocking form would),
        waited in the library's engine: watched by the watchdog like every
        call of the library, never a wait in MPI that nothing reports.
        Where ``op`` is a user-defined ``MPI.Op``, whose Python function MPI
        runs inside its calls (and where mpi4py cannot raise: it ends the
        job), its post and its waits run where no signal handler can raise
        inside that function (:func:`~mpi_allreduce.threads.sheltered`).

        The communicator's set-up comes first (collective, as the library's
        calls' is): where the ranks spell one call's buffers differently,
        some take mpi4py's way and some the library's, and a set-up on some
        ranks only would meet mpi4py's collective on the others (a wrong
        result); set up, the two ways travel on two communicators, never
        meet, and stall (reported)."""
        setup(self)
        shelter = _runs_python(op)
        progress.mpi_request([self._started(start, shelter)], f"MPI_{name} (buffers as "
                             "mpi4py reads them)", self, shelter=shelter).wait()

    def _started(self, start, shelter: bool):
        """``start()``, mpi4py's call posted (``shelter``: see
        :meth:`_theirs`); where mpi4py refuses the buffers (its exception,
        before any message), a refusal of the library's
        (:func:`~mpi_allreduce.api.refused`): no short cut on one rank
        either.  A request handed back as an interrupt lands is kept (MPI
        must not free a collective in flight), and the communicator broken."""
        posted: list = []
        try:
            if shelter:
                sheltered(lambda: posted.append(start()))
            else:
                posted.append(start())
            return posted[0]
        except BaseException as exc:  # (a refusal of any type; an interrupt)
            for request in posted:
                abandon(request)
            _left(self, exc)

    def _their_request(self, name: str, start, op=None, persistent: bool = False):
        """mpi4py's own non-blocking (or, ``persistent``, persistent) call,
        after the communicator's set-up, as :meth:`_theirs` makes it (so
        ranks that spell one call's buffers differently travel on two
        communicators and stall, never meet): its request is the library's,
        waited in the engine and watched -- a rank whose peers took the
        library's way is reported, never left in ``MPI_Wait``."""
        setup(self)
        what = f"MPI_{name} (buffers as mpi4py reads them)"
        shelter = _runs_python(op)
        if persistent:
            return _TheirPersistent(self._started(start, shelter), what, self, shelter)
        return progress.mpi_request([self._started(start, shelter)], what, self,
                                    shelter=shelter)

    def _counts(self, count: Optional[int]) -> Optional[list]:
        """Every rank's receive count (what mpi4py's ``Reduce_scatter``
        exchanges when given none; ``count``: this rank's, None where
        mpi4py would not read its receive buffer), one watched collective
        of the library (``Context.record``); where some rank has none,
        every rank raises :class:`~mpi_allreduce.ArgumentMismatch`."""
        if self.Get_size() == 1:
            return None if count is None else [count]
        setup(self)
        rows = cached_context(self).record(
            "counts", (-1 if count is None else count,),
            "the exchange of Reduce_scatter's receive counts (given none)")
        counts = rows[:, 0]
        if (counts < 0).any():
            raise ArgumentMismatch(
                f"Reduce_scatter without receive counts: rank(s) "
                f"{[int(r) for r in (counts < 0).nonzero()[0]]} gave a receive buffer whose "
                "count mpi4py does not read, so no rank reduced anything")
        return [int(c) for c in counts]

    def _agreed(self, kind: str, sendbuf, recvbuf, op, counts) -> None:
        """Before a call goes to mpi4py (MPI's own collective, which gives
        ranks that disagree wrong numbers or a truncation on one rank), its
        ranks agree on it: a digest of the kind, op, counts and every
        buffer's count and type signature (:func:`_described`), compared in
        one watched collective of the library (``Context.record``); where
        they differ every rank raises
        :class:`~mpi_allreduce.ArgumentMismatch`, and nothing is sent."""
        if self.Get_size() == 1:
            return
        setup(self)
        try:
            counted = None if counts is None else [int(c) for c in counts]
        except (TypeError, ValueError):
            counted = repr(counts)  # (mpi4py refuses them, on every rank that gave them)
        size = self.Get_size()
        whole = recvbuf if sendbuf is None or sendbuf is _IN_PLACE else sendbuf
        # (a reduce-scatter's receive count is each rank's own, in the counts
        # agreed; an allgather's receive spec counts per rank, as in mpi4py)
        described = repr((kind, _op_described(op, whole), _described(sendbuf),
                          _described(recvbuf, size if kind == "allgather" else 1,
                                     counted=kind != "reduce_scatter"),
                          counted))
        digest = int.from_bytes(hashlib.blake2b(described.encode(), digest_size=7).digest(),
                                "little")
        rows = cached_context(self).record(
            "mpi4py", (digest,), f"the agreement on an MPI_{kind} of buffers mpi4py reads")
        other = [r for r in range(rows.shape[0]) if rows[r, 0] != rows[0, 0]]
        if other:
            raise ArgumentMismatch(
                f"{kind} of buffers mpi4py reads: the ranks disagree about the call (its op, "
                f"counts, datatypes or in-place use): rank(s) {other} differ from rank 0; this "
                f"rank has {described}; no rank sent anything")

    def _halves_options(self) -> dict:
        return keywords_for(self.options, "halves")

    # --- buffers as mpi4py reads them ---------------------------------------
    def _call(self, kind: str, sendbuf, recvbuf, op, counts, refused, ours, theirs):
        """Run a call that did not take the plain way (or that the library
        refused there: ``refused``): the library's ``ours(send, recv,
        counts)`` where it takes the buffers with mpi4py's meaning (see
        :meth:`_route`), else mpi4py's own ``theirs()``, which raises
        mpi4py's exception or does what mpi4py does.  The library's error
        stands where it refused the very buffers it would be given again
        (what it refused is not about how they are read: an op it does not
        reduce, say), and so does check mode's verdict, which every rank
        got."""
        try:  # (whatever leaves the call on this rank: api.left)
            routed = self._route(kind, sendbuf, recvbuf, op, counts)
            if routed is None:
                self._agreed(kind, sendbuf, recvbuf, op, counts)
                return theirs()
            if refused is not None and routed.recv is recvbuf and routed.send is sendbuf:
                raise refused  # (final now: api.left makes the refusal's empty call)
            return ours(routed.send, routed.recv, routed.counts)
        except BaseException as exc:
            _left(self, exc)

    def _route(self, kind: str, sendbuf, recvbuf, op, counts) -> Optional[_Routed]:
        """The buffers for the library, where it takes them as mpi4py reads
        them and mpi4py's checks of the call pass; None where mpi4py is to
        read them (or refuse them).  Where this is None the library refuses the same
        buffers before any message, so a refusal of the plain way may be
        handed to mpi4py.  Only local work: ``Reduce_scatter``'s counts,
        where it was given none, were exchanged before."""
        in_place = sendbuf is None or sendbuf is _IN_PLACE
        if sendbuf is recvbuf:
            return None  # mpi4py passes one buffer twice (MPI refuses that)
        user_op = isinstance(op, MPI.Op) and not op.is_predefined
        recv = _message(recvbuf, True, user_op)
        if kind == "allgather" and recv is not None and recv.datatype is not None:
            spec = spelt(recvbuf)
            if len(spec) > 2:  # (a count given: mpi4py's is each rank's block)
                whole = [spec[0], spec[1] * self.Get_size(), *spec[2:]]
                recv = _message(whole, True, user_op)
                recvbuf = whole if recv is not None else recvbuf
        send = None if in_place else _message(sendbuf, False, user_op)
        if recv is None or (send is None and not in_place):
            return None
        if send is not None:
            backend = backend_for(recv.array)
            if backend_for(send.array) is backend and \
                    backend.shares_memory(send.array, recv.array):
                return None  # overlapping buffers: MPI's affair, as in mpi4py
            if kind != "allgather" and not _same_type(send, recv):
                return None  # mpi4py: mismatch in send and receive MPI datatypes
        if kind != "allgather":
            try:
                reduction = resolve_op(op)
                check_dtype(recv.array.dtype, reduction)
            except (TypeError, ValueError):
                return None  # an op, or an op on a type, that this library does not reduce
            if kind != "allreduce" and not reduction.commutative:
                return None  # the ring's reduce-scatter needs a commutative op; MPI's does not
        size = self.Get_size()
        if kind == "allreduce":
            if send is not None and send.count != recv.count:
                return None
        elif kind == "reduce_scatter_block":
            if recv.count % size if send is None else send.count != recv.count * size:
                return None
        elif kind == "allgather":
            if recv.count % size:
                return None
        else:  # reduce_scatter
            if counts is None:
                return None  # in place, mpi4py needs the counts
            try:
                counts = [int(c) for c in counts]
            except (TypeError, ValueError):
                return None
            if len(counts) != size or any(c < 0 for c in counts) or (
                    recv.count != sum(counts) if send is None
                    else send.count != sum(counts) or recv.count != counts[self.Get_rank()]):
                return None
            counts = [c * recv.per for c in counts]  # in the library's elements
        return _Routed(sendbuf if send is None else send.given, recv.given, counts)

    # --- communicators made from this one are wrapped too ------------------
    # (the collectives that make communicators are watched like every call:
    # those with no non-blocking form run on a thread of their own, waited
    # for under the watchdog, as topology.node_comm does: engine.blocking_collective)
    def Dup(self, info=None):  # noqa: N802
        return self._wrap(duplicate(self, "MPI_Comm_idup", info=info))

    def Split(self, color: int = 0, key: int = 0):  # noqa: N802
        return self._wrap(blocking_collective(
            self, lambda: MPI.Intracomm.Split(self, color, key), "MPI_Comm_split"))

    def Split_type(self, split_type: int, key: int = 0, info=MPI.INFO_NULL):  # noqa: N802
        return self._wrap(blocking_collective(
            self, lambda: MPI.Intracomm.Split_type(self, split_type, key, info),
            "MPI_Comm_split_type"))

    def Create(self, group):  # noqa: N802
        return self._wrap(blocking_collective(
            self, lambda: MPI.Intracomm.Create(self, group), "MPI_Comm_create"))

    def Create_group(self, group, tag: int = 0):  # noqa: N802
        # (collective over the group's members only: no barrier of the
        # parent can come first, so the call itself is waited for, watched)
        return self._wrap(wait_for_call(lambda: MPI.Intracomm.Create_group(self, group, tag),
                                        "MPI_Comm_create_group", key=self.handle))
