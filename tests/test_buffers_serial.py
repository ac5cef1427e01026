"""mpi4py's spellings of a message spec, as the drop-in Comm reads them
(``buffers.spelt``), and the library's own reading of lists: no MPI peers."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_allreduce.buffers import message, spelt
from mpi_allreduce.comm import _described

X = np.arange(8.0)

#: label -> (mpi4py's spelling, the elements it names)
SPELLINGS = {
    "typecode": ([X, "d"], X),
    "numpy typecode": ([X, "f8"], X),
    "count without a datatype": ([X, 8], X),
    "count, displacement": ([X, (4, 2)], X[2:6]),
    "count and typecode": ([X, 4, "d"], X[:4]),
    "pair and typecode": ([X, (4, 2), "d"], X[2:6]),
    "four items, typecode": ([X, 4, 2, "d"], X[2:6]),
    "datatype None": ([X, None], X),
    "count, datatype None": ([X, 4, None], X[:4]),
    "pair and datatype": ([X, (4, 2), MPI.DOUBLE], X[2:6]),
}


@pytest.mark.parametrize("label", list(SPELLINGS))
def test_every_spelling_is_one_spec_with_a_datatype(label):
    """Each becomes [buf, (count, (displ,))? MPI.DOUBLE], naming the same
    memory mpi4py's reading does, and agrees with the plain spelling."""
    given, elements = SPELLINGS[label]
    spec = spelt(given)
    assert spec[-1] == MPI.DOUBLE and spec[0] is X
    array = message(spec).array
    assert np.shares_memory(array, X) and array.tolist() == elements.tolist()
    plain = [X, elements.size, int(elements[0]) if elements.size else 0, MPI.DOUBLE]
    assert _described(given) == _described(plain)


@pytest.mark.parametrize("given", [[[5, 6], [1, 1]], [np.float64(7.0), 1], [2.5, 1], (3, 4),
                                   [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]],
                         ids=["rows", "numpy scalar and int", "two numbers", "tuple",
                              "rows of floats"])
def test_the_librarys_own_calls_read_a_list_of_numbers_as_numbers(given):
    """``mar.allreduce([a, b])`` reduces the numbers a and b: the library's
    own reading (a list copied into an array) is not mpi4py's reading of a
    spec, which only the drop-in Comm applies."""
    assert message(given).array.tolist() == np.asarray(given, dtype=float).tolist()


def test_a_spelling_mpi4py_cannot_read_is_left_as_given():
    for given in ([X, "no such type"], [[1, 2], 3], [X.astype(">f8"), 4]):
        assert spelt(given) is given


def test_a_call_of_one_message_matches_by_count_times_signature():
    """MPI matches count x type signature: two doubles and one element of
    a type of two doubles (with a gap) are the same message, three are not."""
    pair = MPI.DOUBLE.Create_vector(2, 1, 2).Commit()
    try:
        buf = np.zeros(6)
        assert _described([buf, 2, MPI.DOUBLE]) == _described([buf, 1, pair])
        assert _described([buf, 3, MPI.DOUBLE]) != _described([buf, 1, pair])
        assert _described([buf, 2, MPI.FLOAT]) != _described([buf, 2, MPI.DOUBLE])
    finally:
        pair.Free()
