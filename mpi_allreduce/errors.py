"""Every exception the library raises of its own, and the one abort path.

=========================== ===============================================
:class:`ArgumentMismatch`   ``check=True`` found ranks that disagree about
                            a call (raised on every rank)
:class:`Stalled`            a call waited longer than the watchdog allows
                            (``MPI_ALLREDUCE_WATCHDOG_ACTION=raise``)
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

from .config import SettingError, environment

__all__ = ["ArgumentMismatch", "Stalled", "RequestError", "ConcurrentCall", "TagsExhausted",
           "SettingError", "failed"]


class ArgumentMismatch(ValueError):
    """Raised on every rank when ``check=True`` finds ranks that disagree."""


class Stalled(RuntimeError):
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


def failed(comm: MPI.Comm, exc: BaseException, what: str) -> None:
    """An error inside ``what`` after this rank's messages started: the
    other ranks may be waiting for messages this rank will never send.
    Abort the job with a clear message, or (``MPI_ALLREDUCE_ON_ERROR=raise``)
    raise -- then the caller owns the consequences.  A stalled call raises
    (the watchdog's action said so)."""
    if environment().on_error == "raise" or isinstance(exc, (Stalled, ConcurrentCall,
                                                             TagsExhausted)):
        raise exc  # (the last two come before any message of the call)
    sys.stderr.write(
        f"mpi_allreduce: rank {MPI.COMM_WORLD.Get_rank()}: {type(exc).__name__}: {exc}\n"
        f"mpi_allreduce: the error came inside {what!r} after messages had started, so "
        "other ranks may wait forever; aborting the job (set MPI_ALLREDUCE_ON_ERROR=raise "
        "to raise instead)\n")
    sys.stderr.flush()
    comm.Abort(1)
