"""Settings are parsed strictly (a bad value names its variable), tuning
files are validated with their name and a size limit, and the tag layout
keeps non-blocking, persistent and blocking calls apart for every MPI's
MPI_TAG_UB."""

from __future__ import annotations

import json

import pytest

from mpi_allreduce import config, selection
from mpi_allreduce.spec import CallSpec, tag_layout

GARBAGE = [
    ("MPI_ALLREDUCE_SEGMENT_BYTES", "-1"), ("MPI_ALLREDUCE_SEGMENT_BYTES", "0"),
    ("MPI_ALLREDUCE_SEGMENT_BYTES", "1e3"), ("MPI_ALLREDUCE_SEGMENT_BYTES", "lots"),
    ("MPI_ALLREDUCE_CHECK", "y"), ("MPI_ALLREDUCE_CHECK", "2"),
    ("MPI_ALLREDUCE_WATCHDOG", "nan"), ("MPI_ALLREDUCE_WATCHDOG", "inf"),
    ("MPI_ALLREDUCE_WATCHDOG", "-5"), ("MPI_ALLREDUCE_WATCHDOG", "soon"),
    ("MPI_ALLREDUCE_WATCHDOG_ACTION", "explode"), ("MPI_ALLREDUCE_PROGRESS", "magic"),
    ("MPI_ALLREDUCE_SELECTION", "random"), ("MPI_ALLREDUCE_ON_ERROR", "ignore"),
    ("MPI_ALLREDUCE_RANKS_PER_NODE", "0"), ("MPI_ALLREDUCE_CUDA_AWARE", "maybe"),
]


@pytest.fixture
def env(monkeypatch):
    for setting in config.SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    config.refresh()
    yield monkeypatch
    monkeypatch.undo()
    config.refresh()


@pytest.mark.parametrize("name,value", GARBAGE, ids=[f"{n[14:]}={v}" for n, v in GARBAGE])
def test_garbage_settings_are_refused_by_name(env, name, value):
    env.setenv(name, value)
    config.refresh()
    with pytest.raises(config.SettingError, match=name):
        config.environment()


def test_good_settings_parse(env):
    for name, value in [("MPI_ALLREDUCE_CHECK", "yes"), ("MPI_ALLREDUCE_SEGMENT_BYTES", "4096"),
                        ("MPI_ALLREDUCE_WATCHDOG", "2.5"), ("MPI_ALLREDUCE_CUDA_AWARE", "0"),
                        ("MPI_ALLREDUCE_WATCHDOG_ACTION", "RAISE")]:
        env.setenv(name, value)
    config.refresh()
    e = config.environment()
    assert (e.check, e.segment_bytes, e.watchdog, e.cuda_aware, e.watchdog_action) == \
        (True, 4096, 2.5, False, "raise")
    env.delenv("MPI_ALLREDUCE_WATCHDOG")
    config.refresh()
    assert config.environment().watchdog == 600.0


def test_the_settings_table_lists_every_variable():
    table = config.settings_table()
    assert all(s.name in table for s in config.SETTINGS)
    assert len(config.SETTINGS) == len(config.Environment._fields)


def _write(tmp_path, text) -> str:
    path = tmp_path / "table.json"
    path.write_text(text)
    return str(path)


GOOD_RULE = {"comm_size": 2, "table": [{"max_bytes": None, "algorithm": "ring"}]}
HOSTILE = {
    "huge int": json.dumps({"rules": [{"comm_size": 2, "table": [
        {"max_bytes": 10**400, "algorithm": "ring"}, {"max_bytes": None, "algorithm": "ring"}]}]}),
    "float": '{"rules": [{"comm_size": 2, "table": [{"max_bytes": 1e400, "algorithm": "ring"},'
             ' {"max_bytes": null, "algorithm": "ring"}]}]}',
    "deep": "[" * 100000 + "]" * 100000,
    "empty table": json.dumps({"rules": [{"comm_size": 2, "table": []}]}),
    "no rules": json.dumps({"rules": []}),
    "rules not a list": json.dumps({"rules": 5}),
    "not json": "{{{",
    "bool size": json.dumps({"rules": [dict(GOOD_RULE, comm_size=True)]}),
    "unknown algorithm": json.dumps({"rules": [{"comm_size": 2, "table": [
        {"max_bytes": None, "algorithm": "quantum"}]}]}),
    "too big": json.dumps({"rules": [GOOD_RULE], "pad": "x" * (selection.MAX_TABLE_BYTES + 1)}),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_tuning_files_are_refused_naming_the_file(tmp_path, case):
    path = _write(tmp_path, HOSTILE[case])
    selection._load.cache_clear()
    with pytest.raises(ValueError, match="table.json"):
        selection.tuning_table(path)


def test_a_device_file_is_not_read(tmp_path):
    selection._load.cache_clear()
    with pytest.raises(ValueError, match="/dev/zero.*not a regular file"):
        selection.tuning_table("/dev/zero")


def test_a_good_tuning_file_loads(tmp_path):
    selection._load.cache_clear()
    table = selection.tuning_table(_write(tmp_path, json.dumps({"rules": [GOOD_RULE]})))
    assert table.choose(100, 2) == "ring"


@pytest.mark.parametrize("tag_ub", [32767, 2**29 - 1, 2**30 - 1, 2**31 - 1])
def test_tag_layout_keeps_every_kind_of_call_apart(tag_ub):
    layout = tag_layout(tag_ub)
    fp = 0xDEADBEEF
    blocking = layout.blocking_tag(fp)
    assert layout.blocking <= blocking <= tag_ub
    persistent = {layout.place(True, n, fp)[1] for n in range(layout.persistent)}
    nonblocking = {layout.place(False, n, fp)[1] for n in range(layout.slots - layout.persistent)}
    assert len(persistent) == layout.persistent and len(nonblocking) == layout.slots - layout.persistent
    assert not persistent & nonblocking
    assert max(persistent | nonblocking) < layout.blocking
    # the slots wrap: number n and n + room share a slot (then the held check decides)
    room = layout.slots - layout.persistent
    assert layout.place(False, 7, fp) == layout.place(False, 7 + room, fp)
    assert layout.place(True, 3, fp) == layout.place(True, 3 + layout.persistent, fp)


def test_every_field_of_a_spec_changes_its_fingerprint():
    base = CallSpec("allreduce", "ring", 4, 100, "<f4", "sum", 64)
    changed = [
        CallSpec("reduce_scatter", "ring", 4, 100, "<f4", "sum", 64),
        CallSpec("allreduce", "tree", 4, 100, "<f4", "sum", 64),
        CallSpec("allreduce", "ring", 5, 100, "<f4", "sum", 64),
        CallSpec("allreduce", "ring", 4, 101, "<f4", "sum", 64),
        CallSpec("allreduce", "ring", 4, 100, "<f8", "sum", 64),
        CallSpec("allreduce", "ring", 4, 100, "<f4", "max", 64),
        CallSpec("allreduce", "ring", 4, 100, "<f4", "sum", 65),
        CallSpec("allreduce", "ring", 4, 100, "<f4", "sum", 64, (("inner", "ring"),)),
        CallSpec("allreduce", "ring", 4, 100, "<f4", "sum", 64, blocks=(50, 50, 0, 0)),
        CallSpec("allreduce", "ring", 4, 100, "<f4", "sum", 64, salt="reproducible/<c8/sum"),
    ]
    prints = {base.fingerprint} | {c.fingerprint for c in changed}
    assert len(prints) == len(changed) + 1
    assert base == CallSpec("allreduce", "ring", 4, 100, "<f4", "sum", 64)
