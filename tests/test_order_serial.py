"""Which algorithms combine operands in rank order, checked for every p.

A non-commutative op gets exactly MPI's result, ``x_0 OP x_1 OP ... OP
x_{p-1}``, only from algorithms that never swap or skip operands.  The
op here (verify's :func:`~mpi_allreduce.tools.verify.interval`) makes any
other order visible: an element is an interval of ranks ``[a, b]``;
``[a, b] OP [c, d]`` is ``[a, d]`` when ``c == b + 1`` and -1 otherwise, so
the all-reduce of ``[r, r]`` over p ranks is ``[0, p - 1]`` only if every
combination took its operands in rank order, each once.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpi_allreduce import registry
from mpi_allreduce.simulate import execute, schedules
from mpi_allreduce.tools.verify import K, interval


def combine(first, second, out):
    out[...] = interval(first, second)


def run(algorithm: str, p: int, count: int, segment: int, in_place: bool) -> np.ndarray:
    scheds = schedules(algorithm, p, count, segment,
                       {"ranks_per_node": 2, "inner": "recursive_doubling"}
                       if algorithm == "hierarchical" else None)
    arrays, results = [], np.empty((p, count), np.int64)
    for rank, sched in enumerate(scheds):
        recv = results[rank]
        send = np.full(count, rank * K + rank, np.int64)
        if in_place:
            recv[...] = send
            send = recv
        arrays.append((send, recv, np.zeros(max(sched.scratch, 1), np.int64)))
    execute(scheds, arrays, None, combine, 8, f"{algorithm} p={p}")
    return results


@pytest.mark.parametrize("algorithm", registry.ORDERED)
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_ordered_algorithms_combine_in_rank_order(algorithm, in_place):
    """p = 1..33 and a few larger (fewer for the heavy ones, below), counts
    with uneven blocks and several segments: every element of every rank is
    [0, p-1]."""
    # (the algorithms that combine p vectors on every rank, p^2 messages a
    # segment, run p = 1..17, 24 and 33: the order of p operands does not
    # change its kind past a few powers of two and the sizes between them)
    heavy = algorithm in ("naive", "allgather_reduce")
    sizes = list(range(1, 18)) + [24, 33] if heavy else list(range(1, 34)) + [48, 64, 100]
    for p in sizes:
        for count, segment in ((1, 4), (p + 3, 2), (37, 5)):
            result = run(algorithm, p, count, segment, in_place)
            assert (result == p - 1).all(), (algorithm, p, count, segment,
                                               np.unique(result).tolist()[:5])


@pytest.mark.parametrize("algorithm", [a for a in registry.ALGORITHMS
                                       if a not in registry.ORDERED])
def test_the_others_do_not(algorithm):
    """The check has teeth: the algorithms marked commutative-only swap
    operands somewhere (so a non-commutative op must not reach them)."""
    broken = [p for p in range(3, 9)
              if not (run(algorithm, p, 2 * p + 1, 3, False) == p - 1).all()]
    assert broken, f"{algorithm} combined in rank order at p = 3..8"
