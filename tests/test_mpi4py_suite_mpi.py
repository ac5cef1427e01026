"""mpi4py's own tests of the calls ``mar.Comm`` takes over, run unchanged
through it: ``test_cco_buf`` (Allreduce, Reduce_scatter, Reduce_scatter_block,
Allgather, in place and not, on COMM_WORLD, COMM_SELF and their Dups),
``test_cco_nb_buf`` (Iallreduce) and ``test_cco_pr_buf`` (Allreduce_init).
Their array kinds (array.array, numpy, DLPack, objects with a CUDA array
interface over host memory), typecodes (long double and its complex
included) and message specs ``(buf, datatype)`` come from mpi4py's
``arrayimpl``.  Only ``COMM`` is ours: a counting subclass of
:class:`mpi_allreduce.Comm`, so the test also shows that our calls ran, and
that every one of them ran this library (none was handed to mpi4py).

Then mpi4py's tests of message specs, ``test_msgspec`` (bad specs, the
mismatched datatypes and counts of ``Reduce_scatter``...) and
``test_msgzero`` (specs of no buffer, ``[None, MPI.INT]``), with
``MPI.COMM_SELF`` and ``MPI.COMM_WORLD`` ours wherever those tests name
them: whatever the library does not take as mpi4py reads it goes to
mpi4py, so they pass with mpi4py's own exceptions."""

from __future__ import annotations

import importlib
import io
import sys
import types
import unittest
from collections import Counter

import pytest

pytestmark = pytest.mark.mpi

OURS = ("testAllreduce", "testReduceScatter", "testReduceScatterBlock", "testAllgather")
MODULES = ("test_cco_buf", "test_cco_nb_buf", "test_cco_pr_buf")
#: mpi4py's tests of message specs, run whole
SPEC_MODULES = ("test_msgspec", "test_msgzero")
NAMES = ("Allreduce", "Iallreduce", "Allreduce_init", "Reduce_scatter", "Reduce_scatter_block",
         "Allgather")
#: calls of Comm's methods, and of those the ones that ran this library
CALLED: Counter = Counter()
LIBRARY: Counter = Counter()
#: the Comm method being called (innermost last)
CURRENT: list = []


def _suite():
    from mpi4py import MPI

    from .mpi4py_suite import suite_dir

    world = MPI.COMM_WORLD
    path, why = suite_dir() if world.Get_rank() == 0 else (None, "")
    path, why = world.bcast((None if path is None else str(path), why), root=0)
    if path is None:  # (fetched by the serial session, never under mpiexec)
        pytest.skip(why)
    if path not in sys.path:
        sys.path.insert(0, path)
    return path


def _counting():
    """A subclass of mar.Comm that counts the calls it takes over."""
    import mpi_allreduce as mar

    def counted(name):
        def method(self, *args, **kwargs):
            CALLED[name] += 1
            CURRENT.append(name)
            try:
                return getattr(mar.Comm, name)(self, *args, **kwargs)
            finally:
                CURRENT.pop()
        return method

    return type("Counting", (mar.Comm,), {name: counted(name) for name in NAMES})


def _count_library(patch):
    """Count the calls of Comm's methods that reach this library's
    functions (the others went to mpi4py's own methods)."""
    from mpi_allreduce import api, collectives

    def counted(function):
        def call(*args, **kwargs):
            if CURRENT:
                LIBRARY[CURRENT[-1]] += 1
            return function(*args, **kwargs)
        return call

    for module, name in ((api, "allreduce"), (api, "iallreduce"), (api, "allreduce_init"),
                         (collectives, "reduce_scatter"), (collectives, "allgather")):
        patch.setattr(module, name, counted(getattr(module, name)))


def _cases(module):
    """(class name, base communicator name) of the module's test classes."""
    return [(name, "SELF" if "Self" in name else "WORLD") for name, cls in vars(module).items()
            if isinstance(cls, type) and issubclass(cls, unittest.TestCase)
            and name.startswith("TestCCO")]


@pytest.mark.parametrize("module_name", MODULES)
def test_mpi4py_tests_pass_through_comm(module_name):
    from mpi4py import MPI

    _suite()
    with pytest.MonkeyPatch.context() as patch:  # mpi4py's own runner hides numba (its
        patch.setitem(sys.modules, "numba", None)  # default --no-numba): no CUDA arrays
        module = importlib.import_module(module_name)
    counting = _counting()
    CALLED.clear()
    LIBRARY.clear()
    suite = unittest.TestSuite()
    for name, base in _cases(module):
        original = getattr(module, name)
        comm = getattr(MPI, f"COMM_{base}")
        attrs = {"COMM": counting(comm)}
        if "Dup" in name:  # their setUp Dups the plain communicator: Dup ours instead
            attrs["setUp"] = lambda self, c=comm: setattr(self, "COMM", counting(c).Dup())
            attrs["tearDown"] = lambda self: self.COMM.Free()
        case = type(name, (original,), attrs)
        for method in OURS:
            if hasattr(case, method):
                suite.addTest(case(method))
    with pytest.MonkeyPatch.context() as patch:
        _count_library(patch)
        _run(suite)
    expected = {"test_cco_buf": ("Allreduce", "Reduce_scatter", "Reduce_scatter_block",
                                 "Allgather"),
                "test_cco_nb_buf": ("Iallreduce",),
                "test_cco_pr_buf": ("Allreduce_init",)}[module_name]
    for call in expected:
        assert CALLED[call] > 0, f"mpi4py's tests never called Comm.{call}: {dict(CALLED)}"
    # every buffer of these tests is one the library takes as mpi4py reads it
    assert LIBRARY == CALLED, f"calls handed to mpi4py: {dict(CALLED - LIBRARY)}"


def _run(suite) -> None:
    stream = io.StringIO()
    result = unittest.TextTestRunner(stream=stream, verbosity=2).run(suite)
    assert result.testsRun > 0
    assert result.wasSuccessful(), stream.getvalue()[-6000:]


@pytest.mark.parametrize("module_name", SPEC_MODULES)
def test_mpi4py_message_tests_pass_through_comm(module_name):
    """mpi4py's tests of message specs, with ``MPI.COMM_SELF`` and
    ``MPI.COMM_WORLD`` ours: in the module (its helpers call them by those
    names) and as the ``COMM`` of its test classes."""
    from mpi4py import MPI

    _suite()
    with pytest.MonkeyPatch.context() as patch:  # (as above: no CUDA arrays)
        patch.setitem(sys.modules, "numba", None)
        module = importlib.import_module(module_name)
    counting = _counting()
    CALLED.clear()
    LIBRARY.clear()
    ours = types.SimpleNamespace(**{name: getattr(MPI, name) for name in dir(MPI)})
    ours.COMM_SELF, ours.COMM_WORLD = counting(MPI.COMM_SELF), counting(MPI.COMM_WORLD)
    suite = unittest.TestSuite()
    for name, cls in vars(module).items():
        if isinstance(cls, type) and issubclass(cls, unittest.TestCase):
            if getattr(cls, "COMM", None) is not None:
                base = "SELF" if cls.COMM == MPI.COMM_SELF else "WORLD"
                cls = type(name, (cls,), {"COMM": getattr(ours, f"COMM_{base}")})
            suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(cls))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "MPI", ours)
        _count_library(patch)
        _run(suite)
    expected = {"test_msgspec": ("Reduce_scatter",),
                "test_msgzero": ("Allgather",)}[module_name]
    for call in expected:
        assert CALLED[call] > 0, f"mpi4py's tests never called Comm.{call}: {dict(CALLED)}"
