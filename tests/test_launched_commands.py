"""The command line tool and the launchers under mpiexec (``verify``,
``info``, ``tune``, ``model``, the examples, the torch backend's rendezvous,
an abort on one rank): each one short launch.

Apart from tests/test_launch.py, whose launches of the MPI tests take one
process of the serial session for most of its length: these run in another
(files are shared among processes whole), beside them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mpi_allreduce.launch import run_mpi

from .test_launch import ROOT, _openmpi, pytestmark, tail  # noqa: F401 (pytestmark: the skip)

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
