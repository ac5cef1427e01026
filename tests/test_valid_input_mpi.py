"""Valid input is taken, whatever its layout; invalid input raises on
every rank before any message; a drop-in communicator reads buffers as
mpi4py does and keeps nothing per wrapper.

* non-contiguous send arrays (strided, reversed, Fortran order, a column,
  both axes reversed) and 0-d arrays, for every call with a send array:
  ``reduce_scatter`` and ``allgather`` (with and without counts, with and
  without a receive array) and the all-reduce (blocking on every
  algorithm, non-blocking, persistent), each called twice with the send
  array changed in between (the copy of a strided input is made on every
  call, the repeated one included);
* receive arrays that are not C-contiguous, a strided send array that
  overlaps the receive array or does not split into blocks: a clear
  exception on every rank, and the communicator still works;
* ``mar.Comm`` against ``MPI.Comm`` on the same arguments: the same
  result, or the same exception (class and message), for lists and
  ``None`` as receive buffers, specs of no buffer, mismatched datatypes
  and counts, typecodes, strided and Fortran-ordered arrays; what this
  library takes is run by it, and a repeated call keeps its fast path;
* ``mar.Comm(comm)`` made anew for every call, 20,000 times: the
  library's tables of communicators and calls stay as they were;
* a kept call's keywords: a value equal to the kept one but refused by a
  first call is refused in a repeat too; one that cannot be copied is
  taken by every call.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import api, collectives
from mpi_allreduce import context as contexts

from .helpers import VARIANTS, VARIANT_IDS

pytestmark = pytest.mark.mpi


# --- layouts ----------------------------------------------------------------------------

def strided(v):
    a = np.full(2 * v.size, -7.0, v.dtype)
    a[::2] = v
    return a[::2]


def reversed_(v):
    return v[::-1].copy()[::-1]


def fortran(v):
    rows = 2 if v.size % 2 == 0 and v.size >= 4 else 1
    return np.asfortranarray(v.reshape(rows, -1))


def column(v):
    m = np.full((v.size, 3), -7.0, v.dtype)
    m[:, 1] = v
    return m[:, 1]


def both_reversed(v):
    rows = 2 if v.size % 2 == 0 and v.size >= 4 else 1
    return np.ascontiguousarray(v.reshape(rows, -1)[::-1, ::-1])[::-1, ::-1]


LAYOUTS = {"strided": strided, "reversed": reversed_, "fortran": fortran, "column": column,
           "both_reversed": both_reversed}


def laid_out(layout: str, v: np.ndarray):
    """``v`` (1-D) in ``layout``: an array whose elements in C order are
    ``v``'s, not C-contiguous (unless it has too few elements to be)."""
    a = LAYOUTS[layout](v)
    assert np.array_equal(a.reshape(-1), v)
    if layout != "fortran":
        assert v.size < 2 or not a.flags.c_contiguous
    else:  # (two rows where the size is even, else one: C-contiguous too)
        assert a.ndim == 2 and (v.size % 2 or v.size < 4 or not a.flags.c_contiguous)
    return a


def block_counts(p: int) -> list:
    """Vector forms: uneven, empty and long blocks (the same on every rank)."""
    return [[(3 * r + 1) % 4 for r in range(p)], [0] * (p - 1) + [5], [2] * p]


def data(comm, n: int, scale: float = 1.0) -> np.ndarray:
    """This rank's vector: (1..n) * (rank + 1) * scale."""
    return (np.arange(1, n + 1, dtype=np.float64) * (comm.Get_rank() + 1)) * scale


def summed(comm, n: int, scale: float = 1.0) -> np.ndarray:
    p = comm.Get_size()
    return np.arange(1, n + 1, dtype=np.float64) * (p * (p + 1) / 2) * scale


def raised_everywhere(comm, exc_type, match, call):
    with pytest.raises(exc_type, match=match):
        call()
    # every rank got here, so every rank raised: nobody is left inside a message
    assert comm.allreduce(1) == comm.Get_size()


