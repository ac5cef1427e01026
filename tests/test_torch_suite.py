"""torch's own distributed test suite (``DistributedTest._DistTestBase``,
from the torch wheel) against the ``mpi_allreduce`` backend, in-process
under ``mpiexec`` at 3 ranks as torch ran it for its MPI backend: the
runner and its gating are ``tests/torch_suite.py``.

Every test the suite runs for MPI passes, the profiling variants with
them (their events' names, counts, asynchrony and input shapes); every skip
carries the suite's own reason.  Skipped where torch
or ``expecttest`` (which torch's test modules import) is not installed:
``pip install -e '.[torch,test]' expecttest``."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

from mpi_allreduce.launch import find_mpiexec, run_mpi

ROOT = Path(__file__).resolve().parent.parent
#: the world size torch ran the suite at for MPI
RANKS = 3
#: seconds for the launch
TIMEOUT = 900

pytestmark = [
    pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec found"),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The suite's outcomes, one launch for the module: {name: entry}."""
    pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
    pytest.importorskip("expecttest", reason="torch's test modules import expecttest: "
                                             "pip install expecttest")
    path = tmp_path_factory.mktemp("torch-suite") / "report.jsonl"
    result = run_mpi(RANKS, [sys.executable, str(ROOT / "tests" / "torch_suite.py"), str(path)],
                     timeout=TIMEOUT, cwd=str(ROOT),
                     env_extra={"MPI_ALLREDUCE_WATCHDOG": "120",
                                "MPI_ALLREDUCE_WATCHDOG_ACTION": "raise"})
    entries: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            entries[entry["name"]] = entry
    running = [name for name, entry in entries.items() if entry["outcome"] == "started"]
    assert result.returncode == 0 and not running, (
        f"the launch ended with {result.returncode}"
        + (f" while {running[0]} ran" if running else "") + ":\n"
        + "\n".join(result.stdout.splitlines()[-60:]))
    return entries


def test_every_test_the_suite_runs_for_mpi_passes(report):
    counts = collections.Counter(entry["outcome"] for entry in report.values())
    sys.stdout.write(f"\ntorch's suite at {RANKS} ranks: {dict(counts)}\n")
    failed = {name: entry["detail"] for name, entry in report.items()
              if entry["outcome"] in ("failed", "error")}
    assert not failed, "\n".join(f"{name}: {detail}" for name, detail in sorted(failed.items()))
    assert counts["passed"] > 0


def test_every_skip_says_why(report):
    silent = [name for name, entry in report.items()
              if entry["outcome"] == "skipped" and not entry["detail"].strip()]
    assert not silent, silent


def test_the_profiling_variants_run_and_pass(report):
    """The suite's point-to-point profiler tests (under the autograd
    profiler and ``torch.profiler``) run for this backend, not skip, and
    pass: their events carry torch's names and input shapes.  (The DDP and
    NCCL ones skip, with the suite's reasons, for every MPI backend; the
    collectives' profiling runs inside their own tests, such as
    ``test_all_reduce_sum``.)"""
    profiled = {name: entry["outcome"] for name, entry in report.items()
                if name.endswith("_profiler") and "ddp" not in name and "nccl" not in name}
    assert len(profiled) >= 8 and set(profiled.values()) == {"passed"}, profiled
