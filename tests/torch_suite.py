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
  gloo- and NCCL-only ones skip).  After the import the module's
  ``BACKEND`` is ours, so the bodies that read it (``dist.new_group``'s
  backend, ``dist.get_backend()`` compared to it) use this backend.
* Our backend is added to the suite's ``PROFILING_SUPPORTED_BACKENDS``:
  its profiler events are named as torch's backends name theirs
  (``mpi_allreduce:all_reduce``), so the profiling variants check them.
* The suite's file barrier (``TEMP_DIR``) is one directory rank 0 makes.
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
    from torch.testing._internal.distributed import distributed_test as suite

    import mpi_allreduce.torch as backend

    suite.BACKEND = backend.BACKEND
    suite.PROFILING_SUPPORTED_BACKENDS.append(backend.BACKEND)
    dist.init_process_group(backend.BACKEND)

    class TestMPIAllreduce(unittest.TestCase, suite.DistributedTest._DistTestBase):
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
            suite.Barrier.init()
            record({"name": name, "outcome": "started"})
        world.Barrier()
        start = time.monotonic()
        result = unittest.TestResult()
        try:
            TestMPIAllreduce(name).run(result)
        except BaseException:  # noqa: BLE001 - recorded as the test's error
            result.errors.append((None, traceback.format_exc()))
        mine = _outcome(result)
        everyone = world.gather(mine + (time.monotonic() - start,), root=0)
        if rank == 0:
            worst = next((o for o in everyone if o[0] in ("failed", "error")), everyone[0])
            seconds = round(max(o[2] for o in everyone), 2)
            record({"name": name, "outcome": worst[0], "detail": worst[1], "seconds": seconds})
            print(f"{name}: {worst[0]} ({seconds} s) {worst[1][:160]}", flush=True)
    if rank == 0:
        out.close()
    world.Barrier()
    dist.destroy_process_group()
    return 0


def _outcome(result: unittest.TestResult) -> tuple:
    """(outcome, the detail: the last line of the error, or the skip's reason)."""
    for kind, entries in (("error", result.errors), ("failed", result.failures)):
        if entries:
            lines = entries[0][1].strip().splitlines()
            return kind, lines[-1] if lines else kind
    if result.skipped:
        return "skipped", str(result.skipped[0][1])
    if result.expectedFailures:
        return "passed", "an expected failure"
    return "passed", ""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
