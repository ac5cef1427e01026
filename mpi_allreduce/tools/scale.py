"""Predicted time of every algorithm at scale: thousands of ranks, many nodes.

:func:`mpi_allreduce.simulate.simulate` times the schedules of all p ranks
message by message.  That is exact for the machine model but costs time and
memory in proportion to all messages sent (the ring sends 2p(p-1) of them),
so up to about a thousand ranks.  This module gives the same model's time in
closed form: per algorithm, the sum over its rounds on the critical path of

* ``o`` per message posted and ``o_op`` per local action (software),
* a message's time once both sides posted it, inside a node or across: the
  measured curve where the machine has one, else ``alpha + n beta``
  (``alpha_inter``, ``beta_inter`` across),
* ``n gamma`` per byte reduced or copied,
* one network port per node: when the q ranks of a node all send n bytes
  to other nodes in the same round (recursive doubling and Rabenseifner at
  distances of q and more), their bytes queue on it: ``q n beta_inter``.

Ranks are laid out in blocks of ``ranks_per_node`` (q) consecutive ranks
per node, each with a core of its own (the simulator's sharing of cores is
left out).  Each form follows its schedule builder (segments, folds, where
the reductions happen), and ``tests/test_scale_serial.py`` holds them
against the message-by-message simulation at every p from 2 to 64 and some
up to 1024, on one node and several: within 3% (13% for the pipelined ring
at uneven segments).  Where no form is exact the simulator answers instead:
the double binary tree always (two segments simulated, the rest
extrapolated), an algorithm with no form here (Swing, Bine, recursive
multiplying, k-nomial, the torus, allgather-then-reduce) up to
``SIMULATE_FORMLESS_UP_TO`` ranks and ``SIMULATE_FORMLESS_BYTES`` of the
simulator's memory and not above (no prediction there: ``-``), recursive
doubling and Rabenseifner across nodes when p is
not a power of two or q does not divide it (up to ``SIMULATE_UP_TO``
ranks).  ``naive`` across nodes is an estimate only (its longest chain or
the bytes leaving a node, whichever is longer).  The forms cost O(log p)
(the trees O(p)), so they reach p = 65536 in seconds; what the
simulations hold is known before any runs (:func:`memory_needed`).
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Optional

from .. import registry
from ..algorithms import hierarchical
from ..partition import real_rank
from ..simulate import Machine
from .bench import human

__all__ = ["ALGORITHMS", "CLOSED_FORMS", "seconds", "Links", "simulations", "memory_needed"]

#: every algorithm of the registry, in its order: each flat one has its
#: form in ``_FORMS``; hierarchical takes the best of the registry's
#: ``INNER_CANDIDATES`` among the node leaders
ALGORITHMS = registry.ALGORITHMS


#: recursive doubling and Rabenseifner across nodes with p not a power of
#: two (or nodes that do not divide p) are simulated up to this many ranks
SIMULATE_UP_TO = 4096
#: an algorithm without a closed form is simulated up to this many ranks
#: (and has no prediction above)
SIMULATE_FORMLESS_UP_TO = 1024
#: ... and where its simulation holds at most this many bytes
#: (:func:`~mpi_allreduce.simulate.footprint`; about a million actions,
#: seconds to simulate): with segments of 1 MiB, allgather_reduce passes
#: it from 2 MiB on 64 ranks, 256 KiB on 256 and 4 KiB on 1024 (its p^2 n /
#: segment pieces), swing_bandwidth from 4 KiB on 1024 (its blocks apart),
#: the latency-bound ones from 128 MiB on 1024
SIMULATE_FORMLESS_BYTES = 256_000_000


class Links:
    """The machine as the forms need it: software costs, the two links,
    gamma and the node size."""

    def __init__(self, prm: Machine, ranks_per_node: int, itemsize: int):
        self.prm = prm
        self.machine = prm.placed(None)  # its links: what a message costs
        self.o, self.o_op, self.w = prm.overhead, prm.op_overhead, itemsize
        self.g = prm.gamma * itemsize  # per element
        self.q = ranks_per_node

    def _key(self) -> tuple:
        return (self.prm, self.q, self.w)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other) -> bool:
        return isinstance(other, Links) and self._key() == other._key()

    def port(self, across: bool) -> float:
        """Seconds per element on the link (across: on the node's port)."""
        return self.machine.link(across)[1] * self.w

    def time(self, across: bool, elements: float) -> float:
        """Seconds of a message of ``elements`` once both sides posted it,
        as the simulator times it (the untouched-message curve)."""
        return self.machine.message_time(across, elements * self.w)

    def flat(self, p: int) -> bool:
        """Whether the slowest link among p ranks is across nodes."""
        return p > self.q


def _segments(length: int, s: int) -> int:
    return max(1, -(-length // s))


def seconds(algorithm: str, nbytes: int, p: int, prm: Machine, ranks_per_node: Optional[int] = None,
            segment_bytes: Optional[int] = None, itemsize: int = 4,
            inner: Optional[str] = None) -> float:
    """Predicted seconds of an ``nbytes`` all-reduce on ``p`` ranks,
    ``ranks_per_node`` to a node (default: all on one), segments of
    ``segment_bytes`` (default: none); NaN for an algorithm without a
    closed form above :data:`SIMULATE_FORMLESS_UP_TO` ranks."""
    count = nbytes // itemsize
    if p <= 1 or count <= 0:
        return 0.0
    q = min(ranks_per_node or p, p)
    s = max(1, (segment_bytes or (1 << 62)) // itemsize)
    m = Links(prm, q, itemsize)
    if algorithm == hierarchical.NAME:
        return prm.call_overhead + _hierarchical(m, p, count, s, inner)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of "
                         f"{', '.join(ALGORITHMS)}")
    form = _FORMS.get(algorithm)
    if form is None:  # (no closed form: the simulator's time, as far as it goes)
        return _simulated(algorithm, p, count, s, m) \
            if _formless_simulated(algorithm, p, count, s, itemsize) else math.nan
    if _misaligned(algorithm, p, q):
        return _simulated(algorithm, p, count, s, m)
    call = 0.0 if algorithm == "double_binary_tree" else prm.call_overhead  # simulated: has it
    return call + form(m, p, count, s)


def _misaligned(algorithm: str, p: int, q: int) -> bool:
    """Recursive doubling and Rabenseifner across nodes with p no power of
    two or nodes that do not divide it, up to :data:`SIMULATE_UP_TO` ranks:
    simulated instead of their form's estimate."""
    return (algorithm in ("recursive_doubling", "rabenseifner") and q < p
            and not _aligned(p, q) and p <= SIMULATE_UP_TO)


#: (algorithm, p, segment, itemsize) -> the fewest elements found whose
#: simulation passes :data:`SIMULATE_FORMLESS_BYTES` (more need no less)
_TOO_LONG: dict = {}


def _formless_simulated(algorithm: str, p: int, count: int, s: int, itemsize: int) -> bool:
    """Whether an algorithm without a form is simulated at this point: up
    to :data:`SIMULATE_FORMLESS_UP_TO` ranks, within
    :data:`SIMULATE_FORMLESS_BYTES`."""
    if p > SIMULATE_FORMLESS_UP_TO:
        return False
    key = (algorithm, p, s, itemsize)
    if count >= _TOO_LONG.get(key, count + 1):
        return False
    if _footprint_bytes(algorithm, p, count, s, itemsize) <= SIMULATE_FORMLESS_BYTES:
        return True
    _TOO_LONG[key] = min(count, _TOO_LONG.get(key, count))
    return False


@functools.lru_cache(maxsize=4096)
def _footprint_bytes(algorithm: str, p: int, count: int, s: int, itemsize: int) -> int:
    """Bytes the simulation of this point holds (timing only: no data)."""
    from ..simulate import footprint

    return footprint(algorithm, p, count, s).bytes(count, _DTYPES[itemsize], data=False)


def _tree_counts(c: int, s: int) -> tuple:
    """The counts the double binary tree is simulated at (its form)."""
    return (c,) if -(-c // 2) <= 2 * s else (2 * s, 4 * s)


def simulations(algorithm: str, nbytes: int, p: int, ranks_per_node: Optional[int] = None,
                segment_bytes: Optional[int] = None, itemsize: int = 4) -> list:
    """The simulations :func:`seconds` runs for this point (arguments as it
    takes them): ``(algorithm, p, count, segment)`` each."""
    count = nbytes // itemsize
    if p <= 1 or count <= 0 or algorithm == hierarchical.NAME:
        return []
    q = min(ranks_per_node or p, p)
    s = max(1, (segment_bytes or (1 << 62)) // itemsize)
    if algorithm == "double_binary_tree":
        return [(algorithm, p, n, s) for n in _tree_counts(count, s)]
    if (algorithm not in _FORMS and _formless_simulated(algorithm, p, count, s, itemsize)) \
            or _misaligned(algorithm, p, q):
        return [(algorithm, p, count, s)]
    return []


def memory_needed(ranks: list, sizes: list, ranks_per_node: int, segment_bytes: int,
                  algorithms=ALGORITHMS, itemsize: int = 4) -> int:
    """Bytes the simulations of :func:`table` hold at their peak (they run
    one at a time; the closed forms hold next to nothing), known before
    any runs: the largest :func:`~mpi_allreduce.simulate.footprint` among
    them."""
    return max((_footprint_bytes(name, n, count, s, itemsize)
                for p in ranks for size in sizes for algorithm in algorithms
                for name, n, count, s in simulations(algorithm, size, p, ranks_per_node,
                                                     segment_bytes, itemsize)), default=0)


def _ring(m: Links, p: int, c: int, s: int) -> float:
    """2(p-1) steps of S segment rounds on the block (the largest block);
    the rank before a node boundary pays the inter-node link every round."""
    block = -(-c // p)
    S = _segments(block, s)
    rounds = (p - 1) * S
    return (2 * rounds * (2 * m.o + m.time(m.flat(p), block / S))
            + rounds * m.o_op + (p - 1) * block * m.g)


def _ring_pipelined(m: Links, p: int, c: int, s: int) -> float:
    """The reduction of segment k runs while segment k+1 is on the wire;
    the allgather keeps two segments in flight (which share the port when
    they cross nodes, and the ranks' copying inside one)."""
    across = m.flat(p)
    block = -(-c // p)
    S = _segments(block, s)
    seg = block / S
    wire, local = m.time(across, seg), m.o_op + seg * m.g
    step_rs = 2 * m.o + wire + (S - 1) * (2 * m.o + max(local, wire)) + local
    pairs, single = divmod(S, 2)
    two = wire + seg * m.port(True) if across else 2 * wire  # a rank copies one at a time
    step_ag = pairs * (4 * m.o + two) + single * (2 * m.o + wire)
    return (p - 1) * (step_rs + step_ag)


@functools.lru_cache(maxsize=1024)
def _crossing(p: int, q: int, distance: int) -> tuple:
    """(any pair across nodes, most ranks of one node sending across) in
    the exchange at ``distance`` among the fold's new ranks (distance 0:
    the fold's pairs)."""
    P = _pof2(p)
    if P == p and p % q == 0 and not q & (q - 1):  # the common case, directly
        return (True, q) if distance >= q else (False, 1)
    rem = p - P
    pairs = ([(2 * i, 2 * i + 1) for i in range(rem)] if distance == 0 else
             [(real_rank(r, rem), real_rank(r ^ distance, rem)) for r in range(P)])
    senders = collections.Counter(x // q for x, y in pairs if x // q != y // q)
    return (bool(senders), max(senders.values(), default=1))


def _fold(m: Links, p: int, c: int, s: int) -> float:
    """Recursive doubling's fold for p not a power of two: the even rank of
    each of the first 2 rem pairs hands its vector in (segments), the odd
    one hands the result back (whole)."""
    if _pof2(p) == p:
        return 0.0
    across = _crossing(p, m.q, 0)[0]
    S = _segments(c, s)
    return S * (m.o + m.time(across, c / S) + m.o_op) + c * m.g + m.o + m.time(across, c)


def _pieces(c: int, s: int) -> list:
    """Segment lengths of ``c`` elements (as :func:`~..partition.segments`)."""
    whole, rest = divmod(c, s)
    return [s] * whole + ([rest] if rest or not whole else [])


def _steps(m: Links, p: int, parts: list) -> float:
    """Exchanges of ``parts`` (distance, elements, segment size, reduced?)
    in order, a segment a round, each segment reduced (if it is) at the
    start of the next round.

    With p a power of two and whole nodes, every node does the same, and
    the peer at a distance of q or more has this rank's place in its node:
    so the q ranks of one node stand for all, and their rounds are followed
    one by one, the bytes sent across nodes in one round queued on the
    node's port in the order the ranks post them.  Otherwise the ranks'
    steps differ: each step takes its slowest rank's time, an estimate
    (``seconds`` simulates such cases instead up to ``SIMULATE_UP_TO`` ranks)."""
    q = m.q
    if not _aligned(p, q):
        return sum(_step_bound(m, p, *part) for part in parts)
    clock = [0.0] * q
    pending = 0.0  # the reduction carried into the next round
    free = 0.0  # when the node's port is free
    for distance, c, s, reduce in parts:
        across = distance >= q
        b = m.port(across)
        for seg in _pieces(c, s):
            wire = m.time(across, seg)
            posted = [t + pending + 2 * m.o for t in clock]
            if across:  # the peer is this rank's twin: the same clock
                done = [0.0] * q
                for i in sorted(range(q), key=posted.__getitem__):
                    begin = max(posted[i], free)
                    free = begin + seg * b
                    done[i] = begin + wire
                clock = done
            else:
                clock = [max(posted[i], posted[i ^ distance]) + wire for i in range(q)]
            pending = (m.o_op + seg * m.g) if reduce and seg else 0.0
    return max(clock) + pending


def _aligned(p: int, q: int) -> bool:
    return _pof2(p) == p and p % q == 0 and not q & (q - 1)


def _step_bound(m: Links, p: int, distance: int, c: int, s: int, reduce: bool) -> float:
    across, share = _crossing(p, m.q, distance)
    b = m.port(across)
    S = _segments(c, s)
    seg = c / S
    local = (m.o_op + seg * m.g) if reduce else 0.0
    wire = m.time(across, seg)
    rank = 2 * m.o + wire + local
    return max(S * rank + (share - 1) * seg * b,
               S * share * seg * b + 2 * m.o + wire - seg * b + local)


def _pof2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _recursive_doubling(m: Links, p: int, c: int, s: int) -> float:
    P = _pof2(p)
    return _fold(m, p, c, s) + _steps(m, p, [(1 << k, c, s, True)
                                             for k in range(P.bit_length() - 1)])


def _rabenseifner(m: Links, p: int, c: int, s: int) -> float:
    """Halving by distance doubling on the largest range, then the
    allgather's one round a step back (no reduction: the same exchange
    with gamma and o_op left out)."""
    P = _pof2(p)
    whole, extra = divmod(c, P)  # blocks of ``whole`` elements, the first ``extra`` one more

    def largest(blocks: int) -> int:  # the most elements in ``blocks`` consecutive blocks
        return blocks * whole + min(blocks, extra)

    halves = [(1 << k, largest(P >> (k + 1))) for k in range(P.bit_length() - 1)]
    return _fold(m, p, c, s) + _steps(m, p, [(d, n, s, True) for d, n in halves]
                                      + [(d, n, max(n, 1), False) for d, n in halves[::-1]])


def _driver(m: Links, p: int, c: int, s: int) -> float:
    """The root takes every rank's vector a segment at a time, folding each
    in, then sends the result to each rank in turn."""
    S = _segments(c, s)
    total = (p - 1) * (S * (m.o + m.o_op) + c * m.g)
    for across, ranks in ((False, min(m.q, p) - 1), (True, p - min(m.q, p))):
        total += ranks * (S * m.time(across, c / S) + m.o + m.time(across, c))
    return total


def _naive(m: Links, p: int, c: int, s: int) -> float:
    """Rank a meets rank b (a < b) in its b-th and b's a-th exchange, so
    the pair (a, b) ends after a + b exchanges: 2p-3 of them on the longest
    chain; then p vectors are combined (and one copied) on every rank."""
    S = _segments(c, s)
    chain = (2 * p - 3) * S * (2 * m.o + m.time(m.flat(p), c / S))
    port = m.q * (p - m.q) * c * m.port(True) if p > m.q else 0.0  # every byte leaving a node
    return max(chain, port) + (p + 1) * (m.o_op + c * m.g)


def _tree(m: Links, p: int, c: int, s: int) -> float:
    """The root is the busiest rank: per segment it receives from and
    sends to each of its ceil(lg p) children (child 2^j across nodes when
    2^j >= q); the other ranks keep up with it."""
    S = _segments(c, s)
    total = 0.0
    for j in range((p - 1).bit_length()):
        total += S * (2 * m.o + 2 * m.time((1 << j) >= m.q, c / S) + m.o_op) + c * m.g
    return total


def _double_binary_tree(m: Links, p: int, c: int, s: int) -> float:
    """Simulated message by message (no closed form): a segment's time
    through the two trees is not set by one rank but by the hand-overs
    along the trees' depth.  Beyond two segments a half, each further
    segment adds what the second one added (the schedule repeats itself
    segment by segment; the simulator's times are linear in the segments
    from the second on), so at most two segments are simulated."""
    counts = _tree_counts(c, s)
    if len(counts) == 1:
        return _simulated("double_binary_tree", p, c, s, m)
    one, two = (_simulated("double_binary_tree", p, n, s, m) for n in counts)
    return one + (-(-c // 2) / s - 1) * (two - one)


@functools.lru_cache(maxsize=512)
def _simulated(algorithm: str, p: int, count: int, s: int, m: "Links") -> float:
    from ..simulate import simulate

    nodes = tuple(r // m.q for r in range(p)) if p > m.q else None
    return simulate(algorithm, p, count, _DTYPES[m.w], segment_size=s,
                    machine=m.prm.placed(nodes), data=False).seconds


#: the simulated elements' type for each size of element
_DTYPES = {1: "u1", 2: "u2", 4: "float32", 8: "float64"}


def _hierarchical(m: Links, p: int, c: int, s: int, inner: Optional[str]) -> float:
    """Ring reduce-scatter inside each node, blocks to the node's leader,
    the leaders' all-reduce across nodes (one rank a node: no port
    sharing), back to the members, ring allgather inside."""
    q = m.q
    block = -(-c // q)
    S = _segments(block, s)
    rounds = (q - 1) * S
    inside = (2 * rounds * (2 * m.o + m.time(False, block / S)) + rounds * m.o_op
              + (q - 1) * block * m.g + 2 * (q - 1) * (m.o + m.time(False, block)))
    nodes = -(-p // q)
    if nodes == 1:
        return inside if q > 1 else 0.0
    leaders = Links(m.prm, 1, m.w)  # one rank a node: every message across, no port shared
    names = (inner,) if inner else registry.INNER_CANDIDATES
    return inside + min(_FORMS[name](leaders, nodes, c, s) for name in names)


_FORMS = {"driver": _driver, "naive": _naive, "ring": _ring, "ring_pipelined": _ring_pipelined,
          "recursive_doubling": _recursive_doubling, "rabenseifner": _rabenseifner,
          "tree": _tree, "double_binary_tree": _double_binary_tree}

#: the algorithms with a closed form (the others are simulated, up to
#: :data:`SIMULATE_UP_TO` ranks)
CLOSED_FORMS = tuple(_FORMS)


def table(prm: Machine, ranks: list, sizes: list, ranks_per_node: int,
          segment_bytes: int, algorithms=ALGORITHMS) -> list:
    """Rows ``{"p", "size", "algorithm", "seconds"}`` for every point."""
    rows = []
    for p in ranks:
        for size in sizes:
            for name in algorithms:
                rows.append({"p": p, "size": size, "algorithm": name,
                             "seconds": seconds(name, size, p, prm, ranks_per_node,
                                                segment_bytes)})
    return rows


def best(rows: list) -> dict:
    """(p, size) -> (fastest algorithm, its seconds)."""
    out: dict = {}
    for row in rows:
        key = (row["p"], row["size"])
        if row["seconds"] > 0 and (key not in out or row["seconds"] < out[key][1]):
            out[key] = (row["algorithm"], row["seconds"])
    return out


def crossovers(winners: dict) -> dict:
    """p -> [(first size, algorithm)]: where the fastest algorithm (of
    :func:`best`) changes as the size grows."""
    out: dict = {}
    for (p, size), (name, _) in sorted(winners.items()):
        runs = out.setdefault(p, [])
        if not runs or runs[-1][1] != name:
            runs.append((size, name))
    return out


def report(prm: Machine, ranks: list, sizes: list, ranks_per_node: int, segment_bytes: int,
           png: Optional[str] = None, json_path: Optional[str] = None, header: str = "") -> None:
    """Print the predicted times (us) per p and size, the fastest marked,
    then the crossovers; optionally the PNG and the rows as JSON."""
    import json

    rows = table(prm, ranks, sizes, ranks_per_node, segment_bytes)
    winners = best(rows)
    by_point = {(r["p"], r["size"], r["algorithm"]): r["seconds"] for r in rows}
    names = list(ALGORITHMS)
    width = max(len(n) for n in names) + 1
    print(header.rstrip())
    print(f"# predicted time per all-reduce (us), {ranks_per_node} ranks a node, segments of "
          f"{human(segment_bytes)}; * the fastest")
    print(f"{'p':>6} {'size':>9} " + " ".join(f"{n[:width]:>{width}}" for n in names))
    for p in ranks:
        for size in sizes:
            cells = []
            for name in names:
                t = by_point[(p, size, name)] * 1e6
                mark = "*" if winners.get((p, size), ("",))[0] == name else " "
                cells.append(f"{'-' if math.isnan(t) else f'{t:.4g}':>{width - 1}}{mark}")
            print(f"{p:>6} {human(size):>9} " + " ".join(cells))
    print("# crossovers: the fastest algorithm from each size on")
    for p, runs in crossovers(winners).items():
        print(f"{p:>6}: " + "; ".join(f"{name} from {human(size)}" for size, name in runs))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"params": prm.parameters(), "ranks_per_node": ranks_per_node,
                       "segment_bytes": segment_bytes,
                       # (no prediction: null)
                       "rows": [dict(r, seconds=None) if math.isnan(r["seconds"]) else r
                                for r in rows]}, f, indent=1)
    if png:
        from .plot import plot_scale

        plot_scale(rows, winners, ALGORITHMS, png,
                   f"predicted all-reduce time, {ranks_per_node} ranks a node")
