"""Serial tests of the decision table, the tuner's row merging and the cost model."""

from __future__ import annotations

import json
import os

import pytest

from mpi_allreduce import config
from mpi_allreduce import selection
from mpi_allreduce.simulate import Machine
from mpi_allreduce.tools.model import best_flat, fit_line, predict
from mpi_allreduce.tools.tune import decision_rows, pick_winners

TABLE = {
    "version": 1,
    "rules": [
        {"comm_size": 2, "table": [{"max_bytes": 100, "algorithm": "driver"},
                                   {"max_bytes": None, "algorithm": "ring"}]},
        {"comm_size": 8, "table": [{"max_bytes": None, "algorithm": "rabenseifner"}]},
    ],
}


@pytest.mark.parametrize("nbytes,size,expected", [
    (8, 2, "driver"), (100, 3, "driver"), (101, 7, "ring"), (10**9, 2, "ring"),
    (8, 8, "rabenseifner"), (8, 100, "rabenseifner"), (8, 1, "driver"),
])
def test_decision_table(nbytes, size, expected):
    assert selection.choose(nbytes, size, TABLE) == expected


OVERSUBSCRIBED = {
    "version": 1,
    "rules": [
        {"comm_size": 2, "table": [{"max_bytes": None, "algorithm": "ring"}]},
        {"comm_size": 2, "oversubscribed": True,
         "table": [{"max_bytes": 64, "algorithm": "driver"}, {"max_bytes": None, "algorithm": "ring"}]},
        {"comm_size": 4, "table": [{"max_bytes": None, "algorithm": "rabenseifner"}]},
        {"comm_size": 6, "oversubscribed": False,
         "table": [{"max_bytes": None, "algorithm": "recursive_doubling"}]},
    ],
}


@pytest.mark.parametrize("nbytes,size,over,expected", [
    (8, 2, False, "ring"), (8, 2, True, "driver"), (8, 3, True, "driver"), (65, 3, True, "ring"),
    (8, 4, True, "rabenseifner"), (8, 4, False, "rabenseifner"),
    (8, 6, False, "recursive_doubling"), (8, 6, True, "rabenseifner"),
])
def test_oversubscribed_rules_apply_only_when_oversubscribed(nbytes, size, over, expected):
    """The largest comm_size <= p wins; for one comm_size a rule that names the
    oversubscription state wins over one that does not, when the state matches."""
    assert selection.choose(nbytes, size, OVERSUBSCRIBED, oversubscribed=over) == expected


def test_describe_choices():
    assert selection.describe_choices(2, True, OVERSUBSCRIBED) == "driver <= 64 B, ring above"
    assert selection.describe_choices(2, False, OVERSUBSCRIBED) == "ring"


def test_built_in_default_is_latency_first_then_bandwidth():
    assert selection.choose(8, 4) == "recursive_doubling"
    assert selection.choose(64 << 20, 4) == "ring"
    assert selection.choose(512 << 10, 2) == "recursive_doubling"
    assert selection.choose(64 << 20, 2) == "rabenseifner"  # 2 ranks: one exchange each way
    assert selection.choose(256 << 10, 5) == "rabenseifner"
    # more ranks than CPUs: the driver for short vectors, the same long-vector choice
    assert selection.choose(8, 4, oversubscribed=True) == "driver"
    assert selection.choose(8, 2, oversubscribed=True) == "recursive_doubling"
    assert selection.choose(64 << 20, 4, oversubscribed=True) == "ring"


def test_decision_table_from_file_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE))
    assert selection.choose(8, 2, str(path)) == "driver"
    monkeypatch.setenv(config.TUNING_ENV, str(path))
    config.refresh()
    try:
        assert selection.choose(8, 2) == "driver"
    finally:
        monkeypatch.delenv(config.TUNING_ENV)
        config.refresh()


@pytest.fixture
def tuning_dir(tmp_path, monkeypatch):
    """MPI_ALLREDUCE_TUNING_DIR at an empty directory, settings re-read."""
    monkeypatch.setenv(config.TUNING_DIR_ENV, str(tmp_path / "tuning"))
    monkeypatch.delenv(config.TUNING_ENV, raising=False)
    config.refresh()
    yield tmp_path / "tuning"
    monkeypatch.undo()
    config.refresh()


