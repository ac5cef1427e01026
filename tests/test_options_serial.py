"""One options value for every entry point: the same names, checked by the
same function, at the same moment (the call, or the wrapper's construction),
with the same errors; what a kind of call cannot use is refused, never
dropped; and the environment is read once, where the value is made."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpi_allreduce as mar
from mpi_allreduce import config
from mpi_allreduce.fusion import Fusion
from mpi_allreduce.options import APPLIES, NAMES, Options, keywords_for, options

SELF = MPI.COMM_SELF


def _torch_configure(**keywords):
    torch_backend = pytest.importorskip("mpi_allreduce.torch")
    try:
        torch_backend.configure(**keywords)
    finally:
        torch_backend.configure()


#: every entry point, called with extra keywords (one rank: no message)
ENTRY_POINTS = {
    "allreduce": lambda **k: mar.allreduce(np.ones(3), comm=SELF, **k),
    "iallreduce": lambda **k: mar.iallreduce(np.ones(3), comm=SELF, **k).wait(),
    "allreduce_init": lambda **k: mar.allreduce_init(np.ones(3), comm=SELF, **k).free(),
    "Comm": lambda **k: mar.Comm(SELF, **k),
    "Fusion": lambda **k: Fusion(SELF, **k),
    "torch configure": _torch_configure,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_unknown_option_is_a_type_error_naming_it(entry):
    with pytest.raises(TypeError, match="bogus"):
        ENTRY_POINTS[entry](bogus=1)


@pytest.mark.parametrize("half", [mar.reduce_scatter, mar.allgather])
def test_the_halves_take_the_options_as_the_all_reduces_do(half):
    """The same keywords, resolved by the same function: an unknown name,
    or one the halves cannot use, a TypeError naming it."""
    with pytest.raises(TypeError, match="bogus"):
        half(np.ones(3), comm=SELF, bogus=1)
    with pytest.raises(TypeError, match="no selection option here"):
        half(np.ones(3), comm=SELF, selection="live")
    got = half(np.ones(3), comm=SELF, segment_size=1, check=None)
    np.testing.assert_array_equal(got.reshape(-1), np.ones(3))


BAD_VALUES = [("segment_size", 0), ("segment_size", 2.5), ("segment_size", True),
              ("algorithm", "fastest"), ("selection", "random"), ("tuning", 42),
              ("inner", "nonesuch"), ("ranks_per_node", -1)]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_a_bad_value_is_refused_where_it_is_given(entry, name, value):
    """The wrappers (Comm, Fusion, configure) check at construction, not at
    their first call, and with the calls' own errors."""
    with pytest.raises((TypeError, ValueError), match=name if name != "algorithm" else
                       "fastest"):
        ENTRY_POINTS[entry](**{name: value})


def test_the_halves_refuse_what_they_cannot_use_and_take_what_they_can():
    with pytest.raises(ValueError, match="run one of ring, rabenseifner"):
        options("halves", algorithm="tree")
    assert options("halves", algorithm="auto").algorithm == "ring"
    assert options("halves", algorithm="knomial", radix=3).radix == 3
    with pytest.raises(TypeError, match="radix is an option of"):
        options("halves", algorithm="bine_bandwidth", radix=3)
    # a wrapper given an all-reduce algorithm with no halves: its halves run the ring
    assert keywords_for({"algorithm": "tree", "check": True}, "halves") == {"check": True}
    assert keywords_for({"algorithm": "recursive_multiplying", "radix": 3}, "halves") == {}
    assert keywords_for({"algorithm": "knomial", "radix": 3}, "halves") == \
        {"algorithm": "knomial", "radix": 3}
    with pytest.raises(TypeError, match="reproducible"):
        options("halves", reproducible=True)
    assert options("halves", algorithm="ring", reproducible=False).algorithm == "ring"
    got = mar.reduce_scatter(np.arange(4.0), None, comm=SELF, segment_size=1, check=False)
    np.testing.assert_array_equal(got, np.arange(4.0))


