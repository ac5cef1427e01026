"""The executor: runs a :class:`~mpi_allreduce.schedule.Schedule` over MPI.

The one place that turns schedules into messages: scratch memory, the MPI
datatype on the wire, device staging and stream synchronisation (both
through the :class:`~mpi_allreduce.backend.Backend`), and the final step of
an op (``avg`` divides).  A :class:`Plan` is a schedule on a communicator
for one dtype and op, with its scratch; :meth:`Plan.bind` fixes the
caller's arrays and compiles the rounds into *steps*, ``(function,
arguments)`` pairs with every view and message spec made once:

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
to its end.  The steps are one flat list today; a non-blocking or
persistent call needs them kept per round (post, then test or wait), which
is the one change to :func:`_compile` it asks for.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
from mpi4py import MPI

from .backend import Backend
from .ops import Op
from .schedule import Recv, Reduce, Schedule, Send

__all__ = ["Plan", "Bound", "TAG", "wire_type"]

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
    """A schedule on ``comm`` for one dtype and op, with its scratch."""

    def __init__(self, comm: MPI.Intracomm, schedule: Schedule, dtype: np.dtype, op: Op,
                 backend: Backend):
        self.comm = comm
        self.schedule = schedule
        self.dtype = np.dtype(dtype)
        self.op = op
        self.backend = backend
        self.mpitype = wire_type(self.dtype)
        self.scratch = backend.empty(max(schedule.scratch, 1), self.dtype)

    @property
    def scratch_bytes(self) -> int:
        return int(self.scratch.nbytes) if self.schedule.scratch else 0

    def bind(self, send, recv) -> "Bound":
        """The call on these arrays: ``send`` (None in place) and ``recv``
        (C-contiguous; any shape)."""
        return Bound(self, send, recv)


class Bound:
    """A plan bound to the caller's arrays, compiled to steps."""

    __slots__ = ("plan", "steps", "run", "__weakref__")

    def __init__(self, plan: Plan, send, recv):
        self.plan = plan
        backend = plan.backend
        flat = recv.reshape(-1) if recv.ndim != 1 else recv
        steps = []
        if backend.device:
            steps.append((backend.device_synchronize, ()))
        if send is None:
            source = flat
        elif backend.is_contiguous(send):
            source = send.reshape(-1) if send.ndim != 1 else send
        else:  # a strided input is copied into the result first, then reduced in place
            steps.append((backend.copy, (recv, send)))
            source = flat
        steps += _compile(plan, (source, flat, plan.scratch))
        if plan.op.finalize is not None and flat.shape[0]:
            steps.append((backend.ufunc(plan.op.finalize), (flat, plan.comm.Get_size(), flat)))
        self.steps = steps
        self.run = _runner(steps)

    def __call__(self) -> None:
        self.run()


def _runner(steps: list) -> Callable[[], None]:
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


def _compile(plan: Plan, arrays: tuple) -> list:
    backend, comm, mpitype = plan.backend, plan.comm, plan.mpitype
    combine = backend.ufunc(plan.op.ufunc)
    host = not backend.device

    def view(ref):
        return arrays[ref.buf][ref.offset:ref.offset + ref.length]

    def local(action):
        if isinstance(action, Reduce):
            if plan.op.ufunc in (np.maximum, np.minimum):  # they take out= by keyword only
                return functools.partial(combine, out=view(action.out)), (
                    view(action.first), view(action.second))
            return combine, (view(action.first), view(action.second), view(action.out))
        dst, src = action
        if dst[1:] == src[1:] and arrays[dst.buf] is arrays[src.buf]:
            return None  # a copy onto itself (a one-rank ring in place)
        return backend.copy, (view(action.dst), view(action.src))

    steps = []
    for actions in plan.schedule.rounds:
        first = next((i for i, a in enumerate(actions) if isinstance(a, (Send, Recv))),
                     len(actions))
        steps.extend(s for s in map(local, actions[:first]) if s is not None)
        rest = actions[first:]
        if not rest:
            continue
        sends = [a for a in rest if isinstance(a, Send)]
        recvs = [a for a in rest if isinstance(a, Recv)]
        overlap = [s for s in map(local, (a for a in rest if not isinstance(a, (Send, Recv))))
                   if s is not None]
        if host and not overlap and len(sends) <= 1 and len(recvs) <= 1:
            send = sends[0] if sends else None
            recv = recvs[0] if recvs else None
            steps.append(_blocking(comm, mpitype, send and view(send.src), send and send.peer,
                                   recv and view(recv.dst), recv and recv.peer))
            continue
        steps.append((_overlapped(backend, comm, mpitype,
                                  [(view(a.src), a.peer) for a in sends],
                                  [(view(a.dst), a.peer) for a in recvs], overlap), ()))
    return steps


def _blocking(comm, mpitype, send, dest, recv, source) -> tuple:
    """One round of at most one send and one receive, host memory: the MPI
    call with its message specs made once."""
    if send is not None and recv is not None:
        return comm.Sendrecv, ([send, mpitype], dest, TAG, [recv, mpitype], source, TAG)
    if send is not None:
        return comm.Send, ([send, mpitype], dest, TAG)
    return comm.Recv, ([recv, mpitype], source, TAG)


def _overlapped(backend, comm, mpitype, sends: list, recvs: list, overlap: list):
    """A round with several messages, or local work that overlaps them:
    post everything, run the local work, wait for the messages."""
    pairs = []
    for k in range(max(len(sends), len(recvs))):
        send, dest = sends[k] if k < len(sends) else (None, MPI.PROC_NULL)
        recv, source = recvs[k] if k < len(recvs) else (None, MPI.PROC_NULL)
        pairs.append((send, dest, recv, source, k))
    post = backend.post

    def run() -> None:
        pending = [post(comm, send, dest, recv, source, mpitype, TAG, slot)
                   for send, dest, recv, source, slot in pairs]
        for function, args in overlap:
            function(*args)
        for p in pending:
            p.wait()
    return run