def test_a_measured_table_is_found_for_its_mpi_machine_and_layout(tuning_dir, monkeypatch):
    """``auto`` reads the table ``tune`` wrote for this MPI library,
    machine and ranks per node, by itself; another key names another file;
    MPI_ALLREDUCE_TUNING still wins, and ``off`` keeps the built-in table."""
    key = selection.calibration_key()
    assert set(key) == {"mpi", "machine", "ranks_per_node"}
    path = selection.calibration_path(key)
    assert os.path.dirname(path) == str(tuning_dir)
    for other in ({**key, "mpi": "MPICH Version: 0"}, {**key, "ranks_per_node": 99},
                  {**key, "machine": "elsewhere"}):
        assert selection.calibration_path(other) != path
    assert selection.choose(8, 2) == "recursive_doubling"  # no file yet: built-in
    assert selection.table_source().startswith("built-in")
    os.makedirs(tuning_dir)
    with open(path, "w") as f:
        json.dump({**TABLE, "key": key}, f)
    assert selection.choose(8, 2) == "recursive_doubling"  # looked for once per process
    config.refresh()
    assert selection.choose(8, 2) == "driver"
    assert path in selection.table_source()
    explicit = tuning_dir / "explicit.json"
    explicit.write_text(json.dumps(OVERSUBSCRIBED))
    monkeypatch.setenv(config.TUNING_ENV, str(explicit))
    config.refresh()
    assert selection.choose(8, 2) == "ring"
    monkeypatch.delenv(config.TUNING_ENV)
    monkeypatch.setenv(config.TUNING_DIR_ENV, "off")
    config.refresh()
    assert selection.calibration_path() is None
    assert selection.choose(8, 2) == "recursive_doubling"


def test_a_broken_measured_table_is_refused_naming_it(tuning_dir):
    path = selection.calibration_path()
    os.makedirs(tuning_dir)
    with open(path, "w") as f:
        f.write('{"rules": [')
    config.refresh()
    with pytest.raises(ValueError, match=os.path.basename(path)):
        selection.choose(8, 2)


@pytest.mark.parametrize("bad,match", [
    ({"rules": []}, "no rules"),
    ({"rules": [{"comm_size": 2, "table": [{"max_bytes": 5, "algorithm": "ring"}]}]}, "max_bytes null"),
    ({"rules": [{"comm_size": 2, "table": [{"max_bytes": None, "algorithm": "nope"}]}]}, "unknown algorithm"),
    ({"rules": [{"comm_size": 2, "table": [{"max_bytes": None, "algorithm": "hierarchical"}]}]}, "may not choose"),
    ({"rulez": []}, "malformed"),
    ({"rules": [{"comm_size": 2, "oversubscribed": "yes",
                 "table": [{"max_bytes": None, "algorithm": "ring"}]}]}, "oversubscribed must be"),
])
def test_bad_decision_tables(bad, match):
    with pytest.raises(ValueError, match=match):
        selection.check_tuning(bad)


def test_decision_rows_merge_neighbours():
    rows = decision_rows([(8, "rd"), (64, "rd"), (512, "ring"), (4096, "ring"), (32768, "rab")])
    assert rows == [{"max_bytes": 181, "algorithm": "rd"},
                    {"max_bytes": 11585, "algorithm": "ring"},
                    {"max_bytes": None, "algorithm": "rab"}]


PRM = Machine(alpha=2e-6, beta=1e-10, gamma=2e-10)


def test_model_prefers_latency_algorithms_for_short_and_bandwidth_for_long():
    assert best_flat(8, 16, PRM)[0] == "recursive_doubling"
    assert best_flat(64 << 20, 16, PRM)[0] in ("ring", "rabenseifner")
    assert predict("driver", 1 << 24, 16, PRM) > predict("ring", 1 << 24, 16, PRM)


