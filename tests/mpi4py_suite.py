"""mpi4py's own tests of collectives and of message specs (from mpi4py's
source distribution, the version installed), for
``tests/test_mpi4py_suite_mpi.py``.

They are fetched once, by :func:`fetch`, in the serial pytest session
before any ``mpiexec`` starts (``tests/test_launch.py``): a download can
take minutes on a cold cache, which must not count against the per-test
watchdog of an MPI run.  Under ``mpiexec`` only :func:`suite_dir` is
called, which never touches the network."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
#: seconds the download may take (pip's own retries included)
FETCH_TIMEOUT = 600
#: the test modules of mpi4py's that the MPI runs take (all of its tests are unpacked)
MODULES = ("test_cco_buf", "test_cco_nb_buf", "test_cco_pr_buf", "test_msgspec", "test_msgzero")


def _target() -> Path:
    import mpi4py

    return ROOT / ".cache" / f"mpi4py-{mpi4py.__version__}-tests"


def _reason_file() -> Path:
    return _target().with_suffix(".skip")


def suite_dir() -> Tuple[Optional[Path], str]:
    """(the directory of mpi4py's tests, "") if they were fetched, else
    (None, why not).  No network."""
    target = _target()
    if all((target / f"{name}.py").exists() for name in MODULES):
        return target, ""
    reason = _reason_file()
    if reason.exists():
        return None, reason.read_text().strip()
    return None, ("mpi4py's tests were not fetched: the serial session fetches them before "
                  "the MPI runs (python -m pytest tests/test_launch.py)")


def fetch() -> Tuple[Optional[Path], str]:
    """Fetch mpi4py's sdist (that alone: ``--no-binary mpi4py``, so pip takes
    wheels for its build dependencies instead of building them) and unpack
    its tests into ``.cache/``, once.  On failure record why, for the MPI
    runs to skip with that reason."""
    import mpi4py

    path, _ = suite_dir()
    if path is not None:
        return path, ""
    target, reason = _target(), _reason_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    reason.unlink(missing_ok=True)
    spec = f"mpi4py=={mpi4py.__version__}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", "mpi4py", "-d", tmp, spec],
                           check=True, timeout=FETCH_TIMEOUT, capture_output=True, text=True)
            archives = list(Path(tmp).glob("mpi4py-*.tar.gz"))
            if not archives:
                raise OSError("pip downloaded no source archive")
        except subprocess.TimeoutExpired:
            return _failed(f"downloading {spec}'s source took over {FETCH_TIMEOUT} s")
        except subprocess.CalledProcessError as exc:
            last = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:] or ["?"]
            return _failed(f"pip download {spec} failed: {last[0]}")
        except OSError as exc:
            return _failed(f"pip download {spec} failed: {exc}")
        partial = target.with_suffix(".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if len(parts) == 3 and parts[1] == "test" and parts[2].endswith(".py"):
                    member.name = parts[2]
                    tar.extract(member, partial)
        partial.rename(target)
    return target, ""


def _failed(why: str) -> Tuple[None, str]:
    text = f"mpi4py's tests could not be fetched ({why}); they are skipped"
    _reason_file().write_text(text + "\n")
    return None, text
