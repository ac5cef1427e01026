"""An all-reduce's two halves on their own (reduce-scatter, allgather), as
schedules, for every algorithm that offers them (``registry.HALVES``):
every rank's schedules run against each other in the simulator
(:func:`mpi_allreduce.simulate.execute`: rendezvous messages, matching and
race checks) and every element compared with numpy; the peers and bytes of
each step are the algorithm's own."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_allreduce import registry
from mpi_allreduce.algorithms import phases
from mpi_allreduce.algorithms.ring import build_allgather, build_reduce_scatter
from mpi_allreduce.partition import blocks_of
from mpi_allreduce.schedule import RECV, SEND, Copy, Send
from mpi_allreduce.simulate import execute

SIZES = [1, 2, 3, 5, 7, 8]
#: each algorithm of the halves, knomial at radix 3 too (``(name, options)``)
ALGORITHMS = [(a, ()) for a in registry.HALVES] + [("knomial", (("radix", 3),))]
ALGORITHM_IDS = [a + "".join(f"-{k}{v}" for k, v in o) for a, o in ALGORITHMS]


def halves(what, algorithm, rank, p, counts, segment, in_place=False):
    name, options = algorithm
    return registry.halves(what, name, rank, p, tuple(counts), segment, in_place, options)


def count_cases(p: int) -> list:
    """Even blocks, empty blocks, uneven blocks, one long block."""
    return [tuple([3] * p), tuple(range(p)), tuple((7 * i + 2) % 5 for i in range(p)),
            tuple(11 if i == p // 2 else 0 for i in range(p))]


def case_id(counts) -> str:
    return "-".join(map(str, counts))


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("segment", [1, 2, 1 << 10], ids=lambda s: f"seg{s}")
@pytest.mark.parametrize("p", SIZES + [4, 6, 9, 16], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=ALGORITHM_IDS)
def test_reduce_scatter_schedule(algorithm, p, segment, in_place):
    """In place, ``SEND`` and ``RECV`` are one array (the whole vector, the
    result left at its start); out of place, ``RECV`` is the block alone."""
    for counts in count_cases(p):
        n = sum(counts)
        scheds = [halves("reduce_scatter", algorithm, r, p, counts, segment, in_place)
                  for r in range(p)]
        inputs = [np.arange(n, dtype=np.int64) * (r + 1) + r * r for r in range(p)]
        arrays = []
        for r, s in enumerate(scheds):
            scratch = np.zeros(max(s.scratch, 1), np.int64)
            if in_place:
                whole = inputs[r].copy()
                arrays.append((whole, whole, scratch))
            else:
                arrays.append((inputs[r], np.full(counts[r], -1, np.int64), scratch))
        execute(scheds, arrays, label=case_id(counts))
        total = sum(inputs)
        for r, block in enumerate(blocks_of(counts)):
            np.testing.assert_array_equal(arrays[r][1][:counts[r]], total[block.offset:block.stop],
                                          err_msg=f"rank {r}, counts {counts}")
        if not in_place and p > 1:  # the block reduced where it belongs: no copy out
            assert not any(isinstance(a, Copy) and a.dst.buf == RECV
                           for s in scheds for rnd in s.rounds for a in rnd)


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("segment", [1, 2, 1 << 10], ids=lambda s: f"seg{s}")
@pytest.mark.parametrize("p", SIZES + [4, 6, 9, 16], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=ALGORITHM_IDS)
def test_allgather_schedule(algorithm, p, segment, in_place):
    for counts in count_cases(p):
        n = sum(counts)
        full = np.arange(n, dtype=np.float64) * 3 + 1
        blocks = blocks_of(counts)
        scheds = [halves("allgather", algorithm, r, p, counts, segment, in_place)
                  for r in range(p)]
        arrays = []
        for r, (s, block) in enumerate(zip(scheds, blocks)):
            recv = np.full(n, np.nan)
            mine = full[block.offset:block.stop].copy()
            if in_place:
                recv[block.offset:block.stop] = mine
            arrays.append((recv if in_place else mine, recv, np.zeros(max(s.scratch, 1))))
        execute(scheds, arrays, label=case_id(counts))
        for r in range(p):
            np.testing.assert_array_equal(arrays[r][1], full, err_msg=f"rank {r}, counts {counts}")


def test_reduce_scatter_sends_each_element_once_per_step():
    """The ring's cost: each rank sends (p-1)/p of the vector (even blocks)."""
    p, counts = 5, (4,) * 5
    for r in range(p):
        assert build_reduce_scatter(r, p, counts, 1 << 10).sent() == 4 * (p - 1)
        assert build_allgather(r, p, counts, 1 << 10, False).sent() == 4 * (p - 1)