def test_model_formulas():
    n, p = 1e6, 4
    a, b, g = PRM.alpha, PRM.beta, PRM.gamma
    assert predict("ring", n, p, PRM) == pytest.approx(6 * a + 2 * n * 3 / 4 * b + n * 3 / 4 * g)
    assert predict("recursive_doubling", n, p, PRM) == pytest.approx(2 * (a + n * b + n * g))
    # p = 6 folds to 4, paying one extra exchange in and out
    assert predict("recursive_doubling", n, 6, PRM) == pytest.approx(
        2 * (a + n * b + n * g) + 2 * (a + n * b) + n * g)
    assert predict("driver", n, p, PRM) == pytest.approx(6 * (a + n * b) + 3 * n * g)
    assert predict("ring", 0, p, PRM) == 0.0


def test_model_counts_a_message_per_segment():
    """Cut into segments of a quarter of the vector, every message that
    carries data to be reduced is four: only the alpha terms grow (the
    schedules are timed, so this checks that they cut what they should)."""
    a, b, g = PRM.alpha, PRM.beta, PRM.gamma
    n, p, seg = 1 << 20, 4, 1 << 18
    assert predict("recursive_doubling", n, p, PRM, seg) == pytest.approx(
        2 * (4 * a + n * b + n * g))
    assert predict("driver", n, p, PRM, seg) == pytest.approx(3 * 5 * a + 6 * n * b + 3 * n * g)
    # halving sends n/2 (two segments), then n/4 (one); the allgather two whole halves
    assert predict("rabenseifner", n, p, PRM, seg) == pytest.approx(
        (2 + 1 + 2) * a + 2 * n * 3 / 4 * b + n * 3 / 4 * g)
    # the ring's blocks are n/4: one segment each
    assert predict("ring", n, p, PRM, seg) == predict("ring", n, p, PRM)


def test_hierarchical_model_uses_the_slow_link_only_across_nodes():
    slow = Machine(alpha=2e-6, beta=1e-10, gamma=2e-10, alpha_inter=50e-6, beta_inter=8e-10)
    flat = predict("ring", 1 << 24, 8, Machine(alpha=50e-6, beta=8e-10, gamma=2e-10))
    assert predict("hierarchical", 1 << 24, 8, slow, ranks_per_node=4) < flat


def test_fit_line_recovers_parameters():
    sizes = [8 << k for k in range(12)]
    times = [3e-6 + s * 2e-10 for s in sizes]
    alpha, beta = fit_line(sizes, times)
    assert alpha == pytest.approx(3e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)


def test_pick_winners_does_not_flip_between_equals():
    timings = [(8, "a", 10.0), (8, "b", 12.0),
               (64, "a", 10.4), (64, "b", 10.0),   # b faster by < 10%: a stays
               (512, "a", 20.0), (512, "b", 10.0)]  # b clearly faster: b wins
    assert pick_winners(timings) == [(8, "a"), (64, "a"), (512, "b")]


def test_pick_winners_makes_the_fewest_rows_within_the_tolerance():
    """a wins the first size by 4%, but b is within 10% there and wins
    every size after: one row of b, not a row of a then one of b.  An
    isolated win (c at 64, by 20%) still makes its row: it is no tie (and
    then a, the faster at 8, reaches as far as b)."""
    timings = [(8, "a", 10.0), (8, "b", 10.4), (64, "a", 12.0), (64, "b", 10.0),
               (512, "a", 30.0), (512, "b", 10.0)]
    assert pick_winners(timings) == [(8, "b"), (64, "b"), (512, "b")]
    assert pick_winners(timings + [(64, "c", 8.0)]) == [(8, "a"), (64, "c"), (512, "b")]
    for tolerance in (0.0, 0.05, 0.1, 0.3):
        for size, name in pick_winners(timings, tolerance):
            fastest = min(t for s, _, t in timings if s == size)
            assert next(t for s, n, t in timings if (s, n) == (size, name)) <= \
                fastest * (1 + tolerance)


def test_model_charges_the_software_overhead_per_message_and_action():
    """Recursive doubling on 4 ranks: 2 rounds of one send and one receive
    (4 messages posted) and 2 reductions on the critical path."""
    base = Machine(alpha=2e-6, beta=0.0, gamma=0.0)
    costly = Machine(alpha=2e-6, beta=0.0, gamma=0.0, overhead=1e-6, op_overhead=5e-7)
    extra = predict("recursive_doubling", 8, 4, costly) - predict("recursive_doubling", 8, 4, base)
    assert extra == pytest.approx(4 * 1e-6 + 2 * 5e-7)
