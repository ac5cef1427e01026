"""Every exception the library raises of its own, and the one abort path.

=========================== ===============================================
:class:`ArgumentMismatch`   ``check=True`` found ranks that disagree about
                            a call (raised on every rank)
:class:`Stalled`            a call waited longer than the watchdog allows
                            (``MPI_ALLREDUCE_WATCHDOG_ACTION=raise``)
:class:`Broken`             a call on a communicator whose earlier call
                            ended early on this rank (interrupted, failed
                            or stalled): its messages are in disarray
                            (:class:`Stalled` is one)
:class:`RequestError`       a request used out of turn (waited twice, never
                            started, used after ``free()``)
:class:`ConcurrentCall`     two threads entered calls on one communicator
                            at once (erroneous in MPI; detected, not run)
:class:`TagsExhausted`      a call would take a tag that a call still in
                            flight holds (refused, never matched)
:class:`SettingError`       an environment variable with a bad value
=========================== ===============================================

:func:`failed` is what happens to an error inside an algorithm after this
rank's messages started: other ranks may wait for messages that will never
come, so the job is aborted (or, as configured, the error raised).
"""

from __future__ import annotations

import sys

from mpi4py import MPI

from . import trace
from .config import SettingError, environment

__all__ = ["ArgumentMismatch", "Broken", "Stalled", "RequestError", "ConcurrentCall", "TagsExhausted",
           "SettingError", "failed"]


class ArgumentMismatch(ValueError):
    """Raised on every rank when ``check=True`` finds ranks that disagree."""


class Broken(RuntimeError):
    """A call on a communicator where an earlier call of the library ended
    early on this rank: interrupted (``KeyboardInterrupt`` or any other
    exception while its messages were in flight), failed, or stalled.  Its
    messages may still be on their way or unmatched at a peer, so the
    library never uses that communicator again on this rank: every later
    call raises this at once, and the peers' calls stall and are reported
    by the watchdog.  Free it and continue on a new one
    (``comm.Dup()`` on every rank), or end the job."""


class Stalled(Broken):
    """A call waited longer than the watchdog allows (action ``raise``)."""


class RequestError(RuntimeError):
    """A request used out of turn: waited twice, never started, started
    while active, or used after ``free()``."""


class ConcurrentCall(RuntimeError):
    """Two threads entered calls on one communicator at the same time.

    MPI leaves collective calls on one communicator from several threads at
    once erroneous (the ranks could not agree on their order); the library
    refuses the second instead of returning a wrong result.  Give each
    thread a communicator of its own (``comm.Dup()``)."""


class TagsExhausted(RuntimeError):
    """A non-blocking or persistent call would take a tag that a call still
    in flight (or a persistent request not yet freed) holds on this rank.
    Refused rather than let the two calls match each other's messages."""


#: the library's own errors, each dealt with where it is raised: check mode's
#: verdict (every rank raises it), a broken or stalled communicator, a
#: second thread's call, a request used out of turn.  (TagsExhausted is
#: not among them: it is this rank's refusal of a call, which may be its
#: alone -- frees and waits are each rank's own -- see api.left.)
OWN_ERRORS = (ArgumentMismatch, Broken, ConcurrentCall, RequestError)


def failed(comm: MPI.Comm, exc: BaseException, what: str) -> None:
    """An error inside ``what`` after this rank's messages started: the
    other ranks may be waiting for messages this rank will never send.
    Abort the job with a clear message, or (``MPI_ALLREDUCE_ON_ERROR=raise``)
    raise -- then the caller owns the consequences.  A stalled call raises
    (the watchdog's action said so)."""
    if environment().on_error == "raise" or isinstance(exc, (Broken, ConcurrentCall,
                                                             TagsExhausted)) \
            or not isinstance(exc, Exception):  # (an interrupt: the caller's to handle)
        raise exc  # (the last two come before any message of the call)
    sys.stderr.write(
        f"mpi_allreduce: rank {MPI.COMM_WORLD.Get_rank()}: {type(exc).__name__}: {exc}\n"
        f"mpi_allreduce: the error came inside {what!r} after messages had started, so "
        "other ranks may wait forever; aborting the job (set MPI_ALLREDUCE_ON_ERROR=raise "
        "to raise instead)\n")
    sys.stderr.flush()
    trace.flush()  # (the trace files then show everything until here)
    comm.Abort(1)
