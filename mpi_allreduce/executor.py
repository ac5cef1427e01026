"""The executor: runs a :class:`~mpi_allreduce.schedule.Schedule` over MPI.

The one place that turns schedules into messages: scratch memory, the MPI
datatype on the wire, device staging and stream synchronisation (both
through the :class:`~mpi_allreduce.backend.Backend`), and the final step of
an op (``avg`` divides); and the tag of every message (derived from the
call, see :class:`Plan`), with messages longer than MPI's ``int`` count
cut into several.  A :class:`Plan` is a schedule on a communicator for one
dtype and op, with its scratch; :meth:`Plan.bind` fixes the caller's
arrays and compiles the rounds into :class:`Stage` objects (what
non-blocking and persistent calls step through, see
:mod:`~mpi_allreduce.progress`) and into *steps*, ``(function, arguments)``
pairs with every view and message spec made once, which a blocking call
runs:

=================================== ==========================================
round                                step
=================================== ==========================================
local actions only                   the ufunc, or ``copyto``, per action
one send and one receive             ``Sendrecv`` (after the round's leading
                                     local actions)
one send, or one receive             ``Send``, or ``Recv``
anything else, and every round of    the backend's ``post`` of each send and
device buffers                       receive (it synchronises the stream and
                                     stages through host memory where MPI is
                                     not CUDA-aware), the local actions after
                                     them (they overlap with the messages),
                                     then each ``wait``
=================================== ==========================================

A :class:`Bound` call is ``for function, args in steps: function(*args)``,
so a repeated call with the same arrays does no more Python than that.
Every round waits for its messages, so a blocking call is a bound call run
to its end.
"""

from __future__ import annotations

import functools
import sys
from collections import OrderedDict
from typing import Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from .backend import Backend, Slot, exchange
from .ops import Op, reduce_step
from .schedule import Recv, Reduce, Schedule, Send
from .spec import CallSpec, TagLayout, tag_layout
from .trace import instrument, tracer

__all__ = ["Plan", "Bound", "Stage", "wire_type", "element_type", "mpi_tags", "runner"]

#: derive every blocking call's tag from the call's spec (see :mod:`.spec`);
#: False: one fixed tag (what the guard costs is measured against that)
TAG_GUARD = True
#: the tag of every blocking call's messages without the guard
FIXED_TAG = 0x6172
#: the most elements (of the wire type) one MPI message carries: MPI's
#: counts are C ints
MAX_MESSAGE_COUNT = 2**31 - 1


@functools.lru_cache(maxsize=1)
def mpi_tags() -> TagLayout:
    """The tag layout of this MPI: its ``MPI_TAG_UB``, read on COMM_WORLD
    (where the standard attaches it; a communicator made by ``Split`` or
    ``Create`` may not carry it, and the standard's minimum would then be
    assumed for no reason)."""
    return tag_layout(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))


#: dtypes remembered by wire_type (a program that makes a new structured
#: dtype per call must not grow the process without bound)
MAX_TYPES = 256


