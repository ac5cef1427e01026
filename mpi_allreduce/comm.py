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

The requests of ``Iallreduce`` and ``Allreduce_init`` are this library's
(:class:`~mpi_allreduce.Request`): they have ``Wait``, ``Test``, ``Start``
and ``Free`` but are not ``MPI.Request`` objects, so wait for lists of
them with :func:`mpi_allreduce.waitall`, not ``MPI.Request.Waitall``.
"""

from __future__ import annotations

from mpi4py import MPI

from . import api, collectives, registry
from .buffers import in_place, message

__all__ = ["Comm"]

#: the keyword arguments of allreduce() a Comm passes on
_OPTIONS = ("check", "segment_size", "ranks_per_node", "inner", "tuning", "selection",
            "reproducible")
#: the subset the non-blocking and persistent calls take
_REQUEST_OPTIONS = ("check", "segment_size", "ranks_per_node", "inner", "tuning")


class Comm(MPI.Intracomm):
    """``MPI.Intracomm`` whose all-reduce family runs this library's algorithms.

    ``Comm(comm, algorithm="auto", **options)``: ``options`` are
    :func:`~mpi_allreduce.allreduce`'s keyword arguments (``check``,
    ``segment_size``, ``ranks_per_node``, ``inner``, ``tuning``,
    ``selection``, ``reproducible`` -- the last for ``Allreduce`` only).  ``Comm()`` is the null communicator, as
    ``MPI.Intracomm()`` is."""

    def __new__(cls, comm=None, algorithm: str = "auto", **options):
        if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
            comm = None  # the null communicator, as MPI.Intracomm(MPI.COMM_NULL) is
        if comm is not None and not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"Comm wraps an MPI.Intracomm, got {type(comm).__name__}")
        unknown = set(options) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; "
                            f"expected {', '.join(_OPTIONS)}")
        self = super().__new__(cls, comm)
        self.algorithm = registry.check_name(algorithm)
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
        return {k: v for k, v in self.options.items() if k in _REQUEST_OPTIONS}

    # --- the calls that run our algorithms ---------------------------------
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM) -> None:  # noqa: N802
        api.allreduce(sendbuf, recvbuf, op, comm=self, algorithm=self.algorithm,
                      **self.options)

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):  # noqa: N802
        return api.iallreduce(sendbuf, recvbuf, op, comm=self, algorithm=self.algorithm,
                              **self._request_options())

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=None):  # noqa: N802
        return api.allreduce_init(sendbuf, recvbuf, op, comm=self, algorithm=self.algorithm,
                                  **self._request_options())

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM) -> None:  # noqa: N802
        collectives.reduce_scatter(sendbuf, recvbuf, op, comm=self, **self._halves_options())

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM) -> None:  # noqa: N802
        if recvcounts is None:
            if in_place(sendbuf, recvbuf):
                raise ValueError("Reduce_scatter in place needs recvcounts")
            # every rank's block is the size of its receive buffer (as mpi4py does)
            mine = message(recvbuf, False, "recvbuf").array.size
            recvcounts = self.allgather(mine)
        collectives.reduce_scatter(sendbuf, recvbuf, op, recvcounts, comm=self,
                                   **self._halves_options())

    def Allgather(self, sendbuf, recvbuf) -> None:  # noqa: N802
        collectives.allgather(sendbuf, recvbuf, comm=self, **self._halves_options())

    def _halves_options(self) -> dict:
        return {k: v for k, v in self.options.items() if k in ("check", "segment_size")}

    # --- communicators made from this one are wrapped too ------------------
    def Dup(self, info=None):  # noqa: N802
        return self._wrap(MPI.Intracomm.Dup(self, info))

    def Split(self, color: int = 0, key: int = 0):  # noqa: N802
        return self._wrap(MPI.Intracomm.Split(self, color, key))

    def Split_type(self, split_type: int, key: int = 0, info=MPI.INFO_NULL):  # noqa: N802
        return self._wrap(MPI.Intracomm.Split_type(self, split_type, key, info))

    def Create(self, group):  # noqa: N802
        return self._wrap(MPI.Intracomm.Create(self, group))

    def Create_group(self, group, tag: int = 0):  # noqa: N802
        return self._wrap(MPI.Intracomm.Create_group(self, group, tag))
