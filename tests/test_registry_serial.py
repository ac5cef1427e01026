"""The registry is the one list of algorithms: every other list follows it.

Adding an algorithm touches its module and its registration; these tests
fail where some other place would still have to be told (a closed form, a
prediction, the test variants), and where a list kept elsewhere names an
algorithm the registry does not have.
"""

from __future__ import annotations

import pytest

from mpi_allreduce import registry
from mpi_allreduce.algorithms import FLAT
from mpi_allreduce.selection import DEFAULT_TUNING, check_tuning
from mpi_allreduce.simulate import Machine
from mpi_allreduce.tools import scale
from mpi_allreduce.tools.model import best_flat, predict

from .conftest import PATH_VARIANTS
from .helpers import VARIANTS

#: a machine with every term of the model non-zero, inside a node and across
MACHINE = Machine(alpha=1e-6, beta=2e-10, gamma=3e-11, alpha_inter=15e-6, beta_inter=8e-10,
                  overhead=1e-7, op_overhead=7e-7)


def test_the_roles_name_registered_flat_algorithms():
    for names in (registry.NOT_CANDIDATES, registry.INNER_CANDIDATES, registry.FLAT_ALGORITHMS,
                  registry.ORDERED):
        assert set(names) <= set(registry.ALGORITHMS), names
    for names in (registry.NOT_CANDIDATES, registry.INNER_CANDIDATES, registry.FLAT_ALGORITHMS):
        assert set(names) <= set(FLAT), names
    assert set(registry.FLAT_ALGORITHMS).isdisjoint(registry.NOT_CANDIDATES)
    with pytest.raises(ValueError, match="unknown flat algorithm"):
        registry._flat("ring", "no_such_algorithm")


def test_short_vector_candidates_are_candidates_up_to_their_limit_only():
    """Every registered flat algorithm is a candidate at some size or named
    as run by name only; those for short vectors only (allgather-then-
    reduce) are candidates up to their module's limit, never past it."""
    assert registry.SHORT_CANDIDATES == {"allgather_reduce": 4096}
    for name, limit in registry.SHORT_CANDIDATES.items():
        assert name in registry.candidates(8) and name in registry.candidates(limit)
        assert name not in registry.candidates(limit + 1)
        assert name not in registry.FLAT_ALGORITHMS
    assert registry.candidates(1 << 30) == registry.FLAT_ALGORITHMS
    placed = set(registry.candidates(8)) | set(registry.NOT_CANDIDATES)
    assert placed == set(FLAT)


def test_scale_predicts_every_algorithm_and_has_forms_for_no_other():
    """A closed form for registered algorithms only; those without one are
    simulated (up to ``scale.SIMULATE_FORMLESS_UP_TO`` ranks)."""
    assert scale.ALGORITHMS == registry.ALGORITHMS
    assert set(scale._FORMS) <= set(FLAT)
    for name in registry.ALGORITHMS:
        assert scale.seconds(name, 4096, 8, MACHINE, 4, 1024) > 0, name


@pytest.mark.parametrize("name", registry.ALGORITHMS)
def test_the_model_predicts_every_algorithm(name):
    assert predict(name, 4096, 6, MACHINE, 1024, ranks_per_node=3) > 0


def test_hierarchical_leaders_come_from_the_registry():
    """``best_flat`` picks among the registry's inner candidates, and
    ``scale``'s hierarchical form takes the best of their forms."""
    picked = {best_flat(n, p, MACHINE)[0] for n in (8, 1 << 16, 1 << 26) for p in (3, 8, 64)}
    assert picked <= set(registry.INNER_CANDIDATES)
    best = min(scale.seconds("hierarchical", 1 << 20, 64, MACHINE, 8, 1 << 16, inner=name)
               for name in registry.INNER_CANDIDATES)
    assert scale.seconds("hierarchical", 1 << 20, 64, MACHINE, 8, 1 << 16) == best


def test_the_test_variants_cover_the_registry():
    assert {algorithm for _, algorithm, _ in VARIANTS} == set(registry.ALGORITHMS)
    assert [label for label, _, options in VARIANTS if not options] == list(registry.ALGORITHMS)
    assert len({label for label, _, _ in VARIANTS}) == len(VARIANTS)
    assert set(PATH_VARIANTS) <= set(registry.ALGORITHMS)


def test_the_built_in_table_names_registered_algorithms():
    check_tuning(DEFAULT_TUNING)
    named = {row["algorithm"] for rule in DEFAULT_TUNING["rules"] for row in rule["table"]}
    assert named <= set(registry.FLAT_ALGORITHMS)


def test_a_fitted_file_loads_into_the_machine(tmp_path):
    """The ``params`` a ``model --json`` file holds, old files included
    (written before ``call_overhead`` and ``half_duplex`` were fitted),
    load into :class:`Machine` and come back as they were written."""
    import json

    old = {"alpha": 2e-6, "beta": 1e-10, "gamma": 2e-10, "alpha_inter": None,
           "beta_inter": None, "overhead": 1e-7, "op_overhead": 5e-7,
           "curve": [[8, 2e-6], [4096, 3e-6]], "curve_inter": None, "cores": 2,
           "curve_fresh": None, "eager_bytes": 4096}
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"params": old, "ranks": 2, "nodes": None}))
    machine = Machine.load(path)
    assert machine.curve == ((8.0, 2e-6), (4096.0, 3e-6)) and machine.call_overhead == 0.0
    assert machine.nodes is None and hash(machine) == hash(Machine.load(path))
    written = json.loads(json.dumps(machine.parameters()))
    assert {k: written[k] for k in old} == old
    assert list(written)[:len(old)] == list(old) and "nodes" not in written
    assert Machine(**written) == machine
    assert machine.placed((0, 0, 2, 2)).nodes == (0, 0, 2, 2)
    path.write_text(json.dumps({"params": dict(old, latency=1.0)}))
    with pytest.raises(TypeError):
        Machine.load(path)
