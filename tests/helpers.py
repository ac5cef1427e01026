"""Expected results computed without MPI: every rank can generate every
rank's input (it is deterministic), so it reduces them locally in rank order."""

from __future__ import annotations

import numpy as np

from mpi_allreduce import registry
from mpi_allreduce.ops import resolve_op
from mpi_allreduce.tools.verify import make_data

#: variants with options, after an algorithm's plain one: (label, options);
#: the hierarchical ones emulate nodes of 2 and 3 ranks; radix 3 folds where
#: the default radix (4) runs one step with every rank (4 ranks) and the
#: other way round (3 and 9 ranks).  The torus's default row size already
#: gives rows of 1 (p prime) and of 2 (4, 6, 8 ranks); a fixed one would not
#: divide every size the tests run on.
WITH_OPTIONS = {
    "hierarchical": [("hierarchical-rpn2", {"ranks_per_node": 2}),
                     ("hierarchical-rpn3-ring", {"ranks_per_node": 3, "inner": "ring"})],
    "recursive_multiplying": [("recursive_multiplying-k3", {"radix": 3})],
    "knomial": [("knomial-k3", {"radix": 3})],
}

#: (label, algorithm, options): every algorithm of the registry, in its
#: order, as it is (labelled by its name), then its variants with options
VARIANTS = [variant for name in registry.ALGORITHMS
            for variant in [(name, name, {})]
            + [(label, name, options) for label, options in WITH_OPTIONS.get(name, [])]]
VARIANT_IDS = [v[0] for v in VARIANTS]


def inputs(comm, dtype, op, count, kind="exact", seed=7):
    return [make_data(np.dtype(dtype), op, count, r, kind, seed) for r in range(comm.Get_size())]


def expected(comm, dtype, op, count, kind="exact", seed=7):
    data = inputs(comm, dtype, op, count, kind, seed)
    ours = resolve_op(op)
    out = data[0].copy()
    for x in data[1:]:
        ours.ufunc(out, x, out=out)
    if ours.finalize is not None:
        ours.finalize(out, comm.Get_size(), out=out)
    return out


def mine(comm, dtype, op, count, kind="exact", seed=7):
    return make_data(np.dtype(dtype), op, count, comm.Get_rank(), kind, seed)


def set_watchdog(monkeypatch, seconds, action: str = "raise") -> None:
    """The watchdog at ``seconds`` with ``action``, through the environment
    (undone by ``monkeypatch.undo()`` and :func:`restore_watchdog`)."""
    from mpi_allreduce import config

    monkeypatch.setenv(config.WATCHDOG_ENV, str(seconds))
    monkeypatch.setenv(config.WATCHDOG_ACTION_ENV, action)
    config.refresh()


def restore_watchdog(monkeypatch) -> None:
    from mpi_allreduce import config

    monkeypatch.undo()
    config.refresh()


def interrupt_once(monkeypatch, owner, name: str, armed: list, message: str = "") -> None:
    """Replace ``owner.name`` (a function of a module, or a method of a
    class) by one that, while ``armed[0]`` is true, disarms it and raises
    KeyboardInterrupt -- an interrupt landing there once -- and otherwise
    calls the original (``armed``: a one-element list, which several
    replacements may share, set by the test to arm it later)."""
    real = getattr(owner, name)

    def interrupted(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt(message or f"lands in {name}")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, interrupted)


def raise_mode(monkeypatch, seconds: float):
    """The watchdog in raise mode with ``seconds``, undone afterwards: the
    body of a fixture (``yield from raise_mode(monkeypatch, 0.5)``)."""
    set_watchdog(monkeypatch, seconds)
    yield
    restore_watchdog(monkeypatch)
