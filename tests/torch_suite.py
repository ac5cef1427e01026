"""torch's own distributed test suite against this library's backend, run as
torch ran it for its MPI backend: in-process under ``mpiexec`` (one group
initialised once per process, every test a method of one ``TestCase``),
for ``tests/test_torch_suite.py``.

    mpiexec -n 3 --oversubscribe python tests/torch_suite.py REPORT.jsonl [NAME-PART ...]

The suite is ``DistributedTest._DistTestBase`` from the torch wheel
(``torch/testing/_internal/distributed/distributed_test.py``).  Our gating,
stated here:

* ``BACKEND=mpi`` while the suite's module is imported: its decorators then
  run or skip each test as they do for torch's MPI backend (the
  ``all_to_all`` tests, "Only MPI supports CPU all_to_all_single", run; the
  gloo- and NCCL-only ones skip, DDP's among them).  After the import the
  module's ``BACKEND`` is our backend's name, as a string that also
  compares equal to ``"mpi"`` (:class:`_AsMPI`): a test body that asks
  ``BACKEND == "mpi"`` takes MPI's path, and one that compares
  ``dist.get_backend()`` with it gets ours.
* Our backend is added to the suite's lists of backends whose profiler
  events it checks: its events are named as torch's backends name theirs
  (``mpi_allreduce:all_reduce``), so the profiling variants check them.
* The tests are methods of a ``TestCase`` of torch's own
  (``common_utils.TestCase``, whose ``assertEqual`` compares tensors), as
  in torch's runs; a test that exits with one of torch's skip codes
  (``sys.exit(TEST_SKIPS[...].exit_code)``, which torch's multi-process
  harness reads as a skip) is a skip with that reason.
* The suite's file barrier (``TEMP_DIR``) is one directory rank 0 makes,
  emptied between tests, with every rank's count of it reset.
* A test that fails on some rank can leave the others' calls unmatched:
  the group is then made again before the next test (a stall has left it
  unusable), so one failure is not counted again in every later test.
* Each test runs on every rank; its outcome on each rank goes to rank 0,
  which appends a line to REPORT.jsonl as each test starts
  (``{"name", "outcome": "started"}``) and ends (``{"name", "outcome",
  "detail", "seconds"}``: "passed", "skipped", "failed" (on any rank) or
  "error"), so a launch ended by its time limit still says which test
  was running.  A stall inside the backend is a failure of that test (the
  caller sets the watchdog's raise action), not a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import unittest


def main(argv: list) -> int:
    from mpi4py import MPI

    report, parts = argv[0], argv[1:]
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    os.environ["BACKEND"] = "mpi"  # torch's gating for its MPI backend (see above)
    os.environ["WORLD_SIZE"] = str(world.Get_size())
    temp = world.bcast(tempfile.mkdtemp(prefix="torch-suite-") if rank == 0 else None)
    os.environ["TEMP_DIR"] = temp
    if rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp, sub), exist_ok=True)
    world.Barrier()

    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed import distributed_test as suite

    import mpi_allreduce.torch as backend

    suite.BACKEND = _AsMPI(backend.BACKEND)
    for listed in (suite.PROFILING_SUPPORTED_BACKENDS,
                   suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
        listed.append(backend.BACKEND)
    skips = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
    dist.init_process_group(backend.BACKEND)

    class TestMPIAllreduce(TestCase, suite.DistributedTest._DistTestBase):
        """torch's tests, in this process's group."""

    names = [n for n in unittest.TestLoader().getTestCaseNames(TestMPIAllreduce)
             if not parts or any(part in n for part in parts)]
    out = open(report, "w") if rank == 0 else None

    def record(entry: dict) -> None:
        out.write(json.dumps(entry) + "\n")
        out.flush()

    for name in names:
        world.Barrier()
        if rank == 0:
            suite.Barrier.init()  # (its files: rank 0 alone removes them)
            record({"name": name, "outcome": "started"})
        world.Barrier()
        suite.Barrier.barrier_id = 0
        start = time.monotonic()
        result = unittest.TestResult()
        try:
            TestMPIAllreduce(name).run(result)
        except BaseException:  # noqa: BLE001 - recorded as the test's error
            result.errors.append((None, traceback.format_exc()))
        mine = _outcome(result, skips)
        everyone = world.allgather(mine + (time.monotonic() - start,))
        worst = next((o for o in everyone if o[0] in ("failed", "error")), everyone[0])
        if rank == 0:
            seconds = round(max(o[2] for o in everyone), 2)
            record({"name": name, "outcome": worst[0], "detail": worst[1], "seconds": seconds})
            print(f"{name}: {worst[0]} ({seconds} s) {worst[1][:160]}", flush=True)
        broken = worst[0] in ("failed", "error")  # (the group may be unusable: made again)
        if broken and dist.is_initialized():
            dist.destroy_process_group()
        if not dist.is_initialized():  # (or a test destroyed it)
            world.Barrier()  # (every rank's group gone before any makes one again)
            dist.init_process_group(backend.BACKEND)
    if rank == 0:
        out.close()
    world.Barrier()
    dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
    return 0


class _AsMPI(str):
    """Our backend's name, equal to ``"mpi"`` as well (see the gating above)."""

    def __eq__(self, other) -> bool:
        return str.__eq__(self, other) or other == "mpi"

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _outcome(result: unittest.TestResult, skips: dict) -> tuple:
    """(outcome, the detail: where it failed and the error's last line, or
    the skip's reason).  ``skips``: torch's skip exit codes, their reasons."""
    for kind, entries in (("error", result.errors), ("failed", result.failures)):
        if entries:
            lines = entries[0][1].strip().splitlines()
            code = lines[-1].removeprefix("SystemExit: ") if lines else ""
            if code.isdigit() and int(code) in skips:
                return "skipped", skips[int(code)]
            where = [line.strip() for line in lines if line.strip().startswith("File ")]
            return kind, " | ".join(where[-2:] + lines[-1:]) if lines else kind
    if result.skipped:
        return "skipped", str(result.skipped[0][1])
    if result.expectedFailures:
        return "passed", "an expected failure"
    return "passed", ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
