"""The MPI half of the suite: the ``@pytest.mark.mpi`` tests under mpiexec
(the command line tool under mpiexec: tests/test_launched_commands.py).
Every mpiexec has a time limit.

Which world sizes.  Most MPI tests take the ``comm`` fixture
(tests/conftest.py) and run on communicators of the world: a duplicate of
it, the world reversed, its even ranks and the world minus its last rank.
The launches at world sizes 1, 3, 5 (tests/test_launch_np5.py) and 8 run
those of them that add a size or a rank order (``SUBCOMM_KINDS_AT`` in
tests/conftest.py):

    world size 1:  1
    world size 3:  3, 3 reversed, 2 strided, 2
    world size 5:  5, 4
    world size 8:  8, 7   (more ranks than cores: oversubscribed)

so every size of 1 to 5, 7 and 8 ranks, powers of two and not, contiguous,
strided and reversed rank orders.

The MPI tests that do not take ``comm`` (on COMM_WORLD itself, a duplicate
of it, or a split such as ``trio``: the mismatch and watchdog stalls,
guarantees, interrupts, traces, verify, threads, mpi4py's own tests, the
torch backend) see the world size itself.  They run at world sizes 1, 2 and
3: one rank; two, where a rank's left and right neighbours are one rank; an
odd size that folds (3 = 2 + 1), more ranks than cores.  What they check --
that ranks agree or stall, that an interrupt breaks the communicator, that
nothing piles up, that an outside suite's calls behave as mpi4py's -- needs
peers, a fold and oversubscription, not more ranks; the algorithms at every
size are the ``comm`` tests' (and their schedules are checked rank by rank
for every p up to 64 and more in the serial tests).  The launch at world
size 2 runs them alone (``MPI_ALLREDUCE_TEST_ONLY=world``; the ``comm``
tests' sizes 2 and 1 are above) and the launches at 5 and 8 run the
``comm`` tests alone (``MPI_ALLREDUCE_TEST_ONLY=comm``).

Each run prints its slowest tests (``--durations`` from pyproject.toml, rank 0
only); this session's summary repeats the first of them for each launch."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mpi_allreduce.launch import find_mpiexec, mpiexec_flavor, run_mpi

from .conftest import ONLY_ENV, SUMMARY_PROPERTY

ROOT = Path(__file__).resolve().parent.parent
#: (world size, which tests: "" all, "world" those that do not take ``comm``,
#: "comm" those that do): see the docstring.  In this order: the launch at 2
#: ranks, one a core, is the one that other processes slow most (Open MPI
#: yields a core only when the ranks outnumber the cores: 2 ranks busy-wait,
#: and a rank waits a time slice for a peer that another process took the
#: core from), so it runs last, once the serial session's other files,
#: which run beside these launches, are more likely over
LAUNCHES = [(8, "comm"), (3, ""), (5, "comm"), (1, ""), (2, "world")]
#: the launches another file runs (tests/test_launch_np5.py): a file stays in
#: one process of the serial session, and this file's launches one after
#: another were its longest path (15 minutes) while the other process stood
#: idle for its last 2 or 3; the 5-rank launch (about 100 s) goes there
ELSEWHERE = [(5, "comm")]
#: seconds for one mpiexec of the MPI test files (a hang guard: 8 ranks on 2 cores,
#: beside the serial tests, took 848 s here)
SUITE_TIMEOUT = 1200
#: slowest tests of each launch repeated in this session's summary
SLOWEST_SHOWN = 8

pytestmark = pytest.mark.skipif(
    find_mpiexec() is None,
    reason="no mpiexec found: pip install 'mpi_allreduce[mpi]' (bundled Open MPI) "
           "or load your site's MPI module",
)


def tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


#: where a rank's own report starts: of a failed test, of one past its time
#: limit, or of a crash (Python's fault handler: a signal such as SIGSEGV)
_RANK_REPORT = re.compile(r"^\[rank \d+\] FAILED |: not done after \d+ s on rank \d+"
                          r"|^Fatal Python error: ")


def failure_report(text: str, lines: int = 80, each: int = 60) -> str:
    """What a failed launch shows: every rank's report of a failed test, of
    one past its time limit (its threads) or of a crash, up to ``each`` lines, without
    the test runner's own frames -- a rank that failed early is not lost
    behind the others' output -- then the output's last ``lines``."""
    out = text.splitlines()
    picked = []
    for i, line in enumerate(out):
        if _RANK_REPORT.search(line):
            block = [x for x in out[i:i + 4 * each] if "site-packages/_pytest" not in x
                     and "site-packages/pluggy" not in x]
            picked += ["", *block[:each]]
    return "\n".join(picked[:20 * each] + ["", "(the output's end:)", *out[-lines:]])


@pytest.fixture(scope="session")
def peer_tests():
    """mpi4py's own tests, fetched once here, outside any MPI run and its
    per-test watchdog (a cold download can take minutes); a failure is
    recorded, and the MPI runs skip those tests with its reason."""
    from .mpi4py_suite import fetch

    path, why = fetch()
    if path is None:
        sys.stderr.write(f"\n{why}\n")
    return path


def launches(which: list):
    """``which`` launches as the parameters of a test of them."""
    return pytest.mark.parametrize(
        "size,only", which, ids=[f"np{n}" + (f"-{only}-only" if only else "") for n, only in which])


@launches([launch for launch in LAUNCHES if launch not in ELSEWHERE])
def test_mpi_suite(size, only, peer_tests, record_property):
    """All MPI tests (or only those on COMM_WORLD, or only those on the
    ``comm`` fixture) pass on every rank at this world size."""
    run_suite(size, only, record_property)


def run_suite(size: int, only: str, record_property) -> None:
    """One launch of the MPI tests, its slowest tests recorded for the summary."""
    args = [sys.executable, "-m", "pytest", "--with-mpi", "-m", "mpi", "-q", "--color=no",
            "-p", "no:cacheprovider", str(ROOT / "tests")]
    env = {"MPI_ALLREDUCE_UNDER_MPIEXEC": "1"}
    if only:
        env[ONLY_ENV] = only
    passed = [x for name in env for x in ("-x", name)] if _openmpi() else []
    result = run_mpi(size, args, timeout=SUITE_TIMEOUT, cwd=str(ROOT), env_extra=env,
                     extra=passed)
    label = f"np{size}" + (f" ({only} only)" if only else "")
    assert result.returncode == 0, \
        f"mpiexec -n {size} failed ({result.returncode}):\n{failure_report(result.stdout)}"
    summaries = re.findall(r"^(\d+ passed.*) in [\d.]+s", result.stdout, re.M)
    assert summaries and all("failed" not in s and "error" not in s for s in summaries), \
        failure_report(result.stdout)
    slowest = re.findall(r"^\d+\.\d+s (?:call|setup|teardown) +\S+", result.stdout, re.M)
    # (the session's summary prints them: tests/conftest.py)
    record_property(SUMMARY_PROPERTY, [f"{label}: {len(summaries)} ranks reported; distinct "
                                       f"per-rank totals: {', '.join(sorted(set(summaries)))}"]
                    + [f"    {line}" for line in slowest[:SLOWEST_SHOWN]])


def test_each_launch_is_shown_as_it_starts_and_ends(monkeypatch):
    """The suite's progress lines: world size, program, time limit, then
    exit status, seconds and the ranks' test summary."""
    from mpi_allreduce import launch

    lines = []
    monkeypatch.setattr(launch, "announce", lines.append)
    result = run_mpi(2, [sys.executable, "-c", "print('3 passed, 1 skipped in 0.25s')"],
                     timeout=60)
    assert result.returncode == 0, tail(result.stdout)
    assert lines[0] == "mpiexec -n 2 python -c print('3 passed, 1 skipped in 0.25s'): started " \
                       "(time limit 60 s)"
    assert re.fullmatch(r"mpiexec -n 2 python -c .*: exit 0 after \d+ s \(2 ranks reported; "
                        r"first: 3 passed, 1 skipped\)", lines[1]), lines


