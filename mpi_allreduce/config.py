"""Settings from the environment, read once (as MPI libraries read theirs at start-up).

=============================== ==============================================
MPI_ALLREDUCE_CHECK=1           check mode: exchange an argument fingerprint first
MPI_ALLREDUCE_SEGMENT_BYTES=N   bytes per message where the data is reduced
                                (default 1 MiB)
MPI_ALLREDUCE_RANKS_PER_NODE=N  hierarchical: emulate nodes of N consecutive ranks
MPI_ALLREDUCE_INNER=NAME        hierarchical: algorithm across node leaders
MPI_ALLREDUCE_TUNING=PATH       decision table for algorithm="auto"
MPI_ALLREDUCE_SELECTION=S       auto: "table" (default; reproducible) or
                                "live" (also times candidates on live calls)
MPI_ALLREDUCE_CUDA_AWARE=0|1    force the GPU path (direct or staged)
MPI_ALLREDUCE_ON_ERROR=E        an error inside an algorithm, after messages
                                started: "abort" the job (default) or "raise"
MPI_ALLREDUCE_WATCHDOG=S        report a call that waits S seconds (default 600;
                                0: off), then act:
MPI_ALLREDUCE_WATCHDOG_ACTION=A "abort" the job (default), "raise" Stalled, or
                                "warn" only
MPI_ALLREDUCE_PROGRESS=P        non-blocking calls: "thread" (default where
                                MPI runs with MPI_THREAD_MULTIPLE) or
                                "caller" (progress in test/wait only)
=============================== ==============================================

Call :func:`refresh` after changing them inside a running program.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

CHECK_ENV = "MPI_ALLREDUCE_CHECK"
SEGMENT_ENV = "MPI_ALLREDUCE_SEGMENT_BYTES"
RANKS_PER_NODE_ENV = "MPI_ALLREDUCE_RANKS_PER_NODE"
INNER_ENV = "MPI_ALLREDUCE_INNER"
TUNING_ENV = "MPI_ALLREDUCE_TUNING"
SELECTION_ENV = "MPI_ALLREDUCE_SELECTION"
CUDA_AWARE_ENV = "MPI_ALLREDUCE_CUDA_AWARE"
PROGRESS_ENV = "MPI_ALLREDUCE_PROGRESS"
PROGRESS_CHOICES = ("thread", "caller")
WATCHDOG_ENV = "MPI_ALLREDUCE_WATCHDOG"
WATCHDOG_ACTION_ENV = "MPI_ALLREDUCE_WATCHDOG_ACTION"
WATCHDOG_ACTIONS = ("abort", "raise", "warn")
#: seconds a call may wait before the watchdog acts, unless set
DEFAULT_WATCHDOG_SECONDS = 600.0
ON_ERROR_ENV = "MPI_ALLREDUCE_ON_ERROR"
ON_ERROR_CHOICES = ("abort", "raise")

#: values of a yes/no variable that mean yes
TRUE_WORDS = ("1", "yes", "true", "on")


class Environment(NamedTuple):
    check: bool
    segment_bytes: Optional[int]
    ranks_per_node: Optional[int]
    inner: Optional[str]
    tuning: Optional[str]
    selection: Optional[str]
    cuda_aware: Optional[str]
    progress: Optional[str]
    on_error: str
    watchdog: float
    watchdog_action: str


def _get(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    return value or None


def _int(name: str) -> Optional[int]:
    value = _get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


@functools.lru_cache(maxsize=1)
def environment() -> Environment:
    return Environment(
        check=(_get(CHECK_ENV) or "").lower() in TRUE_WORDS,
        segment_bytes=_int(SEGMENT_ENV),
        ranks_per_node=_int(RANKS_PER_NODE_ENV),
        inner=_get(INNER_ENV),
        tuning=_get(TUNING_ENV),
        selection=_get(SELECTION_ENV),
        cuda_aware=_get(CUDA_AWARE_ENV),
        progress=_choice(PROGRESS_ENV, PROGRESS_CHOICES),
        on_error=_choice(ON_ERROR_ENV, ON_ERROR_CHOICES) or "abort",
        watchdog=_seconds(WATCHDOG_ENV, DEFAULT_WATCHDOG_SECONDS),
        watchdog_action=_choice(WATCHDOG_ACTION_ENV, WATCHDOG_ACTIONS) or "abort",
    )


def _seconds(name: str, default: float) -> float:
    value = _get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if seconds < 0:
        raise ValueError(f"{name}={value!r} must be 0 (off) or more")
    return seconds


def _choice(name: str, choices: tuple) -> Optional[str]:
    value = _get(name)
    if value is not None and value.lower() not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value and value.lower()


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