def test_requests_refuse_live_selection_and_a_reproducible_float_sum():
    """Non-blocking and persistent calls (and Fusion's) choose by the table:
    ``selection="live"`` is refused, never dropped; ``reproducible=True``
    is taken where it changes nothing (integers are exact anyway) and
    refused for a float sum, which only a blocking call makes reproducible."""
    ints = np.arange(5)
    assert mar.iallreduce(ints, comm=SELF, reproducible=True, selection="table").wait() \
        .tolist() == ints.tolist()
    for make in (lambda: mar.iallreduce(ints, comm=SELF, selection="live"),
                 lambda: mar.allreduce_init(ints, comm=SELF, selection="live"),
                 lambda: Fusion(SELF, selection="live")):
        with pytest.raises(TypeError, match="selection"):
            make()
    with pytest.raises(ValueError, match="blocking"):
        mar.iallreduce(np.ones(3), comm=MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else SELF,
                       reproducible=True)
    # a wrapper given live selection passes it to its blocking calls only
    comm = mar.Comm(SELF, selection="live")
    out = np.empty(5, dtype=ints.dtype)
    comm.Iallreduce(ints, out).Wait()
    assert out.tolist() == ints.tolist()


REFUSED = [dict(algorithm="ring", inner="driver"), dict(algorithm="ring", ranks_per_node=1),
           dict(ranks_per_node=1), dict(inner="ring"), dict(algorithm="tree", tuning={}),
           dict(radix=3), dict(algorithm="rabenseifner", radix=2),
           dict(algorithm="torus", radix=3),
           dict(row_size=2), dict(algorithm="knomial", row_size=2),
           dict(algorithm="hierarchical", inner="knomial", radix=3),
           dict(algorithm="ring", selection="live"), dict(check="no"), dict(reproducible="no"),
           dict(check=1)]


@pytest.mark.parametrize("keywords", REFUSED, ids=[repr(k) for k in REFUSED])
def test_an_option_the_call_would_not_use_is_refused_never_dropped(keywords):
    with pytest.raises(TypeError, match=list(keywords)[-1]):
        mar.allreduce(np.ones(2), comm=SELF, **keywords)


#: (algorithm, option, value, error): values no group of ranks can use
BAD_SHAPES = [("knomial", "radix", 1, ValueError),
              ("recursive_multiplying", "radix", 0, ValueError),
              ("knomial", "radix", 2.5, TypeError), ("knomial", "radix", True, TypeError),
              ("recursive_multiplying", "radix", "4", TypeError),
              ("torus", "row_size", 0, ValueError), ("torus", "row_size", -2, ValueError),
              ("torus", "row_size", 2.0, TypeError), ("torus", "row_size", False, TypeError)]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("algorithm,name,value,error", BAD_SHAPES,
                         ids=[f"{a}-{n}={v!r}" for a, n, v, _ in BAD_SHAPES])
def test_a_bad_radix_or_row_size_is_refused_where_it_is_given(entry, algorithm, name, value,
                                                              error):
    with pytest.raises(error, match=name):
        ENTRY_POINTS[entry](algorithm=algorithm, **{name: value})


def test_the_radix_and_row_size_reach_the_builder_and_the_spec():
    """Taken by the algorithms that use them, resolved for the group's size
    (a radix above p lowered, a default row size chosen, one that does not
    divide p refused the same way on every rank: by p alone)."""
    from mpi_allreduce.planner import algorithm_options

    assert options(algorithm="knomial", radix=np.int64(3)).radix == 3
    assert options(algorithm="torus", row_size=4).row_size == 4
    assert options(algorithm="recursive_multiplying").radix is None
    opts = options(algorithm="recursive_multiplying", radix=8)
    assert algorithm_options("recursive_multiplying", opts, 64) == (("radix", 8),)
    assert algorithm_options("recursive_multiplying", opts, 5) == (("radix", 5),)
    assert algorithm_options("torus", options(algorithm="torus"), 6) == (("row_size", 2),)
    with pytest.raises(ValueError, match="row_size 4 does not divide the 6 ranks"):
        algorithm_options("torus", options(algorithm="torus", row_size=4), 6)
    # one rank: nothing is built, the result is the input
    out = mar.allreduce(np.arange(4.0), comm=SELF, algorithm="torus", row_size=3)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    for name in ("recursive_multiplying", "knomial"):
        assert mar.allreduce(np.ones(3), comm=SELF, algorithm=name, radix=5).tolist() == [1] * 3


