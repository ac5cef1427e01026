"""Algorithm names -> classes, and the ``auto`` choice.

Adding an algorithm: one module in ``algorithms/`` and one line in
``_ALGORITHMS``; tests, ``verify`` and the benchmark loop over this table.
"""

from __future__ import annotations

from .algorithms.driver import Driver
from .algorithms.hierarchical import Hierarchical
from .algorithms.rabenseifner import Rabenseifner
from .algorithms.recursive_doubling import RecursiveDoubling
from .algorithms.ring import Ring
from .algorithms.ring_pipelined import PipelinedRing

__all__ = ["ALGORITHMS", "get", "build", "choose", "resolve"]

_ALGORITHMS = {
    cls.name: cls
    for cls in (Driver, Ring, RecursiveDoubling, Hierarchical, PipelinedRing, Rabenseifner)
}

#: the names ``algorithm=`` accepts besides "auto"
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)

#: below this many bytes ``auto`` picks recursive doubling (latency-bound), above it the ring
SMALL_MESSAGE_BYTES = 64 * 1024


def get(name: str):
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; choose one of: auto, {', '.join(ALGORITHMS)}"
        ) from None


def check_name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"algorithm must be a string, got {type(name).__name__}")
    if name != "auto":
        get(name)
    return name


def choose(nbytes: int, size: int) -> str:
    """The algorithm ``auto`` runs for a vector of ``nbytes`` on ``size`` ranks."""
    if size <= 2 or nbytes < SMALL_MESSAGE_BYTES:
        return "recursive_doubling"
    return "ring"


def resolve(name: str, nbytes: int, size: int) -> str:
    return choose(nbytes, size) if name == "auto" else name


def build(plan, name: str):
    """An algorithm instance for ``plan`` (``auto`` resolved for its size)."""
    name = resolve(name, plan.count * plan.dtype.itemsize, plan.size)
    return get(name)(plan)
