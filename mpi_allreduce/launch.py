"""Start ``mpiexec`` from Python with a time limit (tests, tools, benchmarks).

Open MPI and MPICH both honour ``MPIEXEC_TIMEOUT``; we also kill the whole
process group if the launcher itself overstays, so nothing can hang.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence


@functools.lru_cache(maxsize=None)
def mpiexec_flavor(mpiexec: str = "mpiexec") -> str:
    """'openmpi', 'mpich' or 'unknown', from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "Open MPI" in out or "OpenRTE" in out or "prterun" in out:
        return "openmpi"
    if "HYDRA" in out or "MPICH" in out:
        return "mpich"
    return "unknown"


def find_mpiexec() -> Optional[str]:
    """The mpiexec next to this Python (a venv with the bundled MPI) or on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("mpiexec")


def mpiexec_command(nprocs: int, args: Sequence[str], mpiexec: Optional[str] = None,
                    extra: Sequence[str] = ()) -> list[str]:
    """``mpiexec -n N [--oversubscribe] ARGS``: oversubscribed on Open MPI,
    since the tests run more ranks than this machine has cores."""
    mpiexec = mpiexec or find_mpiexec() or "mpiexec"
    cmd = [mpiexec, "-n", str(nprocs)]
    if mpiexec_flavor(mpiexec) == "openmpi":
        cmd.append("--oversubscribe")
    return cmd + list(extra) + list(args)


def mpiexec_env(timeout: float, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["MPIEXEC_TIMEOUT"] = str(int(timeout))
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Open MPI refuses to run as root unless told twice
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], timeout: float, env: Optional[dict] = None,
        cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the group after ``timeout`` + grace.

    Returns the completed process (stdout and stderr merged); on time-out
    ``returncode`` is 124, as with timeout(1).
    """
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 30)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                out = ""
        return subprocess.CompletedProcess(proc.args, 124, out or "", None)


#: called with one line as each :func:`run_mpi` launch starts and ends (the
#: test suite prints them, so that minutes-long launches are seen to move)
announce: Optional[Callable[[str], None]] = None


def _program(args: Sequence[str]) -> str:
    """``args`` as a reader knows them: ``python -m x ...`` for this
    interpreter, paths shortened to their last part."""
    words = ["python" if a == sys.executable else a for a in args]
    words = [w.strip().splitlines()[0] + " ..." if "\n" in w.strip() else w for w in words]
    return " ".join(os.path.basename(w) if os.path.isabs(w) else w for w in words)


def run_mpi(nprocs: int, args: Sequence[str], timeout: float = 600,
            env_extra: Optional[dict] = None, cwd: Optional[str] = None,
            extra: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """``mpiexec -n nprocs args`` with a time limit; output captured."""
    label = f"mpiexec -n {nprocs} {_program(args)}"
    if announce:
        announce(f"{label}: started (time limit {timeout:.0f} s)")
    start = time.monotonic()
    result = run(mpiexec_command(nprocs, args, extra=extra), timeout,
                 env=mpiexec_env(timeout, env_extra), cwd=cwd)
    if announce:
        tests = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", result.stdout, re.M)
        announce(f"{label}: exit {result.returncode} after {time.monotonic() - start:.0f} s"
                 + (f" ({len(tests)} ranks reported; first: {tests[0]})" if tests else ""))
    return result
