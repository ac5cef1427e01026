"""The vendor's own algorithms (mpi_allreduce.vendor): which library runs,
the tuning files written and read back, the choice of winners, and -- under
mpiexec with the MPI this suite runs on -- ``bench --vendor-algorithms`` and
``tune --export`` end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mpi_allreduce import vendor
from mpi_allreduce.launch import run_mpi
from mpi_allreduce.tools.tune import vendor_choices, vendor_winners

ROOT = Path(__file__).resolve().parent.parent

VERSIONS = [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution", "openmpi"),
    ("MPICH Version:      5.0.2\nMPICH Release date: unreleased", "mpich"),
    ("Intel(R) MPI Library 2021.18.1 for Linux* OS\n", "impi"),
]


@pytest.mark.parametrize("text, key", VERSIONS, ids=[k for _, k in VERSIONS])
def test_the_library_is_told_by_its_version_text(text, key):
    assert vendor.identify(text).key == key


def test_an_unknown_mpi_is_refused_by_name():
    with pytest.raises(vendor.UnknownVendor, match=r"not known for this MPI \(MVAPICH2 2\.3\)"):
        vendor.identify("MVAPICH2 2.3\nmore")


def _open_mpi():
    library = vendor.OpenMPI()
    library.algorithms = lambda: [vendor.Algorithm(n, v) for v, n in vendor.OpenMPI.KNOWN]
    return library


def test_open_mpi_rules_file_reads_back_as_written():
    library = _open_mpi()
    ring, rd = library.algorithm("ring"), library.algorithm("3")
    text = library.export([(0, rd), (2049, None), (65537, ring)], 4)
    assert library.read(text) == [(4, 0, 3), (4, 2049, 0), (4, 65537, 4)]
    assert text.splitlines()[1].startswith("2 ")  # ALLREDUCE's collective id


@pytest.mark.parametrize("text, why", [
    ("1 2 1 2 1 0 9 0 0", "algorithm 9 is not one of Open MPI's"),
    ("1 2 1 2 2 0 4 0 0", "ends early"),
    ("1 2 1 2 1 0 4 0 0 7", "1 numbers after the last rule"),
    ("1 2 x", "whole numbers only"),
], ids=["unknown-algorithm", "short", "trailing", "not-numbers"])
def test_open_mpi_rules_files_it_would_ignore_are_refused(text, why):
    with pytest.raises(vendor.VendorSettingError, match=why):
        _open_mpi().read(text)


def test_an_unknown_algorithm_is_refused_with_the_librarys_list():
    with pytest.raises(vendor.VendorSettingError, match="no all-reduce algorithm '7'; its "
                                                        "algorithms: 1 basic_linear"):
        _open_mpi().algorithm("7")


def test_intel_file_reads_back_and_names_what_is_in_force(monkeypatch, tmp_path):
    """Intel MPI's tuning file: JSON of presets and compositions per size
    range (Intel's own table chooses compositions); read back as written;
    what is in force named from I_MPI_ADJUST_ALLREDUCE or I_MPI_TUNING."""
    library = vendor.IntelMPI()
    composition3 = library.algorithm("composition3")
    assert composition3.value == 3 and library.algorithm("3").name == "reduce_bcast"
    with pytest.raises(vendor.VendorSettingError, match="no all-reduce algorithm '0'"):
        library.algorithm("0")  # (a number names a preset; composition0 goes by its name)
    text = library.export([(0, composition3), (4097, library.algorithm("10")),
                           (65537, library.algorithm("ring"))], 2)
    assert json.loads(text) == {"coll=Allreduce": {"ppn=2": {"comm_size=2": {"comm_id=-1": {
        "msg_size=4096": {"ALLREDUCE_COMPOSITION=3": {}},
        "msg_size=65536": {"ALLREDUCE=10": {}},
        "msg_size=-1": {"ALLREDUCE=8": {}}}}}}}
    assert library.read(text) == [(2, 0, "composition3"), (2, 4097, 10), (2, 65537, 8)]
    with pytest.raises(vendor.VendorSettingError, match="at every size"):
        library.export([(0, library.algorithm("1")), (4097, None)], 2)
    # (Intel's default is no candidate of the file: a composition or preset wins)
    assert vendor_winners(library, [(8, "mpi", 1.0), (8, "mpi:ring", 2.0),
                                    (8, "mpi:composition3", 1.02)], 2) == [(8, "mpi:composition3")]
    for bad, why in [("{", "not JSON"), ('{"coll=Allreduce": {"ppn=2": {"comm_size=2": '
                                         '{"comm_id=-1": {"msg_size=-1": {"ALLREDUCE=99": {}}}}}}}',
                                         "not one of Intel MPI's preset ids"),
                     ('{"coll=Allreduce": {"ppn=2": {"comm_size=2": {"comm_id=-1": '
                      '{"msg_size=-1": {"ALLREDUCE_COMPOSITION=11": {}}}}}}}', "compositions"),
                     ('{"coll=Allreduce": {"nodes=2": {}}}', "'ppn=<n>'")]:
        with pytest.raises(vendor.VendorSettingError, match=why):
            library.read(bad)
    assert library.read('{"coll=Bcast": {}}') == []  # (a file of other collectives)

    monkeypatch.delenv("I_MPI_TUNING", raising=False)
    monkeypatch.setenv("I_MPI_ADJUST_ALLREDUCE", "8")
    assert library.in_force() == "mpi:ring"
    monkeypatch.setenv("I_MPI_ADJUST_ALLREDUCE", "1:0-4096;8:4097-65536")
    assert library.in_force() == "mpi:tuned"
    monkeypatch.setenv("I_MPI_ADJUST_ALLREDUCE", "99")
    with pytest.raises(vendor.VendorSettingError, match="'99' is not"):
        library.in_force()
    monkeypatch.delenv("I_MPI_ADJUST_ALLREDUCE")
    # a composition is forced through a file of it, written where asked
    env = library.force_env(composition3, str(tmp_path))
    assert list(env) == ["I_MPI_TUNING"] and env["I_MPI_TUNING"].startswith(str(tmp_path))
    assert library.force_env(library.algorithm("ring"), str(tmp_path)) == \
        {"I_MPI_ADJUST_ALLREDUCE": "8"}
    monkeypatch.setenv("I_MPI_TUNING", env["I_MPI_TUNING"])
    assert library.in_force() == "mpi:composition3"
    tuned = tmp_path / "tuned.json"
    tuned.write_text(text)
    monkeypatch.setenv("I_MPI_TUNING", str(tuned))
    assert library.in_force() == "mpi:tuned"
    monkeypatch.setenv("I_MPI_ADJUST_ALLREDUCE", "8")
    with pytest.raises(vendor.VendorSettingError, match="set one"):
        library.in_force()
    monkeypatch.delenv("I_MPI_ADJUST_ALLREDUCE")
    monkeypatch.setenv("I_MPI_TUNING", "tuned.json")
    with pytest.raises(vendor.VendorSettingError, match="absolute path"):
        library.in_force()
    monkeypatch.setenv("I_MPI_TUNING", str(tmp_path / "missing.json"))
    with pytest.raises(vendor.VendorSettingError, match="could not read"):
        library.in_force()
    with pytest.raises(vendor.VendorSettingError, match="at start-up only"):
        library.forcing(None, library.algorithm("ring"))


BUILT_IN = {"collective=bcast": {"comm_type=intra": {"algorithm=MPIR_Bcast_intra_binomial": {}}},
            "collective=allreduce": {"comm_type=intra": {
                "avg_msg_size<=8": {"algorithm=MPIR_Allreduce_intra_recursive_doubling": {}},
                "avg_msg_size=any": {"algorithm=MPIR_Allreduce_intra_reduce_scatter_allgather":
                                     {}}}}}


def test_mpich_file_is_the_librarys_own_with_allreduce_for_this_size_changed(monkeypatch):
    library = vendor.MPICH()
    monkeypatch.setattr(library, "builtin_selection", lambda: json.loads(json.dumps(BUILT_IN)))
    ring = library.algorithm("ring")
    text = library.export([(0, library.algorithm("recursive_doubling")), (8193, ring)], 4)
    doc = json.loads(text)
    assert doc["collective=bcast"] == BUILT_IN["collective=bcast"]
    intra = doc["collective=allreduce"]["comm_type=intra"]
    own = BUILT_IN["collective=allreduce"]["comm_type=intra"]
    assert list(intra) == ["comm_size<4", "comm_size<=4", "any"]
    assert intra["comm_size<4"] == own and intra["any"] == own
    ours = intra["comm_size<=4"]["is_op_built_in=yes"]["is_commutative=yes"]
    assert ours == {
        "avg_msg_size<=8192": {"algorithm=MPIR_Allreduce_intra_recursive_doubling": {}},
        "avg_msg_size=any": {"algorithm=MPIR_Allreduce_intra_ring": {}}}
    assert intra["comm_size<=4"]["is_op_built_in=no"] == own
    assert (4, 8192, "MPIR_Allreduce_intra_recursive_doubling") in library.read(text)
    with pytest.raises(vendor.VendorSettingError, match="names an algorithm at every size"):
        library.export([(0, None)], 4)
    with pytest.raises(vendor.VendorSettingError, match="not an MPICH all-reduce algorithm"):
        library.read('{"collective=allreduce": {"comm_size<=2": '
                     '{"algorithm=MPIR_Allreduce_intra_bogus": {}}}}')


def test_winners_keep_the_librarys_own_choice_within_five_percent():
    library = _open_mpi()
    timings = [(8, "mpi", 10.0), (8, "mpi:ring", 9.7), (8, "mpi:basic_linear", 30.0),
               (4096, "mpi", 10.0), (4096, "mpi:ring", 8.0),
               (65536, "mpi", 100.0), (65536, "mpi:ring", 80.0)]
    winners = vendor_winners(library, timings, 2)
    assert winners == [(8, "mpi"), (4096, "mpi:ring"), (65536, "mpi:ring")]
    assert vendor_choices(library, winners) == [(0, None), (182, library.algorithm("ring"))]


def test_mpich_winners_never_name_the_default_or_unusable_choices():
    library = vendor.MPICH()
    library.choices = lambda: list(vendor.MPICH.KNOWN)
    timings = [(8, "mpi", 1.0), (8, "mpi:reduce_scatter_allgather", 2.0),
               (8, "mpi:recursive_doubling", 3.0), (8, "mpi:smp", 0.5),
               (8, "mpi:recursive_multiplying", 0.5),
               (65536, "mpi:reduce_scatter_allgather", 10.0), (65536, "mpi:ring", 20.0)]
    assert vendor_winners(library, timings, 2) == [(8, "mpi:recursive_doubling"),
                                                    (65536, "mpi:reduce_scatter_allgather")]


def _bench(tmp_path, name, extra, env=None):
    out = tmp_path / f"{name}.json"
    result = run_mpi(2, [sys.executable, "-m", "mpi_allreduce", "bench", "-b", "8", "-e", "4K",
                         "-f", "64", "-n", "3", "-w", "1", "-c", "--quiet", "--json", str(out)]
                     + extra, timeout=240, cwd=str(ROOT), env_extra=env)
    return result, out


def _running():
    result = run_mpi(1, [sys.executable, "-c", "from mpi_allreduce import vendor; "
                         "print(vendor.running().key)"], timeout=60, cwd=str(ROOT))
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 else None


def test_vendor_algorithms_are_timed_checked_and_tuned_end_to_end(tmp_path):
    """Under Open MPI or MPICH: every algorithm of the vendor's own gets a
    checked row; ``tune --export`` writes a file the library's parser takes
    and prints its environment; a launch with that environment names its
    vendor row ``mpi:tuned`` and gets the right sums."""
    key = _running()
    if key not in ("openmpi", "mpich"):
        pytest.skip(f"the suite's MPI ({key}) does not take its control at run time")
    result, out = _bench(tmp_path, "algorithms", ["-a", "ring", "--vendor-algorithms"])
    assert result.returncode == 0, result.stdout[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["results"]
    names = {r["algorithm"] for r in rows}
    library = vendor.by_key(key)
    forced = {k for k in doc["meta"]["vendor"]["forced"]}
    assert forced and forced <= names and {"mpi", "ring"} <= names
    assert all(r["wrong"] == 0 for r in rows)
    path = tmp_path / f"tuned{library.suffix}"
    tuned = run_mpi(2, [sys.executable, "-m", "mpi_allreduce", "tune", "--export", key,
                        "-o", str(path), "--from", str(out)], timeout=120, cwd=str(ROOT))
    assert tuned.returncode == 0, tuned.stdout[-3000:]
    assert "to use it, set:" in tuned.stdout
    if key == "openmpi":
        assert library.read(path.read_text())
    env = library.tuned_env(str(path))
    for name, value in env.items():
        assert f"export {name}={value}" in tuned.stdout
    result, out = _bench(tmp_path, "tuned", ["-a", "ring"], env)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["algorithm"] for r in rows} == {"mpi:tuned", "ring"}
    assert all(r["wrong"] == 0 for r in rows)


def test_vendor_settings_that_would_be_refused_or_ignored_stop_before_timing(tmp_path):
    key = _running()
    if key != "openmpi":
        pytest.skip(f"the cases are Open MPI's (the suite runs {key})")
    bad = tmp_path / "bad.rules"
    bad.write_text("1 2 1 2 1 0 9 0 0\n")
    cases = [
        ({"OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}, [], "is ignored by Open MPI without"),
        ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
          "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(bad)}, [], "algorithm 9 is not"),
        ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
          "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(tmp_path / "none")}, [],
         "could not read its tuning file"),
        ({}, ["--vendor-algorithms", "ring,7"], "no all-reduce algorithm '7'"),
    ]
    for env, extra, why in cases:
        result, out = _bench(tmp_path, "refused", extra, env)
        assert result.returncode == 2 and why in result.stdout, result.stdout[-2000:]
        assert not out.exists()