# --- reduce_scatter ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reduce_scatter_of_a_non_contiguous_send_array(comm, layout):
    """The reshape error of a strided input (which aborted the job) is gone:
    every block form, a receive array or none, called twice with the send
    array changed in between."""
    p, rank = comm.Get_size(), comm.Get_rank()
    forms = [(None, 4 * p, True), (None, 4 * p, False)]
    forms += [(counts, sum(counts), given) for counts in block_counts(p) for given in (True, False)]
    for counts, n, given in forms:
        blocks = [n // p] * p if counts is None else counts
        start = sum(blocks[:rank])
        send = laid_out(layout, data(comm, n))
        recv = np.full(blocks[rank], np.nan) if given else None
        for scale in (1.0, 3.0):
            if scale != 1.0:
                send *= scale  # (in place: the very same array again)
            out = mar.reduce_scatter(send, recv, MPI.SUM, counts, comm=comm)
            assert out.shape == (blocks[rank],) and (recv is None or out is recv)
            np.testing.assert_array_equal(out, summed(comm, n, scale)[start:start + blocks[rank]],
                                          err_msg=f"counts {counts}, receive array {given}")


def test_reduce_scatter_of_0d_arrays(comm):
    p, rank = comm.Get_size(), comm.Get_rank()
    counts = [1] + [0] * (p - 1)
    out = mar.reduce_scatter(np.array(float(rank + 1)), None, MPI.SUM, counts, comm=comm)
    assert out.shape == (counts[rank],)
    np.testing.assert_array_equal(out, [p * (p + 1) / 2] * counts[rank])
    if p == 1:
        np.testing.assert_array_equal(mar.reduce_scatter(np.array(5.0), comm=comm), [5.0])


@pytest.mark.parametrize("layout", ["strided", "fortran"])
def test_reduce_scatter_avg_and_max_of_strided_input(comm, layout):
    """Ops with a final step (avg divides the result) and another ufunc."""
    p, rank = comm.Get_size(), comm.Get_rank()
    n = 4 * p
    send = laid_out(layout, data(comm, n))
    want = summed(comm, n)[4 * rank:4 * rank + 4]
    np.testing.assert_allclose(mar.reduce_scatter(send, None, "avg", comm=comm), want / p)
    np.testing.assert_array_equal(mar.reduce_scatter(send, None, MPI.MAX, comm=comm),
                                  data(comm, n)[4 * rank:4 * rank + 4] / (rank + 1) * p)


# --- allgather -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_allgather_of_a_non_contiguous_send_array(comm, layout):
    p, rank = comm.Get_size(), comm.Get_rank()
    base = data(comm, 4)
    # equal blocks: the receive array allocated, or given (flat, or shaped)
    for recv in (None, np.full(4 * p, np.nan), np.full((p, 4), np.nan)):
        send = laid_out(layout, base.copy())
        for scale in (1.0, 2.0):
            if scale != 1.0:
                send *= scale
            out = mar.allgather(send, recv, comm=comm)
            assert recv is None or out is recv
            if recv is None:
                assert out.shape == (p,) + send.shape
            want = np.concatenate([np.arange(1, 5) * (r + 1) * scale for r in range(p)])
            np.testing.assert_array_equal(out.reshape(-1), want)
    for counts in block_counts(p):
        offsets = np.concatenate([[0], np.cumsum(counts)])
        part = np.arange(counts[rank], dtype=np.float64) + offsets[rank] + 0.5
        send = laid_out(layout, part)
        for scale in (1.0, 2.0):
            if scale != 1.0:
                send *= scale
            out = mar.allgather(send, None, counts, comm=comm)
            np.testing.assert_array_equal(out, (np.arange(sum(counts)) + 0.5) * scale,
                                          err_msg=f"counts {counts}")


def test_allgather_of_0d_arrays(comm):
    p, rank = comm.Get_size(), comm.Get_rank()
    out = mar.allgather(np.array(rank + 0.25), comm=comm)
    np.testing.assert_array_equal(out, np.arange(p) + 0.25)
    counts = [1] + [0] * (p - 1)
    mine = np.array(7.0) if rank == 0 else np.empty(0)
    np.testing.assert_array_equal(mar.allgather(mine, None, counts, comm=comm), [7.0])


# --- all-reduce -----------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_allreduce_of_non_contiguous_and_0d_send_arrays(comm, variant):
    """Every layout on every algorithm, into a receive array of another
    shape too, twice with the input changed; 0-d arrays."""
    _, algorithm, options = variant
    n = 12
    for layout in LAYOUTS:
        send = laid_out(layout, data(comm, n))
        for recv in (None, np.full((3, 4), np.nan)):
            for scale in (1.0, 2.0):
                if scale != 1.0:
                    send *= scale
                out = mar.allreduce(send, recv, MPI.SUM, comm=comm, algorithm=algorithm,
                                    **options)
                assert out.shape == (send.shape if recv is None else recv.shape)
                np.testing.assert_array_equal(out.reshape(-1), summed(comm, n, scale),
                                              err_msg=f"{layout}, receive array {recv is not None}")
            send /= 2.0
    p = comm.Get_size()
    out = mar.allreduce(np.array(float(comm.Get_rank() + 1)), comm=comm, algorithm=algorithm,
                        **options)
    assert out.shape == () and out == p * (p + 1) / 2


@pytest.mark.parametrize("layout", ["strided", "both_reversed"])
def test_nonblocking_and_persistent_allreduce_of_strided_input(comm, layout):
    n = 10
    send = laid_out(layout, data(comm, n))
    np.testing.assert_array_equal(mar.iallreduce(send, comm=comm).wait().reshape(-1),
                                  summed(comm, n))
    recv = np.empty(n)
    request = mar.allreduce_init(send, recv, comm=comm)
    try:
        for scale in (1.0, 5.0):
            if scale != 1.0:
                send *= scale  # each start reduces the contents of that moment
            request.start()
            request.wait()
            np.testing.assert_array_equal(recv, summed(comm, n, scale))
    finally:
        request.free()


# --- invalid: every rank raises before any message ------------------------------------------

def test_non_contiguous_receive_arrays_raise_on_every_rank(comm):
    p = comm.Get_size()
    for layout in ("strided", "reversed", "fortran"):
        recv = laid_out(layout, np.zeros(4 * p))
        raised_everywhere(comm, ValueError, "recvbuf must be C-contiguous",
                          lambda: mar.reduce_scatter(MPI.IN_PLACE, recv, comm=comm))
        raised_everywhere(comm, ValueError, "recvbuf must be C-contiguous",
                          lambda: mar.allgather(np.ones(4), recv, comm=comm))
        raised_everywhere(comm, ValueError, "recvbuf must be C-contiguous",
                          lambda: mar.allgather(MPI.IN_PLACE, recv, comm=comm))
        block = laid_out(layout, np.zeros(4))
        raised_everywhere(comm, ValueError, "recvbuf must be C-contiguous",
                          lambda: mar.reduce_scatter(strided(np.ones(4 * p)), block, comm=comm))
    # the communicator is still good
    np.testing.assert_array_equal(mar.reduce_scatter(strided(data(comm, 2 * p)), comm=comm),
                                  summed(comm, 2 * p)[2 * comm.Get_rank():][:2])


def test_bad_strided_send_arrays_raise_on_every_rank(comm):
    p = comm.Get_size()
    shared = np.zeros(8 * p)
    raised_everywhere(comm, ValueError, "overlap",
                      lambda: mar.reduce_scatter(shared[::2], shared[:4], comm=comm))
    raised_everywhere(comm, ValueError, "overlap",
                      lambda: mar.allgather(shared[::8], shared[:p * p].reshape(p, p),
                                            comm=comm))
    raised_everywhere(comm, ValueError, "overlap",
                      lambda: mar.allreduce(shared[::2], shared[:4 * p], comm=comm))
    if p > 1:
        raised_everywhere(comm, ValueError, "equal blocks",
                          lambda: mar.reduce_scatter(strided(np.ones(p + 1)), comm=comm))
    raised_everywhere(comm, ValueError, "do not make",
                      lambda: mar.reduce_scatter(strided(np.ones(2 * p)), np.empty(3), comm=comm))
    raised_everywhere(comm, ValueError, "counts sum to",
                      lambda: mar.reduce_scatter(column(np.ones(p + 1)), None, "sum", [1] * p,
                                                 comm=comm))
    raised_everywhere(comm, ValueError, "this rank's block",
                      lambda: mar.allgather(strided(np.ones(3)), np.empty(2 * p), comm=comm))
    raised_everywhere(comm, ValueError, "sendbuf has 6 elements, recvbuf has 5",
                      lambda: mar.allreduce(strided(np.ones(6)), np.empty(5), comm=comm))
    np.testing.assert_array_equal(mar.allreduce(strided(data(comm, 6)), comm=comm),
                                  summed(comm, 6))


# --- the drop-in communicator reads buffers as mpi4py does ----------------------------

def outcome(call, recv, compared=None):
    """What a call did: its exception (class and message), or the receive
    buffer's contents after it (the first ``compared`` elements)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - compared, not handled
        return type(exc), str(exc)
    if isinstance(recv, (list, tuple)) and recv and not isinstance(recv[0], (int, float)):
        recv = recv[0]  # a message spec's buffer
    if recv is None or isinstance(recv, MPI.BottomType):
        return None, None
    return None, np.asarray(recv).reshape(-1)[:compared].tolist()


def readonly(a):
    a.setflags(write=False)
    return a


def _fresh(make):
    """Two independent sets of the same arguments (one for each side)."""
    return make(), make()


def allreduce_cases(p: int, rank: int) -> dict:
    """Allreduce arguments, built fresh: (sendbuf, recvbuf)."""
    a = (np.arange(6.0) + 1) * (rank + 1)
    contig = MPI.DOUBLE.Create_contiguous(2).Commit()
    return {
        "list_recv": lambda: (a.copy(), [0.0] * 6),
        "none_recv": lambda: (a.copy(), None),
        "int_recv": lambda: (a.copy(), 6),
        "list_send": lambda: (a.tolist(), np.zeros(6)),
        "dtype_mismatch": lambda: (a.astype(np.float32), np.zeros(6)),
        "count_mismatch": lambda: (a.copy(), np.zeros(5)),
        "spec_datatype_mismatch": lambda: ([a.astype(np.int32), 2, MPI.INT],
                                           [np.zeros(6, np.float32), 2, MPI.FLOAT]),
        "spec_count_mismatch": lambda: ([a.copy(), 3, MPI.DOUBLE], [np.zeros(6), 2, MPI.DOUBLE]),
        "two_derived_datatypes": lambda: ([a.copy(), contig.Dup().Commit()],
                                          [np.zeros(6), contig.Dup().Commit()]),
        "strided_send": lambda: (strided(a), np.zeros(6)),
        "reversed_send": lambda: (a[::-1], np.zeros(6)),
        "readonly_recv": lambda: (a.copy(), readonly(np.zeros(6))),
        "byteswapped": lambda: (a.astype(">f8" if np.little_endian else "<f8"),
                                np.zeros(6, ">f8" if np.little_endian else "<f8")),
        "datatype_null": lambda: ([a.copy(), MPI.DATATYPE_NULL], [np.zeros(6), MPI.DATATYPE_NULL]),
        # taken: the library's or mpi4py's, the same answer
        "arrays": lambda: (a.copy(), np.zeros(6)),
        "zero_d": lambda: (np.array(a[0]), np.array(0.0)),
        "fortran_into_c": lambda: (np.asfortranarray(a.reshape(2, 3)), np.zeros((2, 3))),
        "fortran_both": lambda: (np.asfortranarray(a.reshape(2, 3)),
                                 np.zeros((2, 3), order="F")),
        "c_into_fortran": lambda: (a.reshape(2, 3).copy(), np.zeros((2, 3), order="F")),
        "in_place_none": lambda: (None, a.copy()),
        "in_place": lambda: (MPI.IN_PLACE, a.copy()),
        "spec": lambda: ([a.copy(), MPI.DOUBLE], [np.zeros(6), MPI.DOUBLE]),
        "spec_count": lambda: ([a.copy(), 4, MPI.DOUBLE], [np.zeros(6), 4, MPI.DOUBLE]),
        "spec_count_displ": lambda: ([a.copy(), (3, 2), MPI.DOUBLE],
                                     [np.zeros(6), (3, 2), MPI.DOUBLE]),
        "spec_four": lambda: ((a.copy(), 2, 1, MPI.DOUBLE), (np.zeros(6), 2, 1, MPI.DOUBLE)),
        "spec_fortran": lambda: ([np.asfortranarray(a.reshape(2, 3)), MPI.DOUBLE],
                                 [np.zeros(6), MPI.DOUBLE]),
        # (mpi4py's other spellings of a spec: the library takes them as the above)
        "spec_typecode": lambda: ([a.copy(), "d"], [np.zeros(6), "d"]),
        "spec_count_only": lambda: ([a.copy(), 3], [np.zeros(6), 3]),
        "spec_none_datatype": lambda: ([a.copy(), None], [np.zeros(6), None]),
        "spec_count_typecode": lambda: ([a.copy(), (3, 1), "f8"], [np.zeros(6), 3, 1, "d"]),
        "spec_and_array": lambda: (a.copy(), [np.zeros(6), MPI.DOUBLE]),
        "contiguous_datatype": lambda: ([a.copy(), contig], [np.zeros(6), contig]),
        "pair_datatype": lambda: ([np.array([(1.5, rank)] * 2, "f8,i4"), MPI.DOUBLE_INT],
                                  [np.zeros(2, "f8,i4"), MPI.DOUBLE_INT]),
        "null_specs": lambda: ([None, MPI.INT], [None, MPI.INT]),
        "null_specs_counted": lambda: ([None, 0, MPI.INT], [None, (0, None), MPI.INT]),
        "bottom": lambda: ([MPI.BOTTOM, 0, MPI.INT], [MPI.BOTTOM, 0, 0, MPI.INT]),
        "array_array": lambda: (__import__("array").array("d", a), __import__("array").array(
            "d", [0.0] * 6)),
        "bytearray": lambda: (bytearray(b"ab"), bytearray(2)),
    }


#: where this library does what this MPI may refuse (Open MPI has no predefined
#: op on a derived datatype): the result is this library's, whatever MPI says
EXTENSIONS = {"contiguous_datatype"}
#: cases mpi4py takes, which this library runs (the others go to mpi4py)
LIBRARY_RUNS = {"arrays", "zero_d", "fortran_into_c", "fortran_both", "c_into_fortran",
                "in_place_none", "in_place", "spec", "spec_count", "spec_count_displ",
                "spec_four", "spec_fortran", "spec_and_array", "contiguous_datatype",
                "null_specs", "null_specs_counted", "bottom", "array_array", "bytearray",
                "spec_typecode", "spec_count_only", "spec_none_datatype", "spec_count_typecode"}


@pytest.fixture
def library_calls(monkeypatch):
    """The calls this library's functions ran (not refused), by name."""
    calls = []

    def counted(module, name):
        function = getattr(module, name)

        def call(*args, **kwargs):
            result = function(*args, **kwargs)
            calls.append(name)
            return result
        monkeypatch.setattr(module, name, call)

    for module, name in ((api, "allreduce"), (api, "iallreduce"), (api, "allreduce_init"),
                         (collectives, "reduce_scatter"), (collectives, "allgather")):
        counted(module, name)
    return calls


def test_comm_allreduce_answers_as_mpi4py_does(comm, library_calls):
    """Every case: mar.Comm's Allreduce and MPI.Comm's on the same
    arguments give the same result or raise the same exception (class and
    message) -- where mpi4py raises, it is mpi4py that answered (a list or
    None as receive buffer no longer returns with the result lost); the
    library runs what it takes.  (Where this library does more than the MPI,
    EXTENSIONS, its result is checked instead.)"""
    ours = mar.Comm(comm)
    failed = []
    for name, make in allreduce_cases(comm.Get_size(), comm.Get_rank()).items():
        args = _fresh(make)
        del library_calls[:]
        theirs = outcome(lambda: MPI.Intracomm.Allreduce(comm, *args[0], MPI.SUM), args[0][1])
        mine = outcome(lambda: ours.Allreduce(*args[1], MPI.SUM), args[1][1])
        if name in EXTENSIONS:
            p = comm.Get_size()
            theirs = None, ((np.arange(6.0) + 1) * p * (p + 1) / 2).tolist()
        if mine != theirs:
            failed.append(f"{name}: mpi4py {theirs}, mar.Comm {mine}")
        if (name in LIBRARY_RUNS) != bool(library_calls):
            failed.append(f"{name}: the library {'did not run' if not library_calls else 'ran'}")
        comm.Barrier()
    assert not failed, "\n".join(failed)
    assert comm.allreduce(1) == comm.Get_size()


def test_comm_halves_answer_as_mpi4py_does(comm, library_calls):
    """Reduce_scatter_block, Reduce_scatter and Allgather: the same answers
    as MPI.Comm's (mpi4py's checks of their counts and datatypes among
    them), through the library where it takes the buffers."""
    p, rank = comm.Get_size(), comm.Get_rank()
    ours = mar.Comm(comm)
    full = (np.arange(2.0 * p) + 1) * (rank + 1)
    counts = [1 + r % 2 for r in range(p)]
    cases = {
        "block": (True, "Reduce_scatter_block", lambda: (full.copy(), np.zeros(2)), ()),
        "block_list_recv": (False, "Reduce_scatter_block", lambda: (full.copy(), [0.0, 0.0]),
                            ()),
        "block_none_recv": (False, "Reduce_scatter_block", lambda: (full.copy(), None), ()),
        "block_count_mismatch": (False, "Reduce_scatter_block",
                                 lambda: (full.copy(), np.zeros(3)), ()),
        "block_in_place": (True, "Reduce_scatter_block",
                           lambda: (MPI.IN_PLACE, full.copy()), (), 2),
        "block_spec_mismatch": (False, "Reduce_scatter_block",
                                lambda: ([full.astype(np.int32), MPI.INT],
                                         [np.zeros(2, np.float32), MPI.FLOAT]), ()),
        "block_null": (True, "Reduce_scatter_block",
                       lambda: ([None, MPI.DOUBLE], [None, MPI.DOUBLE]), ()),
        "block_strided": (False, "Reduce_scatter_block", lambda: (strided(full), np.zeros(2)),
                          ()),
        "vector": (True, "Reduce_scatter",
                   lambda: (np.ones(sum(counts)) * (rank + 1), np.zeros(counts[rank])),
                   (counts, MPI.SUM)),
        "vector_no_counts": (True, "Reduce_scatter",
                             lambda: (np.ones(sum(counts)), np.zeros(counts[rank])),
                             (None, MPI.SUM)),
        "vector_zero_counts": (True, "Reduce_scatter",
                               lambda: ([None, MPI.DOUBLE], [None, MPI.DOUBLE]),
                               ([0] * p, MPI.SUM)),
        # mpi4py's test_msgspec, at this size: a datatype, the sum, this rank's count
        "vector_datatypes": (False, "Reduce_scatter",
                             lambda: ([np.zeros(p, np.int32), p, MPI.INT],
                                      [np.zeros(1, np.float32), 1, MPI.FLOAT]),
                             ([1] * p, MPI.SUM)),
        "vector_sum": (False, "Reduce_scatter",
                       lambda: ([np.zeros(p + 1, np.int32), p + 1, MPI.INT],
                                [np.zeros(1, np.int32), 1, MPI.INT]), ([1] * p, MPI.SUM)),
        "vector_mine": (False, "Reduce_scatter",
                        lambda: ([np.zeros(2 * p, np.int32), 2 * p, MPI.INT],
                                 [np.zeros(1, np.int32), 1, MPI.INT]), ([2] * p, MPI.SUM)),
        "vector_in_place_sum": (False, "Reduce_scatter",
                                lambda: (MPI.IN_PLACE, [np.zeros(1, np.int32), 1, MPI.INT]),
                                ([2] * p, MPI.SUM)),
        "vector_in_place_no_counts": (False, "Reduce_scatter",
                                      lambda: (MPI.IN_PLACE, np.zeros(p)), (None, MPI.SUM)),
        "gather": (True, "Allgather", lambda: (full[:2].copy(), np.zeros(2 * p)), ()),
        "gather_none_recv": (False, "Allgather", lambda: (full[:2].copy(), None), ()),
        "gather_list_recv": (False, "Allgather", lambda: (full[:2].copy(), [0.0] * (2 * p)), ()),
        "gather_fortran": (True, "Allgather",
                           lambda: (np.asfortranarray(full.reshape(2, p)),
                                    np.zeros((p, 2 * p))), ()),
        "gather_null": (True, "Allgather", lambda: ([None, MPI.INT], [None, MPI.INT]), ()),
        "gather_strided": (False, "Allgather", lambda: (strided(full[:2]), np.zeros(2 * p)), ()),
    }
    failed = []
    for name, (ran, method, make, extra, *compared) in cases.items():
        theirs_args, our_args = _fresh(make)
        del library_calls[:]
        # (in place, only this rank's block of the result is defined)
        theirs = outcome(lambda: getattr(MPI.Intracomm, method)(comm, *theirs_args, *extra),
                         theirs_args[1], *compared)
        mine = outcome(lambda: getattr(ours, method)(*our_args, *extra), our_args[1], *compared)
        if mine != theirs:
            failed.append(f"{name}: mpi4py {theirs}, mar.Comm {mine}")
        if ran != bool(library_calls):
            failed.append(f"{name}: the library {'did not run' if not library_calls else 'ran'}")
        comm.Barrier()
    assert not failed, "\n".join(failed)


def test_comm_nonblocking_calls_read_buffers_as_mpi4py_does(comm, library_calls):
    ours = mar.Comm(comm)
    p = comm.Get_size()
    with pytest.raises(TypeError):
        ours.Iallreduce(np.ones(3), [0.0] * 3)
    with pytest.raises(ValueError, match="mismatch in send and receive MPI datatypes"):
        ours.Allreduce_init(np.ones(3, np.float32), np.zeros(3))
    assert not library_calls
    recv = np.zeros(6)
    ours.Iallreduce(np.asfortranarray(np.ones((2, 3))), recv).Wait()
    np.testing.assert_array_equal(recv, [p] * 6)
    null = ours.Iallreduce([None, MPI.INT], [None, MPI.INT])
    null.Wait()
    recv[:] = 0
    request = ours.Allreduce_init([np.ones(4), 2, MPI.DOUBLE], [recv, 2, 1, MPI.DOUBLE])
    request.Start()
    request.Wait()
    request.Free()
    np.testing.assert_array_equal(recv, [0, p, p, 0, 0, 0])
    assert library_calls == ["iallreduce", "iallreduce", "allreduce_init"]


def test_comm_repeated_call_keeps_its_fast_path(comm, monkeypatch):
    """A repeated Allreduce with the very same arrays runs the kept call:
    no validation after the first (what the buffers are was settled then)."""
    from mpi_allreduce import validate

    validated = []
    real = validate.validate
    monkeypatch.setattr(validate, "validate", lambda *a: validated.append(1) or real(*a))
    ours = mar.Comm(comm)
    send, recv = data(comm, 8), np.empty(8)
    for _ in range(4):
        ours.Allreduce(send, recv, MPI.SUM)
        np.testing.assert_array_equal(recv, summed(comm, 8))
    # (one rank copies: there is no call to keep)
    assert len(validated) == (1 if comm.Get_size() > 1 else 4)


# --- wrapped anew for every call: nothing is kept per wrapper --------------------------

@pytest.mark.long_loop
@pytest.mark.comm_kinds("world")
def test_a_communicator_wrapped_20000_times_keeps_nothing_per_wrapper(comm):
    """``mar.Comm(comm)`` made anew for every call: the library finds its
    state for the communicator through the handle, so its table of
    communicators, the context's record of what leads to it and the kept
    calls stay as they were, and no wrapper outlives its call but those
    held by the calls kept for repeats, one each."""
    p, rank = comm.Get_size(), comm.Get_rank()
    send, recv, empty, nothing = data(comm, 4), np.empty(4), np.empty(0), np.empty(0)
    full, part, gathered = data(comm, 2 * p), np.empty(2), np.empty(2 * p)
    mar.Comm(comm).Allreduce(send, recv)
    mar.Comm(comm).Reduce_scatter_block(full, part)
    live, calls = len(contexts._LIVE), len(contexts.CALLS)
    context = contexts.cached_context(comm)
    alive = []
    for i in range(20_000):
        wrapper = mar.Comm(comm)
        if i % 1000 == 0:
            alive.append(weakref.ref(wrapper))
        # no elements: empty messages, and the whole way to the communicator's state
        wrapper.Allreduce(empty, nothing)
        del wrapper
    for i in range(100):  # and real calls, the three kinds
        wrapper = mar.Comm(comm)
        alive.append(weakref.ref(wrapper))
        wrapper.Allreduce(send, recv)
        wrapper.Reduce_scatter_block(full, part)
        wrapper.Allgather(part, gathered)
        del wrapper
    np.testing.assert_array_equal(recv, summed(comm, 4))
    np.testing.assert_array_equal(part, summed(comm, 2 * p)[2 * rank:2 * rank + 2])
    np.testing.assert_array_equal(gathered, summed(comm, 2 * p))
    gc.collect()
    assert len(contexts._LIVE) == live, "a table entry per wrapper"
    # (the allgather's and the empty call's, at most: the one cache)
    assert len(contexts.CALLS) <= calls + 2
    if context is not None:
        assert contexts.cached_context(comm) is context
        assert context.ids == {comm.handle}
    # (but those its kept calls hold, one each: the empty call's, the allgather's)
    assert sum(ref() is not None for ref in alive) <= 2, "wrappers kept alive"
    assert comm.allreduce(1) == p


def _add_doubles(inbuf, outbuf, datatype):
    """A user op over any datatype made of doubles: out += in."""
    a = np.frombuffer(inbuf, dtype=np.float64)
    b = np.frombuffer(outbuf, dtype=np.float64)
    b += a


def test_a_freed_datatype_and_one_made_at_its_handle_are_two_types(comm):
    """A plan is kept by the call's spec, and the datatype a user
    ``MPI.Op`` is given is the bound call's own: a derived datatype freed,
    and another made (MPI may give it the freed one's handle), each reduce
    with their own -- never a kept plan's freed one (an MPI error after the
    messages started: the job aborted, for valid input)."""
    p = comm.Get_size()
    op = MPI.Op.Create(_add_doubles, commute=True)
    try:
        for round_ in range(3):
            pair = MPI.DOUBLE.Create_contiguous(2).Commit()
            send = np.arange(6, dtype=np.float64) + comm.Get_rank() + round_
            recv = np.zeros(6)
            mar.allreduce([send, pair], [recv, pair], op, comm=comm, algorithm="ring")
            want = np.arange(6) * p + sum(range(p)) + round_ * p
            np.testing.assert_array_equal(recv, want, err_msg=f"round {round_}")
            pair.Free()
    finally:
        op.Free()


def test_an_mpi_op_that_takes_only_its_calls_length_is_never_tried_on_another(fresh):
    """An ``MPI.Op.Create`` op that raises on any vector but its call's
    (records of one length): mpi4py ends the job where such an op raises,
    so the library tries it on the call's length only to tell it apart
    (before: it was tried on 4, 12 and 60 elements -- the job aborted on
    valid input that mpi4py's own Allreduce takes)."""
    from mpi4py import MPI

    def records_of_100(a, b, datatype):
        x, y = np.frombuffer(a, np.float64), np.frombuffer(b, np.float64)
        if x.size != 100:
            raise ValueError(f"this op reduces records of 100 doubles, got {x.size}")
        y += x
    op = MPI.Op.Create(records_of_100, commute=True)
    try:
        p, r = fresh.Get_size(), fresh.Get_rank()
        out = mar.allreduce(np.full(100, 1.0 + r), None, op, comm=fresh,
                            algorithm="recursive_doubling")
        np.testing.assert_array_equal(out, np.full(100, p * (p + 1) / 2))
    finally:
        op.Free()


#: each kind of call a repeat of which is a kept call's, given keywords
_REPEATED = {
    "allreduce": lambda send, recv, comm, **k: mar.allreduce(send, recv, comm=comm, **k),
    "iallreduce": lambda send, recv, comm, **k: mar.iallreduce(send, recv, comm=comm,
                                                               **k).wait(),
    "reduce_scatter": lambda send, recv, comm, **k: mar.reduce_scatter(send, recv, comm=comm,
                                                                       **k),
}


@pytest.mark.parametrize("kind", list(_REPEATED))
@pytest.mark.parametrize("given,refused", [({"segment_size": 4}, {"segment_size": 4.0}),
                                           ({"check": False}, {"check": 0})],
                         ids=["segment_size 4.0", "check 0"])
def test_a_value_equal_to_a_kept_calls_but_refused_is_refused_in_a_repeat(fresh, kind, given,
                                                                          refused):
    """A kept call's keywords are compared with their types: a value that
    equals the kept one but that a first call refuses (``4.0`` for a
    segment of ``4`` elements, ``0`` for ``False``) is refused in a repeat
    too, on every rank, and the communicator still works (before: the
    repeat took it, as ``4.0 == 4``)."""
    p, r = fresh.Get_size(), fresh.Get_rank()
    send = np.arange(4.0 * p) + r
    recv = np.zeros(4 * p if kind != "reduce_scatter" else 4)
    want = np.arange(4.0 * p) * p + p * (p - 1) / 2
    if kind == "reduce_scatter":
        want = want[4 * r:4 * r + 4]
    call = _REPEATED[kind]
    for _ in range(2):  # (the second: the kept call's repeat)
        np.testing.assert_array_equal(call(send, recv, fresh, **given), want)
    with pytest.raises((TypeError, ValueError), match=next(iter(refused))):
        call(send, recv, fresh, **refused)
    np.testing.assert_array_equal(call(send, recv, fresh, **given), want)


class _LockedPath(os.PathLike):
    """A path (``tuning=`` takes any ``os.PathLike``) that cannot be copied."""

    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()

    def __fspath__(self) -> str:
        return self.path


@pytest.mark.parametrize("kind", ["allreduce", "iallreduce"])
def test_keywords_that_cannot_be_copied_are_taken_every_call(fresh, kind, tmp_path_factory):
    """A kept call keeps a copy of its keywords (one changed in place later
    makes a new call); a value that cannot be copied -- a path object that
    holds a lock -- is valid input all the same: every call takes it, none
    is kept (before: every call was refused, and a non-blocking one broke
    the communicator, its tag already claimed)."""
    path = str(tmp_path_factory.mktemp("tables") / "ring.json")
    with open(path, "w") as f:
        json.dump({"rules": [{"comm_size": 1, "table": [{"max_bytes": None,
                                                         "algorithm": "ring"}]}]}, f)
    p, r = fresh.Get_size(), fresh.Get_rank()
    send, recv = np.full(10, r + 1.0), np.zeros(10)
    tuning = _LockedPath(path)
    for _ in range(3):
        np.testing.assert_array_equal(_REPEATED[kind](send, recv, fresh, tuning=tuning),
                                      np.full(10, p * (p + 1) / 2))