@functools.lru_cache(maxsize=MAX_TYPES)
def wire_type(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype messages of ``dtype`` travel as: the matching
    predefined type, or raw bytes where the MPI has none (float16, say, or
    a type mpi4py names that this MPI refuses: Open MPI 4.1's
    ``MPIX_C_FLOAT16`` raises MPI_ERR_TYPE when asked its size)."""
    mpitype = MPI._typedict.get(np.dtype(dtype).char)
    try:
        usable = (mpitype is not None and mpitype != MPI.DATATYPE_NULL
                  and mpitype.Get_size() == dtype.itemsize)
    except MPI.Exception:
        usable = False
    return mpitype if usable else MPI.BYTE


#: the committed MPI datatypes of structured dtypes (see element_type), the
#: most recently used last, at most MAX_TYPES; and those let go that something
#: (a kept call's bound messages) still held, freed once nothing does
_ELEMENT_TYPES: "OrderedDict[np.dtype, MPI.Datatype]" = OrderedDict()
_RETIRED: list = []


def element_type(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype of one element of ``dtype`` (predefined where there
    is one; pair and other structured types built and committed once, and
    freed when they are among the least recently used of more than
    ``MAX_TYPES`` and nothing holds them)."""
    made = _ELEMENT_TYPES.get(dtype)
    if made is not None:
        _ELEMENT_TYPES.move_to_end(dtype)
        return made
    mpitype = wire_type(dtype)
    if mpitype != MPI.BYTE or np.dtype(dtype).itemsize == 1:
        return mpitype
    from mpi4py.util import dtlib
    try:
        made = dtlib.from_numpy_dtype(np.dtype(dtype)).Commit()
    except (ValueError, TypeError, KeyError):  # no MPI equivalent: the element's bytes
        made = MPI.BYTE.Create_contiguous(np.dtype(dtype).itemsize).Commit()
    _ELEMENT_TYPES[dtype] = made
    if len(_ELEMENT_TYPES) > MAX_TYPES:
        _RETIRED.append(_ELEMENT_TYPES.popitem(last=False)[1])
        _free_retired()
    return made


def _free_retired() -> None:
    """Free the let-go datatypes that nothing holds any more."""
    held = []
    while _RETIRED:
        datatype = _RETIRED.pop()
        if sys.getrefcount(datatype) > 2:  # (this name and getrefcount's argument)
            held.append(datatype)
        elif not MPI.Is_finalized():
            datatype.Free()
    _RETIRED.extend(held)


#: scratch arrays a plan keeps for its next non-blocking calls
MAX_SPARE = 2


class Plan:
    """A schedule on ``comm`` for one dtype and op, with its scratch.

    ``tag``: the tag of its blocking messages, derived from the fingerprint
    of the call's :class:`~mpi_allreduce.spec.CallSpec` (everything that
    shapes its messages).  Ranks that disagree on any of it post messages
    that cannot match each other's, so a mismatched call waits (and the
    watchdog reports it) instead of returning a wrong result; the tag is
    fixed when the plan is made, so the guard costs nothing per call.
    Non-blocking and persistent calls take tags of their own from the
    communicator's context, with the same fingerprint in them."""

    def __init__(self, comm: MPI.Intracomm, schedule: Schedule, dtype: np.dtype, op: Op,
                 backend: Backend, spec: CallSpec):
        self.comm = comm
        self.schedule = schedule
        self.dtype = np.dtype(dtype)
        self.op = op
        self.backend = backend
        self.mpitype = wire_type(self.dtype)
        self.scratch = backend.empty(max(schedule.scratch, 1), self.dtype)
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.tag = mpi_tags().blocking_tag(self.fingerprint) if TAG_GUARD else FIXED_TAG
        #: scratch of non-blocking calls that completed, for the next ones
        #: (fresh memory costs a page fault per page: at 1 MiB most of a call)
        self.spare: list = []

    @property
    def scratch_bytes(self) -> int:
        return int(self.scratch.nbytes) if self.schedule.scratch else 0

    def bind(self, send, recv, request: bool = False, datatype=None) -> "Bound":
        """The call on these arrays: ``send`` (None in place) and ``recv``
        (C-contiguous; any shape).  ``request``: for a non-blocking or
        persistent call, which may be in flight with others: scratch of its
        own, and its stages only (no blocking steps).  ``datatype``: the
        MPI datatype of one element that a user ``MPI.Op``'s
        ``MPI_Reduce_local`` is given (the caller's, from a message spec;
        else the dtype's): the bound call's, never the plan's, whose cache
        key cannot tell a freed datatype from another made at its handle."""
        scratch = None
        if request:
            spare = self.spare
            scratch = spare.pop() if spare else self.backend.empty(self.scratch.shape[0],
                                                                    self.dtype)
        return Bound(self, send, recv, scratch, blocking=not request, datatype=datatype)

    def give_back(self, scratch) -> None:
        """A completed non-blocking call's scratch, which no message of it
        can reach any more: the next call's (at most ``MAX_SPARE`` kept)."""
        if len(self.spare) < MAX_SPARE:
            self.spare.append(scratch)


class Stage(NamedTuple):
    """One round, compiled: local steps to run first, the messages to post
    (``(send view, dest, recv view, source)`` each), and the local steps
    that run while they travel.  A round ends when its messages are done."""

    before: tuple
    pairs: tuple
    overlap: tuple


class Bound:
    """A plan bound to the caller's arrays, compiled to stages (what a
    non-blocking call steps through) and steps (what a blocking call runs).

    ``scratch``: the plan's own (default; blocking calls run one at a
    time), or an array of the call's own for calls that may be in flight
    together.  ``blocking``: also compile the steps (``steps`` and ``run``
    are None otherwise)."""

    __slots__ = ("plan", "stages", "steps", "run", "scratch", "slot", "__weakref__")

    def __init__(self, plan: Plan, send, recv, scratch=None, blocking: bool = True,
                 datatype=None):
        self.plan, self.scratch = plan, scratch
        backend = plan.backend
        #: the name of its staging buffers (device backends: see backend.Slots),
        #: held by its steps too (they may outlive the Bound)
        self.slot = Slot(backend.device and blocking)
        flat = recv.reshape(-1) if recv.ndim != 1 else recv
        lead = []
        if backend.device:
            lead.append((backend.device_synchronize, ()))
        if send is None:
            source = flat
        elif backend.is_contiguous(send):
            source = send.reshape(-1) if send.ndim != 1 else send
        elif plan.spec.kind == "allreduce":
            # a strided input is copied into the result first (element by
            # element in its own shape), then reduced in place: an
            # all-reduce's input and result are one vector
            lead.append((backend.copy, (flat.reshape(send.shape), send)))
            source = flat
        else:
            # reduce_scatter, allgather: the input is not the result's size,
            # so a strided one is copied into an array of its own each call
            staged = backend.empty_shaped(send.shape, send.dtype)
            lead.append((backend.copy, (staged, send)))
            source = staged.reshape(-1)
        stages = _stages(plan, (source, flat, plan.scratch if scratch is None else scratch),
                         datatype)
        if plan.op.finalize is not None and flat.shape[0]:
            stages.append(Stage(((backend.ufunc(plan.op.finalize),
                                  (flat, plan.comm.Get_size(), flat)),), (), ()))
        if lead:
            first = stages[0] if stages else Stage((), (), ())
            stages[:1] = [first._replace(before=tuple(lead) + first.before)]
        recorder = tracer()
        if recorder is not None:  # MPI_ALLREDUCE_TRACE: recording steps between these
            stages = instrument(plan, stages, blocking, recorder)
        self.stages = stages
        self.steps = _compile(plan, stages, self.slot) if blocking else None
        self.run = runner(self.steps) if blocking else None

    def __call__(self) -> None:
        self.run()


def runner(steps: list) -> Callable[[], None]:
    """The call itself: the steps in order (one or two steps without a loop)."""
    if len(steps) == 1:
        (f0, a0), = steps
        return lambda: f0(*a0)
    if len(steps) == 2:
        (f0, a0), (f1, a1) = steps

        def two():
            f0(*a0)
            f1(*a1)
        return two

    def run():
        for function, args in steps:
            function(*args)
    return run


def _stages(plan: Plan, arrays: tuple, datatype=None) -> list:
    """The schedule's rounds with every view made: a list of :class:`Stage`."""
    backend, op = plan.backend, plan.op
    temp = None
    if op.reduce_local:  # a user MPI.Op: MPI_Reduce_local
        datatype = datatype or element_type(plan.dtype)
        longest = max((a.out.length for r in plan.schedule.rounds for a in r
                       if isinstance(a, Reduce)), default=0)
        temp = backend.empty(max(longest, 1), plan.dtype)

    def view(ref):
        return arrays[ref.buf][ref.offset:ref.offset + ref.length]

    def local(action):
        if isinstance(action, Reduce):
            return reduce_step(op, backend, view(action.first), view(action.second),
                               view(action.out), datatype, temp)
        dst, src = action
        if dst[1:] == src[1:] and arrays[dst.buf] is arrays[src.buf]:
            return None  # a copy onto itself (a one-rank ring in place)
        return backend.copier(view(action.dst), view(action.src))

    def locals_of(actions):
        return tuple(s for s in map(local, actions) if s is not None)

    # MPI counts are C ints: a longer message travels as several, cut the
    # same way on both sides (they have the same length), in order
    limit = MAX_MESSAGE_COUNT // (plan.dtype.itemsize if plan.mpitype == MPI.BYTE else 1)

    def pieces(ref):
        return [view(ref._replace(offset=o, length=min(limit, ref.stop - o)))
                for o in range(ref.offset, ref.stop, limit)] or [view(ref)]

    stages = []
    for actions in plan.schedule.rounds:
        first = next((i for i, a in enumerate(actions) if isinstance(a, (Send, Recv))),
                     len(actions))
        rest = actions[first:]
        sends = [(v, a.peer) for a in rest if isinstance(a, Send) for v in pieces(a.src)]
        recvs = [(v, a.peer) for a in rest if isinstance(a, Recv) for v in pieces(a.dst)]
        pairs = []
        for k in range(max(len(sends), len(recvs))):
            send, dest = sends[k] if k < len(sends) else (None, MPI.PROC_NULL)
            recv, source = recvs[k] if k < len(recvs) else (None, MPI.PROC_NULL)
            pairs.append((send, dest, recv, source))
        stages.append(Stage(locals_of(actions[:first]), tuple(pairs),
                            locals_of(a for a in rest if not isinstance(a, (Send, Recv)))))
    return stages


def _compile(plan: Plan, stages: list, slot: Slot) -> list:
    """A blocking call's steps: each stage's local steps, then its messages
    (one MPI call where the round has one send and one receive on the host;
    ``slot``: the call's name for its staging buffers, see :class:`Bound`)."""
    comm, mpitype = plan.comm, plan.mpitype
    host = not plan.backend.device
    steps = []
    for stage in stages:
        steps.extend(stage.before)
        if not stage.pairs:
            steps.extend(stage.overlap)
        elif host and not stage.overlap and len(stage.pairs) == 1:
            steps.append(exchange(comm, mpitype, plan.tag, *stage.pairs[0]))
        else:
            steps.append((_overlapped(plan.backend, comm, mpitype, plan.tag, stage.pairs,
                                      stage.overlap, slot), ()))
    return steps


def _overlapped(backend, comm, mpitype, tag, pairs: tuple, overlap: tuple, owner: Slot):
    """A round with several messages, or local work that overlaps them:
    post everything, run the local work, wait for the messages.  (A round
    left by an exception burns ``owner``, its call's staging name: a late
    message may still land in those buffers.)"""
    post = backend.post
    slots = [(send, dest, recv, source, f"{owner.name}.{k}")
             for k, (send, dest, recv, source) in enumerate(pairs)]

    def run() -> None:
        try:
            pending = [post(comm, send, dest, recv, source, mpitype, tag, slot)
                       for send, dest, recv, source, slot in slots]
            for function, args in overlap:
                function(*args)
            for p in pending:
                p.wait()
        except BaseException:
            owner.burn()
            raise
    return run