@pytest.mark.parametrize("p", [2, 4, 5, 8], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=ALGORITHM_IDS)
def test_allgather_sends_this_ranks_block_from_the_callers_input(algorithm, p):
    """Out of place, the first message of this rank's own block leaves from
    the caller's input, never from the copy just written (a message whose
    sender just wrote it costs more: the ring's allgather does the same).
    (A rank that stands for others in a fold sends their blocks with its
    own, from the logical vector.)"""
    name, options = algorithm
    counts = [5] * p
    stands_for = list(range(p)) if name == "ring" else phases.layout(
        lambda r: registry.get(name).phases(r, p, dict(options)), p, tuple(counts)).stands_for
    for r in range(p):
        if stands_for.count(r) > 1:
            continue
        schedule = halves("allgather", algorithm, r, p, counts, 1 << 10)
        own = [a for rnd in schedule.rounds for a in rnd
               if isinstance(a, Send) and a.src.length == counts[r]]
        assert own and all(a.src.buf == SEND for a in own[:1]), f"rank {r}"


def _sends(schedule) -> list:
    """(peer, elements) of every message ``schedule`` sends, in order."""
    return [(a.peer, a.src.length) for r in schedule.rounds for a in r if isinstance(a, Send)]


@pytest.mark.parametrize("p", [2, 3, 4, 8, 9, 16], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("algorithm", ALGORITHMS[1:], ids=ALGORITHM_IDS[1:])
def test_halves_send_what_the_algorithms_phases_send(algorithm, p):
    """Where no rank sits out (p a power of two, of k for k-nomial) and
    the blocks are even, a rank's reduce-scatter
    sends exactly the messages -- peers, order, lengths -- of the first
    half of the algorithm's all-reduce, and its allgather those of the
    second half: the layout moves blocks in memory, never on the wire; each
    rank sends (p-1)/p of the vector in each half, the bandwidth optimum."""
    name, options = algorithm
    module = registry.get(name)
    if any(module.phases(r, p, dict(options)).role.newrank is None for r in range(p)):
        pytest.skip(f"{name} folds {p} ranks (the next test)")
    n, seg = 4 * p * 3, 5
    for r in range(p):
        whole = _sends(registry.schedule(name, r, p, n, seg, options))
        first = _sends(halves("reduce_scatter", algorithm, r, p, [n // p] * p, seg))
        second = _sends(halves("allgather", algorithm, r, p, [n // p] * p, seg))
        assert first + second == whole, f"rank {r}"
        assert sum(k for _, k in first) == sum(k for _, k in second) == n * (p - 1) // p


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("algorithm", ALGORITHMS[1:], ids=ALGORITHM_IDS[1:])
def test_halves_fold_as_the_algorithm_does(algorithm, p):
    """Elsewhere a rank that sits out sends its vector to the rank that
    stands for it (the algorithm's fold in) and gets its block back, or
    sends its block and gets the vector back; the ranks that take part
    run the all-reduce's own steps between."""
    name, options = algorithm
    counts = [(3 * r + 1) % 4 for r in range(p)]
    n = sum(counts)
    module = registry.get(name)
    lay = phases.layout(lambda r: module.phases(r, p, dict(options)), p, tuple(counts))
    for r in range(p):
        rs = _sends(halves("reduce_scatter", algorithm, r, p, counts, 1 << 10))
        ag = _sends(halves("allgather", algorithm, r, p, counts, 1 << 10))
        if lay.stands_for[r] != r:
            assert rs == [(lay.stands_for[r], n)] and ag == [(lay.stands_for[r], counts[r])]
        else:
            group = [x for x in range(p) if lay.stands_for[x] == r and x != r]
            assert rs[len(rs) - len(group):] == [(x, counts[x]) for x in group]
            assert ag[len(ag) - len(group):] == [(x, n) for x in group]
