"""Settings from the environment: one declarative table, read once (as MPI
libraries read theirs at start-up).

:data:`SETTINGS` holds every variable with its type, range, default and
meaning; it drives the parsing (a bad value raises :class:`SettingError`
naming the variable, never a silent default), ``python -m mpi_allreduce
info`` and the documentation's settings reference (``python -m mpi_allreduce
info --settings`` prints it).  Call :func:`refresh` after changing a variable inside a
running program.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["SETTINGS", "Setting", "SettingError", "environment", "refresh", "on_refresh",
           "settings_table"]


class SettingError(ValueError):
    """An environment variable of the library's holds a value it refuses."""


#: the spellings of yes and no
TRUE_WORDS = ("1", "yes", "true", "on")
FALSE_WORDS = ("0", "no", "false", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``parse(text)`` gives its value (or raises
    ValueError with what was expected); unset or empty means ``default``."""

    name: str
    field: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    values: str  # what it takes, for the table


def _flag(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")


def _positive_int(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise ValueError("expected a whole number") from None
        if not 1 <= value <= limit:
            raise ValueError(f"expected 1 to {limit}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number of seconds, 0 (off) or more")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text.lower()
    return parse


def _name(text: str) -> str:
    return text


def _path(text: str) -> str:
    return text


def _tuning_directory(text: str) -> str:
    """A directory (made when ``tune`` writes there), or ``off``."""
    return "off" if text.lower() == "off" else os.path.abspath(os.path.expanduser(text))


def _trace_directory(text: str) -> str:
    """A directory this process can write into (made if missing)."""
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot make the directory: {exc.strerror or exc}") from None
    if not os.path.isdir(text) or not os.access(text, os.W_OK | os.X_OK):
        raise ValueError("expected a directory this process can write into")
    return os.path.abspath(text)


#: every setting; ``environment()`` has one field per row
SETTINGS: tuple = (
    Setting("MPI_ALLREDUCE_CHECK", "check", _flag, False,
            "check mode: exchange the call's full fingerprint before every call", "0|1"),
    Setting("MPI_ALLREDUCE_SEGMENT_BYTES", "segment_bytes", _positive_int(1 << 40), None,
            "bytes per message at most where the data is to be reduced, and so each "
            "algorithm's scratch (default 1 MiB)", "N >= 1"),
    Setting("MPI_ALLREDUCE_RANKS_PER_NODE", "ranks_per_node", _positive_int(1 << 31), None,
            "hierarchical: emulate nodes of N consecutive ranks", "N >= 1"),
    Setting("MPI_ALLREDUCE_INNER", "inner", _name, None,
            "hierarchical: algorithm among node leaders (default auto)", "NAME"),
    Setting("MPI_ALLREDUCE_TUNING", "tuning", _path, None,
            "decision table for auto (a JSON file written by tune)", "PATH"),
    Setting("MPI_ALLREDUCE_TUNING_DIR", "tuning_dir", _tuning_directory, None,
            "where tune writes, and auto finds, the decision table measured for this MPI "
            "library, machine and ranks per node, when MPI_ALLREDUCE_TUNING is unset "
            "(default $XDG_CACHE_HOME/mpi_allreduce or ~/.cache/mpi_allreduce; off: "
            "the built-in table)", "DIR|off"),
    Setting("MPI_ALLREDUCE_SELECTION", "selection", _choice("table", "live"), None,
            "auto: the decision table alone (default; reproducible), or live selection too",
            "table|live"),
    Setting("MPI_ALLREDUCE_CUDA_AWARE", "cuda_aware", _flag, None,
            "force direct (1) or staged (0) GPU buffers", "0|1"),
    Setting("MPI_ALLREDUCE_PROGRESS", "progress", _choice("thread", "caller"), None,
            "non-blocking calls: a progress thread (default where MPI runs "
            "MPI_THREAD_MULTIPLE) or progress in test()/wait() only", "thread|caller"),
    Setting("MPI_ALLREDUCE_ON_ERROR", "on_error", _choice("abort", "raise"), "abort",
            "an error inside an algorithm after messages started: abort the job or raise",
            "abort|raise"),
    Setting("MPI_ALLREDUCE_WATCHDOG", "watchdog", _seconds, 600.0,
            "report a call that has waited this long, on every kind of call (0: off)",
            "SECONDS"),
    Setting("MPI_ALLREDUCE_WATCHDOG_ACTION", "watchdog_action",
            _choice("abort", "raise", "warn"), "abort",
            "then abort the job, raise mar.Stalled, or only report", "abort|raise|warn"),
    Setting("MPI_ALLREDUCE_KERNELS", "kernels", _choice("auto", "numba", "numpy"), "auto",
            "reproducible sums' passes over memory: numba's fused loops where numba is "
            "installed (auto), always (numba: an error without it), or numpy's; the bytes "
            "are the same", "auto|numba|numpy"),
    Setting("MPI_ALLREDUCE_TRACE", "trace", _trace_directory, None,
            "record every call's rounds, messages, reductions and copies (Chrome trace "
            "format) into this directory; each rank writes its file as the run goes (in "
            "chunks of a few thousand events) and at exit", "DIR"),
)

_BY_FIELD = {s.field: s for s in SETTINGS}
# the names other modules and tests use
CHECK_ENV, SEGMENT_ENV, RANKS_PER_NODE_ENV, INNER_ENV, TUNING_ENV, TUNING_DIR_ENV, \
    SELECTION_ENV, CUDA_AWARE_ENV, PROGRESS_ENV, ON_ERROR_ENV, WATCHDOG_ENV, \
    WATCHDOG_ACTION_ENV, KERNELS_ENV, TRACE_ENV = (s.name for s in SETTINGS)


class Environment(NamedTuple):
    check: bool
    segment_bytes: Optional[int]
    ranks_per_node: Optional[int]
    inner: Optional[str]
    tuning: Optional[str]
    tuning_dir: Optional[str]
    selection: Optional[str]
    cuda_aware: Optional[bool]
    progress: Optional[str]
    on_error: str
    watchdog: float
    watchdog_action: str
    kernels: str
    trace: Optional[str]


assert Environment._fields == tuple(_BY_FIELD), "one Environment field per setting"


def _read(setting: Setting):
    text = os.environ.get(setting.name, "").strip()
    if not text:
        return setting.default
    try:
        return setting.parse(text)
    except ValueError as exc:
        raise SettingError(f"{setting.name}={text!r}: {exc}") from None


@functools.lru_cache(maxsize=1)
def environment() -> Environment:
    """Every setting, parsed (a bad value raises :class:`SettingError`)."""
    return Environment(*(_read(s) for s in SETTINGS))


def settings_table() -> str:
    """Every setting as a Markdown table (the documentation's settings reference, generated)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| variable | values | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "-" if s.default is None else \
            f"`{int(s.default) if isinstance(s.default, bool) else s.default}`"
        lines.append(f"| `{s.name}` | `{cell(s.values)}` | {default} | {cell(s.doc)} |")
    return "\n".join(lines)


def refresh() -> None:
    """Forget the settings read so far (and what was derived from them)."""
    environment.cache_clear()
    for hook in _on_refresh:
        hook()


_on_refresh: list = []


def on_refresh(hook):
    """Register a cache-clearing function to run on :func:`refresh`."""
    _on_refresh.append(hook)
    return hook
