"""Swing and Bine without MPI: their index maths exhaustively, the peers
and the bytes of every step of the schedules, and the simulator's verdict
from 1 to 1024 ranks.

The papers' definitions checked here: ``rho(s) = sum_{i<=s} (-2)^i``; the
peer ``pi(r, s)`` (r + rho(s) for even r, r - rho(s) for odd r, mod p);
Swing's reduce-scatter sends the peer the blocks of ``reach(peer, s+1)``;
Bine's puts rank r's block at position ``nu(r)`` (the authors' code gives
0 4 6 1 3 7 5 2 at p = 8) so that those blocks are one range."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from mpi_allreduce import negabinary as nb
from mpi_allreduce import registry
from mpi_allreduce.algorithms import bine_bandwidth, swing_bandwidth, swing_latency
from mpi_allreduce.partition import block_bounds, fold, pow2_floor, real_rank
from mpi_allreduce.schedule import SCRATCH, Recv, Send
from mpi_allreduce.simulate import execute, schedules, simulate
from mpi_allreduce.validate import _check_order

NAMES = ("swing_latency", "swing_bandwidth", "bine_latency", "bine_bandwidth")
POWERS = [1 << k for k in range(11)]  # 1 .. 1024


# --- the index maths -----------------------------------------------------------

def test_rho_is_the_negabinary_repunit():
    for s in range(20):
        assert nb.rho(s) == sum((-2) ** i for i in range(s + 1)) == (1 - (-2) ** (s + 1)) // 3
        assert nb.rho(s) == nb.from_negabinary((1 << (s + 1)) - 1)
    assert [nb.rho(s) for s in range(8)] == [1, -1, 3, -5, 11, -21, 43, -85]
    with pytest.raises(ValueError):
        nb.rho(-1)


def test_negabinary_round_trip():
    for value in range(-2000, 2000):
        digits = nb.negabinary(value)
        assert nb.from_negabinary(digits) == value
        assert digits >= 0


@pytest.mark.parametrize("size", POWERS)
def test_peers_pair_even_with_odd_at_every_step(size):
    """The paper's formula; each step a perfect matching of even and odd ranks."""
    steps = size.bit_length() - 1
    for r in range(size):
        peers = nb.peers(r, size)
        assert len(peers) == steps
        for s, q in enumerate(peers):
            assert q == ((r + nb.rho(s)) if r % 2 == 0 else (r - nb.rho(s))) % size
            assert nb.pi(q, s, size) == r and q % 2 != r % 2
    with pytest.raises(ValueError, match="power of two"):
        nb.peers(0, 6)