def test_options_are_frozen_hashable_and_carry_every_name():
    opts = options(segment_size=4, tuning="no/such/table.json")
    assert opts.tuning.endswith("no/such/table.json")  # (read when a call needs it)
    assert {opts, opts.but(check=True)} == {opts, opts.but(check=True)}
    with pytest.raises(AttributeError):
        opts.algorithm = "tree"
    assert set(APPLIES["allreduce"]) == set(NAMES)
    assert all(set(names) <= set(NAMES) for names in APPLIES.values())
    assert isinstance(options(), Options)


def test_the_environment_is_read_when_the_value_is_made(monkeypatch):
    monkeypatch.setenv("MPI_ALLREDUCE_SEGMENT_BYTES", "64")
    monkeypatch.setenv("MPI_ALLREDUCE_CHECK", "1")
    config.refresh()
    try:
        opts = options()
        assert opts.check and opts.segment(np.float64) == 8 and opts.segment(np.int8) == 64
        assert options(check=False, segment_size=3).segment(np.float64) == 3
        monkeypatch.setenv("MPI_ALLREDUCE_SEGMENT_BYTES", "128")
        config.refresh()
        assert opts.segment(np.float64) == 8, "a made value changed with the environment"
    finally:
        monkeypatch.undo()
        config.refresh()


@pytest.mark.parametrize("call", ["allreduce", "allreduce in place", "reduce_scatter",
                                  "Fusion.add"])
def test_a_receive_buffer_that_would_be_copied_is_refused(call):
    """A list (or tuple) where the result is to be written would be copied,
    and the result lost with the copy: refused, as mpi4py refuses it."""
    runs = {"allreduce": lambda: mar.allreduce(np.ones(2), [0.0, 0.0], comm=SELF),
            "allreduce in place": lambda: mar.allreduce(MPI.IN_PLACE, [1.0, 2.0], comm=SELF),
            "reduce_scatter": lambda: mar.reduce_scatter(np.ones(2), (0.0, 0.0), comm=SELF),
            "Fusion.add": lambda: Fusion(SELF).add([1.0, 2.0])}
    with pytest.raises(TypeError, match="copied"):
        runs[call]()


def test_a_wrapper_gives_each_algorithm_the_options_it_uses():
    """A tool given hierarchical's options (``verify --ranks-per-node 2
    --inner ring``) passes them to hierarchical's runs only: a call would
    refuse them on any other algorithm."""
    from mpi_allreduce.options import keywords_for

    given = {"ranks_per_node": 2, "inner": "ring", "segment_size": 8}
    assert keywords_for(given, "allreduce", "hierarchical") == given
    shapes = {"radix": 3, "row_size": 2, "segment_size": 8}
    assert keywords_for(shapes, "allreduce", "knomial") == {"radix": 3, "segment_size": 8}
    assert keywords_for(shapes, "allreduce", "recursive_multiplying") == \
        {"radix": 3, "segment_size": 8}
    assert keywords_for(shapes, "allreduce", "torus") == {"row_size": 2, "segment_size": 8}
    assert keywords_for(shapes, "request", "ring") == {"segment_size": 8}
    assert keywords_for(given, "allreduce", "ring") == {"segment_size": 8}
    assert keywords_for({"tuning": {}}, "allreduce", "auto") == {"tuning": {}}
    assert keywords_for({"tuning": {}}, "allreduce", "tree") == {}
    for name in ("ring", "hierarchical", "tree"):
        options(algorithm=name, **keywords_for(given, "allreduce", name))  # accepted


@pytest.mark.parametrize("send", [[1.0, 2.0, 3.0], (1.0, 2.0, 3.0)], ids=["list", "tuple"])
def test_a_persistent_call_refuses_a_send_it_could_read_only_once(send):
    """A list or tuple becomes an array once, at set-up: every start would
    reduce its first contents (a rank that changed the list between starts
    got the old sum, silently), so a persistent call refuses it; a
    non-blocking call, read once anyway, takes it."""
    with pytest.raises(TypeError, match="persistent call reads its send buffer at each start"):
        mar.allreduce_init(send, comm=SELF)
    assert mar.iallreduce(send, comm=SELF).wait().tolist() == [1.0, 2.0, 3.0]