def test_the_suite_shows_its_launches(tmp_path):
    """The same, end to end: a pytest run with this suite's conftest prints
    each launch's lines between its dots."""
    (tmp_path / "test_one_launch.py").write_text(
        "import sys\nfrom mpi_allreduce.launch import run_mpi\n"
        "def test_launch():\n"
        "    assert run_mpi(1, [sys.executable, '-c', 'pass'], timeout=60).returncode == 0\n")
    from mpi_allreduce.launch import run

    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                  "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path)], timeout=120,
                 cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    assert re.search(r"^\[\d\d:\d\d:\d\d\] mpiexec -n 1 python -c pass: started", result.stdout,
                     re.M), tail(result.stdout)
    assert re.search(r"mpiexec -n 1 python -c pass: exit 0 after \d+ s", result.stdout), \
        tail(result.stdout)


def _openmpi() -> bool:
    return mpiexec_flavor(find_mpiexec()) == "openmpi"


def test_a_failed_launch_shows_each_ranks_report_however_much_came_after():
    """A rank that failed early, one that crashed, and each rank's threads
    at a time-out are in the failure's text though thousands of lines
    followed them."""
    early = ["", "[rank 3] FAILED tests/x.py::test_a - ValueError: early",
             "  File \"/v/site-packages/_pytest/runner.py\", line 1 in call", "ValueError: early"]
    dump = ["tests/x.py::test_b: not done after 300 s on rank 6; aborting the job; its threads:",
            "  File \"/r/tests/x.py\", line 9 in test_b"]
    crash = ["Fatal Python error: Segmentation fault", "  File \"/r/tests/y.py\", line 3 in test_c"]
    text = "\n".join(early + ["." * 72] * 5000 + crash + ["." * 72] * 100 + dump
                     + ["." * 72] * 200)
    report = failure_report(text)
    assert "[rank 3] FAILED tests/x.py::test_a - ValueError: early" in report
    assert "ValueError: early\n" in report and "_pytest/runner.py" not in report
    assert "not done after 300 s on rank 6" in report and "line 9 in test_b" in report
    assert "Segmentation fault" in report and "line 3 in test_c" in report
    assert len(report.splitlines()) <= 3 * (60 + 1) + 80 + 2  # (three reports and the end)
