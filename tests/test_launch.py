"""The MPI half of the suite: the ``@pytest.mark.mpi`` tests under mpiexec,
plus the command line tool under mpiexec.  Every mpiexec has a time limit.

Which world sizes.  Most MPI tests take the ``comm`` fixture
(tests/conftest.py) and run on communicators of the world: a duplicate of
it, the world reversed, its even ranks and the world minus its last rank.
The launches at world sizes 1, 3, 5 and 8 run those of them that add a size
or a rank order (``SUBCOMM_KINDS_AT`` in tests/conftest.py):

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


@pytest.mark.parametrize("size,only", LAUNCHES,
                         ids=[f"np{n}" + (f"-{only}-only" if only else "") for n, only in LAUNCHES])
def test_mpi_suite(size, only, peer_tests, record_property):
    """All MPI tests (or only those on COMM_WORLD, or only those on the
    ``comm`` fixture) pass on every rank at this world size."""
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


def test_verify_command_prints_zero_wrong():
    """``mpiexec -n 3 python -m mpi_allreduce verify`` on a reduced matrix:
    the command itself (its algorithms at every size are the MPI tests' and
    tests/test_verify_mpi.py's)."""
    result = run_mpi(3, [sys.executable, "-m", "mpi_allreduce", "verify", "--no-large",
                            "-d", "int32,float16,float32,complex64,bool", "--counts", "0,1,5,8,97"],
                     timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    assert "# OK:" in result.stdout and " 0 wrong elements" in result.stdout, tail(result.stdout)
    for name in ("driver", "ring", "recursive_doubling", "hierarchical/rpn=2"):
        assert name in result.stdout
    # pair types and a non-commutative user op: run by the ordered algorithms, refused by the ring
    assert "DOUBLE_INT" in result.stdout and "refused" in result.stdout


def test_command_line_aborts_the_job_when_one_rank_fails(tmp_path):
    """An exception on rank 1 only must end the job, not leave rank 0 waiting."""
    script = tmp_path / "fail_on_one_rank.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "import mpi_allreduce.__main__ as cli\n"
        "def broken(args):\n"
        "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "        raise RuntimeError('rank 1 fails on purpose')\n"
        "    MPI.COMM_WORLD.Barrier()  # would wait forever without the abort\n"
        "    return 0\n"
        "cli.COMMANDS['info'] = broken\n"
        "raise SystemExit(cli.main(['info']))\n"
    )
    result = run_mpi(2, [sys.executable, str(script)], timeout=60, cwd=str(ROOT))
    assert result.returncode not in (0, 124), tail(result.stdout)
    assert "rank 1 fails on purpose" in result.stdout


def test_info_command():
    result = run_mpi(2, [sys.executable, "-m", "mpi_allreduce", "info"], timeout=60,
                     cwd=str(ROOT), env_extra={"MPI_ALLREDUCE_CUDA_AWARE": "0"})
    assert result.returncode == 0, tail(result.stdout)
    assert "ranks       : 2" in result.stdout
    assert "staged through host memory -- forced by MPI_ALLREDUCE_CUDA_AWARE=0" in result.stdout


def test_tune_writes_the_table_auto_then_finds_by_itself(tmp_path):
    """``tune`` with no ``-o`` writes the table for this MPI, machine and
    ranks per node under MPI_ALLREDUCE_TUNING_DIR; a new launch's ``auto``
    reads it with nothing named (``info`` shows its rules and its file)."""
    import json

    env = {"MPI_ALLREDUCE_TUNING_DIR": str(tmp_path)}
    tuned = run_mpi(2, [sys.executable, "-m", "mpi_allreduce", "tune", "-e", "64K", "-f", "16",
                        "-n", "2", "-r", "1"], timeout=300, cwd=str(ROOT), env_extra=env)
    assert tuned.returncode == 0, tail(tuned.stdout)
    (path,) = tmp_path.glob("tuning-*.json")
    table = json.loads(path.read_text())
    assert table["key"]["ranks_per_node"] == 2 and table["key"]["mpi"]
    (rule,) = table["rules"]
    assert rule["comm_size"] == 2 and [m["size"] for m in rule["measured"]] == [8, 128, 2048,
                                                                                  32768]
    info = run_mpi(2, [sys.executable, "-m", "mpi_allreduce", "info"], timeout=60,
                   cwd=str(ROOT), env_extra=env)
    assert info.returncode == 0, tail(info.stdout)
    assert f"measured by tune for this MPI, machine and ranks per node: {path}" in info.stdout
    from mpi_allreduce.selection import describe_choices

    rules = describe_choices(2, "oversubscribed" in rule, table)
    assert f"auto        : {rules} (" in info.stdout, tail(info.stdout)


def test_model_command_fits_and_predicts_every_algorithm(tmp_path):
    """``model`` on 3 ranks (emulated as 2 nodes would need root; one node
    here): the fitted machine has its measured curves, software costs and
    core count, and every algorithm at every size has a positive
    prediction next to its measurement."""
    import json

    from mpi_allreduce.registry import ALGORITHMS

    out = tmp_path / "model.json"
    result = run_mpi(3, [sys.executable, "-m", "mpi_allreduce", "model", "-b", "8", "-e", "64K",
                         "-f", "64", "-n", "3", "-r", "1", "--json", str(out)],
                     timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    data = json.loads(out.read_text())
    prm = data["params"]
    assert len(prm["curve"]) == len(prm["curve_fresh"]) == 20
    assert all(t >= 0 for _, t in prm["curve"]) and prm["curve"][-1][1] > prm["curve"][0][1]
    assert prm["cores"] >= 1 and prm["overhead"] > 0 and prm["gamma"] > 0
    assert {r["algorithm"] for r in data["rows"]} == set(ALGORITHMS)
    assert all(r["predicted_us"] > 0 and r["measured_us"] > 0 for r in data["rows"])
    # every algorithm at 3 sizes (8 B, 512 B, 32 KiB)
    assert re.search(rf"# within \+-25%: \d+ of {3 * len(ALGORITHMS)} points", result.stdout), \
        tail(result.stdout)


def test_sgd_example_keeps_ranks_bit_identical(tmp_path):
    """The data-parallel example: every mode leaves every rank's weights
    bit-identical to rank 0's, and the loss curve is written."""
    png = tmp_path / "loss.png"
    result = run_mpi(3, [sys.executable, "-m", "mpi_allreduce.examples.sgd", "--steps", "12",
                         "--warmup", "2", "--hidden", "96", "--bucket-bytes", "20000",
                         "--png", str(png)], timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    for mode in ("fused", "ours", "mpi"):
        assert re.search(rf"{mode}: weights on all 3 ranks bit-identical to rank 0's: yes",
                         result.stdout), tail(result.stdout)
    assert "ms/step" in result.stdout
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


BIG_VECTOR = """
import numpy as np, mpi_allreduce as mar
from mpi4py import MPI
comm = MPI.COMM_WORLD
n = 2**31 + 17
x = np.ones(n, np.int8)
x[-1] = comm.rank
y = mar.allreduce(x, None, 'sum', algorithm='driver')
assert y[0] == comm.size and y[n // 2] == comm.size and y[-1] == sum(range(comm.size)), y[-3:]
print('big vector ok', comm.rank, flush=True)
"""


@pytest.mark.skipif(_available_bytes() < 14 << 30, reason="needs about 14 GiB of free memory")
def test_driver_takes_more_than_2_31_elements():
    """2**31 + 17 int8 elements through the driver, whose whole-vector
    messages used to exceed MPI's int count (MPI_ERR_ARG)."""
    result = run_mpi(2, [sys.executable, "-c", BIG_VECTOR], timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    assert result.stdout.count("big vector ok") == 2, tail(result.stdout)


MID_ALGORITHM_ERROR = """
import numpy as np, mpi_allreduce as mar
from mpi4py import MPI
comm = MPI.COMM_WORLD
if comm.rank == 1:
    def broken(*args, **kwargs):
        raise FloatingPointError('injected: the reduction fails on rank 1 only')
    np.add = broken  # bound when the plan is made, inside the algorithm
x = np.ones(1000)
mar.allreduce(x, None, 'sum', algorithm='ring', segment_size=10)
print('returned on rank', comm.rank, flush=True)
"""


def test_error_inside_an_algorithm_aborts_the_job():
    """One rank fails after messages started (the others would wait for it
    forever): the job is aborted at once, with the reason on stderr."""
    result = run_mpi(3, [sys.executable, "-c", MID_ALGORITHM_ERROR], timeout=120, cwd=str(ROOT))
    assert result.returncode not in (0, 124), tail(result.stdout)
    assert "injected: the reduction fails on rank 1 only" in result.stdout, tail(result.stdout)
    assert "aborting the job" in result.stdout, tail(result.stdout)


MISMATCHED_OP = """
import numpy as np, mpi_allreduce as mar
from mpi4py import MPI
comm = MPI.COMM_WORLD
x = np.ones(4)
y = mar.allreduce(x, None, 'max' if comm.rank == 0 else 'sum', algorithm='recursive_doubling')
print('returned', y, flush=True)
"""


def test_watchdog_aborts_a_mismatched_call_and_says_where():
    """Default action: ranks that disagree on the op wait (their messages
    cannot match) until the watchdog reports the call and its peers and
    aborts the job; no rank returns a result."""
    result = run_mpi(3, [sys.executable, "-c", MISMATCHED_OP], timeout=120, cwd=str(ROOT),
                     env_extra={"MPI_ALLREDUCE_WATCHDOG": "2"},
                     extra=["-x", "MPI_ALLREDUCE_WATCHDOG"] if _openmpi() else [])
    assert result.returncode not in (0, 124), tail(result.stdout)
    assert "returned" not in result.stdout, tail(result.stdout)
    assert re.search(r"watchdog: world rank \d has waited \d+ s in call #1 of thread "
                     r"'MainThread': allreduce of 4 x float64, op (max|sum), algorithm "
                     r"recursive_doubling", result.stdout), tail(result.stdout)
    assert "aborting the job" in result.stdout, tail(result.stdout)


def test_torchrun_is_refused_on_every_rank_with_a_clear_error(tmp_path):
    """torchrun starts processes without MPI (each one an MPI world of its
    own): making the group refuses, on every rank, saying how to launch
    (docs/frameworks.md)."""
    pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
    import shutil

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torch is installed without its torchrun command")
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\nimport mpi_allreduce.torch\n"
                      "dist.init_process_group('mpi_allreduce')\n")
    from mpi_allreduce.launch import run

    # (--standalone: torchrun's own store on a port the system picks)
    result = run([torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
                 timeout=120, cwd=str(tmp_path))
    assert result.returncode not in (0, 124), tail(result.stdout)
    for rank in (0, 1):
        assert (f"torch's group (rank {rank} of 2) is not MPI's (rank 0 of 1): launch every "
                "process with mpiexec or srun") in result.stdout, tail(result.stdout)


#: rank 0 of the program below: whether MASTER_PORT can be bound by anyone
#: else between the import and the rendezvous, then a group made twice
HELD_PORT = """
import errno, os, socket
import torch, torch.distributed as dist
import mpi_allreduce.torch
if int(os.environ["RANK"]) == 0:
    with socket.socket() as other:
        try:
            other.bind(("", int(os.environ["MASTER_PORT"])))
            print("PORT FREE", flush=True)
        except OSError as exc:
            print("port held" if exc.errno == errno.EADDRINUSE else f"PORT {exc}", flush=True)
for backend in ("mpi_allreduce", "gloo", "mpi_allreduce"):
    dist.init_process_group(backend)
    t = torch.ones(2)
    dist.all_reduce(t)
    print(backend, dist.get_rank(), t.tolist(), flush=True)
    dist.destroy_process_group()
"""


def test_the_rendezvous_port_is_held_from_the_import_on():
    """Under mpiexec, importing the backend fills in MASTER_PORT with the
    port of a store server rank 0 has started and keeps: nothing else can
    take the port before torch's rendezvous (a port probed and let go
    could be taken, and the other ranks then waited for a rank 0 that had
    failed); groups destroyed and made again rendezvous too."""
    pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
    result = run_mpi(3, [sys.executable, "-c", HELD_PORT], timeout=180, cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    assert "port held" in result.stdout and "PORT" not in result.stdout, tail(result.stdout)
    for backend in ("mpi_allreduce", "gloo"):
        for rank in range(3):
            assert f"{backend} {rank} [3.0, 3.0]" in result.stdout, tail(result.stdout)


def test_values_a_parent_filled_in_are_not_taken_for_a_launchers(tmp_path):
    """A process that imported the backend (a singleton: its environment
    filled in, its store server kept) and then starts a job under mpiexec:
    the job's ranks fill in their own rank, size and port, where they
    would otherwise all have been the parent's rank 0 of 1, on the port
    the parent holds."""
    pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
    script = tmp_path / "job.py"
    script.write_text(HELD_PORT)
    parent = ("import os, subprocess, sys\n"
              "import mpi_allreduce.torch\n"
              "from mpi_allreduce.launch import run_mpi\n"
              "assert os.environ['WORLD_SIZE'] == '1'\n"
              f"result = run_mpi(2, [sys.executable, {str(script)!r}], timeout=150)\n"
              "print(result.stdout)\n"
              "sys.exit(result.returncode)\n")
    from mpi_allreduce.launch import run

    result = run([sys.executable, "-c", parent], timeout=180, cwd=str(ROOT))
    assert result.returncode == 0, tail(result.stdout)
    for rank in range(2):
        assert f"mpi_allreduce {rank} [2.0, 2.0]" in result.stdout, tail(result.stdout)


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