@pytest.mark.parametrize("size", POWERS)
def test_nu_is_the_permutation_that_makes_halving_contiguous(size):
    """A permutation; ``nu(r)`` and ``nu(pi(r, s))`` differ in bit L-1-s and
    agree above it (recursive halving on positions); rank r keeps nu(r)."""
    steps = size.bit_length() - 1
    nus = [nb.nu(r, size) for r in range(size)]
    assert sorted(nus) == list(range(size))
    assert list(nb.nu_inverse(size)) == [nus.index(v) for v in range(size)]
    for r in range(size):
        low, high = 0, size
        for s, (peer, kept, sent) in enumerate(nb.halving(r, size)):
            assert peer == nb.pi(r, s, size)
            assert (nus[r] ^ nus[peer]) >> (steps - 1 - s) == 1
            assert sorted(kept + sent) == [low, (low + high) // 2, (low + high) // 2, high]
            assert kept[0] <= nus[r] < kept[1]
            low, high = kept
        assert (low, high) == (nus[r], nus[r] + 1)


def test_nu_as_the_authors_code_gives_it():
    """libbine's remap_rank (PICO suite) at p = 8 and 16."""
    assert [nb.nu(r, 8) for r in range(8)] == [0, 4, 6, 1, 3, 7, 5, 2]
    assert [nb.nu(r, 16) for r in range(8)] == [0, 8, 12, 2, 5, 14, 9, 7]


@pytest.mark.parametrize("size", [1 << k for k in range(8)])
def test_swing_blocks_are_the_reach_sets(size):
    """By the definition (the recursive reach), at every step: the peer
    gets the blocks of reach(peer, s+1), the rank keeps reach(rank, s+1);
    2^(L-s-1) blocks each way, the kept ones inside those kept before."""
    steps = size.bit_length() - 1
    for r in range(size):
        held = set(range(size))
        for s, (peer, kept, sent) in enumerate(nb.swing_blocks(r, size)):
            assert sent == sorted(nb.reach(peer, s + 1, size))
            assert kept == sorted(nb.reach(r, s + 1, size))
            assert len(sent) == len(kept) == 1 << (steps - s - 1)
            assert set(kept) | set(sent) == held and not set(kept) & set(sent)
            held = set(kept)
        assert held == {r}


@pytest.mark.parametrize("size", POWERS[:9])
@pytest.mark.parametrize("which", ["swing", "bine"])
def test_reduce_scatter_and_allgather_on_sets(which, size):
    """Contributions as sets: in the reduce-scatter nothing is counted
    twice and each rank ends with its block (r for Swing, nu(r) for Bine)
    over all ranks; in the allgather only complete blocks move, and every
    rank ends with every block."""
    def plan(r):
        if which == "swing":
            return nb.swing_blocks(r, size)
        return [(q, list(range(*k)), list(range(*s))) for q, k, s in nb.halving(r, size)]
    plans = [plan(r) for r in range(size)]
    have = [[{r} for _ in range(size)] for r in range(size)]
    for s in range(size.bit_length() - 1):
        moved = []
        for r in range(size):
            peer, kept, sent = plans[r][s]
            assert plans[peer][s][0] == r and plans[peer][s][1] == sent  # the peers agree
            moved += [(peer, b, set(have[r][b])) for b in sent]
        for peer, b, contribution in moved:
            assert not have[peer][b] & contribution
            have[peer][b] |= contribution
    everyone = set(range(size))
    own = [r if which == "swing" else nb.nu(r, size) for r in range(size)]
    assert all(have[r][own[r]] == everyone for r in range(size))
    complete = [{own[r]} for r in range(size)]
    for s in reversed(range(size.bit_length() - 1)):
        moved = []
        for r in range(size):
            peer, kept, sent = plans[r][s]
            assert set(kept) <= complete[r]
            moved += [(peer, set(kept))]
        for peer, blocks in moved:
            complete[peer] |= blocks
    assert all(c == everyone for c in complete)


@pytest.mark.parametrize("size", range(1, 70))
def test_shrink_fold(size):
    """Swing's fold: the ranks above pof2 hand their vector to the rank rem
    below; the others keep their numbers; new ranks 0 .. pof2-1 once each."""
    roles = [nb.shrink(r, size) for r in range(size)]
    pof2 = pow2_floor(size)
    assert sorted(role.newrank for role in roles if role.newrank is not None) == list(range(pof2))
    for r, role in enumerate(roles):
        assert (role.pof2, role.rem) == (pof2, size - pof2)
        if role.newrank is None:
            assert r >= pof2 and role.partner == r - role.rem
            assert roles[role.partner].partner == r and roles[role.partner].newrank is not None
        else:
            assert role.newrank == r
            assert role.partner is None or roles[role.partner].newrank is None


def _tree(size, order):
    """Each rank's combination tree (unordered) after the butterfly's steps in ``order``."""
    trees = list(range(size))
    for s in order:
        trees = [tuple(sorted((trees[r], trees[nb.pi(r, s, size)]), key=repr))
                 for r in range(size)]
    return trees


@pytest.mark.parametrize("size", POWERS[1:])
def test_latency_butterfly_gives_every_rank_one_tree(size):
    """Last step first, every rank combines the same partial results in
    the same tree (the same bits for a float sum); in the paper's order
    the trees differ from p = 8 on, p/4 of them."""
    assert len(set(_tree(size, swing_latency.step_order(size)))) == 1
    assert len(set(_tree(size, range(size.bit_length() - 1)))) == max(1, size // 4)


# --- the schedules: peers and bytes per step --------------------------------------

def _message_rounds(schedule):
    """Per round with messages: its peers (a set) and elements sent."""
    out = []
    for actions in schedule.rounds:
        peers = {a.peer for a in actions if isinstance(a, (Send, Recv))}
        if peers:
            out.append((peers, sum(a.src.length for a in actions if isinstance(a, Send))))
    return out


def _fold_of(name):
    return nb.shrink if name.startswith("swing") else fold


def _expected_peers(name, rank, size):
    """The peers of every step, fold included, in the order they run."""
    role = _fold_of(name)(rank, size)
    real = (lambda new: new) if name.startswith("swing") else (lambda new: real_rank(new, role.rem))
    inner = []
    if role.newrank is not None:
        core = [real(nb.pi(role.newrank, s, role.pof2)) for s in range(role.pof2.bit_length() - 1)]
        inner = core[::-1] if name.endswith("latency") else core + core[::-1]
    edge = [] if role.partner is None else [role.partner]
    return edge + inner + edge


@pytest.mark.parametrize("name", NAMES)
def test_every_step_talks_to_the_papers_peer(name):
    """Every p from 1 to 64 and a few more, every rank: one round per step
    (a segment longer than the vector), each with the peer the formula names
    among the fold's new ranks: the reduce-scatter's steps s = 0, 1, ...,
    the allgather's backwards, the latency variants' last first."""
    for size in list(range(1, 65)) + [96, 100, 127, 128]:
        count = 3 * size + 1
        for rank in range(size):
            got = [peers for peers, _ in _message_rounds(registry.schedule(
                name, rank, size, count, 1 << 20))]
            assert got == [{p} for p in _expected_peers(name, rank, size)], (name, size, rank)


@pytest.mark.parametrize("name", ["swing_bandwidth", "bine_bandwidth"])
def test_bandwidth_variants_halve_the_bytes_each_step(name):
    """Step s of the reduce-scatter sends 2^(L-s-1) blocks, count/2^(s+1)
    elements within block rounding, and the allgather mirrors it."""
    for size in [1 << k for k in range(1, 8)]:
        for count in (0, 1, size - 1, size + 1, 7 * size + 3, 1009):
            q = count // size
            steps = size.bit_length() - 1
            for rank in range(size):
                sent = [n for _, n in _message_rounds(registry.schedule(
                    name, rank, size, count, 1 << 20))]
                assert len(sent) == 2 * steps
                for s in range(steps):
                    blocks = 1 << (steps - s - 1)
                    assert blocks * q <= sent[s] <= blocks * (q + 1), (size, count, rank, s)
                    # the allgather: what this rank kept at step s goes back
                    assert blocks * q <= sent[2 * steps - 1 - s] <= blocks * (q + 1)
                assert sum(sent[:steps]) == count - block_bounds(count, size)[
                    rank if name == "swing_bandwidth" else nb.nu(rank, size)].length


def test_latency_variants_send_the_whole_vector_each_step():
    for name in ("swing_latency", "bine_latency"):
        for size, count in ((8, 100), (16, 1), (64, 7)):
            for rank in range(size):
                sent = [n for _, n in _message_rounds(registry.schedule(name, rank, size, count,
                                                                         1 << 20))]
                assert sent == [count] * (size.bit_length() - 1)


@pytest.mark.parametrize("name", NAMES)
def test_messages_to_reduce_are_segments_and_scratch_is_one(name):
    """Every message that lands in scratch (to be reduced) is at most a
    segment; scratch never exceeds one segment."""
    for size, count, segment in ((8, 1000, 7), (6, 257, 16), (16, 4097, 100), (13, 50, 3)):
        for rank in range(size):
            sched = registry.schedule(name, rank, size, count, segment)
            assert sched.scratch <= segment
            for actions in sched.rounds:
                into = [a.dst for a in actions if isinstance(a, Recv) and a.dst.buf == SCRATCH]
                assert sum(ref.length for ref in into) <= segment


def test_pack_keeps_rounds_within_a_segment():
    blocks = block_bounds(103, 16)
    for cut in (1, 2, 5, 7, 13, 200):
        for chosen in ([0, 1, 5, 9, 10, 11, 15], list(range(16)), [3], []):
            ranges = swing_bandwidth.runs(blocks, chosen)
            rounds = swing_bandwidth.pack(ranges, cut)
            pieces = [p for r in rounds for p in r]
            assert all(sum(p.length for p in r) <= cut for r in rounds)
            assert sum(p.length for p in pieces) == sum(blocks[i].length for i in chosen)
            covered = sorted(i for p in pieces for i in range(p.offset, p.stop))
            assert covered == sorted(i for b in chosen for i in range(blocks[b].offset,
                                                                       blocks[b].stop))


# --- registration and the op they need ------------------------------------------

def test_registered_as_candidates_that_need_a_commutative_op():
    for name in NAMES:
        assert name in registry.ALGORITHMS and name in registry.FLAT_ALGORITHMS
        assert name not in registry.ORDERED and registry.get(name).COMMUTATIVE
        with pytest.raises(ValueError, match=f"{name}.*needs a commutative op"):
            _check_order(SimpleNamespace(commutative=False, name="user"), name)
        _check_order(SimpleNamespace(commutative=True, name="sum"), name)
        assert registry.in_rank_order(name) == "rabenseifner"


# --- the simulator -------------------------------------------------------------

def _awkward_counts(size):
    """0, 1, p-1, p+1 and a prime above 2p (several segments of 3)."""
    prime = next(n for n in itertools.count(2 * size + 3)
                 if all(n % d for d in range(2, int(n ** 0.5) + 1)))
    return sorted({0, 1, max(size - 1, 1), size + 1, prime})


@pytest.mark.parametrize("name", NAMES)
def test_simulated_from_1_to_33_ranks(name):
    """Awkward counts in segments of 3 elements; in place too at p+1."""
    for size in range(1, 34):
        for count in _awkward_counts(size):
            for in_place in (False, True) if count == size + 1 else (False,):
                outcome = simulate(name, size, count, "int32", "sum", segment_size=3,
                                   in_place=in_place)
                assert (outcome.wrong, outcome.differing_ranks) == (0, 0), (size, count)


@pytest.mark.parametrize("name,size,count,segment", [
    ("swing_latency", 1024, 23, 7), ("swing_latency", 1000, 999, 300),
    ("swing_latency", 777, 101, 50), ("bine_latency", 1024, 1023, 300),
    ("bine_latency", 1000, 29, 7), ("bine_latency", 513, 2, 1),
    ("bine_bandwidth", 1024, 2053, 64), ("bine_bandwidth", 1000, 1, 1),
    ("bine_bandwidth", 999, 1997, 100), ("swing_bandwidth", 1024, 1, 1),
    ("swing_bandwidth", 1024, 0, 1), ("swing_bandwidth", 1000, 3, 1),
    ("swing_bandwidth", 200, 401, 5), ("swing_bandwidth", 129, 1031, 3),
])
def test_simulated_at_hundreds_of_ranks(name, size, count, segment):
    outcome = simulate(name, size, count, "int64", "sum", segment_size=segment)
    assert (outcome.wrong, outcome.differing_ranks) == (0, 0)


@pytest.mark.parametrize("name", NAMES)
def test_random_floats_give_every_rank_the_same_bits(name):
    """Float sums of random data (no exact order-free sum): the ranks'
    bytes agree, at powers of two and not."""
    for size in (4, 6, 8, 12, 16, 32):
        count = 301
        scheds = schedules(name, size, count, 16)
        rng = np.random.default_rng(size)
        results = np.empty((size, count), np.float32)
        arrays = [(rng.uniform(-1, 1, count).astype(np.float32), results[r],
                   np.zeros(max(s.scratch, 1), np.float32)) for r, s in enumerate(scheds)]
        execute(scheds, arrays, None, np.add, 4, name)
        assert len({row.tobytes() for row in results}) == 1, (name, size)
        exact = sum(a[0].astype(np.float64) for a in arrays)
        np.testing.assert_allclose(results[0], exact, atol=1e-4 * size)


def test_bine_bandwidth_sends_one_range_and_swing_several():
    """Bine's permutation makes each step one message (a segment longer
    than the vector); Swing's blocks go as several ranges from p = 8 on."""
    size, count = 16, 16 * 5
    for rank in range(size):
        bine = registry.schedule("bine_bandwidth", rank, size, count, 1 << 20)
        assert bine.messages == 2 * 4
    swing = registry.schedule("swing_bandwidth", 0, size, count, 1 << 20)
    assert swing.messages > 2 * 4
    plan = bine_bandwidth.steps(0, size, count, lambda new: new)
    assert [sent.length for _, _, sent in plan] == [40, 20, 10, 5]
