"""mpi4py's own collective tests, fetched once (mpi4py's source
distribution from PyPI, the version installed), for
``tests/test_mpi4py_suite_mpi.py``."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


def suite_dir() -> Optional[Path]:
    """The directory of mpi4py's tests for the installed version, fetched
    into ``.cache/`` the first time; None if they cannot be had (offline)."""
    import mpi4py

    target = ROOT / ".cache" / f"mpi4py-{mpi4py.__version__}-tests"
    if (target / "test_cco_buf.py").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "-d", tmp, f"mpi4py=={mpi4py.__version__}"],
                           check=True, timeout=300, capture_output=True)
        except (subprocess.SubprocessError, OSError):
            return None
        archives = list(Path(tmp).glob("mpi4py-*.tar.gz"))
        if not archives:
            return None
        partial = target.with_suffix(".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if len(parts) == 3 and parts[1] == "test" and parts[2].endswith(".py"):
                    member.name = parts[2]
                    tar.extract(member, partial)
        partial.rename(target)
    return target
