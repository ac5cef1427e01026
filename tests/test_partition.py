"""Serial, exhaustive tests of the pure index maths (no MPI involved)."""

from __future__ import annotations

import itertools

import pytest

from mpi_allreduce import partition as pt

SIZES = range(1, 18)
COUNTS = range(0, 40)


@pytest.mark.parametrize("parts", SIZES)
def test_block_bounds_tile_the_vector(parts):
    for count in COUNTS:
        blocks = pt.block_bounds(count, parts)
        assert len(blocks) == parts
        assert blocks[0].offset == 0
        for a, b in zip(blocks, blocks[1:]):
            assert a.stop == b.offset
        assert blocks[-1].stop == count
        lengths = [b.length for b in blocks]
        assert max(lengths) - min(lengths) <= 1
        assert lengths == sorted(lengths, reverse=True)
        for index in range(count):
            owner = pt.block_of(index, count, parts)
            assert blocks[owner].offset <= index < blocks[owner].stop


def test_block_bounds_rejects_bad_arguments():
    with pytest.raises(ValueError, match="parts"):
        pt.block_bounds(3, 0)
    with pytest.raises(ValueError, match="count"):
        pt.block_bounds(-1, 2)


@pytest.mark.parametrize("size", SIZES)
def test_ring_schedules_simulated(size):
    """Simulate the ring on sets of contributions: after the reduce-scatter
    rank r's owned block holds every rank's contribution, after the
    allgather every rank holds every block complete."""
    # have[r][b] = set of ranks whose contribution to block b rank r holds
    have = [[{r} for _ in range(size)] for r in range(size)]
    rs = [pt.ring_reduce_scatter_steps(r, size) for r in range(size)]
    for step in range(size - 1):
        sent = [(r, rs[r][step].send_block, set(have[r][rs[r][step].send_block]))
                for r in range(size)]
        for r, block, contribution in sent:
            right = (r + 1) % size
            assert rs[right][step].recv_block == block  # the peers agree
            assert not (have[right][block] & contribution)  # nothing counted twice
            have[right][block] |= contribution
    full = set(range(size))
    for r in range(size):
        assert have[r][pt.ring_owned_block(r, size)] == full
    ag = [pt.ring_allgather_steps(r, size) for r in range(size)]
    complete = [{pt.ring_owned_block(r, size)} for r in range(size)]
    for step in range(size - 1):
        sent = [(r, ag[r][step].send_block) for r in range(size)]
        for r, block in sent:
            assert block in complete[r]  # only complete blocks are passed on
            right = (r + 1) % size
            assert ag[right][step].recv_block == block
            complete[right].add(block)
    assert all(c == set(range(size)) for c in complete)


@pytest.mark.parametrize("segment_size", [1, 2, 3, 7, 100])
def test_segments_cover_block(segment_size):
    for offset, length in itertools.product([0, 5], range(0, 20)):
        segs = pt.segments(pt.Block(offset, length), segment_size)
        assert len(segs) == max(1, -(-length // segment_size))  # ceil, at least one
        assert segs[0].offset == offset
        assert sum(s.length for s in segs) == length
        assert all(0 < s.length <= segment_size for s in segs) or length == 0
        for a, b in zip(segs, segs[1:]):
            assert a.stop == b.offset


def test_segments_rejects_zero():
    with pytest.raises(ValueError):
        pt.segments(pt.Block(0, 4), 0)


@pytest.mark.parametrize("n", range(1, 70))
def test_pow2_floor(n):
    p = pt.pow2_floor(n)
    assert p <= n < 2 * p and p & (p - 1) == 0


@pytest.mark.parametrize("size", range(1, 34))
def test_fold_and_doubling_simulated(size):
    """Simulate fold-in, recursive doubling and fold-out on sets of
    contributions: every rank ends with every contribution exactly once."""
    roles = [pt.fold(r, size) for r in range(size)]
    pof2 = pt.pow2_floor(size)
    assert sum(role.newrank is not None for role in roles) == pof2
    have = [{r} for r in range(size)]
    for r, role in enumerate(roles):
        if role.newrank is None:
            partner = role.partner
            assert roles[partner].partner == r and roles[partner].newrank is not None
            assert partner == r + 1  # the lower rank's operand comes first
            have[partner] |= have[r]
    newranks = {role.newrank: r for r, role in enumerate(roles) if role.newrank is not None}
    assert sorted(newranks) == list(range(pof2))
    for nr, r in newranks.items():
        assert pt.real_rank(nr, roles[r].rem) == r
    peers = {nr: pt.doubling_peers(nr, pof2) for nr in newranks}
    for step in range(pof2.bit_length() - 1):
        before = {nr: set(have[newranks[nr]]) for nr in newranks}
        for nr in newranks:
            peer = peers[nr][step]
            assert peers[peer][step] == nr
            assert not (before[nr] & before[peer])
            have[newranks[nr]] = before[nr] | before[peer]
    for r, role in enumerate(roles):
        if role.newrank is None:
            have[r] = set(have[role.partner])
    assert all(h == set(range(size)) for h in have)


@pytest.mark.parametrize("pof2", [1, 2, 4, 8, 16])
def test_halving_steps(pof2):
    """Recursive halving (distance doubling) leaves each new rank exactly
    the block of its bit-reversed rank, and partners always split the same
    range between them."""
    steps = {nr: pt.halving_steps(nr, pof2) for nr in range(pof2)}
    for nr, mine in steps.items():
        assert len(mine) == pof2.bit_length() - 1
        lo, hi = 0, pof2
        for k, step in enumerate(mine):
            theirs = steps[step.peer][k]
            assert theirs.peer == nr
            assert theirs.keep == step.send and theirs.send == step.keep
            assert {step.keep, step.send} == {(lo, lo + (hi - lo) // 2), (lo + (hi - lo) // 2, hi)}
            lo, hi = step.keep
        bits = pof2.bit_length() - 1
        reversed_rank = int(format(nr, f"0{bits}b")[::-1], 2) if bits else 0
        assert (lo, hi) == (reversed_rank, reversed_rank + 1)


@pytest.mark.parametrize("segment_size", [1, 3, 100])
def test_exchange_pairs_cover_both_ranges(segment_size):
    """Per message: the slice sent, the slice kept (combined) and where the
    peer's copy of it lands; together they cover both ranges exactly once,
    an empty kept segment is received (so the peer's empty send matches)
    but not combined, and a side with no segments only sends or receives."""
    for sent_len, kept_len in [(0, 0), (0, 5), (5, 0), (7, 7), (7, 6), (1, 9)]:
        sent = pt.segments(pt.Block(10, sent_len), segment_size) if sent_len else []
        kept = pt.segments(pt.Block(30, kept_len), segment_size) if kept_len else []
        pairs = pt.exchange_pairs(sent, kept)
        assert len(pairs) == max(len(sent), len(kept))
        sent_idx = [i for s, _, _ in pairs if s is not None for i in range(s.start, s.stop)]
        kept_idx = [i for _, k, _ in pairs if k is not None for i in range(k.start, k.stop)]
        assert sent_idx == list(range(10, 10 + sent_len))
        assert kept_idx == list(range(30, 30 + kept_len))
        for _, k, into in pairs:
            if k is not None:
                assert into == slice(0, k.stop - k.start) and into.stop <= segment_size
    empty = pt.exchange_pairs(pt.segments(pt.Block(4, 0), 3), pt.segments(pt.Block(4, 0), 3))
    assert empty == [(slice(4, 4), None, slice(0, 0))]
