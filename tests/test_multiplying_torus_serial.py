"""Recursive multiplying, k-nomial, the 2D torus and allgather-then-reduce,
without MPI: their index maths exhaustively, who each rank talks to and how
many bytes in every step, and every rank's result from the simulator for
many p (up to 1024), radices 2 to 8, awkward counts and tiny segments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpi_allreduce import radix, registry
from mpi_allreduce.algorithms import (allgather_reduce, knomial, recursive_multiplying, ring,
                                      torus)
from mpi_allreduce.options import options
from mpi_allreduce.planner import algorithm_options
from mpi_allreduce.schedule import RECV, SCRATCH, SEND, Recv, Reduce, Send
from mpi_allreduce.simulate import execute, schedules, simulate
from mpi_allreduce.spec import CallSpec
from mpi_allreduce.tools.verify import K, interval

NEW = ("recursive_multiplying", "knomial", "torus", "allgather_reduce")
RADIXED = ("recursive_multiplying", "knomial")


def message_rounds(schedule):
    """[(sends, receives)] of the rounds that carry messages, each a list
    of (peer, elements)."""
    out = []
    for r in schedule.rounds:
        sends = [(a.peer, a.src.length) for a in r if isinstance(a, Send)]
        recvs = [(a.peer, a.dst.length) for a in r if isinstance(a, Recv)]
        if sends or recvs:
            out.append((sends, recvs))
    return out


# --- the index maths ------------------------------------------------------------

def test_power_floor_and_steps():
    for k in range(2, 10):
        for n in range(1, 2000):
            pofk = radix.power_floor(n, k)
            assert pofk <= n < pofk * k
            assert k ** radix.steps(pofk, k) == pofk
    with pytest.raises(ValueError):
        radix.power_floor(0, 2)
    with pytest.raises(ValueError):
        radix.radix_for(1, 8)
    assert [radix.radix_for(4, p) for p in (1, 2, 3, 4, 5)] == [2, 2, 3, 4, 4]


@pytest.mark.parametrize("k", range(2, 9))
def test_groups_join_runs_of_consecutive_ranks(k):
    """In step s the groups partition the pofk new ranks into sets of k
    that differ in digit s alone; every member finds the same group, and
    the members' runs of k^s consecutive ranks, taken by position, make one
    run of k^(s+1): combining by position is combining in rank order."""
    for pofk in (k ** e for e in range(0, 5) if k ** e <= 1024):
        for s in range(radix.steps(pofk, k)):
            seen = set()
            for r in range(pofk):
                members, position = radix.group(r, s, k)
                assert members[position] == r and len(members) == k
                for m in members:
                    assert radix.group(m, s, k)[0] == members
                    assert m // k ** (s + 1) == r // k ** (s + 1)
                    assert (m - r) % k ** s == 0
                runs = [range(m - m % k ** s, m - m % k ** s + k ** s) for m in members]
                assert [x for run in runs for x in run] == list(
                    range(runs[0].start, runs[0].start + k ** (s + 1)))
                seen.add(tuple(members))
            assert sorted(r for g in seen for r in g) == list(range(pofk))


@pytest.mark.parametrize("k", range(2, 9))
def test_knomial_ranges_end_on_the_digit_reversed_block(k):
    for pofk in (k ** e for e in range(0, 5) if k ** e <= 1024):
        assert sorted(radix.digit_reversed(r, pofk, k) for r in range(pofk)) == list(range(pofk))
        for r in range(pofk):
            assert radix.digit_reversed(radix.digit_reversed(r, pofk, k), pofk, k) == r
            lo, hi = 0, pofk
            for s, (members, position, ranges) in enumerate(radix.knomial_ranges(r, pofk, k)):
                # k equal runs that cut the range held so far; every member cuts it alike
                assert ranges[0][0] == lo and ranges[-1][1] == hi
                assert all(b - a == (hi - lo) // k for a, b in ranges)
                assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
                for m in members:
                    assert radix.knomial_ranges(m, pofk, k)[s][2] == ranges
                lo, hi = ranges[position]
            assert (lo, hi) == (radix.digit_reversed(r, pofk, k),
                                radix.digit_reversed(r, pofk, k) + 1)


@pytest.mark.parametrize("k", range(2, 9))
def test_the_multiplying_fold_is_mpichs(k):
    """Ranks from pofk on hand their vector to r mod pofk; a rank below
    pofk takes at most k-1 of them."""
    for p in range(1, 400):
        roles = [radix.multiplying_fold(r, p, k) for r in range(p)]
        pofk = radix.power_floor(p, k)
        assert [r for r, role in enumerate(roles) if role.newrank is not None] == \
            list(range(pofk))
        for r, role in enumerate(roles):
            if role.newrank is None:
                assert role.partner == r % pofk and r in roles[role.partner].extras
            else:
                assert len(role.extras) <= k - 1
                assert all(e % pofk == r and e >= pofk for e in role.extras)


@pytest.mark.parametrize("k", range(2, 9))
def test_the_recexch_fold_keeps_rank_order(k):
    """MPICH's recursive exchange fold: pofk ranks take part, their new
    ranks in the real ranks' order, each standing for a run of consecutive
    ranks that ends at itself; the runs cover every rank once."""
    for p in range(1, 600):
        roles = [radix.recexch_fold(r, p, k) for r in range(p)]
        pofk = radix.power_floor(p, k)
        taking = [r for r, role in enumerate(roles) if role.newrank is not None]
        assert len(taking) == pofk
        assert [roles[r].newrank for r in taking] == list(range(pofk))
        covered = []
        for r in taking:
            role = roles[r]
            assert radix.recexch_real_rank(role.newrank, role.rem, k) == r
            run = list(role.extras) + [r]
            assert run == list(range(run[0], r + 1)) and len(run) <= k
            covered += run
            for e in role.extras:
                assert roles[e].newrank is None and roles[e].partner == r
        assert covered == list(range(p))


def test_torus_grid_and_row_sizes():
    for p in range(1, 200):
        x = torus.default_row_size(p)
        assert p % x == 0
        assert all(abs(x - math.sqrt(p)) <= abs(d - math.sqrt(p))
                   for d in range(1, p + 1) if p % d == 0)
        for r in range(p):
            row, column = torus.grid(r, p, x)
            assert r in row and r in column and len(row) == x and len(column) == p // x
            assert set(row) & set(column) == {r}
    assert [torus.default_row_size(p) for p in (4, 6, 8, 9, 12, 16, 64)] == [2, 2, 2, 3, 3, 4, 8]
    with pytest.raises(ValueError, match="does not divide the 8 ranks.*1, 2, 4, 8"):
        torus.row_size_for(8, 3)
    with pytest.raises(ValueError, match="positive"):
        torus.row_size_for(8, 0)


def test_bruck_rounds_gather_every_rank():
    for p in range(1, 300):
        for r in range(p):
            have = {0}
            for send_to, receive_from, n, first in allgather_reduce.bruck_rounds(r, p):
                assert first == len(have) and n == min(first, p - first)
                assert (receive_from - r) % p == first and (r - send_to) % p == first
                have |= set(range(first, first + n))
            assert have == set(range(p))
            assert len(allgather_reduce.bruck_rounds(r, p)) == math.ceil(math.log2(p))


# --- peers and bytes, step by step -------------------------------------------------

@pytest.mark.parametrize("p,k", [(16, 2), (27, 3), (64, 4), (125, 5), (64, 8)])
def test_recursive_multiplying_sends_the_whole_vector_to_k_minus_1_peers_a_step(p, k):
    n = 1000
    for r in range(p):
        s = recursive_multiplying.build(r, p, n, 1 << 20, {"radix": k})
        steps = message_rounds(s)
        assert len(steps) == radix.steps(p, k) == round(math.log(p, k))
        for step, (sends, recvs) in enumerate(steps):
            members, position = radix.group(r, step, k)
            peers = [m for m in members if m != r]
            assert sorted(peer for peer, _ in sends) == peers
            assert sorted(peer for peer, _ in recvs) == peers
            assert all(length == n for _, length in sends + recvs)
        assert s.sent() == radix.steps(p, k) * (k - 1) * n
        assert s.reduced() == radix.steps(p, k) * (k - 1) * n
        assert s.scratch == (k - 1) * n


def test_recursive_multiplying_folds_the_remainder_as_mpich():
    """p = 11, k = 3: ranks 9 and 10 hand their vectors to 0 and 1 and get
    the result back; ranks 0..8 take two steps of two peers."""
    p, k, n = 11, 3, 60
    for r in range(p):
        steps = message_rounds(recursive_multiplying.build(r, p, n, 1 << 20, {"radix": k}))
        if r >= 9:
            assert steps == [([(r - 9, n)], []), ([], [(r - 9, n)])]
        elif r < 2:
            assert steps[0] == ([], [(r + 9, n)]) and steps[-1] == ([(r + 9, n)], [])
            assert len(steps) == 4
        else:
            assert len(steps) == 2


def test_recursive_multiplying_segments_and_bounds_its_scratch():
    s = recursive_multiplying.build(0, 27, 100, 8, {"radix": 3})
    steps = message_rounds(s)
    assert len(steps) == 3 * math.ceil(100 / 8)
    assert max(length for sends, recvs in steps for _, length in sends + recvs) == 8
    assert s.scratch == 2 * 8


@pytest.mark.parametrize("p,k", [(8, 2), (27, 3), (64, 4), (25, 5)])
def test_knomial_step_s_sends_k_minus_1_kths_of_its_range_to_k_minus_1_peers(p, k):
    n = p * 12
    for r in range(p):
        s = knomial.build(r, p, n, 1 << 20, {"radix": k})
        steps = message_rounds(s)
        nsteps = radix.steps(p, k)
        assert len(steps) == 2 * nsteps
        held = n
        for step, (sends, recvs) in enumerate(steps[:nsteps]):  # reduce-scatter
            members, _ = radix.group(r, step, k)
            peers = sorted(m for m in members if m != r)
            assert sorted(peer for peer, _ in sends) == peers
            assert sorted(peer for peer, _ in recvs) == peers
            held //= k
            assert all(length == held for _, length in sends + recvs)
            assert sum(length for _, length in sends) == (k - 1) * held
        for step, (sends, recvs) in enumerate(steps[nsteps:]):  # allgather, backwards
            assert all(length == n // k ** (nsteps - step) for _, length in sends + recvs)
        assert s.sent() == 2 * n * (p - 1) // p
        assert s.reduced() == n * (p - 1) // p


def test_knomial_folds_as_mpichs_recursive_exchange():
    """p = 11, k = 3: rem = 2, T = 3: ranks 0 and 1 hand their vectors to
    rank 2, ranks 2..10 take the steps (rank 3: none folded in)."""
    p, k, n = 11, 3, 99
    for r in range(p):
        steps = message_rounds(knomial.build(r, p, n, 1 << 20, {"radix": k}))
        if r < 2:
            assert steps == [([(2, n)], []), ([], [(2, n)])]
        elif r == 2:
            assert steps[0] == ([], [(0, n), (1, n)])
            assert steps[-1] == ([(0, n), (1, n)], [])
            assert len(steps) == 2 + 2 * 2
        else:
            assert len(steps) == 2 * 2


@pytest.mark.parametrize("p,x", [(12, 3), (12, 4), (16, 4), (6, 2), (30, 5)])
def test_torus_rows_then_columns_then_rows(p, x):
    y, n = p // x, p * 10
    for r in range(p):
        s = torus.build(r, p, n, 1 << 20, {"row_size": x})
        row, column = torus.grid(r, p, x)
        steps = message_rounds(s)
        assert len(steps) == 2 * (x - 1) + 2 * (y - 1)
        rs, col, ag = steps[:x - 1], steps[x - 1:x - 1 + 2 * (y - 1)], steps[x - 1 + 2 * (y - 1):]
        for phase, group, elements in ((rs, row, n // x), (col, column, n // x // y),
                                       (ag, row, n // x)):
            i = group.index(r)
            right, left = group[(i + 1) % len(group)], group[(i - 1) % len(group)]
            for sends, recvs in phase:
                assert sends == [(right, elements)] and recvs == [(left, elements)]
        assert s.sent() == 2 * n * (p - 1) // p


def test_torus_on_one_row_or_one_column_is_the_ring():
    """Rows of one rank or of all: the ring all-reduce's very rounds (every
    prime p by default)."""
    for p in (2, 3, 5, 7, 13):
        for x in (None, 1, p):
            for r in range(p):
                got = torus.build(r, p, 3 * p + 1, 2, {"row_size": x}).rounds
                assert got == ring.build(r, p, 3 * p + 1, 2).rounds, (p, x, r)


@pytest.mark.parametrize("p", [2, 3, 5, 8, 13])
def test_allgather_reduce_gathers_then_reduces_locally(p):
    n = 7
    for r in range(p):
        s = allgather_reduce.build(r, p, n, 1 << 20)
        steps = message_rounds(s)
        assert len(steps) == math.ceil(math.log2(p))
        assert s.sent() == (p - 1) * n
        assert sum(length for _, recvs in steps for _, length in recvs) == (p - 1) * n
        # every reduction after the last message, p-1 of them, into the result
        last = max(i for i, rd in enumerate(s.rounds) if any(isinstance(a, (Send, Recv))
                                                                 for a in rd))
        reductions = [a for rd in s.rounds for a in rd if isinstance(a, Reduce)]
        assert len(reductions) == p - 1 and all(a.out.buf == RECV for a in reductions)
        assert not any(isinstance(a, Reduce) for rd in s.rounds[:last + 1] for a in rd)
        assert s.scratch == p * n


def test_allgather_reduce_keeps_its_scratch_to_a_segment():
    """p copies of a piece: the piece is segment_size // p elements (one at
    least), so the scratch is one segment (p elements when less)."""
    for p, count, segment in ((8, 1000, 64), (8, 1000, 3), (100, 5000, 1000), (5, 3, 1 << 20)):
        s = allgather_reduce.build(0, p, count, segment)
        piece = allgather_reduce.piece_size(p, segment)
        assert s.scratch == p * min(piece, count) <= max(segment, p)
        assert len(message_rounds(s)) == math.ceil(count / piece) * math.ceil(math.log2(p))


# --- every rank's result ----------------------------------------------------------

def check(algorithm, p, count, segment, options=None, in_place=False, dtype="int32", op="sum"):
    out = simulate(algorithm, p, count, dtype, op, segment_size=segment, options=options,
                   in_place=in_place)
    assert (out.wrong, out.differing_ranks) == (0, 0), (algorithm, p, count, segment, options)


def counts(p):
    """(count, segment): empty, one element, p-1 and p+1 elements (blocks
    of 0 and 1), a prime in several segments."""
    return ((0, 4), (1, 1), (max(p - 1, 0), 2), (p + 1, 3), (97, 13))


@pytest.mark.parametrize("algorithm", RADIXED)
def test_radix_algorithms_at_every_radix(algorithm):
    for k in range(2, 9):
        for p in sorted(set(range(1, 14)) | {k ** 2 - 1, k ** 2 + 1}):
            for count, segment in counts(p):
                check(algorithm, p, count, segment, {"radix": k}, in_place=p % 2 == 0)


def test_torus_at_every_row_size():
    for p in list(range(1, 21)) + [36]:
        for x in [None] + [d for d in range(1, p + 1) if p % d == 0 and (p < 21 or d == 4)]:
            for count, segment in counts(p):
                check("torus", p, count, segment, {"row_size": x}, in_place=p % 2 == 1)


def test_allgather_reduce_awkward_counts():
    for p in range(1, 26):
        for count, segment in counts(p) + ((31, 1 << 20),):
            check("allgather_reduce", p, count, segment * p, in_place=p % 2 == 0)


@pytest.mark.parametrize("algorithm,p,count,segment,options", [
    ("recursive_multiplying", 1024, 2051, 1 << 20, {"radix": 4}),
    ("recursive_multiplying", 1000, 2003, 700, {"radix": 3}),
    ("knomial", 1024, 2051, 300, {"radix": 4}), ("knomial", 1000, 2003, 300, {"radix": 7}),
    ("knomial", 625, 1249, 100, {"radix": 5}),
    ("torus", 1024, 2051, 1 << 20, None), ("torus", 360, 719, 30, {"row_size": 24}),
    ("allgather_reduce", 512, 3, 1 << 20, None), ("allgather_reduce", 100, 7, 300, None),
])
def test_large_communicators(algorithm, p, count, segment, options):
    check(algorithm, p, count, segment, options, op="max", dtype="float64")


# --- operand order: what COMMUTATIVE says ------------------------------------------

def _interval_run(algorithm, p, count, segment, options):
    scheds = schedules(algorithm, p, count, segment, options)
    results = np.empty((p, count), np.int64)
    arrays = [(np.full(count, r * K + r, np.int64), results[r],
               np.zeros(max(s.scratch, 1), np.int64)) for r, s in enumerate(scheds)]

    def combine(first, second, out):
        out[...] = interval(first, second)
    execute(scheds, arrays, None, combine, 8, f"{algorithm} p={p}")
    return results


def test_knomial_combines_in_rank_order_at_every_radix():
    assert not knomial.COMMUTATIVE and not allgather_reduce.COMMUTATIVE
    for k in range(2, 7):
        for p in list(range(1, 26)) + [k ** 3 + 1]:
            got = _interval_run("knomial", p, p + 2, 3, {"radix": k})
            assert (got == p - 1).all(), (k, p)


def test_the_fold_of_recursive_multiplying_and_the_torus_need_commutativity():
    assert recursive_multiplying.COMMUTATIVE and torus.COMMUTATIVE
    assert "knomial" in registry.ORDERED and "allgather_reduce" in registry.ORDERED
    assert "torus" not in registry.ORDERED and "recursive_multiplying" not in registry.ORDERED
    # p a power of k: in order; p = 5, k = 4: rank 4 meets rank 0 first
    assert (_interval_run("recursive_multiplying", 9, 4, 2, {"radix": 3}) == 8).all()
    assert not (_interval_run("recursive_multiplying", 5, 4, 2, {"radix": 4}) == 4).all()
    assert not (_interval_run("torus", 6, 12, 2, {"row_size": 3}) == 5).all()


# --- the options -----------------------------------------------------------------

def test_the_spec_carries_the_resolved_options():
    """A call's spec (so its fingerprint and tags) carries the radix and the
    row size the builder runs with, defaults resolved: ranks that differ
    cannot meet in one call's messages."""
    k3 = algorithm_options("knomial", options(algorithm="knomial", radix=3), 16)
    k4 = algorithm_options("knomial", options(algorithm="knomial"), 16)
    assert (k3, k4) == ((("radix", 3),), (("radix", 4),))
    assert algorithm_options("knomial", options(algorithm="knomial", radix=9), 3) == \
        (("radix", 3),)  # lowered to p: the same schedule, the same spec
    assert algorithm_options("torus", options(algorithm="torus"), 12) == (("row_size", 3),)
    assert algorithm_options("torus", options(algorithm="torus", row_size=6), 12) == \
        (("row_size", 6),)
    assert algorithm_options("ring", options(), 12) == ()
    with pytest.raises(ValueError, match="row_size 5 does not divide the 12 ranks"):
        algorithm_options("torus", options(algorithm="torus", row_size=5), 12)

    def spec(opts):
        return CallSpec("allreduce", "knomial", 16, 100, "<f4", "sum", 64, opts)
    assert spec(k3).fingerprint != spec(k4).fingerprint


def test_the_builders_read_their_options_and_default_them():
    for algorithm in RADIXED:
        plain = registry.builder(algorithm)(3, 16, 50, 8, {})
        assert plain == registry.builder(algorithm)(3, 16, 50, 8, {"radix": 4})
        assert plain != registry.builder(algorithm)(3, 16, 50, 8, {"radix": 2})
    assert torus.build(5, 12, 50, 8) == torus.build(5, 12, 50, 8, {"row_size": 3})
    assert registry.schedule("allgather_reduce", 0, 4, 10, 8).scratch == 4 * 2
    assert SEND != SCRATCH  # (the buffers named above)
